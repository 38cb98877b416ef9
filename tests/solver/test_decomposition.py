"""The decomposition by shape (solver/decomposition.py, solver/knapsack.py) against independent oracles.

Oracles: :func:`brute_oracle.solve_brute` (every plan priced by ``evaluate``) on tiny problems, and
the layout enumeration of ``exact.exact_search`` with a large budget (a complete search that shares
no code with the knapsack) on problems too large for brute force. The decomposition runs alone here
(heuristic incumbent, then the decomposition; no layout enumeration), so a proof it claims is its own.
"""

from __future__ import annotations

import math
import random

import pytest
from resihp_lightning.testing.brute_oracle import count_candidates, random_link_problem, solve_brute

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import InfeasibleError
from resihp_lightning.plan import Device, Layer, Plan, Problem, evaluate, validate
from resihp_lightning.solver import solve
from resihp_lightning.solver.decomposition import decomposition_search, link_levels
from resihp_lightning.solver.exact import exact_search, solve_exact
from resihp_lightning.solver.replica_search import BudgetExceeded
from resihp_lightning.solver.exact_model import Best, Model, build_plan
from resihp_lightning.solver.heuristic import heuristic_search

REL = 1e-9


def _problem(rng: random.Random, max_devices: int = 8, max_layers: int = 7) -> Problem:
    """Several speed classes (up to five), memory that binds in most problems, every option."""
    n = rng.randint(2, max_devices)
    num_layers = rng.randint(2, max_layers)
    speeds = [rng.choice([1.0, 1.0, 1.0, 0.9, 0.7, 0.5, 0.3]) for _ in range(n)]
    tight = rng.random() < 0.6
    layers = [
        Layer(rng.choice([1.0, 1.5, 2.0, 3.0]), rng.choice([10.0, 20.0, 30.0]), rng.choice([0.0, 5.0, 10.0]))
        for _ in range(num_layers)
    ]
    devices = [Device(i, speeds[i], rng.choice([45.0, 60.0, 80.0]) if tight else 1e6) for i in range(n)]
    return Problem(
        layers, devices, rng.randint(1, 10), p2p_ms=rng.choice([0.0, 0.1, 0.5]),
        allreduce_ms=rng.choice([0.0, 1.0, 3.0]), shared_partition=rng.random() < 0.5,
        allow_exclude=rng.random() < 0.3, min_layers_per_stage=rng.choice([1, 1, 2]),
    )


def _decomposed(problem: Problem, budget: int = 10**6):
    """(value or None, proven, bound) of the heuristic + decomposition alone."""
    model = Model(problem)
    best = Best()
    heuristic_search(model, best)
    outcome = decomposition_search(model, best, budget)
    if math.isinf(best.value):
        return None, outcome.proven, outcome.bound_ms
    plan = build_plan(model, best.grid, best.bounds, best.counts)
    validate(problem, plan)
    value = evaluate(problem, plan).iteration_ms
    assert value == pytest.approx(best.value, rel=REL)
    return value, outcome.proven, outcome.bound_ms


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= REL * max(1.0, abs(b))


def test_decomposition_matches_brute_force_on_small_problems():
    rng = random.Random(2026)
    checked = proven = 0
    while checked < 70:
        problem = _problem(rng, max_devices=6, max_layers=5)
        if not problem.candidate_shapes() or count_candidates(problem) > 20_000:
            continue
        try:
            optimum = solve_brute(problem).iteration_ms
        except InfeasibleError:
            optimum = None
        value, is_proven, bound = _decomposed(problem)
        if is_proven:
            proven += 1
            assert _same(value, optimum), problem.to_json()
        if optimum is not None:
            assert bound <= optimum * (1 + REL), problem.to_json()
            assert value is None or value >= optimum * (1 - REL)
        checked += 1
    assert proven >= 65  # the few left open are caught by the layout enumeration in solve_exact


