"""knapsack: the replica knapsack and its compositions against enumeration of replica mixes."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

from resihp_lightning.solver.knapsack import ReplicaKnapsack, compositions, free_upper


def _cases(seed: int, tries: int = 60):
    """Random knapsacks (replicas of p devices over up to 3 classes) with random item values, each with
    the best total found by enumerating every mix of d replicas (-1: no mix fits)."""
    rng = random.Random(seed)
    for _ in range(tries):
        counts = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        p = rng.randint(1, 3)
        exclude = rng.random() < 0.5
        d = rng.randint(1, max(1, sum(counts) // p))
        if not exclude and d * p != sum(counts):
            continue
        kn = ReplicaKnapsack(p, d, counts, exclude)
        values = {k: rng.randint(0, 9) for k in compositions(p, counts)}
        free_pure = tuple(p if c == kn.free else 0 for c in range(len(counts)))
        free_value = values.get(free_pure, 0)
        best = -1
        comps = [k for k in compositions(p, counts) if values[k] >= 1]
        for mix in itertools.combinations_with_replacement(comps, d):
            used = [sum(k[c] for k in mix) for c in range(len(counts))]
            if all(u <= n for u, n in zip(used, counts)) and (exclude or used == counts):
                best = max(best, sum(values[k] for k in mix))
        yield kn, values, free_pure, free_value, d, best


def test_knapsack_matches_enumeration_of_replica_mixes():
    checked = 0
    for kn, values, free_pure, free_value, d, best in _cases(4):
        found = kn.solve(values, free_value)
        if best < 0:
            assert found is None
            continue
        assert found.total == best
        mix = Counter({k: n for k, n in found.items.items()})
        if found.free_replicas:
            mix[free_pure] += found.free_replicas
        assert sum(mix.values()) == d
        assert sum(values[k] * n for k, n in mix.items()) == best
        checked += 1
    assert checked > 20


def test_compositions_are_every_bounded_count_vector():
    for p, avail in [(1, (1,)), (2, (2, 1)), (3, (1, 2, 3)), (4, (2, 0, 4)), (3, (1, 1))]:
        got = list(compositions(p, avail))
        want = {k for k in itertools.product(*(range(a + 1) for a in avail)) if sum(k) == p}
        assert len(got) == len(set(got)) and set(got) == want
    assert list(compositions(2, ())) == []


def test_free_upper_is_the_best_mix_by_enumeration():
    checked = 0
    for kn, values, _, free_value, d, best in _cases(9):
        # Item values only: the free class's pure replica is not an item of the table.
        got = free_upper(kn.upper_by_replicas(values), d, free_value)
        if best < 0:
            assert got == -math.inf
        else:
            assert got == best
            checked += 1
    assert checked > 20
