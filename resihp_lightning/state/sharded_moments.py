"""The layer-wise ZeRO-1's optimizer state across plan changes, recoveries and checkpoints.

Between plan changes each holder keeps two slices of each of its layers' optimizer state
(:mod:`~resihp_lightning.state.zero_shards`). Whatever changes the plan (a live re-plan, a reshape
over other processes, a spare taken back, a fail-stop recovery) runs the same simple scheme, with
nothing on disk:

1. *assemble* (:func:`assemble_full_state`, collective over the current process group): every live
   old holder of a layer receives the slices of that layer it does not keep, each from one live
   keeper (the primary when alive, else its copy), and joins them into whole per-parameter states, the
   shape the plain fp32 optimizer keeps;
2. the layers move as in a plain fp32 job (:func:`~resihp_lightning.state.migration.migrate` carries
   the whole states to new holders);
3. *cut*: each holder under the new plan keeps its two new slices of the whole states it kept or
   received (:meth:`~resihp_lightning.state.zero_shards.ZeroShards.load_full`).

While a plan changes, every old holder so holds its layers' whole moments for a moment (8 bytes per
parameter with Adam), as the unsharded engine always does.

Under tensor parallelism the unit is a member's shard of a layer, sliced over the processes holding the
same shard (:mod:`~resihp_lightning.state.zero_holders`); step 2 is then a re-split
(:mod:`~resihp_lightning.tensor.resplit`), which cuts the whole states of the old shards like their
parameters.

After a death, a slice whose two keepers both died has no live copy: every process finds that from
the same gathered inventory and raises :class:`~resihp_lightning.errors.PlanError` before any transfer,
so the survivors exit for a restart from a checkpoint (status 75) instead of waiting.

Checkpoints hold whole (unsharded) fp32 moments in the plain optimizer's per-parameter format, so a
checkpoint resumes under any plan and world, with ZeRO-1 on or off.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from resihp_lightning.errors import PlanError
from resihp_lightning.plan import Plan
from resihp_lightning.state.zero_shards import (
    PieceState,
    SliceStates,
    ZeroShards,
    elementwise,
    join_slices,
    trained_parameters,
)
from resihp_lightning.state import layer_checkpoint
from resihp_lightning.state.optimizer_state import CapturedState, PlainStateCarrier, StateByKey, StateCarrier
from resihp_lightning.state.zero_holders import shard_holders
from resihp_lightning.state.zero_layout import SliceLayout


@dataclass
class ShardedCapture(CapturedState):
    """:class:`~resihp_lightning.state.optimizer_state.CapturedState` plus the slices this rank kept.

    Attributes:
        slices: layer -> slice -> its pieces' states (``by_key`` is filled by :func:`assemble_full_state`).
    """

    slices: SliceStates = field(default_factory=dict)


@dataclass(frozen=True)
class OldHolding:
    """What the plan being left says about where optimizer state lives (the same on every process).

    Attributes:
        plan: the old plan (device ids; with ``groups``, group ids).
        alive: the processes still alive (every process of the current group), by device id.
        rank_of: device id -> rank of the current process group (for the alive ones).
        device: this process's device id.
        layers: this process's layers under the old plan (its shards of them, under tensor parallelism).
        groups: under tensor parallelism, the old groups' members (device ids, member order), by group id;
            each shard's state is sliced over its own holders (:mod:`~resihp_lightning.state.zero_holders`).
    """

    plan: Plan
    alive: Collection[int]
    rank_of: Callable[[int], int]
    device: int
    layers: Mapping[int, nn.Module]
    groups: Sequence[Sequence[int]] | None = None


def _describe(state: PieceState) -> dict[str, tuple[str, Any]]:
    """A piece's state for the inventory: element-wise tensors by shape and dtype, the rest by value."""
    return {
        key: ("tensor", (value.numel(), value.dtype)) if elementwise(key, value)
        else ("value", value.detach().cpu().clone() if isinstance(value, Tensor) else value)
        for key, value in state.items()
    }


