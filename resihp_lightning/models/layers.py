"""Pipeline layers built from Hugging Face Llama / Qwen2 modules.

A causal LM becomes ``L + 2`` layers in model order:

* :class:`EmbeddingPipe` — ``(input_ids, position_ids, seq_lens) -> (hidden, position_ids, seq_lens)``
* :class:`DecoderPipe` — one per HF decoder layer, ``(hidden, position_ids, seq_lens) -> same``
* :class:`HeadPipe` — final RMSNorm + LM head, ``(hidden, position_ids, seq_lens) -> logits``

The tuple that travels between pipeline stages is ``(hidden float [rows, S, H], position_ids long
[rows, S], seq_lens long [rows, max_docs])``: DeepSpeed's ``PipelineModule`` sends tensors (and tuples
of tensors) between stages and carries integer tensors without gradients. Each decoder layer
recomputes the rotary cos/sin from ``position_ids`` with HF's own rotary module (cheap: O(S·head_dim)),
so nothing else needs to cross a stage boundary.

The HF modules are used as they are (``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, their RMSNorm and
rotary embedding), so the logits equal HF's; only the attention kernel is swapped for the
per-document one in :mod:`resihp_lightning.models.attention` through HF's attention interface.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from resihp_lightning.models import attention as _attention  # registers the packed attention

Activations = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

#: The label of a token that is not trained (cross-entropy's ``ignore_index``).
IGNORE_INDEX = -100


class EmbeddingPipe(nn.Module):
    """Token embedding: the first pipeline layer.

    Args:
        embed_tokens: the HF ``nn.Embedding`` (``model.embed_tokens``).
    """

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, inputs: Activations) -> Activations:
        """Embeds ``input_ids``; passes ``position_ids`` and ``seq_lens`` on unchanged."""
        input_ids, position_ids, seq_lens = inputs
        return self.embed_tokens(input_ids), position_ids, seq_lens


class DecoderPipe(nn.Module):
    """One HF decoder layer with per-document attention.

    Args:
        layer: an HF decoder layer whose config's ``_attn_implementation`` is
            :data:`~resihp_lightning.models.attention.PACKED_ATTENTION`.
        rotary_emb: the HF rotary-embedding module of the model (its buffers are not persistent, so
            it adds nothing to the state dict).
    """

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb

    def forward(self, inputs: Activations) -> Activations:
        """Runs the decoder layer; documents of a row attend only within themselves."""
        hidden, position_ids, seq_lens = inputs
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        hidden = self.layer(
            hidden,
            attention_mask=None,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            packed_seq_lens=seq_lens,
        )
        return hidden, position_ids, seq_lens


class HeadPipe(nn.Module):
    """Final RMSNorm and LM head: the last pipeline layer.

    With ``tie_word_embeddings`` the head holds its own copy of the embedding matrix (the embedding
    and the head usually live on different stages); see
    :func:`resihp_lightning.models.hf_checkpoint.save_hf_checkpoint` for how that is saved.

    Args:
        norm: the HF final RMSNorm (``model.norm``).
        lm_head: the HF ``lm_head`` linear layer (untied from the embedding).
    """

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, inputs: Activations) -> torch.Tensor:
        """Returns logits ``[rows, S, vocab]``."""
        hidden = inputs[0]
        return self.lm_head(self.norm(hidden))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy of a micro-batch.

    Labels are already shifted (``labels[t]`` is the token after ``t`` in the same document) and
    are :data:`IGNORE_INDEX` at document ends and padding, so this is Σ CE over valid tokens divided
    by their count. A micro-batch with no valid token gives 0 (with a graph, so backward works).

    Args:
        logits: ``[rows, S, vocab]``.
        labels: ``[rows, S]`` long.

    Returns:
        Scalar loss (float32).
    """
    flat_logits = logits.float().reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).to(flat_logits.device)
    total = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    count = (flat_labels != IGNORE_INDEX).sum().clamp(min=1)
    return total / count


__all__ = ["Activations", "DecoderPipe", "EmbeddingPipe", "HeadPipe", "IGNORE_INDEX", "causal_lm_loss"]
_ = _attention
