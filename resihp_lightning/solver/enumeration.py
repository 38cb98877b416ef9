"""Enumeration of the exact planner's search space.

Bounds vectors (stage partitions), how many devices of each class a plan uses, and the assignments
of device classes to the P x D grid up to replica order.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence


def all_bounds(num_layers: int, stages: int, min_layers: int) -> Iterator[tuple[int, ...]]:
    """Every bounds vector 0 = b0 < ... < bP = L with stages of at least ``min_layers`` layers."""
    slack = num_layers - stages * min_layers
    if slack < 0:
        return
    for cuts in itertools.combinations(range(slack + stages - 1), stages - 1):
        bounds, prev = [0], -1
        for c in cuts:
            bounds.append(bounds[-1] + min_layers + (c - prev - 1))
            prev = c
        bounds.append(num_layers)
        yield tuple(bounds)


def count_bounds(num_layers: int, stages: int, min_layers: int) -> int:
    slack = num_layers - stages * min_layers
    return math.comb(slack + stages - 1, stages - 1) if slack >= 0 else 0


def used_vectors(counts: Sequence[int], size: int, exclude: bool) -> Iterator[tuple[int, ...]]:
    """How many devices of each class a plan of ``size`` devices uses."""
    if not exclude:
        if sum(counts) == size:
            yield tuple(counts)
        return

    def rec(k: int, left: int) -> Iterator[tuple[int, ...]]:
        if k == len(counts):
            if left == 0:
                yield ()
            return
        for take in range(min(counts[k], left), -1, -1):
            for rest in rec(k + 1, left - take):
                yield (take, *rest)

    yield from rec(0, size)


def replica_types(p: int, avail: Sequence[int]) -> list[tuple[int, ...]]:
    """Every P-tuple of class ids that the available counts allow, in decreasing order."""
    out: list[tuple[int, ...]] = []

    def rec(prefix: list[int], left: list[int]) -> None:
        if len(prefix) == p:
            out.append(tuple(prefix))
            return
        for k in range(len(left)):
            if left[k]:
                left[k] -= 1
                prefix.append(k)
                rec(prefix, left)
                prefix.pop()
                left[k] += 1

    rec([], list(avail))
    return sorted(out, reverse=True)


def layouts(p: int, d: int, used: Sequence[int], spend: Callable[[], None] | None = None
            ) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Assignments of classes to the P x D grid up to replica order (replicas in decreasing order).

    ``spend`` is called once per node of the recursion (a caller's work budget: it may raise to
    stop); with many replicas and classes most nodes lead nowhere, so the layouts alone do not
    measure the work.
    """
    types = replica_types(p, used)

    def rec(start: int, left: list[int], chosen: list[tuple[int, ...]]) -> Iterator[tuple[tuple[int, ...], ...]]:
        if spend is not None:
            spend()
        if len(chosen) == d:
            if not any(left):
                yield tuple(chosen)
            return
        classes_left = [k for k in range(len(left)) if left[k]]
        if len(classes_left) == 1:
            # Only one class remains: the rest of the grid is forced (keeps recursion shallow).
            k = classes_left[0]
            rest = d - len(chosen)
            pure = (k,) * p
            if left[k] == rest * p and (not chosen or chosen[-1] >= pure):
                yield (*chosen, *([pure] * rest))
            return
        for i in range(start, len(types)):
            if i == len(types) - 1:
                # The smallest type: every remaining replica must take it (keeps recursion shallow).
                rest = d - len(chosen)
                need = Counter(types[i])
                if all(left[k] == rest * need.get(k, 0) for k in range(len(left))):
                    yield (*chosen, *([types[i]] * rest))
                return
            need = Counter(types[i])
            if all(left[k] >= n for k, n in need.items()):
                for k, n in need.items():
                    left[k] -= n
                chosen.append(types[i])
                yield from rec(i, left, chosen)
                chosen.pop()
                for k, n in need.items():
                    left[k] += n

    yield from rec(0, list(used), [])
