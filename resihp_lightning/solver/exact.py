"""The ``exact`` backend: a combinatorial planner for the planning model (docs/architecture.md).

:func:`solve_exact` runs two phases: a fast heuristic (the incumbent, see
:mod:`resihp_lightning.solver.heuristic`), then a complete search that either proves the incumbent
optimal or replaces it with the optimum, within a work budget. Both work on the class-level model of
:mod:`resihp_lightning.solver.exact_model`.

* **Exact phase** (this module; status ``"optimal"`` when it completes). Devices are grouped into
  classes of equal (speed, link slowdown, memory); devices of one class are interchangeable, and so
  is the order of the replicas. For every shape (P, D) of :meth:`Problem.candidate_shapes <resihp_lightning.plan.Problem.candidate_shapes>` (pruned by
  :func:`~resihp_lightning.solver.bounds.shape_lower_bound`), every choice of how many devices of each
  class to use (``allow_exclude``), and every assignment of classes to the P x D grid up to replica
  order (:mod:`resihp_lightning.solver.enumeration`), it searches the stage bounds:

  - shared partition: branch and bound over the bounds, stage by stage, all replica kinds priced at
    once; a node is cut when a valid lower bound cannot beat the incumbent: partial stage sums and
    maxima plus the least the remaining layers can add (their compute over the fastest remaining
    device for the sum; for the max, their compute over the remaining devices' total speed, and
    :meth:`Model.layer_bound <.exact_model.Model.layer_bound>`, which counts whole layers), partial memory caps, and a fractional
    micro-batch split (:func:`~resihp_lightning.solver.microbatch_split.fluid_value`);
  - per-replica partitions: replicas are independent given their micro-batch counts, so for a
    limit just below the incumbent every replica kind gets the most micro-batches it can run within
    the limit (a branch and bound over its bounds with the same lower bounds, or, for a replica of
    one class whose stage sum is fixed, an exact bottleneck dynamic programme per in-flight level);
    when they add up to M the layout beats the incumbent and the question is asked again below the
    new value, else the layout is done. Without any incumbent (the heuristic found nothing) every
    bounds vector is priced instead, reduced to ``f(m) = min_b T_r(b, m)`` and split greedily.

  A layout fixes which classes are used, hence its all-reduce (``allreduce_ms`` times the slowest
  link among them, :meth:`Model.grid_allreduce <.exact_model.Model.grid_allreduce>`), and each class's stage position, hence its
  transfer terms. For fixed per-replica costs the micro-batch split is solved exactly
  (:mod:`resihp_lightning.solver.microbatch_split`). A completed search is a proof of optimality for
  the model.

  Its work is counted in units (one priced bounds vector or branch-and-bound child): at
  most ``budget`` (:data:`DEFAULT_BUDGET` as a MILP warm start, ``time_limit_s`` x
  :data:`UNITS_PER_SECOND` as the chosen backend). Past it the result is the best plan seen, status
  ``"feasible"``. Measured: every test problem completes; the 16-device, 32-layer examples complete
  in 10 153 (shared partition) and 6 255 (per replica) units; 32-1024 devices with 96-128 layers
  mostly do not (the MILP backends prove those).

* **Heuristic phase** (the incumbent; not claimed optimal): bottleneck-minimal partitions of a few
  placements per shape, polished by local search; see :mod:`resihp_lightning.solver.heuristic`.
"""

from __future__ import annotations

import math
import time
from collections import Counter

from resihp_lightning.errors import InfeasibleError
from resihp_lightning.plan import Plan, Problem, evaluate
from resihp_lightning.solver.bounds import shape_lower_bound
from resihp_lightning.solver.decomposition import decomposition_search
from resihp_lightning.solver.enumeration import all_bounds, count_bounds, layouts, used_vectors
from resihp_lightning.solver.exact_model import Best, Model, build_plan
from resihp_lightning.solver.heuristic import heuristic_search
from resihp_lightning.solver.replica_search import BudgetExceeded, max_micro_batches, max_micro_batches_pure
from resihp_lightning.solver.microbatch_split import count, fluid_value, split, split_functions, split_value

