"""A checkpoint format readable under any plan and world size, and by a plain ``load_from_checkpoint``.

Lightning's checkpoint dict gets:

* ``state_dict``: the LightningModule's own ``state_dict`` keys (``"layers.3.weight"``), every layer's
  parameters (in full precision: fp32 masters under bf16) and persistent buffers, plus the module's
  other tensors; layers given as ``LayerSpec`` under ``"pipeline_layers.<index>.<name>"``
  (:class:`~resihp_lightning.state.module_weights.LayerKeys`);
* ``optimizer_states[0]``: ``{"format": FORMAT, "param_groups": [hyper-parameters without params],
  "group_of": {key: group index}, "state": {key: {state name: value}}}`` keyed by pipeline key
  ``"<layer>.<name>"`` (the same under every plan);
* ``resihp``: the plan in force, M, the micro-batch size, the layer count and ``state_dict_keys``
  (``"module"``; checkpoints without it, written by earlier versions, use pipeline keys);

plus Lightning's own trainer state (loops, epoch, global step, LR schedulers, callbacks). Replica 0's
ranks hold a copy of every layer; they send their layers to rank 0 (``gather_object``), which writes
the file. On load each rank picks out its own layers, and the LightningModule gets the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from resihp_lightning.errors import ConfigError
from resihp_lightning.state.module_weights import LayerKeys
from resihp_lightning.state.wrapped_state import as_plain_entry

FORMAT = "resihp-layerwise-v1"


def _cpu(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _gather_to_zero(part: dict[str, Any]) -> dict[str, Any]:
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(part, parts, dst=0)
    merged: dict[str, Any] = {}
    for item in parts or []:
        merged.update(item)
    return merged


def gather_model_state(params: Mapping[str, nn.Parameter], sends: bool) -> dict[str, Any]:
    """Every layer's parameters on rank 0 (``{}`` elsewhere); collective.

    Args:
        params: this rank's parameters by key.
        sends: whether this rank contributes (ranks of replica 0).
    """
    part = {key: _cpu(p) for key, p in params.items()} if sends else {}
    return dict(sorted(_gather_to_zero(part).items(), key=lambda kv: _order(kv[0])))


def gather_optimizer_state(
    groups: list[dict[str, Any]], group_of: Mapping[str, int], state: Mapping[str, Mapping[str, Any]], sends: bool
) -> dict[str, Any]:
    """The optimizer's layer-keyed state on rank 0 (hyper-parameters on every rank); collective.

    Args:
        groups: the optimizer's parameter-group dicts (their hyper-parameters are saved).
        group_of: parameter key -> group index.
        state: this rank's per-parameter state by key
            (:meth:`~resihp_lightning.runtime.pipeline_runtime.PipelineRuntime.optimizer_checkpoint_state`).
        sends: whether this rank contributes (ranks of replica 0).
    """
    part = {key: {k: _cpu(v) for k, v in entry.items()} for key, entry in state.items() if entry} if sends else {}
    return {
        "format": FORMAT,
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in groups],
        "group_of": dict(group_of),
        "state": _gather_to_zero(part),
    }


def module_keyed(module: nn.Module, keys: LayerKeys, layers: Mapping[str, Any]) -> dict[str, Any]:
    """The module's ``state_dict`` with every pipeline layer's tensors taken from ``layers`` (pipeline keys).

    Tensors outside the pipeline layers come from ``module`` itself; ``LayerSpec`` layers, which the
    module does not hold, are appended under their detached keys.
    """
    out: dict[str, Any] = {}
    for key, value in module.state_dict().items():
        layer_key = keys.to_layer(key)
        out[key] = layers[layer_key] if layer_key is not None and layer_key in layers else _cpu(value)
    for layer_key, value in layers.items():
        if not keys.is_attached(int(layer_key.partition(".")[0])):
            out[keys.to_module(layer_key)] = value
    return out


def load_module_state(
    module: nn.Module,
    keys: LayerKeys,
    state: Mapping[str, Any],
    local: Mapping[str, Any],
    layer_keyed: bool,
    strict: bool = True,
    shard: Callable[[str, Tensor], Tensor] | None = None,
) -> None:
    """Loads a checkpoint's ``state_dict`` into this rank's layers and the rest of the module.

    Args:
        module: the user's LightningModule.
        keys: its key map.
        state: the checkpoint's ``state_dict``.
        local: this rank's layer tensors by pipeline key (they must all be in the checkpoint when ``strict``).
        layer_keyed: ``state`` uses pipeline keys (checkpoints of earlier versions) instead of module keys.
        strict: refuse a checkpoint without a tensor for one of ``local``.
        shard: with tensor parallelism, ``shard(layer_key, whole)`` is this rank's part of a saved whole
            tensor; the module's own layers (unsplit, not the ones that train) take the whole values too.
    """
    by_module_key = {keys.to_module(k): v for k, v in state.items()} if layer_keyed else dict(state)
    by_layer_key = {}
    for key, value in by_module_key.items():
        layer_key = keys.to_layer(key)
        if layer_key is not None:
            by_layer_key[layer_key] = shard(layer_key, value) if shard is not None else value
    load_model_state(by_layer_key, local, strict=strict)
    # The module's other tensors: layers of other ranks (so it is complete) and anything outside the
    # pipeline. Detached (LayerSpec) keys have no place in the module and are skipped, and so are
    # layers on the meta device (loaded per stage: this rank does not keep them).
    on_meta = {k for k, v in module.state_dict(keep_vars=True).items() if v.is_meta}
    rest = {k: v for k, v in by_module_key.items() if (shard is not None or keys.to_layer(k) not in local) and k not in on_meta}
    with torch.no_grad():
        module.load_state_dict(rest, strict=False)


def load_model_state(state: Mapping[str, Any], params: Mapping[str, nn.Parameter], strict: bool = True) -> None:
    """Copies this rank's parameters out of a layer-keyed state dict."""
    missing = [key for key in params if key not in state]
    if missing and strict:
        raise ConfigError(
            f"checkpoint has no tensor for parameter(s) {missing[:5]}; it was written for a different model "
            "or not by ResiHPStrategy"
        )
    with torch.no_grad():
        for key, p in params.items():
            if key in state:
                if tuple(state[key].shape) != tuple(p.shape):
                    raise ConfigError(f"checkpoint tensor {key} has shape {tuple(state[key].shape)}, the model {tuple(p.shape)}")
                p.copy_(state[key])


