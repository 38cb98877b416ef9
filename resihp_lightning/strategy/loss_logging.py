"""``self.log`` inside ``pipeline_loss``: recorded per micro-batch, reduced over the job, logged on every rank.

``pipeline_loss`` runs inside the pipeline engine, once per micro-batch and only on the last stage of
each replica, which usually does not include rank 0 (the rank whose logger writes). So the values
those calls log are recorded instead of being handed to Lightning, then averaged over every
micro-batch of the global batch (all replicas) and logged on every rank with the same value and the
caller's own options, exactly as ``sync_dist`` would average one value per process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class LossLogRecorder:
    """Records the ``self.log`` calls a LightningModule makes while a pipeline step runs."""

    def __init__(self) -> None:
        self._sums: dict[str, list[Any]] = {}

    @contextlib.contextmanager
    def recording(self, module: Any) -> Iterator[None]:
        """Within the block, ``module.log(name, value, **options)`` is recorded, not logged."""
        self._sums.clear()

        def record(name: str, value: Any, **options: Any) -> None:
            number = float(value.detach().float()) if isinstance(value, Tensor) else float(value)
            entry = self._sums.setdefault(name, [0.0, 0, options])
            entry[0] += number
            entry[1] += 1

        module.log = record  # an instance attribute shadows LightningModule.log for the step
        try:
            yield
        finally:
            del module.log

    def replay(self, module: Any, device: torch.device) -> dict[str, tuple[float, dict[str, Any]]]:
        """Logs each recorded name's mean over the global batch on every rank (collective).

        Every rank must join (only last stages know what was logged); a one-number all-reduce first
        keeps the common case, nothing logged, to that.

        Returns:
            name -> (the value logged, the caller's options), for a process that did not run the
            step to log the same (:meth:`log_values`).
        """
        anything = torch.tensor([len(self._sums)], dtype=torch.int64, device=device)
        dist.all_reduce(anything, op=dist.ReduceOp.MAX)
        if not int(anything.item()):
            return {}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self._sums)
        merged: dict[str, list[Any]] = {}
        for part in gathered:
            for name, (total, count, options) in part.items():
                entry = merged.setdefault(name, [0.0, 0, options])
                entry[0] += total
                entry[1] += count
        values = {name: (total / count, options) for name, (total, count, options) in sorted(merged.items())}
        self.log_values(module, values, device)
        self._sums.clear()
        return values

    @staticmethod
    def log_values(module: Any, values: dict[str, tuple[float, dict[str, Any]]], device: torch.device) -> None:
        """Logs ``values`` (from :meth:`replay`) with their options."""
        for name, (value, options) in values.items():
            module.log(name, torch.tensor(value, device=device), **options)
