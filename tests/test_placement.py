"""Who holds which layer under a plan, and which layers must move between two plans (``resihp_lightning.placement``)."""

from __future__ import annotations

import random

from resihp_lightning.placement import owners, plan_transfers, position, row_offset
from resihp_lightning.plan import Plan, Replica


def _random_plan(rng: random.Random, world: int, layers: int) -> Plan:
    p = rng.choice([d for d in range(1, world + 1) if world % d == 0 and d <= layers])
    d = world // p
    ranks = list(range(world))
    rng.shuffle(ranks)
    cuts = sorted(rng.sample(range(1, layers), p - 1))
    bounds = tuple([0, *cuts, layers])
    return Plan(tuple(Replica(tuple(ranks[r * p : (r + 1) * p]), bounds, 1) for r in range(d)))


def _held(plan: Plan) -> dict[int, set[int]]:
    return {rank: set(position(plan, rank).layers) for rank in plan.device_ids}


def test_transfers_move_exactly_the_layers_a_rank_lacks():
    rng = random.Random(0)
    for _ in range(300):
        world, layers = rng.choice([(4, 8), (6, 7), (8, 12), (2, 3)])
        old, new = _random_plan(rng, world, layers), _random_plan(rng, world, layers)
        weights = [rng.randint(1, 100) for _ in range(layers)]
        transfers = plan_transfers(old, new, weights)
        before, after = _held(old), _held(new)
        wanted = {(layer, rank) for rank in after for layer in after[rank] - before[rank]}
        assert {(t.layer, t.dst) for t in transfers} == wanted
        for t in transfers:
            assert t.layer in before[t.src], "a source must hold the layer under the old plan"
        assert plan_transfers(old, old, weights) == []
        # Deterministic: every rank computes the same list.
        assert plan_transfers(old, new, weights) == transfers


def test_transfers_spread_bytes_over_the_old_owners():
    # 1x4 -> 4x1: every rank holds everything before, so nothing moves.
    wide = Plan(tuple(Replica((r,), (0, 8), 1) for r in range(4)))
    deep = Plan((Replica((0, 1, 2, 3), (0, 2, 4, 6, 8), 4),))
    assert plan_transfers(wide, deep, [1] * 8) == []
    # 4x1 -> 1x4: each rank needs the 6 layers it lacks; each layer has one owner.
    transfers = plan_transfers(deep, wide, [1] * 8)
    assert len(transfers) == 4 * 6
    # 2x2 -> 2x2 with the stages swapped: each layer has two old owners; the load is balanced.
    a = Plan((Replica((0, 1), (0, 4, 8), 2), Replica((2, 3), (0, 4, 8), 2)))
    b = Plan((Replica((1, 0), (0, 4, 8), 2), Replica((3, 2), (0, 4, 8), 2)))
    sent = {}
    for t in plan_transfers(a, b, [1] * 8):
        sent[t.src] = sent.get(t.src, 0) + 1
    assert sorted(sent.values()) == [4, 4, 4, 4]


def test_placement_helpers():
    plan = Plan((Replica((3, 0), (0, 5, 8), 1), Replica((1, 2), (0, 5, 8), 3)))
    assert position(plan, 0).layers == range(5, 8) and position(plan, 0).replica == 0
    assert position(plan, 1).stage == 0 and position(plan, 1).replica == 1
    assert owners(plan, 6) == [0, 2]
    assert row_offset(plan, 0, 2) == 0 and row_offset(plan, 1, 2) == 2
