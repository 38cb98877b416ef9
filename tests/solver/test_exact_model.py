"""exact_model: the class-level Model priced against evaluate, build_plan, and Best.offer."""

from __future__ import annotations

import math
import random

import pytest
from resihp_lightning.testing.brute_oracle import link_problem, random_plan, random_problem

from resihp_lightning.plan import evaluate, validate
from resihp_lightning.solver.exact_model import Best, Model, build_plan


def _class_of(model: Model) -> dict[int, int]:
    return {i: k for k, c in enumerate(model.classes) for i in c.ids}


def test_profile_and_allreduce_price_plans_like_evaluate():
    rng = random.Random(51)
    checked = over = 0
    problems = [random_problem(s) for s in range(180)] + [link_problem(s) for s in range(150)]
    for problem in problems:
        if not problem.candidate_shapes():
            continue
        model = Model(problem)
        cls = _class_of(model)
        for _ in range(3):
            plan = random_plan(rng, problem)
            if plan is None:
                continue
            worst, fits = 0.0, True
            for r in plan.replicas:
                total, slowest, cap = model.profile([cls[i] for i in r.devices], r.bounds)
                worst = max(worst, total + (r.micro_batches - 1) * slowest)
                fits &= r.micro_batches <= cap
            worst += model.allreduce({cls[i] for i in plan.device_ids}, plan.data_degree)
            ev = evaluate(problem, plan)
            assert worst == pytest.approx(ev.iteration_ms, rel=1e-12)
            assert fits == ev.fits_memory
            over += not fits
            checked += 1
    assert checked > 400 and over > 20


def test_build_plan_puts_devices_of_the_grid_classes():
    checked = 0
    for seed in range(0, 180, 3):
        problem = random_problem(seed)
        shapes = [(p, d) for p, d in problem.candidate_shapes() if p * d == problem.num_devices]
        if not shapes:
            continue
        p, d = shapes[0]
        model = Model(problem)
        cells = [k for k, c in enumerate(model.classes) for _ in c.ids]
        random.Random(seed).shuffle(cells)
        grid = [tuple(cells[r * p:(r + 1) * p]) for r in range(d)]
        bounds = [tuple(round(problem.num_layers * j / p) for j in range(p + 1))] * d
        if any(b[j + 1] <= b[j] for b in bounds for j in range(p)):
            continue
        counts = [problem.micro_batches // d + (r < problem.micro_batches % d) for r in range(d)]
        if min(counts) < 1:
            continue
        plan = build_plan(model, grid, bounds, counts)
        cls = _class_of(model)
        assert sorted(tuple(cls[i] for i in r.devices) for r in plan.replicas) == sorted(grid)
        assert sorted(plan.device_ids) == sorted(dv.id for dv in problem.devices)
        assert sum(r.micro_batches for r in plan.replicas) == problem.micro_batches
        validate(problem, plan, check_memory=False)
        checked += 1
    assert checked > 10


def test_best_keeps_only_a_strictly_better_layout():
    best = Best()
    assert math.isinf(best.value)
    best.offer(10.0, [(0,)], [(0, 1)], [3])
    assert (best.value, best.grid, best.counts) == (10.0, ((0,),), (3,))
    best.offer(10.0 * (1 - 1e-14), [(1,)], [(0, 1)], [3])  # a tie within rounding is no improvement
    assert best.grid == ((0,),)
    best.offer(9.0, [(1,)], [(0, 1)], [2])
    assert (best.value, best.grid, best.counts) == (9.0, ((1,),), (2,))
    best.offer(9.5, [(0,)], [(0, 1)], [1])
    assert best.value == 9.0
