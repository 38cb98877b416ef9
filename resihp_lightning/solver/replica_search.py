"""One replica's stage bounds on its own: the least bottleneck and the most micro-batches within a limit.

The per-replica searches of :mod:`resihp_lightning.solver.exact` and the decomposition by shape
(:mod:`resihp_lightning.solver.decomposition`) both price one replica kind at a time with these; both
count their work in the same units and stop with :class:`BudgetExceeded` past their budget.
"""

from __future__ import annotations

import math

import numpy as np

from resihp_lightning.solver.bottleneck import min_max_partition
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
    """
    big_l, min_l = model.L, model.min_layers
    fits = np.zeros((big_l + 1, big_l + 1), dtype=bool)
    lo_b = big_l if j == p - 1 else (j + 1) * min_l
    hi_b = big_l - (p - 1 - j) * min_l
    for b in range(lo_b, hi_b + 1):
        for a in range(b - min_l, j * min_l - 1, -1):
            if model.stage_cap(a, b, cls, p - j) < m:
                break  # longer stages (smaller a) need more memory still
            fits[a, b] = True
    return fits


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
            total_lb = new_total + rest / suffix_max[j + 1] + p2p * (p - 2 - j)
            worst_lb = max(new_worst, rest / suffix_sum[j + 1], model.layer_bound(suffix_speeds[j + 1], b))
            if count(limit, total_lb, worst_lb, min(new_cap, most)) > found[0]:
                bounds[j + 1] = b
                visit(j + 1, b, new_total, new_worst, new_cap)
                if found[0] >= most:
                    return

    visit(0, 0, 0.0, 0.0, most)
    return found[0], found[1]