def assemble_full_state(
    holding: OldHolding, slices: SliceStates, group_of: Mapping[str, int]
) -> tuple[StateByKey, int]:
    """Every live old holder's whole per-parameter state of its old layers (collective over the current group).

    Args:
        holding: the old plan and who is alive (see :class:`OldHolding`).
        slices: the slices this process kept under the old plan (``{}`` for a spare).
        group_of: parameter key -> optimizer group (which parameters the optimizer trains).

    Returns:
        (whole state by parameter key for this process's old layers, bytes this process sent).

    Raises:
        PlanError: some slice of some layer has no live keeper (every process raises it, before any transfer).
    """
    # Slices are counted per shard: a layer's own (no tensor parallelism) or a member's shard of it.
    units = shard_holders(holding.plan, holding.groups)
    holders = {unit.key: unit.holders for per in units.values() for unit in per.values()}
    mine_units = units.get(holding.device, {})
    alive = set(holding.alive)
    trained = trained_parameters(holding.layers, group_of)
    mine = {
        "sizes": {mine_units[i].key: SliceLayout(tuple(p.numel() for _, p in params), len(mine_units[i].holders)).sizes()
                  for i, params in trained.items()},
        "slices": {(mine_units[i].key, s): [_describe(state) for state in states]
                   for i, per in slices.items() for s, states in per.items()},
    }
    inventory: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(inventory, mine)
    by_rank = dict(enumerate(inventory))
    sizes: dict[tuple[int, int, int], list[int]] = {}
    for part in inventory:
        sizes.update(part["sizes"])
    # Who keeps what, in ranks of the current group; the lost slices, the same on every process.
    rank_alive = {d: holding.rank_of(d) for d in alive}
    sources: dict[tuple[tuple[int, int, int], int], int] = {}
    lost: dict[tuple[int, tuple[int, ...]], list[tuple[int, ...]]] = {}  # (slice, its keepers) -> shards
    for key in sorted(sizes):
        owners = holders[key]
        for s, size in enumerate(sizes[key]):
            if not size:
                continue
            keepers = [owners[k] for k in SliceLayout((), len(owners)).keepers(s)]
            live = [rank_alive[d] for d in keepers if d in rank_alive and (key, s) in by_rank[rank_alive[d]]["slices"]]
            if live:
                sources[(key, s)] = live[0]
            else:
                lost.setdefault((s, tuple(keepers)), []).append(key if holding.groups is not None else key[0])
    if lost:
        what = "; ".join(f"slice {s} of {'shards (layer, degree, member)' if holding.groups is not None else 'layers'} "
                         f"{shards} (kept by devices {list(keepers)})" for (s, keepers), shards in lost.items())
        raise PlanError(f"ZeRO-1 optimizer state with no live copy: {what}; restart from a checkpoint")
    me = dist.get_rank()
    ops: list[dist.P2POp] = []
    sent = 0
    received: dict[tuple[int, int], list[PieceState]] = {}
    for (key, s), src in sorted(sources.items()):
        layer = key[0]
        metas = by_rank[src]["slices"][(key, s)]
        receivers = [
            rank_alive[d] for d in holders[key]
            if d in rank_alive and (key, s) not in by_rank[rank_alive[d]]["slices"]
        ]
        if src == me:
            for dst in receivers:
                for state in slices[layer][s]:
                    for name in sorted(state):
                        if elementwise(name, state[name]):
                            tensor = state[name].contiguous()
                            ops.append(dist.P2POp(dist.isend, tensor, dst))
                            sent += tensor.numel() * tensor.element_size()
        elif me in receivers:
            device = _device_of(holding.layers[layer])
            states: list[PieceState] = []
            for meta in metas:
                state: PieceState = {}
                for name in sorted(meta):
                    kind, info = meta[name]
                    if kind == "tensor":
                        numel, dtype = info
                        state[name] = torch.empty(numel, dtype=dtype, device=device)
                        ops.append(dist.P2POp(dist.irecv, state[name], src))
                    else:
                        state[name] = info.clone() if isinstance(info, Tensor) else info
                states.append(state)
            received[(layer, s)] = states
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    out: StateByKey = {}
    for layer, params in trained.items():
        per_slice = {**slices.get(layer, {}), **{s: st for (i, s), st in received.items() if i == layer}}
        layout = SliceLayout(tuple(p.numel() for _, p in params), len(mine_units[layer].holders))
        joined = join_slices(layout, [p.shape for _, p in params], per_slice)
        out.update({key: state for (key, _), state in zip(params, joined) if state})
    return out, sent


