"""Which processes share the optimizer state of each shard under the layer-wise ZeRO-1 (pure arithmetic).

The layer-wise ZeRO-1 slices a parameter's Adam moments over the processes that hold *the same values*
of it and reduce its gradient together (:mod:`~resihp_lightning.state.zero_layout`):

* without tensor parallelism, a layer's holders: one process per replica, in replica order
  (:func:`~resihp_lightning.placement.layer_holders`);
* under tensor parallelism a plan names groups, and member ``j`` of a group of degree ``k`` holds its
  own shard of the layer (the range ``[j/k, (j+1)/k)`` of each split tensor): a parameter of its own. Its
  moments are shared by the members ``j`` of the layer's holder groups *of the same degree* ``k``, in
  replica order. With groups of one degree (the job's slices) that is member ``j`` of every holder group;
  groups of different degrees (a group that lost or dropped members) share per degree, e.g. a layer held
  by groups ``(0, 1)``, ``(2,)`` and ``(4, 5)`` has the sets ``(0, 4)`` and ``(1, 5)`` (degree 2) and ``(2,)``
  (degree 1, nothing to share).

A set is identified by its :attr:`ShardHolders.key` ``(layer, degree, member)``, the same on each of its
processes (a process holds one shard of a layer, so it is in one set per layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from resihp_lightning.placement import layer_holders
from resihp_lightning.plan import Plan

#: ``(layer, degree, member)``: which shard of which layer a set of processes holds.
ShardKey = tuple[int, int, int]


@dataclass(frozen=True)
class ShardHolders:
    """The processes that hold one shard of one layer (and share its optimizer state).

    Attributes:
        key: ``(layer, degree, member)``; ``(layer, 1, 0)`` without tensor parallelism.
        holders: the processes, in replica order (holder ``i`` of the slice layout is ``holders[i]``).
    """

    key: ShardKey
    holders: tuple[int, ...]


def shard_holders(plan: Plan, groups: Sequence[Sequence[int]] | None = None) -> dict[int, dict[int, ShardHolders]]:
    """Process -> layer -> the set sharing its shard of that layer, for every process ``plan`` uses.

    Args:
        plan: the plan (over device ids without tensor parallelism, over group ids with it).
        groups: with tensor parallelism, the members of each group (group ``g``'s processes in member
            order, as :attr:`TensorGroups.members <resihp_lightning.tensor.tensor_groups.TensorGroups.members>`);
            ``None``: none (plan devices are the processes).
    """
    out: dict[int, dict[int, ShardHolders]] = {}
    for layer, devices in enumerate(layer_holders(plan)):
        if groups is None:
            units = [ShardHolders((layer, 1, 0), tuple(devices))]
        else:
            units = []
            for degree in sorted({len(groups[g]) for g in devices}):
                same = [g for g in devices if len(groups[g]) == degree]
                units += [ShardHolders((layer, degree, j), tuple(groups[g][j] for g in same)) for j in range(degree)]
        for unit in units:
            for process in unit.holders:
                out.setdefault(process, {})[layer] = unit
    return out
