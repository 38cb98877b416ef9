"""A checkpoint format keyed by global layer index, readable under any plan and world size.

Lightning's checkpoint dict gets:

* ``state_dict``: ``{"<layer>.<name>": tensor}``, every parameter and persistent buffer of every layer;
* ``optimizer_states[0]``: ``{"format": FORMAT, "param_groups": [hyper-parameters without params],
  "group_of": {key: group index}, "state": {key: {state name: value}}}``;
* ``resihp``: the plan in force, M, the micro-batch size and the layer count;

plus Lightning's own trainer state (loops, epoch, global step, LR schedulers, callbacks). Replica 0's
ranks hold a copy of every layer; they send their layers to rank 0 (``gather_object``), which writes
the file. On load each rank picks out its own layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from resihp_lightning.errors import ConfigError
from resihp_lightning.strategy.wrapped_state import as_plain_entry

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
            (:meth:`~resihp_lightning.strategy.runtime.PipelineRuntime.optimizer_checkpoint_state`).
        sends: whether this rank contributes (ranks of replica 0).
    """
    part = {key: {k: _cpu(v) for k, v in entry.items()} for key, entry in state.items() if entry} if sends else {}
    return {
        "format": FORMAT,
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in groups],
        "group_of": dict(group_of),
        "state": _gather_to_zero(part),
    }


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
