"""The class-level model shared by the exact planner's phases.

:class:`Model` holds the prefix sums of one :class:`~resihp_lightning.plan.Problem` and prices
stages on device classes (devices of equal speed, link slowdown and memory); :class:`Best` keeps the best
class-level layout either phase has found, and :func:`build_plan` turns it into a
:class:`~resihp_lightning.plan.Plan` with real device ids.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from resihp_lightning.plan import (
    EPS,
    Plan,
    Problem,
    Replica,
    device_classes,
    prefix_sums,
    stage_p2p_by_position,
    stage_position,
)


#: Memos shared by models of equal layers and transfer costs (:meth:`Model.shared`), the last few.
_SHARED: list[tuple[tuple, dict]] = []


class Model:
    """Prefix sums and per-class stage costs of one problem (shared by exact and heuristic phases)."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.L = problem.num_layers
        self.M = problem.micro_batches
        self.min_layers = problem.min_layers_per_stage
        self.classes = device_classes(problem)
        prefix = prefix_sums(problem)
        self.pc, self.ps, self.pa = prefix.compute, prefix.static, prefix.activation
        # cheapest[a]: the least compute of one layer among layers a..L-1.
        self.cheapest = [math.inf] * (self.L + 1)
        for a in range(self.L - 1, -1, -1):
            self.cheapest[a] = min(self.cheapest[a + 1], problem.layers[a].compute_ms)
        self._layer_bound_memo: dict[tuple, float] = {}
        self._spans: list[float] | None = None
        self._shared: dict | None = None
        # Per class, the transfer time of a stage by its position (plan.STAGE_POSITIONS: only, first,
        # last, middle), from plan.stage_p2p_ms so that it rounds alike.
        self.link = [c.link_slowdown for c in self.classes]
        self._p2p = [stage_p2p_by_position(problem.p2p_ms, u) for u in self.link]
        #: Some class has a slow link (u > 1); False means the model is the one without link speeds.
        self.slow_links = any(u > 1.0 for u in self.link)

    @property
    def shared(self) -> dict:
        """A memo shared by every model of equal layers, p2p cost, minimum stage size and M.

        Values that depend only on these and on device kinds (a pure replica's bottleneck, a
        composition's micro-batch bound) are the same for every problem over the same model, such
        as the groupings of a tensor-parallel search. The searches count their work units as if
        they computed them, so results never depend on what was solved before.
        """
        if self._shared is None:
            key = (self.pc, self.ps, self.pa, self.problem.p2p_ms, self.min_layers, self.M)
            for known, memo in _SHARED:
                if known == key:
                    break
            else:
                memo = {}
                _SHARED.insert(0, (key, memo))
                del _SHARED[4:]
            if len(memo) > 200_000:  # a long replay of many problems: start afresh
                memo.clear()
            self._shared = memo
        return self._shared

    def stage_p2p(self, cls: int, j: int, p: int) -> float:
        """Transfer time of stage j of P on class ``cls`` (:func:`~resihp_lightning.plan.stage_p2p_ms`)."""
        return self._p2p[cls][stage_position(j, p)]

    def max_stage_p2p(self, cls: int) -> float:
        """The most transfer time a stage on class ``cls`` can pay (a middle stage's)."""
        return self._p2p[cls][3]

    def pure_p2p_sum(self, cls: int, p: int) -> float:
        """``sum_j`` of the transfer times of a replica of P stages all on class ``cls``.

        ``(P - 1) p2p (2u - 1)``; with u = 1 exactly ``(P - 1) p2p`` as without link speeds.
        """
        return (p - 1) * self._p2p[cls][3]

    def min_p2p_sum(self, types, p: int) -> float:
        """A lower bound on ``sum_j`` transfer times of P stages on these classes in any order.

        Stage j pays ``p2p ([j < P-1] u_j + [j > 0] (u_j - 1))``, so the sum is
        ``p2p (2 sum u - u_first - u_last - (P - 1))``, least with the two slowest links at the ends.
        """
        if p <= 1:
            return 0.0
        us = [self.link[c] for c in types]
        if max(us) == 1.0:
            return (p - 1) * self.problem.p2p_ms
        top = sorted(us, reverse=True)
        return self.problem.p2p_ms * (2 * sum(us) - top[0] - top[1] - (p - 1))

    def allreduce(self, classes, d: int) -> float:
        """The all-reduce of a plan of D replicas using these classes: ``allreduce_ms * max u`` when D > 1."""
        if d <= 1:
            return 0.0
        return self.problem.allreduce_ms * max(self.link[c] for c in classes)

    def grid_allreduce(self, grid, d: int) -> float:
        """:meth:`allreduce` of a class-level grid (one tuple of class ids per replica)."""
        if d <= 1:
            return 0.0
        return self.allreduce({c for types in grid for c in types}, d)

    def layer_bound(self, speeds: tuple[float, ...], a: int, transfers: tuple[float, ...] | None = None) -> float:
        """A lower bound on the slowest of stages at ``speeds`` holding layers a..L-1, from whole layers.

        Stage j holds n_j layers of at least ``c = cheapest[a]`` ms each, so ``t_j >= n_j c / s_j``
        (plus its transfer time ``transfers[j]`` when given, e.g. by a replica whose order is
        fixed); with all ``t_j <= X`` every ``n_j <= floor((X - transfers[j]) s_j / c)``, and the
        n_j must add up to L - a. Returns (just below) the least X where they can.
        """
        key = (speeds, a, transfers)
        found = self._layer_bound_memo.get(key)
        if found is not None:
            return found
        n, c = self.L - a, self.cheapest[a]
        extra = transfers if transfers is not None else (0.0,) * len(speeds)
        if n <= 0 or not c > 0:
            value = 0.0
        else:
            lo, hi = 0.0, n * c / max(speeds) + max(extra)
            for _ in range(50):
                mid = (lo + hi) / 2
                if sum(math.floor(max(0.0, mid - e) * s / c) for s, e in zip(speeds, extra)) >= n:
                    hi = mid
                else:
                    lo = mid
            value = lo * (1 - 1e-9)
        self._layer_bound_memo[key] = value
        return value

    def longest_run(self, budget: float) -> float:
        """The most compute of contiguous layers that is at most ``budget`` (within 1e-12 relative); 0 below any layer.

        Every run of contiguous layers is a span ``pc[b] - pc[a]``, so this is the largest span
        value not above the budget: a bisection into the sorted spans (computed once per model).
        """
        if not budget >= 0:
            return 0.0
        if self._spans is None:
            pc = self.pc
            self._spans = sorted({pc[b] - pc[a] for b in range(self.L + 1) for a in range(b + 1)})
        index = bisect.bisect_right(self._spans, budget + 1e-12 * max(1.0, budget)) - 1
        return max(0.0, self._spans[index]) if index >= 0 else 0.0

    def stage_time(self, a: int, b: int, cls: int, j: int, p: int) -> float:
        """t of stage j of P holding layers a..b-1 on class ``cls`` (as :func:`~resihp_lightning.plan.evaluate`)."""
        return (self.pc[b] - self.pc[a]) / self.classes[cls].speed + self._p2p[cls][stage_position(j, p)]

    def stage_cap(self, a: int, b: int, cls: int, in_flight_max: int) -> int:
        """The most micro-batches stage [a, b) fits on class ``cls`` (``M`` when memory never binds)."""
        capacity = self.classes[cls].memory_mb * (1 + EPS) + EPS
        static = self.ps[b] - self.ps[a]
        act = self.pa[b] - self.pa[a]
        if static + in_flight_max * act <= capacity:
            return self.M
        if act <= 0:
            return 0
        fits = max(0, min(in_flight_max - 1, math.floor((capacity - static) / act)))
        if fits and static + fits * act > capacity:  # the division rounded up
            fits -= 1
        return fits

    def profile(self, types: Sequence[int], bounds: Sequence[int]) -> tuple[float, float, int]:
        """(S, X, cap) of a replica: sum and max of stage times, most micro-batches memory allows."""
        p = len(types)
        total, worst, cap = 0.0, 0.0, self.M
        for j, cls in enumerate(types):
            t = self.stage_time(bounds[j], bounds[j + 1], cls, j, p)
            total += t
            worst = max(worst, t)
            cap = min(cap, self.stage_cap(bounds[j], bounds[j + 1], cls, p - j))
        return total, worst, cap


