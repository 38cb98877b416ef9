"""The user's module and the pipeline's layers (:mod:`resihp_lightning.state.module_weights`): key maps,
the wire dtype, and trained values written back into layers."""

from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec
from torch import nn

from resihp_lightning.torch_utils.layer_tensors import layer_tensors
from resihp_lightning.state.module_weights import (
    DETACHED_PREFIX,
    LayerKeys,
    restore_full_precision,
    wire_dtype,
    write_trained,
)
from resihp_lightning.torch_utils import meta

BLOCKS = 12  # two-digit indices, so "layers.1" must not match "layers.10"


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 3)
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(BLOCKS))
        self.first = self.layers[0]  # the same layer under a second name
        self.extra = nn.Linear(1, 1)  # not a pipeline layer

    def pipeline_layers(self):
        return [self.embed, *self.layers, LayerSpec(nn.Linear, 3, 1)]


def _tensor_by_module_key(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict(keep_vars=True))


def test_layer_keys_name_each_pipeline_tensor_by_the_module_key_of_the_same_tensor():
    model = Model()
    layers = model.pipeline_layers()
    keys = LayerKeys(model, layers)
    by_key = _tensor_by_module_key(model)
    spec = len(layers) - 1
    assert [keys.is_attached(i) for i in range(len(layers))] == [True] * (len(layers) - 1) + [False]
    for index, layer in enumerate(layers[:-1]):
        for name, tensor in layer_tensors(layer).items():
            module_key = keys.to_module(f"{index}.{name}")
            assert by_key[module_key] is tensor
            assert keys.to_layer(module_key) == f"{index}.{name}"
    assert keys.to_module("11.weight") == "layers.10.weight"  # layer 11 is layers[10]
    assert keys.to_layer("layers.10.bias") == "11.bias" and keys.to_layer("layers.1.bias") == "2.bias"
    # The layer's second name maps back too; its first name is the one used.
    assert keys.to_layer("first.weight") == "1.weight" and keys.to_module("1.weight") == "layers.0.weight"
    # A LayerSpec is no attribute of the module: its tensors get the detached prefix.
    assert keys.to_module(f"{spec}.weight") == f"{DETACHED_PREFIX}.{spec}.weight"
    assert keys.to_layer(f"{DETACHED_PREFIX}.{spec}.bias") == f"{spec}.bias"
    # Tensors outside the pipeline layers have no pipeline key.
    assert keys.to_layer("extra.weight") is None and keys.to_layer("layers") is None


def test_module_state_dict_covers_the_pipeline_keys_exactly_once_plus_the_rest():
    model = Model()
    keys = LayerKeys(model, model.pipeline_layers())
    mapped = {k: keys.to_layer(k) for k in model.state_dict()}
    assert {k for k, v in mapped.items() if v is None} == {"extra.weight", "extra.bias"}
    expected = {f"{i}.{n}" for i, layer in enumerate(model.pipeline_layers()[:-1]) for n in layer.state_dict()}
    assert {v for v in mapped.values() if v is not None} == expected


def test_wire_dtype_is_float32_for_floating_tensors_of_a_casting_engine_only():
    half, whole = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.long)
    assert wire_dtype(half, cast=True) == torch.float32
    assert wire_dtype(half, cast=False) == torch.bfloat16
    assert wire_dtype(whole, cast=True) == torch.long
    assert wire_dtype(torch.zeros(1, dtype=torch.float64), cast=False) == torch.float64


def test_restore_full_precision_gives_cast_layers_their_master_values():
    torch.manual_seed(0)
    layers = {3: nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))}
    masters = {f"3.{n}": t.detach().clone() + (0.001 if t.is_floating_point() else 1) for n, t in layer_tensors(layers[3]).items()}
    params = [id(p) for p in layers[3].parameters()]
    layers[3].to(torch.bfloat16)
    counter = layers[3][1].num_batches_tracked
    restore_full_precision(layers, masters)
    for name, tensor in layer_tensors(layers[3]).items():
        if tensor.is_floating_point():
            assert tensor.dtype == torch.float32 and torch.equal(tensor, masters[f"3.{name}"])
    assert [id(p) for p in layers[3].parameters()] == params
    # Not floating: left alone (not even the value).
    assert layers[3][1].num_batches_tracked is counter and counter.item() == 0
    # Tensors without a trained value, or already in its dtype, are left alone.
    other = nn.Linear(2, 2).to(torch.bfloat16)
    before = other.weight.detach().clone()
    restore_full_precision({0: other}, {"0.bias": torch.zeros(2)})
    assert other.weight.dtype == torch.bfloat16 and torch.equal(other.weight, before)
    assert other.bias.dtype == torch.float32 and torch.equal(other.bias, torch.zeros(2))
    same = nn.Linear(2, 2)
    before = same.weight.detach().clone()
    restore_full_precision({0: same}, {"0.weight": torch.zeros(2, 2)})
    assert torch.equal(same.weight, before)


def test_write_trained_fills_layers_including_ones_on_meta():
    torch.manual_seed(1)
    trained_layers = {0: nn.Linear(3, 2), 1: nn.LayerNorm(2)}
    trained = {f"{i}.{n}": t.detach().clone() for i, layer in trained_layers.items() for n, t in layer_tensors(layer).items()}
    with torch.device("meta"):
        on_meta = nn.Linear(3, 2)
    targets = {0: on_meta, 1: nn.LayerNorm(2)}
    params = [id(p) for p in on_meta.parameters()]
    write_trained(targets, trained)
    assert not meta.has_meta(on_meta) and [id(p) for p in on_meta.parameters()] == params
    for index, layer in targets.items():
        for name, tensor in layer_tensors(layer).items():
            assert torch.equal(tensor, trained[f"{index}.{name}"])
