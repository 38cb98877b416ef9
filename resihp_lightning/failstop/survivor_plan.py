"""The survivors' plan after a lost rank: the planner over the live devices, as they are."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from resihp_lightning._logging import user_warn
from resihp_lightning.config import PlannerConfig
from resihp_lightning.contract import DeviceConditions
from resihp_lightning.errors import PlanError
from resihp_lightning.plan import Device, Layer, Plan, Problem
from resihp_lightning.telemetry import LayerCost


def fill_missing_costs(profile: Sequence[LayerCost]) -> list[LayerCost]:
    """Layer costs with unmeasured compute (0) replaced by the mean of the measured ones (or 1 ms)."""
    measured = [c.compute_ms for c in profile if c.compute_ms > 0]
    default = sum(measured) / len(measured) if measured else 1.0
    return [c if c.compute_ms > 0 else LayerCost(c.index, default, c.static_mb, c.activation_mb) for c in profile]


def survivor_plan(
    profile: Sequence[LayerCost],
    members: Sequence[int],
    micro_batches: int,
    per_replica_bounds: bool,
    solver: str,
    memory_mb: float | Mapping[int, float] | None = None,
    min_data_degree: int = 1,
    conditions: DeviceConditions | None = None,
) -> Plan:
    """The best plan for the survivors.

    ``conditions``: the slow devices and links known before the failure, and the measured transfer
    costs (``strategy.device_conditions``, which the controller keeps current); ``None``: every
    survivor healthy and transfers free.
    ``memory_mb``: every survivor's budget (one number for all, or per device id; ``None``: unlimited).
    The survivors take over the lost ranks' layers, so a plan that does not fit a device's memory is
    never chosen (``InfeasibleError`` when none fits). ``min_data_degree``: the plan keeps at least this
    many replicas where one fits (else the best plan with fewer, and a warning).

    The plan may leave survivors idle (``allow_exclude``) when that is faster, e.g. seven survivors
    whose memory needs two stages run 2 x 3 with one spare instead of a 7 x 1 pipeline.

    Raises:
        PlanError / InfeasibleError: no plan fits (too few micro-batches for the survivors, ...).
    """
    from resihp_lightning.errors import ResiHPError
    from resihp_lightning.solver import solve

    costs = fill_missing_costs(profile)
    if isinstance(memory_mb, Mapping):
        memory = {int(d): float(mb) for d, mb in memory_mb.items()}
    else:
        fixed = math.inf if memory_mb is None else float(memory_mb)
        memory = {int(d): fixed for d in members}
    known = conditions or DeviceConditions()
    problem = Problem(
        layers=tuple(Layer(c.compute_ms, c.static_mb, c.activation_mb) for c in costs),
        devices=tuple(Device(d, known.speeds.get(d, 1.0), memory.get(int(d), math.inf),
                             link_speed=known.link_speeds.get(d, 1.0)) for d in members),
        micro_batches=micro_batches,
        p2p_ms=known.p2p_ms,
        allreduce_ms=known.allreduce_ms,
        shared_partition=not per_replica_bounds,
        allow_exclude=True,
    )
    config = PlannerConfig(solver=solver)
    wanted = dataclasses.replace(problem, min_data_degree=min_data_degree)
    try:
        plan, problem = solve(wanted, config), wanted
    except ResiHPError:
        if min_data_degree <= 1:
            raise
        user_warn(f"ResiHPStrategy: no plan with {min_data_degree} replicas fits the {len(members)} survivors; "
                  "they run with fewer, so a further death may lose layers (recovery then needs a restart)")
        plan = solve(problem, config)
    if len(plan.device_ids) < len(members):
        # Idle survivors only where that is strictly faster: on a tie, every device keeps working.
        try:
            everyone = solve(dataclasses.replace(problem, allow_exclude=False), config)
        except ResiHPError:
            everyone = None
        if everyone is not None and everyone.iteration_ms <= plan.iteration_ms * (1 + 1e-9):
            plan = everyone
    if not set(plan.device_ids) <= set(members):
        raise PlanError(f"the survivors' plan uses devices {sorted(plan.device_ids)} outside {sorted(members)}")
    return plan