def build_plan(model: Model, grid: Sequence[Sequence[int]], bounds: Sequence[Sequence[int]], counts: Sequence[int]) -> Plan:
    """Turns class-level choices into a plan with real device ids (lowest ids of each class first)."""
    pools = [list(c.ids) for c in model.classes]
    taken = [0] * len(pools)
    replicas = []
    # Replicas of faster devices first (class ids grow as speed falls).
    for types, b, m in sorted(zip(grid, bounds, counts), key=lambda row: tuple(row[0])):
        ids = []
        for cls in types:
            ids.append(pools[cls][taken[cls]])
            taken[cls] += 1
        replicas.append(Replica(tuple(ids), tuple(b), int(m)))
    return Plan(tuple(replicas))


@dataclass
class Best:
    """The best class-level layout seen so far; :meth:`offer` keeps a strictly better one."""

    value: float = math.inf
    grid: tuple = ()
    bounds: tuple = ()
    counts: tuple = ()

    def offer(self, value: float, grid, bounds, counts) -> None:
        """Keeps this layout when it is lower than the best by more than 1e-12 x max(1, value)."""
        if value < self.value - 1e-12 * max(1.0, abs(value)):
            self.value, self.grid, self.bounds, self.counts = value, tuple(grid), tuple(bounds), tuple(counts)
