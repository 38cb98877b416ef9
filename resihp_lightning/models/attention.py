"""Per-document causal attention for packed rows, plugged into Hugging Face's attention interface.

A packed row holds several documents back to back. Each document must attend only to itself
(causally), and the attention work must grow with Σ len² rather than with row_len²: that
variability is what the straggler detector has to see through. The function below receives the
query/key/value that Hugging Face's own attention module has already projected and rotated
(so the maths outside the softmax is HF's, bit for bit) and runs
``torch.nn.functional.scaled_dot_product_attention`` once per document.

The documents of each row are described by ``seq_lens``: a ``LongTensor [rows, max_docs]`` of
per-document lengths, zero-padded; positions past Σ lens in a row are padding and get a zero
attention output (their labels are ignored by the loss).

It is registered under :data:`PACKED_ATTENTION` in ``transformers.AttentionInterface`` when this
module is imported; a model uses it when its config's ``_attn_implementation`` names it and the
decoder layer is called with ``packed_seq_lens=seq_lens``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from resihp_lightning.errors import ConfigError

PACKED_ATTENTION = "resihp_packed"
"""Name of the per-document attention in Hugging Face's ``AttentionInterface``."""


def positions_from_seq_lens(seq_lens: torch.Tensor, row_len: int) -> torch.Tensor:
    """Builds ``position_ids [rows, row_len]`` that restart at 0 for every document.

    Args:
        seq_lens: ``[rows, max_docs]`` per-document lengths, zero-padded.
        row_len: tokens per row.

    Returns:
        Long tensor of positions; padding positions (past Σ lens) are 0.
    """
    rows = seq_lens.shape[0]
    out = torch.zeros(rows, row_len, dtype=torch.long, device=seq_lens.device)
    for r, lens in enumerate(seq_lens.tolist()):
        start = 0
        for n in lens:
            if n > 0:
                out[r, start : start + n] = torch.arange(n, device=seq_lens.device)
                start += n
    return out


def _doc_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, dropout: float, window: int | None
) -> torch.Tensor:
    """Causal SDPA over one document; q/k/v are ``[1, heads, len, head_dim]``."""
    n = q.shape[-2]
    if window is None or n <= window:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling)
    # Sliding window (Qwen2's `sliding_attention` layers): query i sees keys j with i - window < j <= i.
    i = torch.arange(n, device=q.device)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scaling)


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    packed_seq_lens: torch.Tensor | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-interface function: causal attention within each packed document.

    Args:
        module: the HF attention module (for ``num_key_value_groups``).
        query: ``[rows, heads, row_len, head_dim]`` (already rotated).
        key: ``[rows, kv_heads, row_len, head_dim]``.
        value: ``[rows, kv_heads, row_len, head_dim]``.
        attention_mask: ignored; document boundaries come from ``packed_seq_lens``.
        scaling: softmax scale (HF passes ``head_dim ** -0.5``).
        dropout: attention dropout probability.
        packed_seq_lens: ``[rows, max_docs]`` per-document lengths; ``None`` means one document per row.
        sliding_window: Qwen2 sliding-window size for this layer, or ``None``.
        **kwargs: other HF keyword arguments (ignored).

    Returns:
        ``(attn_output [rows, row_len, heads, head_dim], None)`` as HF's attention functions return.
    """
    del attention_mask, kwargs
    rows, heads, row_len, head_dim = query.shape
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if packed_seq_lens is None:
        lens_per_row = [[row_len]] * rows
    else:
        lens_per_row = packed_seq_lens.tolist()
    row_outputs = []
    for r, lens in enumerate(lens_per_row):
        pieces, start = [], 0
        for n in lens:
            if n <= 0:
                continue
            end = start + n
            if end > row_len:
                raise ConfigError(f"packed_seq_lens of row {r} sum to more than the row length {row_len}")
            sl = slice(start, end)
            q, k, v = query[r : r + 1, :, sl], key[r : r + 1, :, sl], value[r : r + 1, :, sl]
            pieces.append(_doc_attention(q, k, v, scaling, dropout, sliding_window))
            start = end
        if start < row_len:  # padding tail: no attention, zero output
            pieces.append(query.new_zeros(1, heads, row_len - start, head_dim))
        row_outputs.append(torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0])
    out = torch.cat(row_outputs, dim=0) if rows > 1 else row_outputs[0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
