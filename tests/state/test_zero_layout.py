"""The layer-wise ZeRO-1's slice arithmetic and config switch (pure: no processes).

Which holder keeps which slice for D = 1..5 and uneven parameter sizes; cutting whole Adam states into
pieces and joining them back is exact; the sharded step on pieces equals ``torch.optim.Adam`` /
``AdamW`` on the whole parameters bit for bit; ``zero_optimization.stage: 1`` selects the layer-wise
engine unless switched off or combined with a DeepSpeed wrapper.
"""

from __future__ import annotations

import pytest
import torch

from resihp_lightning.errors import ConfigError
from resihp_lightning.state.zero_shards import cut_state, join_slices
from resihp_lightning.state.wrapped_state import wraps_optimizer
from resihp_lightning.state.zero_config import deepspeed_runs_zero, for_deepspeed, layerwise_zero
from resihp_lightning.state.zero_layout import Piece, SliceLayout

#: Uneven layers: a Linear(6, 6), sizes that do not divide, a tiny layer, one with an empty parameter.
LAYERS = [(36, 6), (7, 1, 13), (2,), (5, 0, 4)]


@pytest.mark.parametrize("numels", LAYERS)
@pytest.mark.parametrize("holders", [1, 2, 3, 4, 5])
def test_slices_partition_the_layer_and_every_slice_has_two_keepers(numels, holders):
    layout = SliceLayout(numels, holders)
    total = sum(numels)
    # The slices tile [0, total) in order, sizes within one element of each other.
    bounds = [layout.bounds(s) for s in range(holders)]
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert max(layout.sizes()) - min(layout.sizes()) <= 1
    # Pieces cover each slice exactly, inside one parameter each, and all pieces cover every element once.
    covered = {i: [] for i in range(len(numels))}
    for s in range(holders):
        pieces = layout.pieces(s)
        assert sum(p.numel for p in pieces) == layout.sizes()[s]
        for piece in pieces:
            assert 0 <= piece.start < piece.stop <= numels[piece.param]
            covered[piece.param].extend(range(piece.start, piece.stop))
    assert all(sorted(covered[i]) == list(range(n)) for i, n in enumerate(numels))
    # Holder i keeps its slice and the next one; slice s lives on s and s - 1: each kept by two holders
    # (one when D = 1), and what a holder keeps is what names it a keeper.
    for i in range(holders):
        assert layout.kept_by(i) == ((i,) if holders == 1 else (i, (i + 1) % holders))
    for s in range(holders):
        assert layout.keepers(s) == ((s,) if holders == 1 else (s, (s - 1) % holders))
        assert all(s in layout.kept_by(h) for h in layout.keepers(s))
        assert sum(s in layout.kept_by(h) for h in range(holders)) == len(layout.keepers(s))
    # Memory: a holder keeps at most 2 * ceil(total / D) elements (everything when D <= 2).
    for i in range(holders):
        kept = layout.kept_elements(i)
        assert kept == (total if holders <= 2 else layout.sizes()[i] + layout.sizes()[(i + 1) % holders])
        assert kept <= 2 * -(-total // holders)


def test_uneven_slices_of_a_linear_layer_over_four_holders():
    layout = SliceLayout((36, 6), 4)  # weight 6x6, bias 6: 42 elements
    assert layout.sizes() == [10, 11, 10, 11]
    assert layout.pieces(3) == [Piece(0, 31, 36), Piece(1, 0, 6)]  # crosses from the weight into the bias
    assert layout.kept_by(3) == (3, 0)


@pytest.mark.parametrize("holders", [1, 2, 3, 4, 5])
def test_a_slice_is_lost_only_when_both_its_keepers_are(holders):
    layout = SliceLayout((36, 6), holders)
    everyone = set(range(holders))
    assert layout.lost(everyone) == []
    for dead in range(holders):  # any one loss: every slice still has a live keeper when D >= 2
        assert layout.lost(everyone - {dead}) == ([] if holders > 1 else [0])
    if holders >= 3:  # two neighbours: the slice of the second is gone (its copy was on the first)
        assert layout.lost(everyone - {1, 2}) == [2]
    if holders >= 4:
        assert layout.lost(everyone - {0, 2}) == []  # not neighbours: every slice has a copy
    empty = SliceLayout((2,), 4)  # slices 0 and 2 are empty: nothing to lose there
    assert empty.sizes() == [0, 1, 0, 1] and empty.lost({1}) == [3]


def test_cut_and_join_are_exact_and_keep_the_step_whole():
    gen = torch.Generator().manual_seed(0)
    shapes = [torch.Size((6, 6)), torch.Size((6,))]
    whole = [
        {"step": torch.tensor(3.0), "exp_avg": torch.randn(s, generator=gen), "exp_avg_sq": torch.rand(s, generator=gen)}
        for s in shapes
    ]
    params = [torch.empty(s) for s in shapes]
    for holders in (1, 3, 4, 5):
        layout = SliceLayout((36, 6), holders)
        slices = {s: [cut_state(whole[p.param], p, params[p.param]) for p in layout.pieces(s)] for s in range(holders)}
        for states, pieces in ((slices[s], layout.pieces(s)) for s in range(holders)):
            for state, piece in zip(states, pieces):
                assert state["exp_avg"].shape == (piece.numel,) and state["step"].shape == ()
        joined = join_slices(layout, shapes, slices)
        for got, want in zip(joined, whole):
            assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        with pytest.raises(RuntimeError, match="missing"):
            join_slices(layout, shapes, {s: v for s, v in slices.items() if s != holders - 1})
    # Never stepped: no state in any piece, none joined.
    layout = SliceLayout((36, 6), 2)
    assert join_slices(layout, shapes, {0: [{}], 1: [{}, {}]}) == [{}, {}]


@pytest.mark.parametrize("cls, kwargs", [
    (torch.optim.Adam, {}), (torch.optim.AdamW, {"weight_decay": 0.1}), (torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.01}),
])
def test_stepping_pieces_with_the_user_s_class_is_bit_equal_to_the_whole_step(cls, kwargs):
    """What each holder does: its class over views of its slices (uneven, crossing parameters)."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(37, 11), (11,), (5,)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    whole = [torch.nn.Parameter(t.clone()) for t in start]
    reference = cls(whole, lr=0.05, **kwargs)
    sharded = [torch.nn.Parameter(t.clone()) for t in start]
    layout = SliceLayout(tuple(p.numel() for p in sharded), 3)
    pieces = [(piece, torch.nn.Parameter(sharded[piece.param].data.view(-1)[piece.start:piece.stop]))
              for s in range(3) for piece in layout.pieces(s)]
    stepper = cls([shadow for _, shadow in pieces], lr=0.05, **kwargs)
    for step_grads in grads:
        for p, g in zip(whole, step_grads):
            p.grad = g.clone()
        reference.step()
        for piece, shadow in pieces:
            shadow.grad = step_grads[piece.param].view(-1)[piece.start:piece.stop]
        stepper.step()
    for got, want in zip(sharded, whole):
        assert torch.equal(got.detach(), want.detach())
    for piece, shadow in pieces:
        for key, value in reference.state[whole[piece.param]].items():
            expected = value if key == "step" else value.view(-1)[piece.start:piece.stop]
            assert torch.equal(stepper.state[shadow][key], expected), key


def test_stage_1_selects_the_layerwise_zero_unless_switched_off_or_under_a_deepspeed_wrapper():
    zero = {"zero_optimization": {"stage": 1}}
    assert layerwise_zero(zero) and not deepspeed_runs_zero(zero) and not wraps_optimizer(zero)
    assert for_deepspeed(zero) == {}  # DeepSpeed never sees it (it would wrap the optimizer)
    off = {"zero_optimization": {"stage": 1, "layerwise": False, "reduce_bucket_size": 10}}
    assert not layerwise_zero(off) and deepspeed_runs_zero(off) and wraps_optimizer(off)
    assert for_deepspeed(off) == {"zero_optimization": {"stage": 1, "reduce_bucket_size": 10}}  # the switch removed
    bf16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
    assert not layerwise_zero(bf16) and deepspeed_runs_zero(bf16)
    assert not layerwise_zero({}) and not layerwise_zero({"zero_optimization": {"stage": 0}})
    with pytest.raises(ConfigError, match=r"zero_optimization.layerwise.*bf16"):
        layerwise_zero({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1, "layerwise": True}})
    with pytest.raises(ConfigError, match=r"zero_optimization.layerwise"):
        layerwise_zero({"zero_optimization": {"stage": 1, "layerwise": "yes"}})
    with pytest.raises(ConfigError, match=r"offload_optimizer.*layerwise=False"):
        layerwise_zero({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})
    assert layerwise_zero({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}}})


def test_the_strategy_refuses_a_bad_switch_and_non_adam_optimizers_by_name():
    from resihp_lightning.state.zero_shards import check_optimizer
    from resihp_lightning.strategy.options import StrategyOptions

    with pytest.raises(ConfigError, match=r"zero_optimization.layerwise"):
        StrategyOptions(deepspeed_config={"fp16": {"enabled": True}, "zero_optimization": {"stage": 1, "layerwise": True}})
    check_optimizer(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]))
    with pytest.raises(ConfigError, match=r"torch.optim.Adam.*SGD.*layerwise=False"):
        check_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
