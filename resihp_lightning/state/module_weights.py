"""The user's LightningModule and the pipeline's layers: key names, and the trained weights back.

The pipeline addresses a tensor as ``"<layer index>.<name in the layer>"`` (the same under every
plan). The user's LightningModule addresses it by its own ``state_dict`` key, e.g.
``"layers.3.self_attn.q_proj.weight"`` when ``pipeline_layers()`` returned ``self.layers``.
:class:`LayerKeys` maps between the two, so checkpoints carry the module's own keys (a plain
``Model.load_from_checkpoint(path)`` works) while the strategy still loads each rank's layers by index.
Layers given as DeepSpeed ``LayerSpec`` are not attributes of the module; their tensors are saved
under ``"pipeline_layers.<index>.<name>"``.

During training a rank's LightningModule holds current values only for its own layers (the pipe
runs the module's own layer objects); :func:`sync_module_layers` copies every layer's trained values
into the module on the ranks that ask for them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from resihp_lightning.torch_utils import meta
from resihp_lightning.placement import owners
from resihp_lightning.plan import Plan
from resihp_lightning.torch_utils.layer_tensors import layer_tensors

#: Key prefix of layers that are not attributes of the LightningModule (DeepSpeed ``LayerSpec``).
DETACHED_PREFIX = "pipeline_layers"


class LayerKeys:
    """Maps pipeline keys ``"<layer>.<name>"`` to the LightningModule's ``state_dict`` keys and back.

    Args:
        module: the user's LightningModule.
        layers: ``module.pipeline_layers()``.
    """

    def __init__(self, module: nn.Module, layers: Sequence[Any]) -> None:
        names: dict[int, list[str]] = {}
        for name, sub in module.named_modules(remove_duplicate=False):
            if name:
                names.setdefault(id(sub), []).append(name)
        self._prefix: list[str] = []
        self._layer_of_prefix: dict[str, int] = {}
        self._attached: list[bool] = []
        for index, layer in enumerate(layers):
            found = names.get(id(layer)) if isinstance(layer, nn.Module) else None
            prefixes = found or [f"{DETACHED_PREFIX}.{index}"]
            self._prefix.append(prefixes[0])
            self._attached.append(bool(found))
            for prefix in prefixes:
                self._layer_of_prefix[prefix] = index

    def is_attached(self, layer: int) -> bool:
        """Whether layer ``layer`` is a submodule of the LightningModule (not a ``LayerSpec``)."""
        return self._attached[layer]

    def to_module(self, key: str) -> str:
        """``"3.weight"`` -> the module's key of that tensor (its first name, if it has several)."""
        layer, _, name = key.partition(".")
        return f"{self._prefix[int(layer)]}.{name}"

    def to_layer(self, key: str) -> str | None:
        """A module key -> ``"<layer>.<name>"``, or ``None`` when the tensor is not in a pipeline layer."""
        parts = key.split(".")
        for cut in range(1, len(parts)):
            layer = self._layer_of_prefix.get(".".join(parts[:cut]))
            if layer is not None:
                return f"{layer}." + ".".join(parts[cut:])
        return None


def wire_dtype(tensor: Tensor, cast: bool) -> torch.dtype:
    """The dtype a tensor's trained value travels in: float32 for floating tensors of an engine that
    casts the model (bf16 / fp16, whose masters are fp32), else the tensor's own dtype."""
    return torch.float32 if cast and tensor.is_floating_point() else tensor.dtype


def restore_full_precision(local_layers: Mapping[int, nn.Module], trained: Mapping[str, Tensor]) -> None:
    """Gives this rank's layers their full-precision trained values (the fp32 masters of a bf16 / fp16 engine).

    The engine cast the layers' floating tensors in place; training is over, so they take the master
    values (and dtype) back. Tensors already in the trained value's dtype are left alone.
    """
    with torch.no_grad():
        for index, layer in local_layers.items():
            for name, tensor in layer_tensors(layer).items():
                value = trained.get(f"{index}.{name}")
                if value is not None and tensor.is_floating_point() and tensor.dtype != value.dtype:
                    tensor.data = value.detach().clone()


def write_trained(layers: Mapping[int, nn.Module], trained: Mapping[str, Tensor]) -> None:
    """Copies trained values into layers that did not train themselves (with tensor parallelism, the
    module's unsplit layers, whose split copies trained; ``trained`` holds the gathered whole values)."""
    with torch.no_grad():
        for index, layer in layers.items():
            if meta.has_meta(layer):  # a layer loaded per stage went back to meta once split
                meta.allocate(layer, next(iter(trained.values())).device)
            for name, tensor in layer_tensors(layer).items():
                value = trained.get(f"{index}.{name}")
                if value is not None:
                    tensor.copy_(value)


def sync_module_layers(
    plan: Plan,
    rank: int,
    layers: Sequence[Any],
    keys: LayerKeys,
    trained: Mapping[str, Tensor],
    receivers: Collection[int] | None,
    cast: bool,
) -> None:
    """Writes every attached layer's trained values into the LightningModule of ``receivers`` (collective).

    Each layer comes from its holder in the plan's first replica. Floating tensors of an engine that
    casts the model travel as float32 (its fp32 master values; call :func:`restore_full_precision`
    first so that the holders' own layers are float32 again). A receiver's layer still on the meta
    device (per-stage loading) first gets storage, on the device of this rank's own layers.

    Args:
        plan: the plan in force (device ids are ranks of the current process group).
        rank: this process's rank.
        layers: ``pipeline_layers()`` (the module's own layer objects, or ``LayerSpec``).
        keys: the module's key map (``LayerSpec`` layers are skipped: they are not in the module).
        trained: this rank's trained values by pipeline key (fp32 masters under a wrapper).
        receivers: ranks that get the whole model (``None``: every rank).
        cast: whether the engine cast the model to bf16 / fp16.
    """
    everyone = receivers is None
    device = next((t.device for t in trained.values()), torch.device("cpu"))
    for index, layer in enumerate(layers):
        if not keys.is_attached(index):
            continue
        source = owners(plan, index)[0]
        if rank == source:
            values = [trained[f"{index}.{name}"].detach().to(wire_dtype(t, cast)) for name, t in layer_tensors(layer).items()]
            if everyone:
                for value in values:
                    dist.broadcast(value, src=source)
            else:
                ops = [dist.P2POp(dist.isend, v, dst) for v in values for dst in sorted(receivers) if dst != source]
                for work in dist.batch_isend_irecv(ops) if ops else ():
                    work.wait()
            continue
        if not everyone and rank not in receivers:
            continue
        meta.allocate(layer, device)
        tensors = list(layer_tensors(layer).values())
        buffers = [torch.empty(t.shape, dtype=wire_dtype(t, cast), device=t.device) for t in tensors]
        if everyone:
            for buffer in buffers:
                dist.broadcast(buffer, src=source)
        else:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, source) for b in buffers]):
                work.wait()
        with torch.no_grad():
            for tensor, buffer in zip(tensors, buffers):
                tensor.copy_(buffer)
