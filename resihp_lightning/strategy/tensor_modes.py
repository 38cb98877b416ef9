"""Tensor parallelism as the strategy sees it: ``WholeLayers`` (none) or ``SplitLayers`` (``tensor_degree`` > 1).

Each answers the strategy's few tensor-parallel questions: the loss on the last stage's outputs, the
ranks of the runtime's pipeline, whether this process reports its device's step statistics, the
whole outputs of a predict step, and how the trained weights reach the LightningModule. The groups
themselves are built in :mod:`.tensor_setup`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

from torch import Tensor

from resihp_lightning.contract import MigrationRecord
from resihp_lightning.errors import ConfigError
from resihp_lightning.placement import relabel
from resihp_lightning.plan import Plan
from resihp_lightning.runtime.pipeline_runtime import PipelineRuntime
from resihp_lightning.state.module_weights import LayerKeys, restore_full_precision, write_trained
from resihp_lightning.tensor.tensor_groups import (
    TensorGroups,
    TensorParallelism,
    destroy_process_groups,
    tensor_parallelism,
)


class TensorMode(Protocol):
    """The strategy's view of tensor parallelism (see the module docstring)."""

    #: Whether each process holds a shard of its device's layers.
    splits_layers: bool

    @property
    def degree(self) -> int:
        """Processes per planning device under the groups in force (1: none)."""
        ...

    @property
    def parallelism(self) -> TensorParallelism | None:
        """The runtime's ``RuntimeConfig.tensor``."""
        ...

    @property
    def reports_device(self) -> bool:
        """Whether this process's step statistics speak for its device."""
        ...

    def runtime_ranks(self, ranks: dict[int, int] | None) -> dict[int, int] | None:
        """The runtime's device -> rank map, given the membership's."""
        ...

    def pipeline_loss(self, module: Any, outputs: Any, labels: Any) -> Tensor:
        """The loss of one micro-batch on the last stage."""
        ...

    def whole_outputs(self, module: Any, outputs: list[Any]) -> list[Any] | None:
        """A predict step's outputs of each micro-batch, whole (``None`` where this process adds nothing)."""
        ...

    def keep_trained(self, runtime: PipelineRuntime, specs: list[Any], keys: LayerKeys, trained: Mapping[str, Tensor]) -> None:
        """End of fit: this process's own layers in the LightningModule take their trained values."""
        ...

    def weights_plan(self, runtime: PipelineRuntime) -> Plan:
        """The plan, in ranks, that the end-of-fit weight sync sends the layers over."""
        ...


class WholeLayers:
    """No tensor parallelism: every process holds whole layers."""

    splits_layers = False
    parallelism = None
    reports_device = True
    degree = 1

    def runtime_ranks(self, ranks: dict[int, int] | None) -> dict[int, int] | None:
        return ranks

    def pipeline_loss(self, module: Any, outputs: Any, labels: Any) -> Tensor:
        return module.pipeline_loss(outputs, labels)

    def whole_outputs(self, module: Any, outputs: list[Any]) -> list[Any] | None:
        return outputs

    def keep_trained(self, runtime: PipelineRuntime, specs: list[Any], keys: LayerKeys, trained: Mapping[str, Tensor]) -> None:
        restore_full_precision(runtime.local_layers(), trained)

    def weights_plan(self, runtime: PipelineRuntime) -> Plan:
        return runtime.plan_in_ranks()


class SplitLayers:
    """Tensor parallelism: this process holds its member's shard of its group's layers.

    Args:
        parallelism: its tensor-parallel groups (:func:`.tensor_setup.create_tensor_groups`); a re-split
            replaces it (:meth:`reshape`), and every part of the strategy holding this mode sees the new one.
    """

    splits_layers = True

    def __init__(self, parallelism: TensorParallelism) -> None:
        self.parallelism = parallelism

    @property
    def degree(self) -> int:
        return self.parallelism.groups.degree

    def reshape(self, runtime: PipelineRuntime, groups: TensorGroups, plan: Plan, rank: int, ranks: dict[int, int] | None) -> MigrationRecord:
        """Puts ``plan`` over new ``groups`` in force: creates their process groups and re-cuts every layer
        (collective over the default group; :meth:`~resihp_lightning.runtime.pipeline_runtime.PipelineRuntime.reshape`).

        Args:
            runtime: the runtime in force.
            groups: the new groups (device ids: the processes' global ranks at the start).
            plan: the plan over the new groups' ids.
            rank: this process's device id.
            ranks: device id -> rank of the current default group (``None``: the identity).
        """
        current = groups if ranks is None else groups.relabelled(ranks)
        parallelism = tensor_parallelism(current, ranks[rank] if ranks is not None else rank, self.parallelism.split_layer)
        if parallelism is None:
            raise ConfigError(f"rank {rank} is in none of the tensor-parallel groups {groups.members}")
        parallelism = dataclasses.replace(parallelism, groups=groups)
        try:
            record = runtime.reshape(parallelism, plan, ranks)
        except ConfigError:  # refused before anything changed: the groups in force go on
            destroy_process_groups(parallelism)
            raise
        self.parallelism = parallelism
        return record

    @property
    def reports_device(self) -> bool:
        """Only a group's member 0 reports: the members finish every layer together."""
        return self.parallelism.member == 0

    def runtime_ranks(self, ranks: dict[int, int] | None) -> dict[int, int] | None:
        """This member's slice: group id -> the rank of its member with this process's index (groups of
        different degrees: the members 0)."""
        groups = self.parallelism.groups
        return groups.slice_ranks(self.parallelism.member if groups.uniform else 0)

    def pipeline_loss(self, module: Any, outputs: Any, labels: Any) -> Tensor:
        return module.pipeline_tensor_parallel_loss(outputs, labels, self.parallelism.group)

    def whole_outputs(self, module: Any, outputs: list[Any]) -> list[Any] | None:
        """Member 0 of a last-stage group joins the members' split outputs (collective over the group)."""
        tensor = self.parallelism
        whole = [module.pipeline_tensor_parallel_outputs(out, tensor.group) for out in outputs]
        return whole if tensor.member == 0 else None

    def keep_trained(self, runtime: PipelineRuntime, specs: list[Any], keys: LayerKeys, trained: Mapping[str, Tensor]) -> None:
        # the split copies trained; the module's own layers take the gathered values
        write_trained({i: specs[i] for i in runtime.local_layers() if keys.is_attached(i)}, trained)

    def weights_plan(self, runtime: PipelineRuntime) -> Plan:
        """Slice 0's plan: member 0 of each group sends the whole layers."""
        return relabel(runtime.plan, runtime.groups_in_ranks().slice_ranks(0))
