"""The tensors that make up a pipeline layer's state: parameters and persistent buffers, by name."""

from __future__ import annotations

import torch
from torch import nn


def layer_tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    """A layer's parameters and persistent buffers (e.g. running stats) by name, in a fixed order: what
    its new owner needs, and what a checkpoint stores of it."""
    out: dict[str, torch.Tensor] = dict(layer.named_parameters())
    out.update(persistent_buffers(layer))
    return out


def persistent_buffers(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers of ``layer`` that belong in its state dict."""
    keys = set(layer.state_dict(keep_vars=True))
    return {name: b for name, b in layer.named_buffers() if name in keys}
