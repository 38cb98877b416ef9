"""The tensor-parallel groups of a job: which processes split each planning device's layers.

With ``tensor_degree`` t, consecutive ranks form a group (on GPUs: one machine's NVLink domain), group
``g`` being ranks ``g*t .. g*t + t - 1``. A plan names *groups*: to the planner, the placement and the
pipeline a group is one device, whose layers are split t ways (:mod:`resihp_lightning.models.tensor_parallel`).
Member ``i`` of every group forms *slice* ``i``: a pipeline x data-parallel job of its own over the
shards ``i`` of the layers, wired exactly as a job without tensor parallelism is; the slices meet only
inside the layers, in the groups' all-reduces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from resihp_lightning.errors import ConfigError
from resihp_lightning.placement import relabel
from resihp_lightning.plan import Plan


@dataclass(frozen=True)
class TensorGroups:
    """The tensor-parallel layout of a world of ``world_size`` ranks.

    Attributes:
        degree: t, processes per group.
        world_size: processes in the job (a multiple of ``degree``).
    """

    degree: int
    world_size: int

    def __post_init__(self) -> None:
        if self.degree < 1 or self.world_size % self.degree:
            raise ConfigError(
                f"invalid value {self.degree!r} for option `tensor_degree`; allowed: a divisor of the world size "
                f"{self.world_size}"
            )

    @property
    def groups(self) -> int:
        """How many groups (planning devices) the job has."""
        return self.world_size // self.degree

    def group_of(self, rank: int) -> int:
        """The group (the planning device id) of ``rank``."""
        return rank // self.degree

    def member_of(self, rank: int) -> int:
        """``rank``'s index in its group: which shard of its group's layers it holds."""
        return rank % self.degree

    def rank(self, group: int, member: int) -> int:
        """The rank of member ``member`` of group ``group``."""
        return group * self.degree + member

    def ranks_of(self, group: int) -> list[int]:
        """The ranks of ``group``, in member order."""
        return [self.rank(group, member) for member in range(self.degree)]

    def slice_ranks(self, member: int) -> dict[int, int]:
        """Group id -> rank of its member ``member``: slice ``member``'s ranks."""
        return {group: self.rank(group, member) for group in range(self.groups)}

    def slice_plans(self, plan: Plan) -> list[Plan]:
        """``plan`` (over groups) in the ranks of each slice, in member order."""
        return [relabel(plan, self.slice_ranks(member)) for member in range(self.degree)]

    def new_process_groups(self) -> list[Any]:
        """Creates every group's process group (collective: every rank creates all of them, in order).

        Returns:
            the process group of each group, by group id (``GroupMember.NON_GROUP_MEMBER`` for groups
            this rank is not in).
        """
        return [dist.new_group(ranks=self.ranks_of(group)) for group in range(self.groups)]


@dataclass(frozen=True)
class TensorParallelism:
    """How this process takes part in tensor parallelism (a runtime's; ``None`` there: none).

    Attributes:
        groups: the job's tensor-parallel layout.
        member: this process's index in its group (the shard of every layer it holds).
        group: its group's process group.
        split_layer: ``split_layer(index, layer, group)`` -> this member's split of ``layer``, a private copy
            of the unsplit layer (the module's ``pipeline_split_layer``).
    """

    groups: TensorGroups
    member: int
    group: Any
    split_layer: Any
