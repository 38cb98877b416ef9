"""The driver of the MILP backends: one :class:`~.milp_model.MilpModel` per pipeline degree.

:func:`solve_by_degree` is what :mod:`.cpsat` and :mod:`.pulp_backend` run; they only supply
``solve_one``, which hands one model to their engine. It decides P, D, placement, bounds and
micro-batches jointly over :meth:`Problem.candidate_shapes <resihp_lightning.plan.Problem.candidate_shapes>`:

* **Order and pruning.** The P of the hint comes first, then the others by their proven lower bound
  (:func:`lower_bound_ms`); a P whose bound cannot beat the incumbent by more than
  ``relative_gap`` is not solved, and its bound still counts in the proof.
* **Hint.** A feasible plan (normally the exact planner's) is the first incumbent. Each model is
  built with the current incumbent's time as its cutoff (an upper bound on T, up to rounding), and
  the incumbent is encoded as a complete assignment of that model
  (:meth:`~.milp_model.MilpModel.encode`) for the engine's warm start.
* **Time budget.** ``config.time_limit_s`` covers the whole call: each engine run gets what is left,
  building a model counts against it, and a P reached with no time left is skipped (not proven).
* **Result.** Each decoded plan is re-priced with :func:`~resihp_lightning.plan.evaluate`, and the
  best plan is returned with that ``iteration_ms``. It is ``"optimal"`` only when every P was
  solved to optimality or infeasibility, or pruned, and ``relative_gap`` is 0.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from resihp_lightning._logging import get_logger
from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import InfeasibleError, PlanError, ResiHPError
from resihp_lightning.plan import Plan, Problem, evaluate, prefix_sums
from resihp_lightning.solver.bounds import shape_lower_bound
from resihp_lightning.solver.milp_model import MilpModel, choose_time_scale, data_degrees

_log = get_logger(__name__)


def pipeline_degrees(problem: Problem) -> list[int]:
    """The P values of :meth:`Problem.candidate_shapes <resihp_lightning.plan.Problem.candidate_shapes>`, ascending."""
    return sorted({p for p, _ in problem.candidate_shapes()})


def lower_bound_ms(problem: Problem, pipeline_degree: int) -> float:
    """A proven lower bound on T over every plan with this P (``inf`` when no D is allowed).

    The least :func:`~resihp_lightning.solver.bounds.shape_lower_bound` over the D allowed with P.
    """
    return min(
        (shape_lower_bound(problem, pipeline_degree, d) for d in data_degrees(problem, pipeline_degree)),
        default=math.inf,
    )


def crude_upper_ms(problem: Problem) -> float:
    """An upper bound on any plan's T (all layers on the slowest device, every micro-batch serial)."""
    compute = prefix_sums(problem).compute[-1]
    slowest = min(d.speed for d in problem.devices)
    u_max = max(d.link_slowdown for d in problem.devices)  # a middle stage pays p2p (2u - 1)
    stage = compute / slowest + problem.p2p_ms * (2 * u_max - 1)
    return problem.allreduce_ms * u_max + (problem.micro_batches + problem.num_layers) * stage


@dataclass(frozen=True)
class DegreeOutcome:
    """What a backend reports for one P: ``status`` is ``optimal`` / ``infeasible`` (both proven),
    ``feasible`` (stopped with a solution) or ``unknown`` (stopped without one)."""

    status: str
    values: list[int] | None = None
    bound_units: float | None = None


@dataclass(frozen=True)
class MilpResult:
    """A backend's answer with the proof it has.

    Attributes:
        plan: the plan returned (its ``iteration_ms`` from :func:`~resihp_lightning.plan.evaluate`).
        bound_ms: proven lower bound on the optimum over all P (up to rounding).
        gap: ``(T - bound) / T``, 0 when proven optimal.
        proven: every P was solved to optimality/infeasibility or pruned by its bound.
        degrees_solved: P values whose model was handed to the engine.
    """

    plan: Plan
    bound_ms: float
    gap: float
    proven: bool
    degrees_solved: tuple[int, ...]


