"""The ``exact`` backend: a combinatorial planner for the DESIGN.md model.

:func:`solve_exact` runs two phases: a fast heuristic (the incumbent), then a complete search that
either proves the incumbent optimal or replaces it with the optimum, within a work budget.

* **Exact phase** (status ``"optimal"`` when it completes). Devices are grouped into classes of equal
  (speed, memory); devices of one class are interchangeable, and so is the order of the replicas. For
  every shape (P, D) of :meth:`Problem.candidate_shapes` (pruned by the lower bound
  ``T >= max(M C / S, C / s_max + (P - 1) p2p + (M - D) C / S)`` plus the all-reduce, with C the
  total compute and S the speed of the P*D fastest devices; see :func:`lower_bound`), every choice of
  how many devices of each class to use (``allow_exclude``), and every assignment of classes to the
  P x D grid up to replica order, it searches the stage bounds:

  - shared partition: branch and bound over the bounds, stage by stage, all replica kinds priced at
    once; a node is cut when a valid lower bound cannot beat the incumbent: partial stage sums and
    maxima plus the least the remaining layers can add (their compute over the fastest remaining
    device for the sum; for the max, their compute over the remaining devices' total speed, and
    :meth:`Model.layer_bound`, which counts whole layers), partial memory caps, and a fractional
    micro-batch split (:func:`fluid_value`);
  - per-replica partitions: replicas are independent given their micro-batch counts, so for a
    limit just below the incumbent every replica kind gets the most micro-batches it can run within
    the limit (a branch and bound over its bounds with the same lower bounds, or, for a replica of
    one class whose stage sum is fixed, an exact bottleneck dynamic programme per in-flight level);
    when they add up to M the layout beats the incumbent and the question is asked again below the
    new value, else the layout is done. Without any incumbent (the heuristic found nothing) every
    bounds vector is priced instead, reduced to ``f(m) = min_b T_r(b, m)`` and split greedily.

  For fixed per-replica costs the micro-batch split is solved exactly: ``T_r(m)`` is increasing in
  ``m``, so the smallest T with ``sum_r m_r(T) >= M``, ``m_r(T) = floor((T - S_r) / X_r) + 1`` capped
  by memory, is the optimum (:func:`split_value`: bisection on T, then the candidate values
  ``S + (m - 1) X`` in the last interval). A completed search is a proof of optimality for the model.

  Its work is counted in units (one priced bounds vector or branch-and-bound child, ~50 µs): at
  most ``budget`` (:data:`DEFAULT_BUDGET` as a MILP warm start, ``time_limit_s`` x
  :data:`UNITS_PER_SECOND` as the chosen backend). Past it the result is the best plan seen, status
  ``"feasible"``. Measured: every test problem completes; the 16-device, 32-layer examples complete
  in 10 153 (shared partition) and 6 255 (per replica) units; 32-1024 devices with 96-128 layers
  mostly do not (the MILP backends prove those).

* **Heuristic phase** (the incumbent; not claimed optimal):

  - shapes: every allowed (P, D) whose lower bound can beat the incumbent; with ``allow_exclude`` only
    those that use all devices or leave out whole slowest classes, always keeping the fastest devices;
  - placements: the devices outside the largest class spread one per replica, or packed into as few
    replicas as possible, at the last or at the first stages (4 candidates);
  - bounds: bottleneck-minimal partitions (bisection on the stage-time cap, greedy farthest reach,
    memory for the expected micro-batch count), then, for the 8 most promising (shape, placement)
    pairs, a local search that moves one boundary or two neighbouring ones by 8, 4, 2, 1 layers;
    per-replica partitions alternate bounds per (replica kind, m) with the split, 3 rounds;
  - micro-batches: the exact split above.

  On 116 random problems with 2-8 devices, 4-10 layers and up to 2 slow devices (shared and
  per-replica, exclusion, tight memory) it matched the exact optimum within 0.1% (mean 1e-5); on
  256-1024 devices, 128 layers and <= 3 speed classes it takes 0.1-0.7 s on the 2-core machine.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from resihp_lightning.errors import InfeasibleError
from resihp_lightning.plan import EPS, Plan, Problem, Replica, device_classes, evaluate

#: Work units (priced bounds candidates / branch-and-bound children) of the exact phase when it is a
#: warm start: at most about 0.5 s on the 2-core dev machine.
DEFAULT_BUDGET = 12_000
#: Work units per second of ``time_limit_s`` when ``exact`` is the chosen backend (a deterministic
#: stand-in for a time limit; ~50 µs per unit measured on the 2-core dev machine).
UNITS_PER_SECOND = 20_000


class _BudgetExceeded(Exception):
    pass


class Model:
    """Prefix sums and per-class stage costs of one problem (shared by exact and heuristic phases)."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.L = problem.num_layers
        self.M = problem.micro_batches
        self.min_layers = problem.min_layers_per_stage
        self.classes = device_classes(problem)
        pc, ps, pa = [0.0], [0.0], [0.0]
        for layer in problem.layers:
            pc.append(pc[-1] + layer.compute_ms)
            ps.append(ps[-1] + layer.static_mb)
            pa.append(pa[-1] + layer.activation_mb)
        self.pc, self.ps, self.pa = pc, ps, pa
        # cheapest[a]: the least compute of one layer among layers a..L-1.
        self.cheapest = [math.inf] * (self.L + 1)
        for a in range(self.L - 1, -1, -1):
            self.cheapest[a] = min(self.cheapest[a + 1], problem.layers[a].compute_ms)
        self._layer_bound_memo: dict[tuple[tuple[float, ...], int], float] = {}

    def layer_bound(self, speeds: tuple[float, ...], a: int) -> float:
        """A lower bound on the slowest of stages at ``speeds`` holding layers a..L-1, from whole layers.

        Stage j holds n_j layers of at least ``c = cheapest[a]`` ms each, so ``t_j >= n_j c / s_j``;
        with all ``t_j <= X`` every ``n_j <= floor(X s_j / c)``, and the n_j must add up to L - a.
        Returns (just below) the least X where they can.
        """
        key = (speeds, a)
        found = self._layer_bound_memo.get(key)
        if found is not None:
            return found
        n, c = self.L - a, self.cheapest[a]
        if n <= 0 or not c > 0:
            value = 0.0
        else:
            lo, hi = 0.0, n * c / max(speeds)
            for _ in range(50):
                mid = (lo + hi) / 2
                if sum(math.floor(mid * s / c) for s in speeds) >= n:
                    hi = mid
                else:
                    lo = mid
            value = lo * (1 - 1e-9)
        self._layer_bound_memo[key] = value
        return value

    def stage_time(self, a: int, b: int, cls: int, last: bool) -> float:
        return (self.pc[b] - self.pc[a]) / self.classes[cls].speed + (0.0 if last else self.problem.p2p_ms)

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
            t = self.stage_time(bounds[j], bounds[j + 1], cls, j == p - 1)
            total += t
            worst = max(worst, t)
            cap = min(cap, self.stage_cap(bounds[j], bounds[j + 1], cls, p - j))
        return total, worst, cap


