"""A slow link on 4 real gloo processes: probed, named, priced and planned around.

``Trainer.fit`` under a 2 x 2 plan with ``FaultInjector`` slowing rank 2's links (every send of its
pipeline, its all-reduces and its link probes wait ``DELAY_MS``) from step ``FAULT_STEP``; the
detector probes the links every 2 steps. The checks: the link is named (rank 2 and no other link),
the planner's problem carries the measured round trip and
all-reduce and rank 2's link speed, and every plan applied gives the replica with the slow link fewer
micro-batches than the other (or takes rank 2 out of the pipeline's boundaries). A second test kills
another rank afterwards: the recovery plans the survivors with the known slow link.
"""

from __future__ import annotations

import pytest
import torch

from resihp_lightning.testing.toy_jobs import build_stack

WORLD, WIDTH, DEPTH, MBS, M = 4, 128, 8, 8, 8
SLOW_RANK, DELAY_MS = 2, 25.0
FAULT_STEP, STEPS = 4, 16


def _rank(rank: int, world: int, log_dir: str) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.callbacks import FaultInjector, ReplanController, StragglerDetector
    from resihp_lightning.callbacks.replan.replan_policy import ControllerConfig
    from resihp_lightning.config import PlannerConfig
    from resihp_lightning.plan import Plan
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    detector = StragglerDetector(warmup_steps=1, fit_steps=3, link_probe_interval_steps=2, link_patience=2,
                                 link_window=1, link_min_extra_ms=5.0)  # 2 shared cores: ms-sized spikes
    callbacks = [
        FaultInjector([{"kind": "slow_link", "rank": SLOW_RANK, "delay_ms": DELAY_MS, "start_step": FAULT_STEP}]),
        detector,
        # min_relative_gain 0: this test checks where the planner routes, not the hysteresis. With every
        # 2 x 2 plan using rank 2, all pay its all-reduce, priced at the link's measured slowdown; when the
        # probe reads the link very slow (0.006) that common term shrinks the relative gain below 5%.
        ReplanController(ControllerConfig(migration_overhead_s=0.1, cooldown_steps=0, min_relative_gain=0.0),
                         planner=PlannerConfig(solver="exact", pipeline_degrees=(2,))),
    ]
    plan = Plan.from_dict({"replicas": [{"devices": [0, 1], "bounds": [0, 4, 8], "micro_batches": 4},
                                        {"devices": [2, 3], "bounds": [0, 4, 8], "micro_batches": 4}]})
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ResiHPStrategy(plan=plan, micro_batch_size=MBS),
                         max_steps=STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=log_dir)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M * MBS * STEPS, WIDTH, generator=gen)
    data = DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=M * MBS, drop_last=True)
    trainer.fit(build_stack(WIDTH, DEPTH)(), data)
    return {"links": detector.links.estimates, "p2p_ms": detector.p2p_ms}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_slow_link_is_named_and_planned_around(distributed, tmp_path):
    from resihp_lightning.callbacks import read_events

    results = distributed(_rank, WORLD, timeout=220, log_dir=str(tmp_path))
    events = read_events(tmp_path)
    of = {name: [e for e in events if e["event"] == name] for name in {e["event"] for e in events}}

    detected = of.get("slow_link_detected", [])
    assert detected, f"no slow link named; estimates {results[0]['links']}; events {events}"
    assert {e["rank"] for e in detected} == {SLOW_RANK} and detected[0]["step"] >= FAULT_STEP, detected
    assert detected[0]["link_speed"] < 0.5, detected
    # Not checked: that rank 2's compute is not also flagged. It is not slowed, but on 4 processes sharing
    # 2 cores a rank that sleeps in its sends leaves CPU to the other replica, whose compute then runs
    # faster, so rank 2's speed relative to the fleet can read 0.6-0.7 (seen under load).

    computed = [e for e in of.get("plan_computed", []) if e.get("link_speeds")]
    assert computed, f"no plan computed for the slow link; events {events}"
    first = computed[0]
    assert set(first["link_speeds"]) == {str(SLOW_RANK)} or set(first["link_speeds"]) == {SLOW_RANK}, first
    assert 0 < first["p2p_ms"] < DELAY_MS, first  # measured on the healthy links
    assert first["allreduce_ms"] > 0, first

    # The healthy reference (the planner's best plan for these devices all healthy, priced with the plan
    # in force on the same problem) is logged once, with the first profile: the optimum is never slower.
    references = of.get("healthy_reference", [])
    assert len(references) == 1, references
    assert 0 < references[0]["predicted_ms"] <= references[0]["current_ms"] * (1 + 1e-9), references

    applied = of.get("plan_applied", [])
    assert applied, f"the planner did not route around the slow link; events {events}"
    for event in applied:
        replicas = event["plan"]["replicas"]
        with_slow = [r for r in replicas if SLOW_RANK in r["devices"]]
        others = [r for r in replicas if SLOW_RANK not in r["devices"]]
        slow_replica = with_slow[0]
        assert len(slow_replica["devices"]) == 1 or slow_replica["micro_batches"] < min(r["micro_batches"] for r in others), replicas
    print(f"\nslow link named at step {detected[0]['step']} (link speed {detected[0]['link_speed']}); measured p2p "
          f"{first['p2p_ms']:.2f} ms, all-reduce {first['allreduce_ms']:.2f} ms; applied "
          f"{[(e['step'], e['plan']['replicas']) for e in applied]}; rejected {of.get('plan_rejected', [])}")