def solve_by_degree(
    problem: Problem,
    config: PlannerConfig,
    hint: Plan | None,
    solve_one: Callable[[MilpModel, float, list[int] | None], DegreeOutcome],
    solver_name: str,
) -> MilpResult:
    """Solves the MILP for every allowed P (most promising first) and keeps the best plan.

    Args:
        problem: the problem (``config``'s model options are applied here).
        config: a :class:`~resihp_lightning.config.PlannerConfig`.
        hint: a feasible plan to start from (warm start and incumbent), or ``None``.
        solve_one: ``solve_one(model, seconds_left, hint_values) -> DegreeOutcome``.
        solver_name: written into the plan's ``solver``.

    Raises:
        InfeasibleError: every P is proven infeasible (memory or device counts).
        ResiHPError: the time limit ran out before any plan was found and there is no hint.
    """
    start = time.perf_counter()
    deadline = start + config.time_limit_s
    problem = config.apply_to(problem)
    degrees = pipeline_degrees(problem)
    if not degrees:
        raise InfeasibleError(
            f"no pipeline degree fits: {problem.num_devices} devices, {problem.num_layers} layers, "
            f"{problem.micro_batches} micro-batches, pipeline_degrees={problem.pipeline_degrees}"
        )
    best_plan: Plan | None = None
    best_ms = math.inf
    if hint is not None:
        try:
            ev = evaluate(problem, hint)
            if ev.fits_memory:
                best_plan, best_ms = hint, ev.iteration_ms
            else:
                _log.warning("hint ignored: it does not fit memory")
        except PlanError as err:
            _log.warning("hint ignored: %s", err)
    scale = choose_time_scale(best_ms if best_plan is not None else crude_upper_ms(problem))
    bounds = {p: lower_bound_ms(problem, p) for p in degrees}
    hint_p = best_plan.pipeline_degree if best_plan is not None else None
    order = sorted(degrees, key=lambda p: (p != hint_p, bounds[p], p))
    gap_target = config.relative_gap
    proven = True
    bound_ms = math.inf
    solved: list[int] = []
    for p in order:
        if best_plan is not None and bounds[p] >= best_ms * (1 - gap_target) - 1e-9 * best_ms:
            bound_ms = min(bound_ms, bounds[p])
            continue
        left = deadline - time.perf_counter()
        if left <= 0.01:
            proven = False
            bound_ms = min(bound_ms, bounds[p])
            continue
        model = MilpModel(problem, p, scale, cutoff_ms=best_ms if best_plan is not None else None)
        if model.infeasible:
            continue
        hint_values = model.encode(best_plan) if best_plan is not None else None
        began = time.perf_counter()
        left = deadline - began  # building the model counts against the limit too
        if left <= 0.01:
            proven = False
            bound_ms = min(bound_ms, bounds[p])
            continue
        solved.append(p)
        outcome = solve_one(model, left, hint_values)
        _log.debug(
            "%s P=%d: %d vars, %d constraints, hint %s, %s in %.3f s, bound %s, lower bound %.4f, incumbent %.4f",
            solver_name, p, len(model.variables), len(model.constraints), hint_values is not None,
            outcome.status, time.perf_counter() - began,
            None if outcome.bound_units is None else outcome.bound_units / scale, bounds[p], best_ms,
        )
        if outcome.values is not None:
            plan = model.decode(outcome.values)
            ev = evaluate(problem, plan)
            if ev.fits_memory and ev.iteration_ms < best_ms * (1 - 1e-12):
                best_plan, best_ms = plan, ev.iteration_ms
        if outcome.status == "optimal" and outcome.values is not None:
            bound_ms = min(bound_ms, model.objective_ms(outcome.values))
        elif outcome.status == "infeasible":
            if model.variables[model.objective].ub < math.inf and best_plan is not None:
                bound_ms = min(bound_ms, best_ms)
        else:
            proven = False
            found = outcome.bound_units / scale if outcome.bound_units is not None else -math.inf
            bound_ms = min(bound_ms, max(bounds[p], found))
    elapsed = time.perf_counter() - start
    if best_plan is None:
        if proven:
            raise InfeasibleError(
                f"no plan satisfies the constraints (memory, min_layers_per_stage, pipeline_degrees) for "
                f"pipeline degrees {degrees}"
            )
        raise ResiHPError(
            f"{solver_name} found no plan within planner.time_limit_s={config.time_limit_s}; "
            "raise it or use planner.solver='exact'"
        )
    bound_ms = min(bound_ms, best_ms)
    if proven and gap_target == 0:
        bound_ms = best_ms  # optimal up to the model's rounding (module docstring)
    gap = max(0.0, (best_ms - bound_ms) / best_ms) if best_ms > 0 else 0.0
    status = "optimal" if proven and gap_target == 0 else "feasible"
    plan = best_plan.with_result(iteration_ms=best_ms, status=status, gap=gap, solver=solver_name, solve_seconds=elapsed)
    return MilpResult(plan, bound_ms, gap, proven, tuple(solved))

