"""Time a process spends inside its tensor-parallel all-reduces: the part of a split layer's time that is
waiting for the other members, not its own compute.

The members of a group finish every split layer together, so a slow member shows in everyone's layer
time. What tells the slow one apart is each member's own compute: its layer time minus its time in the
group's all-reduces (the slow member arrives last and waits least). The split layers
(:mod:`resihp_lightning.models.tensor_parallel`) run their all-reduces through :func:`timed_all_reduce`;
the runtime reads :data:`TENSOR_PARALLEL_WAIT` around each step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist


class WaitClock:
    """A running total of seconds spent in timed collectives (one per process)."""

    def __init__(self) -> None:
        self.total_s = 0.0

    def reading(self) -> float:
        """The total so far; a step's wait is the difference of two readings."""
        return self.total_s


#: This process's time in tensor-parallel all-reduces.
TENSOR_PARALLEL_WAIT = WaitClock()


def timed_all_reduce(tensor: torch.Tensor, group: Any, op: Any = None) -> None:
    """``torch.distributed.all_reduce`` over ``group``, its wall time added to :data:`TENSOR_PARALLEL_WAIT`
    (on CUDA the work is synchronised first, so that the time is the wait, not queued kernels)."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    started = time.perf_counter()
    if op is None:
        dist.all_reduce(tensor, group=group)
    else:
        dist.all_reduce(tensor, op=op, group=group)
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    TENSOR_PARALLEL_WAIT.total_s += time.perf_counter() - started
