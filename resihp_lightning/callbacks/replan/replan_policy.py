"""The re-planning controller's arithmetic, as pure functions (no torch, no Lightning).

* :func:`build_problem`: the planner's :class:`~resihp_lightning.plan.Problem` from the strategy's
  measured per-layer costs, the detector's per-rank speeds and the job's options (built by
  :func:`~resihp_lightning.problem_builder.problem_from_costs`, as every other plan is).
* :func:`moved_mb` / :func:`estimate_migration_s`: what switching plans would move and cost.
* :func:`decide`: whether a computed plan is worth applying. In order, a plan is rejected when it
  is the plan in force, when the last change is fewer than ``cooldown_steps`` ago (if it passes the
  other rules, the controller solves again when the cooldown ends), when its
  predicted iteration time is not at least ``min_relative_gain`` below the current plan's
  (hysteresis: small predicted gains are noise and would make plans flap), or when the time it
  saves over the expected remaining steps does not exceed ``payback_factor`` times the estimated
  migration cost. Otherwise it is applied.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from resihp_lightning.config import PlannerConfig, config_from_dict
from resihp_lightning.contract import DeviceConditions
from resihp_lightning.errors import PlanError, invalid_option
from resihp_lightning.placement import plan_transfers
from resihp_lightning.plan import Plan, Problem, evaluate, validate
from resihp_lightning.problem_builder import problem_from_costs
from resihp_lightning.telemetry import LayerCost


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """Options of the re-planning controller (when and whether to re-plan; how to plan is
    :class:`~resihp_lightning.config.PlannerConfig`).

    Attributes:
        min_relative_gain: the new plan's predicted time must be at least this fraction below the
            current plan's (hysteresis; 0 <= x < 1).
        payback_factor: predicted saving over the remaining steps must exceed this multiple of the
            estimated migration cost (>= 0).
        horizon_steps: expected remaining steps when the trainer has no ``max_steps``; with one,
            ``max_steps - global_step`` is used.
        cooldown_steps: steps after a plan change during which no other plan is applied.
        speed_quantum: speeds are rounded to multiples of this before planning (fewer speed classes
            make the planner faster, and tiny estimate changes do not produce new plans).
        migration_overhead_s: fixed cost of a migration (engine rebuild) until one was measured.
        migration_bandwidth_mb_s: bytes-moved rate until a migration was measured.
        p2p_ms: activation + gradient transfer between stages per micro-batch, for the Problem;
            ``None`` (default): measured by the detector's link probe (0 until the first probe).
        allreduce_ms: data-parallel gradient sync per iteration, for the Problem; ``None`` (default):
            measured by the detector's link probe (0 until the first probe).
        memory_mb: memory per device for the Problem: ``"auto"`` (default) reads each device's budget
            from the strategy (``strategy.device_memory_mb()``: free CUDA memory, or a share of host
            memory on CPU; see ``strategy.device_memory``), a number gives every device that many MB,
            ``None`` is unlimited. The planner only proposes plans that fit.
        profile_interval_steps: refresh the cached healthy layer profile this often while no rank
            is flagged (the profile is a collective; 0 = only when first needed).
        plan_wait_s: how long every rank waits, at the step whose detector change started a solve,
            for the solve to finish; a longer solve goes on in the planner's worker process while
            training continues, and its plan is applied at the first step boundary after it is ready.
        tensor_regroup: under tensor parallelism, let the planner form the groups too: which processes
            make each group and its degree (among the module's ``pipeline_tensor_parallel_degrees``, at
            most ``tensor_degree``, inside the groups the job started with), so that a slow member is
            dropped from its group and taken back when it heals
            (:mod:`~resihp_lightning.callbacks.replan.tensor_regroup`). ``False``: groups stay as they
            are and the planner moves layers and micro-batches between them. Under tensor parallelism
            ``memory_mb`` is per process.
        tensor_comm_fraction: with ``tensor_regroup``, f_t: a group of the job's degree t spends this
            fraction of a layer's one-GPU compute time in its TP all-reduces (>= 0); other degrees are
            scaled from it (:mod:`~resihp_lightning.callbacks.replan.tensor_regroup`). ``None`` (default):
            measured, from the members' wait in the all-reduces during healthy steps (on oversubscribed
            CPUs that wait is mostly contention, and a number states the hardware's real cost).
        tensor_degrees: with ``tensor_regroup``, the degrees groups may take (``None``: every degree the
            module's layers split over, up to ``tensor_degree``); must hold ``tensor_degree``.
    """

    min_relative_gain: float = 0.05
    payback_factor: float = 2.0
    horizon_steps: int = 1000
    cooldown_steps: int = 5
    speed_quantum: float = 0.05
    migration_overhead_s: float = 1.0
    migration_bandwidth_mb_s: float = 1000.0
    p2p_ms: float | None = None
    allreduce_ms: float | None = None
    memory_mb: float | str | None = "auto"
    profile_interval_steps: int = 50
    plan_wait_s: float = 0.5
    tensor_regroup: bool = True
    tensor_comm_fraction: float | None = None
    tensor_degrees: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not _number(self.min_relative_gain) or not 0 <= self.min_relative_gain < 1:
            raise invalid_option("controller.min_relative_gain", self.min_relative_gain, "a number in [0, 1)")
        for name in ("payback_factor", "migration_overhead_s", "plan_wait_s"):
            if not _number(getattr(self, name)) or getattr(self, name) < 0:
                raise invalid_option(f"controller.{name}", getattr(self, name), "a number >= 0")
        for name in ("p2p_ms", "allreduce_ms"):
            value = getattr(self, name)
            if value is not None and (not _number(value) or value < 0):
                raise invalid_option(f"controller.{name}", value, "null (measured) or a number >= 0")
        for name in ("speed_quantum", "migration_bandwidth_mb_s"):
            if not _number(getattr(self, name)) or not getattr(self, name) > 0:
                raise invalid_option(f"controller.{name}", getattr(self, name), "a number > 0")
        if self.speed_quantum > 0.5:
            raise invalid_option("controller.speed_quantum", self.speed_quantum, "a number in (0, 0.5]")
        for name, low in (("horizon_steps", 1), ("cooldown_steps", 0), ("profile_interval_steps", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise invalid_option(f"controller.{name}", value, f"an integer >= {low}")
        if self.tensor_comm_fraction is not None and (not _number(self.tensor_comm_fraction)
                                                      or self.tensor_comm_fraction < 0):
            raise invalid_option("controller.tensor_comm_fraction", self.tensor_comm_fraction,
                                 "null (measured) or a number >= 0")
        if self.tensor_degrees is not None:
            degrees = self.tensor_degrees
            if (not isinstance(degrees, (list, tuple)) or not degrees
                    or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in degrees)):
                raise invalid_option("controller.tensor_degrees", degrees, "null or a list of integers >= 1")
            object.__setattr__(self, "tensor_degrees", tuple(sorted(set(degrees))))
        if not isinstance(self.tensor_regroup, bool):
            raise invalid_option("controller.tensor_regroup", self.tensor_regroup, "true or false")
        if self.memory_mb is not None and self.memory_mb != "auto" and (not _number(self.memory_mb) or not self.memory_mb > 0):
            raise invalid_option("controller.memory_mb", self.memory_mb, "'auto', null or a number > 0")

    @classmethod
    def from_dict(cls, data: ControllerConfig | Mapping[str, Any]) -> ControllerConfig:
        """Builds the config from a mapping (YAML); an unknown or moved key is refused by name.

        Raises:
            ConfigError: e.g. ``shared_partition``, which is a planner option
                (:attr:`PlannerConfig.shared_partition <resihp_lightning.config.PlannerConfig>`).
        """
        return config_from_dict(cls, data, "controller")


@dataclass(frozen=True)
class Decision:
    """The verdict on a computed plan.

    Attributes:
        apply: whether to request the plan.
        reason: why (one line, for ``plan_rejected`` and logs).
        gain_ms: predicted saving per iteration (current - new).
        total_gain_s: predicted saving over the remaining steps.
        migration_s: estimated migration cost.
        retry_after_steps: set when only the cooldown stood in the way: the plan passed every other
            rule, so the controller solves again this many steps later (when the cooldown ends).
    """

    apply: bool
    reason: str
    gain_ms: float = 0.0
    total_gain_s: float = 0.0
    migration_s: float = 0.0
    retry_after_steps: int | None = None


@dataclass(frozen=True)
class MeasuredLinks:
    """What the detector's link probe measured (:mod:`~resihp_lightning.callbacks.failslow.link_core`), for :func:`build_problem`.

    Attributes:
        speeds: link speed of each device whose link is flagged slow (others 1.0).
        p2p_ms: measured round trip of one micro-batch's stage-boundary activation (``None``: not yet).
        allreduce_ms: measured gradient all-reduce per iteration (``None``: not yet).
    """

    speeds: Mapping[int, float] = field(default_factory=dict)
    p2p_ms: float | None = None
    allreduce_ms: float | None = None


def quantize_speeds(speeds: Mapping[int, float], quantum: float) -> dict[int, float]:
    """Rounds speeds to multiples of ``quantum``, within [quantum, 1.0]."""
    return {rank: min(1.0, max(quantum, round(speed / quantum) * quantum)) for rank, speed in speeds.items()}


def quantize_link_speeds(speeds: Mapping[int, float], quantum: float) -> dict[int, float]:
    """Link speeds as :func:`quantize_speeds`, except that speeds below ``quantum`` keep two significant
    digits: a link 100x slower is common (a degraded NIC, a congested path) and clamping it at the
    quantum would price its transfers several times too cheap."""
    out = {}
    for rank, speed in speeds.items():
        out[rank] = float(f"{speed:.2g}") if speed < quantum else min(1.0, round(speed / quantum) * quantum)
    return out


def device_conditions(
    speeds: Mapping[int, float],
    links: MeasuredLinks | None,
    config: ControllerConfig,
    planner: PlannerConfig | None = None,
) -> DeviceConditions:
    """The devices' speeds, links and transfer costs as the planner takes them: speeds and link speeds
    quantized by ``config.speed_quantum``, and ``p2p_ms`` / ``allreduce_ms`` from ``config`` where it sets
    them, else as measured (0 before the first measurement); ``planner``: the options to plan them with
    (what the controller hands a fail-stop recovery)."""
    links = links or MeasuredLinks()
    return DeviceConditions(
        speeds=quantize_speeds(speeds, config.speed_quantum),
        link_speeds=quantize_link_speeds(links.speeds, config.speed_quantum),
        p2p_ms=config.p2p_ms if config.p2p_ms is not None else (links.p2p_ms or 0.0),
        allreduce_ms=config.allreduce_ms if config.allreduce_ms is not None else (links.allreduce_ms or 0.0),
        planner=planner,
    )


def memory_rule(config: ControllerConfig, measured: Mapping[int, float] | None) -> float | Mapping[int, float] | None:
    """The memory budgets ``config.memory_mb`` asks for: ``"auto"``: the measured ones (a device missing
    from ``measured``, or no measurement at all, is unlimited); a number: that for every device;
    ``None``: unlimited."""
    if config.memory_mb == "auto":
        return dict(measured or {})
    return config.memory_mb


def build_problem(
    profile: Sequence[LayerCost],
    speeds: Mapping[int, float],
    ranks: Iterable[int],
    micro_batches: int,
    config: ControllerConfig,
    planner: PlannerConfig | None = None,
    *,
    per_replica_bounds: bool = False,
    allow_exclude: bool = False,
    links: MeasuredLinks | None = None,
    memory_mb: Mapping[int, float] | None = None,
) -> Problem:
    """The controller's planning problem for the devices as they are now: its options resolved into
    :func:`~resihp_lightning.problem_builder.problem_from_costs`' inputs.

    Args:
        profile: per-layer costs measured on healthy steps (``strategy.layer_profile()``).
        speeds: per-rank speed (ranks missing here are healthy, 1.0).
        ranks: the ranks that can hold stages (dead ones left out).
        micro_batches: M per step.
        config: controller options (p2p, all-reduce, memory, speed quantum).
        planner: the planner's model options, written over the problem (pipeline degrees, shared
            partition, ...) where they are not ``None``.
        allow_exclude: whether the plan may leave devices idle (``strategy.supports_idle_devices``;
            ``planner.allow_exclude`` overrides it).
        per_replica_bounds: whether the strategy can run replicas with different stage bounds
            (``strategy.supports_per_replica_bounds``); the problem's ``shared_partition`` is its
            negation unless ``planner.shared_partition`` says otherwise.
        links: the detector's link measurements: per-device link speeds (flagged links) and, where
            ``config`` leaves ``p2p_ms`` / ``allreduce_ms`` at ``None``, the measured costs.
        memory_mb: each device's measured budget, used when ``config.memory_mb`` is ``"auto"``
            (:func:`memory_rule`).
    """
    return problem_from_costs(
        profile,
        ranks,
        micro_batches,
        conditions=device_conditions(speeds, links, config),
        memory_mb=memory_rule(config, memory_mb),
        per_replica_bounds=per_replica_bounds,
        allow_exclude=allow_exclude,
        planner=planner,
    )


def moved_mb(old: Plan, new: Plan, static_mb: Sequence[float]) -> float:
    """MB of layer state that must travel: the transfers the strategy will run (:func:`~resihp_lightning.placement.plan_transfers`)."""
    return sum(static_mb[t.layer] for t in plan_transfers(old, new, static_mb))


def estimate_migration_s(
    old: Plan,
    new: Plan,
    static_mb: Sequence[float],
    *,
    overhead_s: float,
    bandwidth_mb_s: float,
) -> float:
    """Fixed rebuild cost plus moved bytes over the bandwidth."""
    return overhead_s + moved_mb(old, new, static_mb) / bandwidth_mb_s


def price_plan_in_force(problem: Problem, plan: Plan) -> tuple[float, str | None]:
    """The plan in force's predicted iteration time on ``problem``, and why it breaks the problem's rules
    (``None`` when it keeps them). A plan the job runs has a time even when it breaks a rule the planner
    was given later (e.g. a 3 x 1 start with ``planner.min_data_degree: 2``); it is ``inf`` only when it
    cannot be priced at all (a device the problem does not have)."""
    try:
        validate(problem, plan, check_memory=False)
        breaks = None
    except PlanError as err:
        breaks = str(err)
    try:
        return evaluate(problem, plan, check=False).iteration_ms, breaks
    except (KeyError, IndexError, ValueError):
        return float("inf"), breaks


def calibrate(last_seconds: float, last_mb: float, overhead_s: float, bandwidth_mb_s: float) -> tuple[float, float]:
    """Updates (overhead_s, bandwidth_mb_s) from a measured migration.

    One measurement cannot separate the two, so the overhead is kept unless the migration was
    faster than it (then the overhead becomes the measured time), and the bandwidth is whatever
    explains the rest.
    """
    if not last_seconds > 0:
        return overhead_s, bandwidth_mb_s
    if last_seconds <= overhead_s or last_mb <= 0:
        return min(overhead_s, last_seconds), bandwidth_mb_s
    return overhead_s, last_mb / (last_seconds - overhead_s)


def decide(
    current_ms: float,
    new_ms: float,
    *,
    same_plan: bool,
    remaining_steps: int,
    migration_s: float,
    steps_since_change: int | None,
    config: ControllerConfig,
    current_breaks: str | None = None,
) -> Decision:
    """Whether to apply a computed plan (rules in the module docstring).

    Args:
        current_ms: predicted iteration time of the plan in force, at the devices' current speeds.
        new_ms: predicted iteration time of the computed plan.
        same_plan: the computed plan is the plan in force.
        remaining_steps: steps expected after the change.
        migration_s: estimated cost of switching.
        steps_since_change: steps since the last applied change (``None``: never changed).
        config: thresholds.
        current_breaks: why the plan in force breaks the problem's rules (e.g. fewer replicas than
            ``planner.min_data_degree``), or ``None``. Such a plan is left for the computed one
            whatever the gain (the cooldown still applies).
    """
    gain = current_ms - new_ms
    if same_plan:
        return Decision(False, "the plan in force is already the best plan", gain, 0.0, 0.0)
    if steps_since_change is not None and steps_since_change < config.cooldown_steps:
        wait = config.cooldown_steps - steps_since_change
        later = decide(current_ms, new_ms, same_plan=False, remaining_steps=remaining_steps - wait,
                       migration_s=migration_s, steps_since_change=None, config=config,
                       current_breaks=current_breaks)
        return Decision(False, f"cooldown: last change {steps_since_change} steps ago (< {config.cooldown_steps})"
                        + (f"; solving again in {wait} steps" if later.apply else ""),
                        gain, 0.0, migration_s, retry_after_steps=wait if later.apply else None)
    relative = gain / current_ms if current_ms > 0 else 0.0
    if current_breaks is not None:
        return Decision(True, f"the plan in force breaks the planner's rules ({current_breaks}); the new plan is "
                        f"predicted at {new_ms:.1f} ms per step vs {current_ms:.1f} ms", gain,
                        gain / 1000.0 * max(remaining_steps, 0), migration_s)
    if relative < config.min_relative_gain:
        return Decision(False, f"predicted gain {relative * 100:.1f}% is below min_relative_gain "
                        f"{config.min_relative_gain * 100:.1f}%", gain, 0.0, migration_s)
    total = gain / 1000.0 * max(remaining_steps, 0)
    if total <= config.payback_factor * migration_s:
        return Decision(False, f"saves {total:.2f} s over {remaining_steps} steps, less than {config.payback_factor:g} x "
                        f"migration {migration_s:.2f} s", gain, total, migration_s)
    return Decision(True, f"saves {gain:.1f} ms per step ({relative * 100:.1f}%), {total:.1f} s over {remaining_steps} "
                    f"steps vs migration {migration_s:.2f} s", gain, total, migration_s)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
