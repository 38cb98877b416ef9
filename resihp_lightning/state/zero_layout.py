"""Which holder keeps which slice of a layer's optimizer state under the layer-wise ZeRO-1 (pure arithmetic).

A layer's trained parameters, flattened and concatenated in ``named_parameters`` order, form one flat
index space of ``total`` elements. Its ``D`` holders (one per replica, in replica order) cut it into
``D`` contiguous slices, slice ``s`` being ``[total * s // D, total * (s + 1) // D)`` (sizes differ by
at most one element). Redundancy ``r = 2``: holder ``i`` keeps the optimizer state of its own slice
``i`` (the *primary*) and of its neighbour's slice ``(i + 1) % D`` (the *copy*), so slice ``s`` lives
on holders ``s`` and ``(s - 1) % D`` and survives the loss of any one of them. With ``D <= 2`` every
holder keeps everything; with ``D = 1`` there is nothing to share.

A slice crosses parameter boundaries: it is stepped as *pieces*, one contiguous range of one
parameter each.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """One contiguous part of a slice inside one parameter.

    Attributes:
        param: the parameter's position in the layer's trained parameters.
        start: first element, in the parameter's flattened index.
        stop: one past the last element.
    """

    param: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class SliceLayout:
    """The slices of one layer's flat parameters over its ``holders`` (see the module docstring).

    Attributes:
        numels: element count of each trained parameter of the layer, in order.
        holders: D, the layer's holder count (>= 1).
    """

    numels: tuple[int, ...]
    holders: int

    def __post_init__(self) -> None:
        if self.holders < 1:
            raise ValueError(f"a layer has at least one holder, not {self.holders}")
        if any(n < 0 for n in self.numels):
            raise ValueError(f"parameter sizes must be >= 0: {self.numels}")

    @property
    def total(self) -> int:
        """Elements of the layer's flat parameters."""
        return sum(self.numels)

    def bounds(self, s: int) -> tuple[int, int]:
        """Slice ``s``'s range ``[start, stop)`` in the flat index."""
        self._check(s)
        return self.total * s // self.holders, self.total * (s + 1) // self.holders

    def sizes(self) -> list[int]:
        """Elements of every slice, in slice order."""
        return [b - a for a, b in map(self.bounds, range(self.holders))]

    def pieces(self, s: int) -> list[Piece]:
        """Slice ``s`` cut at parameter boundaries, in flat order (no empty pieces)."""
        start, stop = self.bounds(s)
        out, offset = [], 0
        for index, numel in enumerate(self.numels):
            lo, hi = max(start, offset), min(stop, offset + numel)
            if lo < hi:
                out.append(Piece(index, lo - offset, hi - offset))
            offset += numel
        return out

    def keepers(self, s: int) -> tuple[int, ...]:
        """The holders keeping slice ``s``: its primary ``s``, then its copy ``(s - 1) % D`` (once when D = 1)."""
        self._check(s)
        copy = (s - 1) % self.holders
        return (s,) if copy == s else (s, copy)

    def kept_by(self, holder: int) -> tuple[int, ...]:
        """The slices ``holder`` keeps: its own, then its neighbour's ``(holder + 1) % D`` (once when D = 1)."""
        self._check(holder)
        neighbour = (holder + 1) % self.holders
        return (holder,) if neighbour == holder else (holder, neighbour)

    def kept_elements(self, holder: int) -> int:
        """Elements of the optimizer state ``holder`` keeps (its slices' sizes)."""
        return sum(self.bounds(s)[1] - self.bounds(s)[0] for s in self.kept_by(holder))

    def lost(self, alive: set[int]) -> list[int]:
        """The non-empty slices none of whose keepers is in ``alive`` (holder indices)."""
        return [s for s in range(self.holders) if self.sizes()[s] and not set(self.keepers(s)) & alive]

    def _check(self, index: int) -> None:
        if not 0 <= index < self.holders:
            raise IndexError(f"slice / holder {index} out of range for D = {self.holders}")
