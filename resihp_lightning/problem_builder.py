"""The one builder of planning problems from measured costs (torch-free).

:func:`problem_from_costs` turns what the job knows about its layers and devices into the
planner's :class:`~resihp_lightning.plan.Problem`. Every place that plans builds its problem here,
so that the same measurements give the same problem wherever they are planned:

* the re-planning controller (:func:`~resihp_lightning.callbacks.replan.replan_policy.build_problem`
  resolves the controller's options into these inputs),
* the survivors' plan after a lost rank (:func:`~resihp_lightning.failstop.survivor_plan.survivor_plan`),
* the checks on a requested plan (:func:`~resihp_lightning.strategy.plan_rules.check_plan`),
* the trace evaluation (:class:`~resihp_lightning.evaluation.cluster.Cluster`).

See docs/architecture.md, "The planning model", for what the problem's fields mean.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from resihp_lightning.config import PlannerConfig
from resihp_lightning.contract import DeviceConditions
from resihp_lightning.plan import Device, Layer, Problem
from resihp_lightning.telemetry import LayerCost


def fill_missing_costs(profile: Sequence[LayerCost]) -> list[LayerCost]:
    """Layer costs with unmeasured compute (0) replaced by the mean of the measured ones (or 1 ms).

    A layer whose holder recorded no step (it took the layer over, or recording was paused) reports 0;
    priced as free, the planner would pile such layers onto one stage.
    """
    measured = [c.compute_ms for c in profile if c.compute_ms > 0]
    default = sum(measured) / len(measured) if measured else 1.0
    return [c if c.compute_ms > 0 else LayerCost(c.index, default, c.static_mb, c.activation_mb) for c in profile]


def measured_layers(profile: Sequence[LayerCost]) -> tuple[Layer, ...]:
    """The planner's layers from a measured profile: in layer order, unmeasured compute filled in
    (:func:`fill_missing_costs`), negative memory readings taken as 0."""
    ordered = fill_missing_costs(sorted(profile, key=lambda c: c.index))
    return tuple(Layer(c.compute_ms, max(c.static_mb, 0.0), max(c.activation_mb, 0.0)) for c in ordered)


def memory_budgets(devices: Iterable[int], memory_mb: float | Mapping[int, float] | None) -> dict[int, float]:
    """Each device's memory budget in MB: one number for all, per device id (a device missing from the
    mapping is unlimited), or ``None``: every device unlimited."""
    if isinstance(memory_mb, Mapping):
        given = {int(d): float(mb) for d, mb in memory_mb.items()}
        return {int(d): given.get(int(d), math.inf) for d in devices}
    fixed = math.inf if memory_mb is None else float(memory_mb)
    return {int(d): fixed for d in devices}


def problem_from_costs(
    costs: Sequence[LayerCost] | Sequence[Layer],
    devices: Iterable[int],
    micro_batches: int,
    *,
    conditions: DeviceConditions | None = None,
    memory_mb: float | Mapping[int, float] | None = None,
    per_replica_bounds: bool = False,
    allow_exclude: bool = False,
    planner: PlannerConfig | None = None,
) -> Problem:
    """The planning problem for the devices as they are now.

    Args:
        costs: per-layer costs: measured (:class:`~resihp_lightning.telemetry.LayerCost`, e.g.
            ``strategy.layer_profile()``; see :func:`measured_layers`) or modelled
            (:class:`~resihp_lightning.plan.Layer`, taken as they are: a modelled 0 is a real cost).
        devices: the device ids a plan may use (the live ones); the problem holds them in id order.
        micro_batches: M per step.
        conditions: the devices' speeds and link speeds (a device missing there is healthy, 1.0) and
            the transfer costs ``p2p_ms`` / ``allreduce_ms``; ``None``: all healthy, transfers free.
            Its ``planner`` field is not read here (pass ``planner``).
        memory_mb: memory budgets (:func:`memory_budgets`; ``None``: unlimited).
        per_replica_bounds: whether the job can run replicas with different stage bounds; the
            problem's ``shared_partition`` is its negation unless ``planner.shared_partition`` is set.
        allow_exclude: whether the plan may leave devices idle (``planner.allow_exclude`` overrides).
        planner: the planner's model options (pipeline degrees, shared partition, exclusion, layers
            per stage, replicas), written over the problem where they are not ``None``
            (:meth:`PlannerConfig.apply_to <resihp_lightning.config.PlannerConfig.apply_to>`).
    """
    measured = [c for c in costs if isinstance(c, LayerCost)]
    modelled = tuple(c for c in costs if isinstance(c, Layer))
    if len(measured) != len(costs) and len(modelled) != len(costs):
        raise TypeError("costs must be all LayerCost (measured) or all Layer (modelled)")
    layers = modelled if modelled else measured_layers(measured)
    ids = sorted(int(d) for d in devices)
    known = conditions or DeviceConditions()
    budgets = memory_budgets(ids, memory_mb)
    problem = Problem(
        layers=layers,
        devices=tuple(
            Device(d, known.speeds.get(d, 1.0), budgets[d], link_speed=known.link_speeds.get(d, 1.0)) for d in ids
        ),
        micro_batches=int(micro_batches),
        p2p_ms=known.p2p_ms,
        allreduce_ms=known.allreduce_ms,
        shared_partition=not per_replica_bounds,
        allow_exclude=allow_exclude,
    )
    return planner.apply_to(problem) if planner is not None else problem
