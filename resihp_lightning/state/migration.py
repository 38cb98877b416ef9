"""Moving layers' parameters and optimizer state to their new owners, point to point.

Under a plan every replica holds a full copy of the model, so after a re-plan a rank only needs the
layers it did not hold before. Each such (layer, new owner) pair is served by one old owner,
chosen to spread the bytes over the old owners; nothing else crosses the wire. Small tensors
(such as Adam's ``step``) and non-tensor optimizer state travel in a metadata exchange
(``all_gather_object`` of a few bytes per moved tensor); every other tensor travels by ``isend`` /
``irecv`` on its own device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from resihp_lightning.placement import Transfer
from resihp_lightning.torch_utils.layer_tensors import layer_tensors

#: Tensors with at most this many elements travel inside the metadata exchange.
SMALL_NUMEL = 16


def _describe(value: Any) -> tuple[str, Any]:
    if isinstance(value, torch.Tensor) and value.numel() > SMALL_NUMEL:
        return ("tensor", (tuple(value.shape), value.dtype))
    if isinstance(value, torch.Tensor):
        return ("value", value.detach().cpu().clone())
    return ("value", value)


def migrate(
    transfers: Sequence[Transfer],
    rank: int,
    old_layers: Mapping[int, nn.Module],
    new_layers: Mapping[int, nn.Module],
    state: Mapping[torch.Tensor, Mapping[str, Any]],
) -> tuple[int, dict[int, dict[str, dict[str, Any]]]]:
    """Runs the transfers; collective over the world group (every rank calls it).

    Parameters and persistent buffers are received straight into the new owners' modules (which must
    already have the senders' dtypes). Optimizer state is returned, not installed, because the
    optimizer's parameter groups are rebuilt afterwards.

    Args:
        transfers: every transfer of the switch (:func:`~resihp_lightning.placement.plan_transfers`,
            device ids being ranks of the current process group).
        rank: this process's rank.
        old_layers: this rank's layers under the old plan, by global index.
        new_layers: this rank's layers under the new plan, by global index.
        state: per-parameter optimizer state to carry (old parameter -> name -> value), from
            :meth:`~resihp_lightning.state.optimizer_state.StateCarrier.outgoing`.

    Returns:
        (bytes this rank sent, received optimizer state: layer -> parameter name -> state dict).
    """
    outgoing = [t for t in transfers if t.src == rank]
    meta: dict[tuple[int, int], list[tuple[str, tuple, dict[str, tuple[str, Any]]]]] = {}
    for t in outgoing:
        entries = []
        for name, tensor in layer_tensors(old_layers[t.layer]).items():
            opt_state = {k: _describe(v) for k, v in state.get(tensor, {}).items()}
            entries.append((name, tuple(tensor.shape), opt_state))
        meta[(t.layer, t.dst)] = entries
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, meta)
    everything = {key: entries for part in gathered for key, entries in part.items()}

    ops: list[dist.P2POp] = []
    sent = 0
    received: dict[int, dict[str, dict[str, Any]]] = {}
    for t in transfers:
        if t.src == rank:
            params = layer_tensors(old_layers[t.layer])
            for name, _, opt_meta in everything[(t.layer, t.dst)]:
                tensor = params[name].data.contiguous()
                ops.append(dist.P2POp(dist.isend, tensor, t.dst))
                sent += tensor.numel() * tensor.element_size()
                for key, (kind, _) in sorted(opt_meta.items()):
                    if kind == "tensor":
                        value = state[params[name]][key].contiguous()
                        ops.append(dist.P2POp(dist.isend, value, t.dst))
                        sent += value.numel() * value.element_size()
                    else:
                        value = state[params[name]][key]
                        sent += value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
        elif t.dst == rank:
            params = layer_tensors(new_layers[t.layer])
            layer_state = received.setdefault(t.layer, {})
            for name, shape, opt_meta in everything[(t.layer, t.dst)]:
                param = params[name]
                if tuple(param.shape) != shape:
                    raise RuntimeError(f"layer {t.layer} tensor {name}: shape {tuple(param.shape)} here, {shape} at rank {t.src}")
                ops.append(dist.P2POp(dist.irecv, param.data, t.src))
                param_state: dict[str, Any] = {}
                for key, (kind, info) in sorted(opt_meta.items()):
                    if kind == "tensor":
                        shape_, dtype = info
                        buffer = torch.empty(shape_, dtype=dtype, device=param.device)
                        ops.append(dist.P2POp(dist.irecv, buffer, t.src))
                        param_state[key] = buffer
                    else:
                        param_state[key] = info.clone() if isinstance(info, torch.Tensor) else info
                if param_state:
                    layer_state[name] = param_state
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return sent, received
