"""Parameters split over a tensor-parallel group: which dimension, and gathering the shards back.

Kept apart from :mod:`resihp_lightning.models.tensor_parallel` (which imports transformers) so that the
strategy's gradient reduction and checkpoints can read the marks without that import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


#: The attribute a parameter split over the group carries: the dimension its members' shards are cut
#: along (concatenating them in member order gives the unsplit tensor). Parameters without it (norms,
#: a row split's bias) are whole, and equal, on every member.
SPLIT_DIM = "resihp_split_dim"


def sharded_parameter(part: torch.Tensor, dim: int, requires_grad: bool) -> nn.Parameter:
    """A parameter holding (a copy of) ``part``, this member's shard of a tensor split along ``dim``."""
    param = nn.Parameter(part.clone(), requires_grad=requires_grad)
    setattr(param, SPLIT_DIM, dim)
    return param


def split_dim(tensor: torch.Tensor) -> int | None:
    """The dimension ``tensor`` (a parameter) is split along over its group, or ``None`` (whole)."""
    return getattr(tensor, SPLIT_DIM, None)


def gather_shards(tensors: Mapping[Any, torch.Tensor], dims: Mapping[Any, int], group: Any) -> dict[Any, torch.Tensor]:
    """The unsplit tensors on every member (collective over ``group``, in ``tensors``' key order).

    Args:
        tensors: this member's tensors by key (the same keys, in the same order, on every member).
        dims: the split dimension of each split key (:func:`split_dim`); keys not in it are whole and
            returned as they are.
        group: the tensor-parallel process group.
    """
    out = {}
    for key, tensor in tensors.items():
        dim = dims.get(key)
        if dim is None:
            out[key] = tensor
            continue
        out[key] = gather_along(tensor.detach(), dim, group)
    return out


def gather_along(tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The members' ``tensor`` concatenated along ``dim`` in member order, on every member (collective)."""
    _, size = group_shape(group)
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def shard_of(full: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This member's shard of an unsplit tensor split along ``dim`` (the inverse of :func:`gather_shards`)."""
    index, size = group_shape(group)
    return full.chunk(size, dim=dim)[index]


def group_shape(group: Any) -> tuple[int, int]:
    """(this process's index in ``group``, the group's size)."""
    return dist.get_rank(group), dist.get_world_size(group)
