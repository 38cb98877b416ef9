"""Data-parallel gradient reduction when a layer's holder groups have different tensor-parallel degrees.

With groups of one degree, member ``i`` of every holder group has the same shard of a layer and the
shards reduce slice by slice (:class:`~resihp_lightning.runtime.layerwise.LayerwiseReducer`). When a
layer is held at degree 2 in one replica and 1 in another, the shards do not line up. This reducer
reduces *whole* gradients: each group joins its members' shards of every split gradient (an
all-gather inside the group, over its fast links), the groups' member 0 all-reduce the whole gradients
over the layer's holder groups (DeepSpeed's averaging, as the layer-wise reducer does), and member 0
hands the result back to its members, who keep their shard. The whole tensor crosses the slow links
once per group instead of ``1/k`` of it per member: re-cutting on the fly would send less, at the cost of
one process group per piece of every layer and holder set; groups of different degrees are a
transition state (a group that lost or dropped a member), so the simple form is used.

The gradient norm for clipping adds, per layer, each member's shard squares (whole parameters counted
by member 0 only) over the replica's processes: every parameter once, exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from resihp_lightning.errors import ConfigError
from resihp_lightning.placement import holder_sets, layer_holders, position
from resihp_lightning.plan import Plan
from resihp_lightning.runtime.layerwise import averaged_allreduce
from resihp_lightning.torch_utils.collectives import release_process_groups
from resihp_lightning.torch_utils.shards import gather_along, split_dim


class MixedDegreeReducer:
    """Reduces this process's gradients over a plan whose tensor-parallel groups differ in degree.

    Building one is collective over the default group: every process creates the group of the
    members 0 of each holder set of two or more groups, in :func:`~resihp_lightning.placement.holder_sets`
    order.

    Args:
        plan: the plan over group ids.
        members: group id -> the ranks of its members (member 0 first).
        rank: this process's rank.
        local_layers: this process's split layers by layer index.
        tensor_group: this process's tensor-parallel group.
        replica_group: the process group of every process of this process's replica.
        tied: tied parameters (refused: not supported with groups of different degrees yet).
    """

    def __init__(
        self,
        plan: Plan,
        members: Mapping[int, Sequence[int]],
        rank: int,
        local_layers: Mapping[int, nn.Module],
        tensor_group: Any,
        replica_group: Any,
        tied: Sequence[Any] = (),
    ) -> None:
        if tied:
            raise ConfigError(
                "tied parameters (pipeline_tied_parameters) with tensor-parallel groups of different degrees are not "
                "supported yet"
            )
        self.plan = plan
        self.members = {g: tuple(r) for g, r in members.items()}
        self.rank = rank
        self.group_id = next(g for g, r in self.members.items() if rank in r)
        self.is_lead = self.members[self.group_id][0] == rank
        self.degree = len(self.members[self.group_id])
        self.data_degree = plan.data_degree
        self.tensor_group = tensor_group
        self.replica_group = replica_group
        # DeepSpeed's averaging settings; install() copies the engine's.
        self.average, self.prescale, self.predivide = True, False, 1.0
        self.communication_dtype: torch.dtype | None = None
        mine = set(position(plan, self.group_id).layers)
        holders = layer_holders(plan)
        self._leads: dict[tuple[int, ...], Any] = {}
        self._made: list[Any] = []
        for groups in holder_sets(plan):
            if len(groups) < 2:
                continue
            made = dist.new_group(ranks=sorted(self.members[g][0] for g in groups))
            self._made.append(made)
            if self.is_lead and self.group_id in groups:
                self._leads[groups] = made
        self._layer_params = {i: [p for p in local_layers[i].parameters() if p.numel() > 0] for i in sorted(local_layers) if i in mine}
        self._order: list[tuple[tuple[int, ...], list[nn.Parameter]]] = []
        for groups in holder_sets(plan):
            params = [p for i, ps in self._layer_params.items() if holders[i] == groups for p in ps if p.requires_grad]
            if params:
                self._order.append((groups, params))
        self._num_layers = len(holders)

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter the reducer covers (this process's layers)."""
        return [p for params in self._layer_params.values() for p in params]

    def reduce(self, bucket_numel: int = 0) -> None:  # noqa: ARG002 - one buffer per holder set
        """Averages every gradient over the layer's holder groups (see the module docstring; collective)."""
        for groups, params in self._order:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            # The whole gradients, on every member (the split ones joined over the group).
            whole = [self._whole(p.grad.data, split_dim(p)) for p in params]
            if len(groups) > 1 or self.degree > 1:
                flat = _flatten_dense_tensors(whole)
                if self.is_lead and len(groups) > 1:
                    averaged_allreduce(self, [flat], self._leads[groups], len(groups))
                if self.degree > 1:
                    dist.broadcast(flat, src=self.members[self.group_id][0], group=self.tensor_group)
                whole = list(_unflatten_dense_tensors(flat, whole))
            for p, value in zip(params, whole):
                dim = split_dim(p)
                p.grad.data.copy_(value if dim is None else value.chunk(self.degree, dim=dim)[self._member()])

    def grad_norm(self, pipe_group: Any = None, device: Any = None) -> Tensor:  # noqa: ARG002 - the replica's
        """The 2-norm of the whole model's gradient, the same on every process of the replica."""
        if device is None:
            device = next((p.device for p in self.parameters()), torch.device("cpu"))
        squares = torch.zeros(self._num_layers, dtype=torch.float64, device=device)
        for layer, params in self._layer_params.items():
            for p in params:
                if p.grad is None or (split_dim(p) is None and not self.is_lead):
                    continue
                squares[layer] += p.grad.detach().float().norm(2).double() ** 2
        dist.all_reduce(squares, group=self.replica_group)
        return squares.sum().sqrt()

    def clip(self, max_norm: float, pipe_group: Any = None, device: Any = None, norm: Tensor | None = None) -> Tensor:
        """Scales every local gradient by ``min(1, max_norm / (norm + 1e-6))``; returns the norm."""
        if norm is None:
            norm = self.grad_norm(pipe_group, device)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0).float()  # the layer-wise reducer's rule
        for p in self.parameters():
            if p.grad is not None:
                p.grad.data.mul_(coef.to(p.grad.device, p.grad.dtype))
        return norm.float()

    def broadcast(self) -> None:
        """Not needed: groups of different degrees only arise from a re-split, whose values are exact."""
        raise RuntimeError("a job with tensor-parallel groups of different degrees has no initial broadcast")

    def destroy(self) -> None:
        """Releases the process groups it created (local)."""
        release_process_groups(self._made)
        self._made, self._leads, self._order = [], {}, []

    def _member(self) -> int:
        return self.members[self.group_id].index(self.rank)

    def _whole(self, grad: Tensor, dim: int | None) -> Tensor:
        if dim is None or self.degree == 1:
            return grad
        return gather_along(grad, dim, self.tensor_group)
