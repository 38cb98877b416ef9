"""enumeration: bounds vectors, class-use vectors and grid layouts against itertools."""

from __future__ import annotations

import itertools
from collections import Counter

from resihp_lightning.solver.enumeration import all_bounds, count_bounds, layouts, replica_types, used_vectors


def test_layouts_are_distinct_up_to_replica_order():
    got = list(layouts(2, 2, (2, 2)))
    canonical = {tuple(sorted(g)) for g in got}
    assert len(canonical) == len(got)
    # Independently: all ways to fill a 2x2 grid with two devices of class 0 and two of class 1.
    want = set()
    for cells in set(itertools.permutations((0, 0, 1, 1))):
        want.add(tuple(sorted((cells[0:2], cells[2:4]))))
    assert canonical == want


def test_all_bounds_are_every_partition_with_min_layers():
    for num_layers in range(1, 8):
        for stages in range(1, num_layers + 2):
            for min_layers in (1, 2, 3):
                want = set()
                for cuts in itertools.combinations(range(1, num_layers), stages - 1):
                    b = (0, *cuts, num_layers)
                    if all(b[j + 1] - b[j] >= min_layers for j in range(stages)):
                        want.add(b)
                got = list(all_bounds(num_layers, stages, min_layers))
                assert len(got) == len(set(got))
                assert set(got) == want
                assert count_bounds(num_layers, stages, min_layers) == len(want)


def test_used_vectors_are_every_class_use_of_the_size():
    for counts in [(1,), (2, 1), (3, 2, 1), (1, 1, 1, 2)]:
        for size in range(0, sum(counts) + 2):
            got = list(used_vectors(counts, size, exclude=True))
            want = {u for u in itertools.product(*(range(c + 1) for c in counts)) if sum(u) == size}
            assert len(got) == len(set(got)) and set(got) == want
            fixed = list(used_vectors(counts, size, exclude=False))
            assert fixed == ([tuple(counts)] if size == sum(counts) else [])


def test_replica_types_are_the_allowed_class_tuples_in_decreasing_order():
    for p, avail in [(1, (2, 1)), (2, (2, 1)), (3, (1, 1, 1)), (3, (3, 0, 2)), (2, (0, 0))]:
        got = replica_types(p, avail)
        want = {
            t for t in itertools.product(range(len(avail)), repeat=p)
            if all(n <= avail[k] for k, n in Counter(t).items())
        }
        assert got == sorted(want, reverse=True)


def test_layouts_cover_every_grid_once():
    for p, d, used in [(1, 3, (2, 1)), (2, 2, (3, 1)), (3, 2, (2, 2, 2)), (2, 3, (4, 2))]:
        got = list(layouts(p, d, used))
        for grid in got:
            assert list(grid) == sorted(grid, reverse=True)
            assert Counter(c for row in grid for c in row) == Counter({k: n for k, n in enumerate(used) if n})
        cells = [k for k, n in enumerate(used) for _ in range(n)]
        want = {tuple(sorted((perm[r * p:(r + 1) * p] for r in range(d)), reverse=True))
                for perm in set(itertools.permutations(cells))}
        assert len(got) == len(set(got)) == len(want) and set(got) == want
