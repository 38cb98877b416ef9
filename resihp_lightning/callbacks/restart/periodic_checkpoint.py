"""Periodic checkpoints with Lightning's own ``ModelCheckpoint``: every N steps or minutes, the last K kept.

:class:`CheckpointConfig` is the YAML-friendly description (the ``checkpoint:`` section of
``examples/finetune.py``); :func:`periodic_checkpoint` turns it into a ``ModelCheckpoint`` with
``every_n_train_steps`` or ``train_time_interval``, and keeps the last K by monitoring the global
step (``monitor="step", mode="max", save_top_k=K``, the way Lightning's documentation keeps the
latest K). Files are ``<dirpath>/step<00000020>.ckpt``; :func:`newest_checkpoint` finds the newest
one to resume from. ``save_last`` is not used: with asynchronous writes, ``last.ckpt`` (a second
copy, or a link) could name a file whose write had not finished when the job died; the newest
finished ``step*.ckpt`` is the same checkpoint without that window.

A checkpoint holds everything a restart needs: the model under its own keys and the optimizer state
keyed by layer (``ResiHPStrategy``, any plan and world size), the loops (global step, epoch, the
position of a :class:`~resihp_lightning.data.resumable.ResumableDataLoader`), every callback's
``state_dict`` (the detector, the controller, :class:`~.elastic_restart.ElasticRestart`'s layer costs and
speeds) and this callback's own list of kept files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from resihp_lightning.errors import ConfigError, invalid_option

#: Steps between checkpoints when neither ``every_n_steps`` nor ``every_n_minutes`` is set.
DEFAULT_EVERY_N_STEPS = 50
#: ``ModelCheckpoint.filename`` of periodic checkpoints (``auto_insert_metric_name=False``).
FILENAME = "step{step:08d}"
_NAME = re.compile(r"^step(\d+)\.ckpt$")


@dataclass
class CheckpointConfig:
    """When and where periodic checkpoints are written, and how many are kept.

    Attributes:
        dirpath: the checkpoint directory (``null``: ``<run_dir>/checkpoints`` in the example).
            Several machines need a directory they all see (rank 0 writes, every rank reads on resume).
        every_n_steps: write after every N-th training step (``ModelCheckpoint(every_n_train_steps=N)``);
            ``null`` with ``every_n_minutes`` also ``null``: every 50 steps.
        every_n_minutes: write when this many minutes passed since the last one instead
            (``train_time_interval``; rank 0's clock decides, for every rank). At most one of the two.
        keep_last: how many of the newest checkpoints are kept (older ones are deleted).
        asynchronous: write on a background thread (Lightning's ``AsyncCheckpointIO``): the step pays
            only for gathering the layers and cloning them; ``false`` writes inside the step.
        resume: start from the newest checkpoint in ``dirpath`` when there is one (a restarted job).
    """

    dirpath: str | None = None
    every_n_steps: int | None = None
    every_n_minutes: float | None = None
    keep_last: int = 2
    asynchronous: bool = True
    resume: bool = True

    def __post_init__(self) -> None:
        if self.every_n_steps is not None and (not isinstance(self.every_n_steps, int) or self.every_n_steps < 1):
            raise invalid_option("checkpoint.every_n_steps", self.every_n_steps, "an integer >= 1 or null")
        if self.every_n_minutes is not None and not (isinstance(self.every_n_minutes, (int, float)) and self.every_n_minutes > 0):
            raise invalid_option("checkpoint.every_n_minutes", self.every_n_minutes, "a number > 0 or null")
        if self.every_n_steps is not None and self.every_n_minutes is not None:
            raise ConfigError(
                "set at most one of checkpoint.every_n_steps and checkpoint.every_n_minutes (got "
                f"{self.every_n_steps!r} and {self.every_n_minutes!r}); set the other to null"
            )
        if self.every_n_steps is None and self.every_n_minutes is None:
            self.every_n_steps = DEFAULT_EVERY_N_STEPS
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise invalid_option("checkpoint.keep_last", self.keep_last, "an integer >= 1")

    @classmethod
    def from_dict(cls, data: CheckpointConfig | dict[str, Any]) -> CheckpointConfig:
        """The config from itself or a mapping (YAML), refusing unknown keys by name."""
        from resihp_lightning.config import config_from_dict

        return config_from_dict(cls, data, "checkpoint")


def periodic_checkpoint(config: CheckpointConfig, dirpath: str | Path | None = None) -> Any:
    """Lightning's ``ModelCheckpoint`` for ``config``.

    Args:
        config: when to write and how many to keep.
        dirpath: the directory when ``config.dirpath`` is ``None``.

    Raises:
        ConfigError: neither ``config.dirpath`` nor ``dirpath`` is given.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    where = config.dirpath if config.dirpath is not None else dirpath
    if where is None:
        raise ConfigError("checkpoint.dirpath is not set and no run directory was given to put checkpoints in")
    interval = None if config.every_n_minutes is None else timedelta(minutes=config.every_n_minutes)
    return ModelCheckpoint(
        dirpath=str(where),
        filename=FILENAME,
        auto_insert_metric_name=False,
        monitor="step",
        mode="max",
        save_top_k=config.keep_last,
        every_n_train_steps=config.every_n_steps,
        train_time_interval=interval,
        save_last=False,
        save_on_train_epoch_end=False,
        enable_version_counter=False,
    )


def checkpoint_step(path: str | Path) -> int | None:
    """The global step in a periodic checkpoint's file name (``None`` for other files)."""
    match = _NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def newest_checkpoint(dirpath: str | Path) -> Path | None:
    """The periodic checkpoint with the highest step in ``dirpath`` (``None`` when there is none).

    Only finished files carry the ``.ckpt`` name (Lightning moves a completed write into place).
    """
    folder = Path(dirpath)
    if not folder.is_dir():
        return None
    found = [(step, path) for path in folder.iterdir() if (step := checkpoint_step(path)) is not None]
    return max(found)[1] if found else None
