"""A device left out for slowness is measured while it idles, and taken back when it heals.

Four real gloo processes, P = 1 x D = 4, ``fail_stop`` on (so a plan may leave a device idle as a hot
spare), ``FaultInjector`` slowing rank 3 twenty-fold from ``FAULT_STEP`` to ``HEAL_STEP``,
``StragglerDetector`` and ``ReplanController`` (the fault starts after the detector's warm-up and fit). The detector names rank 3; the controller's plan leaves it
idle (three replicas beat a fourth that takes twenty times as long for its share). Idle, rank 3 computes
nothing that the detector could measure: it times the speed probe and shares the time, the members time
theirs; once the fault is over, the probe clears it (``fail_slow_recovered``, source ``idle probe``) and
the next plan takes it back. Without the probe it would idle to the end.

The fault is strong and the model large enough for the busy time to dominate on loaded cores (see
tests/state/test_resume_e2e.py); the file runs with the speed files (tests/timing_files.txt).
"""

from __future__ import annotations

import pytest

WORLD, WIDTH, DEPTH, MBS, M = 4, 512, 2, 32, 16
SLOW_RANK, FACTOR, FAULT_STEP, HEAL_STEP, STEPS = 3, 20.0, 3, 14, 34


def _job(rank: int, world: int, log_dir: str) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.callbacks import FaultInjector, ReplanController, StragglerDetector
    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.testing.toy_jobs import build_stack

    Stack = build_stack(WIDTH, DEPTH)
    gen = torch.Generator().manual_seed(1)
    rows = M * MBS * 4
    data = DataLoader(TensorDataset(torch.randn(rows, WIDTH, generator=gen), torch.randn(rows, WIDTH, generator=gen)),
                      batch_size=M * MBS, drop_last=True)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.idle: list[bool] = []
            self.devices: list[list[int]] = []

        def on_train_batch_end(self, trainer, *args):
            self.idle.append(bool(trainer.strategy.is_spare))
            self.devices.append(sorted(trainer.strategy.current_plan.device_ids))

    record = Record()
    callbacks = [
        FaultInjector([{"kind": "slow", "rank": SLOW_RANK, "factor": FACTOR, "start_step": FAULT_STEP,
                        "end_step": HEAL_STEP}], log_dir=log_dir),
        StragglerDetector(warmup_steps=1, fit_steps=2, patience=2, significance=0.5, gpu_individual_perf_threshold=0.6,
                          gpu_relative_perf_threshold=0.5, probe_interval_steps=1, log_dir=log_dir),
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
    # (On loaded cores a healthy rank may be named now and then too: not what is tested here.)
    detected = [e for e in events if e["event"] == "fail_slow_detected" and e["rank"] == SLOW_RANK]
    assert detected and FAULT_STEP <= detected[0]["step"] < HEAL_STEP, events
    devices = results[0]["devices"]
    assert all(r["devices"] == devices for r in results)  # every process ran the same plans
    left_out = [step for step, d in enumerate(devices) if SLOW_RANK not in d]
    assert left_out and left_out[0] < HEAL_STEP, devices
    assert any(results[SLOW_RANK]["idle"]), "the left-out rank idled as a spare"
    healed = [e for e in events if e["event"] == "fail_slow_recovered" and e.get("source") == "idle probe"]
    assert healed and healed[0]["rank"] == SLOW_RANK and healed[0]["step"] >= HEAL_STEP, events
    back = [step for step, d in enumerate(devices) if step > left_out[0] and SLOW_RANK in d]
    assert back and back[0] > healed[0]["step"] - 1, devices
    assert all(SLOW_RANK in d for d in devices[back[0]:]), devices
