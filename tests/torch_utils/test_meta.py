"""Layers on the meta device (:mod:`resihp_lightning.torch_utils.meta`): finding, allocating, filling and
releasing their tensors in place, keeping the Parameter objects."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from resihp_lightning.torch_utils import meta


class Layer(nn.Module):
    """Two linears sharing one weight, a norm, a persistent and a non-persistent buffer."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        with torch.device(device):
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight  # tied
            self.norm = nn.LayerNorm(4)
            self.register_buffer("count", torch.zeros(3, dtype=torch.long))
        self.register_buffer("freqs", torch.arange(4.0), persistent=False)  # built on a real device


#: The state-dict tensors of a Layer, each object once (the tied weight under its first name).
PERSISTENT = {"a.weight", "a.bias", "b.bias", "norm.weight", "norm.bias", "count"}


def test_slots_are_every_parameter_and_buffer_once_with_names_and_persistence():
    layer = Layer()
    slots = list(meta.tensor_slots(layer))
    assert [s.name for s in slots if s.is_parameter] == [n for n, _ in layer.named_parameters()]
    assert [s.name for s in slots if not s.is_parameter] == [n for n, _ in layer.named_buffers()]
    assert len({id(s.tensor) for s in slots}) == len(slots)  # the tied weight once
    state = layer.state_dict()
    for slot in slots:
        assert slot.persistent == (slot.name in state)
        assert slot.tensor is dict(layer.named_parameters(), **dict(layer.named_buffers()))[slot.name]
    assert {s.name for s in slots if not s.persistent} == {"freqs"}


def test_meta_layer_allocated_and_filled_keeps_its_parameter_objects():
    layer = Layer("meta")
    assert meta.has_meta(layer)
    assert {s.name for s in meta.meta_slots(layer)} == PERSISTENT  # freqs is real
    params = [id(p) for p in layer.parameters()]
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    meta.allocate(layer, "cpu")
    assert not meta.has_meta(layer) and meta.meta_slots(layer) == []
    assert [id(p) for p in layer.parameters()] == params
    reference = Layer()
    for slot in meta.tensor_slots(layer):
        meta.fill(slot, dict(reference.state_dict(keep_vars=True))[slot.name] if slot.persistent else slot.tensor)
    assert [id(p) for p in layer.parameters()] == params
    for key, value in reference.state_dict().items():
        assert torch.equal(layer.state_dict()[key], value)
    assert layer.b.weight is layer.a.weight  # still tied
    # The optimizer built over the meta parameters trains the filled ones.
    x = torch.randn(2, 4)
    layer.norm(layer.b(layer.a(x))).sum().backward()
    before = layer.a.weight.detach().clone()
    optimizer.step()
    assert torch.equal(layer.a.weight, before - 0.5 * layer.a.weight.grad)


def test_fill_casts_to_the_slot_dtype_and_refuses_another_shape():
    layer = Layer()
    slot = next(s for s in meta.tensor_slots(layer) if s.name == "count")
    meta.fill(slot, torch.tensor([1.7, 2.2, 3.9], dtype=torch.float64))
    assert layer.count.dtype == torch.long and layer.count.tolist() == [1, 2, 3]
    weight = next(s for s in meta.tensor_slots(layer) if s.name == "a.weight")
    with pytest.raises(ValueError, match=r"a\.weight: shape \(2, 4\), the layer has \(4, 4\)"):
        meta.fill(weight, torch.zeros(2, 4))
    frozen = nn.Linear(2, 2)
    frozen.weight.requires_grad_(False)
    meta.fill(next(meta.tensor_slots(frozen)), torch.ones(2, 2))
    assert isinstance(frozen.weight, nn.Parameter) and not frozen.weight.requires_grad


def test_release_frees_parameters_and_persistent_buffers_but_keeps_non_persistent_ones():
    layer = Layer()
    layer.a(torch.randn(1, 4)).sum().backward()
    params = [id(p) for p in layer.parameters()]
    meta.release(layer)
    assert all(p.is_meta and p.grad is None for p in layer.parameters())
    assert layer.count.is_meta and not layer.freqs.is_meta
    assert torch.equal(layer.freqs, torch.arange(4.0))
    assert [id(p) for p in layer.parameters()] == params
    assert {s.name for s in meta.meta_slots(layer)} == PERSISTENT
    meta.allocate(layer, "cpu")  # and back
    assert not meta.has_meta(layer) and [id(p) for p in layer.parameters()] == params


def test_allocate_refuses_a_non_persistent_buffer_on_meta():
    layer = nn.Module()
    layer.register_buffer("freqs", torch.empty(4, device="meta"), persistent=False)
    with pytest.raises(ValueError, match=r"non-persistent buffer 'freqs' is on the meta device"):
        meta.allocate(layer, "cpu")
