"""Decomposition by shape over replica compositions: the exact planner's fast proof at scale.

For each shape (P, D) (in increasing order of :func:`~resihp_lightning.solver.bounds.shape_lower_bound`,
skipping those that cannot beat the incumbent) the search asks one question: *can every replica
finish below the incumbent?* With ``limit`` just below it (minus the all-reduce), a replica can run
at most ``count(limit, S, X, cap)`` micro-batches (:func:`~.microbatch_split.count`), and the shape
can beat the incumbent exactly when some choice of D replicas, using the devices there are, runs M
micro-batches in all. Devices of one class are interchangeable, so that choice is a knapsack over
replica *compositions* (:mod:`resihp_lightning.solver.knapsack`), solved exactly:

* **Upper bounds first.** Every composition starts with a bound that needs no partition at all:
  ``S >= C / s_max + (P - 1) p2p`` (with slow links, the least transfer sum of any arrangement of
  its classes, :meth:`~.exact_model.Model.min_p2p_sum`) and
  ``X >= max(C / sum s (plus the p2p share), whole layers)``.
  Pure replicas get their exact value from the bottleneck dynamic programme
  (:func:`~.replica_search.min_bottleneck`, memory included). When the knapsack over these values cannot
  reach M the shape is closed, before any partition of a mixed replica is searched.
* **Exact values lazily.** Otherwise the compositions the knapsack chose get their exact value
  (the best arrangement of their classes over the stages, and its bounds), and the knapsack is
  solved again; a knapsack whose chosen items are all exact is the true answer (every other value
  is an upper bound). When it reaches M, its replicas, with the exact micro-batch split
  (:func:`~.microbatch_split.split`), are a strictly better plan: it becomes the incumbent and the
  question is asked again below it.
* **Shared partitions** add one search over the common bounds: a branch and bound whose nodes are
  cut when even the pure replicas of the largest class, with the best remaining stages, leave the
  knapsack short of M. At a leaf the compositions' values are exact for those bounds.
* **Slow links.** A replica's stage times depend on its classes' positions (every arrangement is
  priced, as for speeds), but the all-reduce, ``allreduce_ms`` times the slowest link used, couples
  all replicas. With exclusion, D > 1 and classes of several link slowdowns, a shape is therefore
  closed once per *link level* (:func:`link_levels`): only the classes whose links are at least
  that fast, the all-reduce priced at that level. Every plan is priced exactly at its own level
  and higher at the others, so closing every level closes the shape. With healthy links there is
  one level, the shape itself.

Every cut is a valid upper bound on micro-batches (so a lower bound on T), the knapsack is exact,
and the split is exact, so a search that closes every shape has proven its incumbent optimal.
Work is counted in units of about 5 µs (a child of a partition's branch and bound; a knapsack
table counts its cells / 100, a node of the shared search 10); past its budget, or where the knapsack would be too large
(:data:`~.knapsack.MAX_CELLS`) or a composition has too many arrangements
(:data:`MAX_ARRANGEMENTS`), a shape stays open. An open shape still gets a proven lower bound: the
least limit at which the knapsack over the upper bounds alone can reach M (bisection), which is
what the reported gap uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from resihp_lightning.solver.bounds import shape_lower_bound
from resihp_lightning.solver.enumeration import count_bounds
from resihp_lightning.solver.exact_model import Best, Model
from resihp_lightning.solver.replica_search import (
    MAX_COMPOSITION_STATES,
    BudgetExceeded,
    WitnessRejected,
    composition_states,
    max_micro_batches,
    max_micro_batches_mixed,
    min_bottleneck,
)
from resihp_lightning.solver.knapsack import Mix, TooLarge, free_upper, replica_knapsack
from resihp_lightning.solver.microbatch_split import count, split

#: A composition with more distinct stage arrangements than this leaves its shape open.
MAX_ARRANGEMENTS = 2_000
#: Shared partitions: when mixes without pure replicas of the free class could reach M, the search
#: over the common bounds has nothing to cut with; beyond this many bounds vectors the shape is
#: left open at once (to the layout enumeration and the MILP) instead of spending the budget.
UNGUIDED_BOUNDS = 5_000


#: Work units per composition when every composition of a shape gets its upper bound: a few when
#: another problem over the same layers computed it already (Model.shared), up to about 50 when not;
#: counted alike, so that budgets never depend on what was solved before.
ITEM_UNITS = 10


def count_compositions(p: int, counts: list[int]) -> int:
    """How many per-class count vectors sum to ``p`` with each at most its class's count."""
    ways = [1] + [0] * p
    for cap in counts:
        ways = [sum(ways[s - k] for k in range(0, min(cap, s) + 1)) for s in range(p + 1)]
    return ways[p]