#: Work units (priced bounds candidates / branch-and-bound children) of the exact phase when it is a
#: warm start (kept small, so that the MILP gets the time).
DEFAULT_BUDGET = 12_000
#: Work units per second of ``time_limit_s`` when ``exact`` is the chosen backend (a deterministic
#: stand-in for a time limit; see benchmarks/README.md for solve times).
UNITS_PER_SECOND = 20_000
#: Work units of the decomposition by shape (:mod:`resihp_lightning.solver.decomposition`) in
#: :func:`solve_exact` (about 0.5 s); it runs before the layout enumeration and usually finishes
#: far below this.
DECOMPOSITION_BUDGET = 100_000
#: Decomposition units per second of ``time_limit_s`` when ``exact`` is the chosen backend.
DECOMPOSITION_UNITS_PER_SECOND = 200_000


# ----------------------------------------------------------------------------------- exact phase
def _exact_shared(model: Model, p: int, d: int, grid: tuple, best: Best, ticks: list[int], budget: int) -> None:
    """Branch and bound over the shared bounds of one layout (complete: prunes only by valid bounds).

    Stages are fixed left to right. A node's lower bound prices every replica kind with the partial
    sums and maxima of its stage times plus the least the remaining layers can add (their compute over
    the fastest remaining device for the sum, over the remaining devices' total speed for the max),
    with the partial memory caps (caps only fall as stages are added), through :func:`split_value`,
    which is monotone in all three.
    """
    problem = model.problem
    allreduce = model.grid_allreduce(grid, d)
    kinds = list(Counter(grid).items())
    n_kinds = len(kinds)
    counts = [n for _, n in kinds]
    speeds = [[model.classes[c].speed for c in t] for t, _ in kinds]
    suffix_max = [[max(sp[j:]) for j in range(p)] for sp in speeds]
    suffix_sum = [[sum(sp[j:]) for j in range(p)] for sp in speeds]
    suffix_speeds = [[tuple(sp[j:]) for j in range(p)] for sp in speeds]
    pc, big_l, min_l, total_mb = model.pc, model.L, model.min_layers, model.M
    bounds = [0] * (p + 1)
    bounds[p] = big_l

    def lower(j: int, a: int, sums: list[float], maxes: list[float], caps: list[int]) -> float:
        rest = pc[big_l] - pc[a]
        p2p_rest = problem.p2p_ms * max(0, p - 1 - j)
        groups = [
            (
                sums[k] + rest / suffix_max[k][j] + p2p_rest,
                max(maxes[k], rest / suffix_sum[k][j], model.layer_bound(suffix_speeds[k][j], a)),
                caps[k],
                counts[k],
            )
            for k in range(n_kinds)
        ]
        return fluid_value(groups, total_mb) + allreduce

    def cutoff() -> float:
        if math.isinf(best.value):
            return math.inf
        return best.value - 1e-12 * max(1.0, abs(best.value))

    def visit(j: int, a: int, sums: list[float], maxes: list[float], caps: list[int]) -> None:
        ticks[0] += 1
        if ticks[0] > budget:
            raise BudgetExceeded
        last = j == p - 1
        first_b = big_l if last else a + min_l
        last_b = big_l if last else big_l - (p - 1 - j) * min_l
        for b in range(first_b, last_b + 1):
            ticks[0] += 1
            new_sums, new_maxes, new_caps = [], [], []
            for k, (types, _) in enumerate(kinds):
                t = model.stage_time(a, b, types[j], j, p)
                new_sums.append(sums[k] + t)
                new_maxes.append(max(maxes[k], t))
                new_caps.append(min(caps[k], model.stage_cap(a, b, types[j], p - j)))
            if min(new_caps) < 1:
                break  # more layers only need more memory
            if last:
                groups = [(new_sums[k], new_maxes[k], new_caps[k], counts[k]) for k in range(n_kinds)]
                value = split_value(groups, total_mb) + allreduce
                if value < cutoff():
                    bounds[p] = b
                    result = split(groups, total_mb)
                    flat_grid, flat_counts = [], []
                    for (t, _), row in zip(kinds, result[1]):
                        flat_grid.extend([t] * len(row))
                        flat_counts.extend(row)
                    best.offer(value, flat_grid, [tuple(bounds)] * d, flat_counts)
            elif lower(j + 1, b, new_sums, new_maxes, new_caps) < cutoff():
                bounds[j + 1] = b
                visit(j + 1, b, new_sums, new_maxes, new_caps)

    zeros = [0.0] * n_kinds
    if lower(0, 0, zeros, zeros, [total_mb] * n_kinds) < cutoff():
        visit(0, 0, zeros, zeros, [total_mb] * n_kinds)


