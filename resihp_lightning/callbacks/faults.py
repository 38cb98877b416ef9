"""Fault descriptions and the plain-PyTorch machinery that injects them (no Lightning needed).

* :class:`FaultConfig`: one fault, YAML-friendly (``kind``: ``slow``, ``delay_p2p``, ``kill`` or ``hang``).
* :class:`Slowdown`: makes wrapped modules behave like a device at ``1/factor`` speed. Inside the
  module's own ``forward`` it times the real forward and then sleeps ``(factor - 1)`` times that;
  in the backward pass, identity autograd nodes on the module's outputs and inputs time the module's
  backward and sleep ``(factor - 1)`` times it before the gradient leaves the module. The waits are
  therefore *inside* the layer's forward and backward, where any timer around the stage's forward or
  backward work (the strategy's busy-time profiler, hooks) sees them exactly as it would see a GPU
  running at ``1/factor`` speed. On CUDA the timing synchronises the device first so that it
  measures kernels, not launches. A module without a differentiable input (an embedding fed token
  ids) only gets the forward part, since nothing marks the end of its backward; its backward is
  usually negligible.
* :class:`DelayedCall`: patches a function in a module namespace to wait before each call;
  :func:`delay_p2p_sends` uses it on DeepSpeed's pipeline ``p2p.send``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from resihp_lightning.errors import ConfigError, invalid_option

FAULT_KINDS = ("slow", "delay_p2p", "kill", "hang")
#: Faults that end (``kill``: SIGKILL, like ``kill -9``) or freeze (``hang``: SIGSTOP) the process.
STOP_KINDS = ("kill", "hang")


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """One injected fault.

    Attributes:
        kind: ``"slow"`` (compute at 1/factor speed), ``"delay_p2p"`` (wait ``delay_ms`` before
            each pipeline send), ``"kill"`` (the process gets SIGKILL, as from ``kill -9``) or
            ``"hang"`` (SIGSTOP: alive but frozen). ``kill`` and ``hang`` strike inside step
            ``start_step``, at the forward of the rank's ``micro_batch``-th micro-batch.
        rank: the rank that suffers it (its global rank when the job started).
        factor: slowdown factor for ``slow`` (> 1; 2.0 = half speed).
        start_step: first step (trainer global step) of the fault; the step of death for ``kill``.
        end_step: first step without the fault again (``None``: to the end of training).
        delay_ms: wait per send for ``delay_p2p`` (> 0).
        micro_batch: for ``kill`` / ``hang``: which of the rank's micro-batches of the step (1 = first).
    """

    kind: str = "slow"
    rank: int = 0
    factor: float = 2.0
    start_step: int = 0
    end_step: int | None = None
    delay_ms: float = 0.0
    micro_batch: int = 1

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise invalid_option("fault.kind", self.kind, FAULT_KINDS)
        if not isinstance(self.micro_batch, int) or isinstance(self.micro_batch, bool) or self.micro_batch < 1:
            raise invalid_option("fault.micro_batch", self.micro_batch, "an integer >= 1")
        for name in ("rank", "start_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise invalid_option(f"fault.{name}", value, "an integer >= 0")
        if self.end_step is not None and (not isinstance(self.end_step, int) or self.end_step <= self.start_step):
            raise invalid_option("fault.end_step", self.end_step, f"null or an integer > start_step ({self.start_step})")
        if self.kind == "slow" and not (isinstance(self.factor, (int, float)) and self.factor > 1):
            raise invalid_option("fault.factor", self.factor, "a number > 1 (2.0 = half speed)")
        if self.kind == "delay_p2p" and not (isinstance(self.delay_ms, (int, float)) and self.delay_ms > 0):
            raise invalid_option("fault.delay_ms", self.delay_ms, "milliseconds > 0")

    def active(self, step: int) -> bool:
        """Whether the fault is in force at ``step``."""
        return step >= self.start_step and (self.end_step is None or step < self.end_step)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FaultConfig:
        """Builds a fault from a mapping (YAML); unknown keys are refused by name."""
        if isinstance(data, FaultConfig):
            return data
        if not isinstance(data, Mapping):
            raise ConfigError(f"a fault must be a mapping, got {type(data).__name__}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ConfigError(f"unknown fault option '{unknown[0]}'; allowed: {', '.join(sorted(allowed))}")
        return cls(**data)


class _Timing:
    """Shared between one forward call's backward markers."""

    __slots__ = ("factor", "start", "done", "sync")

    def __init__(self, factor: float, sync: bool) -> None:
        self.factor, self.start, self.done, self.sync = factor, None, False, sync


