"""Parameters split over a tensor-parallel group (:mod:`resihp_lightning.torch_utils.shards`): the marks,
and shard / gather in a single-process gloo group (a group of one member holds the whole tensor)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from resihp_lightning.torch_utils.shards import (
    SPLIT_DIM,
    gather_along,
    gather_shards,
    group_shape,
    shard_of,
    sharded_parameter,
    split_dim,
)


@pytest.fixture
def group(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.new_group(ranks=[0])
    finally:
        dist.destroy_process_group()


def test_a_sharded_parameter_is_a_marked_copy():
    full = torch.arange(24.0).reshape(4, 6)
    part = full.chunk(2, dim=1)[1]
    param = sharded_parameter(part, 1, requires_grad=True)
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad
    assert split_dim(param) == 1 and getattr(param, SPLIT_DIM) == 1
    assert torch.equal(param, part) and param.data_ptr() != part.data_ptr()
    param.data.zero_()
    assert torch.equal(full[:, 3:], torch.arange(24.0).reshape(4, 6)[:, 3:])  # the source is untouched
    assert not sharded_parameter(part, 0, requires_grad=False).requires_grad
    assert split_dim(torch.nn.Parameter(torch.zeros(2))) is None
    assert split_dim(torch.zeros(2)) is None


def test_a_group_of_one_holds_the_whole_tensor(group):
    assert group_shape(group) == (0, 1)
    full = torch.randn(4, 6)
    for dim in (0, 1):
        assert torch.equal(shard_of(full, dim, group), full)
        assert torch.equal(gather_along(full, dim, group), full)


def test_gather_shards_joins_split_keys_and_passes_whole_ones(group):
    weight = sharded_parameter(torch.randn(3, 5), 0, requires_grad=True)
    bias = torch.randn(5)
    out = gather_shards({"w": weight, "b": bias}, {"w": split_dim(weight)}, group)
    assert list(out) == ["w", "b"]
    assert out["b"] is bias
    assert torch.equal(out["w"], weight.detach()) and not out["w"].requires_grad
    # shard_of is the inverse of the gather
    assert torch.equal(shard_of(out["w"], 0, group), weight.detach())
