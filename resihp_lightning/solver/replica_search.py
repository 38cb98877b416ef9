"""One replica's stage bounds on its own: the least bottleneck and the most micro-batches within a limit.

The per-replica searches of :mod:`resihp_lightning.solver.exact` and the decomposition by shape
(:mod:`resihp_lightning.solver.decomposition`) both price one replica kind at a time with these; both
count their work in the same units and stop with :class:`BudgetExceeded` past their budget.
"""

from __future__ import annotations

import math

import numpy as np

from resihp_lightning.solver.bottleneck import min_max_partition
from resihp_lightning.plan import EPS
from resihp_lightning.solver.exact_model import Model
from resihp_lightning.solver.microbatch_split import count


class BudgetExceeded(Exception):
    """A search spent its work budget (the caller keeps the best plan seen, status ``"feasible"``)."""


def min_bottleneck(model: Model, cls: int, p: int, m: int) -> tuple[float, tuple[int, ...] | None]:
    """The least possible slowest-stage time of P stages on class ``cls`` with memory for m in flight.

    The ms tables for :func:`~resihp_lightning.solver.bottleneck.min_max_partition` (stage j may
    hold a..b-1 when :meth:`Model.stage_cap <.exact_model.Model.stage_cap>` allows m micro-batches; ties: the latest start).
    ``(inf, None)`` when nothing fits.
    """
    pc = np.asarray(model.pc, dtype=float)
    span = (pc[None, :] - pc[:, None]) / model.classes[cls].speed
    costs = [span + model.stage_p2p(cls, j, p) for j in range(p)]
    allowed = [_fitting_stages(model, cls, p, j, m) for j in range(p)]
    found = min_max_partition(costs, allowed, latest_start_on_ties=True)
    if found is None:
        return math.inf, None
    return found


def _fitting_stages(model: Model, cls: int, p: int, j: int, m: int) -> np.ndarray:
    """Where stage j of P may hold layers a..b-1 on class ``cls`` with m micro-batches (bool array).

    Only ends ``b`` that leave room for the later stages are marked (only ``b = L`` for the last
    stage), and starts ``a >= j * min_layers``: no partition of all L layers ends a stage elsewhere.
    For each end, starts are taken from the shortest stage down to the first that does not fit
    (longer stages need more memory). :func:`stage_caps` computes ``Model.stage_cap`` for every
    span at once, with the same floating-point operations.
    """
    big_l, min_l = model.L, model.min_layers
    fits = stage_caps(model, cls, p - j) >= m
    index = np.arange(big_l + 1)
    span = index[None, :] - index[:, None]  # b - a
    # Starts closer to b than min_layers are not stages; let them pass so the run below starts at b - min_layers.
    passing = np.where(span < min_l, True, fits)
    # Going down from a = b - min_layers, a start is kept while every shorter stage fitted too.
    kept = np.logical_and.accumulate(passing[::-1, :], axis=0)[::-1, :]
    lo_b = big_l if j == p - 1 else (j + 1) * min_l
    hi_b = big_l - (p - 1 - j) * min_l
    allowed = kept & (span >= min_l) & (index[:, None] >= j * min_l)
    allowed &= (index[None, :] >= lo_b) & (index[None, :] <= hi_b)
    return allowed


#: Stage caps of recent models: (pc, ps, pa, min_layers, M, class memory) -> in flight -> table.
_CAPS: list[tuple[tuple, dict[int, np.ndarray]]] = []