def _sync(enabled: bool) -> None:
    if enabled:
        import torch

        torch.cuda.synchronize()


def _markers():
    import torch

    class BackwardStart(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, timing):  # noqa: ANN001
            ctx.timing = timing
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001
            timing = ctx.timing
            if timing.start is None:
                _sync(timing.sync)
                timing.start = time.perf_counter()
            return grad, None

    class BackwardEnd(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, timing):  # noqa: ANN001
            ctx.timing = timing
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001
            timing = ctx.timing
            if timing.start is not None and not timing.done:
                timing.done = True
                _sync(timing.sync)
                elapsed = time.perf_counter() - timing.start
                time.sleep((timing.factor - 1.0) * elapsed)
            return grad, None

    return BackwardStart, BackwardEnd


class Slowdown:
    """Makes wrapped modules run like a device at ``1 / factor_fn()`` speed (see module docstring).

    Args:
        factor_fn: returns the current slowdown factor; 1.0 (or less) means no slowdown.
        cuda_sync: synchronise CUDA around the timed regions (default: when CUDA is available).
    """

    def __init__(self, factor_fn: Callable[[], float], *, cuda_sync: bool | None = None) -> None:
        import torch

        self.factor_fn = factor_fn
        self.cuda_sync = torch.cuda.is_available() if cuda_sync is None else cuda_sync
        self._start_fn, self._end_fn = _markers()
        self._wrapped: dict[int, tuple[Any, Callable[..., Any]]] = {}
        self.injected_s = 0.0  # forward waits so far (backward waits are not counted here)

    @property
    def wrapped(self) -> list[Any]:
        return [module for module, _ in self._wrapped.values()]

    def wrap(self, module: Any) -> None:
        """Wraps ``module.forward`` (idempotent)."""
        if id(module) in self._wrapped:
            return
        original = module.forward
        self._wrapped[id(module)] = (module, original)
        module.forward = self._make_forward(original)

    def unwrap_all(self) -> None:
        """Restores every wrapped module's original ``forward``."""
        for module, _ in self._wrapped.values():
            if "forward" in vars(module):
                del module.forward
        self._wrapped.clear()

    def _make_forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        start_fn, end_fn = self._start_fn, self._end_fn

        def mark(value: Any, fn: Any, timing: _Timing) -> Any:
            if isinstance(value, torch.Tensor):
                return fn.apply(value, timing) if value.requires_grad and value.is_floating_point() else value
            if isinstance(value, tuple):
                return tuple(mark(v, fn, timing) for v in value)
            if isinstance(value, list):
                return [mark(v, fn, timing) for v in value]
            return value

        def forward(*args: Any, **kwargs: Any) -> Any:
            factor = float(self.factor_fn())
            if factor <= 1.0:
                return original(*args, **kwargs)
            timing = _Timing(factor, self.cuda_sync)
            grad = torch.is_grad_enabled()
            if grad:
                args = mark(args, end_fn, timing)
            _sync(self.cuda_sync)
            begin = time.perf_counter()
            out = original(*args, **kwargs)
            _sync(self.cuda_sync)
            wait = (factor - 1.0) * (time.perf_counter() - begin)
            time.sleep(wait)
            self.injected_s += wait
            return mark(out, start_fn, timing) if grad else out

        return forward


class DelayedCall:
    """Replaces ``namespace.name`` with a version that first sleeps ``delay_s_fn()`` seconds.

    Args:
        namespace: a module (or any object) holding the function.
        name: the attribute to patch.
        delay_s_fn: returns the wait in seconds (0 = no wait) at each call.
    """

    def __init__(self, namespace: Any, name: str, delay_s_fn: Callable[[], float]) -> None:
        self.namespace, self.name = namespace, name
        self.original = getattr(namespace, name)
        self.calls = 0
        self.delayed_s = 0.0
        original = self.original

        def delayed(*args: Any, **kwargs: Any) -> Any:
            wait = float(delay_s_fn())
            if wait > 0:
                time.sleep(wait)
                self.delayed_s += wait
            self.calls += 1
            return original(*args, **kwargs)

        setattr(namespace, name, delayed)

    def restore(self) -> None:
        setattr(self.namespace, self.name, self.original)


def delay_p2p_sends(delay_s_fn: Callable[[], float]) -> DelayedCall:
    """Delays DeepSpeed pipeline sends (``deepspeed.runtime.pipe.p2p.send``, looked up per call by the engine)."""
    from deepspeed.runtime.pipe import p2p

    return DelayedCall(p2p, "send", delay_s_fn)
