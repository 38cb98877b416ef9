"""The controller's planning problem under tensor parallelism: GPUs that the planner groups (no torch).

With ``ResiHPStrategy(tensor_degree=t)`` the controller plans over GPUs (processes), not over fixed
groups: the planner (:func:`~resihp_lightning.solver.tensor_search.solve_tensor`) chooses which
processes form each tensor-parallel group and its degree, jointly with the stages, so that a slow
member can be dropped from its group (TP-drop), its group's layers moved, or both, and taken back when
it heals. This module turns what the job measured into that :class:`~resihp_lightning.tensor_plan.TensorProblem`:

* **TP domains.** A group forms among the processes the job started as one group (process ids
  ``[d t, (d + 1) t)``, where the fast links are), named by their ranks now.
* **Speeds per process** (:func:`process_speeds`). A group of one is a device of its own: the
  per-device detector's speed. In a larger group with a member named slow (the detector's
  ``member_speeds``), that member runs at its own speed and the others at 1.0 (the group's slowness is
  the member's). Otherwise every member runs at its group's speed.
* **One-GPU layer costs** (:func:`one_gpu_costs`). The healthy profile was measured on groups of
  degree k: a layer's time there is ``c (1/k + f_k)`` for its one-GPU compute c, and the members'
  own-compute share of their busy time, ``rho = (c / k) / (c / k + c f_k)``, gives both
  ``c = k rho g`` and ``f_k = (1 - rho) / (k rho)``. A shard holds 1/k of the layer's memory.
* **Other degrees** (:func:`tensor_cost`). A TP all-reduce moves the same activations whatever the
  degree; a ring all-reduce sends ``2 (k - 1) / k`` of them per member, so
  ``f_j = f_k ((j - 1) / j) / ((k - 1) / k)`` (0 for one GPU).

A plan over groups names a group by its first member's rank (:mod:`resihp_lightning.tensor_plan`);
the strategy names them by their index among the groups sorted by first member
(:func:`strategy_plan`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from resihp_lightning.callbacks.replan.replan_policy import price_plan_in_force
from resihp_lightning.plan import Plan, Problem, Replica
from resihp_lightning.tensor_plan import TensorCost, TensorGroup, TensorPlan, TensorProblem
from resihp_lightning.telemetry import LayerCost


def domains(process_ids: Mapping[int, int], degree: int) -> tuple[tuple[int, ...], ...]:
    """The job's TP domains as current ranks: processes ``[d t, (d + 1) t)`` form domain d (dead ones absent).

    Args:
        process_ids: current rank -> process id (its rank at the start).
        degree: the job's ``tensor_degree`` option t.
    """
    by_domain: dict[int, list[int]] = {}
    for rank, process in process_ids.items():
        by_domain.setdefault(process // degree, []).append(rank)
    return tuple(tuple(sorted(ranks)) for _, ranks in sorted(by_domain.items()))


def process_speeds(
    groups: Mapping[int, Sequence[int]],
    process_ids: Mapping[int, int],
    device_speeds: Mapping[int, float],
    member_speeds: Mapping[int, float],
) -> dict[int, float]:
    """Each current rank's speed (module docstring).

    Args:
        groups: device id -> its members' current ranks.
        process_ids: current rank -> process id.
        device_speeds: the per-device detector's speeds (missing: 1.0).
        member_speeds: process id -> speed of each member named slow.
    """
    speeds: dict[int, float] = {}
    for device, ranks in groups.items():
        named = [r for r in ranks if process_ids[r] in member_speeds]
        for rank in ranks:
            if len(ranks) == 1:
                speeds[rank] = device_speeds.get(device, 1.0)
            elif named:
                speeds[rank] = member_speeds.get(process_ids[rank], 1.0)
            else:
                speeds[rank] = device_speeds.get(device, 1.0)
    return speeds


def own_share(samples: Sequence[tuple[float, float]]) -> float | None:
    """rho, the median own-compute share ``own / (own + wait)`` of members of groups of two or more.

    Args:
        samples: ``(own_ms, wait_ms)`` of such members in a healthy step.
    """
    shares = sorted(own / (own + wait) for own, wait in samples if own > 0 and own + wait > 0)
    if not shares:
        return None
    middle = len(shares) // 2
    return shares[middle] if len(shares) % 2 else (shares[middle - 1] + shares[middle]) / 2


def one_gpu_costs(
    profile: Sequence[LayerCost], degree: int, share: float | None, fraction: float | None = None
) -> tuple[list[LayerCost], float]:
    """The layers' costs on one healthy GPU, from a profile measured on groups of ``degree``, and f_degree.

    Args:
        profile: per-layer costs measured on groups of ``degree`` (``strategy.layer_profile()``).
        degree: k, the degree of the groups that measured it.
        share: rho (:func:`own_share`); ``None`` or ``degree`` 1: the all-reduces are taken as free.
        fraction: f_degree when it is known (configured) rather than measured: then ``share`` is not used.
    """
    if fraction is None:
        share = 1.0 if degree == 1 or share is None else min(max(share, 1e-3), 1.0)
        fraction = (1.0 - share) / (degree * share)
    if degree == 1:
        fraction = 0.0
    per_gpu = 1.0 / (1.0 / degree + fraction)  # one-GPU compute per ms of the group's layer time
    layers = [LayerCost(c.index, c.compute_ms * per_gpu, c.static_mb * degree, c.activation_mb * degree)
              for c in profile]
    return layers, fraction


def tensor_cost(degrees: Sequence[int], degree: int, fraction: float) -> TensorCost:
    """The allowed degrees with each one's all-reduce fraction, scaled from ``fraction`` = f_degree (module docstring)."""
    ring = {k: (k - 1) / k for k in degrees}
    unit = fraction / ring[degree] if degree > 1 and ring.get(degree) else 0.0
    return TensorCost(tuple(degrees), {k: unit * ring[k] for k in degrees if k > 1})


