"""Busy compute time per micro-batch and per layer, measured on this rank.

Step wall time cannot localise a slow device in a synchronous pipeline (every rank waits for the
slowest), so the profiler times only this rank's own work: the engine's forward and backward
instructions (one per micro-batch each, in micro-batch order under 1F1B) and, through forward
hooks, each local layer's share of the forward pass. A layer's forward + backward cost is its
forward share of the stage's measured forward + backward time.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict, deque
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


class _Clock:
    """Wall-clock marks on CPU; CUDA events (resolved at step end) on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start: Any, stop: Any) -> float:
        if self.cuda:
            return float(start.elapsed_time(stop))
        return (stop - start) * 1000.0

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


class StageProfiler:
    """Times one engine's stage; re-attached after every engine rebuild.

    Args:
        device: where the stage runs.
        window: how many recorded steps the per-layer estimate keeps (median over them).
    """

    def __init__(self, device: torch.device, window: int = 20) -> None:
        self._clock = _Clock(device)
        self._handles: list[Any] = []
        self._engine: Any = None
        self._forward: list[tuple[Any, Any]] = []
        self._backward: list[tuple[Any, Any]] = []
        self._layer_marks: dict[int, list[tuple[Any, Any]]] = defaultdict(list)
        self._open: dict[int, Any] = {}
        self.activation_bytes: dict[int, int] = {}
        self._layer_history: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=window))
        #: Whether finished steps feed the per-layer estimate (a controller may pause it while a
        #: device is known to be slow, so that ``layer_profile`` keeps healthy costs).
        self.record_layers = True

    # ----------------------------------------------------------------------------- wiring
    def attach(self, engine: Any, layers: Mapping[int, nn.Module]) -> None:
        """Wraps ``engine``'s forward/backward instructions and hooks ``layers``."""
        from deepspeed.runtime.pipe import schedule

        self.detach()
        self._engine = engine
        table = dict(type(engine)._INSTRUCTION_MAP)
        forward, backward = table[schedule.ForwardPass], table[schedule.BackwardPass]
        clock, fwd_marks, bwd_marks = self._clock, self._forward, self._backward

        def timed_forward(eng: Any, **kwargs: Any) -> Any:
            start = clock.mark()
            result = forward(eng, **kwargs)
            fwd_marks.append((start, clock.mark()))
            return result

        def timed_backward(eng: Any, **kwargs: Any) -> Any:
            start = clock.mark()
            result = backward(eng, **kwargs)
            bwd_marks.append((start, clock.mark()))
            return result

        table[schedule.ForwardPass] = timed_forward
        table[schedule.BackwardPass] = timed_backward
        engine._INSTRUCTION_MAP = table  # the instance attribute shadows the class table
        for index, layer in layers.items():
            self._handles.append(layer.register_forward_pre_hook(self._pre_hook(index)))
            self._handles.append(layer.register_forward_hook(self._post_hook(index)))

    def detach(self) -> None:
        """Removes the hooks; measured history is kept (layers keep their costs across re-plans)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._engine is not None and "_INSTRUCTION_MAP" in vars(self._engine):
            del self._engine._INSTRUCTION_MAP
        self._engine = None

    def _pre_hook(self, index: int):
        def hook(module: nn.Module, args: Any) -> None:
            if module.training and torch.is_grad_enabled():
                self._open[index] = self._clock.mark()

        return hook

    def _post_hook(self, index: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            start = self._open.pop(index, None)
            if start is not None:
                self._layer_marks[index].append((start, self._clock.mark()))
                self.activation_bytes[index] = _nbytes(output)

        return hook

    # ------------------------------------------------------------------------------- steps
    def begin_step(self) -> None:
        self._forward.clear()
        self._backward.clear()
        self._layer_marks.clear()
        self._open.clear()

    def end_step(self) -> list[float]:
        """Finishes a training step; returns busy ms (forward + backward) per micro-batch."""
        self._clock.settle()
        ms = self._clock.elapsed_ms
        forward = [ms(a, b) for a, b in self._forward]
        backward = [ms(a, b) for a, b in self._backward]
        per_micro = [f + (backward[i] if i < len(backward) else 0.0) for i, f in enumerate(forward)]
        if self.record_layers and per_micro:
            layer_fwd = {i: sum(ms(a, b) for a, b in marks) for i, marks in self._layer_marks.items()}
            total_fwd = sum(layer_fwd.values())
            busy = sum(per_micro) / len(per_micro)
            if total_fwd > 0:
                for index, value in layer_fwd.items():
                    self._layer_history[index].append(busy * value / total_fwd)
        return per_micro

    def layer_compute_ms(self) -> dict[int, float]:
        """Median forward + backward ms per micro-batch of each local layer over recent steps."""
        return {i: statistics.median(h) for i, h in self._layer_history.items() if h}
