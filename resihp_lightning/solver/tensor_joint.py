"""One replica knapsack over many TP groupings at once: a proof that none of them beats a cutoff.

The groupings of one healthy degree in :func:`~resihp_lightning.solver.tensor_search.solve_tensor`
share their healthy groups (the *free* kind, as many in each) and differ in a few *odd* devices,
the groups formed in the affected domains. Solving each grouping on its own repeats the same
per-replica questions for every grouping; this module asks them once for the whole set.

For a shape (P, D) and a limit (the cutoff, minus the all-reduce when D > 1), a plan on one
grouping with per-replica partitions is D replicas, each a *composition* of device kinds running
at most its exact count of micro-batches within the limit
(:func:`~resihp_lightning.solver.replica_search.max_micro_batches_mixed`, memory included), their
counts adding up to M. A replica holding odd devices is an *item*: its odd part o (a vector of odd
kinds, ``1 <= |o| <= P``) with ``P - |o|`` free devices; pure free replicas fill the rest. So a grouping
beats the limit at (P, D) exactly when some r <= D items, whose odd parts add up to a vector u
within the grouping's odd devices, and D - r pure replicas, using ``D P - |u|`` free devices at
most the grouping's, run M micro-batches. Over a *set* of groupings the only change is the last
test: u must fit into *some* grouping of the set, with its free devices. The states of the
knapsack are therefore the union of the groupings' downward-closed odd vectors (few: every
grouping holds a handful of odd devices), and one dynamic programme over (items taken, state)
answers for every grouping at once.

Values start as cheap upper bounds (``JointProof._cheap``: the least stage-time sum and
slowest stage that the layers' compute and the devices' memory allow, as the decomposition's
bounds do; ``JointProof._cheap_all`` for every item at once) and are made exact lazily, only
for the items of a mix that reaches M, until either no mix reaches M (the shape is closed for
every grouping of the set) or a mix of exact values does: a *witness*, the groupings whose devices
hold it each have a plan faster than the cutoff, and :attr:`Verdict.replicas` is that plan (each
count keeps its stage order and bounds). Exact counts are kept by
:class:`~resihp_lightning.solver.tensor_bounds.DominantKindBound` (per composition of kinds and
limit), so later questions at the same cutoff reuse them; a count that ran out of work is only its
ceiling, an upper bound that may close but never makes a witness (``"open"`` instead).

When pure free replicas run at least one micro-batch, the knapsack does not count its items
(``_Levels``): D replicas of which r are items run ``D v_free - sum (v_free - v_o)``, so a
state's best is its least total *loss*, computed in one pass per state size; a mix it finds with
more items than replicas is not a plan, and the programme over (items, state) decides that shape.

Before the knapsack, a *coarse count* closes most shapes: every odd device fits into E, the
largest speed, memory and link among the odd kinds, so a replica with k odd devices runs at most
v_k, the count of P - k free devices and k of E, and D replicas with at most as many odd and free
devices as any grouping holds run at most the best sum of such values.

Shapes are first pruned by :class:`~resihp_lightning.solver.tensor_search.GroupingBound` over the
union fleet (every device any grouping of the set may hold, at its largest count): with exclusion,
every grouping's plans are plans of the union fleet, so its bounds hold for all of them.

Exclusion is required (without it a grouping's devices must all be used, which the union fleet's
bounds do not see), and per-replica partitions: shared ones are a restriction of them, so the
proof would hold, but their optima lie above the per-replica ones the counts describe (256 GPUs,
2-4 slow GPUs: 3.5-4% above), so it would never close and every witness would need a solve.
Otherwise :meth:`JointProof.decide` answers ``"open"``. With healthy links the counts are exact
and a witness is a real plan. With slow links (the all-reduce priced at its least,
``allreduce_ms``, and transfers by the counts' own arrangement) the proof is a relaxation: a
``"closed"`` still holds, a witness may not (the caller prices its plan, and solves the grouping
when it is not better).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from resihp_lightning.plan import Problem
from resihp_lightning.solver.exact_model import Model
from resihp_lightning.solver.microbatch_split import count
from resihp_lightning.solver.tensor_bounds import dominates_kind

Kind = tuple[float, float, float]  # (speed, memory_mb, link_speed), as tensor_plan.device_key lists them

#: The most knapsack states (odd vectors) a set of groupings may have; past it the proof is not tried.
MAX_STATES = 20_000
#: The most (item, state) moves one table may hold; a pipeline degree past it leaves the proof open.
MAX_MOVES = 4_000_000
#: The largest state code table the knapsack's moves may use; past it the proof is not tried.
MAX_CODES = 50_000_000
#: How many of the coarse bound's v_k (fewest odd devices first) are made exact before the finer
#: knapsack takes over.
COARSE_EXACT = 1
#: Exact replica counts one :meth:`JointProof.decide` may compute (known ones are free); past them
#: it answers ``"open"``.
COUNTS_PER_DECISION = 400


@dataclass(frozen=True)
class Verdict:
    """What :meth:`JointProof.decide` found.

    Attributes:
        outcome: ``"closed"`` (no grouping of the set has a plan faster than the cutoff),
            ``"witness"`` (the groupings in ``fleets`` each have one) or ``"open"`` (undecided).
        fleets: with ``"witness"``, the indices of the groupings whose devices hold the mix found.
        shape: with ``"witness"``, its (P, D).
        replicas: with ``"witness"``, the mix found, when every count's plan is known: per
            composition, its stages' devices as (speed, memory_mb, link slowdown), its stage
            bounds and how many replicas take it (each runs at least one micro-batch, and all of
            them M, within the cutoff); empty when not known.
    """

    outcome: str
    fleets: tuple[int, ...] = ()
    shape: tuple[int, int] | None = None
    replicas: tuple[tuple[tuple[tuple[float, float, float], ...], tuple[int, ...], int], ...] = ()


class _Undecided(Exception):
    """Past a size or count limit."""


class JointProof:
    """Decides for a set of groupings at once whether any beats a cutoff (module docstring).

    Args:
        problem: the problem over groups (its devices are ignored: each question brings its own).
        bounder: a :class:`~resihp_lightning.solver.tensor_search.GroupingBound` of that problem.
        counter: a :class:`~resihp_lightning.solver.tensor_bounds.DominantKindBound` of that
            problem: its exact replica counts, shared with other questions.
    """

    def __init__(self, problem: Problem, bounder, counter) -> None:
        self.problem = problem
        self.bounder = bounder
        self.counter = counter
        self.compute = bounder.compute
        self._model = Model(problem)
        self._cheap_memo: dict[tuple, int] = {}
        self._unproven: set[tuple] = set()  # exact counts that ran out of work: upper bounds only
        self._moves: dict[tuple, tuple] = {}
        self._closures: dict[tuple, tuple] = {}
        self.counted = 0  #: exact counts asked for by the last decision

    # ------------------------------------------------------------------------------- entry
    @staticmethod
    def applies(problem: Problem) -> bool:
        """Whether the proof is asked for this problem (module docstring): exclusion, and replicas
        partitioned each their own way."""
        return problem.allow_exclude and not problem.shared_partition

    def decide(self, fleets: Sequence[Sequence[Kind]], cutoff: float) -> Verdict:
        """Whether any of these groupings (each the multiset of its group devices) has a plan faster than ``cutoff``."""
        if not fleets or not self.applies(self.problem):
            return Verdict("open")
        try:
            return self._decide(fleets, cutoff)
        except _Undecided:
            return Verdict("open")

    # ------------------------------------------------------------------------------ states
    def _decide(self, fleets: Sequence[Sequence[Kind]], cutoff: float) -> Verdict:
        problem = self.problem
        counters = [Counter(fleet) for fleet in fleets]
        kinds = sorted({kind for c in counters for kind in c}, reverse=True)
        free = max(kinds, key=lambda k: (min(c.get(k, 0) for c in counters), k))
        odd = [k for k in kinds if k != free]
        avails = [tuple(c.get(k, 0) for k in odd) for c in counters]
        frees = [c.get(free, 0) for c in counters]
        key = (tuple(avails), tuple(frees))
        if key not in self._closures:
            if len(self._closures) > 8:
                self._closures.clear()
            self._closures[key] = _closure(avails, frees)
        states, most_free = self._closures[key]
        vectors = np.asarray(states, dtype=np.int64).reshape(len(states), len(odd))
        sizes = vectors.sum(axis=1)
        union = [free] * max(frees) + [k for j, k in enumerate(odd) for _ in range(max(a[j] for a in avails))]
        n_union = len(union)
        self.counted = 0
        tolerance = 1e-12 * max(1.0, abs(cutoff))
        m = problem.micro_batches
        # Shapes the union fleet's bounds leave open, by P. With healthy links the bound falls as D
        # grows (D = 1, without an all-reduce, is priced on its own), so a P whose largest D is
        # closed is closed for every D > 1.
        single: set[int] = set()
        many: set[int] = set()
        for p, d, value in self.bounder.shape_bounds(union, replicas=True):
            if value < cutoff - tolerance:
                (single if d == 1 else many).add(p)
        for p in sorted(single | many):
            if p in single:  # D = 1: one replica runs all M
                found = self._single(p, states, vectors, sizes, most_free, odd, free, cutoff - tolerance)
                if found is not None:
                    free_used = p - int(sizes[found])
                    mix = self._mix({self._key(p, states[found], odd, free): 1}, cutoff - tolerance)
                    return Verdict("witness", _holders(states[found], avails, frees, free_used), (p, 1), mix)
            d_low, d_high = max(2, problem.min_data_degree), min(n_union // p, m)
            limit = cutoff - tolerance - problem.allreduce_ms
            if p in many and d_high >= d_low and limit > 0:
                shapes, by_size = self._coarse(p, range(d_low, d_high + 1), int(sizes.max()), int(most_free.max()),
                                               odd, free, limit)
                if not shapes:
                    continue
                found = self._many(p, shapes, by_size, states, vectors, sizes, most_free, odd, free, limit)
                if found is not None:
                    state, d, chosen = found
                    free_used = d * p - int(sizes[state])
                    wanted = Counter(self._key(p, states[i], odd, free) for i in chosen)
                    if d > len(chosen):
                        wanted[self._key(p, (0,) * len(odd), odd, free)] += d - len(chosen)
                    mix = self._mix(wanted, limit)
                    return Verdict("witness", _holders(states[state], avails, frees, free_used), (p, d), mix)
        return Verdict("closed")

    # ------------------------------------------------------------------------------ values
    def _exact(self, composition: Sequence[Kind], limit: float, ceiling: int | None = None) -> int:
        """The exact count of one replica of these devices (at most ``ceiling``, an upper bound
        known already: the default is the cheap bound)."""
        if ceiling is None:
            ceiling = self._cheap(composition, limit)
        if ceiling <= 0:
            return 0
        if self.counted >= COUNTS_PER_DECISION:
            raise _Undecided
        before = self.counter.counted
        value, proven = self.counter.count(composition, limit, ceiling)
        self.counted += self.counter.counted - before
        if not proven:
            self._unproven.add((tuple(sorted(composition, reverse=True)), limit))
        return value

    def _key(self, p: int, u: tuple[int, ...], odd: list[Kind], free: Kind) -> tuple[Kind, ...]:
        return tuple(sorted(self._composition(p, u, odd, free), reverse=True))

    def _mix(self, wanted: Counter, limit: float) -> tuple:
        """:attr:`Verdict.replicas` for these compositions (empty when a count's plan is not known)."""
        out = []
        for composition, n in wanted.items():
            found = self.counter.witness(composition, limit)
            if found is None:
                return ()
            out.append((found[0], found[1], n))
        return tuple(out)

    def _proven(self, composition: Sequence[Kind], limit: float) -> bool:
        return (tuple(sorted(composition, reverse=True)), limit) not in self._unproven

    def _cheap(self, composition: Sequence[Kind], limit: float) -> int:
        """An upper bound on the micro-batches one replica of these devices runs within ``limit``.

        For a candidate m the slowest stage is at most ``x = (limit - S) / (m - 1)``, so stage j
        holds at most the longest run of layers within ``x s_j`` that fits its memory; filling the
        fastest first gives the least S that allows (iterated, as S rises x falls). A candidate
        that fails proves the count below it; the most that passes is found by bisection.
        """
        key = (tuple(sorted(composition, reverse=True)), limit)
        found = self._cheap_memo.get(key)
        if found is not None:
            return found
        bounder, p2p = self.bounder, self.problem.p2p_ms
        p = len(composition)
        # Runs of one kind, fastest first: (speed, compute its memory holds, devices).
        runs: list[tuple[float, float, int]] = []
        for kind, n in sorted(Counter(composition).items(), key=lambda item: -item[0][0]):
            runs.append((kind[0], bounder.held(kind[1]), n))
        speed_sum = sum(s * n for s, _, n in runs)
        total = self.compute
        transfers = (p - 1) * p2p
        longest = self._model.longest_run

        def least_sum(x: float | None) -> float:
            left, out = total, transfers
            for s, h, n in runs:
                run = h if x is None else min(h, longest(x * s))
                if run <= 0:
                    continue
                take = min(left, n * run)
                out += take / s
                left -= take
                if left <= 1e-12 * max(1.0, total):
                    return out
            return math.inf

        base = least_sum(None)
        # Every stage within X: c_j <= (X - p2p_j) s_j, and only the last stage sends nothing.
        worst = (total + p2p * (speed_sum - runs[0][0])) / speed_sum
        if not math.isfinite(base):
            self._cheap_memo[key] = 0
            return 0

        def passes(m: int) -> bool:
            s = base
            for _ in range(3):
                if m <= 1:
                    break
                cap = (limit - s) / (m - 1)
                if cap <= 0:
                    return False
                least = least_sum(cap * (1 + 1e-9))
                if least <= s:
                    break
                s = least
            return count(limit, s, worst, m) >= m

        hi = count(limit, base, worst, self.problem.micro_batches)
        lo = 0
        if hi < 1:
            pass
        elif passes(hi):
            lo = hi
        else:
            hi -= 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if passes(mid):
                    lo = mid
                else:
                    hi = mid - 1
        self._cheap_memo[key] = lo
        return lo

    def _cheap_all(self, p: int, odd_parts: np.ndarray, odd: list[Kind], free: Kind, limit: float,
                   ceiling: np.ndarray | None = None) -> np.ndarray:
        """:meth:`_cheap` for many replicas at once: P - |o| free devices and the odd part o (rows).

        The same bound, vectorised (a slightly more generous rounding at the limit, so still an
        upper bound): the runs are the kinds, fastest first, with the row's count of each. With
        ``ceiling`` (upper bounds known already) the search starts there: the result is then at
        most the ceiling, and still an upper bound.
        """
        n_items = odd_parts.shape[0]
        if n_items == 0:
            return np.zeros(0, dtype=np.int64)
        kinds = [free] + list(odd)
        counts = np.concatenate([(p - odd_parts.sum(axis=1))[:, None], odd_parts], axis=1).astype(float)
        order = sorted(range(len(kinds)), key=lambda j: -kinds[j][0])
        speeds = np.asarray([kinds[j][0] for j in order])
        held = np.asarray([self.bounder.held(kinds[j][1]) for j in order])
        counts = counts[:, order]
        total, p2p, m_top = self.compute, self.problem.p2p_ms, self.problem.micro_batches
        spans = self._spans()
        tol = 1e-12 * max(1.0, total)

        def least_sum(rows: np.ndarray, x: np.ndarray | None) -> np.ndarray:
            """The least S of these rows when each stage holds at most x ms at its speed (None: memory only)."""
            left = np.full(rows.size, total)
            out = np.full(rows.size, (p - 1) * p2p)
            n = counts[rows]
            for j in range(len(order)):
                has = n[:, j] > 0
                if not has.any():
                    continue
                if x is None:
                    run = np.full(rows.size, held[j])
                else:
                    budget = x[has] * speeds[j]
                    index = np.searchsorted(spans, budget * (1 + 1e-9) + 1e-12 * np.maximum(1.0, budget), side="right") - 1
                    run = np.zeros(rows.size)
                    run[has] = np.minimum(held[j], np.where(index >= 0, spans[np.maximum(index, 0)], 0.0))
                take = np.minimum(left, n[:, j] * np.maximum(run, 0.0))
                out += take / speeds[j]
                left -= take
            return np.where(left <= tol, out, np.inf)

        speed_sum = counts @ speeds
        fastest = np.max(np.where(counts > 0, speeds[None, :], 0.0), axis=1)
        worst = (total + p2p * (speed_sum - fastest)) / speed_sum
        every = np.arange(n_items)
        base = least_sum(every, None)
        slack = limit * (1 + 1e-12) + 1e-12
        huge = spans[-1] / speeds.min() + 1.0

        def reach(rows: np.ndarray, s: np.ndarray, cap: np.ndarray) -> np.ndarray:
            with np.errstate(invalid="ignore", divide="ignore"):
                q = np.floor((slack - s) / worst[rows]) + 1
            return np.where(s <= slack, np.minimum(cap, np.maximum(q, 0)), 0).astype(np.int64)

        def passes(rows: np.ndarray, m: np.ndarray) -> np.ndarray:
            s = base[rows].copy()
            for _ in range(3):
                with np.errstate(invalid="ignore", divide="ignore"):
                    x = np.where(m > 1, (slack - s) / np.maximum(m - 1, 1) * (1 + 1e-9), np.inf)
                s = np.maximum(s, least_sum(rows, np.where(np.isfinite(x), np.maximum(x, 0.0), huge)))
            return reach(rows, s, m) >= m

        hi = reach(every, base, np.full(n_items, m_top))
        if ceiling is not None:
            hi = np.minimum(hi, ceiling)
        lo = np.zeros(n_items, dtype=np.int64)
        top_ok = passes(every, np.maximum(hi, 1)) & (hi >= 1)
        lo = np.where(top_ok, hi, lo)
        hi = np.where(top_ok, hi, hi - 1)
        while True:
            rows = np.flatnonzero(lo < hi)
            if rows.size == 0:
                break
            mid = (lo[rows] + hi[rows] + 1) // 2
            ok = passes(rows, mid)
            lo[rows[ok]] = mid[ok]
            hi[rows[~ok]] = mid[~ok] - 1
        return lo

    def _spans(self) -> np.ndarray:
        """Every run of contiguous layers' compute, sorted (:meth:`Model.longest_run
        <resihp_lightning.solver.exact_model.Model.longest_run>`'s table)."""
        if not hasattr(self, "_span_table"):
            self._model.longest_run(0.0)
            self._span_table = np.asarray(self._model._spans if self._model._spans is not None else
                                          sorted({0.0}), dtype=float)
        return self._span_table

    # ---------------------------------------------------------------------------- one replica
    def _composition(self, p: int, u: tuple[int, ...], odd: list[Kind], free: Kind) -> list[Kind]:
        return [free] * (p - sum(u)) + [k for j, k in enumerate(odd) for _ in range(u[j])]

    def _single(self, p: int, states, vectors, sizes, most_free, odd, free, limit: float) -> int | None:
        """D = 1: a state (the odd part of one replica) whose exact count reaches M, or None."""
        m = self.problem.micro_batches
        items = np.flatnonzero((sizes <= p) & (most_free >= p - sizes))
        cheap = self._cheap_all(p, vectors[items], odd, free, limit)
        for i, value in zip(items.tolist(), cheap.tolist()):
            if value < m:
                continue
            composition = self._composition(p, states[i], odd, free)
            if self._exact(composition, limit, value) >= m:
                if not self._proven(composition, limit):
                    raise _Undecided  # a witness only the ceiling of an unfinished count gives
                return i
        return None

    # ------------------------------------------------------------------------- many replicas
    def _coarse(self, p: int, shapes: Sequence[int], n_odd: int, n_free: int, odd: list[Kind], free: Kind,
                limit: float) -> tuple[list[int], list[int] | None]:
        """The D of ``shapes`` that a coarse count leaves open, and v_k by k: an upper bound on the
        count of any replica with k odd devices (``None`` when there are no odd devices).

        Every odd device fits into E, the largest speed, memory and link among the odd kinds, so a
        replica with k odd devices runs at most ``v_k``, the exact count of P - k free devices and
        k of E, a pure one at most ``v_0`` (when E also fits into a free device, v_k does not grow
        with k, so an exact v_j caps every later one). Some
        grouping holds at most ``n_odd`` odd devices and (maybe another) at most ``n_free`` free
        ones, so D replicas, m of them mixed with K odd devices in all (m <= K <= n_odd, and
        ``D P - K <= n_free``), run at most ``(D - m) v_0 + `` the best of m values adding up to K.
        """
        if not odd:
            return list(shapes), None
        envelope = (max(k[0] for k in odd), max(k[1] for k in odd), max(k[2] for k in odd))
        monotone = dominates_kind(free, envelope)
        # Cheap upper bounds first, made exact one k at a time (fewest odd devices first: those
        # replicas run the most) while some D is open, for shallow pipelines only: deeper ones
        # need many odd devices per replica, so nearly every v_k, and the finer knapsack of
        # :meth:`_many` closes them on cheap values. An exact v_j also caps every later v_k.
        top = min(p, n_odd)
        compositions = [[free] * (p - k) + [envelope] * k for k in range(0, top + 1)]
        values = self._cheap_all(p, np.arange(top + 1, dtype=np.int64)[:, None], [envelope], free, limit).tolist()
        exact_up_to = COARSE_EXACT if monotone else 0
        for j, composition in enumerate(compositions):
            shapes = self._coarse_reach(p, shapes, n_odd, n_free, values)
            if not shapes or j >= exact_up_to:
                break
            values[j] = self._exact(composition, limit, values[j])
            if monotone:
                values[j + 1:] = [min(v, values[j]) for v in values[j + 1:]]
        else:
            shapes = self._coarse_reach(p, shapes, n_odd, n_free, values)
        return shapes, values

    def _coarse_reach(self, p: int, shapes: Sequence[int], n_odd: int, n_free: int, values: list[int]) -> list[int]:
        """The D of ``shapes`` whose coarse count (:meth:`_coarse`, ``values[k]`` = v_k) reaches M."""
        m_total = self.problem.micro_batches
        pure = values[0]
        top_k = len(values) - 1
        # best[m][K]: the most m mixed replicas with K odd devices in all run (-1: none).
        best = [[-1] * (n_odd + 1) for _ in range(min(max(shapes), n_odd) + 1)]
        best[0][0] = 0
        for m in range(1, len(best)):
            for total in range(m, n_odd + 1):
                best[m][total] = max((best[m - 1][total - k] + values[k] for k in range(1, min(top_k, total) + 1)
                                      if best[m - 1][total - k] >= 0 and values[k] >= 1), default=-1)
        open_shapes = []
        for d in shapes:
            reach = -1
            for m in range(0, min(d, len(best) - 1) + 1):
                if d - m > 0 and pure < 1:
                    continue
                for total in range(max(m, d * p - n_free), min(n_odd, m * p) + 1):
                    if best[m][total] >= 0:
                        reach = max(reach, (d - m) * pure + best[m][total])
            if reach >= m_total:
                open_shapes.append(d)
        return open_shapes

    def _many(self, p: int, shapes: Sequence[int], by_size: list[int] | None, states, vectors, sizes, most_free,
              odd, free, limit: float) -> tuple[int, int, list[int]] | None:
        """D among ``shapes``: a (state, D, items) whose mix of exact counts reaches M, or None (closed).

        An item's value starts as the coarse v_k of its size (when known), then, when a mix
        reaches M, becomes at most its cheap bound (every item at once), then its exact count when
        a mix reaching M takes it.
        """
        m = self.problem.micro_batches
        d_high = max(shapes)
        free_value = self._exact([free] * p, limit)
        fits = (sizes >= 1) & (sizes <= p) & (most_free >= p - sizes)
        if by_size is not None:
            coarse = np.asarray(by_size + [0] * (p + 1 - len(by_size)), dtype=np.int64)
            fits &= coarse[np.minimum(sizes, p)] >= 1
        items = np.nonzero(fits)[0]
        # values[i]: what one replica whose odd part is state i runs (0: not an item at this P).
        values = np.zeros(len(states), dtype=np.int64)
        cheap = by_size is None
        if cheap:
            values[items] = self._cheap_all(p, vectors[items], odd, free, limit)
        else:  # the coarse v_k by size first: the knapsack alone often closes with them
            values[items] = coarse[sizes[items]]
        exact = np.zeros(len(states), dtype=bool)
        src, owner, dst = self._all_moves(states, vectors, sizes)
        keep = values[owner] >= 1
        src, owner, dst = src[keep], owner[keep], dst[keep]
        starts = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]]) if dst.size else np.zeros(0, dtype=np.int64)
        targets = dst[starts]
        rmax = min(d_high, int(sizes.max()))
        levels = _Levels(sizes, src, owner, dst) if free_value >= 1 else None
        while True:
            if levels is not None:
                # Pure replicas can fill in: one pass over the states by size (module docstring).
                found = levels.best_mix(values, free_value, shapes, p, most_free, m)
                if found is not None and len(found[2]) > found[1]:
                    levels = None  # more items than replicas: the layered programme decides
                    continue
                if found is None:
                    return None
                s, d, chosen = found
            else:
                best = _table(len(states), rmax, src, owner, starts, targets, values)
                top = None
                for d in shapes:
                    valid = d * p - sizes <= most_free
                    for r in range(0, min(d, rmax) + 1):
                        rest = d - r
                        if rest > 0 and free_value < 1:
                            continue
                        row = np.where(valid, best[r], -1)
                        s = int(np.argmax(row))
                        if row[s] < 0:
                            continue
                        total = int(row[s]) + rest * free_value
                        if total >= m and (top is None or total > top[0]):
                            top = (total, r, s, d)
                if top is None:
                    return None
                _, r, s, d = top
                chosen = None
            if not cheap:
                values[items] = self._cheap_all(p, vectors[items], odd, free, limit, values[items])
                cheap = True
                continue
            if chosen is None:
                chosen = _backtrack(best, r, s, src, owner, starts, targets, values)
            pending = [i for i in chosen if not exact[i]]
            if not pending:
                compositions = [self._composition(p, states[i], odd, free) for i in chosen] + [[free] * p]
                if not all(self._proven(c, limit) for c in compositions):
                    raise _Undecided  # a witness only the ceiling of an unfinished count gives
                return s, d, chosen
            for i in pending:
                values[i] = self._exact(self._composition(p, states[i], odd, free), limit, int(values[i]))
                exact[i] = True

    def _all_moves(self, states, vectors: np.ndarray, sizes: np.ndarray):
        """Every move (source state u, item o, destination u + o), both u and o states and o not
        zero, ordered by the destination's size, then the destination: ``(src, owner, dst)``,
        ``owner`` the item's state index.

        The states are closed downwards, so the moves into w are its nonzero sub-vectors o (and
        u = w - o); they are generated for every w at once, one kind at a time.
        """
        key = tuple(states)  # compared whole on a hash match: never another set's moves
        if key in self._moves:
            return self._moves[key]
        n_states, n_odd = vectors.shape
        empty = np.zeros(0, dtype=np.int64)
        if n_odd == 0:
            return empty, empty, empty
        caps = vectors.max(axis=0)
        radix = np.ones(n_odd, dtype=np.int64)
        for j in range(1, n_odd):
            radix[j] = radix[j - 1] * (caps[j - 1] + 1)
        span = int(radix[-1] * (caps[-1] + 1))
        if span > MAX_CODES:
            raise _Undecided
        codes = vectors @ radix
        position = np.full(span, -1, dtype=np.int64)
        position[codes] = np.arange(n_states)
        # Every (destination w, item o <= w): o grows one kind at a time, t = 0..w_j of kind j
        # (w stays in state order).
        dst = np.arange(n_states)
        item = np.zeros(n_states, dtype=np.int64)
        for j in range(n_odd):
            reps = vectors[dst, j] + 1
            first = np.cumsum(reps) - reps
            dst = np.repeat(dst, reps)
            item = np.repeat(item, reps) + (np.arange(dst.size) - np.repeat(first, reps)) * radix[j]
            if dst.size > MAX_MOVES + n_states:
                raise _Undecided
        real = item != 0
        dst, item = dst[real], item[real]
        owner = position[item]  # o <= w and the states are closed downwards: o and w - o are states
        src = position[codes[dst] - item]
        order = np.argsort(sizes[dst], kind="stable")  # by the destination's size, then the destination
        src, owner, dst = src[order], owner[order], dst[order]
        if len(self._moves) > 8:
            self._moves.clear()
        self._moves[key] = (src, owner, dst)
        return self._moves[key]