def stage_caps(model: Model, cls: int, in_flight_max: int) -> np.ndarray:
    """``Model.stage_cap(a, b, cls, in_flight_max)`` for every ``0 <= a, b <= L`` (an int array).

    Elementwise the same operations as :meth:`Model.stage_cap <.exact_model.Model.stage_cap>`
    (IEEE arithmetic, so the same values; ``a >= b`` entries are meaningless). Tables are kept for
    the last few layer lists and memory sizes, so that problems over the same layers and device
    kinds (the groupings of a tensor-parallel search) share them.
    """
    memory = model.classes[cls].memory_mb
    key = (model.pc, model.ps, model.pa, model.M, memory)
    for known, tables in _CAPS:
        if known == key:
            break
    else:
        tables = {}
        _CAPS.insert(0, (key, tables))
        del _CAPS[16:]
    if in_flight_max not in tables:
        ps = np.asarray(model.ps, dtype=float)
        pa = np.asarray(model.pa, dtype=float)
        static = ps[None, :] - ps[:, None]
        act = pa[None, :] - pa[:, None]
        capacity = memory * (1 + EPS) + EPS
        whole = static + in_flight_max * act <= capacity
        with np.errstate(divide="ignore", invalid="ignore"):
            quotient = np.floor((capacity - static) / act)
        fits = np.maximum(0.0, np.minimum(float(in_flight_max - 1), quotient))
        fits = np.where((fits > 0) & (static + fits * act > capacity), fits - 1, fits)
        fits = np.where(act > 0, fits, 0.0)
        tables[in_flight_max] = np.where(whole, model.M, fits).astype(np.int64)
    return tables[in_flight_max]


