"""The exact micro-batch split for replicas of fixed per-replica costs.

A replica r with stage-time sum S_r and slowest stage X_r runs m micro-batches in
``T_r(m) = S_r + (m - 1) X_r``, at most ``cap_r`` of them (memory). ``T_r(m)`` is increasing in
``m``, so the smallest T with ``sum_r m_r(T) >= M``, ``m_r(T) = floor((T - S_r) / X_r) + 1`` capped
by memory, is the optimum (:func:`split_value`: bisection on T, then the candidate values
``S + (m - 1) X`` in the last interval); :func:`split` returns the counts too, :func:`fluid_value` a
cheap lower bound for pruning, and :func:`split_functions` the split for arbitrary non-decreasing
per-replica costs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def count(limit: float, s: float, x: float, cap: int) -> int:
    """The most micro-batches m <= cap with ``s + (m - 1) x <= limit`` (0 when not even one fits).

    Times within 1e-13 (relative) of the limit count as fitting, so that ``limit = s + (m - 1) x``
    computed in floating point admits m; the searches compare with the incumbent at a coarser 1e-12,
    so a tie with the incumbent never passes for an improvement.
    """
    tol = 1e-13 * max(1.0, abs(limit))
    if s > limit + tol:
        return 0
    if x <= 0:
        return cap
    q = max(0, math.floor((limit - s) / x))
    if q >= cap:
        return cap
    while s + (q + 1) * x <= limit + tol:
        q += 1
    while q > 0 and s + q * x > limit + tol:
        q -= 1
    return min(cap, q + 1)


def _total(limit: float, groups: Sequence[tuple[float, float, int, int]]) -> int:
    return sum(count(limit, s, x, c) * n for s, x, c, n in groups)


def split_value(groups: Sequence[tuple[float, float, int, int]], total: int) -> float:
    """The smallest T at which replicas of fixed costs can run ``total`` micro-batches (inf: none).

    Args:
        groups: ``(S, X, cap, n)``: n replicas with ``T_r(m) = S + (m - 1) X`` and ``1 <= m <= cap``.
        total: M.

    The optimum is one of the values ``S + (m - 1) X``; a coarse bisection narrows the interval, then
    the candidates inside it are tried in increasing order.
    """
    if len(groups) > 8:
        merged: dict[tuple[float, float, int], int] = {}
        for s, x, c, n in groups:
            merged[(s, x, c)] = merged.get((s, x, c), 0) + n
        groups = [(*key, n) for key, n in merged.items()]
    if sum(g[3] for g in groups) > total or any(g[2] < 1 for g in groups):
        return math.inf
    if sum(min(g[2], total) * g[3] for g in groups) < total:
        return math.inf
    lo = max(g[0] for g in groups)
    if _total(lo, groups) >= total:
        return lo
    hi = max(g[0] + (min(g[2], total) - 1) * g[1] for g in groups)
    for _ in range(40):
        if hi - lo <= 1e-9 * max(1.0, hi):
            break
        mid = (lo + hi) / 2
        if _total(mid, groups) >= total:
            hi = mid
        else:
            lo = mid
    candidates = {hi}
    for s, x, c, _ in groups:
        if x > 0:
            for m in range(count(lo, s, x, c) + 1, count(hi, s, x, c) + 1):
                candidates.add(s + (m - 1) * x)
    for value in sorted(candidates):
        if _total(value, groups) >= total:
            return value
    return hi  # pragma: no cover - hi is feasible


def fluid_value(groups: Sequence[tuple[float, float, int, int]], total: int) -> float:
    """A lower bound on :func:`split_value` in O(groups): the split with fractional micro-batches.

    Real counts ``(T - S) / X + 1`` are at least the integer ones and ignore the caps, so T with
    ``sum_g n_g ((T - S_g) / X_g + 1) < M`` cannot be feasible; nor can T below ``max_g S_g``.
    (Infinite when some replica cannot hold one micro-batch.)
    """
    if any(g[2] < 1 for g in groups) or sum(g[3] for g in groups) > total:
        return math.inf
    floor_t = max(g[0] for g in groups)
    if any(g[1] <= 0 for g in groups):
        return floor_t
    rate = sum(n / x for _, x, _, n in groups)
    need = total - sum(n for *_, n in groups) + sum(n * s / x for s, x, _, n in groups)
    return max(floor_t, need / rate)


def split(groups: Sequence[tuple[float, float, int, int]], total: int) -> tuple[float, list[list[int]]] | None:
    """Optimal micro-batch split for replicas of fixed costs.

    Args:
        groups: ``(S, X, cap, n)``: n replicas with ``T_r(m) = S + (m - 1) X`` and ``m <= cap``.
        total: M, the micro-batches to hand out (each replica gets >= 1).

    Returns:
        ``(max_r T_r, counts)`` with ``counts[g]`` the per-replica counts of group g, or ``None`` when
        no split exists (a replica cannot hold one micro-batch, or the caps sum to less than M).
        Any split with every ``T_r`` at most :func:`split_value` is optimal; the surplus of the
        counts at that value is taken from the replicas that finish last.
    """
    limit = split_value(groups, total)
    if math.isinf(limit):
        return None
    counts = [[max(1, count(limit, s, x, c))] * n for s, x, c, n in groups]
    surplus = sum(map(sum, counts)) - total
    while surplus > 0:
        # One micro-batch less for each of the replicas that finish last, round by round, so that
        # the surplus is spread (max_r T_r never grows).
        cells = sorted(
            ((g, i) for g, row in enumerate(counts) for i in range(len(row)) if row[i] > 1),
            key=lambda gi: -(groups[gi[0]][0] + (counts[gi[0]][gi[1]] - 1) * groups[gi[0]][1]),
        )
        for g, i in cells[:surplus]:
            counts[g][i] -= 1
        surplus -= min(surplus, len(cells))
    worst = max(groups[g][0] + (m - 1) * groups[g][1] for g, row in enumerate(counts) for m in row)
    return worst, counts


def split_functions(funcs: Sequence[Sequence[float]], total: int) -> tuple[float, list[int]] | None:
    """Optimal split for replicas with arbitrary non-decreasing costs ``funcs[r][m]`` (inf = not allowed).

    Greedy: every micro-batch goes where the resulting finish time is smallest; optimal for minimising
    the maximum of non-decreasing functions.
    """
    d = len(funcs)
    if d > total or any(math.isinf(f[1]) for f in funcs):
        return None
    counts = [1] * d
    heap = [(funcs[r][2] if total >= 2 else math.inf, r) for r in range(d)]
    heapq.heapify(heap)
    for _ in range(total - d):
        value, r = heapq.heappop(heap)
        if math.isinf(value):
            return None
        counts[r] += 1
        nxt = funcs[r][counts[r] + 1] if counts[r] + 1 <= total else math.inf
        heapq.heappush(heap, (nxt, r))
    return max(funcs[r][counts[r]] for r in range(d)), counts