def _closure(avails: Sequence[tuple[int, ...]], frees: Sequence[int]) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """Every odd vector within some grouping's odd devices, and per vector the most free devices of
    a grouping that holds it."""
    most: dict[tuple[int, ...], int] = {}
    for avail, free in zip(avails, frees):
        frontier = [avail]
        if most.get(avail, -1) >= free:
            continue
        most[avail] = free
        while frontier:
            nxt = []
            for u in frontier:
                for j, n in enumerate(u):
                    if n:
                        v = u[:j] + (n - 1,) + u[j + 1:]
                        if most.get(v, -1) < free:
                            most[v] = free
                            nxt.append(v)
            frontier = nxt
            if len(most) > MAX_STATES:
                raise _Undecided
    states = sorted(most)
    return states, np.asarray([most[u] for u in states], dtype=np.int64)


def _holders(u: tuple[int, ...], avails, frees, free_used: int) -> tuple[int, ...]:
    """The groupings whose odd devices hold ``u`` and whose free devices number at least ``free_used``."""
    return tuple(g for g, (avail, free) in enumerate(zip(avails, frees))
                 if free >= free_used and all(a >= x for a, x in zip(avail, u)))


class _Levels:
    """The knapsack without counting its items, when pure free replicas can fill in (v_free >= 1).

    D replicas, r of them items, run ``D v_free - sum_i (v_free - v_i)``: the most for a state is
    the least *loss* of items adding up to it, and the number of items drops out. Every item adds
    at least one odd device, so the least losses follow the states in order of size, one
    vectorised pass per size over the moves into it. A mix with more items than D replicas is not
    a plan, so this is a relaxation: a state it cannot raise to M is closed, and a mix it finds
    with r <= D is a real one (the caller falls back to the layered programme otherwise).
    """

    def __init__(self, sizes: np.ndarray, src: np.ndarray, owner: np.ndarray, dst: np.ndarray) -> None:
        self.sizes = sizes
        self.src, self.owner, self.dst = src, owner, dst  # ordered by the destination's size, then it
        self.size_of = sizes[self.dst]
        self.bounds = np.searchsorted(self.size_of, np.arange(int(sizes.max()) + 2))

    def best_mix(self, values: np.ndarray, free_value: int, shapes: Sequence[int], p: int, most_free: np.ndarray,
                 m: int) -> tuple[int, int, list[int]] | None:
        """(state, D, items) of the best mix reaching M, or None when none does (a proof)."""
        big = np.iinfo(np.int64).max // 4
        loss = np.where(values >= 1, free_value - values, big)
        least = np.full(self.sizes.size, big, dtype=np.int64)
        least[0] = 0
        for size in range(1, len(self.bounds) - 1):
            lo, hi = int(self.bounds[size]), int(self.bounds[size + 1])
            if lo == hi:
                continue
            cand = np.minimum(least[self.src[lo:hi]] + loss[self.owner[lo:hi]], big)
            dst = self.dst[lo:hi]
            heads = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]])
            least[dst[heads]] = np.minimum.reduceat(cand, heads)
        top = None
        for d in shapes:
            valid = (d * p - self.sizes <= most_free) & (least < big)
            if not valid.any():
                continue
            totals = np.where(valid, d * free_value - least, -1)
            s = int(np.argmax(totals))
            if totals[s] >= m and (top is None or totals[s] > top[0]):
                top = (int(totals[s]), s, d)
        if top is None:
            return None
        _, s, d = top
        chosen = []
        at = s
        while at != 0:
            lo, hi = int(self.bounds[self.sizes[at]]), int(self.bounds[self.sizes[at] + 1])
            moves = np.flatnonzero(self.dst[lo:hi] == at) + lo
            for move in moves:
                prev, item = int(self.src[move]), int(self.owner[move])
                if loss[item] < big and least[prev] + loss[item] == least[at]:
                    break
            else:  # pragma: no cover - the table was built from these moves
                raise AssertionError("joint knapsack backtrack found no move")
            chosen.append(item)
            at = prev
        return s, d, chosen


