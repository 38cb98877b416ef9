"""Layers built on the meta device: finding, allocating, filling and releasing their tensors in place.

A layer built under ``torch.device("meta")`` has shapes and dtypes but no storage. Per-stage loading
(:class:`~resihp_lightning.models.hf_checkpoint.HFLayerLoader`) gives storage only to the layers a
process holds; the others stay on meta. Every function here changes tensors *in place* with
:func:`torch.utils.swap_tensors`, so the ``Parameter`` objects stay the same objects: an optimizer
built over the module's parameters, tied parameters (one ``Parameter`` in two layers) and the
strategy's key maps keep working after a layer is loaded or released.

Non-persistent buffers (e.g. rotary-embedding frequencies) are neither in a checkpoint nor moved by a
migration, so a layer that is to be loaded or received must have them on a real device already.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor of a module lives.

    Attributes:
        owner: the submodule that holds it.
        attr: its name in ``owner`` (``"weight"``).
        name: its dotted name in the module (``"self_attn.q_proj.weight"``).
        is_parameter: a ``Parameter`` (else a buffer).
        persistent: it belongs in the state dict (parameters always do).
    """

    owner: nn.Module
    attr: str
    name: str
    is_parameter: bool
    persistent: bool

    @property
    def tensor(self) -> torch.Tensor:
        store = self.owner._parameters if self.is_parameter else self.owner._buffers
        return store[self.attr]


def tensor_slots(module: nn.Module) -> Iterator[TensorSlot]:
    """Every parameter and buffer of ``module`` (each object once), in ``named_parameters`` order."""
    seen: set[int] = set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        head = f"{prefix}." if prefix else ""
        for attr, param in sub._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                yield TensorSlot(sub, attr, head + attr, True, True)
        for attr, buf in sub._buffers.items():
            if buf is not None and id(buf) not in seen:
                seen.add(id(buf))
                yield TensorSlot(sub, attr, head + attr, False, attr not in sub._non_persistent_buffers_set)


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(slot.tensor.is_meta for slot in tensor_slots(module))


def meta_slots(module: nn.Module) -> list[TensorSlot]:
    """The tensors of ``module`` that are on the meta device."""
    return [slot for slot in tensor_slots(module) if slot.tensor.is_meta]


def fill(slot: TensorSlot, value: torch.Tensor) -> None:
    """Makes the tensor at ``slot`` hold ``value`` (same object; cast to its dtype, on ``value``'s device).

    Raises:
        ValueError: ``value`` has another shape.
    """
    current = slot.tensor
    if tuple(value.shape) != tuple(current.shape):
        raise ValueError(f"{slot.name}: shape {tuple(value.shape)}, the layer has {tuple(current.shape)}")
    value = value.detach().to(dtype=current.dtype)
    replacement = nn.Parameter(value, requires_grad=current.requires_grad) if slot.is_parameter else value
    try:
        torch.utils.swap_tensors(current, replacement)
    except RuntimeError:  # something pins the old tensor object: replace it instead (identity lost)
        store = slot.owner._parameters if slot.is_parameter else slot.owner._buffers
        store[slot.attr] = replacement


def allocate(module: nn.Module, device: torch.device | str) -> None:
    """Gives every meta tensor of ``module`` uninitialised storage on ``device`` (its values are to be
    written next, e.g. received from a peer).

    Raises:
        ValueError: a non-persistent buffer is on meta (nothing would ever write it).
    """
    for slot in meta_slots(module):
        if not slot.persistent:
            raise ValueError(
                f"non-persistent buffer {slot.name!r} is on the meta device: neither a checkpoint nor a migration "
                "writes it; build such buffers on a real device"
            )
        fill(slot, torch.empty(slot.tensor.shape, dtype=slot.tensor.dtype, device=device))


def release(module: nn.Module) -> None:
    """Moves every parameter and persistent buffer of ``module`` back to the meta device (frees their
    storage and gradients); non-persistent buffers stay (they are small and cannot be rebuilt)."""
    for slot in tensor_slots(module):
        tensor = slot.tensor
        if tensor.is_meta or not slot.persistent:
            continue
        if slot.is_parameter:
            tensor.grad = None
        fill(slot, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
