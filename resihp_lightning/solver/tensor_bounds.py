"""A replica-count proof for TP groupings: many identical groups and a few odd ones (docs/planner.md).

The groupings of :func:`~resihp_lightning.solver.tensor_search.solve_tensor` share their healthy
groups and differ in a few *odd* devices, the groups formed in the affected domains. When the most
numerous device kind K (the healthy group) dominates every other device (at least as fast, as large
and as well linked), a grouping's optimum is decided by how many micro-batches its replicas can run
below a limit, and that count has a tight upper bound that needs no plan of the grouping:

* a replica of P devices of K runs at most ``c_K`` micro-batches within the limit, its exact most
  (:func:`~resihp_lightning.solver.replica_search.max_micro_batches_mixed`, memory included);
* every other replica holds at least one odd device; one with k devices of K holds P - k odd ones,
  and those, ranked fastest first, are each dominated by the *rank envelope* of the grouping's odd
  devices: W_t = (the t-th fastest speed, the largest memory and link among the devices ranked t or
  later). Devices are interchangeable with ones that dominate them (stage times only fall, memory
  caps only rise), so such a replica runs at most ``V(k)``, the exact most of K^k + W_1..W_{P-k};
* with a' pure replicas (at most ``n_K // P``, at least ``D - n_odd`` since every other replica
  holds an odd device), the other D - a' replicas share ``n_K - a' P`` devices of K and the odd
  devices: a small knapsack over their k's.

The mixed replicas are ordered by their best odd device's rank, so the t-th fits into K^k and
W_t, W_{t+1}, ... To keep each count cheap its odd slots are taken as at most two kinds (W_t, then
W_{t+1} for the others; W_t for all of them first, and always past :data:`CHEAP_STAGES`): more
dominating devices only loosen the bound.

When ``a' c_K + max sum V(k_r) < M`` for every a' and every shape (P, D) the cheaper bounds leave
open, no plan on the grouping beats the limit (plus the all-reduce): the grouping is closed without
a solve. The counts depend on the kinds and the limit only, so groupings with equal odd envelopes
share them. A shared partition is a restriction of per-replica ones, so the proof holds for it too.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import replace

from resihp_lightning.plan import Device, Problem, link_slowdown
from resihp_lightning.solver.exact_model import Model
from resihp_lightning.solver.replica_search import (
    BudgetExceeded,
    WitnessRejected,
    max_micro_batches,
    max_micro_batches_mixed,
)

#: Work units (about 5 us each) of one replica count; a count past it is taken as its ceiling (still
#: an upper bound, so the proof stays valid, only weaker).
COUNT_BUDGET = 400_000
#: Replica counts one :meth:`DominantKindBound.closes` may compute (those known from earlier
#: questions are free): past them it gives up (no proof), and the caller solves the grouping.
COUNTS_PER_PROOF = 40
#: A composition with more distinct arrangements than this is not counted arrangement by arrangement
#: when the one-pass count is rejected (rounding at the limit); its count stays its ceiling.
MAX_ARRANGEMENTS = 720
#: Shapes deeper than this are only tried with the coarse envelope (every odd slot of the t-th mixed
#: replica as W_t: two kinds, a cheap count); the rank envelope's counts cost several times more.
CHEAP_STAGES = 6

Kind = tuple[float, float, float]  # (speed, memory_mb, link_speed), as tensor_plan.device_key lists them


def dominates_kind(better: Kind, worse: Kind) -> bool:
    """At least as fast, as large and as well linked (links at least as fast as the reference are alike)."""
    return better[0] >= worse[0] and better[1] >= worse[1] and min(better[2], 1.0) >= min(worse[2], 1.0)


def rank_envelope(odd: Sequence[Kind]) -> list[Kind]:
    """W_1..W_n of the module docstring: any t of these devices, ranked fastest first, fit into W_1..W_t."""
    ranked = sorted(odd, reverse=True)
    out = []
    memory = link = -math.inf
    for t in range(len(ranked) - 1, -1, -1):
        memory, link = max(memory, ranked[t][1]), max(link, min(ranked[t][2], 1.0))
        out.append((ranked[t][0], memory, link))
    return out[::-1]


class _OutOfCounts(Exception):
    """A proof used up its :data:`COUNTS_PER_PROOF`."""


class DominantKindBound:
    """Proves that a grouping cannot beat a cutoff from replica counts (module docstring).

    Args:
        problem: the problem over groups (its devices are ignored: each question brings its own).
    """

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self._models: dict[tuple[Kind, ...], tuple[Model, dict]] = {}
        self._counts: dict[tuple, int] = {}
        self._unproven: set[tuple] = set()  # counts that are only their ceiling (out of work)
        self._witnesses: dict[tuple, tuple] = {}  # count key -> (stage signatures, bounds)
        self.counted = 0  #: replica counts computed (not found in the memo)
        self._allowance = math.inf

    def most(self, kinds: Iterable[Kind], limit: float, ceiling: int) -> int:
        """An upper bound (exact within the budget) on the micro-batches one replica of these devices
        runs within ``limit`` ms, at most ``ceiling``."""
        composition = tuple(sorted(Counter(kinds).items()))
        key = (composition, limit)
        known = self._counts.get(key)  # (value, the ceiling it was computed under)
        if known is not None:
            value, capped = known
            if value < capped:
                return min(value, ceiling)  # exact
            if ceiling <= capped:
                return ceiling
        if self.counted >= self._allowance:
            raise _OutOfCounts
        self.counted += 1
        model, index = self._model(tuple(kind for kind, _ in composition))
        vector = [0] * len(model.classes)
        for kind, n in composition:
            vector[index[(kind[0], kind[1], link_slowdown(kind[2]))]] += n
        at_least = known[1] if known is not None else 1
        self._unproven.discard(key)
        arg = None
        try:
            got, arg = max_micro_batches_mixed(model, tuple(vector), limit, ceiling, [0], COUNT_BUDGET,
                                               at_least=at_least)
        except WitnessRejected:  # rounding at the limit: every arrangement on its own
            got, arg = _per_arrangement(model, vector, limit, ceiling, at_least)
        except (BudgetExceeded, RecursionError):
            got = None
        if got is None:
            got = ceiling  # not decided: the ceiling is still an upper bound
            self._unproven.add(key)
        elif arg is not None:
            order, bounds = arg
            signature = [(c.speed, c.memory_mb, c.link_slowdown) for c in model.classes]
            self._witnesses[key] = (tuple(signature[c] for c in order), tuple(bounds))
        self._counts[key] = (got, ceiling)
        return got

    def witness(self, kinds: Iterable[Kind], limit: float) -> tuple[tuple[tuple[float, float, float], ...], tuple[int, ...]] | None:
        """The plan behind the last count of these devices at ``limit``: each stage's device as
        (speed, memory_mb, link slowdown), in stage order, and the stage bounds (``None``: none known).
        It runs at least the count :meth:`most` returned within the limit."""
        return self._witnesses.get((tuple(sorted(Counter(kinds).items())), limit))

    def count(self, kinds: Iterable[Kind], limit: float, ceiling: int) -> tuple[int, bool]:
        """:meth:`most` outside a proof's count allowance (for other proofs sharing the memo), and
        whether the value is exact (False: only an upper bound, the count ran out of work)."""
        allowance, self._allowance = self._allowance, math.inf
        try:
            value = self.most(kinds, limit, ceiling)
        finally:
            self._allowance = allowance
        key = (tuple(sorted(Counter(kinds).items())), limit)
        return value, key not in self._unproven

    def _model(self, kinds: tuple[Kind, ...]) -> tuple[Model, dict]:
        if kinds not in self._models:
            devices = tuple(Device(i, speed, memory, link) for i, (speed, memory, link) in enumerate(kinds))
            model = Model(replace(self.problem, devices=devices))
            index = {(c.speed, c.memory_mb, c.link_slowdown): i for i, c in enumerate(model.classes)}
            self._models[kinds] = (model, index)
        return self._models[kinds]

    def closes(self, devices: Sequence[Kind], cutoff: float, pipeline_degrees: Iterable[int]) -> bool:
        """True when no plan on ``devices`` with P among ``pipeline_degrees`` is faster than ``cutoff``
        (a proof); False: maybe, or the most numerous kind does not dominate the others."""
        problem = self.problem
        self._allowance = self.counted + COUNTS_PER_PROOF
        kinds = Counter(devices)
        top, n_top = max(kinds.items(), key=lambda item: (item[1], item[0]))
        if not all(dominates_kind(top, kind) for kind in kinds):
            return False
        odd = [kind for kind in devices if kind != top]
        envelope = rank_envelope(odd)
        n, m = len(devices), problem.micro_batches
        slowdowns = sorted(link_slowdown(kind[2]) for kind in devices)
        for p in sorted(set(pipeline_degrees)):
            if problem.allow_exclude:
                shapes = range(max(1, problem.min_data_degree), min(n // p, m) + 1)
            else:
                shapes = (n // p,) if n % p == 0 and problem.min_data_degree <= n // p <= m else ()
            for d in shapes:
                limit = cutoff * (1 - 1e-12)
                if d > 1:
                    slowest = slowdowns[min(p * d, n) - 1] if problem.allow_exclude else slowdowns[-1]
                    limit -= problem.allreduce_ms * slowest
                if limit <= 0:
                    continue
                # Coarse first (the t-th mixed replica's odd slots all W_t: two kinds, a cheap count),
                # the finer envelope only when that does not close the shape and P is small.
                try:
                    if self._reach(top, n_top, envelope, p, d, limit, coarse=True) >= m and \
                            (p > CHEAP_STAGES or self._reach(top, n_top, envelope, p, d, limit, coarse=False) >= m):
                        return False
                except _OutOfCounts:
                    return False
        return True

    def _reach(self, top: Kind, n_top: int, envelope: list[Kind], p: int, d: int, limit: float, *, coarse: bool) -> int:
        """An upper bound on the micro-batches D replicas of P stages run within ``limit``.

        The mixed replicas are taken in the order of their best odd device's rank: the t-th holds
        ranks t or later, its j-th best rank t + j - 1 or later, so it fits into K^k and
        W_t..W_{t+P-k-1} (the envelope falls with the rank).
        """
        m = self.problem.micro_batches
        ceiling = m - d + 1  # every other replica runs at least one
        pure = min(self.most([top] * p, limit, m), ceiling)  # K dominates: the most any replica runs
        if d * pure < m:
            return d * pure  # not even D pure replicas reach M
        n_odd = len(envelope)
        values: dict[tuple[int, int], int] = {}

        def mixed(t: int, k: int) -> int:  # the t-th mixed replica (from 0), k devices of K: -1 when none fits
            if (t, k) not in values:
                window = envelope[t:t + p - k]
                if window:  # one odd kind (W_t) when coarse, else two (W_t, then W_{t+1}): cheap counts
                    window = window[:1] * len(window) if coarse else window[:1] + window[1:2] * (len(window) - 1)
                if len(window) < p - k:
                    values[(t, k)] = -1
                else:  # more K (k + 1) or a later window (t + 1) only lower the count: a ceiling
                    above = mixed(t, k + 1) if k + 1 < p else pure
                    values[(t, k)] = self.most([top] * k + window, limit, max(0, above))
            return values[(t, k)]

        best = -1
        for pure_count in range(max(0, d - n_odd), min(d, n_top // p) + 1):
            spare_top = n_top - pure_count * p
            # (K devices used, odd devices used) -> most micro-batches of the mixed replicas so far
            states = {(0, 0): 0}
            for t in range(d - pure_count):
                grown: dict[tuple[int, int], int] = {}
                for (used, used_odd), total in states.items():
                    for k in range(0, min(p - 1, spare_top - used) + 1):
                        if used_odd + p - k > n_odd:
                            continue
                        value = mixed(t, k)
                        if value < 0:
                            continue
                        state = (used + k, used_odd + p - k)
                        grown[state] = max(grown.get(state, -1), total + value)
                states = grown
            if states:
                best = max(best, pure_count * pure + max(states.values()))
        return best


def _per_arrangement(model: Model, vector: Sequence[int], limit: float, ceiling: int, at_least: int):
    """The exact count by one branch and bound per arrangement of the classes, and its (order,
    bounds) (``(None, None)``: too many arrangements or out of work; ``None`` bounds: below ``at_least``)."""
    if math.factorial(sum(vector)) // math.prod(math.factorial(n) for n in vector) > MAX_ARRANGEMENTS:
        return None, None
    arrangements: list[tuple[int, ...]] = []
    left = list(vector)

    def arrange(prefix: tuple[int, ...]) -> None:
        if not any(left):
            arrangements.append(prefix)
            return
        for c, n in enumerate(left):
            if n:
                left[c] -= 1
                arrange(prefix + (c,))
                left[c] += 1

    arrange(())
    ticks = [0]
    best, arg = at_least - 1, None
    try:
        for order in arrangements:
            got, bounds = max_micro_batches(model, order, limit, ceiling, ticks, COUNT_BUDGET, best + 1)
            if bounds is not None and got > best:
                best, arg = got, (order, bounds)
                if best >= ceiling:
                    break
    except (BudgetExceeded, RecursionError):
        return None, None
    return best, arg


__all__ = ["CHEAP_STAGES", "COUNT_BUDGET", "COUNTS_PER_PROOF", "DominantKindBound", "dominates_kind", "rank_envelope"]
