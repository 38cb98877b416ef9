"""heuristic: the incumbent search (valid, never below the brute-force optimum) and bottleneck_bounds."""

from __future__ import annotations

import math

import pytest
from resihp_lightning.testing.brute_oracle import link_problem, random_problem, solve_brute

from resihp_lightning.errors import InfeasibleError
from resihp_lightning.plan import evaluate, validate
from resihp_lightning.solver.exact_model import Best, Model, build_plan
from resihp_lightning.solver.heuristic import bottleneck_bounds, heuristic_search
from resihp_lightning.solver.replica_search import min_bottleneck

REL = 1e-9


def test_heuristic_search_is_valid_and_never_below_the_optimum():
    found = 0
    problems = [random_problem(s) for s in range(0, 180, 3)] + [link_problem(s) for s in range(0, 150, 5)]
    for problem in problems:
        try:
            optimum = solve_brute(problem).iteration_ms
        except InfeasibleError:
            optimum = None
        model = Model(problem)
        best = Best()
        heuristic_search(model, best)
        if math.isinf(best.value):
            continue
        plan = build_plan(model, best.grid, best.bounds, best.counts)
        validate(problem, plan)  # memory included
        assert evaluate(problem, plan).iteration_ms == pytest.approx(best.value, rel=REL)
        assert optimum is not None and best.value >= optimum * (1 - REL)
        found += 1
    assert found > 60


def test_bottleneck_bounds_reach_the_least_bottleneck_of_pure_replicas():
    checked = 0
    problems = [random_problem(s) for s in range(0, 180, 3)] + [link_problem(s) for s in range(0, 150, 5)]
    for problem in problems:
        model = Model(problem)
        for p in range(1, problem.num_layers // problem.min_layers_per_stage + 1):
            for cls in range(len(model.classes)):
                for m in range(1, p + 2):
                    want, _ = min_bottleneck(model, cls, p, m)
                    bounds = bottleneck_bounds(model, (cls,) * p, m)
                    if math.isinf(want):
                        assert bounds is None
                        continue
                    assert bounds is not None and bounds[0] == 0 and bounds[-1] == model.L
                    assert all(bounds[j + 1] - bounds[j] >= model.min_layers for j in range(p))
                    assert all(model.stage_cap(bounds[j], bounds[j + 1], cls, p - j) >= m for j in range(p))
                    got = max(model.stage_time(bounds[j], bounds[j + 1], cls, j, p) for j in range(p))
                    assert want * (1 - REL) <= got <= want * (1 + 1e-8) + 1e-12
                    checked += 1
    assert checked > 300
