"""A device left out for slowness is measured while it idles, and taken back when it heals.

Four real gloo processes, P = 1 x D = 4, ``fail_stop`` on (so a plan may leave a device idle as a hot
spare), ``StragglerDetector`` and ``ReplanController``. At ``LEAVE_AT`` every process marks rank 3 slow
in its detector (as a detection would: flagged at 0.05) and requests a plan without it, so rank 3 idles;
``FaultInjector`` slows rank 3 four-fold until ``HEAL_STEP``. Idle, rank 3 computes nothing the
detector could measure: it times the speed probe and shares the time, the members time theirs; once
the fault is over the probe clears it (``fail_slow_recovered``, source ``idle probe``) and the
controller's next plan takes it back. Without the probe it would idle to the end. (The detection and
the first re-plan around a slow rank are tested elsewhere; here they are set, so that the busy-time
noise of loaded cores cannot decide the outcome.)
"""

from __future__ import annotations

import pytest

WORLD, WIDTH, DEPTH, MBS, M = 4, 512, 2, 32, 16
SLOW_RANK, FACTOR, LEAVE_AT, HEAL_STEP, STEPS = 3, 4.0, 4, 10, 28


def _job(rank: int, world: int, log_dir: str) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.callbacks import FaultInjector, ReplanController, StragglerDetector
    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.plan import Plan, Replica
    from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.testing.toy_jobs import build_stack

    Stack = build_stack(WIDTH, DEPTH)
    gen = torch.Generator().manual_seed(1)
    rows = M * MBS * 4
    data = DataLoader(TensorDataset(torch.randn(rows, WIDTH, generator=gen), torch.randn(rows, WIDTH, generator=gen)),
                      batch_size=M * MBS, drop_last=True)

    detector = StragglerDetector(warmup_steps=1, fit_steps=2, patience=2, probe_interval_steps=1, log_dir=log_dir)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.idle: list[bool] = []
            self.devices: list[list[int]] = []

        def on_train_batch_end(self, trainer, *args):
            strategy = trainer.strategy
            self.idle.append(bool(strategy.is_spare))
            self.devices.append(sorted(strategy.current_plan.device_ids))
            if trainer.global_step == LEAVE_AT:  # every process, at the same step
                detector.core.reseat(SLOW_RANK, speed=0.05)
                healthy = [d for d in range(world) if d != SLOW_RANK]
                bounds = strategy.current_plan.replicas[0].bounds
                shares = [M // len(healthy) + (i < M % len(healthy)) for i in range(len(healthy))]
                strategy.request_plan(Plan(tuple(Replica((d,), bounds, m) for d, m in zip(healthy, shares))))

    record = Record()
    callbacks = [
        FaultInjector([{"kind": "slow", "rank": SLOW_RANK, "factor": FACTOR, "start_step": LEAVE_AT,
                        "end_step": HEAL_STEP}], log_dir=log_dir),
        detector,
        ReplanController({"migration_overhead_s": 0.05}, planner={"solver": "exact", "pipeline_degrees": (1,)}),
        record,
    ]
    strategy = ResiHPStrategy(pipeline_degree=1, micro_batch_size=MBS, fail_stop=FailStopConfig(detect_timeout_s=3.0))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=log_dir)
    trainer.fit(Stack(), data)
    return {"idle": record.idle, "devices": record.devices}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_spare_left_out_for_slowness_is_probed_while_idle_and_taken_back_when_it_heals(distributed, tmp_path):
    from resihp_lightning.callbacks import read_events

    results = distributed(_job, WORLD, timeout=280, log_dir=str(tmp_path))
    events = read_events(tmp_path)
    story = [(e["step"], e["event"], e.get("rank"), e.get("speed"), e.get("source"),
              sorted(d for r in e["plan"]["replicas"] for d in r["devices"]) if e["event"] == "plan_applied" else None)
             for e in events if e["event"] in ("fail_slow_detected", "fail_slow_recovered", "plan_applied")]
    devices = results[0]["devices"]
    assert all(r["devices"] == devices for r in results)  # every process ran the same plans
    left_out = [step for step, d in enumerate(devices) if SLOW_RANK not in d]
    assert left_out and left_out[0] == LEAVE_AT, devices
    assert any(results[SLOW_RANK]["idle"]), "the left-out rank idled as a spare"
    healed = [e for e in events if e["event"] == "fail_slow_recovered" and e.get("source") == "idle probe"]
    assert healed and healed[0]["rank"] == SLOW_RANK and healed[0]["step"] >= HEAL_STEP, story
    back = [step for step, d in enumerate(devices) if step > left_out[0] and SLOW_RANK in d]
    assert back and back[0] >= healed[0]["step"], (devices, story)
    assert all(SLOW_RANK in d for d in devices[back[0]:]), devices