def _device_of(layer: nn.Module) -> torch.device:
    return next((p.device for p in layer.parameters()), torch.device("cpu"))


class ShardedStateCarrier(PlainStateCarrier):
    """The layer-wise ZeRO-1's carrier: state in :class:`~resihp_lightning.state.zero_shards.ZeroShards`
    slices between plan changes, whole per parameter while a plan changes and in checkpoints.

    The user's optimizer keeps the parameter groups (LR schedulers write into them) and no state.
    The runtime sets ``shards`` when it builds an engine.
    """

    per_replica_bounds = True

    def __init__(self, bound: Any, deepspeed_config: Mapping[str, Any]) -> None:
        super().__init__(bound, deepspeed_config)
        self.shards: ZeroShards | None = None
        #: Bytes this process sent while assembling whole states at the last plan change.
        self.assembled_bytes = 0

    def capture(self, engine: Any, params: Mapping[str, nn.Parameter]) -> ShardedCapture:
        slices = self.shards.export_slices() if self.shards is not None else {}
        return ShardedCapture(params=dict(params), slices=slices)

    def complete(self, captured: CapturedState, holding: OldHolding) -> CapturedState:
        """Fills ``captured.by_key`` with whole states assembled from the live slices (collective; nothing to
        do outside fitting, where no process has an optimizer)."""
        if self.bound is None:
            return captured
        slices = captured.slices if isinstance(captured, ShardedCapture) else {}
        by_key, self.assembled_bytes = assemble_full_state(holding, slices, self.bound.group_of)
        captured.by_key = by_key
        return captured

    def carry_over(self, previous: StateCarrier) -> None:
        """The slices ``previous`` kept, when it stepped the same user's optimizer: the moments belong to that
        optimizer object, as the plain optimizer's own ``state`` does (a new one from ``configure_optimizers``
        starts without state under either)."""
        if (
            isinstance(previous, ShardedStateCarrier) and previous.shards is not None and self.shards is not None
            and previous.bound is not None and self.bound is not None and previous.bound.optimizer is self.bound.optimizer
        ):
            self.shards.adopt(previous.shards)

    def bind(self, params: Mapping[str, nn.Parameter], received: StateByKey) -> None:
        self.shards = None  # the next engine's shards cut their slices at restore
        if self.bound is not None:
            self.bound.assign(params, None)

    def restore(self, engine: Any, params: Mapping[str, nn.Parameter], captured: CapturedState, received: StateByKey) -> None:
        if self.shards is not None:
            kept = {key: entry for key, entry in captured.by_key.items() if key in params}
            self.shards.load_full({**kept, **received})

    def checkpoint_state(self, engine: Any, params: Mapping[str, nn.Parameter]) -> StateByKey:
        return self.shards.full_state() if self.shards is not None else {}

    def load_checkpoint(self, engine: Any, params: Mapping[str, nn.Parameter], saved: Mapping[str, Any]) -> None:
        if self.bound is None:
            return
        # The plain optimizer's loader reads the format (and a DeepSpeed wrapper's masters); the whole
        # states it puts into the user's optimizer are cut into slices and taken out again.
        optimizer = self.bound.optimizer
        layer_checkpoint.load_optimizer_state(optimizer, self.bound.groups, saved, params)
        whole = {key: optimizer.state.pop(p) for key, p in params.items() if p in optimizer.state}
        if self.shards is not None:
            self.shards.load_full(whole)

    def state_bytes(self, engine: Any, param: nn.Parameter) -> float:
        return self.shards.state_bytes(param) if self.shards is not None else 0.0
