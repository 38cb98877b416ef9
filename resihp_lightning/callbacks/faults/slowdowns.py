"""Fault descriptions and the plain-PyTorch machinery that injects them (no Lightning needed).

* :class:`FaultConfig`: one fault, YAML-friendly (``kind``: ``slow``, ``slow_link``, ``delay_p2p``,
  ``kill`` or ``hang``).
* :class:`Slowdown`: makes a rank behave like a device at ``1/factor`` speed. A throttled device runs
  *everything* slower, so every piece of compute the rank runs is slowed, each by ``(factor - 1)``
  times its own measured duration, waited inside it:

  - each wrapped module's forward (the rank's layers) and, through identity autograd nodes on the
    module's outputs and inputs, its backward, before the gradient leaves the module;
  - a module without a differentiable input (an embedding fed token ids): its backward ends when
    the last of its parameters has had its gradient accumulated (``register_post_accumulate_grad_hook``);
  - wrapped functions (the loss: :meth:`Slowdown.wrap_function`), forward and backward alike;
  - the optimizer step (:meth:`Slowdown.slow_optimizer_steps`: torch's global optimizer step hooks,
    so DeepSpeed's and Lightning's wrappers need no change).

  The waits are therefore *inside* the forward, backward and optimizer work, where any timer around
  them (the strategy's busy-time profiler, hooks, the step time) sees them as it would see a GPU at
  ``1/factor`` speed. Under tensor parallelism a split layer's duration includes its all-reduces,
  whose time is waiting for the group's other members, not compute: that time
  (:data:`~resihp_lightning.torch_utils.wait_clock.TENSOR_PARALLEL_WAIT`) is left out of what is
  slowed, as a throttled GPU's NVLink transfers are not slowed with its compute. On CUDA the timing synchronises the device first so that it measures kernels,
  not launches. What is left unslowed is the pipeline engine's own bookkeeping around each
  instruction (input clones, buffer handling), a small share of the measured busy time.
* Link faults (``slow_link``, ``delay_p2p``) delay the runtime's own transfers:
  :mod:`resihp_lightning.runtime.transport_delays` (``DelayedCall``, ``delay_p2p_sends``,
  ``slow_links``), the only place that knows which functions the runtime sends through.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from resihp_lightning.errors import ConfigError, invalid_option

__all__ = ["FAULT_KINDS", "STOP_KINDS", "FaultConfig", "Slowdown"]

FAULT_KINDS = ("slow", "slow_link", "delay_p2p", "kill", "hang")
#: Faults that end (``kill``: SIGKILL, like ``kill -9``) or freeze (``hang``: SIGSTOP) the process.
STOP_KINDS = ("kill", "hang")


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """One injected fault.

    Attributes:
        kind: ``"slow"`` (all of the rank's compute at 1/factor speed: forward, backward, loss,
            optimizer step), ``"slow_link"`` (the rank's links: wait ``delay_ms`` before each of its
            pipeline sends and each of its gradient all-reduces), ``"delay_p2p"`` (wait ``delay_ms``
            before each pipeline send only), ``"kill"`` (the process gets SIGKILL, as from ``kill -9``) or
            ``"hang"`` (SIGSTOP: alive but frozen). ``kill`` and ``hang`` strike inside step
            ``start_step``, at the forward of the rank's ``micro_batch``-th micro-batch.
        rank: the rank that suffers it (its global rank when the job started).
        factor: slowdown factor for ``slow`` (> 1; 2.0 = half speed).
        start_step: first step (trainer global step) of the fault; the step of death for ``kill``.
        end_step: first step without the fault again (``None``: to the end of training).
        delay_ms: wait per send (and per all-reduce for ``slow_link``) for ``delay_p2p`` / ``slow_link`` (> 0).
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
        if self.kind in ("delay_p2p", "slow_link") and not (isinstance(self.delay_ms, (int, float)) and self.delay_ms > 0):
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
    """One slowed call: shared between its backward markers (and its parameters' hooks)."""

    __slots__ = ("factor", "start", "done", "sync", "pending", "waited")

    def __init__(self, factor: float, sync: bool, pending: int = 0) -> None:
        self.factor, self.start, self.done, self.sync = factor, None, False, sync
        #: the process's tensor-parallel all-reduce time when the backward started
        self.waited = 0.0
        #: parameters whose gradient is still to be accumulated (a call without a differentiable input)
        self.pending = pending


def _all_reduce_wait() -> float:
    """This process's time so far in tensor-parallel all-reduces (not compute: never slowed)."""
    from resihp_lightning.torch_utils.wait_clock import TENSOR_PARALLEL_WAIT

    return TENSOR_PARALLEL_WAIT.reading()


def _sync(enabled: bool) -> None:
    if enabled:
        import torch

        torch.cuda.synchronize()


def _markers(finish: Callable[[_Timing], None]):
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
                timing.waited = _all_reduce_wait()
            return grad, None

    class BackwardEnd(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, timing):  # noqa: ANN001
            ctx.timing = timing
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001
            finish(ctx.timing)
            return grad, None

    return BackwardStart, BackwardEnd


