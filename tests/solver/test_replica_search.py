"""replica_search.min_bottleneck against the enumeration of every bounds vector."""

from __future__ import annotations

import math

from resihp_lightning.testing.brute_oracle import link_problem, random_problem

from resihp_lightning.solver.enumeration import all_bounds
from resihp_lightning.solver.exact_model import Model
from resihp_lightning.solver.replica_search import min_bottleneck


def test_min_bottleneck_matches_enumeration():
    """The exact planner's bottleneck partition (ms, memory by Model.stage_cap) against every bounds vector."""
    checked = 0
    problems = [random_problem(seed) for seed in range(0, 180, 3)] + [link_problem(seed) for seed in range(0, 150, 5)]
    for problem in problems:
        model = Model(problem)
        for p in range(1, problem.num_layers // problem.min_layers_per_stage + 1):
            for cls in range(len(model.classes)):
                for m in range(1, p + 2):
                    best = math.inf
                    for bounds in all_bounds(model.L, p, model.min_layers):
                        stages = [(bounds[j], bounds[j + 1]) for j in range(p)]
                        if all(model.stage_cap(a, b, cls, p - j) >= m for j, (a, b) in enumerate(stages)):
                            best = min(best, max(model.stage_time(a, b, cls, j, p) for j, (a, b) in enumerate(stages)))
                    value, bounds = min_bottleneck(model, cls, p, m)
                    assert value == best, (problem.to_json(), p, cls, m)
                    if bounds is not None:
                        assert max(model.stage_time(bounds[j], bounds[j + 1], cls, j, p) for j in range(p)) == best
                        assert all(model.stage_cap(bounds[j], bounds[j + 1], cls, p - j) >= m for j in range(p))
                    checked += 1
    assert checked > 300
