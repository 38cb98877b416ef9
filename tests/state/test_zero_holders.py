"""Which processes share a shard's optimizer state under the layer-wise ZeRO-1 (:mod:`resihp_lightning.state.zero_holders`)."""

from __future__ import annotations

from resihp_lightning.plan import Plan, Replica
from resihp_lightning.state.zero_holders import ShardHolders, shard_holders


def _plan(*replicas: tuple[tuple[int, ...], tuple[int, ...]]) -> Plan:
    return Plan(tuple(Replica(devices, bounds, 1) for devices, bounds in replicas))


def test_without_tensor_parallelism_a_layer_s_holders_share_it_in_replica_order():
    plan = _plan(((2, 0), (0, 1, 3)), ((1, 3), (0, 2, 3)))
    found = shard_holders(plan)
    assert found[2] == {0: ShardHolders((0, 1, 0), (2, 1))}
    assert found[1] == {0: ShardHolders((0, 1, 0), (2, 1)), 1: ShardHolders((1, 1, 0), (0, 1))}
    assert found[0][1].holders == (0, 1) and found[0][2] == ShardHolders((2, 1, 0), (0, 3))
    assert found[3] == {2: ShardHolders((2, 1, 0), (0, 3))}


def test_groups_of_one_degree_share_member_by_member_as_the_job_s_slices():
    groups = ((0, 1), (2, 3), (4, 5))
    found = shard_holders(_plan(((2,), (0, 2)), ((0,), (0, 2)), ((1,), (0, 2))), groups)
    # Replica order: group 2 first, then 0 and 1; member j of each.
    assert found[4][0] == ShardHolders((0, 2, 0), (4, 0, 2))
    assert found[3][1] == ShardHolders((1, 2, 1), (5, 1, 3))
    assert sorted(found) == [0, 1, 2, 3, 4, 5] and all(sorted(per) == [0, 1] for per in found.values())


def test_groups_of_different_degrees_share_per_degree_and_member():
    # A group that lost a member (2,) beside two groups of two: the degree-2 shards are shared by the
    # members of the same index; the degree-1 group's whole layer is its own.
    groups = ((0, 1), (2,), (4, 5))
    found = shard_holders(_plan(((0,), (0, 3)), ((1,), (0, 3)), ((2,), (0, 3))), groups)
    assert found[0][0] == ShardHolders((0, 2, 0), (0, 4))
    assert found[5][2] == ShardHolders((2, 2, 1), (1, 5))
    assert found[2][1] == ShardHolders((1, 1, 0), (2,))
    assert 3 not in found
