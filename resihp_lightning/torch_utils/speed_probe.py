"""A fixed piece of compute that every process times the same way: speeds comparable without a workload model.

The detector's speeds come from each device's own workload model, fitted on its own steps; a device
whose model was fitted while it was slow, on layers no other device holds, has nothing to be compared
with when it heals. A probe is the same work on every process (two matrix products of a fixed size,
in the device's dtype, from fixed values: no random numbers are drawn, so the job's random streams do
not move), timed at a step boundary: a process's probe speed is the median probe time over the
processes divided by its own. Processes that share a machine probe in turns (:func:`probe_in_turns`):
on shared CPU cores, processes probing at once would time each other's load (measured: 3-10x
between healthy processes on 2 loaded cores), and a device that sleeps to play slow would lend its
core to the others.

:data:`PROBE` is this process's probe. A throttled device runs all of its compute slower, the probe
included: :class:`~resihp_lightning.callbacks.faults.fault_injector.FaultInjector` slows
``PROBE.work`` on the rank it slows (:meth:`SpeedProbe.wrap`).
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist

from resihp_lightning.torch_utils.collectives import all_gather_objects

#: Rows and columns of the probe's matrices: about 3 ms of one CPU core's work (long enough for a shared
#: core's scheduling noise), well under a millisecond on a GPU.
PROBE_SIZE = 384


def _work(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) @ w.t()


class SpeedProbe:
    """Times the probe's work on this process (see the module docstring).

    Args:
        size: the matrices' rows and columns.
        repeats: runs per measurement; the fastest counts (load only adds time).
    """

    def __init__(self, size: int = PROBE_SIZE, repeats: int = 3) -> None:
        self.size = size
        self.repeats = repeats
        #: The work that is timed; a fault injector may wrap it (:meth:`wrap`).
        self.work: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _work

    def wrap(self, wrapper: Callable[[Callable], Callable]) -> Callable[[], None]:
        """Replaces :attr:`work` by ``wrapper(work)``; returns what puts the previous work back."""
        previous = self.work
        self.work = wrapper(previous)

        def restore() -> None:
            self.work = previous

        return restore

    def measure_ms(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> float:
        """The fastest of ``repeats`` timed runs, in milliseconds (no gradients, no random numbers)."""
        device = torch.device(device)
        n = self.size
        x = torch.linspace(-1.0, 1.0, n * n, device=device, dtype=dtype).reshape(n, n)
        w = torch.linspace(1.0, -1.0, n * n, device=device, dtype=dtype).reshape(n, n) / n
        best = float("inf")
        with torch.no_grad():
            for _ in range(self.repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                started = time.perf_counter()
                self.work(x, w)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best = min(best, (time.perf_counter() - started) * 1000.0)
        return best


#: This process's probe.
PROBE = SpeedProbe()


def relative_speeds(times_ms: dict[int, float]) -> dict[int, float]:
    """Each key's probe speed: the median probe time over all keys divided by its own (1.0 = typical)."""
    values = sorted(times_ms.values())
    if not values:
        return {}
    middle = len(values) // 2
    median = values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
    return {key: median / max(ms, 1e-9) for key, ms in times_ms.items()}


def probe_in_turns(process: int, device: torch.device | str = "cpu") -> dict[int, float]:
    """Every process's :data:`PROBE` time in ms, by process id (collective over the default group).

    The processes of one machine take turns (a barrier between turns); turn t runs the t-th process of
    every machine at once, so a round takes as many turns as the busiest machine has processes.

    Args:
        process: this process's id (its rank at the start).
        device: where to run the probe (the process's device).
    """
    host = socket.gethostname()
    hosts = all_gather_objects((process, host))
    turn = sorted(p for p, h in hosts if h == host).index(process)
    turns = max(Counter(h for _, h in hosts).values())
    mine = float("nan")
    for index in range(turns):
        if index == turn:
            mine = PROBE.measure_ms(device)
        dist.barrier()
    return dict(all_gather_objects((process, mine)))
