"""Baseline adaptation policies over the same :class:`~resihp_lightning.plan.Problem`, for comparison with the planner.

Each policy is ``policy(problem, healthy_plan, config) -> Plan``: ``problem`` describes the devices as
they are now, ``healthy_plan`` the layout the job ran before the change (usually
:func:`healthy_plan`). Every returned plan carries ``iteration_ms`` from :func:`~resihp_lightning.plan.evaluate` on
``problem``; ``solver`` is the policy's name (``joint`` keeps the planner backend's name).

* ``none``: keep the healthy plan (throughput falls to about s of healthy with one device at speed s).
* ``microbatch_only``: keep devices and bounds, re-split the micro-batches across replicas
  (Greyhound-style); optimal for the model (exact split, see
  :func:`~resihp_lightning.solver.microbatch_split.split`); about
  (D - 1 + s) / D of healthy.
* ``repartition_only``: keep devices and micro-batch counts, choose one new stage partition for every
  replica (ResiHP-rule-style); exact by enumeration when the bounds vectors number at most
  :data:`REPARTITION_BUDGET`, otherwise a local search (status ``"feasible"``); about (P - 1 + s) / P.
* ``joint``: the planner (:func:`resihp_lightning.solver.solve`); about S / N minus granularity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import InfeasibleError
from resihp_lightning.plan import Plan, Problem, Replica, evaluate
from resihp_lightning.solver.enumeration import all_bounds, count_bounds
from resihp_lightning.solver.exact_model import Model
from resihp_lightning.solver.heuristic import Stages, bottleneck_bounds, local_search
from resihp_lightning.solver.microbatch_split import split

#: Bounds vectors ``repartition_only`` enumerates before it falls back to local search.
REPARTITION_BUDGET = 20_000

Policy = Callable[[Problem, Plan, PlannerConfig], Plan]


def healthy_plan(problem: Problem, config: PlannerConfig | None = None) -> Plan:
    """The best plan when every device has speed 1.0 (same devices, ids and options)."""
    from resihp_lightning.solver import solve

    plan = solve(problem.healthy(), config)
    return plan.with_result(iteration_ms=evaluate(problem.healthy(), plan).iteration_ms)


def _finish(problem: Problem, plan: Plan, name: str, status: str, start: float) -> Plan:
    return plan.with_result(
        iteration_ms=evaluate(problem, plan).iteration_ms,
        status=status,
        solver=name,
        solve_seconds=time.perf_counter() - start,
    )


def none(problem: Problem, healthy: Plan, config: PlannerConfig | None = None) -> Plan:
    """Keeps the healthy plan as it is."""
    start = time.perf_counter()
    return _finish(problem, Plan(healthy.replicas), "none", "given", start)


def _replica_classes(model: Model, problem: Problem, plan: Plan) -> list[tuple[int, ...]]:
    index = {}
    for k, cls in enumerate(model.classes):
        for device_id in cls.ids:
            index[device_id] = k
    return [tuple(index[d] for d in r.devices) for r in plan.replicas]


def microbatch_only(problem: Problem, healthy: Plan, config: PlannerConfig | None = None) -> Plan:
    """Keeps devices and bounds, re-splits the micro-batches optimally (exact for the model).

    Raises:
        InfeasibleError: no split fits in memory.
    """
    start = time.perf_counter()
    model = Model(problem)
    types = _replica_classes(model, problem, healthy)
    groups = [(*model.profile(t, r.bounds), 1) for t, r in zip(types, healthy.replicas)]
    result = split(groups, problem.micro_batches)
    if result is None:
        raise InfeasibleError("microbatch_only: no micro-batch split of the healthy layout fits in memory")
    counts = [row[0] for row in result[1]]
    plan = Plan(tuple(Replica(r.devices, r.bounds, m) for r, m in zip(healthy.replicas, counts)))
    return _finish(problem, plan, "microbatch_only", "optimal", start)


def repartition_only(problem: Problem, healthy: Plan, config: PlannerConfig | None = None) -> Plan:
    """Keeps devices and micro-batch counts, picks the best single partition for every replica.

    Raises:
        InfeasibleError: no partition fits in memory.
    """
    start = time.perf_counter()
    model = Model(problem)
    types = _replica_classes(model, problem, healthy)
    counts = [r.micro_batches for r in healthy.replicas]
    p = healthy.pipeline_degree

    def value(bounds) -> float:
        worst = 0.0
        for t, m in zip(types, counts):
            s, x, cap = model.profile(t, bounds)
            if cap < m:
                return math.inf
            worst = max(worst, s + (m - 1) * x)
        return worst

    best_b, best_v = None, math.inf
    if count_bounds(model.L, p, model.min_layers) <= REPARTITION_BUDGET:
        status = "optimal"
        for b in all_bounds(model.L, p, model.min_layers):
            v = value(b)
            if v < best_v:
                best_b, best_v = b, v
    else:
        status = "feasible"
        # Replicas with the same classes and count behave alike: one kind each.
        distinct = sorted(set(zip(types, counts)))
        kinds = [(t, 1) for t, _ in distinct]
        objective = _fixed_counts_objective([m for _, m in distinct])
        starts = {b for t, m in zip(types, counts) if (b := bottleneck_bounds(model, t, m)) is not None}
        starts |= {r.bounds for r in healthy.replicas}
        for b0 in sorted(starts):
            if any(b0[j + 1] - b0[j] < model.min_layers for j in range(p)):
                continue
            b, _ = local_search(Stages(model, kinds, b0), objective, model.min_layers)
            v = value(b)
            if v < best_v:
                best_b, best_v = b, v
    if best_b is None or math.isinf(best_v):
        raise InfeasibleError("repartition_only: no single partition of the healthy layout fits in memory")
    plan = Plan(tuple(Replica(r.devices, best_b, r.micro_batches) for r in healthy.replicas))
    return _finish(problem, plan, "repartition_only", status, start)


def _fixed_counts_objective(counts: list[int]):
    def objective(groups):
        values = []
        for (s, x, cap, _), m in zip(groups, counts):
            values.append(s + (m - 1) * x if cap >= m else math.inf)
        return (max(values), sum(values))

    return objective


def joint(problem: Problem, healthy: Plan, config: PlannerConfig | None = None) -> Plan:
    """The planner itself (:func:`resihp_lightning.solver.solve`); ``healthy`` is not needed."""
    from resihp_lightning.solver import solve

    return solve(problem, config)


POLICIES: dict[str, Policy] = {
    "none": none,
    "microbatch_only": microbatch_only,
    "repartition_only": repartition_only,
    "joint": joint,
}
