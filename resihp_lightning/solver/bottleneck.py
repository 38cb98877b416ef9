"""The bottleneck partition: contiguous stages whose slowest stage is as fast as possible.

:func:`min_max_partition` is the one exact dynamic programme for it. Its callers only say what a
stage costs and where it may end:

* :func:`resihp_lightning.solver.milp_model.bottleneck`: integer time units of the MILP, memory in
  MB for ``min(P - j, k)`` micro-batches in flight (the tables of pure groups and the cuts);
* :func:`resihp_lightning.solver.replica_search.min_bottleneck`: ms on one device class, memory through
  :meth:`~resihp_lightning.solver.exact_model.Model.stage_cap` (per-replica exact phase).

:func:`resihp_lightning.solver.heuristic.bottleneck_bounds` is not built on it; its docstring says why.
numpy is imported inside the function, so that importing the exact planner stays light.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

#: Cost of a forbidden stage in integer tables (above any real time, far from int64 overflow).
INT_BLOCKED = 2**60


def min_max_partition(
    stage_costs: Sequence[np.ndarray],
    allowed: Sequence[np.ndarray],
    *,
    latest_start_on_ties: bool = False,
) -> tuple[int | float, tuple[int, ...]] | None:
    """Bounds ``0 = b_0 < ... < b_P = L`` minimising ``max_j stage_costs[j][b_j, b_{j+1}]``.

    Dynamic programme over (stage, end layer), O(P L^2) with numpy:
    ``best[j + 1][b] = min_a max(best[j][a], cost_j[a, b])`` over the allowed ``(a, b)``.

    Args:
        stage_costs: one ``(L + 1) x (L + 1)`` numpy array per stage; entry ``[a, b]`` is the
            time of that stage holding layers ``a..b-1``. All integer (exact units) or all float.
        allowed: one boolean array of the same shape per stage: where the stage may hold
            ``a..b-1`` (at least the minimum layers, memory fits). Entries with ``a >= b`` must
            be False.
        latest_start_on_ties: among starts ``a`` of equal value, take the largest (stages end
            as late as possible at the front); by default the smallest.

    Returns:
        ``(value, bounds)`` with ``value`` a Python int or float like the costs, or ``None``
        when no partition is allowed.
    """
    import numpy as np

    p = len(stage_costs)
    size = stage_costs[0].shape[0]
    last = size - 1
    idx = np.arange(size)
    dtype = np.result_type(*stage_costs)
    blocked = np.inf if np.issubdtype(dtype, np.floating) else INT_BLOCKED
    best = np.full(size, blocked, dtype=dtype)
    best[0] = 0
    came_from = []
    for j in range(p):
        cost = np.where(allowed[j], stage_costs[j], blocked)
        cand = np.maximum(best[:, None], cost)  # cand[a, b]: the partition's max if stage j is [a, b)
        if latest_start_on_ties:
            arg = last - cand[::-1].argmin(axis=0)
        else:
            arg = cand.argmin(axis=0)
        best = cand[arg, idx]
        came_from.append(arg)
    if best[last] >= blocked:
        return None
    bounds = [last]
    for j in range(p - 1, -1, -1):
        bounds.append(int(came_from[j][bounds[-1]]))
    return best[last].item(), tuple(reversed(bounds))
