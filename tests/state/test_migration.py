"""What a layer move carries (:mod:`resihp_lightning.state.migration`), in one process: a layer's tensors,
and a rank that takes part in no transfer. Layers really moving between ranks: tests/state/test_wrapped_state.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from resihp_lightning.placement import Transfer
from resihp_lightning.state.migration import migrate
from resihp_lightning.torch_utils.layer_tensors import layer_tensors, persistent_buffers


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)  # running stats: persistent buffers
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def test_layer_tensors_are_the_parameters_then_the_persistent_buffers_as_live_objects():
    layer = Layer()
    tensors = layer_tensors(layer)
    params = [n for n, _ in layer.named_parameters()]
    assert list(tensors)[: len(params)] == params
    assert set(tensors) == set(layer.state_dict())  # what a checkpoint stores of the layer
    assert "scratch" not in tensors
    live = dict(layer.named_parameters(), **dict(layer.named_buffers()))
    assert all(tensors[name] is live[name] for name in tensors)
    assert set(persistent_buffers(layer)) == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    assert persistent_buffers(nn.Linear(2, 2)) == {}


def test_persistent_buffers_follow_the_state_dict_when_running_stats_are_off():
    norm = nn.BatchNorm1d(4, track_running_stats=False)
    assert persistent_buffers(norm) == {}
    assert set(layer_tensors(norm)) == {"weight", "bias"} == set(norm.state_dict())


def test_a_rank_in_no_transfer_sends_and_receives_nothing(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mine = {0: Layer()}
        before = {k: v.clone() for k, v in mine[0].state_dict().items()}
        transfers = [Transfer(layer=1, src=1, dst=2), Transfer(layer=2, src=2, dst=1)]  # among other ranks
        state = {mine[0].lin.weight: {"exp_avg": torch.ones(4, 3)}}
        sent, received = migrate(transfers, 0, mine, mine, state)
        assert (sent, received) == (0, {})
        assert all(torch.equal(v, before[k]) for k, v in mine[0].state_dict().items())
        assert migrate([], 0, mine, mine, {}) == (0, {})
    finally:
        dist.destroy_process_group()
