"""``ResiHPStrategy(tensor_degree=2)`` on 4 gloo processes: a slow member slows its whole group.

A speed file (tests/timing_files.txt): the detector's view of a member's compute is measured from busy
time, which a neighbour on the other core would change.
"""

from __future__ import annotations

import pytest

from resihp_lightning.config import ScratchModelConfig
from resihp_lightning.testing.tensor_jobs import document_batches

SLOW_RANK, FACTOR, FAULT_STEP, SLOW_STEPS, M = 1, 4.0, 8, 20, 8


def _slow_job(rank: int, world: int, log_dir: str) -> dict:
    """2 groups as 1 x 2 (each group holds every layer); rank 1, member 1 of group 0, turns slow."""
    import warnings

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from resihp_lightning.callbacks import FaultInjector, ReplanController, StragglerDetector
    from resihp_lightning.callbacks.replan.replan_policy import ControllerConfig
    from resihp_lightning.config import PlannerConfig
    from resihp_lightning.models import CausalLMPipelineModule
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    warnings.filterwarnings("ignore")
    shape = ScratchModelConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=512)
    module = CausalLMPipelineModule(scratch=shape, seed=7, learning_rate=1e-3)
    detector = StragglerDetector(warmup_steps=2, fit_steps=4, window=3, patience=3, significance=1.5,
                                 gpu_individual_perf_threshold=0.75, gpu_relative_perf_threshold=0.6)
    callbacks = [
        FaultInjector([{"kind": "slow", "rank": SLOW_RANK, "factor": FACTOR, "start_step": FAULT_STEP}]),
        detector,
        # Groups stay as they are (tests/tensor/test_tensor_regroup.py drops the member instead).
        ReplanController(ControllerConfig(migration_overhead_s=0.1, tensor_regroup=False),
                         planner=PlannerConfig(solver="exact", pipeline_degrees=(1,))),
    ]
    strategy = ResiHPStrategy(tensor_degree=2, pipeline_degree=1, micro_batch_size=2, micro_batches=M)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=SLOW_STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         use_distributed_sampler=False, callbacks=callbacks, default_root_dir=log_dir)
    trainer.fit(module, DataLoader(document_batches(SLOW_STEPS, rows=2 * M, seq_len=64), batch_size=None))
    return {"plan": strategy.current_plan.to_dict(), "reports": strategy.reports_device}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_slow_member_slows_its_group_which_is_detected_and_planned_around(distributed, tmp_path):
    """The detector sees one device per group (its first member reports; the slow member 1 makes member 0
    wait inside every layer) and names the slow member, and the controller, told to keep the groups
    (``tensor_regroup=False``), gives that group fewer micro-batches."""
    from resihp_lightning.callbacks import read_events

    results = distributed(_slow_job, 4, timeout=280, log_dir=str(tmp_path))
    assert [r["reports"] for r in results] == [True, False, True, False]
    events = read_events(tmp_path)
    of = {name: [e for e in events if e["event"] == name] for name in {e["event"] for e in events}}
    assert [(e["rank"], e["step"]) for e in of.get("fault_injected", [])] == [(SLOW_RANK, FAULT_STEP)]
    detected = of.get("fail_slow_detected", [])
    assert detected and {e["rank"] for e in detected} == {0}, events  # group 0, the slow member's
    assert detected[0]["step"] >= FAULT_STEP
    # Each member's own compute (its busy time minus its wait in the group's all-reduces) names the member.
    named = of.get("fail_slow_member_detected", [])
    assert named and {(e["rank"], e["group"]) for e in named} == {(SLOW_RANK, 0)}, events
    assert named[0]["step"] >= FAULT_STEP and named[0]["speed"] < 0.6
    applied = of.get("plan_applied", [])
    assert applied, events
    for event in applied:
        counts = {r["devices"][0]: r["micro_batches"] for r in event["plan"]["replicas"]}
        assert sum(counts.values()) == M and counts[0] < counts[1], counts
