"""Which ranks form the tensor-parallel groups and slices (:mod:`resihp_lightning.tensor.tensor_groups`)."""

from __future__ import annotations

import pytest

from resihp_lightning.errors import ConfigError
from resihp_lightning.placement import owners, position
from resihp_lightning.plan import Plan, Replica
from resihp_lightning.tensor.tensor_groups import TensorGroups


def test_tensor_groups_are_consecutive_ranks_and_slices_relabel_plans():
    from resihp_lightning.plan import Plan
    from resihp_lightning.tensor.tensor_groups import TensorGroups

    groups = TensorGroups.consecutive(2, 8)
    assert groups.groups == 4 and groups.ranks_of(1) == [2, 3]
    assert [groups.group_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [groups.member_of(r) for r in range(8)] == [0, 1] * 4
    plan = Plan.uniform([0, 1, 2, 3], 6, 2, 4)  # over groups: replicas (0, 1) and (2, 3)
    slices = groups.slice_plans(plan)
    assert [r.devices for r in slices[0].replicas] == [(0, 2), (4, 6)]
    assert [r.devices for r in slices[1].replicas] == [(1, 3), (5, 7)]


@pytest.mark.parametrize(("degree", "world"), [(1, 1), (1, 4), (2, 2), (2, 6), (3, 9), (4, 8)])
def test_groups_partition_the_world_and_rank_inverts_group_and_member(degree, world):
    groups = TensorGroups.consecutive(degree, world)
    assert groups.groups * degree == world
    members = [rank for g in range(groups.groups) for rank in groups.ranks_of(g)]
    assert sorted(members) == list(range(world))  # every rank in exactly one group
    for rank in range(world):
        g, i = groups.group_of(rank), groups.member_of(rank)
        assert 0 <= i < degree and groups.rank(g, i) == rank
        assert groups.ranks_of(g)[i] == rank
    # Slice i holds member i of every group; the slices partition the world too.
    slices = [groups.slice_ranks(i) for i in range(degree)]
    assert sorted(r for s in slices for r in s.values()) == list(range(world))
    for i, ranks in enumerate(slices):
        assert list(ranks) == list(range(groups.groups))
        assert all(groups.member_of(r) == i and groups.group_of(r) == g for g, r in ranks.items())


@pytest.mark.parametrize(("degree", "world"), [(0, 4), (-1, 4), (3, 4), (5, 4), (2, 3)])
def test_a_degree_that_does_not_divide_the_world_is_refused(degree, world):
    with pytest.raises(ConfigError, match=rf"`tensor_degree`; allowed: a divisor of the world size {world}"):
        TensorGroups.consecutive(degree, world)


def test_each_slice_plan_puts_member_i_of_a_group_where_the_plan_puts_the_group():
    groups = TensorGroups.consecutive(3, 12)  # 4 groups
    # Per-replica bounds and a non-identity device order, so a wrong relabelling shows.
    plan = Plan((Replica((3, 1), (0, 2, 5), 2), Replica((0, 2), (0, 4, 5), 3)))
    slices = groups.slice_plans(plan)
    assert len(slices) == 3
    for member, sliced in enumerate(slices):
        assert [(r.bounds, r.micro_batches) for r in sliced.replicas] == [(r.bounds, r.micro_batches) for r in plan.replicas]
        for group in plan.device_ids:
            assert position(sliced, groups.rank(group, member)) == position(plan, group)
        for layer in range(5):
            assert owners(sliced, layer) == [groups.rank(g, member) for g in owners(plan, layer)]


def test_new_process_groups_in_a_one_process_world(tmp_path):
    import torch
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        made = TensorGroups.consecutive(1, 1).new_process_groups()
        assert len(made) == 1
        assert dist.get_world_size(made[0]) == 1 and dist.get_rank(made[0]) == 0
        value = torch.tensor([2.0])
        dist.all_reduce(value, group=made[0])
        assert value.item() == 2.0
    finally:
        dist.destroy_process_group()
