"""replica_search.min_bottleneck against the enumeration of every bounds vector."""

from __future__ import annotations

import math

from resihp_lightning.testing.brute_oracle import link_problem, random_problem

from resihp_lightning.plan import Device, Layer, Problem
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


def _binding_problem(rng) -> Problem:
    """Up to 6 devices in up to three speeds, 8 layers, memory that binds by stage position."""
    n = rng.randint(2, 6)
    layers = [Layer(rng.choice([1.0, 2.0, 3.0]), rng.choice([10.0, 20.0]), rng.choice([2.0, 5.0])) for _ in range(rng.randint(3, 8))]
    devices = [Device(i, rng.choice([1.0, 1.0, 0.5, 0.7]), rng.choice([45.0, 60.0, 1e6]), rng.choice([1.0, 1.0, 0.5]))
               for i in range(n)]
    return Problem(layers, devices, rng.randint(2, 12), p2p_ms=rng.choice([0.0, 0.5]),
                   min_layers_per_stage=rng.choice([1, 1, 2]))


def _most_by_enumeration(model, composition, limit, most, at_least):
    """The most micro-batches (>= at_least) of one replica of ``composition``: every order, every bounds vector."""
    from resihp_lightning.solver.decomposition import arrangements
    from resihp_lightning.solver.microbatch_split import count

    p = sum(composition)
    best = at_least - 1
    for order in arrangements(composition):
        for bounds in all_bounds(model.L, p, model.min_layers):
            total, worst, cap = model.profile(order, bounds)
            best = max(best, count(limit, total, worst, min(cap, most)))
    return best


def test_mixed_replica_matches_every_arrangement_and_bounds_vector():
    """max_micro_batches_mixed (one programme over all orders) against the enumeration of orders and bounds,
    with binding memory, slow links and limits around the replica's own times; its witness is priced by the model."""
    import random

    from resihp_lightning.solver.knapsack import compositions
    from resihp_lightning.solver.microbatch_split import count
    from resihp_lightning.solver.replica_search import max_micro_batches_mixed

    rng = random.Random(5)
    checked = found = 0
    problems = [random_problem(seed) for seed in range(0, 120, 2)] + [link_problem(seed) for seed in range(0, 80, 2)]
    problems += [_binding_problem(rng) for _ in range(25)]
    for problem in problems:
        model = Model(problem)
        counts = [len(c.ids) for c in model.classes]
        for p in range(1, min(problem.num_devices, model.L // model.min_layers) + 1):
            for composition in compositions(p, counts):
                most = rng.randint(1, model.M)  # a replica never runs more than M
                total = model.pc[-1]
                limit = rng.uniform(0.3, 3.0) * total * most / p
                at_least = rng.choice([1, 1, 2, most])
                expected = _most_by_enumeration(model, composition, limit, most, at_least)
                got, witness = max_micro_batches_mixed(model, composition, limit, most, [0], 10**9, at_least)
                assert got == expected, (problem.to_json(), composition, limit, most, at_least)
                if witness is not None:
                    order, bounds = witness
                    assert sorted(order) == sorted(c for c, n in enumerate(composition) for _ in range(n))
                    s, x, cap = model.profile(order, bounds)
                    assert count(limit, s, x, min(cap, most)) >= got
                    found += 1
                else:
                    assert got == at_least - 1
                checked += 1
    assert checked > 300 and found > 100


def test_stage_caps_equal_model_stage_cap_everywhere():
    """The vectorised caps (replica_search.stage_caps) against Model.stage_cap on every span, class and in-flight count."""
    import random

    from resihp_lightning.solver.replica_search import stage_caps

    rng = random.Random(8)
    problems = [random_problem(seed) for seed in range(0, 90, 3)] + [_binding_problem(rng) for _ in range(20)]
    checked = 0
    for problem in problems:
        model = Model(problem)
        for cls in range(len(model.classes)):
            for in_flight in range(1, model.L + 2):
                table = stage_caps(model, cls, in_flight)
                for a in range(model.L):
                    for b in range(a + 1, model.L + 1):
                        assert table[a, b] == model.stage_cap(a, b, cls, in_flight)
                        checked += 1
    assert checked > 5_000


def test_longest_run_is_the_largest_span_within_the_budget():
    """Model.longest_run (bisection into the sorted spans) against every span."""
    import random

    rng = random.Random(9)
    for seed in range(40):
        model = Model(random_problem(seed))
        spans = [model.pc[b] - model.pc[a] for b in range(model.L + 1) for a in range(b + 1)]
        for budget in [rng.uniform(0, model.pc[-1] * 1.2) for _ in range(20)] + spans[:10] + [-1.0]:
            expected = max((s for s in spans if s <= budget + 1e-12 * max(1.0, budget)), default=0.0)
            assert model.longest_run(budget) == (expected if budget >= 0 else 0.0)