def max_micro_batches_pure(model: Model, cls: int, p: int, limit: float, most: int, ticks: list[int], budget: int, cache: dict):
    """:func:`max_micro_batches` for a replica of one class: S is fixed, so only the bottleneck matters."""
    total = model.pc[-1] / model.classes[cls].speed + model.pure_p2p_sum(cls, p)
    for m in [p] + list(range(min(p - 1, most), 0, -1)):
        key = ("pure", cls, p, m)
        if key not in cache:
            ticks[0] += max(1, p * model.L * model.L // 20)
            if ticks[0] > budget:
                raise BudgetExceeded
            cache[key] = min_bottleneck(model, cls, p, m)
        worst, bounds = cache[key]
        if bounds is None:
            continue
        if m == p:
            got = count(limit, total, worst, most)
            if got >= p:
                return got, bounds
        elif count(limit, total, worst, m) >= m:
            return m, bounds
    return 0, None


def max_micro_batches(
    model: Model, types: tuple[int, ...], limit: float, most: int, ticks: list[int], budget: int, at_least: int = 1
):
    """The most micro-batches one replica of these classes can run within ``limit`` ms, and its bounds.

    Branch and bound over the bounds: ``m(b) = min(cap(b), floor((limit - S(b)) / X(b)) + 1)`` is
    maximised; a node's upper bound uses the partial memory cap and lower bounds on S and X (as in
    ``resihp_lightning.solver.exact._exact_shared``). Only answers of at least ``at_least`` are sought: ``(at_least - 1, None)``
    means there is none. Stops early at ``most``.
    """
    p = len(types)
    speeds = [model.classes[c].speed for c in types]
    suffix_max = [max(speeds[j:]) for j in range(p)]
    suffix_sum = [sum(speeds[j:]) for j in range(p)]
    suffix_speeds = [tuple(speeds[j:]) for j in range(p)]
    pc, big_l, min_l = model.pc, model.L, model.min_layers
    found = [at_least - 1, None]
    bounds = [0] * (p + 1)
    # This order's transfer times, and what stages j.. pay for them in all.
    transfers = [model.stage_p2p(c, j, p) for j, c in enumerate(types)]
    suffix_transfers = [tuple(transfers[j:]) for j in range(p)]
    suffix_p2p = [sum(transfers[j:]) for j in range(p)]
    suffix_inverse = [sum(1.0 / s for s in speeds[j:]) for j in range(p)]

    def least_rest_sum(j: int, a: int) -> float:
        """The least ``sum_i t_i`` of stages j..P-1 holding layers a..L-1: each holds at least
        ``min_layers`` layers of at least the cheapest compute among them, the rest goes to the
        fastest device (a linear programme's optimum, so a valid lower bound)."""
        least = min_l * model.cheapest[a]
        spread = least * (p - j)
        return (pc[big_l] - pc[a] - spread) / suffix_max[j] + least * suffix_inverse[j] + suffix_p2p[j]

    # The least S any bounds give (the X that m micro-batches allow follows from it).
    least_sum = least_rest_sum(0, 0)
    tails: dict[int, list[bool]] = {}

    def completable(m: int) -> list[bool]:
        """``ok[j * (L + 1) + a]``: stages j..P-1 can hold layers a..L-1 with room for m micro-batches
        in flight and every stage within the X that m micro-batches allow (``(limit - least S) / (m - 1)``).

        Both rules only forbid a stage for holding too much, so a node whose end leaves a tail no
        stages can hold is cut at once instead of being found out stages later (binding memory).
        """
        if m in tails:
            return tails[m]
        ticks[0] += p * big_l // 10 + 1
        if ticks[0] > budget:
            raise BudgetExceeded
        slack = limit + 1e-13 * max(1.0, abs(limit)) - least_sum
        x_max = math.inf if m <= 1 else slack / (m - 1) * (1 + 1e-9) + 1e-12
        width = big_l + 1
        ok = [False] * (p * width)
        for j in range(p - 1, -1, -1):
            cls, in_flight = types[j], p - j
            # nxt[b]: the least b' >= b where stages j+1.. can start (None past the end).
            nxt: list[int | None] = [None] * (width + 1)
            if j < p - 1:
                for b in range(big_l, -1, -1):
                    nxt[b] = b if ok[(j + 1) * width + b] else nxt[b + 1]
            for a in range(j * min_l, big_l - (p - j) * min_l + 1):
                b = big_l if j == p - 1 else nxt[a + min_l]
                if b is None or (j < p - 1 and b > big_l - (p - 1 - j) * min_l):
                    continue
                if model.stage_cap(a, b, cls, in_flight) < m or model.stage_time(a, b, cls, j, p) > x_max:
                    continue  # the shortest stage that leaves a completable tail already does not fit
                ok[j * width + a] = True
        tails[m] = ok
        return ok

    def visit(j: int, a: int, total: float, worst: float, cap: int) -> None:
        last = j == p - 1
        first_b = big_l if last else a + min_l
        last_b = big_l if last else big_l - (p - 1 - j) * min_l
        if not last:
            tail = completable(min(found[0] + 1, most))
            row = (j + 1) * (big_l + 1)
        for b in range(first_b, last_b + 1):
            if not last and not tail[row + b]:
                continue
            ticks[0] += 1
            if ticks[0] > budget:
                raise BudgetExceeded
            t = model.stage_time(a, b, types[j], j, p)
            new_cap = min(cap, model.stage_cap(a, b, types[j], p - j))
            if new_cap < 1:
                break  # more layers only need more memory
            new_total, new_worst = total + t, max(worst, t)
            if last:
                m = count(limit, new_total, new_worst, min(new_cap, most))
                if m > found[0]:
                    bounds[p] = b
                    found[0], found[1] = m, tuple(bounds)
                continue
            rest = pc[big_l] - pc[b]
            total_lb = new_total + least_rest_sum(j + 1, b)
            worst_lb = max(new_worst, rest / suffix_sum[j + 1],
                           model.layer_bound(suffix_speeds[j + 1], b, suffix_transfers[j + 1]))
            if count(limit, total_lb, worst_lb, min(new_cap, most)) > found[0]:
                bounds[j + 1] = b
                visit(j + 1, b, new_total, new_worst, new_cap)
                if found[0] >= most:
                    return

    visit(0, 0, 0.0, 0.0, most)
    return found[0], found[1]


#: A composition whose used-device vectors (the product of count + 1 over its classes) exceed this
#: is left to the per-arrangement search (:func:`max_micro_batches` on each arrangement).
MAX_COMPOSITION_STATES = 4_096


def composition_states(composition: tuple[int, ...]) -> int:
    """How many used-device vectors :func:`max_micro_batches_mixed` tracks for ``composition``."""
    return math.prod(n + 1 for n in composition)


class _MixedReplica:
    """One replica of a fixed composition (devices per class), its order and bounds both free.

    :meth:`least_sum` is a dynamic programme over (stage, end layer, devices of each class used so
    far): the least stage-time sum S over every order of the composition's devices and every bounds
    vector whose stages each fit ``m`` micro-batches in memory and take at most ``x`` ms. With few
    devices outside the largest class (what re-planning sees) the used vectors are few, so all
    arrangements are priced in one pass instead of one branch and bound each.
    """

    def __init__(self, model: Model, composition: tuple[int, ...], p: int) -> None:
        self.model, self.composition, self.p = model, composition, p
        pc = np.asarray(model.pc, dtype=float)
        ps = np.asarray(model.ps, dtype=float)
        pa = np.asarray(model.pa, dtype=float)
        self.span = pc[None, :] - pc[:, None]
        self.static = ps[None, :] - ps[:, None]
        self.act = pa[None, :] - pa[:, None]
        index = np.arange(model.L + 1)
        self.long_enough = (index[None, :] - index[:, None]) >= model.min_layers
        self.classes = [c for c, n in enumerate(composition) if n]
        self._times: dict[int, np.ndarray] = {}
        self._fits: dict[tuple[int, int], np.ndarray] = {}

    def _stage_times(self, cls: int) -> np.ndarray:
        """Compute of every span at the class's speed (transfers added per position)."""
        if cls not in self._times:
            self._times[cls] = self.span / self.model.classes[cls].speed
        return self._times[cls]

    def _fitting(self, cls: int, in_flight: int) -> np.ndarray:
        """Where a stage on ``cls`` holds ``in_flight`` micro-batches' activations in memory.

        ``static + in_flight * act <= capacity`` (with the model's tolerance): everything that
        :meth:`Model.stage_cap <.exact_model.Model.stage_cap>` accepts, so the programme never cuts
        a plan the model allows; a witness is re-priced by the model before it is believed.
        """
        key = (cls, in_flight)
        if key not in self._fits:
            capacity = self.model.classes[cls].memory_mb * (1 + EPS) + EPS
            self._fits[key] = self.long_enough & (self.static + in_flight * self.act <= capacity)
        return self._fits[key]

    def least_sum(self, m: int, x: float) -> tuple[float, tuple[int, ...] | None, tuple[int, ...] | None]:
        """(least S, its class order, its bounds) with every stage within ``x`` ms and fitting m in flight."""
        model, p, big_l = self.model, self.p, self.model.L
        comp = self.composition
        threshold = x * (1 + 1e-12) + 1e-12  # generous: the witness is checked by the caller
        start = tuple(0 for _ in comp)
        first = np.full(big_l + 1, np.inf)
        first[0] = 0.0
        layer: dict[tuple[int, ...], np.ndarray] = {start: first}
        history: list[dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, list]]] = []
        columns = np.arange(big_l + 1)
        costs: dict[tuple[int, float, int], np.ndarray] = {}  # (class, transfer, in flight) -> stage times, inf where not allowed
        for j in range(p):
            merged: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray, list]] = {}
            in_flight = min(p - j, m)
            for used, values in layer.items():
                rows = np.nonzero(np.isfinite(values))[0]
                if rows.size == 0:
                    continue
                for cls in self.classes:
                    if used[cls] >= comp[cls]:
                        continue
                    key = (cls, model.stage_p2p(cls, j, p), in_flight)
                    if key not in costs:
                        times = self._stage_times(cls) + key[1]
                        costs[key] = np.where(self._fitting(cls, in_flight) & (times <= threshold), times, np.inf)
                    cand = values[rows][:, None] + costs[key][rows]
                    arg = cand.argmin(axis=0)
                    best = cand[arg, columns]
                    nxt = used[:cls] + (used[cls] + 1,) + used[cls + 1:]
                    source = len(merged[nxt][3]) if nxt in merged else 0
                    if nxt not in merged:
                        merged[nxt] = (best, rows[arg], np.zeros(big_l + 1, dtype=np.int64), [(used, cls)])
                    else:
                        old_best, old_from, old_src, sources = merged[nxt]
                        better = best < old_best
                        sources.append((used, cls))
                        merged[nxt] = (np.where(better, best, old_best), np.where(better, rows[arg], old_from),
                                       np.where(better, source, old_src), sources)
            layer = {used: entry[0] for used, entry in merged.items()}
            history.append({used: (entry[1], entry[2], entry[3]) for used, entry in merged.items()})
            if not layer:
                return math.inf, None, None
        values = layer.get(comp)
        if values is None or not np.isfinite(values[big_l]):
            return math.inf, None, None
        order, bounds = [], [big_l]
        used, at = comp, big_l
        for j in range(p - 1, -1, -1):
            came_from, source, sources = history[j][used]
            previous, cls = sources[int(source[at])]
            order.append(cls)
            at = int(came_from[at])
            bounds.append(at)
            used = previous
        return float(values[big_l]), tuple(reversed(order)), tuple(reversed(bounds))