def _exact_per_replica(
    model: Model, p: int, d: int, grid: tuple, best: Best, ticks: list[int], budget: int, cache: dict
) -> None:
    allreduce = model.grid_allreduce(grid, d)
    m_top = model.M - d + 1
    funcs, argb = [], []
    for t in grid:
        if t not in cache:
            n_bounds = count_bounds(model.L, p, model.min_layers)
            ticks[0] += n_bounds
            if ticks[0] > budget:
                raise BudgetExceeded
            f = [math.inf] * (model.M + 2)
            fb: list[tuple[int, ...] | None] = [None] * (model.M + 2)
            for b in all_bounds(model.L, p, model.min_layers):
                s, x, cap = model.profile(t, b)
                for m in range(1, min(cap, model.M) + 1):
                    v = s + (m - 1) * x
                    if v < f[m]:
                        f[m], fb[m] = v, b
            cache[t] = (f, fb)
        f, fb = cache[t]
        funcs.append(f[: m_top + 1] + [math.inf] * (model.M + 2 - m_top - 1))
        argb.append(fb)
    result = split_functions(funcs, model.M)
    if result is None:
        return
    value, counts = result
    best.offer(value + allreduce, grid, [argb[r][counts[r]] for r in range(d)], counts)


def _exact_per_replica_bnb(
    model: Model, p: int, d: int, grid: tuple, best: Best, ticks: list[int], budget: int, cache: dict
) -> None:
    """Per-replica partitions with an incumbent: asks "can every replica finish below it?" per kind.

    With ``limit`` just below the incumbent (minus the all-reduce), each replica kind's most
    micro-batches within ``limit`` come from :func:`max_micro_batches`; when they sum to M the
    kinds' bounds give a strictly better plan (its exact split is taken) and the question is asked
    again, else this layout cannot beat the incumbent. Each round lowers the incumbent, so it ends.
    """
    allreduce = model.grid_allreduce(grid, d)
    kinds = list(Counter(grid).items())
    most = model.M - d + 1
    while True:
        cutoff = best.value - 1e-12 * max(1.0, abs(best.value))
        limit = cutoff - allreduce
        if limit <= 0:
            return
        # Upper bounds per kind (from the whole-replica lower bounds on S and X) say how many
        # micro-batches each kind must at least reach for the others to make up M.
        upper = {}
        for types, _ in kinds:
            speeds = tuple(model.classes[c].speed for c in types)
            compute = model.pc[-1]
            total_lb = compute / max(speeds) + model.min_p2p_sum(types, p)
            worst_lb = max(compute / sum(speeds), model.layer_bound(speeds, 0))
            upper[types] = count(limit, total_lb, worst_lb, most)
        found = []
        for types, n in kinds:
            others = sum(n_o * upper[t_o] for t_o, n_o in kinds if t_o != types)
            at_least = max(1, -(-(model.M - others) // n))
            if at_least > upper[types]:
                return
            key = (types, limit)
            known = cache.get(key)
            if known is None or (known[1] is None and known[0] >= at_least):
                if len(set(types)) == 1:
                    known = max_micro_batches_pure(model, types[0], p, limit, most, ticks, budget, cache)
                else:
                    known = max_micro_batches(model, types, limit, most, ticks, budget, at_least)
                cache[key] = known
            m, bounds = known
            if bounds is None or m < at_least:
                return
            upper[types] = m
            found.append((types, n, m, bounds))
        if sum(n * m for _, n, m, _ in found) < model.M:
            return
        groups = [(*model.profile(types, bounds), n) for types, n, _, bounds in found]
        result = split(groups, model.M)
        if result is None or result[0] + allreduce >= cutoff:
            return  # rounding at the limit: nothing strictly better
        flat_grid, flat_bounds, flat_counts = [], [], []
        for (types, _, _, bounds), row in zip(found, result[1]):
            flat_grid.extend([types] * len(row))
            flat_bounds.extend([bounds] * len(row))
            flat_counts.extend(row)
        best.offer(result[0] + allreduce, flat_grid, flat_bounds, flat_counts)


def exact_search(model: Model, budget: int, best: Best) -> None:
    """The complete search of the exact phase, into ``best``; raises ``BudgetExceeded`` past ``budget``."""
    problem = model.problem
    ticks = [0]
    counts = [len(c.ids) for c in model.classes]
    shapes = sorted(problem.candidate_shapes(), key=lambda s: shape_lower_bound(problem, *s))
    incumbent = not math.isinf(best.value)

    def spend() -> None:  # a node of the layout enumeration
        ticks[0] += 1
        if ticks[0] > budget:
            raise BudgetExceeded

    if not problem.shared_partition and not incumbent:
        if sum(count_bounds(model.L, p, model.min_layers) for p, _ in shapes) > budget:
            raise BudgetExceeded  # per-replica enumeration cannot finish: do not spend the time
    for p, d in shapes:
        if shape_lower_bound(problem, p, d) >= best.value:
            continue
        cache: dict = {}
        for used in used_vectors(counts, p * d, problem.allow_exclude):
            for grid in layouts(p, d, used, spend):
                ticks[0] += 1
                if ticks[0] > budget:
                    raise BudgetExceeded
                if problem.shared_partition:
                    _exact_shared(model, p, d, grid, best, ticks, budget)
                elif incumbent:
                    _exact_per_replica_bnb(model, p, d, grid, best, ticks, budget, cache)
                else:
                    _exact_per_replica(model, p, d, grid, best, ticks, budget, cache)


# ----------------------------------------------------------------------------------------- entry
def infeasible_reason(problem: Problem) -> str:
    """One line saying why no plan exists (called when the search found none)."""
    shapes = problem.candidate_shapes()
    if not shapes:
        return (
            f"no pipeline degree fits: {problem.num_devices} devices, {problem.num_layers} layers, "
            f"{problem.micro_batches} micro-batches, min_layers_per_stage={problem.min_layers_per_stage}, "
            f"pipeline_degrees={list(problem.pipeline_degrees) if problem.pipeline_degrees else 'any'}"
            + ("" if problem.allow_exclude else ", allow_exclude=false")
            + (f", min_data_degree={problem.min_data_degree}" if problem.min_data_degree > 1 else "")
        )
    biggest = max(problem.devices, key=lambda dv: dv.memory_mb)
    heaviest = max(problem.layers, key=lambda la: la.static_mb + la.activation_mb)
    total_static = sum(la.static_mb for la in problem.layers)
    return (
        "no layout fits in memory: every pipeline degree "
        f"{sorted({s[0] for s in shapes})} overflows some device (largest memory_mb "
        f"{biggest.memory_mb:g} on device {biggest.id}; the model's static_mb totals {total_static:g}, "
        f"the heaviest layer needs {heaviest.static_mb + heaviest.activation_mb:g} MB with one micro-batch)"
    )


class NoBetterPlan(Exception):
    """No plan faster than the caller's ``cutoff`` was found (:func:`solve_exact`, :func:`resihp_lightning.solver.solve`).

    Attributes:
        proven: the search was complete: no plan of the problem is faster than the cutoff (an
            infeasible problem included).
        bound_ms: a proven lower bound on the problem's optimum (the cutoff itself when ``proven``).
    """

    def __init__(self, message: str, *, proven: bool, bound_ms: float) -> None:
        super().__init__(message)
        self.proven = proven
        self.bound_ms = bound_ms


class _FirstBelow(Best):
    """An incumbent that stops the search at the first layout offered below it (:func:`solve_exact`'s ``first``)."""

    def offer(self, value: float, grid, bounds, counts) -> None:
        super().offer(value, grid, bounds, counts)
        if self.grid:
            raise _Found


class _Found(Exception):
    """A layout below the cutoff was found and the caller asked for no more."""


def solve_exact(problem: Problem, *, budget: int = DEFAULT_BUDGET, decomposition_budget: int = DECOMPOSITION_BUDGET,
                cutoff: float | None = None, first: bool = False, bounds: bool = True) -> Plan:
    """Plans ``problem`` with the exact combinatorial search (heuristic beyond ``budget``).

    The heuristic phase finds the incumbent, the decomposition by shape
    (:mod:`resihp_lightning.solver.decomposition`, ``decomposition_budget`` units) tries to prove
    it optimal or improves it, and the layout enumeration of this module (``budget`` units) runs
    only when the decomposition left a shape open.

    Args:
        problem: the planning problem.
        budget: work units of the layout enumeration.
        decomposition_budget: work units of the decomposition by shape.
        cutoff: an incumbent value from outside (e.g. another problem's plan that the caller may
            take instead): the search starts from it as if it had a plan of that value (the
            heuristic phase is skipped), so shapes that cannot beat it close at once, and only
            strictly faster plans are kept.
        first: with a ``cutoff``, return the first plan found faster than it (status
            ``"feasible"``, not improved further): the answer to "can this problem beat the
            cutoff?" without the cost of its optimum. Only the decomposition asks (no layout
            enumeration, no bounds for shapes it leaves open), so a "no" is proven only when it
            closes every shape.
        bounds: bisect a lower bound for every shape the decomposition leaves open (the gap of an
            unproven plan, or ``NoBetterPlan.bound_ms``); ``False`` reports the shapes' cheap
            bounds instead, for callers that only ask whether the search closes.

    Returns:
        The plan with ``iteration_ms`` (from :func:`~resihp_lightning.plan.evaluate`), ``status`` ``"optimal"`` when a
        complete search finished and ``"feasible"`` otherwise, ``gap`` (the proven relative gap,
        0.0 when optimal), ``solver="exact"`` and ``solve_seconds``. With a ``cutoff`` it is
        faster than the cutoff and, when ``"optimal"``, the problem's optimum.

    Raises:
        InfeasibleError: no plan satisfies the memory and shape constraints. Its attribute ``proven``
            is True when the exact phase finished (certain), False when only the heuristic phase ran
            (then :func:`resihp_lightning.solver.solve` still asks the MILP backends). Not raised
            with a ``cutoff``: an infeasible problem has no plan faster than it.
        NoBetterPlan: with a ``cutoff``, no plan faster than it was found (``proven`` when none exists).
    """
    start = time.perf_counter()
    model = Model(problem)
    status = "optimal"
    probe = first and cutoff is not None  # only "is anything faster than the cutoff?"
    best = _FirstBelow() if probe else Best()
    if cutoff is None:
        heuristic_search(model, best)  # a good incumbent makes the exact phase prune early
    else:
        # The cutoff is the incumbent (a value without a layout): shapes that cannot beat it close
        # at once, and a shape that can yields its plan to the decomposition itself.
        best.value = cutoff
    try:
        outcome = decomposition_search(model, best, decomposition_budget, bounds=bounds and not probe)
        bound = outcome.bound_ms
        if probe and not outcome.proven:
            status = "feasible"
        elif not outcome.proven:
            try:
                exact_search(model, budget, best)
                bound = best.value
            except (BudgetExceeded, RecursionError):  # too many replicas to enumerate their layouts
                status = "feasible"
    except _Found:  # first=True: one plan below the cutoff is the answer
        plan = build_plan(model, best.grid, best.bounds, best.counts)
        value = evaluate(problem, plan).iteration_ms
        return plan.with_result(iteration_ms=value, status="feasible", gap=relative_gap(value, -math.inf),
                                solver="exact", solve_seconds=time.perf_counter() - start)
    if cutoff is not None and not best.grid:
        raise NoBetterPlan(
            f"no plan faster than the cutoff {cutoff:g} ms" + (" exists" if status == "optimal" else " was found"),
            proven=status == "optimal", bound_ms=min(cutoff, bound),
        )
    if math.isinf(best.value):
        error = InfeasibleError(infeasible_reason(problem))
        error.proven = status == "optimal"  # False: only the heuristic phase ran and found nothing
        raise error
    plan = build_plan(model, best.grid, best.bounds, best.counts)
    value = evaluate(problem, plan).iteration_ms
    gap = 0.0 if status == "optimal" else relative_gap(value, bound)
    return plan.with_result(
        iteration_ms=value, status=status, gap=gap, solver="exact", solve_seconds=time.perf_counter() - start
    )


def relative_gap(value: float, bound: float) -> float:
    """``(value - bound) / value``, clipped to [0, 1] (1.0 when nothing is known)."""
    if not value > 0 or not math.isfinite(bound):
        return 1.0 if value > 0 else 0.0
    return min(1.0, max(0.0, (value - bound) / value))
