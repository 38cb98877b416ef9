"""The shape lower bound on the iteration time, shared by every backend.

Both the exact planner (to order and prune shapes) and the MILP (to order and prune pipeline
degrees, and as a cut on T) use :func:`shape_lower_bound`. It depends only on
:mod:`resihp_lightning.plan`, so any solver module can import it without cycles.
"""

from __future__ import annotations

from resihp_lightning.plan import Problem, prefix_sums


def shape_lower_bound(problem: Problem, pipeline_degree: int, data_degree: int, *, with_allreduce: bool = True) -> float:
    """A proven lower bound on T over every plan of shape (P, D).

    With C the total compute, s_max the fastest speed and S the total speed of the P*D fastest
    devices, every replica r satisfies ``T_r >= m_r tmax_r`` and
    ``T_r >= sum_j t_rj + (m_r - 1) tmax_r`` with ``tmax_r >= C / S_r`` and
    ``sum_j t_rj >= C / s_max + (P - 1) p2p``; summed over the replicas this gives::

        T >= max(M C / S, C / s_max + (P - 1) p2p + (M - D) C / S) + (allreduce_ms * u_D if D > 1)

    Slow links only add to stage times (every transfer factor ``u >= 1``), so the body holds with
    them. The all-reduce costs ``allreduce_ms * max u`` over the devices used: ``u_D`` is the least
    that maximum can be, the (P*D)-th smallest link slowdown with ``allow_exclude`` and the largest
    without it (1.0 when every link is healthy).

    Args:
        problem: the planning problem.
        pipeline_degree: P.
        data_degree: D.
        with_allreduce: add the all-reduce term (False gives the pipeline part alone, which the
            MILP uses for a cut whose all-reduce term is a variable).

    Returns:
        The bound in ms.
    """
    p, d = pipeline_degree, data_degree
    compute, speeds, slowdowns = _fleet(problem)
    top = sum(speeds[: p * d])
    m = problem.micro_batches
    work = m * compute / top
    bubble = compute / speeds[0] + (p - 1) * problem.p2p_ms + (m - d) * compute / top
    body = max(work, bubble)
    if not with_allreduce:
        return body
    if d <= 1:
        return body + 0.0
    least = slowdowns[min(p * d, len(slowdowns)) - 1] if problem.allow_exclude else slowdowns[-1]
    return body + problem.allreduce_ms * least


#: The last few problems' (layers, devices, total compute, speeds descending, link slowdowns
#: ascending): the searches ask for thousands of shape bounds of one problem.
_FLEETS: list[tuple] = []


def _fleet(problem: Problem) -> tuple[float, list[float], list[float]]:
    for layers, devices, *found in _FLEETS:
        if layers is problem.layers and devices is problem.devices:
            return tuple(found)
    compute = prefix_sums(problem).compute[-1]
    speeds = sorted((device.speed for device in problem.devices), reverse=True)
    slowdowns = sorted(device.link_slowdown for device in problem.devices)
    _FLEETS.insert(0, (problem.layers, problem.devices, compute, speeds, slowdowns))
    del _FLEETS[4:]
    return compute, speeds, slowdowns