def test_decomposition_matches_the_layout_enumeration_on_medium_problems():
    """Up to 12 devices and five speed classes, binding memory: the complete layout enumeration as oracle."""
    rng = random.Random(77)
    checked = proven = 0
    while checked < 30:
        problem = _problem(rng, max_devices=12, max_layers=8)
        if not problem.candidate_shapes():
            continue
        model = Model(problem)
        oracle = Best()
        try:
            exact_search(model, 30_000, oracle)
        except BudgetExceeded:
            continue
        optimum = None if math.isinf(oracle.value) else oracle.value
        value, is_proven, bound = _decomposed(problem)
        if is_proven:
            proven += 1
            assert _same(value, optimum), problem.to_json()
        if optimum is not None:
            assert bound <= optimum * (1 + REL), problem.to_json()
        checked += 1
    assert proven >= 27


def _binding(n: int, slow: list[float], shared: bool, m: int) -> Problem:
    """96 layers of 700 MB static state on 24 GB devices: P >= 4, and stage 0 cannot take 27 layers."""
    speeds = [1.0] * n
    for k, s in enumerate(slow):
        speeds[(k * max(1, n // len(slow)) + 3) % n] = s
    devices = [Device(i, speeds[i], 24_000.0) for i in range(n)]
    return Problem([Layer(10.0, 700.0, 50.0)] * 96, devices, m, shared_partition=shared)


@pytest.mark.parametrize("shared", [True, False])
def test_binding_memory_at_256_devices_is_proven_fast(shared):
    problem = _binding(256, [0.5, 0.3, 0.7, 0.9, 0.3, 0.5, 0.7, 0.9], shared, 1024)  # five speed classes
    plan = solve(problem, PlannerConfig(time_limit_s=10.0))
    validate(problem, plan)
    assert plan.status == "optimal" and plan.gap == 0.0
    # 62 healthy replicas of 4 x 24 layers run at most 16 micro-batches below 4800 ms, and no replica
    # holding a slow device more than 14: nothing reaches 1024 below it.
    assert plan.iteration_ms == pytest.approx(4800.0, rel=REL)
    assert plan.solve_seconds < 5.0  # about 0.2 s on an idle core


@pytest.mark.parametrize("shared", [True, False])
def test_a_deep_pipeline_under_binding_memory_is_proven_by_the_decomposition(shared):
    """32 devices, 80 layers of 700 MB + 50 MB per micro-batch on 6 GB devices, one at half speed, M = 128.

    Stage j of a 32-stage pipeline holds 32 - j micro-batches in flight, so the first six stages fit
    two layers and the others three: every plan is one replica of all 32 devices, whose slow device
    holds a single layer (20 ms) and whose healthy stages take at most three (30 ms + 0.05 ms of
    transfer). The decomposition closes every shape on its own: the one replica's orders and bounds
    go through one programme (replica_search.max_micro_batches_mixed), and with D = 1 a shared
    partition is a per-replica one. Before, this took 1-8 s and CP-SAT.
    """
    speeds = [1.0] * 32
    speeds[3] = 0.5
    problem = Problem([Layer(10.0, 700.0, 50.0)] * 80, [Device(i, speeds[i], 6_000.0) for i in range(32)], 128,
                      p2p_ms=0.05, allreduce_ms=5.0, shared_partition=shared)
    value, proven, bound = _decomposed(problem)
    assert proven and bound == value
    # S = 800 ms of compute + 10 ms more for the slow device's layer + 31 transfers; X = 3 layers + one transfer.
    assert value == pytest.approx(800.0 + 10.0 + 31 * 0.05 + 127 * 30.05, rel=REL)
    plan = solve(problem, PlannerConfig(solver="exact"))
    assert plan.status == "optimal" and plan.iteration_ms == pytest.approx(value, rel=REL)
    assert (plan.pipeline_degree, plan.data_degree) == (32, 1)
    assert plan.solve_seconds < 3.0  # about 0.1 s on an idle core


def test_gap_is_reported_when_the_budget_stops_the_search():
    rng = random.Random(9)
    checked = 0
    while checked < 12:
        problem = _problem(rng, max_devices=6, max_layers=5)
        if not problem.candidate_shapes() or count_candidates(problem) > 20_000:
            continue
        try:
            optimum = solve_brute(problem).iteration_ms
            plan = solve_exact(problem, budget=0, decomposition_budget=0)
        except InfeasibleError:
            continue
        assert plan.gap is not None and 0.0 <= plan.gap <= 1.0
        if plan.status == "optimal":
            assert plan.gap == 0.0
        else:
            # The bound behind the gap never exceeds the true optimum.
            assert plan.iteration_ms * (1 - plan.gap) <= optimum * (1 + REL)
        checked += 1


def test_milp_time_limit_reports_a_proven_gap():
    """Shared partition, five classes on 32 devices: the decomposition leaves a shape open and CP-SAT
    stops at its limit; the plan carries the gap of the better of the two proven bounds."""
    problem = _binding(32, [0.3, 0.5, 0.7, 0.9, 0.3, 0.5, 0.7, 0.9], True, 128)
    plan = solve(problem, PlannerConfig(time_limit_s=1.0, num_workers=1))
    validate(problem, plan)
    if plan.status == "optimal":  # a quiet machine may prove it within the second
        assert plan.gap == 0.0
        return
    assert plan.status == "feasible" and 0.0 < plan.gap < 0.05
    data = plan.to_dict()
    assert data["gap"] == plan.gap and Plan.from_dict(data).gap == plan.gap


def test_decomposition_matches_brute_force_with_slow_links():
    """Link levels (exclusion, D > 1): every plan is closed at its slowest link; the proofs must hold."""
    rng = random.Random(31)
    checked = proven = split_levels = 0
    while checked < 120:
        problem = random_link_problem(rng, max_devices=6, max_layers=5, max_candidates=20_000)
        try:
            optimum = solve_brute(problem).iteration_ms
        except InfeasibleError:
            optimum = None
        model = Model(problem)
        split_levels += any(len(link_levels(model, p, d)) > 1 for p, d in problem.candidate_shapes())
        value, is_proven, bound = _decomposed(problem)
        if is_proven:
            proven += 1
            assert _same(value, optimum), problem.to_json()
        if optimum is not None:
            assert bound <= optimum * (1 + REL), problem.to_json()
            assert value is None or value >= optimum * (1 - REL)
        checked += 1
    assert proven >= 110
    assert split_levels >= 12  # 17 of 120 measured


def test_link_levels_close_a_shape_per_slowest_link():
    # Two healthy devices, two with slow links (u = 2 and 4): levels at u = 1, 2, 4 for shapes they fit.
    devices = [Device(0), Device(1), Device(2, link_speed=0.5), Device(3, link_speed=0.25)]
    problem = Problem([Layer(1.0)] * 4, devices, 8, p2p_ms=0.5, allreduce_ms=3.0, allow_exclude=True)
    model = Model(problem)
    assert [(ar, counts) for ar, counts in link_levels(model, 1, 2)] == [(3.0, (2, 0, 0)), (6.0, (2, 1, 0)), (12.0, (2, 1, 1))]
    assert [ar for ar, _ in link_levels(model, 1, 3)] == [6.0, 12.0]  # three devices need a slow link
    assert link_levels(model, 2, 1) == [None]  # one replica: no all-reduce
    fixed = Model(Problem([Layer(1.0)] * 4, devices, 8, p2p_ms=0.5, allreduce_ms=3.0))
    assert [ar for ar, _ in link_levels(fixed, 1, 4)] == [12.0]  # every device is used
    plan = solve(problem, PlannerConfig(solver="exact"))
    assert plan.iteration_ms == pytest.approx(solve_brute(problem).iteration_ms)
    # 3 replicas of (3, 3, 2) x 4 ms with the ring at u = 2 (18 ms) beat 2 healthy ones (16 + 3 ms) and
    # any plan with device 3 (its ring alone costs 12 ms).
    assert sorted(plan.device_ids) == [0, 1, 2] and plan.iteration_ms == pytest.approx(12.0 + 6.0)
