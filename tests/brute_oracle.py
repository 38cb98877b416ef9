"""Brute-force oracle for tiny problems: the reference the planner tests compare against.

Enumerates every shape (P, D), every ordered choice of devices for the P x D grid (replica order
fixed by sorting, the only symmetry used), every bounds vector (one shared, or one per replica),
every micro-batch split, and prices each candidate with :func:`resihp_lightning.plan.evaluate`.
It shares no code with the solver package. Tests import it as ``brute_oracle`` (conftest.py puts
this directory on ``sys.path``).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator

from resihp_lightning.errors import InfeasibleError, ProblemError
from resihp_lightning.plan import Plan, Problem, Replica, evaluate

#: Refuse problems whose candidate count exceeds this.
MAX_CANDIDATES = 400_000


def _bounds(num_layers: int, stages: int, min_layers: int) -> list[tuple[int, ...]]:
    out = []
    for cuts in itertools.combinations(range(1, num_layers), stages - 1):
        b = (0, *cuts, num_layers)
        if all(b[j + 1] - b[j] >= min_layers for j in range(stages)):
            out.append(b)
    return out


def _splits(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        yield tuple(edges[i + 1] - edges[i] for i in range(parts))


def _grids(ids: list[int], p: int, d: int, exclude: bool) -> Iterator[tuple[tuple[int, ...], ...]]:
    for chosen in itertools.permutations(ids, p * d) if exclude else itertools.permutations(ids):
        grid = tuple(tuple(chosen[r * p : (r + 1) * p]) for r in range(d))
        if list(grid) == sorted(grid):
            yield grid


def count_candidates(problem: Problem) -> int:
    """How many plans :func:`solve_brute` would price."""
    n, total = problem.num_devices, 0
    for p, d in problem.candidate_shapes():
        grids = math.perm(n, p * d) // math.factorial(d)
        nb = len(_bounds(problem.num_layers, p, problem.min_layers_per_stage))
        bounds = nb if problem.shared_partition else nb**d
        total += grids * bounds * math.comb(problem.micro_batches - 1, d - 1)
    return total


def solve_brute(problem: Problem) -> Plan:
    """The true optimum of a tiny problem by exhaustive enumeration.

    Raises:
        ProblemError: the problem has more than :data:`MAX_CANDIDATES` candidates.
        InfeasibleError: no candidate fits in memory.
    """
    count = count_candidates(problem)
    if count > MAX_CANDIDATES:
        raise ProblemError(
            f"brute force would price {count} plans (limit {MAX_CANDIDATES}); use a smaller problem"
        )
    start = time.perf_counter()
    ids = [dv.id for dv in problem.devices]
    best, best_value = None, math.inf
    for p, d in problem.candidate_shapes():
        bound_list = _bounds(problem.num_layers, p, problem.min_layers_per_stage)
        per_replica = [(b,) * d for b in bound_list] if problem.shared_partition else itertools.product(bound_list, repeat=d)
        per_replica = list(per_replica)
        for grid in _grids(ids, p, d, problem.allow_exclude):
            for bounds in per_replica:
                for counts in _splits(problem.micro_batches, d):
                    plan = Plan(tuple(Replica(g, b, m) for g, b, m in zip(grid, bounds, counts)))
                    ev = evaluate(problem, plan, check=False)
                    if ev.fits_memory and ev.iteration_ms < best_value:
                        best, best_value = plan, ev.iteration_ms
    if best is None:
        raise InfeasibleError("no plan fits in memory")
    return best.with_result(
        iteration_ms=best_value, status="optimal", solver="brute", solve_seconds=time.perf_counter() - start
    )