class _Open(Exception):
    """This shape cannot be closed within the work budget or the size limits."""


@dataclass
class Outcome:
    """What the decomposition proved.

    Attributes:
        proven: every shape was closed: the incumbent is optimal.
        bound_ms: a proven lower bound on the optimum (the incumbent's value when proven).
        open_shapes: the shapes left open.
    """

    proven: bool
    bound_ms: float
    open_shapes: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _Work:
    used: int = 0
    budget: int = 0

    def spend(self, units: int) -> None:
        self.used += units
        if self.used > self.budget:
            raise _Open("work budget")


def arrangements(composition: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every distinct sequence of class ids with these per-class counts (fastest classes first)."""
    out: list[tuple[int, ...]] = []
    left = list(composition)
    prefix: list[int] = []
    total = sum(composition)

    def rec() -> None:
        if len(out) > MAX_ARRANGEMENTS:
            raise _Open("arrangements")
        if len(prefix) == total:
            out.append(tuple(prefix))
            return
        for c in range(len(left)):
            if left[c]:
                left[c] -= 1
                prefix.append(c)
                rec()
                prefix.pop()
                left[c] += 1

    rec()
    return out


class _Shape:
    """The search of one shape (P, D); ``close`` returns normally when the shape is closed."""

    def __init__(self, model: Model, best: Best, work: _Work, p: int, d: int,
                 level: tuple[float, tuple[int, ...]] | None = None, pure_cache: dict | None = None) -> None:
        self.model, self.best, self.work, self.p, self.d = model, best, work, p, d
        self.problem = model.problem
        if level is None:
            self.counts = [len(c.ids) for c in model.classes]
            self.allreduce = self.problem.allreduce_ms if d > 1 else 0.0
        else:
            # One link level (:func:`link_levels`): only these classes, the all-reduce priced at it.
            self.allreduce, self.counts = level[0], list(level[1])
        self.most = model.M - d + 1
        # Building the knapsack lists every composition, and each gets a bound (start_values):
        # their number is the work, counted before it is done.
        self.items = count_compositions(p, self.counts)
        self.work.spend(1 + self.items // 10)
        try:
            self.knapsack = replica_knapsack(p, d, self.counts, self.problem.allow_exclude)
        except TooLarge as error:
            raise _Open(str(error)) from None
        self.free = self.knapsack.free
        slowest = min(c.speed for c in model.classes)
        u_max = max(model.link)
        stage = model.pc[-1] / slowest + self.problem.p2p_ms * (2 * u_max - 1)
        self.ceiling = 2 * (self.problem.allreduce_ms * u_max + (model.M + model.L + 1) * stage) + 1.0
        # (class, in flight) -> bottleneck partition; shared by the link levels of one shape.
        self._pure: dict[tuple[int, int], tuple[float, tuple[int, ...] | None]] = {} if pure_cache is None else pure_cache
        self._arr: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        self._start: tuple[float | None, dict] = (None, {})

    # ------------------------------------------------------------------------------ values
    def limit(self) -> float:
        # Without an incumbent the ceiling stands in: every plan is below it (all layers on the
        # slowest device, every micro-batch after the other), so closing every shape proves that
        # nothing fits.
        value = min(self.best.value, self.ceiling)
        return value - 1e-12 * max(1.0, abs(value)) - self.allreduce

    def _table(self, values: dict, free_value: int) -> Mix | None:
        self.work.spend(1 + self.knapsack.cells // 100)
        return self.knapsack.solve(values, free_value)

    def upper(self, composition: tuple[int, ...], limit: float) -> int:
        """Micro-batches no replica of this composition can exceed within ``limit`` (any partition).

        Starts from ``S >= C / s_max + (P - 1) p2p`` (with slow links, the least transfer sum of any
        arrangement, :meth:`Model.min_p2p_sum`) and ``X >= max(C / sum s (+ p2p share), whole
        layers)``; then, for a candidate m, a replica running m needs ``X <= (limit - S) / (m - 1)``,
        so each stage holds at most the largest run of layers within ``X s_j``, and filling the
        fastest devices first gives the least S that allows. A candidate that fails is a proof that
        no replica runs that many (nor, running fewer being easier, more), so the most candidate that
        passes is found by bisection.
        """
        model = self.model
        speeds = sorted((model.classes[c].speed for c, n in enumerate(composition) for _ in range(n)), reverse=True)
        p2p_sum = model.min_p2p_sum([c for c, n in enumerate(composition) for _ in range(n)], self.p)
        shared_key = ("upper", tuple(speeds), p2p_sum, self.p, self.most, limit)
        found = model.shared.get(shared_key)
        if found is None:
            found = model.shared[shared_key] = self._upper(speeds, p2p_sum, limit)
        return found

    def _upper(self, speeds: list[float], p2p_sum: float, limit: float) -> int:
        model, p2p = self.model, self.problem.p2p_ms
        total = model.pc[-1]
        s_sum, s_max = sum(speeds), speeds[0]
        base_sum = total / s_max + p2p_sum
        worst = max((total + p2p * (s_sum - s_max)) / s_sum, model.layer_bound(tuple(speeds), 0))

        def passes(m: int) -> bool:
            stages_sum = base_sum
            for _ in range(3):  # a lower S cap allows less per stage, which raises S: iterate
                cap = (limit - stages_sum) / (m - 1)
                least = self._least_sum(speeds, cap, p2p_sum)
                if least <= stages_sum:
                    break
                stages_sum = least
            return count(limit, stages_sum, worst, m) >= m

        lo, hi = 1, count(limit, base_sum, worst, self.most)  # the answer lies in [lo, hi]
        if hi <= 1:
            return hi
        if passes(hi):
            return hi
        hi -= 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if passes(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _least_sum(self, speeds: list[float], cap: float, p2p_sum: float) -> float:
        """The least ``sum_j c_j / s_j + p2p_sum`` when stage j holds at most ``cap`` ms at its speed."""
        left = self.model.pc[-1]
        out = p2p_sum
        run, run_speed = 0.0, None
        for s in speeds:  # fastest first: the cheapest place for compute
            if s != run_speed:  # equal speeds (sorted, so adjacent) hold equal runs
                run, run_speed = self._longest_run(cap * s), s
            take = min(left, run)
            out += take / s
            left -= take
            if left <= 0:
                return out
        return math.inf

    def _longest_run(self, budget: float) -> float:
        """The most compute of contiguous layers that is at most ``budget`` (:meth:`Model.longest_run`)."""
        return self.model.longest_run(budget)

    def pure(self, cls: int, limit: float) -> tuple[int, tuple[int, ...] | None]:
        """Exact: the most micro-batches of a pure replica of ``cls`` within ``limit``, its bounds.

        With memory for P in flight (every stage's most) any count the time allows fits. Below P,
        m fits when the bottleneck partition with memory for m in flight runs m within ``limit``;
        fewer micro-batches need less memory and time, so the most such m is found by bisection.
        """
        model, p = self.model, self.p
        total = model.pc[-1] / model.classes[cls].speed + model.pure_p2p_sum(cls, p)

        def partition(m: int) -> tuple[float, tuple[int, ...] | None]:
            key = (cls, m)
            if key not in self._pure:
                self.work.spend(20 + p * model.L * model.L // 500)  # measured: a numpy pass per stage
                c = model.classes[cls]
                shared_key = ("bottleneck", c.speed, c.memory_mb, c.link_slowdown, p, m)
                if shared_key not in model.shared:
                    model.shared[shared_key] = min_bottleneck(model, cls, p, m)
                self._pure[key] = model.shared[shared_key]
            return self._pure[key]

        worst, bounds = partition(p)
        if bounds is not None:
            got = count(limit, total, worst, self.most)
            if got >= p:
                return got, bounds

        def fits(m: int) -> bool:
            worst, bounds = partition(m)
            return bounds is not None and count(limit, total, worst, m) >= m

        lo, hi = 0, min(p - 1, self.most)  # fits(lo) holds (vacuously at 0); the answer lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return (lo, partition(lo)[1]) if lo > 0 else (0, None)

    def arrangements(self, composition: tuple[int, ...]) -> list[tuple[int, ...]]:
        if composition not in self._arr:
            self._arr[composition] = arrangements(composition)
        return self._arr[composition]

    def start_values(self, limit: float) -> dict[tuple[int, ...], int]:
        """Upper bounds for every item composition; pure ones exact (per-replica partitions)."""
        if self._start[0] == limit:
            return dict(self._start[1])
        self.work.spend(ITEM_UNITS * len(self.knapsack.items))
        values = {}
        for k in self.knapsack.items:
            if max(k) == self.p:
                values[k] = self.pure(k.index(self.p), limit)[0]
            else:
                values[k] = self.upper(k, limit)
        self._start = (limit, values)
        return dict(values)

    def relaxed_reaches(self, limit: float) -> bool:
        """Whether the knapsack over upper bounds alone reaches M within ``limit`` (False: proof)."""
        g = self.knapsack.upper_by_replicas(self.start_values(limit))
        self.work.spend(1 + self.knapsack.cells // 100)
        return free_upper(g, self.d, self.pure(self.free, limit)[0]) >= self.model.M

    def lower_bound(self) -> float:
        """A proven lower bound on T over this shape (bisection on the relaxed knapsack)."""
        lo = shape_lower_bound(self.problem, self.p, self.d) - self.allreduce
        hi = min(self.best.value, self.ceiling) - self.allreduce
        if not self.relaxed_reaches(lo):
            for _ in range(30):
                if hi - lo <= 1e-7 * max(1.0, hi):
                    break
                mid = (lo + hi) / 2
                if self.relaxed_reaches(mid):
                    hi = mid
                else:
                    lo = mid
        return lo + self.allreduce

    # ------------------------------------------------------------------------------ offering
    def _offer(self, rows: list[tuple[tuple[int, ...], tuple[int, ...], int]]) -> bool:
        """Splits M over (types, bounds, replicas) rows; offers the plan; True when it improved."""
        groups = [(*self.model.profile(t, b), n) for t, b, n in rows]
        result = split(groups, self.model.M)
        if result is None:
            return False
        # The plan's own all-reduce (at most the level's: its slowest link may be faster).
        value = result[0] + (self.model.grid_allreduce([t for t, _, _ in rows], self.d) if self.model.slow_links else self.allreduce)
        incumbent = min(self.best.value, self.ceiling)
        if not value < incumbent - 1e-12 * max(1.0, abs(incumbent)):
            return False  # rounding at the limit: nothing strictly better
        grid, bounds, counts = [], [], []
        for (t, b, _), row in zip(rows, result[1]):
            grid.extend([t] * len(row))
            bounds.extend([b] * len(row))
            counts.extend(row)
        self.best.offer(value, grid, bounds, counts)
        return True

    # ------------------------------------------------------------------------- per replica
    def _exact_per_replica(self, k: tuple[int, ...], limit: float, ceiling: int):
        """The most micro-batches a replica of composition ``k`` runs within ``limit`` (best arrangement).

        Only values that could matter are sought: the other D - 1 replicas run at most ``most``
        each, so a value below ``M - (D - 1) most`` can never complete a mix that reaches M (with
        D = 1 the replica must run all M). Below it, ``need - 1`` is returned without bounds: a
        valid upper bound that keeps the composition out of every mix that reaches M.
        """
        need = max(1, self.model.M - (self.d - 1) * self.most)
        if composition_states(k) <= MAX_COMPOSITION_STATES:
            ticks = [self.work.used]
            try:
                got, arg = max_micro_batches_mixed(self.model, k, limit, self.most, ticks, self.work.budget,
                                                   need, ceiling)
                self.work.used = ticks[0]
                return got, arg
            except BudgetExceeded:
                raise _Open("work budget") from None
            except WitnessRejected:
                self.work.used = ticks[0]  # rounding at the limit: every arrangement on its own below
        got, arg = need - 1, None
        for t in self.arrangements(k):
            ticks = [self.work.used]
            try:
                m, b = max_micro_batches(self.model, t, limit, self.most, ticks, self.work.budget, got + 1)
            except BudgetExceeded:
                raise _Open("work budget") from None
            self.work.used = ticks[0]
            if b is not None and m > got:
                got, arg = m, (t, b)
                if got >= ceiling:
                    break
        return got, arg

    def close_per_replica(self) -> None:
        while True:
            limit = self.limit()
            if limit <= 0:
                return
            values = self.start_values(limit)
            free_value, free_bounds = self.pure(self.free, limit)
            chosen: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]] | None] = {}
            for k in values:
                if max(k) == self.p and values[k] >= 1:
                    cls = k.index(self.p)
                    chosen[k] = ((cls,) * self.p, self.pure(cls, limit)[1])
            while True:
                mix = self._table(values, free_value)
                if mix is None or mix.total < self.model.M:
                    return
                pending = [k for k in mix.items if k not in chosen]
                if not pending:
                    break
                for k in pending:
                    values[k], chosen[k] = self._exact_per_replica(k, limit, values[k])
            rows = [(*chosen[k], n) for k, n in mix.items.items()]
            if mix.free_replicas:
                rows.append(((self.free,) * self.p, free_bounds, mix.free_replicas))
            if not self._offer(rows):
                return

    # ------------------------------------------------------------------------------ shared
    def close_shared(self) -> None:
        model, p = self.model, self.p
        self._limit_seen = None
        self._g: list = []
        s_f = model.classes[self.free].speed
        self._free_sum = model.pc[-1] / s_f + model.pure_p2p_sum(self.free, p)
        self._bounds = [0] * (p + 1)
        self._bounds[p] = model.L
        self._visit(0, 0, 0.0, self.most)

    def _refresh(self) -> float:
        """The current limit; the relaxed knapsack table and the free class's need follow it."""
        limit = self.limit()
        if limit != self._limit_seen:
            self._limit_seen = limit
            self._g = self.knapsack.upper_by_replicas(self.start_values(limit))
            self.work.spend(1 + self.knapsack.cells // 100)
            # The fewest micro-batches the free class's pure replicas must reach for any mix to
            # reach M (free_upper is non-decreasing in it); most + 1 when none can.
            self._need = next((mu for mu in range(self.most + 1) if free_upper(self._g, self.d, mu) >= self.model.M),
                              self.most + 1)
            if self._need == 0 and count_bounds(self.model.L, self.p, self.model.min_layers) > UNGUIDED_BOUNDS:
                raise _Open("the free class does not guide the shared bounds")
        return limit

    def _free_bound(self, limit: float, j: int, a: int, worst: float, cap: int) -> int:
        """Upper bound on the free class's pure micro-batches once stages < j end at ``a``."""
        model, p = self.model, self.p
        s_f = model.classes[self.free].speed
        rest = model.pc[-1] - model.pc[a]
        stages = p - j
        if stages > 0:
            p2p_share = self.problem.p2p_ms * (stages - 1) / stages
            speeds = (s_f,) * stages
            worst = max(worst, rest / (s_f * stages) + p2p_share, model.layer_bound(speeds, a))
        return count(limit, self._free_sum, worst, min(cap, self.most))

    def _visit(self, j: int, a: int, worst: float, cap: int) -> None:
        model, p = self.model, self.p
        last = j == p - 1
        first_b = model.L if last else a + model.min_layers
        last_b = model.L if last else model.L - (p - 1 - j) * model.min_layers
        for b in range(first_b, last_b + 1):
            self.work.spend(10)
            limit = self._refresh()
            if limit <= 0 or self._need > self.most:
                return
            t = model.stage_time(a, b, self.free, j, p)
            stage_cap = model.stage_cap(a, b, self.free, p - j)
            if self._need > 0 and count(limit, self._free_sum, t, min(stage_cap, self.most)) < self._need:
                return  # longer stages only take more time and memory on the free class
            new_worst, new_cap = max(worst, t), min(cap, stage_cap)
            if self._free_bound(limit, j + 1, b, new_worst, new_cap) < self._need:
                continue
            self._bounds[j + 1] = b
            if last:
                while self._leaf(tuple(self._bounds)):
                    pass
            else:
                self._visit(j + 1, b, new_worst, new_cap)

    def _leaf(self, bounds: tuple[int, ...]) -> bool:
        """Exact knapsack for these shared bounds; True when it found a better plan."""
        model, p = self.model, self.p
        limit = self._refresh()
        n_cls = len(model.classes)
        times = [[model.stage_time(bounds[j], bounds[j + 1], c, j, p) for c in range(n_cls)] for j in range(p)]
        caps = [[model.stage_cap(bounds[j], bounds[j + 1], c, p - j) for c in range(n_cls)] for j in range(p)]

        def value(types: tuple[int, ...]) -> int:
            s = sum(times[j][c] for j, c in enumerate(types))
            x = max(times[j][c] for j, c in enumerate(types))
            return count(limit, s, x, min(self.most, min(caps[j][c] for j, c in enumerate(types))))

        free_value = value((self.free,) * p)
        if free_upper(self._g, self.d, free_value) < model.M:
            return False
        values = self.start_values(limit)
        chosen: dict[tuple[int, ...], tuple[int, ...]] = {}
        while True:
            mix = self._table(values, free_value)
            if mix is None or mix.total < model.M:
                return False
            pending = [k for k in mix.items if k not in chosen]
            if not pending:
                break
            for k in pending:
                options = self.arrangements(k)
                self.work.spend(1 + 2 * len(options))
                best_t = max(options, key=value)
                values[k], chosen[k] = value(best_t), best_t
        rows = [(chosen[k], bounds, n) for k, n in mix.items.items()]
        if mix.free_replicas:
            rows.append(((self.free,) * p, bounds, mix.free_replicas))
        return self._offer(rows)


def decomposition_search(model: Model, best: Best, budget: int, *, bounds: bool = True) -> Outcome:
    """Closes every shape it can within ``budget`` work units; improves ``best`` in place.

    Args:
        model: the class-level model of the problem.
        best: the incumbent (normally the heuristic's); needed: without one nothing is closed.
        budget: work units (deterministic; see the module docstring).
        bounds: give a shape left open its bisected lower bound (else only
            :func:`~resihp_lightning.solver.bounds.shape_lower_bound`): for callers that only ask
            whether every shape closes.

    Returns:
        Whether the incumbent is proven optimal, and a proven lower bound on the optimum.
    """
    problem = model.problem
    work = _Work(0, budget)
    shapes = sorted(problem.candidate_shapes(), key=lambda s: shape_lower_bound(problem, *s))
    left: list[tuple[int, int, tuple | None]] = []
    for p, d in shapes:
        if shape_lower_bound(problem, p, d) >= best.value:
            continue
        pure_cache: dict = {}
        for level in link_levels(model, p, d):
            if level is not None and _level_floor(problem, p, d, level) >= best.value:
                continue
            try:
                shape = _Shape(model, best, work, p, d, level, pure_cache)
                if problem.shared_partition and d > 1:
                    shape.close_shared()
                else:
                    shape.close_per_replica()
            except _Open:
                left.append((p, d, level))
    bound = best.value
    open_shapes = []
    for p, d, level in left:
        lb = shape_lower_bound(problem, p, d)
        if level is not None:
            lb = max(lb, _level_floor(problem, p, d, level))
        if lb >= best.value:
            continue
        if (p, d) not in open_shapes:
            open_shapes.append((p, d))
        try:
            # The bound of an open shape gets a budget of its own: it is cheap and keeps the gap honest.
            if bounds:
                lb = max(lb, _Shape(model, best, _Work(0, max(budget // 4, 2_000)), p, d, level).lower_bound())
        except _Open:
            pass
        bound = min(bound, lb)
    return Outcome(not open_shapes, bound, open_shapes)


def link_levels(model: Model, p: int, d: int) -> list[tuple[float, tuple[int, ...]] | None]:
    """The link levels a shape is closed over: ``[None]`` (the whole shape) unless links split it.

    The all-reduce costs ``allreduce_ms * max u`` over the devices a plan uses, which couples all
    replicas. With ``allow_exclude``, D > 1 and classes of different link slowdowns u, the shape
    is searched once per level U (a distinct u, ascending): only the classes with ``u <= U``, the
    all-reduce priced at ``allreduce_ms * U``. Every plan lies in the level of its slowest link,
    where it is priced exactly, and elsewhere it is priced higher, so closing every level closes
    the shape. Without exclusion every device is used, so the one level is the slowest link.
    Each level is ``(allreduce_ms * U, devices per class with the others at 0)``.
    """
    problem = model.problem
    if not model.slow_links or d <= 1 or problem.allreduce_ms == 0:
        return [None]
    counts = [len(c.ids) for c in model.classes]
    if not problem.allow_exclude:
        return [(problem.allreduce_ms * max(model.link), tuple(counts))]
    levels = []
    for u in sorted(set(model.link)):
        allowed = tuple(n if model.link[c] <= u else 0 for c, n in enumerate(counts))
        if sum(allowed) >= p * d:
            levels.append((problem.allreduce_ms * u, allowed))
    return levels


def _level_floor(problem, p: int, d: int, level: tuple[float, tuple[int, ...]]) -> float:
    """A lower bound on T over the plans of one link level (the shape bound with its all-reduce)."""
    return shape_lower_bound(problem, p, d, with_allreduce=False) + level[0]
