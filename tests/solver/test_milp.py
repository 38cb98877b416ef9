"""The MILP backends (CP-SAT, PuLP+CBC, PuLP+HiGHS) against exhaustive enumeration.

The oracle is :func:`brute_oracle.solve_brute` (resihp_lightning/testing/brute_oracle.py), which prices every plan with
:func:`resihp_lightning.plan.evaluate` and shares no code with the MILP.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
from resihp_lightning.testing.brute_oracle import count_candidates, random_link_problem, solve_brute

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import InfeasibleError
from resihp_lightning.plan import Device, Layer, Plan, Problem, evaluate, validate
from resihp_lightning.solver.cpsat import solve_cpsat
from resihp_lightning.solver.milp_model import MilpModel, choose_time_scale
from resihp_lightning.solver.pulp_backend import solve_pulp

ENGINES = ("cpsat", "cbc", "highs")
# shared_partition, allow_exclude, tight memory, min_layers_per_stage 2, pipeline_degrees given
OPTION_COMBOS = list(itertools.product((True, False), repeat=5))


def _solve(engine: str, problem: Problem, hint: Plan | None = None, **kw) -> Plan:
    if engine == "cpsat":
        return solve_cpsat(problem, PlannerConfig(**kw), hint)
    return solve_pulp(problem, PlannerConfig(solver="pulp", pulp_engine=engine, **kw), hint)


def _random_problem(
    rng: random.Random, shared: bool, exclude: bool, tight: bool, minl2: bool, degrees: bool
) -> Problem:
    while True:
        n = rng.randint(2, 4)
        num_layers = rng.randint(3, 5) if minl2 else rng.randint(2, 5)
        layers = [
            Layer(round(rng.uniform(0.5, 3.0), 3), rng.choice([10, 20, 30]), rng.choice([0, 5, 10]))
            for _ in range(num_layers)
        ]
        devices = [
            Device(i, rng.choice([1.0, 1.0, 0.8, 0.5, 0.3]), rng.choice([45, 60, 80, 120]) if tight else 10_000)
            for i in range(n)
        ]
        problem = Problem(
            layers,
            devices,
            rng.randint(1, 5),
            p2p_ms=rng.choice([0.0, 0.1]),
            allreduce_ms=rng.choice([0.0, 1.0, 4.0]),
            pipeline_degrees=tuple(sorted(rng.sample([1, 2, 3, 4], 2))) if degrees else None,
            shared_partition=shared,
            allow_exclude=exclude,
            min_layers_per_stage=2 if minl2 else 1,
        )
        if problem.candidate_shapes() and count_candidates(problem) <= 5_000:
            return problem


def _edge_problems() -> list[Problem]:
    def layers(n: int) -> list[Layer]:
        return [Layer(1.0 + 0.25 * (i % 3), 10, 5) for i in range(n)]

    return [
        # per-replica partitions beat a shared one (one slow device in a 2x2 grid)
        Problem(layers(4), [Device(i, 0.5 if i == 3 else 1.0) for i in range(4)], 5,
                pipeline_degrees=(2,), shared_partition=False, p2p_ms=0.1),
        # a very slow device is worth leaving out
        Problem(layers(3), [Device(0, 1.0), Device(1, 1.0), Device(2, 0.05)], 4,
                allow_exclude=True, allreduce_ms=0.5),
        Problem(layers(3), [Device(0, 1.0)], 3),  # one device
        Problem(layers(3), [Device(i, 1.0) for i in range(3)], 2, pipeline_degrees=(3,)),  # P = L
        Problem(layers(4), [Device(i, 0.4) for i in range(4)], 5, p2p_ms=0.2, allreduce_ms=1.0),  # all slow
        # memory depends on the micro-batches in flight: 2 in flight at stage 0 force an uneven split
        Problem([Layer(1.0, 10, 20)] * 4, [Device(i, 1.0, 95) for i in range(4)], 4,
                pipeline_degrees=(2,), shared_partition=False),
        Problem([Layer(1.0, 10, 20)] * 4, [Device(i, 1.0 if i else 0.5, 95) for i in range(4)], 5,
                pipeline_degrees=(2,), shared_partition=True),
    ]


def _problems() -> list[Problem]:
    rng = random.Random(20260611)
    return _edge_problems() + [_random_problem(rng, *combo) for combo in OPTION_COMBOS for _ in range(2)]


PROBLEMS = _problems()


def _oracle(problem: Problem) -> float | None:
    try:
        return evaluate(problem, solve_brute(problem)).iteration_ms
    except InfeasibleError:
        return None


ORACLE = [_oracle(p) for p in PROBLEMS]


def test_problems_cover_every_option_and_both_outcomes():
    assert any(t is None for t in ORACLE) and sum(t is not None for t in ORACLE) > len(ORACLE) // 2
    for flags in itertools.product((True, False), repeat=2):
        assert any((p.shared_partition, p.allow_exclude) == flags for p in PROBLEMS)
    per_replica, exclude = PROBLEMS[0], PROBLEMS[1]
    shared = solve_brute(replace(per_replica, shared_partition=True))
    assert ORACLE[0] < evaluate(per_replica, shared).iteration_ms - 1e-6
    assert len(solve_brute(exclude).device_ids) == 2
    assert sum(solve_brute(p).pipeline_degree > 1 for p, t in zip(PROBLEMS, ORACLE) if t is not None) > 5
    # the in-flight memory rule binds: the optimum is an uneven split that one micro-batch would not need
    memory_bound = PROBLEMS[5]
    assert solve_brute(memory_bound).replicas[0].bounds == (0, 1, 4)
    even = Plan.uniform([0, 1, 2, 3], 4, 2, 4)  # bounds (0, 2, 4), 2 micro-batches per replica
    assert not evaluate(memory_bound, even).fits_memory
    assert evaluate(replace(memory_bound, micro_batches=2), Plan.uniform([0, 1, 2, 3], 4, 2, 2)).fits_memory


@pytest.mark.parametrize("engine", ENGINES)
def test_backend_matches_brute_force(engine):
    for index, (problem, expected) in enumerate(zip(PROBLEMS, ORACLE)):
        if expected is None:
            with pytest.raises(InfeasibleError):
                _solve(engine, problem, num_workers=1)
            continue
        plan = _solve(engine, problem, num_workers=1)
        validate(problem, plan)  # structure and memory
        actual = evaluate(problem, plan).iteration_ms
        assert plan.iteration_ms == pytest.approx(actual, rel=1e-12)
        assert actual == pytest.approx(expected, rel=1e-6), f"problem {index}: {problem.to_json()}"
        assert plan.status == "optimal"
        assert plan.solver == ("cpsat" if engine == "cpsat" else f"pulp-{engine}")
        assert plan.solve_seconds > 0


def test_model_admits_every_optimal_plan_at_its_price():
    """encode() of the brute-force optimum satisfies every row, with T equal to its price."""
    checked = 0
    for problem, expected in zip(PROBLEMS, ORACLE):
        if expected is None:
            continue
        best = solve_brute(problem)
        scale = choose_time_scale(expected)
        model = MilpModel(problem, best.pipeline_degree, scale)
        values = model.encode(best)
        assert values is not None and model.violations(values) == []
        assert model.objective_ms(values) == pytest.approx(expected, rel=1e-6)
        decoded = model.decode(values)
        assert evaluate(problem, decoded).iteration_ms <= expected * (1 + 1e-9)
        checked += 1
    assert checked > 20


def _link_problems() -> list[Problem]:
    rng = random.Random(20260612)
    return [random_link_problem(rng, max_devices=5, max_layers=5, max_candidates=5_000) for _ in range(40)]


LINK_PROBLEMS = _link_problems()
LINK_ORACLE = [_oracle(p) for p in LINK_PROBLEMS]


@pytest.mark.parametrize("engine", ENGINES)
def test_backend_matches_brute_force_with_slow_links(engine):
    """Per-class transfer terms by stage position and the all-reduce at the slowest link used."""
    assert sum(t is not None for t in LINK_ORACLE) > 30
    for index, (problem, expected) in enumerate(zip(LINK_PROBLEMS, LINK_ORACLE)):
        if expected is None:
            with pytest.raises(InfeasibleError):
                _solve(engine, problem, num_workers=1)
            continue
        plan = _solve(engine, problem, num_workers=1)
        validate(problem, plan)
        assert evaluate(problem, plan).iteration_ms == pytest.approx(expected, rel=1e-6), f"problem {index}: {problem.to_json()}"
        assert plan.status == "optimal"


def test_model_admits_every_optimal_plan_at_its_price_with_slow_links():
    checked = 0
    for problem, expected in zip(LINK_PROBLEMS, LINK_ORACLE):
        if expected is None:
            continue
        best = solve_brute(problem)
        model = MilpModel(problem, best.pipeline_degree, choose_time_scale(expected))
        values = model.encode(best)
        assert values is not None and model.violations(values) == []
        assert model.objective_ms(values) == pytest.approx(expected, rel=1e-6)
        checked += 1
    assert checked > 30
    assert any(MilpModel(p, 1, 1000).arv is not None for p in LINK_PROBLEMS if (1, 2) in p.candidate_shapes())


@pytest.mark.parametrize("engine", ENGINES)
def test_memory_infeasible_raises(engine):
    problem = Problem(
        [Layer(1.0, 600, 100)] * 4,
        [Device(i, 1.0, 1000) for i in range(2)],
        micro_batches=4,
    )  # 2 stages x 2 layers need 1200+ MB each
    with pytest.raises(InfeasibleError):
        _solve(engine, problem)


def _big_problem() -> Problem:
    layers = [Layer(2.0 if i in (0, 95) else 1.0, 500, 50) for i in range(96)]
    speeds = [0.5, 0.5, 0.5, 0.5, 0.7, 0.7, 0.7, 0.7] + [1.0] * 248
    devices = [Device(i, s, 80_000) for i, s in enumerate(speeds)]
    return Problem(layers, devices, 256, p2p_ms=0.05, allreduce_ms=5.0, pipeline_degrees=(4, 8, 16),
                   shared_partition=False)


@pytest.mark.parametrize("engine,limit", [("cpsat", 0.3), ("highs", 0.3), ("cbc", 2.0)])
def test_time_limit_gives_feasible_never_worse_than_hint(engine, limit):
    problem = _big_problem()
    hint = Plan.uniform([d.id for d in problem.devices], problem.num_layers, 8, problem.micro_batches)
    plan = _solve(engine, problem, hint, time_limit_s=limit)
    assert plan.status == "feasible"
    validate(problem, plan)
    assert plan.iteration_ms <= evaluate(problem, hint).iteration_ms * (1 + 1e-12)
