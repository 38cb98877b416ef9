"""Planner backends over :class:`~resihp_lightning.plan.Problem`.

``solve(problem, config)`` dispatches to the backend named by ``config.solver``:

* ``"exact"``: the combinatorial search of :mod:`resihp_lightning.solver.exact`, with a work budget
  of ``time_limit_s`` x :data:`~resihp_lightning.solver.exact.UNITS_PER_SECOND` (deterministic: the
  same problem and config give the same plan and status on any machine).
* ``"cpsat"`` / ``"pulp"``: the exact search runs first (warm start and fallback); its plan is the
  hint of the MILP (:mod:`resihp_lightning.solver.cpsat`, :mod:`resihp_lightning.solver.pulp_backend`),
  and the better of the two plans is returned, so a MILP stopped by its time limit is never worse
  than the exact search. ``status`` is ``"optimal"`` only when some backend proved optimality. The
  warm start's time counts against ``time_limit_s``; the MILP gets the rest.

``solve(problem, config, cutoff=T)`` asks only for a plan faster than ``T`` (a plan of another
problem that the caller may take instead, e.g. another grouping of GPUs into tensor-parallel groups,
:mod:`resihp_lightning.solver.tensor_search`): the exact search starts from ``T`` as its incumbent,
so most shapes close at once, and :class:`~resihp_lightning.solver.exact.NoBetterPlan` says when
there is none.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import time

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import InfeasibleError
from resihp_lightning.plan import Plan, Problem, evaluate

__all__ = ["solve", "InfeasibleError", "NoBetterPlan"]

_MILP_BACKENDS = {
    "cpsat": ("resihp_lightning.solver.cpsat", "solve_cpsat"),
    "pulp": ("resihp_lightning.solver.pulp_backend", "solve_pulp"),
}


def solve(problem: Problem, config: PlannerConfig | None = None, *, cutoff: float | None = None) -> Plan:
    """Plans ``problem`` with the backend of ``config`` (default: ``PlannerConfig()``, CP-SAT).

    Args:
        problem: the planning problem; the config's model options (pipeline degrees, shared
            partition, exclusion, minimum layers per stage) are written over it first.
        config: planner options.
        cutoff: only plans strictly faster than this (ms) are sought; the exact search starts from
            it as an incumbent without a layout. ``None``: any plan.

    Returns:
        The plan with ``iteration_ms`` (from :func:`~resihp_lightning.plan.evaluate`), ``status``,
        ``solver`` and ``solve_seconds`` (the whole call); with a ``cutoff``, faster than it.

    Raises:
        InfeasibleError: no plan fits (one line naming the reason, usually memory); not raised with
            a ``cutoff``.
        NoBetterPlan: with a ``cutoff``, no plan faster than it was found; its ``proven`` says
            whether none exists, its ``bound_ms`` is a proven lower bound on the optimum.
    """
    from resihp_lightning.solver.exact import (
        DECOMPOSITION_BUDGET,
        NoBetterPlan,
        DECOMPOSITION_UNITS_PER_SECOND,
        DEFAULT_BUDGET,
        UNITS_PER_SECOND,
        relative_gap,
        solve_exact,
    )

    config = config or PlannerConfig()
    problem = config.apply_to(problem)
    start = time.perf_counter()
    # As the chosen backend the exact search may use the time limit (as a deterministic work
    # budget); as a warm start it stays short so that the MILP gets the time.
    chosen = config.solver == "exact"
    budget = max(DEFAULT_BUDGET, int(config.time_limit_s * UNITS_PER_SECOND)) if chosen else DEFAULT_BUDGET
    split_budget = (
        max(DECOMPOSITION_BUDGET, int(config.time_limit_s * DECOMPOSITION_UNITS_PER_SECOND)) if chosen else DECOMPOSITION_BUDGET
    )
    try:
        exact_plan = solve_exact(problem, budget=budget, decomposition_budget=split_budget, cutoff=cutoff)
    except InfeasibleError as error:
        if config.solver == "exact" or getattr(error, "proven", True):
            raise
        exact_plan = None  # the heuristic phase found nothing: the MILP decides without a hint
    except NoBetterPlan as nothing:
        if chosen or nothing.proven:
            raise
        # Not proven: the MILP decides without a hint, and its plan must still beat the cutoff.
        return _milp_below(problem, config, cutoff, start)
    if chosen:
        return exact_plan.with_result(solve_seconds=time.perf_counter() - start)
    if exact_plan is not None and exact_plan.status == "optimal":
        # Proven already (normally by the decomposition): the MILP could only prove it again.
        return exact_plan.with_result(solver=config.solver, solve_seconds=time.perf_counter() - start)
    module_name, function_name = _MILP_BACKENDS[config.solver]
    backend = getattr(importlib.import_module(module_name), function_name)
    # The warm start's time counts against the limit: the MILP gets what is left of it.
    left = max(config.time_limit_s - (time.perf_counter() - start), 1e-3)
    milp_plan = backend(problem, dataclasses.replace(config, time_limit_s=left), exact_plan)
    milp_value = evaluate(problem, milp_plan).iteration_ms
    if exact_plan is None:
        return milp_plan.with_result(
            iteration_ms=milp_value, solver=config.solver, solve_seconds=time.perf_counter() - start
        )
    proved = milp_plan.status == "optimal" or exact_plan.status == "optimal"
    if milp_value < exact_plan.iteration_ms:
        best = milp_plan.with_result(iteration_ms=milp_value)
    else:
        best = exact_plan.with_result(solver=config.solver)
    # Both searches proved a lower bound on the optimum; the larger one gives the gap.
    bound = max(_bound(exact_plan), _bound(milp_plan.with_result(iteration_ms=milp_value)))
    return best.with_result(
        status="optimal" if proved else best.status,
        gap=0.0 if proved else relative_gap(best.iteration_ms, bound),
        solver=config.solver,
        solve_seconds=time.perf_counter() - start,
    )


def __getattr__(name: str):
    # NoBetterPlan lives with the exact search, imported on first use (``import resihp_lightning.solver`` stays light).
    if name == "NoBetterPlan":
        from resihp_lightning.solver.exact import NoBetterPlan

        return NoBetterPlan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _milp_below(problem: Problem, config: PlannerConfig, cutoff: float, start: float) -> Plan:
    """The MILP's plan when the exact search found nothing below ``cutoff`` and could not prove that
    nothing is; :class:`~resihp_lightning.solver.exact.NoBetterPlan` unless the MILP's plan is faster than ``cutoff``."""
    from resihp_lightning.errors import ResiHPError
    from resihp_lightning.solver.exact import NoBetterPlan

    module_name, function_name = _MILP_BACKENDS[config.solver]
    backend = getattr(importlib.import_module(module_name), function_name)
    left = max(config.time_limit_s - (time.perf_counter() - start), 1e-3)
    try:
        plan = backend(problem, dataclasses.replace(config, time_limit_s=left), None)
    except InfeasibleError:
        raise NoBetterPlan("no plan fits, so none is faster than the cutoff", proven=True, bound_ms=cutoff) from None
    except ResiHPError:
        raise NoBetterPlan(f"no plan faster than the cutoff {cutoff:g} ms was found within the time limit",
                           proven=False, bound_ms=-math.inf) from None
    value = evaluate(problem, plan).iteration_ms
    if value < cutoff - 1e-12 * max(1.0, abs(cutoff)):
        return plan.with_result(iteration_ms=value, solver=config.solver, solve_seconds=time.perf_counter() - start)
    proven = plan.status == "optimal"
    raise NoBetterPlan(f"no plan faster than the cutoff {cutoff:g} ms" + (" exists" if proven else " was found"),
                       proven=proven, bound_ms=cutoff if proven else min(cutoff, _bound(plan.with_result(iteration_ms=value))))


def _bound(plan: Plan) -> float:
    """The proven lower bound behind a plan's ``gap`` (``-inf`` when it has none)."""
    if plan.gap is None or plan.iteration_ms is None:
        return -math.inf
    return plan.iteration_ms * (1.0 - plan.gap)
