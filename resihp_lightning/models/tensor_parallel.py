"""Tensor-parallel splits of a Llama / Qwen2 causal LM (``docs/tensor_parallel.md``).

``CausalLMPipelineModule`` hands them to ``ResiHPStrategy(tensor_degree=t)``; tested against the
unsplit layer on real gloo processes (``tests/models/test_tensor_parallel.py``) and in a whole job
(``tests/tensor/test_tensor_parallel_strategy.py``). Split parameters carry their split dimension
(:mod:`resihp_lightning.torch_utils.shards`), so the strategy gathers them whole for checkpoints.

A group of ``t`` processes holds one decoder layer split Megatron-style:

* attention: ``q_proj``, ``k_proj`` and ``v_proj`` by output rows into whole heads (member ``i``
  keeps query heads ``i*H/t .. (i+1)*H/t - 1`` and the key-value heads they use, so grouped-query
  attention keeps its head-to-group mapping), ``o_proj`` by input columns;
* MLP: ``gate_proj`` and ``up_proj`` by output rows, ``down_proj`` by input columns;
* the token embedding and the LM head by vocabulary rows (:class:`VocabParallelEmbedding`, a
  column-split head), with the cross-entropy computed on the split logits
  (:func:`vocab_parallel_causal_lm_loss`): no member ever holds a whole row of logits.

A column-split linear (:class:`ColumnParallelLinear`) sees the whole input and produces this member's
share of the outputs; its input's gradient is summed over the group in the backward pass (each
member only has its share's contribution). A row-split linear (:class:`RowParallelLinear`) takes this
member's share of the inputs and sums the partial products over the group in the forward pass; a
bias is added once, after the sum. Everything else of the layer (the RMSNorms, the rotary embedding,
the attention kernel) runs unchanged on every member: Hugging Face's attention module sizes its
heads from the projections' outputs (``view(..., -1, head_dim)``), so it runs on the local heads as
it is. The replicated RMSNorm weights get the full gradient on every member.

In a decoder layer the column splits that share an input (q, k, v; gate, up) leave the gradient sum
to one all-reduce on the attention's and the MLP's input (a forward pre-hook), so a layer runs four
all-reduces per micro-batch: two forward, two backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from resihp_lightning.errors import ConfigError
from resihp_lightning.models.layers import IGNORE_INDEX, DecoderPipe, EmbeddingPipe, HeadPipe
from resihp_lightning.torch_utils.shards import group_shape, sharded_parameter
from resihp_lightning.torch_utils.wait_clock import timed_all_reduce


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the gradient is summed over the group (the input of a column split)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # noqa: D102
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        grad = grad.contiguous().clone()
        timed_all_reduce(grad, ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the group (the partial products of a row split); identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # noqa: D102
        out = x.contiguous().clone()
        timed_all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return grad, None


class ColumnParallelLinear(nn.Module):
    """This member's output rows of a linear layer: ``y_i = x W_i^T + b_i``.

    Args:
        linear: the unsplit layer (its weight is ``[out, in]``).
        group: the tensor-parallel process group.
        unit: rows that stay together (a head's ``head_dim``): ``out`` must split into whole units,
            as many on every member.
        sum_input_grad: sum the input's gradient over the group here; ``False`` when the caller
            does it once for several splits of the same input.
    """

    def __init__(self, linear: nn.Linear, group: Any, unit: int = 1, sum_input_grad: bool = True) -> None:
        super().__init__()
        index, size = group_shape(group)
        rows = _share(linear.out_features, size, unit, "output features")
        self.group, self.sum_input_grad = group, sum_input_grad
        self.in_features, self.out_features = linear.in_features, rows
        part = slice(index * rows, (index + 1) * rows)
        self.weight = sharded_parameter(linear.weight.detach()[part], 0, linear.weight.requires_grad)
        self.bias = None if linear.bias is None else sharded_parameter(linear.bias.detach()[part], 0, linear.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sum_input_grad:
            x = _SumGradOverGroup.apply(x, self.group)
        return F.linear(x, self.weight, self.bias)


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
        index, size = group_shape(group)
        cols = _share(linear.in_features, size, unit, "input features")
        self.group = group
        self.in_features, self.out_features = cols, linear.out_features
        part = slice(index * cols, (index + 1) * cols)
        self.weight = sharded_parameter(linear.weight.detach()[:, part], 1, linear.weight.requires_grad)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=linear.bias.requires_grad)

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
    attn.q_proj = ColumnParallelLinear(attn.q_proj, group, unit=head_dim, sum_input_grad=False)
    attn.k_proj = ColumnParallelLinear(attn.k_proj, group, unit=head_dim, sum_input_grad=False)
    attn.v_proj = ColumnParallelLinear(attn.v_proj, group, unit=head_dim, sum_input_grad=False)
    attn.o_proj = RowParallelLinear(attn.o_proj, group, unit=head_dim)
    mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, group, sum_input_grad=False)
    mlp.up_proj = ColumnParallelLinear(mlp.up_proj, group, sum_input_grad=False)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, group)
    for module in (attn, mlp):
        module.register_forward_pre_hook(_InputGradSum(group), with_kwargs=True)
    return layer


class _InputGradSum:
    """Forward pre-hook: the module's input (``hidden_states``, by keyword or first argument) gets its
    gradient summed over the group, once for all the column splits that read it."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": _SumGradOverGroup.apply(kwargs["hidden_states"], self.group)}
        elif args:
            args = (_SumGradOverGroup.apply(args[0], self.group), *args[1:])
        else:
            raise ConfigError(f"{type(module).__name__} was called without its hidden states")
        return args, kwargs


