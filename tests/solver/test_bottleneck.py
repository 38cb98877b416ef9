"""bottleneck.min_max_partition against the enumeration of every bounds vector."""

from __future__ import annotations

import itertools
import random

import numpy as np

from resihp_lightning.solver.bottleneck import min_max_partition


def _tables(rng: random.Random, num_layers: int, p: int, integer: bool):
    costs, allowed = [], []
    for _ in range(p):
        if integer:
            cost = np.array([[rng.randint(0, 50) for _ in range(num_layers + 1)] for _ in range(num_layers + 1)], dtype=np.int64)
        else:
            cost = np.array([[rng.uniform(0, 5) for _ in range(num_layers + 1)] for _ in range(num_layers + 1)])
        ok = np.array([[a < b and rng.random() < 0.8 for b in range(num_layers + 1)] for a in range(num_layers + 1)])
        costs.append(cost)
        allowed.append(ok)
    return costs, allowed


def _enumerate(costs, allowed, num_layers: int, p: int):
    best = None
    for cuts in itertools.combinations(range(1, num_layers), p - 1):
        b = (0, *cuts, num_layers)
        if all(allowed[j][b[j], b[j + 1]] for j in range(p)):
            value = max(costs[j][b[j], b[j + 1]] for j in range(p))
            best = value if best is None else min(best, value)
    return best


def test_min_max_partition_matches_enumeration():
    rng = random.Random(31)
    found = missing = 0
    for trial in range(300):
        num_layers = rng.randint(1, 7)
        p = rng.randint(1, num_layers)
        integer = trial % 2 == 0
        costs, allowed = _tables(rng, num_layers, p, integer)
        want = _enumerate(costs, allowed, num_layers, p)
        for latest in (False, True):
            got = min_max_partition(costs, allowed, latest_start_on_ties=latest)
            if want is None:
                assert got is None
                continue
            value, bounds = got
            assert isinstance(value, int if integer else float)
            assert value == want
            assert bounds[0] == 0 and bounds[-1] == num_layers and len(bounds) == p + 1
            assert all(allowed[j][bounds[j], bounds[j + 1]] for j in range(p))
            assert max(costs[j][bounds[j], bounds[j + 1]] for j in range(p)) == want
        found += want is not None
        missing += want is None
    assert found > 150 and missing > 5


def test_nothing_allowed_gives_none():
    cost = np.zeros((4, 4), dtype=np.int64)
    assert min_max_partition([cost, cost], [np.zeros((4, 4), dtype=bool)] * 2) is None