# ----------------------------------------------------------------------------- micro-batch split
def _count(limit: float, s: float, x: float, cap: int) -> int:
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
    return sum(_count(limit, s, x, c) * n for s, x, c, n in groups)


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
            for m in range(_count(lo, s, x, c) + 1, _count(hi, s, x, c) + 1):
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
    counts = [[max(1, _count(limit, s, x, c))] * n for s, x, c, n in groups]
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


# ----------------------------------------------------------------------------------- enumeration
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


def layouts(p: int, d: int, used: Sequence[int]) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Assignments of classes to the P x D grid up to replica order (replicas in decreasing order)."""
    types = replica_types(p, used)

    def rec(start: int, left: list[int], chosen: list[tuple[int, ...]]) -> Iterator[tuple[tuple[int, ...], ...]]:
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


def lower_bound(model: Model, p: int, d: int) -> float:
    """A valid lower bound on T for shape (P, D) (see module docstring)."""
    speeds = sorted((c.speed for c in model.classes for _ in c.ids), reverse=True)
    compute = model.pc[-1]
    top = sum(speeds[: p * d])
    throughput = model.M * compute / top
    # T_r >= C / s_max + (P - 1) p2p + (m_r - 1) C / sigma_r, summed over the replicas.
    bubble = compute / speeds[0] + (p - 1) * model.problem.p2p_ms + (model.M - d) * compute / top
    return max(throughput, bubble) + (model.problem.allreduce_ms if d > 1 else 0.0)


# ------------------------------------------------------------------------------------ plan build
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
class _Best:
    value: float = math.inf
    grid: tuple = ()
    bounds: tuple = ()
    counts: tuple = ()

    def offer(self, value: float, grid, bounds, counts) -> None:
        if value < self.value - 1e-12 * max(1.0, abs(value)):
            self.value, self.grid, self.bounds, self.counts = value, tuple(grid), tuple(bounds), tuple(counts)


# ----------------------------------------------------------------------------------- exact phase
def _exact_shared(model: Model, p: int, d: int, grid: tuple, best: _Best, ticks: list[int], budget: int) -> None:
    """Branch and bound over the shared bounds of one layout (complete: prunes only by valid bounds).

    Stages are fixed left to right. A node's lower bound prices every replica kind with the partial
    sums and maxima of its stage times plus the least the remaining layers can add (their compute over
    the fastest remaining device for the sum, over the remaining devices' total speed for the max),
    with the partial memory caps (caps only fall as stages are added), through :func:`split_value`,
    which is monotone in all three.
    """
    problem = model.problem
    allreduce = problem.allreduce_ms if d > 1 else 0.0
    kinds = list(Counter(grid).items())
    n_kinds = len(kinds)
    counts = [n for _, n in kinds]
    speeds = [[model.classes[c].speed for c in t] for t, _ in kinds]
    suffix_max = [[max(sp[j:]) for j in range(p)] for sp in speeds]
    suffix_sum = [[sum(sp[j:]) for j in range(p)] for sp in speeds]
    suffix_speeds = [[tuple(sp[j:]) for j in range(p)] for sp in speeds]
    pc, big_l, min_l, total_mb = model.pc, model.L, model.min_layers, model.M
    bounds = [0] * (p + 1)
    bounds[p] = big_l

    def lower(j: int, a: int, sums: list[float], maxes: list[float], caps: list[int]) -> float:
        rest = pc[big_l] - pc[a]
        p2p_rest = problem.p2p_ms * max(0, p - 1 - j)
        groups = [
            (
                sums[k] + rest / suffix_max[k][j] + p2p_rest,
                max(maxes[k], rest / suffix_sum[k][j], model.layer_bound(suffix_speeds[k][j], a)),
                caps[k],
                counts[k],
            )
            for k in range(n_kinds)
        ]
        return fluid_value(groups, total_mb) + allreduce

    def cutoff() -> float:
        if math.isinf(best.value):
            return math.inf
        return best.value - 1e-12 * max(1.0, abs(best.value))

    def visit(j: int, a: int, sums: list[float], maxes: list[float], caps: list[int]) -> None:
        ticks[0] += 1
        if ticks[0] > budget:
            raise _BudgetExceeded
        last = j == p - 1
        first_b = big_l if last else a + min_l
        last_b = big_l if last else big_l - (p - 1 - j) * min_l
        for b in range(first_b, last_b + 1):
            ticks[0] += 1
            new_sums, new_maxes, new_caps = [], [], []
            for k, (types, _) in enumerate(kinds):
                t = model.stage_time(a, b, types[j], last)
                new_sums.append(sums[k] + t)
                new_maxes.append(max(maxes[k], t))
                new_caps.append(min(caps[k], model.stage_cap(a, b, types[j], p - j)))
            if min(new_caps) < 1:
                break  # more layers only need more memory
            if last:
                groups = [(new_sums[k], new_maxes[k], new_caps[k], counts[k]) for k in range(n_kinds)]
                value = split_value(groups, total_mb) + allreduce
                if value < cutoff():
                    bounds[p] = b
                    result = split(groups, total_mb)
                    flat_grid, flat_counts = [], []
                    for (t, _), row in zip(kinds, result[1]):
                        flat_grid.extend([t] * len(row))
                        flat_counts.extend(row)
                    best.offer(value, flat_grid, [tuple(bounds)] * d, flat_counts)
            elif lower(j + 1, b, new_sums, new_maxes, new_caps) < cutoff():
                bounds[j + 1] = b
                visit(j + 1, b, new_sums, new_maxes, new_caps)

    zeros = [0.0] * n_kinds
    if lower(0, 0, zeros, zeros, [total_mb] * n_kinds) < cutoff():
        visit(0, 0, zeros, zeros, [total_mb] * n_kinds)


def _exact_per_replica(
    model: Model, p: int, d: int, grid: tuple, best: _Best, ticks: list[int], budget: int, cache: dict
) -> None:
    allreduce = model.problem.allreduce_ms if d > 1 else 0.0
    m_top = model.M - d + 1
    funcs, argb = [], []
    for t in grid:
        if t not in cache:
            n_bounds = count_bounds(model.L, p, model.min_layers)
            ticks[0] += n_bounds
            if ticks[0] > budget:
                raise _BudgetExceeded
            f = [math.inf] * (model.M + 2)
            fb: list[tuple[int, ...] | None] = [None] * (model.M + 2)
            for b in all_bounds(model.L, p, model.min_layers):
                s, x, cap = model.profile(t, b)
                for m in range(1, min(cap, model.M) + 1):
                    v = s + (m - 1) * x
                    if v < f[m]:
                        f[m], fb[m] = v, b
            cache[t] = (f, fb)
        f, fb = cache[t]
        funcs.append(f[: m_top + 1] + [math.inf] * (model.M + 2 - m_top - 1))
        argb.append(fb)
    result = split_functions(funcs, model.M)
    if result is None:
        return
    value, counts = result
    best.offer(value + allreduce, grid, [argb[r][counts[r]] for r in range(d)], counts)


def min_bottleneck(model: Model, cls: int, p: int, m: int) -> tuple[float, tuple[int, ...] | None]:
    """The least possible slowest-stage time of P stages on class ``cls`` with memory for m in flight.

    Exact dynamic programme over (stages, position), O(P L^2); ``(inf, None)`` when nothing fits.
    """
    big_l, min_l = model.L, model.min_layers
    inf = math.inf
    cost = [[inf] * (big_l + 1) for _ in range(p + 1)]
    came = [[0] * (big_l + 1) for _ in range(p + 1)]
    cost[0][0] = 0.0
    for j in range(p):
        last = j == p - 1
        lo_b = (j + 1) * min_l
        hi_b = big_l if last else big_l - (p - 1 - j) * min_l
        for b in range(lo_b, hi_b + 1):
            if last and b != big_l:
                continue
            best_v, best_a = inf, 0
            for a in range(b - min_l, j * min_l - 1, -1):
                prev = cost[j][a]
                if prev == inf:
                    continue
                if model.stage_cap(a, b, cls, p - j) < m:
                    break  # longer stages (smaller a) need more memory still
                v = max(prev, model.stage_time(a, b, cls, last))
                if v < best_v:
                    best_v, best_a = v, a
            cost[j + 1][b], came[j + 1][b] = best_v, best_a
    if cost[p][big_l] == inf:
        return inf, None
    bounds = [big_l]
    for j in range(p, 0, -1):
        bounds.append(came[j][bounds[-1]])
    return cost[p][big_l], tuple(reversed(bounds))


def _max_micro_batches_pure(model: Model, cls: int, p: int, limit: float, most: int, ticks: list[int], budget: int, cache: dict):
    """:func:`_max_micro_batches` for a replica of one class: S is fixed, so only the bottleneck matters."""
    total = model.pc[-1] / model.classes[cls].speed + (p - 1) * model.problem.p2p_ms
    for m in [p] + list(range(min(p - 1, most), 0, -1)):
        key = ("pure", cls, p, m)
        if key not in cache:
            ticks[0] += max(1, p * model.L * model.L // 20)
            if ticks[0] > budget:
                raise _BudgetExceeded
            cache[key] = min_bottleneck(model, cls, p, m)
        worst, bounds = cache[key]
        if bounds is None:
            continue
        if m == p:
            got = _count(limit, total, worst, most)
            if got >= p:
                return got, bounds
        elif _count(limit, total, worst, m) >= m:
            return m, bounds
    return 0, None


def _max_micro_batches(
    model: Model, types: tuple[int, ...], limit: float, most: int, ticks: list[int], budget: int, at_least: int = 1
):
    """The most micro-batches one replica of these classes can run within ``limit`` ms, and its bounds.

    Branch and bound over the bounds: ``m(b) = min(cap(b), floor((limit - S(b)) / X(b)) + 1)`` is
    maximised; a node's upper bound uses the partial memory cap and lower bounds on S and X (as in
    :func:`_exact_shared`). Only answers of at least ``at_least`` are sought: ``(at_least - 1, None)``
    means there is none. Stops early at ``most``.
    """
    p = len(types)
    speeds = [model.classes[c].speed for c in types]
    suffix_max = [max(speeds[j:]) for j in range(p)]
    suffix_sum = [sum(speeds[j:]) for j in range(p)]
    suffix_speeds = [tuple(speeds[j:]) for j in range(p)]
    pc, big_l, min_l, p2p = model.pc, model.L, model.min_layers, model.problem.p2p_ms
    found = [at_least - 1, None]
    bounds = [0] * (p + 1)

    def visit(j: int, a: int, total: float, worst: float, cap: int) -> None:
        last = j == p - 1
        first_b = big_l if last else a + min_l
        last_b = big_l if last else big_l - (p - 1 - j) * min_l
        for b in range(first_b, last_b + 1):
            ticks[0] += 1
            if ticks[0] > budget:
                raise _BudgetExceeded
            t = model.stage_time(a, b, types[j], last)
            new_cap = min(cap, model.stage_cap(a, b, types[j], p - j))
            if new_cap < 1:
                break  # more layers only need more memory
            new_total, new_worst = total + t, max(worst, t)
            if last:
                m = _count(limit, new_total, new_worst, min(new_cap, most))
                if m > found[0]:
                    bounds[p] = b
                    found[0], found[1] = m, tuple(bounds)
                continue
            rest = pc[big_l] - pc[b]
            total_lb = new_total + rest / suffix_max[j + 1] + p2p * (p - 2 - j)
            worst_lb = max(new_worst, rest / suffix_sum[j + 1], model.layer_bound(suffix_speeds[j + 1], b))
            if _count(limit, total_lb, worst_lb, min(new_cap, most)) > found[0]:
                bounds[j + 1] = b
                visit(j + 1, b, new_total, new_worst, new_cap)
                if found[0] >= most:
                    return

    visit(0, 0, 0.0, 0.0, most)
    return found[0], found[1]


def _exact_per_replica_bnb(
    model: Model, p: int, d: int, grid: tuple, best: _Best, ticks: list[int], budget: int, cache: dict
) -> None:
    """Per-replica partitions with an incumbent: asks "can every replica finish below it?" per kind.

    With ``limit`` just below the incumbent (minus the all-reduce), each replica kind's most
    micro-batches within ``limit`` come from :func:`_max_micro_batches`; when they sum to M the
    kinds' bounds give a strictly better plan (its exact split is taken) and the question is asked
    again, else this layout cannot beat the incumbent. Each round lowers the incumbent, so it ends.
    """
    allreduce = model.problem.allreduce_ms if d > 1 else 0.0
    kinds = list(Counter(grid).items())
    most = model.M - d + 1
    while True:
        cutoff = best.value - 1e-12 * max(1.0, abs(best.value))
        limit = cutoff - allreduce
        if limit <= 0:
            return
        # Upper bounds per kind (from the whole-replica lower bounds on S and X) say how many
        # micro-batches each kind must at least reach for the others to make up M.
        upper = {}
        for types, _ in kinds:
            speeds = tuple(model.classes[c].speed for c in types)
            compute = model.pc[-1]
            total_lb = compute / max(speeds) + (p - 1) * model.problem.p2p_ms
            worst_lb = max(compute / sum(speeds), model.layer_bound(speeds, 0))
            upper[types] = _count(limit, total_lb, worst_lb, most)
        found = []
        for types, n in kinds:
            others = sum(n_o * upper[t_o] for t_o, n_o in kinds if t_o != types)
            at_least = max(1, -(-(model.M - others) // n))
            if at_least > upper[types]:
                return
            key = (types, limit)
            known = cache.get(key)
            if known is None or (known[1] is None and known[0] >= at_least):
                if len(set(types)) == 1:
                    known = _max_micro_batches_pure(model, types[0], p, limit, most, ticks, budget, cache)
                else:
                    known = _max_micro_batches(model, types, limit, most, ticks, budget, at_least)
                cache[key] = known
            m, bounds = known
            if bounds is None or m < at_least:
                return
            upper[types] = m
            found.append((types, n, m, bounds))
        if sum(n * m for _, n, m, _ in found) < model.M:
            return
        groups = [(*model.profile(types, bounds), n) for types, n, _, bounds in found]
        result = split(groups, model.M)
        if result is None or result[0] + allreduce >= cutoff:
            return  # rounding at the limit: nothing strictly better
        flat_grid, flat_bounds, flat_counts = [], [], []
        for (types, _, _, bounds), row in zip(found, result[1]):
            flat_grid.extend([types] * len(row))
            flat_bounds.extend([bounds] * len(row))
            flat_counts.extend(row)
        best.offer(result[0] + allreduce, flat_grid, flat_bounds, flat_counts)


def exact_search(model: Model, budget: int, best: _Best) -> None:
    """The complete search of the exact phase, into ``best``; raises ``_BudgetExceeded`` past ``budget``."""
    problem = model.problem
    ticks = [0]
    counts = [len(c.ids) for c in model.classes]
    shapes = sorted(problem.candidate_shapes(), key=lambda s: lower_bound(model, *s))
    incumbent = not math.isinf(best.value)
    if not problem.shared_partition and not incumbent:
        if sum(count_bounds(model.L, p, model.min_layers) for p, _ in shapes) > budget:
            raise _BudgetExceeded  # per-replica enumeration cannot finish: do not spend the time
    for p, d in shapes:
        if lower_bound(model, p, d) >= best.value:
            continue
        cache: dict = {}
        for used in used_vectors(counts, p * d, problem.allow_exclude):
            for grid in layouts(p, d, used):
                ticks[0] += 1
                if ticks[0] > budget:
                    raise _BudgetExceeded
                if problem.shared_partition:
                    _exact_shared(model, p, d, grid, best, ticks, budget)
                elif incumbent:
                    _exact_per_replica_bnb(model, p, d, grid, best, ticks, budget, cache)
                else:
                    _exact_per_replica(model, p, d, grid, best, ticks, budget, cache)


# ------------------------------------------------------------------------------- heuristic phase
def bottleneck_bounds(model: Model, types: Sequence[int], m: int) -> tuple[int, ...] | None:
    """Bounds that (nearly) minimise the slowest stage of a replica, memory for m micro-batches.

    Bisection on the stage-time cap with a greedy farthest-reach feasibility test.
    """
    p = len(types)
    def greedy(cap: float) -> tuple[int, ...] | None:
        bounds = [0]
        a = 0
        for j, cls in enumerate(types):
            last = j == p - 1
            latest = model.L - (p - 1 - j) * model.min_layers
            earliest = a + model.min_layers
            if earliest > latest:
                return None
            if last:
                b = model.L
            else:
                speed = model.classes[cls].speed
                budget_c = (cap - model.problem.p2p_ms) * speed
                b = bisect.bisect_right(model.pc, model.pc[a] + budget_c + 1e-12, earliest, latest + 1) - 1
                b = min(b, latest)
                while b > earliest and model.stage_cap(a, b, cls, p - j) < m:
                    b -= 1
                if b < earliest:
                    return None
            if model.stage_time(a, b, cls, last) > cap * (1 + 1e-12) + 1e-12:
                return None
            if model.stage_cap(a, b, cls, p - j) < m:
                return None
            bounds.append(b)
            a = b
        return tuple(bounds)

    hi = max(model.pc[-1] / model.classes[c].speed for c in types) + model.problem.p2p_ms
    found = greedy(hi)
    if found is None:
        return None
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        cand = greedy(mid)
        if cand is None:
            lo = mid
        else:
            hi, found = mid, cand
        if hi - lo <= 1e-9 * hi:
            break
    return found


class _Stages:
    """Stage times and memory caps of a few replica kinds under one bounds vector, updated in place."""

    def __init__(self, model: Model, kinds: Sequence[tuple[tuple[int, ...], int]], bounds: Sequence[int]) -> None:
        self.model = model
        self.kinds = list(kinds)
        self.p = len(bounds) - 1
        self.bounds = list(bounds)
        self.times = [[0.0] * self.p for _ in self.kinds]
        self.caps = [[0] * self.p for _ in self.kinds]
        for j in range(self.p):
            self._refresh(j)

    def _refresh(self, j: int) -> None:
        a, b, last = self.bounds[j], self.bounds[j + 1], j == self.p - 1
        for k, (types, _) in enumerate(self.kinds):
            self.times[k][j] = self.model.stage_time(a, b, types[j], last)
            self.caps[k][j] = self.model.stage_cap(a, b, types[j], self.p - j)

    def set(self, index: int, value: int) -> None:
        self.bounds[index] = value
        self._refresh(index - 1)
        self._refresh(index)

    def groups(self) -> list[tuple[float, float, int, int]]:
        return [(sum(t), max(t), min(c), n) for t, c, (_, n) in zip(self.times, self.caps, self.kinds)]


def _shared_objective(model: Model, allreduce: float):
    def value(groups):
        tie = sum(n * x for (_, x, _, n) in groups)  # breaks plateaus of the max: smaller bottlenecks
        return (split_value(groups, model.M) + allreduce, tie)

    return value


def _replica_objective(m: int):
    def value(groups):
        s, x, cap, _ = groups[0]
        return (s + (m - 1) * x if cap >= m else math.inf, x)

    return value


def _local_search(state: _Stages, objective, min_layers: int) -> tuple[tuple[int, ...], tuple]:
    """Moves one boundary, or two neighbouring ones together, while the objective improves."""
    p = state.p
    best_v = objective(state.groups())
    steps = [s for s in (8, 4, 2, 1) if s <= max(1, state.bounds[-1] // max(1, p))] or [1]
    improved = True
    while improved:
        improved = False
        for step in steps:
            for i in range(1, p):
                for width in (1, 2):
                    if i + width - 1 >= p:
                        continue
                    for delta in (step, -step):
                        lo = state.bounds[i - 1]
                        hi = state.bounds[i + width]
                        first, last = state.bounds[i] + delta, state.bounds[i + width - 1] + delta
                        if first - lo < min_layers or hi - last < min_layers:
                            continue
                        old = state.bounds[i : i + width]
                        for k in range(width):
                            state.set(i + k, old[k] + delta)
                        v = objective(state.groups())
                        if v < best_v:
                            best_v, improved = v, True
                        else:
                            for k in reversed(range(width)):
                                state.set(i + k, old[k])
    return tuple(state.bounds), best_v


def _candidate_grids(model: Model, p: int, d: int, used: Sequence[int]) -> list[tuple[tuple[int, ...], ...]]:
    """A few placements of the used devices: slower devices spread one per replica or packed."""
    pool: list[int] = []
    for k, n in enumerate(used):
        pool.extend([k] * n)  # fastest classes first
    major = max(range(len(used)), key=lambda k: used[k])
    odd = sorted((k for k in pool if k != major), reverse=True)  # slowest first
    grids = []
    n_odd = len(odd)
    for mode in ("spread_last", "spread_first", "pack_last", "pack_first"):
        cells = [[major] * p for _ in range(d)]
        positions = []
        if mode.startswith("spread"):
            stage_order = list(range(p - 1, -1, -1)) if mode.endswith("last") else list(range(p))
            positions = [(i % d, stage_order[(i // d) % p]) for i in range(n_odd)]
        else:
            stage_order = list(range(p - 1, -1, -1)) if mode.endswith("last") else list(range(p))
            positions = [(d - 1 - i // p, stage_order[i % p]) for i in range(n_odd)]
        for k, (r, j) in zip(odd, positions):
            cells[r][j] = k
        grid = tuple(sorted((tuple(c) for c in cells), reverse=True))
        if grid not in grids:
            grids.append(grid)
    return grids


def _offer_shared(model: Model, best: _Best, kinds, bounds, d: int, allreduce: float) -> None:
    groups = _Stages(model, kinds, bounds).groups()
    result = split(groups, model.M)
    if result is None:
        return
    flat_grid, flat_counts = [], []
    for (t, _), row in zip(kinds, result[1]):
        flat_grid.extend([t] * len(row))
        flat_counts.extend(row)
    best.offer(result[0] + allreduce, flat_grid, [bounds] * d, flat_counts)


def _shared_candidates(model: Model, p: int, d: int, grid: tuple) -> list[tuple[tuple, tuple, list, tuple]]:
    """(quick value, bounds, kinds, shape) for each start of a shared-partition layout."""
    allreduce = model.problem.allreduce_ms if d > 1 else 0.0
    kinds = list(Counter(grid).items())
    per_replica_m = max(1, model.M // d)
    out = []
    seen = set()
    for t, _ in kinds:
        b = bottleneck_bounds(model, t, per_replica_m) or bottleneck_bounds(model, t, 1)
        if b is None or b in seen:
            continue
        seen.add(b)
        value = _shared_objective(model, allreduce)(_Stages(model, kinds, b).groups())
        out.append((value, b, kinds, (p, d)))
    return out


def _per_replica_layout(model: Model, p: int, d: int, grid: tuple, best: _Best, polish: bool) -> float:
    """Per-replica partitions: alternate bounds per (kind, m) and the split; returns the best value."""
    allreduce = model.problem.allreduce_ms if d > 1 else 0.0
    kinds = list(Counter(grid).items())
    cache: dict[tuple[tuple[int, ...], int], tuple[int, ...] | None] = {}

    def bounds_for(t: tuple[int, ...], m: int) -> tuple[int, ...] | None:
        key = (t, m)
        if key not in cache:
            b0 = bottleneck_bounds(model, t, m)
            if b0 is None or not polish:
                cache[key] = b0
            else:
                cache[key] = _local_search(_Stages(model, [(t, 1)], b0), _replica_objective(m), model.min_layers)[0]
        return cache[key]

    per_replica_m = max(1, model.M // d)
    ms = {t: per_replica_m for t, _ in kinds}
    found = math.inf
    for _ in range(3 if polish else 1):
        groups, chosen = [], []
        for t, n in kinds:
            b = bounds_for(t, ms[t]) or bounds_for(t, 1)
            if b is None:
                return found
            chosen.append(b)
            groups.append((*model.profile(t, b), n))
        result = split(groups, model.M)
        if result is None:
            return found
        flat, flat_b, flat_m = [], [], []
        for (t, _), b, row in zip(kinds, chosen, result[1]):
            for m in row:
                flat.append(t)
                flat_b.append(b)
                flat_m.append(m)
        found = min(found, result[0] + allreduce)
        best.offer(result[0] + allreduce, flat, flat_b, flat_m)
        if not polish:
            break
        # Re-optimise each replica's bounds for its own count, then split again.
        rows = [(t, bounds_for(t, m) or bounds_for(t, 1)) for t, m in zip(flat, flat_m)]
        groups2 = [(*model.profile(t, b), 1) for t, b in rows]
        result2 = split(groups2, model.M)
        if result2 is None:
            return found
        counts2 = [row[0] for row in result2[1]]
        found = min(found, result2[0] + allreduce)
        best.offer(result2[0] + allreduce, flat, [b for _, b in rows], counts2)
        ms = {}
        for t, m in zip(flat, counts2):
            ms[t] = max(ms.get(t, 0), m)
    return found


#: Layouts polished by local search after the quick pass over every shape and placement.
POLISH = 8


def heuristic_search(model: Model, best: _Best) -> None:
    """The heuristic phase (see module docstring); improves ``best`` in place."""
    problem = model.problem
    counts = [len(c.ids) for c in model.classes]
    n = sum(counts)
    shapes = problem.candidate_shapes()
    if problem.allow_exclude:
        # Only the shapes that use all devices or leave out whole slowest classes.
        sizes = {n - sum(counts[k:]) for k in range(1, len(counts))} | {n}
        keep = []
        for p in sorted({s[0] for s in shapes}):
            for size in sizes:
                d = min(size // p, model.M)
                if d >= 1 and (p, d) in shapes:
                    keep.append((p, d))
        shapes = sorted(set(keep))
    quick = []
    for p, d in sorted(shapes, key=lambda s: lower_bound(model, *s)):
        if lower_bound(model, p, d) >= best.value:
            continue
        left = p * d
        used = []
        for c in counts:
            take = min(c, left)
            used.append(take)
            left -= take
        for grid in _candidate_grids(model, p, d, used):
            if problem.shared_partition:
                found = _shared_candidates(model, p, d, grid)
                for value, bounds, kinds, _ in found:
                    if value[0] < best.value:
                        _offer_shared(model, best, kinds, bounds, d, problem.allreduce_ms if d > 1 else 0.0)
                quick.extend(found)
            else:
                quick.append(((_per_replica_layout(model, p, d, grid, best, polish=False), 0.0), grid, None, (p, d)))
    quick.sort(key=lambda item: item[0])
    for value, key, kinds, (p, d) in quick[:POLISH]:
        if math.isinf(value[0]):
            continue
        allreduce = problem.allreduce_ms if d > 1 else 0.0
        if problem.shared_partition:
            _offer_shared(model, best, kinds, key, d, allreduce)
            bounds, _ = _local_search(_Stages(model, kinds, key), _shared_objective(model, allreduce), model.min_layers)
            _offer_shared(model, best, kinds, bounds, d, allreduce)
        else:
            _per_replica_layout(model, p, d, key, best, polish=True)


# ----------------------------------------------------------------------------------------- entry
def infeasible_reason(problem: Problem) -> str:
    """One line saying why no plan exists (called when the search found none)."""
    shapes = problem.candidate_shapes()
    if not shapes:
        return (
            f"no pipeline degree fits: {problem.num_devices} devices, {problem.num_layers} layers, "
            f"{problem.micro_batches} micro-batches, min_layers_per_stage={problem.min_layers_per_stage}, "
            f"pipeline_degrees={list(problem.pipeline_degrees) if problem.pipeline_degrees else 'any'}"
            + ("" if problem.allow_exclude else ", allow_exclude=false")
        )
    biggest = max(problem.devices, key=lambda dv: dv.memory_mb)
    heaviest = max(problem.layers, key=lambda la: la.static_mb + la.activation_mb)
    total_static = sum(la.static_mb for la in problem.layers)
    return (
        "no layout fits in memory: every pipeline degree "
        f"{sorted({s[0] for s in shapes})} overflows some device (largest memory_mb "
        f"{biggest.memory_mb:g} on device {biggest.id}; the model's static_mb totals {total_static:g}, "
        f"the heaviest layer needs {heaviest.static_mb + heaviest.activation_mb:g} MB with one micro-batch)"
    )


def solve_exact(problem: Problem, *, budget: int = DEFAULT_BUDGET) -> Plan:
    """Plans ``problem`` with the exact combinatorial search (heuristic beyond ``budget``).

    Returns:
        The plan with ``iteration_ms`` (from :func:`evaluate`), ``status`` ``"optimal"`` when the
        complete search finished and ``"feasible"`` otherwise, ``solver="exact"`` and ``solve_seconds``.

    Raises:
        InfeasibleError: no plan satisfies the memory and shape constraints. Its attribute ``proven``
            is True when the exact phase finished (certain), False when only the heuristic phase ran
            (then :func:`resihp_lightning.solver.solve` still asks the MILP backends).
    """
    start = time.perf_counter()
    model = Model(problem)
    status = "optimal"
    best = _Best()
    heuristic_search(model, best)  # a good incumbent makes the exact phase prune early
    try:
        exact_search(model, budget, best)
    except (_BudgetExceeded, RecursionError):  # too many replicas to enumerate their layouts
        status = "feasible"
    if math.isinf(best.value):
        error = InfeasibleError(infeasible_reason(problem))
        error.proven = status == "optimal"  # False: only the heuristic phase ran and found nothing
        raise error
    plan = build_plan(model, best.grid, best.bounds, best.counts)
    value = evaluate(problem, plan).iteration_ms
    return plan.with_result(
        iteration_ms=value, status=status, solver="exact", solve_seconds=time.perf_counter() - start
    )
