"""The contract between the strategy and the callbacks (pure Python: imports no torch).

The callbacks of :mod:`resihp_lightning.callbacks` talk to ``trainer.strategy`` only through the
members named here. Each callback checks the protocol it needs at ``setup`` with :func:`require`,
which raises a :class:`~resihp_lightning.errors.ConfigError` naming every missing member, so a job
with the wrong strategy fails at once instead of silently doing nothing.

* :class:`StepStatsSource`: ``last_step_stats`` (the detector, the progress bar);
* :class:`LayerHost`: ``local_layers()`` (the fault injector slows the rank's own layers);
* :class:`Replannable`: the above plus the re-planning API (the controller);
* :class:`LinkProber`: ``measure_links()`` (the detector's link probe: slow links, measured
  ``p2p_ms`` / ``allreduce_ms`` for the planner);
* :class:`MemoryGauge`: ``device_memory_mb()`` (the controller's per-device memory budget);
* :class:`Survivable`: in-process fail-stop recovery's record and listeners (the recovery reporter),
  and the :class:`DeviceConditions` it plans the survivors with (kept current by the controller);
* :class:`TensorParallel` (optional): planning devices that are groups of processes; only one
  process of a group reports its step statistics, and links are not probed (the detector).

:class:`MigrationRecord` is what ``strategy.last_migration`` holds after a plan was applied.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import ConfigError
from resihp_lightning.plan import Plan
from resihp_lightning.telemetry import LayerCost, LinkSample, StepStats


_MISSING = object()


@dataclass(frozen=True)
class MigrationRecord:
    """One applied plan change, as this rank measured it.

    Attributes:
        plan: the plan that was put in force.
        seconds: this rank's time from the start of the switch to the new engine being ready.
        bytes_moved: parameters + optimizer state sent, summed over all ranks (0 when only
            micro-batch counts changed).
        transfer_seconds: the point-to-point exchange of moved layers.
        rebuild_seconds: the rest (engine teardown and rebuild, groups).
        state_seconds: the part spent reading and writing a ZeRO-1 / bf16 wrapper's per-parameter
            state (0 for the plain optimizer).
    """

    plan: Plan
    seconds: float
    bytes_moved: int
    transfer_seconds: float = 0.0
    rebuild_seconds: float = 0.0
    state_seconds: float = 0.0


@dataclass(frozen=True)
class DeviceConditions:
    """The devices as the detector last knew them, in the planner's terms (device id -> value), and the
    planner options the controller plans them with.

    The controller hands them to the strategy at every step, so that a fail-stop recovery plans the
    survivors with the slow devices and links already known, and under the user's planner options,
    instead of as if every survivor were healthy and the options were the defaults.

    Attributes:
        speeds: compute speed of each slow device (others 1.0), as the controller plans with them.
        link_speeds: link speed of each device with a slow link (others 1.0).
        p2p_ms: stage-boundary transfer per micro-batch (measured, or the controller's setting).
        allreduce_ms: gradient all-reduce per iteration (measured, or the controller's setting).
        planner: the controller's planner options (``ReplanController(planner=...)``); ``None``: no
            controller, the defaults apply.
    """

    speeds: Mapping[int, float] = field(default_factory=dict)
    link_speeds: Mapping[int, float] = field(default_factory=dict)
    p2p_ms: float = 0.0
    allreduce_ms: float = 0.0
    planner: PlannerConfig | None = None


@runtime_checkable
class StepStatsSource(Protocol):
    """A strategy that measures each training step on each rank."""

    @property
    def last_step_stats(self) -> StepStats | None:
        """This rank's statistics of the last training step (``None`` before the first)."""

    @property
    def collectives_interrupted(self) -> bool:
        """Whether a lost peer interrupted this step's collectives after its update (skip the rest of them)."""

    def collective(self, run: Any) -> tuple[bool, Any]:
        """Runs ``run()`` (a collective of a callback, between steps): ``(True, result)``, or ``(False, None)``
        when a peer was lost and the survivors regrouped (the callback skips the rest of this step)."""


@runtime_checkable
class LayerHost(Protocol):
    """A strategy that can name the layer modules this rank runs."""

    def local_layers(self) -> Mapping[int, Any]:
        """This rank's layer modules by global layer index (they change after a re-plan)."""


@runtime_checkable
class Replannable(StepStatsSource, LayerHost, Protocol):
    """A strategy whose layout the controller can change while training."""

    @property
    def current_plan(self) -> Plan:
        """The plan in force (device ids are global ranks)."""

    @property
    def micro_batches(self) -> int | None:
        """M, micro-batches per global batch (``None`` until known)."""

    @property
    def supports_per_replica_bounds(self) -> bool:
        """Whether replicas may have different stage bounds."""

    @property
    def last_migration(self) -> MigrationRecord | None:
        """The last applied plan change (``None`` before one)."""

    @property
    def devices_alive(self) -> tuple[int, ...]:
        """Device ids of the job's live processes (a plan may use them)."""

    @property
    def supports_idle_devices(self) -> bool:
        """Whether a plan may leave live devices idle (hot spares, taken back by a later plan)."""

    profiler_recording: bool
    """Whether training steps feed :meth:`layer_profile` (the controller pauses it while a device is slow)."""

    def request_plan(self, plan: Plan) -> None:
        """Applies ``plan`` at the next step boundary (all ranks); raises ``PlanError`` when it cannot run."""

    def layer_profile(self) -> list[LayerCost]:
        """Measured per-layer costs (collective: every rank calls it at the same step)."""


@runtime_checkable
class LinkProber(Protocol):
    """A strategy that measures its links between steps."""

    def measure_links(self, first_round: int = 0) -> LinkSample:
        """Round trips per pair of ranks and one all-reduce, timed apart from the schedule (collective:
        every rank of the group calls it at the same step boundary); see ``strategy.link_probe``."""


@runtime_checkable
class TensorParallel(Protocol):
    """A strategy whose planning devices may be groups of processes (tensor parallelism)."""

    @property
    def tensor_degree(self) -> int:
        """Processes per planning device (1: none)."""

    @property
    def reports_device(self) -> bool:
        """Whether this process's step statistics speak for its device: the first member of its group
        (the others measure the same group, whose members finish each layer together)."""


def tensor_degree_of(strategy: Any) -> int:
    """``strategy.tensor_degree`` when it provides :class:`TensorParallel`, else 1."""
    return int(strategy.tensor_degree) if provides(strategy, TensorParallel) else 1


def reports_device(strategy: Any) -> bool:
    """Whether this process reports its device's step statistics (always, without :class:`TensorParallel`)."""
    return bool(strategy.reports_device) if provides(strategy, TensorParallel) else True


@runtime_checkable
class MemoryGauge(Protocol):
    """A strategy that knows how much memory its device can give the model."""

    def device_memory_mb(self) -> float:
        """This rank's budget for the model's state and activations, in MB (local, no collective)."""


def provides(obj: Any, protocol: type) -> bool:
    """Whether ``obj`` has every member of ``protocol`` (looked up statically)."""
    return not missing_members(obj, protocol)


def missing_members(obj: Any, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks, in declaration order (bases first)."""
    names: list[str] = []
    for cls in reversed(protocol.__mro__):
        if cls is object or cls is Protocol or not getattr(cls, "_is_protocol", False):
            continue
        for name in list(getattr(cls, "__annotations__", {})) + [n for n in vars(cls) if not n.startswith("_")]:
            if name not in names:
                names.append(name)
    # getattr_static: a property must not run here (``current_plan`` raises before Trainer setup).
    return [name for name in names if inspect.getattr_static(obj, name, _MISSING) is _MISSING]


def require(strategy: Any, protocol: type, user: str) -> None:
    """Raises :class:`~resihp_lightning.errors.ConfigError` when ``strategy`` does not provide ``protocol``.

    Args:
        strategy: ``trainer.strategy``.
        protocol: one of the protocols of this module.
        user: who needs it, for the message (e.g. ``"ReplanController"``).
    """
    missing = missing_members(strategy, protocol)
    if missing:
        raise ConfigError(
            f"{user} needs a strategy with {', '.join(missing)} ({protocol.__name__} in resihp_lightning.contract); "
            f"{type(strategy).__name__} lacks them: use Trainer(strategy='resihp')"
        )


@runtime_checkable
class Survivable(Protocol):
    """A strategy that recovers in-process from lost ranks."""

    @property
    def last_recovery(self) -> Any:
        """The last recovery (:class:`~resihp_lightning.failstop.recovery_record.RecoveryRecord`), or ``None``."""

    @property
    def last_admission(self) -> Any:
        """The last newcomers admitted (:class:`~resihp_lightning.failstop.admission.AdmissionNote`), or ``None``."""

    @property
    def fail_stop_listeners(self) -> list[Any]:
        """Called as ``listener(event, fields)`` just before the process exits because it cannot recover."""

    @property
    def recovery_listeners(self) -> list[Any]:
        """Called (no arguments) on every survivor inside a recovery, in registration order, after the new
        group formed: a callback re-synchronises its cross-rank state there (collectives allowed)."""

    @property
    def failure_detector(self) -> Any:
        """The job's :class:`~resihp_lightning.resilience.failure_detector.FailureDetector` (a reporting
        callback subscribes to it instead of running a second one); ``None`` without ``fail_stop``."""

    device_conditions: DeviceConditions
    """What a recovery plans the survivors with (healthy by default; the controller keeps it current)."""


@runtime_checkable
class IdleProbes(Protocol):
    """A strategy whose idle processes (hot spares) report a speed probe to the processes that plan.

    A device that a plan left out for slowness computes nothing, so nothing else measures whether it
    healed: it times the speed probe between steps and shares the time; the members compare it with
    their own probe times (:class:`~resihp_lightning.callbacks.failslow.straggler_detector.StragglerDetector`).
    """

    @property
    def is_spare(self) -> bool:
        """Whether the plan in force leaves this process idle."""

    def share_idle_probe(self, step: int, probe_ms: float) -> None:
        """An idle process: publishes its probe time at ``step`` (the latest one replaces the last)."""

    def idle_probes(self) -> dict[int, tuple[int, float]]:
        """Device id -> ``(step, probe ms)``: the latest probe of every idle process that shared one."""
