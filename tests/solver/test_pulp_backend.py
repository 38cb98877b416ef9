"""pulp_backend: PuLP specific behaviour (engine selection, the HiGHS dependency, proven bounds)."""

from __future__ import annotations

import sys

import pytest
from resihp_lightning.testing.brute_oracle import random_problem, solve_brute

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import ConfigError, InfeasibleError
from resihp_lightning.plan import Device, Layer, Problem, evaluate, validate
from resihp_lightning.solver.pulp_backend import solve_pulp, solve_pulp_detailed


def _layers(n: int) -> list[Layer]:
    return [Layer(1.0 + 0.25 * (i % 3), 10, 5) for i in range(n)]


# Per-replica partitions beat a shared one (one slow device in a 2x2 grid): as in test_milp.py.
PROBLEMS = [
    Problem(_layers(4), [Device(i, 0.5 if i == 3 else 1.0) for i in range(4)], 5,
            pipeline_degrees=(2,), shared_partition=False, p2p_ms=0.1),
]


def test_highs_missing_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "highspy", None)  # import highspy -> ImportError
    with pytest.raises(ConfigError, match="planner.pulp_engine"):
        solve_pulp(PROBLEMS[0], PlannerConfig(solver="pulp", pulp_engine="highs"))


@pytest.mark.parametrize("engine", ["cbc", "highs"])
def test_detailed_result_brackets_the_brute_force_optimum(engine):
    config = PlannerConfig(solver="pulp", pulp_engine=engine, num_workers=1, time_limit_s=20)
    checked = 0
    for seed in range(4, 180, 15):
        problem = random_problem(seed)
        try:
            want = evaluate(problem, solve_brute(problem)).iteration_ms
        except InfeasibleError:
            with pytest.raises(InfeasibleError):
                solve_pulp(problem, config)
            continue
        result = solve_pulp_detailed(problem, config)
        validate(problem, result.plan)
        assert result.plan.solver == f"pulp-{engine}"
        assert result.proven and result.plan.status == "optimal"
        assert result.plan.iteration_ms == pytest.approx(want, rel=1e-6)
        assert result.bound_ms <= want * (1 + 1e-6)
        checked += 1
    assert checked > 5
