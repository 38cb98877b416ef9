"""bounds.shape_lower_bound against the brute-force optimum of every pipeline degree."""

from __future__ import annotations

from dataclasses import replace

from resihp_lightning.testing.brute_oracle import link_problem, random_problem, solve_brute

from resihp_lightning.errors import InfeasibleError
from resihp_lightning.solver.bounds import shape_lower_bound

REL = 1e-9


def test_shape_lower_bound_is_below_every_plan_of_its_degree():
    problems = [random_problem(seed) for seed in range(0, 180, 7)] + [link_problem(seed) for seed in range(0, 150, 6)]
    for problem in problems:
        for p in sorted({shape[0] for shape in problem.candidate_shapes()}):
            one_degree = replace(problem, pipeline_degrees=(p,))
            try:
                optimum = solve_brute(one_degree).iteration_ms
            except InfeasibleError:
                continue
            bound = min(shape_lower_bound(problem, p, d) for q, d in problem.candidate_shapes() if q == p)
            assert bound <= optimum * (1 + REL), (problem.to_json(), p)
