"""The shape lower bound on the iteration time, shared by every backend.

Both the exact planner (to order and prune shapes) and the MILP (to order and prune pipeline
degrees, and as a cut on T) use :func:`shape_lower_bound`. It depends only on
:mod:`resihp_lightning.plan`, so any solver module can import it without cycles.
:class:`Fleet` and :func:`fleet_bound` give the same bound for any list of device speeds and link
slowdowns (the tensor-parallel search prices many fleets over one problem's layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from resihp_lightning.plan import Problem, prefix_sums


def shape_lower_bound(problem: Problem, pipeline_degree: int, data_degree: int, *, with_allreduce: bool = True) -> float:
    """A proven lower bound on T over every plan of shape (P, D).

    With C the total compute, s_max the fastest speed and S the total speed of the P*D fastest
    devices, every replica r satisfies ``T_r >= m_r tmax_r`` and
    ``T_r >= sum_j t_rj + (m_r - 1) tmax_r`` with ``tmax_r >= C / S_r`` and
    ``sum_j t_rj >= C / s_max + (P - 1) p2p``; summed over the replicas this gives::

        T >= max(M C / S, C / s_max + (P - 1) p2p + (M - D) C / S) + (allreduce_ms * u_D if D > 1)

    Whole layers add a third term: some replica runs at least ceil(M / D) micro-batches, and its
    slowest stage takes at least ``x_P = max_i c_(i) / t_i``, where c_(i) is the i-th cheapest
    layer (each of the i lightest stages holds a layer of its own, so the i-th lightest holds one of
    at least c_(i)) and t_i the i-th slowest of the P fastest speeds (the lightest stages sit best
    on the slowest devices); with ``min_layers_per_stage`` = k the i lightest stages hold at least
    i k layers, so the i-th holds at least the (i k)-th cheapest and at least their average. So
    ``T >= C / s_max + (P - 1) p2p + (ceil(M / D) - 1) x_P``. This is what a deep pipeline that
    must use slow devices, or stages of one heavy layer, pays.

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
    return fleet_bound(problem, _fleet(problem), pipeline_degree, data_degree, with_allreduce=with_allreduce)


@dataclass
class Fleet:
    """What :func:`fleet_bound` needs of a problem's devices and layers.

    Attributes:
        compute: C, the layers' total compute at speed 1.0.
        speeds: the devices' speeds, fastest first.
        slowdowns: the devices' link slowdowns u, ascending.
        layers: the layers' compute, cheapest first, and their prefix sums (``cheap_sums[i]`` is the
            sum of the i cheapest).
    """

    compute: float
    speeds: Sequence[float]
    slowdowns: Sequence[float]
    layers: Sequence[float]
    cheap_sums: Sequence[float]
    _stage: dict[int, float] = field(default_factory=dict)

    @classmethod
    def of(cls, problem: Problem, speeds: Sequence[float], slowdowns: Sequence[float]) -> Fleet:
        """The fleet of these device speeds and link slowdowns over ``problem``'s layers."""
        layers = sorted(layer.compute_ms for layer in problem.layers)
        sums = [0.0]
        for c in layers:
            sums.append(sums[-1] + c)
        return cls(prefix_sums(problem).compute[-1], sorted(speeds, reverse=True), sorted(slowdowns), layers, sums)

    def least_slowest(self, p: int, min_layers: int) -> float:
        """``x_P``: a lower bound on the slowest stage of any P-stage replica from whole layers (shape_lower_bound)."""
        found = self._stage.get(p)
        if found is None:
            found = 0.0
            top = self.speeds[:p]
            for i in range(1, min(p, len(self.layers) // min_layers) + 1):
                lightest = max(self.layers[i * min_layers - 1], self.cheap_sums[i * min_layers] / i)
                found = max(found, lightest / top[p - i])
            self._stage[p] = found
        return found


def fleet_bound(problem: Problem, fleet: Fleet, pipeline_degree: int, data_degree: int, *,
                with_allreduce: bool = True) -> float:
    """:func:`shape_lower_bound` over ``fleet``'s devices (``problem`` gives M, p2p, the all-reduce and the rules)."""
    p, d = pipeline_degree, data_degree
    compute, speeds, slowdowns = fleet.compute, fleet.speeds, fleet.slowdowns
    top = sum(speeds[: p * d])
    m = problem.micro_batches
    work = m * compute / top
    fill = compute / speeds[0] + (p - 1) * problem.p2p_ms
    bubble = fill + (m - d) * compute / top
    layered = fill + (-(-m // d) - 1) * fleet.least_slowest(p, problem.min_layers_per_stage)
    body = max(work, bubble, layered)
    if not with_allreduce:
        return body
    if d <= 1:
        return body + 0.0
    least = slowdowns[min(p * d, len(slowdowns)) - 1] if problem.allow_exclude else slowdowns[-1]
    return body + problem.allreduce_ms * least


#: The last few problems' (layers, devices, fleet): the searches ask for thousands of shape bounds
#: of one problem.
_FLEETS: list[tuple] = []


def _fleet(problem: Problem) -> Fleet:
    for layers, devices, found in _FLEETS:
        if layers is problem.layers and devices is problem.devices:
            return found
    found = Fleet.of(problem, [d.speed for d in problem.devices], [d.link_slowdown for d in problem.devices])
    _FLEETS.insert(0, (problem.layers, problem.devices, found))
    del _FLEETS[4:]
    return found


__all__ = ["Fleet", "fleet_bound", "shape_lower_bound"]