def load_hyperparameters(groups: list[dict[str, Any]], saved: Mapping[str, Any]) -> None:
    """Restores the parameter groups' hyper-parameters (learning rate, ...) from a saved optimizer state."""
    if saved.get("format") != FORMAT:
        raise ConfigError(
            f"optimizer state in the checkpoint has format {saved.get('format')!r}; ResiHPStrategy reads {FORMAT!r}"
        )
    if len(saved["param_groups"]) != len(groups):
        raise ConfigError(
            f"checkpoint optimizer has {len(saved['param_groups'])} parameter groups, configure_optimizers made {len(groups)}"
        )
    for group, hyper in zip(groups, saved["param_groups"]):
        group.update({k: v for k, v in hyper.items() if k != "params"})


def load_optimizer_state(
    optimizer: Optimizer, groups: list[dict[str, Any]], saved: Mapping[str, Any], params: Mapping[str, nn.Parameter]
) -> None:
    """Restores hyper-parameters and this rank's per-parameter state into the plain optimizer.

    A state saved under a DeepSpeed wrapper carries the fp32 master value: it becomes the parameter's value.
    """
    load_hyperparameters(groups, saved)
    for key, p in params.items():
        if key in saved["state"]:
            entry, master = as_plain_entry(saved["state"][key])
            optimizer.state[p] = {
                k: (v.to(p.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in entry.items()
            }
            if master is not None:
                with torch.no_grad():
                    p.copy_(master)


def _order(key: str) -> tuple[int, str]:
    layer, _, name = key.partition(".")
    return (int(layer), name)
