"""The planning MILP on OR-Tools CP-SAT (the default backend).

The model is :class:`~resihp_lightning.solver.milp_model.MilpModel` (integer units throughout), one
per pipeline degree, driven by :func:`~resihp_lightning.solver.milp_driver.solve_by_degree`.
CP-SAT runs with ``config.num_workers`` workers (never every core by default) and
``config.random_seed``; with more than one worker it uses ``interleave_search`` (CP-SAT's
deterministic parallel mode) with ``interleave_batch_size=1`` (the default batch slowed the proofs
down), so the same inputs give the same plan whenever the time limit is not hit. The time limit and
relative gap come from the config, and the exact algorithm's plan is a complete solution hint (every
variable, including the linearisation's auxiliaries) as well as the incumbent whose value cuts the
search (``T <= hint``).
"""

from __future__ import annotations

from ortools.sat.python import cp_model  # noqa: F401 - imported once here, not inside the timed solve

from resihp_lightning.config import PlannerConfig
from resihp_lightning.plan import Plan, Problem
from resihp_lightning.solver.milp_driver import DegreeOutcome, MilpResult, solve_by_degree
from resihp_lightning.solver.milp_model import MilpModel

_INT_MIN = -(2**62)
_INT_MAX = 2**62


def solve_cpsat(problem: Problem, config: PlannerConfig | None = None, hint: Plan | None = None) -> Plan:
    """Solves ``problem`` with CP-SAT.

    Args:
        problem: the planning problem (the config's model options override its own).
        config: planner options (time limit, workers, seed, relative gap, ...).
        hint: a feasible plan (normally the exact algorithm's) used as warm start and incumbent.

    Returns:
        The best plan found, ``status="optimal"`` only when CP-SAT proved it (and ``relative_gap`` is
        0), else ``"feasible"``; ``iteration_ms`` comes from :func:`~resihp_lightning.plan.evaluate`.

    Raises:
        InfeasibleError: CP-SAT proved that no plan fits (usually memory).
        ResiHPError: no plan was found within the time limit and no hint was given.
    """
    return solve_cpsat_detailed(problem, config, hint).plan


def solve_cpsat_detailed(problem: Problem, config: PlannerConfig | None = None, hint: Plan | None = None) -> MilpResult:
    """Like :func:`solve_cpsat`, with the proven bound and gap (for benchmarks)."""
    config = config or PlannerConfig()
    return solve_by_degree(problem, config, hint, lambda m, left, h: _solve_one(m, left, h, config), "cpsat")


def _solve_one(model: MilpModel, seconds: float, hint: list[int] | None, config: PlannerConfig) -> DegreeOutcome:
    cp = cp_model.CpModel()
    xs = [cp.new_int_var(v.lb, v.ub, "") for v in model.variables]
    for con in model.constraints:
        if con.indicator is not None:  # native enforcement instead of the big-M row
            lits, terms, lb, ub = con.indicator
            expr = cp_model.LinearExpr.weighted_sum([xs[i] for i, _ in terms], [c for _, c in terms])
            ct = cp.add_linear_constraint(expr, _INT_MIN if lb is None else lb, _INT_MAX if ub is None else ub)
            ct.only_enforce_if([xs[i] for i in lits])
            continue
        expr = cp_model.LinearExpr.weighted_sum([xs[i] for i, _ in con.terms], [c for _, c in con.terms])
        cp.add_linear_constraint(
            expr, _INT_MIN if con.lb is None else con.lb, _INT_MAX if con.ub is None else con.ub
        )
    cp.minimize(xs[model.objective])
    if hint is not None:  # in bulk: add_hint() per variable costs more than the whole solve here
        cp.proto.solution_hint.vars.extend(x.index for x in xs)
        cp.proto.solution_hint.values.extend(hint)
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.num_workers = config.num_workers
    params.random_seed = config.random_seed
    if config.num_workers > 1:
        # Deterministic parallel search; batches of one task keep it as quick as one worker here.
        params.interleave_search = True
        params.interleave_batch_size = 1
    params.max_time_in_seconds = max(seconds, 0.01)
    params.relative_gap_limit = config.relative_gap
    params.log_search_progress = False
    status = solver.solve(cp)
    if status == cp_model.INFEASIBLE:
        return DegreeOutcome("infeasible")
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        values = [solver.value(x) for x in xs]
        proven = status == cp_model.OPTIMAL and config.relative_gap == 0
        return DegreeOutcome("optimal" if proven else "feasible", values, solver.best_objective_bound)
    return DegreeOutcome("unknown", None, None)
