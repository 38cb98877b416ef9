"""The replica knapsack: which mix of replica compositions runs the most micro-batches.

Devices of one class are interchangeable, so a replica is described, for counting, by its
*composition*: how many devices of each class it holds (a vector summing to P). Given for every
composition a number of micro-batches one replica of it can run (exact or an upper bound), the
question "how many micro-batches can D replicas run in all, using the devices there are?" is a
multi-dimensional unbounded knapsack with few dimensions:

* the class with the most devices is *free*: its pure replicas are not items, they fill the
  replicas left over (each worth ``free_value``);
* every other composition is an item, weighing its devices of the non-free classes;
* without exclusion every non-free device is used exactly once; with it, at most once, and the
  free class must have enough devices for the rest of the grid.

:meth:`ReplicaKnapsack.solve` solves it exactly by dynamic programming over (items chosen, non-free devices
used). The state space is the product of (count + 1) over the non-free classes, so this is meant
for what re-planning sees: a large healthy class and a few devices of other speeds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

#: The knapsack refuses (``TooLarge``) state spaces beyond this many cells (items x states).
MAX_CELLS = 30_000_000


class TooLarge(Exception):
    """The knapsack's state space is beyond :data:`MAX_CELLS`; the caller uses another method."""


def compositions(p: int, avail: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every vector of per-class counts summing to ``p`` with ``counts[c] <= avail[c]``."""

    def rec(k: int, left: int) -> Iterator[tuple[int, ...]]:
        if k == len(avail) - 1:
            if left <= avail[k]:
                yield (left,)
            return
        for take in range(min(left, avail[k]), -1, -1):
            for rest in rec(k + 1, left - take):
                yield (take, *rest)

    if not avail:
        return
    yield from rec(0, p)


@dataclass(frozen=True)
class Mix:
    """The knapsack's answer: ``total`` micro-batches from ``items`` (composition -> replicas) plus
    ``free_replicas`` pure replicas of the free class."""

    total: int
    items: dict[tuple[int, ...], int]
    free_replicas: int


class ReplicaKnapsack:
    """The knapsack of one shape (P, D) over fixed class counts; solved for any item values.

    Args:
        p: stages per replica.
        d: replicas.
        counts: devices per class.
        exclude: devices may be left out.

    Raises:
        TooLarge: the state space is beyond :data:`MAX_CELLS`.
    """

    def __init__(self, p: int, d: int, counts: Sequence[int], exclude: bool) -> None:
        self.p, self.d, self.exclude = p, d, exclude
        self.counts = tuple(counts)
        self.free = max(range(len(counts)), key=lambda c: (counts[c], -c))
        self.others = [c for c in range(len(counts)) if c != self.free]
        caps = [counts[c] for c in self.others]
        self.radix = []
        size = 1
        for cap in caps:
            self.radix.append(size)
            size *= cap + 1
        self.size = size
        self.rmax = min(d, sum(caps))
        self.items = [k for k in compositions(p, counts) if k[self.free] != p]
        if (self.rmax + 1) * self.size * max(1, len(self.items)) > MAX_CELLS:
            raise TooLarge(f"{len(self.items)} compositions x {self.size} states x {self.rmax + 1} replica counts")
        import numpy as np

        # used[c][s]: devices of others[c] used in state s.
        idx = np.arange(self.size)
        self._used = [(idx // self.radix[i]) % (caps[i] + 1) for i in range(len(caps))]
        # Every (item, source state) move at once, ordered by destination state, so that one
        # maximum.reduceat per replica count does a whole layer of the table.
        offsets, sources, owners = [], [], []
        for i, k in enumerate(self.items):
            ok = np.ones(self.size, dtype=bool)
            offset = 0
            for j, c in enumerate(self.others):
                ok &= self._used[j] + k[c] <= caps[j]
                offset += k[c] * self.radix[j]
            offsets.append(offset)
            src = np.nonzero(ok)[0]
            sources.append(src)
            owners.append(np.full(src.size, i, dtype=np.int64))
        self._offsets = np.asarray(offsets, dtype=np.int64)
        src = np.concatenate(sources) if sources else np.zeros(0, dtype=np.int64)
        owner = np.concatenate(owners) if owners else np.zeros(0, dtype=np.int64)
        dst = src + self._offsets[owner] if owner.size else src
        order = np.argsort(dst, kind="stable")
        self._src, self._owner, dst = src[order], owner[order], dst[order]
        self._dst, self._starts = np.unique(dst, return_index=True)
        n_other = sum(caps)
        total_used = sum(self._used) if self._used else np.zeros(self.size, dtype=np.int64)
        if exclude:
            # The free class fills the rest of the grid: d * p - (non-free devices used).
            self._final = (d * p - total_used) <= counts[self.free]
        else:
            self._final = total_used == n_other
        #: The work of one table: every move once per replica count.
        self.cells = self.rmax * int(self._src.size) + self.size

    def _table(self, values: Mapping[tuple[int, ...], int]):
        """``best[r][s]``: the most micro-batches of r items using the non-free devices of state s."""
        import numpy as np

        neg = np.iinfo(np.int64).min // 4
        gain = np.array([values.get(k, 0) for k in self.items], dtype=np.int64)
        gain = np.where(gain >= 1, gain, neg)  # a replica must run at least one micro-batch
        best = np.full((self.rmax + 1, self.size), neg, dtype=np.int64)
        best[0, 0] = 0
        if self._src.size:
            move_gain = gain[self._owner]
            for r in range(self.rmax):
                cand = best[r, self._src] + move_gain
                # Clamped at neg: unreachable entries must not drift towards overflow.
                best[r + 1, self._dst] = np.maximum(np.maximum.reduceat(cand, self._starts), neg)
        return best, gain, neg

    def _adds_up(self, prev: int, k: tuple[int, ...], state: int) -> bool:
        """Whether state ``prev`` plus one replica of composition k is exactly ``state``."""
        return all(int(self._used[j][prev]) + k[c] == int(self._used[j][state]) for j, c in enumerate(self.others))

    def upper_by_replicas(self, values: Mapping[tuple[int, ...], int]) -> list[int | None]:
        """``G[r]``: the most micro-batches r item replicas can run in a complete mix (None: no mix)."""
        best, _, neg = self._table(values)
        out: list[int | None] = []
        for r in range(self.rmax + 1):
            row = best[r][self._final]
            top = int(row.max()) if row.size else neg
            out.append(None if top <= neg // 2 else top)
        return out

    def solve(self, values: Mapping[tuple[int, ...], int], free_value: int) -> Mix | None:
        """The mix with the most micro-batches (``None`` when no complete mix exists).

        Args:
            values: micro-batches one replica of each item composition runs (< 1: not usable).
            free_value: micro-batches of one pure replica of the free class (< 1: not usable).
        """
        import numpy as np

        best, gain, neg = self._table(values)
        top, where = -1, None
        for r in range(self.rmax + 1):
            rest = self.d - r
            if rest < 0 or (rest > 0 and free_value < 1):
                continue
            valid = (best[r] > neg // 2) & self._final
            if not valid.any():
                continue
            s = int(np.argmax(np.where(valid, best[r], neg)))
            total = int(best[r, s]) + rest * free_value
            if total > top:
                top, where = total, (r, s)
        if where is None:
            return None
        r, s = where
        items: dict[tuple[int, ...], int] = {}
        while r > 0:
            # Some item leads here from a state of one item less with exactly this value.
            for i, k in enumerate(self.items):
                prev = s - int(self._offsets[i])
                if gain[i] >= 1 and prev >= 0 and best[r - 1, prev] > neg // 2 and \
                        self._adds_up(prev, k, s) and best[r - 1, prev] + gain[i] == best[r, s]:
                    break
            else:  # pragma: no cover - the table was built from these moves
                raise AssertionError("knapsack backtrack found no move")
            items[k] = items.get(k, 0) + 1
            s, r = prev, r - 1
        return Mix(top, items, self.d - where[0])


#: Knapsacks built lately, by (P, D, counts, exclude): a table depends on nothing else, and a search
#: over many problems of the same device kinds (a tensor-parallel search) asks for the same ones.
_BUILT: dict[tuple, ReplicaKnapsack] = {}


def replica_knapsack(p: int, d: int, counts: Sequence[int], exclude: bool) -> ReplicaKnapsack:
    """:class:`ReplicaKnapsack` ``(p, d, counts, exclude)``, reused when built lately (it is never changed
    after it is built).

    Raises:
        TooLarge: as the constructor.
    """
    key = (p, d, tuple(counts), exclude)
    found = _BUILT.get(key)
    if found is None:
        found = ReplicaKnapsack(p, d, counts, exclude)
        if len(_BUILT) >= 2_000:
            _BUILT.clear()
        _BUILT[key] = found
    return found


def free_upper(g: Sequence[int | None], d: int, free_value: int) -> int:
    """The most micro-batches of any mix when the free class's pure replicas run ``free_value``."""
    top = -1
    for r, value in enumerate(g):
        if value is None or r > d:
            continue
        rest = d - r
        if rest > 0 and free_value < 1:
            continue
        top = max(top, value + rest * free_value)
    return top if top >= 0 else -math.inf
