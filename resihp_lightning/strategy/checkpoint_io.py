"""Checkpoint writing: Lightning's ``TorchCheckpointIO``, timed, optionally behind ``AsyncCheckpointIO``.

``TorchCheckpointIO`` already writes atomically (the bytes are serialised in memory, then written
through an fsspec transaction that moves a finished temporary file into place), so a process killed
mid-write never leaves a truncated ``.ckpt`` behind. :class:`TimedCheckpointIO` adds nothing to the
format; it records how long each write took (``writes``), which the restart benchmark reports.
``make_checkpoint_io(asynchronous=True)`` wraps it in Lightning's ``AsyncCheckpointIO``: the training
thread only clones the (already gathered, CPU) tensors and queues the write on one background
thread; ``Trainer`` teardown waits for the queue and re-raises a failed write.

Only rank 0 writes (``ResiHPStrategy`` gathers the layers to it); the plugin is the same object on
every rank.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO
from typing_extensions import override


@dataclass(frozen=True)
class WriteRecord:
    """One checkpoint write: the file, its size and the seconds ``torch.save`` + the move took."""

    path: str
    seconds: float
    bytes: int


class TimedCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that records each write in ``writes``, a list of :class:`WriteRecord` (on the thread that wrote it)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[WriteRecord] = []

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        start = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        seconds = time.perf_counter() - start
        try:
            size = os.path.getsize(path)
        except OSError:
            size = 0
        self.writes.append(WriteRecord(str(path), seconds, size))


def make_checkpoint_io(asynchronous: bool) -> TimedCheckpointIO | AsyncCheckpointIO:
    """The checkpoint IO plugin for ``Trainer(plugins=[...])``.

    Args:
        asynchronous: write on a background thread (``AsyncCheckpointIO``) instead of in the step.

    Returns:
        A :class:`TimedCheckpointIO`, wrapped in ``AsyncCheckpointIO`` when ``asynchronous``; the timed
        plugin is :func:`timed_io` of either.
    """
    timed = TimedCheckpointIO()
    return AsyncCheckpointIO(timed) if asynchronous else timed


def timed_io(plugin: Any) -> TimedCheckpointIO | None:
    """The :class:`TimedCheckpointIO` inside ``plugin`` (itself or the one an ``AsyncCheckpointIO`` wraps)."""
    while plugin is not None and not isinstance(plugin, TimedCheckpointIO):
        plugin = getattr(plugin, "checkpoint_io", None)
    return plugin
