"""``HeartbeatMonitor`` in a ``fail_stop`` job: it reports the strategy's detector and lets the job recover.

Real gloo processes under ``harness.run_job``; rank 2 is SIGKILLed as step 2 begins.
"""

from __future__ import annotations

import os
import signal

import pytest

from resihp_lightning.testing.toy_jobs import EPOCH_STEPS as STEPS
from resihp_lightning.testing.toy_jobs import M, MBS, build_class, make_data

VICTIM, AT_STEP = 2, 2


def _job(rank: int, world: int, run_dir: str) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.callbacks import HeartbeatMonitor
    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    monitor = HeartbeatMonitor(monitor="all")
    seen: dict = {}

    class Victim(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            heartbeat = monitor.heartbeat
            seen.update(borrowed=not heartbeat.owns_detector, same=heartbeat.detector is trainer.strategy.failure_detector)
            if trainer.strategy.device_id == VICTIM and trainer.global_step == AT_STEP:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_end(self, trainer, pl_module):
            seen.update(dead=sorted(monitor.dead), should_stop=trainer.should_stop)

    x, y = make_data()
    strategy = ResiHPStrategy(micro_batch_size=MBS, fail_stop=FailStopConfig(), pipeline_degree=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[Victim(), monitor], default_root_dir=run_dir,
    )
    trainer.fit(build_class()(), DataLoader(TensorDataset(x, y), batch_size=M * MBS))
    return {**seen, "steps": trainer.global_step, "recovered": strategy.last_recovery is not None}


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_the_monitor_reports_the_strategys_detector_and_the_job_recovers(tmp_path):
    from resihp_lightning.callbacks.events import read_events
    from resihp_lightning.testing.harness import run_job

    survivors = [0, 1, 3]
    outcome = run_job(_job, 4, timeout=180, wait_for=survivors, run_dir=str(tmp_path))
    values = outcome.values()
    assert sorted(values) == survivors, outcome.describe()
    for rank in survivors:
        result = values[rank]
        assert result["borrowed"] and result["same"], result  # no second heartbeat
        assert result["dead"] == [VICTIM] and not result["should_stop"], result  # reported, not acted on
        assert result["steps"] == STEPS and result["recovered"], result
    reported = [e for e in read_events(outcome.run_dir) if e["event"] == "fail_stop_detected"]
    assert len(reported) == len(survivors) and {e["rank"] for e in reported} == {VICTIM}, reported
    assert all(e["how"] and e["reporter"] != VICTIM for e in reported), reported