def _table(n_states: int, rmax: int, src, owner, starts, targets, gain) -> np.ndarray:
    """``best[r][s]``: the most micro-batches of r items whose odd parts add up to state s (-1: none)."""
    best = np.full((rmax + 1, n_states), -1, dtype=np.int64)
    best[0, 0] = 0  # states are sorted: the zero vector is first
    if src.size == 0:
        return best
    move_gain = gain[owner]
    usable = move_gain >= 1  # a replica must run at least one micro-batch
    for r in range(rmax):
        before = best[r, src]
        cand = np.where(usable & (before >= 0), before + move_gain, -1)
        best[r + 1, targets] = np.maximum.reduceat(cand, starts)
    return best


def _backtrack(best, r, s, src, owner, starts, targets, gain) -> list[int]:
    """The items (indices into the item list) of a mix that gives ``best[r][s]``."""
    chosen = []
    while r > 0:
        k = int(np.flatnonzero(targets == s)[0])
        lo = int(starts[k])
        hi = int(starts[k + 1]) if k + 1 < len(starts) else src.size
        for move in range(lo, hi):
            prev, item = int(src[move]), int(owner[move])
            if gain[item] >= 1 and best[r - 1, prev] >= 0 and best[r - 1, prev] + gain[item] == best[r, s]:
                break
        else:  # pragma: no cover - the table was built from these moves
            raise AssertionError("joint knapsack backtrack found no move")
        chosen.append(item)
        s, r = prev, r - 1
    return chosen


__all__ = ["COUNTS_PER_DECISION", "JointProof", "MAX_MOVES", "MAX_STATES", "Verdict"]
