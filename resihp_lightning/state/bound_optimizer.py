"""Keeping the user's optimizer (and so its LR schedulers) across engine rebuilds.

The optimizer object from ``configure_optimizers`` lives for the whole run. Its parameter groups
are dict objects that schedulers write ``lr`` into; the strategy keeps those dicts and, after each
re-plan, refills their ``params`` with this rank's parameters. Every parameter is identified by
``"<global layer index>.<name inside the layer>"``, which is the same under every partition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

#: Group index of parameters the optimizer does not train.
FROZEN = -1


def local_parameters(layers: Mapping[int, nn.Module]) -> dict[str, nn.Parameter]:
    """This rank's parameters by stable key, in layer order."""
    return {f"{index}.{name}": p for index in sorted(layers) for name, p in layers[index].named_parameters()}


def group_assignment(optimizer: Optimizer, params: Mapping[str, nn.Parameter]) -> dict[str, int]:
    """Which parameter group each of ``params`` belongs to, gathered from every rank.

    A parameter the optimizer was not given goes to group 0 when it requires a gradient (the module
    built it lazily, e.g. from a ``LayerSpec``) and is left out otherwise.
    """
    by_id = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    mine = {
        key: by_id.get(id(p), 0 if p.requires_grad else FROZEN) for key, p in params.items()
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged: dict[str, int] = {}
    for part in gathered:
        merged.update(part)
    return merged


def assign(
    optimizer: Optimizer,
    groups: list[dict[str, Any]],
    group_of: Mapping[str, int],
    params: Mapping[str, nn.Parameter],
    received_state: Mapping[str, dict[str, Any]] | None = None,
) -> None:
    """Makes ``optimizer`` train exactly ``params``.

    Args:
        optimizer: the user's optimizer.
        groups: its parameter-group dicts as first configured (kept, so schedulers stay valid).
        group_of: parameter key -> group index (from :func:`group_assignment`).
        params: this rank's parameters under the new plan.
        received_state: optimizer state of parameters that arrived from another rank, by key.
    """
    keep = {id(p) for p in params.values()}
    for param in list(optimizer.state.keys()):
        if id(param) not in keep:
            del optimizer.state[param]
    for group in groups:
        group["params"] = []
    for key, param in params.items():
        g = group_of.get(key, 0)
        if g != FROZEN:
            groups[g]["params"].append(param)
    for key, value in (received_state or {}).items():
        optimizer.state[params[key]] = value
    optimizer.param_groups[:] = groups


@dataclass
class BoundOptimizer:
    """The user's optimizer with the parameter-group dicts it was configured with.

    Attributes:
        optimizer: the optimizer from ``configure_optimizers`` (lives for the whole run).
        groups: its parameter-group dicts as first configured (schedulers write ``lr`` into them).
        group_of: parameter key -> group index, over every layer of the model.
    """

    optimizer: Optimizer
    groups: list[dict[str, Any]]
    group_of: dict[str, int]

    @classmethod
    def bind(cls, optimizer: Optimizer, params: Mapping[str, nn.Parameter]) -> BoundOptimizer:
        """Keeps ``optimizer``'s groups and makes it train ``params`` (collective: gathers the group map)."""
        bound = cls(optimizer, list(optimizer.param_groups), group_assignment(optimizer, params))
        bound.assign(params)
        return bound

    def assign(self, params: Mapping[str, nn.Parameter], received_state: Mapping[str, dict[str, Any]] | None = None) -> None:
        """Makes the optimizer train exactly ``params`` (see :func:`assign`)."""
        assign(self.optimizer, self.groups, self.group_of, params, received_state)
