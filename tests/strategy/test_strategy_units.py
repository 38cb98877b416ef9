"""Single-process tests of the strategy's pure parts: transfers, batch slicing, options."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from resihp_lightning.errors import ConfigError
from resihp_lightning.plan import Plan, Replica
from resihp_lightning.runtime import batching
from resihp_lightning.placement import plan_transfers
from resihp_lightning.strategy.options import StrategyOptions
from resihp_lightning.placement import owners, position, row_offset


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


def test_micro_batches_slice_rows_and_workload():
    x = torch.arange(24.0).reshape(8, 3)
    y = torch.arange(8)
    seq = torch.tensor([[3, 0], [1, 2], [3, 0], [2, 1], [3, 0], [3, 0], [1, 1], [2, 0]])
    split = batching.SplitBatch((x,), y, seq)
    items = batching.micro_batches(split, offset=2, count=3, micro_batch_size=2)
    assert [mb.labels.tolist() for mb in items] == [[2, 3], [4, 5], [6, 7]]
    assert torch.equal(items[0].inputs[0], x[2:4])
    assert [(mb.tokens, mb.sum_len_sq) for mb in items] == [(6, 9 + 4 + 1), (6, 18), (4, 1 + 1 + 4)]
    no_lens = batching.micro_batches(batching.SplitBatch((x,), (y, y), None), 0, 1, 4)
    assert (no_lens[0].tokens, no_lens[0].sum_len_sq) == (4 * 3, 4 * 9)
    assert isinstance(no_lens[0].labels, tuple) and no_lens[0].labels[1].tolist() == [0, 1, 2, 3]


def test_eval_shares_cover_the_batch_in_proportion():
    for rows, mbs, weights in itertools.product([1, 5, 10, 17, 64], [1, 2, 4], [(1,), (2, 2), (3, 1), (1, 1, 1, 5)]):
        shares = batching.eval_shares(rows, mbs, weights)
        total = -(-rows // mbs)
        assert sum(count for _, count in shares) == total
        offset = 0
        for (start, count), w in zip(shares, weights):
            assert start == offset * mbs
            assert abs(count - total * w / sum(weights)) < 1
            offset += count


def test_split_batch_checks_the_module_output():
    class Module:
        def __init__(self, out):
            self.out = out

        def pipeline_batch(self, batch):
            return self.out

    assert batching.split_batch(Module((torch.zeros(4, 2), torch.zeros(4), None)), None).rows == 4
    with pytest.raises(ConfigError, match="pipeline_batch must return"):
        batching.split_batch(Module((torch.zeros(4, 2), torch.zeros(4))), None)
    with pytest.raises(ConfigError, match="same rows"):
        batching.split_batch(Module(((torch.zeros(4, 2), torch.zeros(3, 2)), torch.zeros(4), None)), None)


def test_the_default_pipeline_batch_takes_pairs_and_inputs_alone():
    """(inputs, labels) for training; for trainer.predict the inputs alone, as a tensor or as the
    one-element batch a DataLoader over TensorDataset(x) yields (it was refused); anything else is named."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning import ResiHPModule

    module = ResiHPModule()
    x, y = torch.randn(6, 3), torch.randn(6, 3)
    inputs, labels, lens = module.pipeline_batch((x, y))
    assert inputs is x and labels is y and lens is None
    from_dataset = next(iter(DataLoader(TensorDataset(x), batch_size=6)))
    inputs, labels, _ = module.pipeline_batch(from_dataset)
    assert torch.equal(inputs, x) and labels is None
    assert module.pipeline_batch(x)[0] is x
    with pytest.raises(MisconfigurationException, match="expects batches of \\(inputs, labels\\)"):
        module.pipeline_batch((x, y, y))


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"pipeline_degree": 0}, "pipeline_degree"),
        ({"deepspeed_config": {"gradient_accumulation_steps": 2}}, "deepspeed_config.gradient_accumulation_steps"),
        ({"deepspeed_config": {"zero_optimization": {"stage": 2}}}, "deepspeed_config.zero_optimization.stage"),
        ({"process_group_backend": "mpi"}, "process_group_backend"),
    ],
)
def test_options_refuse_bad_values_by_name(kwargs, option):
    with pytest.raises(ConfigError, match=f"`{option}`"):
        StrategyOptions(**kwargs)


def test_options_accept_a_plan_as_json_dict():
    plan = Plan((Replica((0, 1), (0, 2, 4), 2),))
    assert StrategyOptions(plan=plan.to_dict()).plan.layout_key() == plan.layout_key()


def test_tied_parameter_names_are_checked():
    from types import SimpleNamespace

    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from resihp_lightning.strategy.module import tied_parameters

    def module(groups):
        return SimpleNamespace(pipeline_tied_parameters=lambda: groups)

    assert tied_parameters(module([("0.embed.weight", "9.head.weight")]), 10) == [((0, "embed.weight"), (9, "head.weight"))]
    assert tied_parameters(SimpleNamespace(), 10) == []
    for groups, message in (
        ([("0.embed.weight",)], "a tie needs at least two"),
        ([("0.embed.weight", "10.head.weight")], "layer index below 10"),
        ([("embed.weight", "9.head.weight")], "'<layer index>.<parameter name>'"),
        ([("0.", "9.head.weight")], "'<layer index>.<parameter name>'"),
    ):
        with pytest.raises(MisconfigurationException, match=message):
            tied_parameters(module(groups), 10)
