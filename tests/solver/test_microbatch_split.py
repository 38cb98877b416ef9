"""microbatch_split: the split of micro-batches over replicas of fixed costs, against enumeration."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from resihp_lightning.solver.microbatch_split import count, fluid_value, split, split_functions, split_value


def test_split_is_optimal_for_fixed_replica_costs():
    rng = random.Random(7)
    for _ in range(200):
        groups = [(rng.uniform(1, 5), rng.uniform(0.1, 3), rng.randint(1, 6), 1) for _ in range(rng.randint(1, 4))]
        total = rng.randint(len(groups), 12)
        best = math.inf
        ranges = [range(1, g[2] + 1) for g in groups]
        for counts in itertools.product(*ranges):
            if sum(counts) == total:
                best = min(best, max(g[0] + (m - 1) * g[1] for g, m in zip(groups, counts)))
        result = split(groups, total)
        if math.isinf(best):
            assert result is None
        else:
            value, rows = result
            assert sum(r[0] for r in rows) == total
            assert all(1 <= r[0] <= g[2] for r, g in zip(rows, groups))
            assert value == pytest.approx(best, rel=1e-12)


def test_count_is_the_most_micro_batches_within_the_limit():
    rng = random.Random(21)
    for _ in range(500):
        s, x, cap = rng.uniform(0, 5), rng.choice([0.0, rng.uniform(0.1, 2)]), rng.randint(1, 8)
        limit = rng.uniform(0, 15)
        want = max((m for m in range(1, cap + 1) if s + (m - 1) * x <= limit), default=0)
        assert count(limit, s, x, cap) == want
    # A limit computed as s + (m - 1) x admits m micro-batches.
    assert count(0.1 + 2 * 0.7, 0.1, 0.7, 10) == 3


def test_fluid_value_is_a_lower_bound_on_split_value():
    rng = random.Random(22)
    checked = 0
    for _ in range(300):
        groups = [(rng.uniform(1, 5), rng.uniform(0.1, 3), rng.randint(1, 6), rng.randint(1, 3))
                  for _ in range(rng.randint(1, 4))]
        total = rng.randint(1, 20)
        exact, fluid = split_value(groups, total), fluid_value(groups, total)
        if math.isinf(exact) and math.isinf(fluid):
            continue
        assert fluid <= exact * (1 + 1e-12)
        checked += 1
    assert checked > 100


def test_split_functions_matches_enumeration():
    rng = random.Random(23)
    for _ in range(200):
        d, total = rng.randint(1, 3), rng.randint(1, 7)
        funcs = []
        for _ in range(d):
            row, value = [math.inf], 0.0
            for m in range(1, total + 1):
                value += rng.uniform(0, 3)
                row.append(value if rng.random() < 0.9 or m == 1 else math.inf)
            # inf stays inf once reached (non-decreasing)
            for m in range(2, total + 1):
                if math.isinf(row[m - 1]):
                    row[m] = math.inf
            funcs.append(row)
        best = math.inf
        for counts in itertools.product(range(1, total + 1), repeat=d):
            if sum(counts) == total:
                best = min(best, max(f[m] for f, m in zip(funcs, counts)))
        result = split_functions(funcs, total)
        if math.isinf(best):
            assert result is None
            continue
        value, counts = result
        assert sum(counts) == total and all(m >= 1 for m in counts)
        assert value == best == max(f[m] for f, m in zip(funcs, counts))
