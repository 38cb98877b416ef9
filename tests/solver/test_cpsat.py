"""cpsat: CP-SAT specific behaviour (determinism with a seed, the exact plan as hint, proven bounds)."""

from __future__ import annotations

import pytest
from resihp_lightning.testing.brute_oracle import random_problem, solve_brute

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import InfeasibleError
from resihp_lightning.plan import Device, Layer, Problem, evaluate, validate
from resihp_lightning.solver.cpsat import solve_cpsat, solve_cpsat_detailed


def test_cpsat_is_deterministic_with_a_seed():
    layers = [Layer(1.0 + 0.1 * (i % 5), 100, 10) for i in range(12)]
    devices = [Device(i, {0: 0.5, 5: 0.7}.get(i, 1.0), 80_000) for i in range(8)]
    problem = Problem(layers, devices, 12, p2p_ms=0.05, allreduce_ms=2.0, pipeline_degrees=(2, 4),
                      shared_partition=False)
    cfg = PlannerConfig(num_workers=2, random_seed=7, time_limit_s=30)
    plans = [solve_cpsat(problem, cfg) for _ in range(3)]
    assert all(plan.status == "optimal" for plan in plans)
    assert len({plan.layout_key() for plan in plans}) == 1


def test_exact_hint_is_proven_optimal_at_scale():
    """One slow device among 256 (the production path: the exact algorithm's plan as the hint)."""
    from resihp_lightning.solver.exact import solve_exact

    layers = [Layer(2.0 if i in (0, 95) else 1.0, 500, 50) for i in range(96)]
    devices = [Device(i, 0.5 if i == 0 else 1.0, 80_000) for i in range(256)]
    problem = Problem(layers, devices, 256, p2p_ms=0.05, allreduce_ms=5.0, pipeline_degrees=(4, 8, 16),
                      shared_partition=True)
    hint = solve_exact(problem)
    result = solve_cpsat_detailed(problem, PlannerConfig(num_workers=1, time_limit_s=30), hint)
    assert result.plan.status == "optimal" and result.gap == 0.0
    assert result.plan.iteration_ms <= hint.iteration_ms * (1 + 1e-12)
    assert result.plan.iteration_ms >= 256 * 98 / 255.5  # M * C / S: nothing can beat it


def test_detailed_result_brackets_the_brute_force_optimum():
    checked = 0
    for seed in range(3, 180, 10):
        problem = random_problem(seed)
        try:
            want = evaluate(problem, solve_brute(problem)).iteration_ms
        except InfeasibleError:
            with pytest.raises(InfeasibleError):
                solve_cpsat_detailed(problem, PlannerConfig(num_workers=1))
            continue
        result = solve_cpsat_detailed(problem, PlannerConfig(num_workers=1, time_limit_s=20))
        validate(problem, result.plan)
        assert result.proven and result.plan.status == "optimal" and result.gap == 0.0
        assert result.plan.solver == "cpsat"
        assert result.plan.iteration_ms == pytest.approx(want, rel=1e-6)
        assert result.bound_ms <= want * (1 + 1e-6)
        checked += 1
    assert checked > 8
