"""Baseline policies: the closed forms of solver/baseline_policies.py, the ideal time of docs/architecture.md
("The planning model") and optimality within their own scope."""

from __future__ import annotations

import itertools
import math

import pytest
from resihp_lightning.testing.brute_oracle import random_problem, solve_brute

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import InfeasibleError
from resihp_lightning.plan import Device, Layer, Plan, Problem, Replica, efficiency, evaluate, validate
from resihp_lightning.solver.baseline_policies import (
    POLICIES,
    healthy_plan,
    joint,
    microbatch_only,
    none,
    repartition_only,
)

EXACT = PlannerConfig(solver="exact")


def _problem(speeds, layers, m, **kw) -> Problem:
    return Problem(
        tuple(Layer(1.0) for _ in range(layers)),
        tuple(Device(i, s) for i, s in enumerate(speeds)),
        m,
        **kw,
    )


def test_registry_names():
    assert set(POLICIES) == {"none", "microbatch_only", "repartition_only", "joint"}


def test_none_keeps_the_plan_and_runs_at_the_slow_speed():
    problem = _problem([0.4], layers=5, m=7)
    healthy = healthy_plan(problem, EXACT)
    kept = none(problem, healthy, EXACT)
    assert kept.layout_key() == healthy.layout_key()
    assert kept.iteration_ms == pytest.approx(healthy.iteration_ms / 0.4)  # throughput = s of healthy
    # In a long uniform pipeline the slow stage sets the pace: throughput -> s.
    problem = _problem([1.0, 1.0, 0.5, 1.0], layers=8, m=400, pipeline_degrees=(4,))
    healthy = healthy_plan(problem, EXACT)
    ratio = healthy.iteration_ms / none(problem, healthy, EXACT).iteration_ms
    assert ratio == pytest.approx(0.5, rel=0.01)


def test_microbatch_only_reaches_the_data_parallel_closed_form():
    d, s, m = 4, 0.5, 60
    problem = _problem([1.0, 1.0, s, 1.0], layers=3, m=m)  # P = 1, D = 4, no communication
    healthy = healthy_plan(problem, EXACT)
    assert (healthy.pipeline_degree, healthy.data_degree) == (1, 4)
    plan = microbatch_only(problem, healthy, EXACT)
    assert [r.devices for r in plan.replicas] == [r.devices for r in healthy.replicas]
    compute = 3.0
    fluid = m * compute / (d - 1 + s)  # throughput (D - 1 + s) / D of healthy
    assert fluid - 1e-9 <= plan.iteration_ms <= fluid + compute / s
    assert healthy.iteration_ms / plan.iteration_ms == pytest.approx((d - 1 + s) / d, rel=0.06)


def test_repartition_only_reaches_the_pipeline_closed_form():
    p, s = 4, 0.5
    problem = _problem([1.0, s, 1.0, 1.0], layers=80, m=100, pipeline_degrees=(4,))
    healthy = healthy_plan(problem, EXACT)
    plan = repartition_only(problem, healthy, EXACT)
    assert plan.status == "feasible"  # C(79, 3) bounds vectors: local search
    assert [r.micro_batches for r in plan.replicas] == [r.micro_batches for r in healthy.replicas]
    ratio = healthy.iteration_ms / plan.iteration_ms
    assert ratio == pytest.approx((p - 1 + s) / p, rel=0.01)  # (P - 1 + s) / P of healthy
    slow = plan.replicas[0].devices.index(1)
    sizes = [b - a for a, b in zip(plan.replicas[0].bounds, plan.replicas[0].bounds[1:])]
    assert sizes[slow] == min(sizes)


def test_joint_approaches_aggregate_speed():
    problem = _problem([1.0] * 7 + [0.5], layers=4, m=120, allreduce_ms=1.0)
    healthy = healthy_plan(problem, EXACT)
    plan = joint(problem, healthy, EXACT)
    assert plan.status == "optimal"
    assert efficiency(problem, healthy, plan) >= 0.97  # S / N minus granularity
    # The healthy optimum is pure data parallelism, 15 micro-batches per device; kept as is, the
    # slow device needs twice as long for its 15: throughput ~ s of healthy.
    assert (healthy.pipeline_degree, healthy.data_degree) == (1, 8)
    assert none(problem, healthy, EXACT).iteration_ms == pytest.approx(15 * 4.0 / 0.5 + 1.0)


def test_policies_are_optimal_in_their_own_scope_and_joint_beats_them():
    checked = 0
    for seed in range(0, 180, 5):
        problem = random_problem(seed)
        try:
            healthy = healthy_plan(problem, EXACT)
        except InfeasibleError:
            continue
        assert healthy.iteration_ms == pytest.approx(solve_brute(problem.healthy()).iteration_ms)
        plans = {name: fn(problem, healthy, EXACT) for name, fn in POLICIES.items()}
        for name, plan in plans.items():
            validate(problem, plan)
            assert plan.iteration_ms == pytest.approx(evaluate(problem, plan).iteration_ms)
        for name in ("none", "microbatch_only", "repartition_only"):
            assert plans["joint"].iteration_ms <= plans[name].iteration_ms * (1 + 1e-9), (seed, name)
        # microbatch_only: the best split of the healthy layout (independent enumeration).
        best_split = math.inf
        for counts in itertools.product(range(1, problem.micro_batches + 1), repeat=healthy.data_degree):
            if sum(counts) == problem.micro_batches:
                cand = Plan(tuple(Replica(r.devices, r.bounds, m) for r, m in zip(healthy.replicas, counts)))
                ev = evaluate(problem, cand)
                if ev.fits_memory:
                    best_split = min(best_split, ev.iteration_ms)
        assert plans["microbatch_only"].iteration_ms == pytest.approx(best_split)
        # repartition_only: the best single partition (independent enumeration).
        p = healthy.pipeline_degree
        best_part = math.inf
        for cuts in itertools.combinations(range(1, problem.num_layers), p - 1):
            bounds = (0, *cuts, problem.num_layers)
            if any(b - a < problem.min_layers_per_stage for a, b in zip(bounds, bounds[1:])):
                continue
            cand = Plan(tuple(Replica(r.devices, bounds, r.micro_batches) for r in healthy.replicas))
            ev = evaluate(problem, cand)
            if ev.fits_memory:
                best_part = min(best_part, ev.iteration_ms)
        assert plans["repartition_only"].iteration_ms == pytest.approx(best_part)
        assert plans["repartition_only"].status == "optimal"
        checked += 1
    assert checked >= 20
