"""A plan's placement as a DeepSpeed topology (:mod:`resihp_lightning.runtime.topology`), checked against
the plan's own positions and holder sets (:mod:`resihp_lightning.placement`)."""

from __future__ import annotations

import pytest

from resihp_lightning.placement import holder_sets, layer_holders, position
from resihp_lightning.plan import Plan, Replica
from resihp_lightning.runtime.topology import PlanTopology, TensorPlanTopology
from resihp_lightning.tensor.tensor_groups import TensorGroups

SHARED = [
    Plan.uniform([0, 1, 2, 3, 4, 5], 6, 3, 4),  # 3 stages x 2 replicas, consecutive ids
    Plan((Replica((5, 2, 7), (0, 1, 3, 4), 2), Replica((0, 6, 1), (0, 1, 3, 4), 2))),  # permuted ids
    Plan((Replica((3,), (0, 4), 1), Replica((1,), (0, 4), 1), Replica((2,), (0, 4), 1))),  # P = 1
    Plan((Replica((4, 0, 2, 1), (0, 1, 2, 3, 5), 8),)),  # D = 1
]


@pytest.mark.parametrize("plan", SHARED + [Plan((Replica((3, 1), (0, 2, 5), 2), Replica((0, 2), (0, 4, 5), 3)))])
def test_every_device_sits_at_its_plan_position(plan):
    topo = PlanTopology(plan)
    assert topo.world_size() == len(plan.device_ids)
    assert (topo.get_dim("pipe"), topo.get_dim("data")) == (plan.pipeline_degree, plan.data_degree)
    for device in plan.device_ids:
        pos = position(plan, device)
        coord = topo.get_coord(device)
        assert (coord.pipe, coord.data) == (pos.stage, pos.replica)
        assert topo.get_rank(pipe=pos.stage, data=pos.replica) == device
    # DeepSpeed's pipelines (ranks along "pipe") are the replicas, stage by stage.
    assert sorted(map(tuple, topo.get_axis_comm_lists("pipe"))) == sorted(r.devices for r in plan.replicas)


@pytest.mark.parametrize("plan", SHARED)
def test_with_shared_bounds_the_data_parallel_groups_are_the_holder_sets(plan):
    topo = PlanTopology(plan)
    data_groups = [tuple(group) for group in topo.get_axis_comm_lists("data")]  # stage by stage
    assert data_groups == holder_sets(plan)
    # Each layer's holders are the data-parallel group of the stage that holds it.
    for layer, holders in enumerate(layer_holders(plan)):
        stage = position(plan, holders[0]).stage
        assert holders == data_groups[stage]


def test_tensor_topology_model_groups_are_the_tensor_groups_and_slices_keep_the_plan():
    groups = TensorGroups.consecutive(2, 12)  # 6 groups of 2
    plan = Plan((Replica((4, 0, 2), (0, 2, 3, 6), 2), Replica((1, 5, 3), (0, 2, 3, 6), 2)))  # over groups
    slices = groups.slice_plans(plan)
    topo = TensorPlanTopology(slices)
    assert topo.world_size() == 12
    assert (topo.get_dim("pipe"), topo.get_dim("data"), topo.get_dim("model")) == (3, 2, 2)
    assert sorted(map(tuple, topo.get_axis_comm_lists("model"))) == [tuple(groups.ranks_of(g)) for g in range(6)]
    for rank in range(12):
        coord = topo.get_coord(rank)
        pos = position(plan, groups.group_of(rank))
        assert (coord.pipe, coord.data, coord.model) == (pos.stage, pos.replica, groups.member_of(rank))
    # Pipelines and data-parallel groups stay inside a slice: they are the slice plan's own.
    pipes = sorted(map(tuple, topo.get_axis_comm_lists("pipe")))
    assert pipes == sorted(r.devices for s in slices for r in s.replicas)
    datas = sorted(map(tuple, topo.get_axis_comm_lists("data")))
    assert datas == sorted(h for s in slices for h in holder_sets(s))
