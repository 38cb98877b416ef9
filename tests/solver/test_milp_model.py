"""milp_model: the bottleneck programme, degrees and time scale, and encode of brute-force optima."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from resihp_lightning.testing.brute_oracle import random_problem, solve_brute

from resihp_lightning.errors import InfeasibleError
from resihp_lightning.plan import evaluate
from resihp_lightning.solver.milp_model import TARGET_UNITS, MilpModel, bottleneck, choose_time_scale, data_degrees


def test_bottleneck_matches_enumeration():
    rng = random.Random(5)
    for _ in range(40):
        num_layers, p, minl = rng.randint(2, 8), rng.randint(1, 4), rng.choice([1, 2])
        if p * minl > num_layers:
            continue
        prefix = [0]
        for _ in range(num_layers):
            prefix.append(prefix[-1] + rng.randint(1, 50))
        p2p = rng.choice([0, 3])
        best = math.inf
        for cuts in itertools.combinations(range(1, num_layers), p - 1):
            b = (0, *cuts, num_layers)
            if all(b[j + 1] - b[j] >= minl for j in range(p)):
                best = min(best, max(prefix[b[j + 1]] - prefix[b[j]] + (p2p if j < p - 1 else 0) for j in range(p)))
        value, bounds = bottleneck(prefix, p, minl, p2p)
        assert value == best
        assert max(prefix[bounds[j + 1]] - prefix[bounds[j]] + (p2p if j < p - 1 else 0) for j in range(p)) == best


def test_bottleneck_takes_per_stage_transfer_units():
    prefix = [0, 10, 20, 30, 40]
    # A slow link at the last stage (it pays 7 or 30 units there): the last stage gets fewer layers.
    assert bottleneck(prefix, 2, 1, [3, 7]) == (27, (0, 2, 4))
    assert bottleneck(prefix, 2, 1, [3, 30]) == (40, (0, 3, 4))
    assert bottleneck(prefix, 2, 1, 3) == bottleneck(prefix, 2, 1, [3, 0])


def test_data_degrees_are_the_candidate_shapes_of_the_degree():
    for seed in range(0, 180, 5):
        problem = random_problem(seed)
        shapes = set(problem.candidate_shapes())
        for p in range(1, 6):
            got = data_degrees(problem, p)
            assert got == sorted(got) and set(got) == {d for q, d in shapes if q == p}


def test_time_scale_is_a_power_of_ten_that_keeps_times_in_range():
    for upper in [1e-3, 0.5, 1.0, 37.0, 1e3, 2.5e5, 1e7, 1e9]:
        scale = choose_time_scale(upper)
        assert 1000 <= scale <= 10**9
        assert scale == 10 ** round(math.log10(scale))
        if scale > 1000:  # not clamped from below: the largest time stays within the target
            assert upper * scale <= TARGET_UNITS
        if scale < 10**9:  # not clamped from above: one more power of ten would exceed it
            assert upper * scale * 10 > TARGET_UNITS
    assert choose_time_scale(0.0) == choose_time_scale(math.inf) == 1000


def test_encode_of_brute_force_optima_satisfies_every_row():
    checked = 0
    for seed in range(1, 180, 6):
        problem = random_problem(seed)
        try:
            best = solve_brute(problem)
        except InfeasibleError:
            continue
        expected = evaluate(problem, best).iteration_ms
        model = MilpModel(problem, best.pipeline_degree, choose_time_scale(expected))
        values = model.encode(best)
        assert values is not None and model.violations(values) == []
        assert model.objective_ms(values) == pytest.approx(expected, rel=1e-6)
        assert evaluate(problem, model.decode(values)).iteration_ms <= expected * (1 + 1e-9)
        checked += 1
    assert checked > 10