def max_micro_batches_mixed(
    model: Model, composition: tuple[int, ...], limit: float, most: int, ticks: list[int], budget: int,
    at_least: int = 1, ceiling: int | None = None,
) -> tuple[int, tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """The most micro-batches one replica of ``composition`` runs within ``limit`` ms: its best order and bounds.

    Exact, like :func:`max_micro_batches` over every arrangement of the composition, but by one
    dynamic programme over all arrangements (``_MixedReplica``). For a target m the question
    "is there an order and bounds with ``S + (m - 1) X <= limit`` and memory for m in flight?" is
    answered by a fixed point: every such plan has ``X <= x = (limit - S_least) / (m - 1)``, so
    ``S >= least_sum(m, x)``, which lowers x again; when S stops rising the plan found at x is a
    witness (``S + (m - 1) X <= limit``), and when no bounds are left there is none. Answers are
    monotone in m (fewer micro-batches need less memory and time), so the most m is found by
    bisection between ``at_least`` and ``ceiling`` (default ``most``).

    Returns:
        ``(m, (order, bounds))``, or ``(at_least - 1, None)`` when not even ``at_least`` fits.

    Raises:
        BudgetExceeded: past ``budget`` work units (``ticks[0]`` counts them).
        WitnessRejected: the model prices a witness above the limit (rounding at the limit); the
            caller falls back to :func:`max_micro_batches` per arrangement.
    """
    p = sum(composition)
    top = min(most, ceiling if ceiling is not None else most)
    if top < at_least:
        return at_least - 1, None
    replica = _MixedReplica(model, composition, p)
    types = [c for c, n in enumerate(composition) for _ in range(n)]
    least = model.pc[-1] / max(model.classes[c].speed for c in types) + model.min_p2p_sum(types, p)
    tol = 1e-13 * max(1.0, abs(limit))
    units = 1 + p * max(1, len(replica.classes)) * composition_states(composition) * (model.L + 1) ** 2 // 20_000

    def decide(m: int):
        s = least
        while True:
            ticks[0] += units
            if ticks[0] > budget:
                raise BudgetExceeded
            x = limit + tol if m <= 1 else (limit + tol - s) / (m - 1)
            if x <= 0:
                return None
            found, order, bounds = replica.least_sum(m, x)
            if order is None or found > limit + tol:
                return None
            if m <= 1 or found <= s * (1 + 1e-12):
                total, worst, cap = model.profile(order, bounds)
                if count(limit, total, worst, min(cap, most)) < m:
                    raise WitnessRejected
                return order, bounds
            s = found

    witness = decide(top)
    if witness is not None:
        return top, witness
    witness = decide(at_least)
    if witness is None:
        return at_least - 1, None
    lo, hi = at_least, top - 1  # lo fits, top does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        found = decide(mid)
        if found is None:
            hi = mid - 1
        else:
            lo, witness = mid, found
    return lo, witness


class WitnessRejected(Exception):
    """The mixed-replica programme's plan is priced differently by the model (rounding at the limit)."""
