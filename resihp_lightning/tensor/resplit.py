"""Re-cutting split layers when the tensor-parallel groups change: shards move member to member.

When a plan over new groups (another degree, other members, or the survivors of a lost member) comes
into force, every process that holds a layer under it needs its new member's share of each split
tensor: a contiguous range ``[j/k, (j+1)/k)`` of the split dimension for member ``j`` of a group of
``k``. Under the old groups, member ``i`` of a holder group of degree ``t`` has ``[i/t, (i+1)/t)``. The
new range is cut at every old boundary, and each piece comes from one live old holder of that range:
the receiving process itself where it held the piece (a local copy), else the least loaded holder
(:func:`plan_pieces`). Whole tensors (norms, a row split's bias) come whole from one holder. Nothing is
gathered whole on any process and nothing touches the disk; the optimizer state shaped like a
parameter (Adam's moments) is cut the same way, other state travels by value.

A lost member's shards therefore come back from any other group holding the same layers, whatever its
degree: what cannot come back is a range no live process holds (:class:`~resihp_lightning.errors.PlanError`).

Ids: groups and plans name *devices* (a process's id for the whole job); ``rank_of`` maps them to
ranks of the current default process group, over which the exchange is collective.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from resihp_lightning.errors import PlanError
from resihp_lightning.placement import position
from resihp_lightning.plan import Plan
from resihp_lightning.tensor.tensor_groups import TensorGroups
from resihp_lightning.torch_utils.layer_tensors import layer_tensors
from resihp_lightning.torch_utils.shards import split_dim

#: Tensors with at most this many elements travel inside the metadata exchange.
SMALL_NUMEL = 16


@dataclass(frozen=True)
class Piece:
    """The range ``[lo, hi)`` (fractions of a split dimension) of one layer goes from ``src`` to ``dst``.

    ``src_lo`` is where the sender's own shard starts, so the sender reads ``[lo - src_lo, hi - src_lo)``
    of it; the receiver writes ``[lo - dst_lo, hi - dst_lo)`` of its new shard.
    """

    layer: int
    src: int
    dst: int
    lo: Fraction
    hi: Fraction
    src_lo: Fraction
    dst_lo: Fraction


@dataclass(frozen=True)
class LayerSources:
    """Where one process's new copy of one layer comes from.

    Attributes:
        layer: the layer.
        dst: the receiving device.
        pieces: the ranges of its split tensors, in order of ``lo``.
        whole_src: the device its whole tensors (and state passed by value) come from.
    """

    layer: int
    dst: int
    pieces: tuple[Piece, ...]
    whole_src: int


def shard_range(member: int, degree: int) -> tuple[Fraction, Fraction]:
    """The range of a split dimension that member ``member`` of a group of ``degree`` holds."""
    return Fraction(member, degree), Fraction(member + 1, degree)


def holders(groups: TensorGroups, plan: Plan) -> dict[int, list[tuple[int, ...]]]:
    """Layer -> the member tuples of the groups holding it under ``plan`` (over ``groups``' ids)."""
    out: dict[int, list[tuple[int, ...]]] = {}
    for g in plan.device_ids:
        for layer in position(plan, g).layers:
            out.setdefault(layer, []).append(groups.members[g])
    return out


def plan_pieces(
    old_groups: TensorGroups,
    old_plan: Plan,
    new_groups: TensorGroups,
    new_plan: Plan,
    alive: Collection[int] | None = None,
) -> list[LayerSources]:
    """Where every (layer, new holder) gets its new shards from (deterministic: every process computes
    the same list).

    Args:
        old_groups, old_plan: the groups and the plan (over their ids) in force.
        new_groups, new_plan: the ones to apply.
        alive: the devices still running (default: all); a dead device sends nothing.

    Raises:
        PlanError: a range of a layer that a new holder needs has no live old holder.
    """
    old = holders(old_groups, old_plan)
    load: dict[int, Fraction] = {}
    out: list[LayerSources] = []
    for g in sorted(new_plan.device_ids):
        members = new_groups.members[g]
        k = len(members)
        for layer in position(new_plan, g).layers:
            sources = [
                (device, shard_range(i, len(group)))
                for group in old.get(layer, [])
                for i, device in enumerate(group)
                if alive is None or device in alive
            ]
            for j, dst in enumerate(members):
                lo, hi = shard_range(j, k)
                cuts = sorted({lo, hi} | {b for _, r in sources for b in r if lo < b < hi})
                pieces: list[Piece] = []
                for a, b in zip(cuts, cuts[1:]):
                    covering = [(device, r) for device, r in sources if r[0] <= a and b <= r[1]]
                    if not covering:
                        raise PlanError(
                            f"layer {layer}: no live process holds the part [{a}, {b}) of its split tensors "
                            "(every holder of it is lost); it cannot be restored in process"
                        )
                    device, r = min(covering, key=lambda c: (c[0] != dst, load.get(c[0], Fraction(0)), c[0]))
                    if device != dst:
                        load[device] = load.get(device, Fraction(0)) + (b - a)
                    last = pieces[-1] if pieces else None
                    if last is not None and last.src == device and last.hi == a and last.src_lo == r[0]:
                        pieces[-1] = Piece(layer, device, dst, last.lo, b, r[0], lo)
                    else:
                        pieces.append(Piece(layer, device, dst, a, b, r[0], lo))
                if not sources:
                    raise PlanError(f"layer {layer} has no live holder under the plan in force; it cannot be restored")
                held_here = [d for d, _ in sources if d == dst]
                whole_src = held_here[0] if held_here else min((d for d, _ in sources), key=lambda d: (load.get(d, 0), d))
                out.append(LayerSources(layer, dst, tuple(pieces), whole_src))
    return out


def surviving_groups(groups: TensorGroups, alive: Collection[int]) -> TensorGroups:
    """The groups that go on after the processes outside ``alive`` are lost.

    A group with every member alive stays as it is. A group that lost members goes on with its live
    ones at a smaller degree: the largest divisor of its degree that they fill, then the same for the
    rest (3 live members of a group of 4 form groups of 2 and 1). A divisor of a degree the model
    splits over always splits it too (heads, key-value heads and vocabulary divide by it).

    Raises:
        PlanError: no process of any group is alive.
    """
    out: list[tuple[int, ...]] = []
    for group in groups.members:
        live = [d for d in group if d in alive]
        if len(live) == len(group):
            out.append(group)
            continue
        while live:
            size = max(d for d in range(1, len(group) + 1) if len(group) % d == 0 and d <= len(live))
            out.append(tuple(live[:size]))
            live = live[size:]
    if not out:
        raise PlanError("no process of the job's tensor-parallel groups is alive")
    return TensorGroups(tuple(out))


def lost_parts(groups: TensorGroups, plan: Plan, alive: Collection[int]) -> list[str]:
    """The parts of layers (``"layer 3 [1/2, 1)"``) that no live process holds under ``groups`` and ``plan``."""
    lost = []
    for layer, held in sorted(holders(groups, plan).items()):
        ranges = sorted(shard_range(i, len(group)) for group in held for i, d in enumerate(group) if d in alive)
        covered = Fraction(0)
        for lo, hi in ranges:
            if lo > covered:
                lost.append(f"layer {layer} [{covered}, {lo})")
            covered = max(covered, hi)
        if covered < 1:
            lost.append(f"layer {layer} [{covered}, 1)")
    return lost


def _describe(value: Any, param: torch.Tensor) -> tuple[str, Any]:
    """How one optimizer-state entry travels: cut like its parameter, whole, or by value."""
    if isinstance(value, torch.Tensor) and value.shape == param.shape and split_dim(param) is not None:
        return ("split", value.dtype)
    if isinstance(value, torch.Tensor) and value.numel() > SMALL_NUMEL:
        return ("tensor", (tuple(value.shape), value.dtype))
    if isinstance(value, torch.Tensor):
        return ("value", value.detach().cpu().clone())
    return ("value", value)


def resplit(
    old_groups: TensorGroups,
    old_plan: Plan,
    new_groups: TensorGroups,
    new_plan: Plan,
    me: int,
    old_layers: Mapping[int, nn.Module],
    new_layers: Mapping[int, nn.Module],
    state: Mapping[torch.Tensor, Mapping[str, Any]],
    rank_of: Callable[[int], int],
    alive: Collection[int] | None = None,
) -> tuple[int, dict[int, dict[str, dict[str, Any]]]]:
    """Fills this process's new shards from the old ones (collective over the default group).

    Args:
        old_groups, old_plan, new_groups, new_plan: as for :func:`plan_pieces`.
        me: this process's device id.
        old_layers: its split layers under the old groups (none for a spare), by layer.
        new_layers: its layers under the new groups, already split over its new group (their values are
            overwritten), by layer.
        state: per-parameter optimizer state of the old layers (old parameter -> name -> value).
        rank_of: device id -> rank in the current default process group.
        alive: the devices still running (default: all).

    Returns:
        (bytes this process sent, its new layers' optimizer state: layer -> tensor name -> state dict).
    """
    plan = plan_pieces(old_groups, old_plan, new_groups, new_plan, alive)
    # The optimizer state's shape: each process describes the state of the layers it holds.
    described = {
        (layer, name): {key: _describe(value, tensor) for key, value in state.get(tensor, {}).items()}
        for layer, module in old_layers.items()
        for name, tensor in layer_tensors(module).items()
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (me, described))
    by_device = dict(gathered)
    old_share = _share(old_groups, me)
    new_share = _share(new_groups, me)

    ops: list[dist.P2POp] = []
    fills: list[tuple[torch.Tensor, torch.Tensor]] = []  # (receive buffer, where its values go)
    sent = 0
    received: dict[int, dict[str, dict[str, Any]]] = {}
    for sources in plan:
        layer, dst = sources.layer, sources.dst
        receiving = dst == me
        if not receiving and sources.whole_src != me and all(p.src != me for p in sources.pieces):
            continue
        meta = by_device[sources.whole_src]
        new = layer_tensors(new_layers[layer]) if receiving else {}
        old = layer_tensors(old_layers[layer]) if layer in old_layers else {}
        for name in sorted(n for (index, n) in meta if index == layer):
            entries = sorted(meta[(layer, name)].items())
            dim = split_dim(new[name]) if receiving else split_dim(old[name]) if name in old else None
            param_state: dict[str, Any] = {}
            if dim is None:  # whole on every member: from the whole-tensor source
                if receiving and sources.whole_src == me:
                    new[name].data.copy_(old[name].data)
                elif receiving:
                    fills.append(_recv(ops, new[name].data, rank_of(sources.whole_src)))
                elif sources.whole_src == me:
                    sent += _send(ops, old[name].data, rank_of(dst))
            else:  # cut: the value and the state shaped like it, piece by piece
                keys = [None, *(key for key, (kind, _) in entries if kind == "split")]
                for key in keys:
                    if receiving:
                        if key is None:
                            target = new[name].data
                        else:
                            target = param_state[key] = torch.empty(
                                new[name].shape, dtype=meta[(layer, name)][key][1], device=new[name].device
                            )
                    for piece in sources.pieces:
                        if piece.src == me:
                            mine = old[name].data if key is None else state[old[name]][key]
                            chunk = mine.narrow(dim, *_span(mine.shape[dim], old_share, piece.lo, piece.hi, piece.src_lo))
                        if receiving:
                            where = target.narrow(dim, *_span(target.shape[dim], new_share, piece.lo, piece.hi, piece.dst_lo))
                            if piece.src == me:
                                where.copy_(chunk)
                            else:
                                fills.append(_recv(ops, where, rank_of(piece.src)))
                        elif piece.src == me:
                            sent += _send(ops, chunk, rank_of(dst))
            for key, (kind, info) in entries:
                if kind == "split" and dim is not None:
                    continue
                if kind == "value":
                    if receiving:
                        param_state[key] = info.clone() if isinstance(info, torch.Tensor) else info
                    continue
                # a whole state tensor, or the state of a whole parameter: from the whole-tensor source
                if receiving and sources.whole_src == me:
                    param_state[key] = state[old[name]][key].detach().clone()
                elif receiving:
                    shape, dtype = info if kind == "tensor" else (tuple(new[name].shape), info)
                    param_state[key] = torch.empty(shape, dtype=dtype, device=new[name].device)
                    fills.append(_recv(ops, param_state[key], rank_of(sources.whole_src)))
                elif sources.whole_src == me:
                    sent += _send(ops, state[old[name]][key], rank_of(dst))
            if receiving and param_state:
                received.setdefault(layer, {})[name] = param_state
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for buffer, where in fills:
        if buffer is not where:
            where.copy_(buffer)
    return sent, received


def _span(size: int, share: Fraction, lo: Fraction, hi: Fraction, start: Fraction) -> tuple[int, int]:
    """(offset, length) in elements of the range ``[lo, hi)`` inside a shard of ``size`` elements that
    starts at ``start`` and covers ``share`` of the whole dimension."""
    whole = Fraction(size) / share
    offset, length = (lo - start) * whole, (hi - lo) * whole
    if offset.denominator != 1 or length.denominator != 1:
        raise PlanError(f"a split dimension of {whole} elements does not cut at {lo}..{hi}")
    return int(offset), int(length)


def _share(groups: TensorGroups, device: int) -> Fraction:
    """The fraction of a split dimension that ``device``'s shard covers under ``groups`` (0 for a spare)."""
    g = groups.group_of(device)
    return Fraction(0) if g is None else Fraction(1, len(groups.members[g]))


def _send(ops: list[dist.P2POp], tensor: torch.Tensor, rank: int) -> int:
    tensor = tensor.detach().contiguous()
    ops.append(dist.P2POp(dist.isend, tensor, rank))
    return tensor.numel() * tensor.element_size()


def _recv(ops: list[dist.P2POp], where: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    buffer = where if where.is_contiguous() else torch.empty_like(where, memory_format=torch.contiguous_format)
    ops.append(dist.P2POp(dist.irecv, buffer, rank))
    return buffer, where
