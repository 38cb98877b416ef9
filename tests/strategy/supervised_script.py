"""A user's script for the launcher tests: ``python supervised_script.py RUN_DIR STEPS``.

Four CPU processes under Lightning's own launcher with ``fail_stop`` on, the exactness job of
``resihp_lightning/testing/toy_jobs.py`` as 2 stages x 2 replicas. Every rank prints
``rank <launch rank> pid <pid> step <global step>`` after each step and ``rank <r> finished <n> steps``
at the end, so that a test can kill a rank from outside mid-run and see who trained on.
"""

from __future__ import annotations

import os
import sys
import time

import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

from resihp_lightning.callbacks import FailStopReporter
from resihp_lightning.failstop.fail_stop_config import FailStopConfig
from resihp_lightning.strategy.strategy import ResiHPStrategy
from resihp_lightning.testing.toy_jobs import M, MBS, build_class, make_data


def _say(line: str) -> None:
    """One line in one ``write``: the ranks share the command's stdout, so their lines do not interleave."""
    os.write(1, f"{line}\n".encode())


class StepPrinter(pl.Callback):
    """Prints each step on this rank's stdout; ``pause_s`` per step leaves a test time to act mid-run."""

    def __init__(self, pause_s: float) -> None:
        self.pause_s = pause_s
        self.rank = os.environ.get("LOCAL_RANK", "?")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _say(f"rank {self.rank} pid {os.getpid()} step {trainer.global_step}")
        time.sleep(self.pause_s)

    def on_train_end(self, trainer, pl_module):
        _say(f"rank {self.rank} finished {trainer.global_step} steps on {trainer.world_size} processes")


def main(run_dir: str, steps: int) -> None:
    x, y = make_data()
    strategy = ResiHPStrategy(micro_batch_size=MBS, pipeline_degree=2, fail_stop=FailStopConfig())
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[StepPrinter(pause_s=0.3), FailStopReporter(log_dir=run_dir)], default_root_dir=run_dir,
    )
    trainer.fit(build_class()(), DataLoader(TensorDataset(x, y), batch_size=M * MBS))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
