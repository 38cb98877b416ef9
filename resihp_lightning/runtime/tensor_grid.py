"""The pipeline grid of a plan over tensor-parallel groups of different degrees.

When every group has the same degree t, the job is t *slices* and DeepSpeed's own pipe x data x model
grid runs it (:class:`~resihp_lightning.runtime.topology.TensorPlanTopology`). When degrees differ (a
group went on at a smaller degree after losing or dropping a member) there is no such cube: stage j of
a replica may be held by 2 processes and stage j + 1 by 1. :class:`TensorGrid` then gives each
process's ``PipelineEngine`` what it asks its grid (its stage, its replica, the sizes, the groups it
reduces the loss over) and routes the stage-boundary transfers:

* activations and their gradients are whole, and equal, on every member of a group (after a row
  split's sum; the backward's input-gradient sum over the group runs inside the layer), so member ``j``
  of a receiving group of degree ``k_recv`` takes them from member ``j mod k_send`` of the sending group,
  and a sender sends to every receiving member that maps to it (none, one or several);
* the engine's loss average (over replicas) and its broadcast to every stage run over the replica's
  processes (:meth:`TensorGrid.aggregate_loss`).

The routing sits in DeepSpeed's ``p2p.send`` / ``p2p.recv`` (looked up per call by the engine), for the
engine whose grid is a :class:`TensorGrid`; any other engine's transfers pass through untouched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from resihp_lightning.placement import position
from resihp_lightning.plan import Plan
from resihp_lightning.torch_utils.collectives import release_process_groups


class TensorGrid:
    """DeepSpeed's pipeline grid for one process of a plan over groups of any degrees.

    Building one is collective over the default group: every process creates the replicas' process
    groups (all the ranks of a replica's groups), in replica order.

    Args:
        plan: the plan over group ids.
        members: group id -> the ranks (of the default group) of its members, member 0 first.
        rank: this process's rank.
    """

    def __init__(self, plan: Plan, members: Mapping[int, Sequence[int]], rank: int) -> None:
        self.plan = plan
        self.members = {g: tuple(ranks) for g, ranks in members.items()}
        self.global_rank = rank
        self.group_id = next(g for g, ranks in self.members.items() if rank in ranks)
        self.member = self.members[self.group_id].index(rank)
        where = position(plan, self.group_id)
        self.stage_id, self.data_parallel_id = where.stage, where.replica
        self.pipe_parallel_size = plan.pipeline_degree
        self.data_parallel_size = plan.data_degree
        self.model_parallel_size = 1  # the engine must not partition activations over a model group
        self.slice_parallel_size = 1
        replica_ranks = [sorted(r for g in replica.devices for r in self.members[g]) for replica in plan.replicas]
        made = [dist.new_group(ranks=ranks) for ranks in replica_ranks]
        self.pp_group = replica_ranks[self.data_parallel_id]
        self._replica_group = made[self.data_parallel_id]
        self._replica_groups = made
        devices = plan.replicas[self.data_parallel_id].devices
        self._chain = [self.members[g] for g in devices]
        self._topo = _own_topology(plan, self.members, self.group_id, rank)

    # ----------------------------------------------------------------- routing
    def send_ranks(self, dest_stage: int) -> list[int]:
        """The ranks this process sends a stage-boundary tensor to: every member of ``dest_stage``'s group
        that takes it from this member."""
        mine, theirs = self._chain[self.stage_id], self._chain[dest_stage]
        return [rank for j, rank in enumerate(theirs) if j % len(mine) == self.member]

    def recv_rank(self, src_stage: int) -> int:
        """The rank this process receives a stage-boundary tensor from."""
        theirs = self._chain[src_stage]
        return theirs[self.member % len(theirs)]

    def aggregate_loss(self, engine: Any) -> torch.Tensor:
        """The engine's ``_aggregate_total_loss``: the mean over replicas of each replica's scaled loss, on
        every process (each replica's last-stage member 0 contributes its loss)."""
        last = self.stage_id == self.pipe_parallel_size - 1
        if last:
            loss = engine._scale_loss_by_gas(engine.total_loss).clone().detach().float()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=engine.device)
        mine = torch.stack([loss, loss if last and self.member == 0 else torch.zeros_like(loss)])
        # Each replica's loss to all its processes, then the replicas' mean over the job.
        dist.all_reduce(mine[1:], group=None)
        if self.pipe_parallel_size > 1:
            source = self._chain[-1][0]
            dist.broadcast(mine[:1], src=source, group=self._replica_group)
        engine.dp_group_loss = mine[0].clone()
        engine.agg_train_loss = mine[1] / self.data_parallel_size
        engine.agg_additional_losses = None
        return engine.agg_train_loss

    def destroy(self) -> None:
        """Releases the replicas' process groups (local)."""
        release_process_groups(self._replica_groups)
        self._replica_groups = []

    # ----------------------------------------------------- DeepSpeed's grid interface
    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: Any) -> int:
        return self.recv_rank(stage_id)

    def topology(self) -> PipeDataParallelTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self._replica_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        # DeepSpeed reduces gradients and broadcasts the model over it; the layer-wise reducer does both
        # here. A group of this process alone keeps any other use local.
        return dist.GroupMember.WORLD if dist.get_world_size() == 1 else self._replica_group

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self) -> Any:
        return self._replica_group

    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size


def _own_topology(plan: Plan, members: Mapping[int, Sequence[int]], group: int, rank: int) -> PipeDataParallelTopology:
    """A pipe x data topology of ``plan`` in which this process stands for its group and member 0 for each
    other group: what ``PipelineModule`` reads its stage from."""
    topology = PipeDataParallelTopology(num_pp=plan.pipeline_degree, num_dp=plan.data_degree)
    topology.mapping = {
        topology.ProcessCoord(pipe=j, data=r): rank if g == group else members[g][0]
        for r, replica in enumerate(plan.replicas)
        for j, g in enumerate(replica.devices)
    }
    return topology


def _install_routing() -> None:
    """Routes DeepSpeed's pipeline ``p2p.send`` / ``p2p.recv`` through a :class:`TensorGrid` when the
    engine's grid is one (once per process)."""
    from deepspeed.runtime.pipe import p2p

    if getattr(p2p, "_resihp_routed", False):
        return
    send, recv = p2p.send, p2p.recv

    def routed_send(tensor: torch.Tensor, dest_stage: int, async_op: bool = False) -> Any:
        grid = p2p._grid
        if not isinstance(grid, TensorGrid):
            return send(tensor, dest_stage, async_op=async_op)
        for rank in grid.send_ranks(dest_stage):
            dist.send(tensor, rank)
        return None

    def routed_recv(tensor: torch.Tensor, src_stage: int, async_op: bool = False) -> Any:
        grid = p2p._grid
        if not isinstance(grid, TensorGrid):
            return recv(tensor, src_stage, async_op=async_op)
        dist.recv(tensor, grid.recv_rank(src_stage))
        return None

    p2p.send, p2p.recv = routed_send, routed_recv
    p2p._resihp_routed = True


_install_routing()