def tensor_problem(base: Problem, process_domains: Sequence[Sequence[int]], cost: TensorCost) -> TensorProblem:
    """The TP problem over ``base``'s devices (the processes, costed per GPU): no GPU may idle, since the
    strategy runs no spares under tensor parallelism."""
    return TensorProblem(dataclasses.replace(base, allow_exclude=False), tuple(map(tuple, process_domains)), cost)


def groups_in_force(groups: Mapping[int, Sequence[int]]) -> tuple[TensorGroup, ...]:
    """The groups in force as :class:`~resihp_lightning.tensor_plan.TensorGroup` (members as ranks), by device id."""
    return tuple(TensorGroup(tuple(sorted(groups[d]))) for d in sorted(groups))


def price_in_force(problem: TensorProblem, groups: Mapping[int, Sequence[int]], plan: Plan) -> tuple[float, str | None]:
    """The plan in force (over device ids = group indices) priced on ``problem``, and the rule it breaks (or None)."""
    tensor_groups = groups_in_force(groups)
    by_id = tensor_plan_of(plan, tensor_groups)
    return price_plan_in_force(problem.group_problem(tensor_groups), by_id)


def tensor_plan_of(plan: Plan, groups: Sequence[TensorGroup]) -> Plan:
    """A plan over group indices (the strategy's) renamed to first-member ids (the planner's)."""
    return _renamed(plan, {index: group.id for index, group in enumerate(groups)})


def strategy_plan(tensor_plan: TensorPlan) -> tuple[Plan, list[list[int]]]:
    """A planner's TP plan in the strategy's terms: the plan over group indices and the groups (ranks, sorted
    by first member) for ``request_plan(plan, tensor_groups=...)``."""
    groups = sorted(tensor_plan.groups, key=lambda g: g.members)
    index = {group.id: i for i, group in enumerate(groups)}
    return _renamed(tensor_plan.plan, index), [list(g.members) for g in groups]


def regroup_moved_mb(
    old_groups: Mapping[int, Sequence[int]], new_groups: Sequence[Sequence[int]], new_plan: Plan, static_mb: Sequence[float]
) -> float:
    """An upper bound on the state a switch moves: every layer held by a group that is not a group in force
    travels whole once per replica (a re-split sends each new member what it lacks, at most the layer)."""
    old = {tuple(sorted(g)) for g in old_groups.values()}
    changed = {i for i, g in enumerate(new_groups) if tuple(sorted(g)) not in old}
    moved = 0.0
    for replica in new_plan.replicas:
        for stage, device in enumerate(replica.devices):
            if device in changed:
                moved += sum(static_mb[layer] for layer in replica.stage_layers(stage))
    return moved


def _renamed(plan: Plan, names: Mapping[int, int]) -> Plan:
    replicas = tuple(Replica(tuple(names[d] for d in r.devices), r.bounds, r.micro_batches) for r in plan.replicas)
    return dataclasses.replace(plan, replicas=replicas)