class Slowdown:
    """Makes a rank run like a device at ``1 / factor_fn()`` speed (see the module docstring).

    Wrap the rank's modules (:meth:`wrap`), its loss (:meth:`wrap_function`) and its optimizer steps
    (:meth:`slow_optimizer_steps`); :meth:`unwrap_all` undoes all of it.

    Args:
        factor_fn: returns the current slowdown factor; 1.0 (or less) means no slowdown.
        cuda_sync: synchronise CUDA around the timed regions (default: when CUDA is available).
    """

    def __init__(self, factor_fn: Callable[[], float], *, cuda_sync: bool | None = None) -> None:
        import torch

        self.factor_fn = factor_fn
        self.cuda_sync = torch.cuda.is_available() if cuda_sync is None else cuda_sync
        self._start_fn, self._end_fn = _markers(self._finish)
        self._wrapped: dict[int, tuple[Any, Callable[..., Any]]] = {}
        self._handles: list[Any] = []
        self._optimizer_handles: list[Any] = []
        self.injected_s = 0.0  # every wait so far: forward, backward and optimizer step

    @property
    def wrapped(self) -> list[Any]:
        return [module for module, _ in self._wrapped.values()]

    def wrap(self, module: Any) -> None:
        """Wraps ``module.forward`` (idempotent); its backward is slowed too (see the module docstring)."""
        if id(module) in self._wrapped:
            return
        original = module.forward
        self._wrapped[id(module)] = (module, original)
        params = [p for p in module.parameters() if p.requires_grad]
        queue: deque[_Timing] = deque(maxlen=256)  # calls whose backward ends at their parameters
        for param in params:
            self._handles.append(param.register_post_accumulate_grad_hook(self._param_hook(queue)))
        module.forward = self._make_forward(original, queue, len(params))

    def wrap_function(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Returns ``fn`` slowed like a module's forward (e.g. the loss): its forward and, when its
        inputs need gradients, its backward."""
        return self._make_forward(fn, None, 0)

    def slow_optimizer_steps(self) -> None:
        """Slows every ``torch.optim.Optimizer.step`` in this process (idempotent; undone by :meth:`unwrap_all`)."""
        if self._optimizer_handles:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        open_steps: list[tuple[float, float]] = []

        def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
            factor = float(self.factor_fn())
            if factor > 1.0:
                _sync(self.cuda_sync)
                open_steps.append((factor, time.perf_counter()))

        def post(optimizer: Any, args: Any, kwargs: Any) -> None:
            if open_steps:
                factor, begin = open_steps.pop()
                _sync(self.cuda_sync)
                self._wait((factor - 1.0) * (time.perf_counter() - begin))

        self._optimizer_handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def unwrap_all(self) -> None:
        """Restores every wrapped module's original ``forward`` and removes every hook."""
        for module, _ in self._wrapped.values():
            if "forward" in vars(module):
                del module.forward
        self._wrapped.clear()
        for handle in self._handles + self._optimizer_handles:
            handle.remove()
        self._handles, self._optimizer_handles = [], []

    # ------------------------------------------------------------------------------ internals
    def _wait(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)
            self.injected_s += seconds

    def _finish(self, timing: _Timing) -> None:
        """The backward of one slowed call has ended: wait ``factor - 1`` times its duration."""
        if timing.start is not None and not timing.done:
            timing.done = True
            _sync(timing.sync)
            own = time.perf_counter() - timing.start - (_all_reduce_wait() - timing.waited)
            self._wait((timing.factor - 1.0) * own)

    def _param_hook(self, queue: deque[_Timing]) -> Callable[[Any], None]:
        def hook(param: Any) -> None:
            while queue and queue[0].done:
                queue.popleft()
            for timing in queue:  # the oldest call whose backward has started (1F1B runs them in order)
                if timing.start is not None and not timing.done:
                    timing.pending -= 1
                    if timing.pending <= 0:
                        self._finish(timing)
                    return

        return hook

    def _make_forward(self, original: Callable[..., Any], queue: deque[_Timing] | None, params: int) -> Callable[..., Any]:
        import torch

        start_fn, end_fn = self._start_fn, self._end_fn

        def mark(value: Any, fn: Any, timing: _Timing, hits: list[int]) -> Any:
            if isinstance(value, torch.Tensor):
                if value.requires_grad and value.is_floating_point():
                    hits[0] += 1
                    return fn.apply(value, timing)
                return value
            if isinstance(value, tuple):
                return tuple(mark(v, fn, timing, hits) for v in value)
            if isinstance(value, list):
                return [mark(v, fn, timing, hits) for v in value]
            return value

        def forward(*args: Any, **kwargs: Any) -> Any:
            factor = float(self.factor_fn())
            if factor <= 1.0:
                return original(*args, **kwargs)
            timing = _Timing(factor, self.cuda_sync)
            grad = torch.is_grad_enabled()
            if grad:
                hits = [0]
                args = mark(args, end_fn, timing, hits)
                if not hits[0] and queue is not None and params:
                    timing.pending = params  # no differentiable input: the backward ends at the parameters
                    queue.append(timing)
            _sync(self.cuda_sync)
            begin, waited = time.perf_counter(), _all_reduce_wait()
            out = original(*args, **kwargs)
            _sync(self.cuda_sync)
            self._wait((factor - 1.0) * (time.perf_counter() - begin - (_all_reduce_wait() - waited)))
            return mark(out, start_fn, timing, [0]) if grad else out

        return forward