class VocabParallelEmbedding(nn.Module):
    """This member's vocabulary rows of a token embedding; a token outside them looks up zeros, and
    the members' lookups are summed over the group (exactly one member holds each token).

    Args:
        embedding: the unsplit ``nn.Embedding`` (its vocabulary must split into equal parts).
        group: the tensor-parallel process group.
    """

    def __init__(self, embedding: nn.Embedding, group: Any) -> None:
        super().__init__()
        index, size = group_shape(group)
        rows = _share(embedding.num_embeddings, size, 1, "vocabulary rows")
        self.group, self.start, self.rows = group, index * rows, rows
        self.weight = sharded_parameter(embedding.weight.detach()[self.start:self.start + rows], 0,
                               embedding.weight.requires_grad)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.start) & (input_ids < self.start + self.rows)
        local = torch.where(mine, input_ids - self.start, torch.zeros_like(input_ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return _SumOverGroup.apply(out, self.group)


def vocab_parallel_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, group: Any) -> torch.Tensor:
    """:func:`~resihp_lightning.models.layers.causal_lm_loss` on vocabulary-split logits.

    Every member passes its share of the logits (``[rows, S, V / t]``, vocabulary rows in member
    order) and the same labels, and gets the same loss. The softmax's normaliser and each label's logit
    are summed over the group; the shift by the row maximum (for stability) is taken over the whole
    vocabulary and has no gradient (it cancels).

    Args:
        logits: this member's logits.
        labels: ``[rows, S]`` long, already shifted, :data:`~resihp_lightning.models.layers.IGNORE_INDEX`
            where no token is predicted.
        group: the tensor-parallel process group.

    Returns:
        Scalar loss (float32): the mean over the valid tokens (0 with a graph when there is none).
    """
    index, _ = group_shape(group)
    local = logits.float()
    width = local.shape[-1]
    labels = labels.to(local.device)
    top = local.detach().amax(dim=-1)
    timed_all_reduce(top, group, op=dist.ReduceOp.MAX)
    shifted = local - top.unsqueeze(-1)
    start = index * width
    valid = labels != IGNORE_INDEX
    mine = valid & (labels >= start) & (labels < start + width)
    picked = shifted.gather(-1, (labels - start).clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    picked = _SumOverGroup.apply(picked * mine.to(picked.dtype), group)
    normaliser = _SumOverGroup.apply(shifted.exp().sum(dim=-1), group)
    per_token = (torch.log(normaliser) - picked) * valid.to(picked.dtype)
    return per_token.sum() / valid.sum().clamp(min=1)


def split_pipeline_layers(layers: list[nn.Module], group: Any) -> list[nn.Module]:
    """Splits a causal LM's pipeline layers (:mod:`~resihp_lightning.models.layers`) over ``group`` in
    place: the embedding and the LM head by vocabulary rows, every decoder layer by
    :func:`split_decoder_layer`. The head then returns this member's logits, for
    :func:`vocab_parallel_causal_lm_loss`.

    Raises:
        ConfigError: a layer of another kind, or sizes that do not split into equal parts.
    """
    for position, layer in enumerate(layers):
        if isinstance(layer, EmbeddingPipe):
            layer.embed_tokens = VocabParallelEmbedding(layer.embed_tokens, group)
        elif isinstance(layer, DecoderPipe):
            split_decoder_layer(layer.layer, group)
        elif isinstance(layer, HeadPipe):
            layer.lm_head = ColumnParallelLinear(layer.lm_head, group)
        else:
            raise ConfigError(f"pipeline layer {position} ({type(layer).__name__}) has no tensor-parallel split")
    return layers
