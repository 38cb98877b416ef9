"""The tensor-parallel groups of a job: which processes split each planning device's layers.

A plan names *groups*: to the planner, the placement and the pipeline a group is one device, whose
layers are split over its members (:mod:`resihp_lightning.models.tensor_parallel`). At the start of a
job with ``tensor_degree`` t, consecutive ranks form the groups (on GPUs: one machine's NVLink domain),
group ``g`` being ranks ``g*t .. g*t + t - 1`` (:meth:`TensorGroups.consecutive`). A re-plan may form
other groups of another degree (:mod:`resihp_lightning.tensor.resplit` re-cuts the layers); ranks in no
group are spares.

Member ``i`` of every group forms *slice* ``i``: a pipeline x data-parallel job of its own over the
shards ``i`` of the layers, wired exactly as a job without tensor parallelism is; the slices meet only
inside the layers, in the groups' all-reduces. Groups of different degrees (a group that lost or dropped
a member goes on smaller) form no slices: :mod:`resihp_lightning.runtime.tensor_grid` runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from resihp_lightning.errors import ConfigError
from resihp_lightning.placement import relabel
from resihp_lightning.plan import Plan
from resihp_lightning.torch_utils.collectives import release_process_groups


@dataclass(frozen=True)
class TensorGroups:
    """The tensor-parallel layout of a job: its groups, each the ranks of its members in member order.

    Attributes:
        members: ``members[g]`` = the ranks of group ``g`` (the planning device ``g``). Members are
            numbered in ascending rank order, as ``torch.distributed`` numbers a process group's members
            (the given order is sorted). Groups may differ in degree; a rank is in one group at most.
    """

    members: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for group in self.members:
            for rank in group:
                if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                    raise ConfigError(f"tensor-parallel group members must be ranks (integers >= 0), got {rank!r}")
                if rank in seen:
                    raise ConfigError(f"rank {rank} is in two tensor-parallel groups: {self.members!r}")
                seen.add(rank)
        members = tuple(tuple(sorted(group)) for group in self.members)
        object.__setattr__(self, "members", members)
        if not members or not members[0]:
            raise ConfigError(f"tensor-parallel groups must name at least one group of one rank, got {members!r}")

    @classmethod
    def consecutive(cls, degree: int, world_size: int) -> TensorGroups:
        """Groups of ``degree`` consecutive ranks over a world of ``world_size`` (the job's start).

        Raises:
            ConfigError: ``degree`` does not divide ``world_size`` (named as the ``tensor_degree`` option).
        """
        if not isinstance(degree, int) or degree < 1 or world_size % degree:
            raise ConfigError(
                f"invalid value {degree!r} for option `tensor_degree`; allowed: a divisor of the world size {world_size}"
            )
        return cls(tuple(tuple(range(g * degree, (g + 1) * degree)) for g in range(world_size // degree)))

    @property
    def degrees(self) -> tuple[int, ...]:
        """Members of each group, by group id."""
        return tuple(len(group) for group in self.members)

    @property
    def uniform(self) -> bool:
        """Whether every group has the same degree (the job is then ``degree`` slices)."""
        return len(set(self.degrees)) == 1

    @property
    def degree(self) -> int:
        """Members per group (the largest, when the groups differ)."""
        return max(self.degrees)

    @property
    def groups(self) -> int:
        """How many groups (planning devices) the job has."""
        return len(self.members)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank in some group, in group then member order."""
        return tuple(rank for group in self.members for rank in group)

    def group_of(self, rank: int) -> int | None:
        """The group (the planning device id) of ``rank``; ``None`` for a rank in no group (a spare)."""
        for g, group in enumerate(self.members):
            if rank in group:
                return g
        return None

    def member_of(self, rank: int) -> int | None:
        """``rank``'s index in its group (which shard of its group's layers it holds); ``None`` for a spare."""
        g = self.group_of(rank)
        return None if g is None else self.members[g].index(rank)

    def rank(self, group: int, member: int) -> int:
        """The rank of member ``member`` of group ``group``."""
        return self.members[group][member]

    def ranks_of(self, group: int) -> list[int]:
        """The ranks of ``group``, in member order."""
        return list(self.members[group])

    def slice_ranks(self, member: int) -> dict[int, int]:
        """Group id -> rank of its member ``member``: slice ``member``'s ranks (slice 0, the members 0,
        exists whatever the degrees)."""
        if any(member >= len(group) for group in self.members):
            raise ValueError(f"slice {member} needs groups of more than {member} members; the degrees are {self.degrees}")
        return {g: group[member] for g, group in enumerate(self.members)}

    def slice_plans(self, plan: Plan) -> list[Plan]:
        """``plan`` (over groups) in the ranks of each slice, in member order (groups of one degree)."""
        if not self.uniform:
            raise ValueError(f"groups of degrees {self.degrees} do not form slices")
        return [relabel(plan, self.slice_ranks(member)) for member in range(self.degree)]

    def relabelled(self, ranks: Sequence[int] | dict[int, int]) -> TensorGroups:
        """The same groups with every rank ``r`` replaced by ``ranks[r]`` (e.g. into a new process group)."""
        return TensorGroups(tuple(tuple(ranks[r] for r in group) for group in self.members))

    def new_process_groups(self) -> list[Any]:
        """Creates every group's process group (collective: every rank of the default group creates all of
        them, in order).

        Returns:
            the process group of each group, by group id (``GroupMember.NON_GROUP_MEMBER`` for groups
            this rank is not in).
        """
        return [dist.new_group(ranks=list(group)) for group in self.members]


@dataclass(frozen=True)
class TensorParallelism:
    """How this process takes part in tensor parallelism (a runtime's; ``None`` there: none).

    Attributes:
        groups: the job's tensor-parallel layout.
        member: this process's index in its group (the shard of every layer it holds).
        group: its group's process group.
        split_layer: ``split_layer(index, layer, group)`` -> this member's split of ``layer``, a private copy
            of the unsplit layer (the module's ``pipeline_split_layer``).
        process_groups: every group's process group, by group id (``None``: not kept).
    """

    groups: TensorGroups
    member: int
    group: Any
    split_layer: Any
    process_groups: tuple[Any, ...] | None = None


def tensor_parallelism(groups: TensorGroups, rank: int, split_layer: Any) -> TensorParallelism | None:
    """Creates ``groups``' process groups (collective over the default group) and returns ``rank``'s part
    (``None`` for a rank in no group: a spare)."""
    made = tuple(groups.new_process_groups())
    g = groups.group_of(rank)
    if g is None:
        return None
    return TensorParallelism(groups=groups, member=groups.member_of(rank), group=made[g], split_layer=split_layer,
                             process_groups=made)


def destroy_process_groups(parallelism: TensorParallelism | None) -> None:
    """Destroys the process groups ``parallelism`` created (each rank its own handles; local)."""
    if parallelism is not None and parallelism.process_groups is not None:
        release_process_groups(parallelism.process_groups)
