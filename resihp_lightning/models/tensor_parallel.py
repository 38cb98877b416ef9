"""Tensor-parallel splits of a Llama / Qwen2 decoder layer (step 1 of ``docs/tensor_parallel.md``).

Not used by the strategy yet: a pipeline stage still runs on one device. These are the building
blocks, tested against the unsplit layer on real gloo processes (``tests/test_tensor_parallel.py``).

A group of ``t`` processes holds one decoder layer split Megatron-style:

* attention: ``q_proj``, ``k_proj`` and ``v_proj`` by output rows into whole heads (member ``i``
  keeps query heads ``i*H/t .. (i+1)*H/t - 1`` and the key-value heads they use, so grouped-query
  attention keeps its head-to-group mapping), ``o_proj`` by input columns;
* MLP: ``gate_proj`` and ``up_proj`` by output rows, ``down_proj`` by input columns.

A column-split linear (:class:`ColumnParallelLinear`) sees the whole input and produces this member's
share of the outputs; its input's gradient is summed over the group in the backward pass (each
member only has its share's contribution). A row-split linear (:class:`RowParallelLinear`) takes this
member's share of the inputs and sums the partial products over the group in the forward pass; a
bias is added once, after the sum. Everything else of the layer (the RMSNorms, the rotary embedding,
the attention kernel) runs unchanged on every member: Hugging Face's attention module sizes its
heads from the projections' outputs (``view(..., -1, head_dim)``), so it runs on the local heads as
it is. The replicated RMSNorm weights get the full gradient on every member.

Each split linear brings its own collective, so the layer does three input-gradient all-reduces for
attention and two for the MLP where one each would do; fusing them is an optimisation for later.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from resihp_lightning.errors import ConfigError


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the gradient is summed over the group (the input of a column split)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # noqa: D102
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the group (the partial products of a row split); identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # noqa: D102
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return grad, None


def _group_shape(group: Any) -> tuple[int, int]:
    """(this process's index in ``group``, the group's size)."""
    return dist.get_rank(group), dist.get_world_size(group)


class ColumnParallelLinear(nn.Module):
    """This member's output rows of a linear layer: ``y_i = x W_i^T + b_i``.

    Args:
        linear: the unsplit layer (its weight is ``[out, in]``).
        group: the tensor-parallel process group.
        unit: rows that stay together (a head's ``head_dim``): ``out`` must split into whole units,
            as many on every member.
    """

    def __init__(self, linear: nn.Linear, group: Any, unit: int = 1) -> None:
        super().__init__()
        index, size = _group_shape(group)
        rows = _share(linear.out_features, size, unit, "output features")
        self.group = group
        self.in_features, self.out_features = linear.in_features, rows
        part = slice(index * rows, (index + 1) * rows)
        self.weight = nn.Parameter(linear.weight.detach()[part].clone(), requires_grad=linear.weight.requires_grad)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[part].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_SumGradOverGroup.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This member's input columns of a linear layer; the partial products are summed over the group:
    ``y = sum_i x_i W_i^T + b``.

    Args:
        linear: the unsplit layer (its weight is ``[out, in]``).
        group: the tensor-parallel process group.
        unit: columns that stay together (a head's ``head_dim``).
    """

    def __init__(self, linear: nn.Linear, group: Any, unit: int = 1) -> None:
        super().__init__()
        index, size = _group_shape(group)
        cols = _share(linear.in_features, size, unit, "input features")
        self.group = group
        self.in_features, self.out_features = cols, linear.out_features
        part = slice(index * cols, (index + 1) * cols)
        self.weight = nn.Parameter(linear.weight.detach()[:, part].clone(), requires_grad=linear.weight.requires_grad)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _SumOverGroup.apply(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


def _share(total: int, size: int, unit: int, what: str) -> int:
    if total % (size * unit):
        raise ConfigError(f"{total} {what} do not split into {size} equal parts of whole {unit}-wide units")
    return total // size


def split_decoder_layer(layer: nn.Module, group: Any) -> nn.Module:
    """Splits a Hugging Face Llama / Qwen2 decoder layer over ``group`` in place (module docstring).

    Every member calls it with the same unsplit layer (e.g. built from one seed or one checkpoint)
    and keeps its own share.

    Args:
        layer: a ``LlamaDecoderLayer`` / ``Qwen2DecoderLayer`` (``self_attn`` and ``mlp`` with the
            usual projections).
        group: the tensor-parallel process group (its size t must divide the query heads, the
            key-value heads and the MLP's intermediate size).

    Returns:
        ``layer``, with its projections replaced.

    Raises:
        ConfigError: the heads or the intermediate size do not split into t equal parts.
    """
    size = dist.get_world_size(group)
    attn, mlp = layer.self_attn, layer.mlp
    config = attn.config
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
    if heads % size or kv_heads % size:
        raise ConfigError(
            f"a tensor-parallel group of {size} needs query heads ({heads}) and key-value heads ({kv_heads}) "
            f"divisible by {size}"
        )
    attn.q_proj = ColumnParallelLinear(attn.q_proj, group, unit=head_dim)
    attn.k_proj = ColumnParallelLinear(attn.k_proj, group, unit=head_dim)
    attn.v_proj = ColumnParallelLinear(attn.v_proj, group, unit=head_dim)
    attn.o_proj = RowParallelLinear(attn.o_proj, group, unit=head_dim)
    mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, group)
    mlp.up_proj = ColumnParallelLinear(mlp.up_proj, group)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, group)
    return layer
