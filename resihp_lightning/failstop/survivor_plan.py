"""The survivors' plan after a lost rank: the planner over the live devices, as they are."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from resihp_lightning._logging import user_warn
from resihp_lightning.config import PlannerConfig
from resihp_lightning.contract import DeviceConditions
from resihp_lightning.errors import PlanError
from resihp_lightning.plan import Plan, Problem
from resihp_lightning.problem_builder import problem_from_costs
from resihp_lightning.telemetry import LayerCost
from resihp_lightning.tensor.tensor_groups import TensorGroups


def survivor_problem(
    profile: Sequence[LayerCost],
    members: Sequence[int],
    micro_batches: int,
    per_replica_bounds: bool,
    memory_mb: float | Mapping[int, float] | None = None,
    conditions: DeviceConditions | None = None,
) -> Problem:
    """The survivors' planning problem, before :func:`survivor_plan` raises its ``min_data_degree``.

    It is the problem the controller builds from the same measurements and options
    (:func:`~resihp_lightning.callbacks.replan.replan_policy.build_problem` with hot spares), over
    the survivors: a plan may leave survivors idle unless ``conditions.planner`` forbids it.
    Arguments as for :func:`survivor_plan`.
    """
    known = conditions or DeviceConditions()
    return problem_from_costs(profile, members, micro_batches, conditions=known, memory_mb=memory_mb,
                              per_replica_bounds=per_replica_bounds, allow_exclude=True, planner=known.planner)


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

    The problem is built as the controller builds its own
    (:func:`~resihp_lightning.problem_builder.problem_from_costs`), under the controller's planner
    options when there is one (``conditions.planner``), with ``solver`` as the backend.

    Args:
        profile: the layers' measured costs (each from a survivor that held the layer).
        members: the survivors' device ids.
        micro_batches: M; the plan deals all of it out.
        per_replica_bounds: whether the job can run replicas with different stage bounds.
        solver: the backend (``fail_stop.solver``; it replaces the planner options' own).
        memory_mb: every survivor's budget (one number for all, or per device id; ``None``: unlimited).
            The survivors take over the lost ranks' layers, so a plan that does not fit a device's
            memory is never chosen (``InfeasibleError`` when none fits).
        min_data_degree: the plan keeps at least this many replicas (and at least the planner
            options' ``min_data_degree``) where one fits, else the best plan with fewer, and a warning.
        conditions: the slow devices and links known before the failure, the measured transfer
            costs and the controller's planner options (``strategy.device_conditions``, which the
            controller keeps current); ``None``: every survivor healthy, transfers free, default options.

    The plan may leave survivors idle (``allow_exclude``, unless the planner options forbid it) when
    that is faster, e.g. seven survivors whose memory needs two stages run 2 x 3 with one spare instead
    of a 7 x 1 pipeline.

    Raises:
        InfeasibleError: no plan fits (too few micro-batches for the survivors, ...).
        PlanError: the solver's plan uses a device that is not a survivor.
    """
    from resihp_lightning.errors import ResiHPError
    from resihp_lightning.solver import solve

    known = conditions or DeviceConditions()
    problem = survivor_problem(profile, members, micro_batches, per_replica_bounds, memory_mb, known)
    # The problem holds the options' rules; the solves below relax some of them on purpose.
    config = dataclasses.replace((known.planner or PlannerConfig()).search_options(), solver=solver)
    wanted = dataclasses.replace(problem, min_data_degree=max(problem.min_data_degree, min_data_degree))
    try:
        plan, problem = solve(wanted, config), wanted
    except ResiHPError:
        if wanted.min_data_degree <= 1:
            raise
        user_warn(f"ResiHPStrategy: no plan with {wanted.min_data_degree} replicas fits the {len(members)} survivors; "
                  "they run with fewer, so a further death may lose layers (recovery then needs a restart)")
        problem = dataclasses.replace(problem, min_data_degree=1)
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


def tensor_survivor_conditions(
    old: TensorGroups, new: TensorGroups, budgets: Mapping[int, float | None], conditions: DeviceConditions
) -> tuple[DeviceConditions, dict[int, float]]:
    """The survivors' groups as planning devices: speeds and memory relative to the old groups'.

    The layer costs were measured on groups of the old degree t: a group of degree d made from one of
    them runs a layer ``t / d`` times longer (speed ``d / t``) and holds ``d / t`` of the memory, in the
    measured units. Group ids change, so the known slow devices do not carry over; the plan must use every
    group (idle processes under tensor parallelism are not supported yet).

    Args:
        old: the groups before the loss.
        new: the survivors' groups (:func:`~resihp_lightning.tensor.resplit.surviving_groups`).
        budgets: each survivor's memory budget in MB by process id (``None``: unlimited).
        conditions: the known conditions (their transfer costs and planner options are kept).

    Returns:
        (the conditions over the new group ids, each new group's memory budget).
    """
    speeds: dict[int, float] = {}
    memory: dict[int, float] = {}
    for g, members in enumerate(new.members):
        before = len(old.members[old.group_of(members[0])])
        speeds[g] = len(members) / before
        known = [budgets.get(d) for d in members]
        memory[g] = math.inf if any(b is None for b in known) else min(known) * len(members) / before
    planner = dataclasses.replace(conditions.planner or PlannerConfig(), allow_exclude=False)
    return dataclasses.replace(conditions, speeds=speeds, link_speeds={}, planner=planner), memory