KILL_STEP = 12


def _survivors_rank(rank: int, world: int, run_dir: str) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.callbacks import FaultInjector, ReplanController, StragglerDetector
    from resihp_lightning.callbacks.replan.replan_policy import ControllerConfig
    from resihp_lightning.config import PlannerConfig
    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    detector = StragglerDetector(warmup_steps=1, fit_steps=3, link_probe_interval_steps=2, link_patience=2,
                                 link_window=1, link_min_extra_ms=5.0)
    callbacks = [
        FaultInjector([{"kind": "slow_link", "rank": SLOW_RANK, "delay_ms": DELAY_MS, "start_step": FAULT_STEP},
                       {"kind": "kill", "rank": 3, "start_step": KILL_STEP}]),
        detector,
        # Plans with two replicas or more (P in 1, 2 and no idle devices on 4): with one replica any death
        # loses layers, and the job can only restart from a checkpoint.
        ReplanController(ControllerConfig(migration_overhead_s=0.1, cooldown_steps=2),
                         planner=PlannerConfig(solver="exact", allow_exclude=False, pipeline_degrees=(1, 2))),
    ]
    strategy = ResiHPStrategy(pipeline_degree=2, micro_batch_size=MBS, fail_stop=FailStopConfig())
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS + 6, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=run_dir)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M * MBS * (STEPS + 6), WIDTH, generator=gen)
    trainer.fit(build_stack(WIDTH, DEPTH)(), DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=M * MBS, drop_last=True))
    recovery = strategy.last_recovery
    return {"recovered_at": None if recovery is None else recovery.step, "plan": strategy.current_plan.to_dict(),
            "members": None if recovery is None else sorted(recovery.members + recovery.spares),
            "recovery_plan": None if recovery is None else recovery.plan.to_dict(),
            "link_speeds": None if recovery is None else dict(recovery.conditions.link_speeds)}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_after_a_lost_rank_the_survivors_are_planned_with_the_known_slow_link(tmp_path):
    """The controller hands the strategy the conditions it plans with at every step, so the recovery's own
    plan for the survivors already prices rank 2's slow link (no healthy plan first, corrected later)."""
    from resihp_lightning.testing.harness import run_job

    from resihp_lightning.callbacks import read_events

    outcome = run_job(_survivors_rank, 4, timeout=220, wait_for=[0, 1, 2], run_dir=str(tmp_path))
    values = outcome.values()
    assert sorted(values) == [0, 1, 2], outcome.describe()
    recovered_at = values[0]["recovered_at"]
    assert recovered_at == KILL_STEP and values[0]["members"] == [0, 1, 2], values[0]
    events = read_events(tmp_path)
    detected = [e for e in events if e["event"] == "slow_link_detected"]
    assert detected and detected[0]["rank"] == SLOW_RANK and detected[0]["step"] < KILL_STEP, detected
    link_speeds = {int(k): v for k, v in values[0]["link_speeds"].items()}
    assert set(link_speeds) == {SLOW_RANK} and link_speeds[SLOW_RANK] < 0.5, values[0]
    replicas = values[0]["recovery_plan"]["replicas"]
    assert set(d for r in replicas for d in r["devices"]) <= {0, 1, 2}, replicas
    # Routed around: rank 2 idle (a hot spare), or its replica runs fewer micro-batches than every other one.
    with_slow = [r for r in replicas if SLOW_RANK in r["devices"]]
    others = [r for r in replicas if SLOW_RANK not in r["devices"]]
    assert not with_slow or with_slow[0]["micro_batches"] < min(r["micro_batches"] for r in others), replicas
