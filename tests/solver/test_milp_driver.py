"""milp_driver: per-degree bounds against brute force, and what solve_by_degree reports without a proof."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from resihp_lightning.testing.brute_oracle import random_plan, random_problem, solve_brute

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import InfeasibleError, ResiHPError
from resihp_lightning.plan import Plan, evaluate
from resihp_lightning.solver.milp_driver import (
    DegreeOutcome,
    crude_upper_ms,
    lower_bound_ms,
    pipeline_degrees,
    solve_by_degree,
)

REL = 1e-9


def test_lower_bound_of_each_degree_is_below_its_optimum():
    checked = 0
    for seed in range(0, 180, 4):
        problem = random_problem(seed)
        degrees = pipeline_degrees(problem)
        assert degrees == sorted({p for p, _ in problem.candidate_shapes()})
        for p in range(1, 6):
            if p not in degrees:
                assert lower_bound_ms(problem, p) == math.inf
                continue
            try:
                optimum = solve_brute(replace(problem, pipeline_degrees=(p,))).iteration_ms
            except InfeasibleError:
                continue
            assert lower_bound_ms(problem, p) <= optimum * (1 + REL)
            checked += 1
    assert checked > 30


def test_crude_upper_is_above_every_plan():
    rng = random.Random(41)
    checked = 0
    for seed in range(180):
        problem = random_problem(seed)
        if not problem.candidate_shapes():
            continue
        upper = crude_upper_ms(problem)
        for _ in range(5):
            plan = random_plan(rng, problem)
            if plan is not None:
                assert evaluate(problem, plan).iteration_ms <= upper * (1 + REL)
                checked += 1
    assert checked > 300


def _unknown(model, seconds, hint):
    """An engine that stops without a solution or a bound (what a time limit of zero gives)."""
    return DegreeOutcome("unknown")


def test_without_a_proof_the_hint_comes_back_feasible_with_a_valid_bound():
    checked = 0
    for seed in range(0, 180, 6):
        problem = random_problem(seed)
        try:
            best = solve_brute(problem)
        except InfeasibleError:
            continue
        hint = Plan(best.replicas)
        result = solve_by_degree(problem, PlannerConfig(num_workers=1), hint, _unknown, "test")
        assert result.plan.layout_key() == hint.layout_key()
        assert result.plan.iteration_ms == pytest.approx(evaluate(problem, hint).iteration_ms, rel=1e-12)
        assert result.plan.solver == "test"
        assert result.bound_ms <= result.plan.iteration_ms * (1 + REL)
        if result.degrees_solved:
            assert not result.proven and result.plan.status == "feasible" and result.gap >= 0
        else:  # every degree pruned by its lower bound: the hint is proven optimal
            assert result.proven and result.plan.status == "optimal"
        if not result.proven:
            with pytest.raises(ResiHPError):
                solve_by_degree(problem, PlannerConfig(num_workers=1), None, _unknown, "test")
        checked += 1
    assert checked > 15
