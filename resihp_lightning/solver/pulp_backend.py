"""The planning MILP through PuLP 3.x (``pulp<4``): CBC (bundled) or HiGHS (``highspy``).

The model is the same :class:`~resihp_lightning.solver.milp_model.MilpModel` the CP-SAT backend
solves (big-M rows instead of enforcement literals), driven per pipeline degree by
:func:`~resihp_lightning.solver.milp_driver.solve_by_degree`.

PuLP's own ``LpStatus`` says "Optimal" after CBC stops at its time limit with an incumbent, so the
status used here is the solver's own: CBC's solution status (``sol_status``, read from the first
line of its solution file: "Optimal" vs "Stopped on time - objective value ...") and HiGHS's model
status (``kOptimal`` vs ``kTimeLimit``). Only a proven optimum with ``relative_gap == 0`` is
reported as ``optimal``.

Warm start: CBC gets the hint as a MIP start (``warmStart=True``); HiGHS gets it through
``Highs.setSolution`` before the run.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile
import time
import warnings

import pulp

from resihp_lightning._logging import get_logger
from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import ConfigError
from resihp_lightning.plan import Plan, Problem
from resihp_lightning.solver.milp_driver import DegreeOutcome, MilpResult, solve_by_degree
from resihp_lightning.solver.milp_model import MilpModel

_log = get_logger(__name__)


def solve_pulp(problem: Problem, config: PlannerConfig | None = None, hint: Plan | None = None) -> Plan:
    """Solves ``problem`` with PuLP and the engine ``config.pulp_engine`` (``"cbc"`` or ``"highs"``).

    Args:
        problem: the planning problem (the config's model options override its own).
        config: planner options (engine, time limit, threads, relative gap, ...).
        hint: a feasible plan (normally the exact algorithm's) used as warm start and incumbent.

    Returns:
        The best plan found; ``status="optimal"`` only when the engine proved it.

    Raises:
        ConfigError: ``planner.pulp_engine="highs"`` but ``highspy`` is not installed.
        InfeasibleError: the engine proved that no plan fits (usually memory).
        ResiHPError: no plan was found within the time limit and no hint was given.
    """
    return solve_pulp_detailed(problem, config, hint).plan


def solve_pulp_detailed(problem: Problem, config: PlannerConfig | None = None, hint: Plan | None = None) -> MilpResult:
    """Like :func:`solve_pulp`, with the proven bound and gap (for benchmarks)."""
    config = config or PlannerConfig(solver="pulp")
    if config.pulp_engine == "highs":
        _require_highspy()
        solve_one = _solve_highs
    else:
        solve_one = _solve_cbc
    name = f"pulp-{config.pulp_engine}"
    return solve_by_degree(problem, config, hint, lambda m, left, h: solve_one(m, left, h, config), name)


def _require_highspy() -> None:
    try:
        import highspy  # noqa: F401
    except ImportError:
        raise ConfigError(
            "planner.pulp_engine='highs' needs the package highspy (pip install highspy); "
            "allowed without it: 'cbc'"
        ) from None


def _build(model: MilpModel, hint: list[int] | None) -> tuple[pulp.LpProblem, list[pulp.LpVariable]]:
    lp = pulp.LpProblem("resihp_plan", pulp.LpMinimize)
    xs = [
        lp.add_variable(f"v{i}", lowBound=v.lb, upBound=v.ub, cat=pulp.LpInteger if v.integer else pulp.LpContinuous)
        for i, v in enumerate(model.variables)
    ]
    lp += xs[model.objective]
    for k, con in enumerate(model.constraints):
        expr = pulp.LpAffineExpression([(xs[i], c) for i, c in con.terms])
        if con.lb is not None and con.ub is not None and con.lb == con.ub:
            lp += pulp.LpConstraint(expr, pulp.LpConstraintEQ, f"c{k}", con.lb)
            continue
        if con.lb is not None:
            lp += pulp.LpConstraint(expr, pulp.LpConstraintGE, f"c{k}l", con.lb)
        if con.ub is not None:
            lp += pulp.LpConstraint(expr, pulp.LpConstraintLE, f"c{k}u", con.ub)
    if hint is not None:
        for x, value in zip(xs, hint):
            x.setInitialValue(value)
    return lp, xs


def _values(model: MilpModel, xs: list[pulp.LpVariable]) -> list[int] | None:
    out = []
    for x in xs:
        value = x.value()
        if value is None:
            return None
        out.append(int(round(value)))
    return out


def _solve_cbc(model: MilpModel, seconds: float, hint: list[int] | None, config: PlannerConfig) -> DegreeOutcome:
    start = time.perf_counter()
    try:
        return _run_cbc(model, seconds, hint, config)
    except pulp.PulpSolverError as err:
        if hint is None:
            raise
        # The bundled CBC can crash (SIGSEGV) when its time limit expires while it is still
        # processing a MIP start; the hint is the incumbent anyway, so retry without it.
        _log.warning("CBC failed with a MIP start (%s); retrying without it", err)
    left = seconds - (time.perf_counter() - start)
    if left < 1:
        return DegreeOutcome("unknown")
    return _run_cbc(model, left, None, config)


def _run_cbc(model: MilpModel, seconds: float, hint: list[int] | None, config: PlannerConfig) -> DegreeOutcome:
    lp, xs = _build(model, hint)
    fd, log_path = tempfile.mkstemp(prefix="resihp_cbc_", suffix=".log")
    os.close(fd)
    try:
        with warnings.catch_warnings():  # PuLP 3.x says PULP_CBC_CMD goes in 4.0; we pin pulp<4
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = _cbc_cmd(
                msg=False,
                timeLimit=max(1, math.ceil(seconds)),  # CBC takes whole seconds
                # No "threads": the bundled CBC sometimes stalls until the time limit with it (even
                # with threads=1, idle, then "Stopped on time"); CBC runs one thread.
                gapRel=config.relative_gap,
                warmStart=hint is not None,
                logPath=log_path,
                options=[f"randomCbcSeed {config.random_seed + 1}"],  # CBC: seed 0 means "from the clock"
            )
        lp.solve(solver)
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            log_text = fh.read()
    finally:
        os.unlink(log_path)
    if lp.status == pulp.LpStatusInfeasible:
        return DegreeOutcome("infeasible")
    bound = _cbc_bound(log_text)
    if lp.sol_status == pulp.LpSolutionOptimal:
        return DegreeOutcome("optimal" if config.relative_gap == 0 else "feasible", _values(model, xs), bound)
    if lp.sol_status == pulp.LpSolutionIntegerFeasible:
        return DegreeOutcome("feasible", _values(model, xs), bound)
    return DegreeOutcome("unknown", None, bound)


def _cbc_bound(log_text: str) -> float | None:
    """CBC's proven lower bound, from its log ("Lower bound:" or "best possible")."""
    found = re.findall(r"Lower bound:\s+([-+0-9.eE]+)", log_text) or re.findall(
        r"best possible ([-+0-9.eE]+)", log_text
    )
    try:
        return float(found[-1]) if found else None
    except ValueError:
        return None


def _solve_highs(model: MilpModel, seconds: float, hint: list[int] | None, config: PlannerConfig) -> DegreeOutcome:
    import highspy

    lp, xs = _build(model, hint)
    solver = _WarmHiGHS(
        hint=hint,
        msg=False,
        timeLimit=max(seconds, 0.01),
        threads=config.num_workers,
        gapRel=config.relative_gap,
        random_seed=config.random_seed,
    )
    lp.solve(solver)
    highs = lp.solverModel
    status = highs.getModelStatus()
    info = highs.getInfo()
    bound = getattr(info, "mip_dual_bound", None)
    bound = bound if bound is not None and math.isfinite(bound) else None
    if status == highspy.HighsModelStatus.kInfeasible:
        return DegreeOutcome("infeasible")
    has_solution = getattr(info, "primal_solution_status", 0) == 2
    values = _values(model, xs) if has_solution else None
    if status == highspy.HighsModelStatus.kOptimal and values is not None:
        return DegreeOutcome("optimal" if config.relative_gap == 0 else "feasible", values, bound)
    return DegreeOutcome("feasible" if values is not None else "unknown", values, bound)


class _WarmHiGHS(pulp.HiGHS):
    """PuLP's HiGHS interface plus a MIP start (``Highs.setSolution``) from the hint."""

    def __init__(self, hint: list[int] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self._hint = hint

    def createAndConfigureSolver(self, lp) -> None:  # noqa: N802 - PuLP's name
        # highspy prints a banner on stdout (from C++) when the first Highs object is built; it
        # would end up in `resihp plan --json` output, so stdout's descriptor is muted meanwhile.
        with _muted_stdout():
            super().createAndConfigureSolver(lp)

    def callSolver(self, lp) -> None:  # noqa: N802 - PuLP's name
        if self._hint is not None:
            import highspy

            solution = highspy.HighsSolution()
            values = [0.0] * lp.solverModel.getNumCol()
            for var in lp.variables():
                values[var.index] = float(var.varValue) if var.varValue is not None else 0.0
            solution.col_value = values
            lp.solverModel.setSolution(solution)
        lp.solverModel.run()


def _cbc_cmd(**kwargs) -> pulp.LpSolver:
    """PuLP 3.x's bundled CBC."""
    return pulp.PULP_CBC_CMD(**kwargs)


@contextlib.contextmanager
def _muted_stdout():
    """Sends file descriptor 1 to /dev/null (C-level writes included) for the block."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
