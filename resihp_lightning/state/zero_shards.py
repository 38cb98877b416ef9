"""ZeRO-1 in the layer-wise engine: Adam's moments sharded over each layer's holders, every slice kept twice.

Under a plan every layer is held by one rank per replica (its holder set, D ranks). Each holder keeps
the optimizer state of two slices of the layer's flat parameters (:mod:`~resihp_lightning.state.zero_layout`):
its own and its neighbour's, so that a lost holder's slice survives on the next one. Adam's two fp32
moments cost ``8 * 2 / D`` bytes per parameter on each holder instead of 8 (``D <= 2``: no saving).
The parameters stay whole on every holder (the forward pass needs them; under ``bf16-mixed`` they are
the fp32 masters).

One step, after the layer-wise reducer has all-reduced (and clipped) the gradients:

1. every holder steps its two slices with the user's optimizer class (``torch.optim.Adam`` / ``AdamW``)
   and hyper-parameters, on *pieces*: parameters that are views of its slices of the real parameters and
   gradients, so the element-wise maths runs on exactly the fp32 values an unsharded step would read;
2. the neighbour's slice is stepped too rather than sent: its inputs (the whole reduced gradient, the
   whole parameters) are on every holder already, so the copy stays bit-equal to the primary for
   compute alone and no bytes;
3. each holder set all-gathers its members' own slices of the updated parameters.

Why the gradients are all-reduced rather than reduce-scattered: the all-reduce is the one the unsharded
engine runs, so the reduced gradients, and with them the sharded step, are bit-equal to the unsharded
run's; the copy needs the neighbour's reduced slice as well (a reduce-scatter would give each holder its
own only); and ``benchmarks/zero1_engine.py`` measured it on this machine (``benchmarks/README.md``).

Under tensor parallelism every member's shard of a layer is a parameter of its own, whose moments are
sliced over the processes holding the same shard in the other replicas
(:mod:`~resihp_lightning.state.zero_holders`); nothing else changes.

Use (the runtime does this in ``_build_engine``)::

    reducer = LayerwiseReducer(plan, rank, layers)
    shards = ZeroShards(layer_holders(plan), rank, layers, bound, reducer.groups)
    install(engine, reducer, zero=shards)      # the engine's optimizer step is now shards.step()
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from resihp_lightning.errors import ConfigError
from resihp_lightning.state.bound_optimizer import FROZEN, BoundOptimizer
from resihp_lightning.state.zero_layout import Piece, SliceLayout
from resihp_lightning.torch_utils.collectives import release_process_groups

#: Optimizer classes whose state the layer-wise ZeRO-1 shards (element-wise maths, per-element state).
SUPPORTED_OPTIMIZERS: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW)
#: Elements of the layers whose updated slices one all-gather carries at most (plus one layer): the transient
#: buffers are about ``(D + 1) / D`` times this (1 MiB of fp32), or one layer when a layer is larger.
GATHER_BUCKET_NUMEL = 1 << 18
#: Optimizer state entries that are per parameter, not per element (kept whole in every piece).
SCALAR_KEYS = ("step",)

#: One piece's optimizer state (``{"step": t, "exp_avg": T, "exp_avg_sq": T}`` for Adam; ``{}`` before the first step).
PieceState = dict[str, Any]
#: Slices of optimizer state a rank keeps: layer -> slice -> the state of each of its pieces, in piece order.
SliceStates = dict[int, dict[int, list[PieceState]]]


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuses an optimizer the layer-wise ZeRO-1 cannot shard.

    Raises:
        ConfigError: not exactly ``torch.optim.Adam`` / ``AdamW`` (a subclass may step otherwise).
    """
    if type(optimizer) not in SUPPORTED_OPTIMIZERS:
        raise ConfigError(
            f"deepspeed_config.zero_optimization.stage=1 (the layer-wise ZeRO-1) shards the state of "
            f"{' / '.join('torch.optim.' + c.__name__ for c in SUPPORTED_OPTIMIZERS)} only, not "
            f"{type(optimizer).__name__}; use one of those, or DeepSpeed's ZeRO wrapper with "
            "zero_optimization.layerwise=False"
        )


def trained_parameters(layers: Mapping[int, nn.Module], group_of: Mapping[str, int]) -> dict[int, list[tuple[str, nn.Parameter]]]:
    """Each layer's parameters the optimizer trains, by key ``"<layer>.<name>"``, in ``named_parameters`` order
    (the order of the layer's flat index; the same on every holder)."""
    out: dict[int, list[tuple[str, nn.Parameter]]] = {}
    for index in sorted(layers):
        params = [
            (key, p) for name, p in layers[index].named_parameters()
            if p.numel() > 0 and group_of.get(key := f"{index}.{name}", 0 if p.requires_grad else FROZEN) != FROZEN
        ]
        if params:
            out[index] = params
    return out


def elementwise(key: str, value: Any) -> bool:
    """Whether a state entry has one value per parameter element (sliced with it)."""
    return isinstance(value, Tensor) and key not in SCALAR_KEYS


def cut_state(entry: Mapping[str, Any], piece: Piece, param: Tensor) -> PieceState:
    """A piece's state cut from its parameter's whole state ``entry`` (copies, on ``param``'s device)."""
    out: PieceState = {}
    for key, value in entry.items():
        if elementwise(key, value):
            if value.numel() != param.numel():
                raise RuntimeError(f"optimizer state {key!r} has {value.numel()} elements for a parameter of {param.numel()}")
            out[key] = value.reshape(-1)[piece.start:piece.stop].to(param.device, copy=True)
        else:
            out[key] = value.clone() if isinstance(value, Tensor) else value
    return out


def join_slices(layout: SliceLayout, shapes: list[torch.Size], slices: Mapping[int, list[PieceState]]) -> list[PieceState]:
    """Every parameter's whole state from all ``layout``'s slices (``slices[s]``: its pieces' states).

    A parameter whose pieces have no state (never stepped) gets ``{}``.

    Raises:
        RuntimeError: a slice is missing, or a parameter's pieces disagree on whether they have state.
    """
    parts: list[list[tuple[Piece, PieceState]]] = [[] for _ in shapes]
    for s in range(layout.holders):
        pieces = layout.pieces(s)
        if pieces and s not in slices:
            raise RuntimeError(f"slice {s} of {layout.holders} is missing")
        for piece, state in zip(pieces, slices.get(s, []), strict=True):
            parts[piece.param].append((piece, state))
    out: list[PieceState] = []
    for shape, entries in zip(shapes, parts):
        entries.sort(key=lambda e: e[0].start)
        stepped = [bool(state) for _, state in entries]
        if not any(stepped):
            out.append({})
            continue
        if not all(stepped):
            raise RuntimeError("a parameter's optimizer state exists in some of its slices only")
        first = entries[0][1]
        out.append({
            key: torch.cat([state[key] for _, state in entries]).view(shape) if elementwise(key, value)
            else (value.clone() if isinstance(value, Tensor) else value)
            for key, value in first.items()
        })
    return out


@dataclass
class _LayerShard:
    """One local layer under ZeRO-1.

    Attributes:
        keys: its trained parameters' keys, in flat order.
        params: those parameters.
        layout: its slices over its holders.
        holder: this rank's index among the holders (its replica).
        ranks: the holders, in ranks of the process group, in replica order.
        pieces: kept slice -> ``(piece, the shadow parameter stepping it)`` in piece order.
    """

    keys: list[str]
    params: list[nn.Parameter]
    layout: SliceLayout
    holder: int
    ranks: tuple[int, ...]
    pieces: dict[int, list[tuple[Piece, nn.Parameter]]]


def _flat(tensor: Tensor) -> Tensor:
    return tensor.view(-1)


class ZeroShards:
    """This rank's slices of its layers' optimizer state, and the sharded optimizer step (module docstring).

    Building one is local. :meth:`step` and :meth:`full_state` are collective over the holder sets this
    rank is in (every holder calls them at the same point, as the reducer's ``reduce``).

    Args:
        holders: layer -> the ranks (of the current process group) sharing this rank's shard of it, in
            replica order, for at least this rank's layers (:func:`~resihp_lightning.placement.layer_holders`
            of the plan in ranks; under tensor parallelism :func:`~resihp_lightning.state.zero_holders.shard_holders`).
        rank: this process's rank.
        local_layers: its layers by global index.
        bound: the user's optimizer (its class and hyper-parameters are used; its own ``state`` stays empty).
        groups: the process group of every holder set of two or more ranks this rank is in, by the set's
            ranks in replica order (e.g. :attr:`LayerwiseReducer.groups <resihp_lightning.runtime.layerwise.LayerwiseReducer.groups>`).
        owned: process groups this object created for itself (released by :meth:`destroy`).

    Raises:
        ConfigError: the optimizer is not Adam / AdamW, or a parameter is not contiguous.
    """

    def __init__(
        self,
        holders: Mapping[int, tuple[int, ...]] | Sequence[tuple[int, ...]],
        rank: int,
        local_layers: Mapping[int, nn.Module],
        bound: BoundOptimizer,
        groups: Mapping[tuple[int, ...], Any],
        owned: Sequence[Any] = (),
    ) -> None:
        check_optimizer(bound.optimizer)
        self.bound = bound
        self.bucket_numel = GATHER_BUCKET_NUMEL
        self.rank = rank
        self._owned = list(owned)
        per_group: list[list[nn.Parameter]] = [[] for _ in bound.groups]
        self.layers: dict[int, _LayerShard] = {}
        for index, params in trained_parameters(local_layers, bound.group_of).items():
            ranks = holders[index]
            layout = SliceLayout(tuple(p.numel() for _, p in params), len(ranks))
            holder = ranks.index(rank)
            pieces: dict[int, list[tuple[Piece, nn.Parameter]]] = {}
            for s in layout.kept_by(holder):
                pieces[s] = []
                for piece in layout.pieces(s):
                    key, param = params[piece.param]
                    if not param.is_contiguous():
                        raise ConfigError(f"the layer-wise ZeRO-1 needs contiguous parameters; {key} is not")
                    shadow = nn.Parameter(_flat(param.data)[piece.start:piece.stop], requires_grad=param.requires_grad)
                    per_group[bound.group_of.get(key, 0)].append(shadow)
                    pieces[s].append((piece, shadow))
            self.layers[index] = _LayerShard([k for k, _ in params], [p for _, p in params], layout, holder, ranks, pieces)
        self._pieces_of: dict[int, list[nn.Parameter]] = {}  # id(parameter) -> its shadow pieces
        for shard in self.layers.values():
            for piece, shadow in (e for entries in shard.pieces.values() for e in entries):
                self._pieces_of.setdefault(id(shard.params[piece.param]), []).append(shadow)
        self._groups = dict(groups)
        # Every member of a holder set holds all of the set's layers: ordered by their first layer, the
        # sets' collectives run in the same order on every rank.
        first: dict[tuple[int, ...], int] = {}
        for index in sorted(self.layers):
            first.setdefault(self.layers[index].ranks, index)
        self._order = sorted((h for h in first if len(h) > 1), key=lambda h: (first[h], h))
        missing = [h for h in self._order if h not in self._groups]
        if missing:
            raise ValueError(f"no process group for the holder sets {missing}")
        self._shadow = self._make_shadow(per_group) if any(per_group) else None

    def _make_shadow(self, per_group: list[list[nn.Parameter]]) -> torch.optim.Optimizer:
        """An optimizer of the user's class over the pieces, one group per user group (hyper-parameters copied)."""
        optimizer = self.bound.optimizer
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups = [{**_hyper(group), "params": pieces} for group, pieces in zip(self.bound.groups, per_group)]
        return cls(groups, **kwargs)

    # ------------------------------------------------------------------------------- step
    def step(self) -> None:
        """Steps this rank's slices of every local layer and all-gathers the updated parameters (collective)."""
        if self._shadow is not None:
            for shadow, group in zip(self._shadow.param_groups, self.bound.groups):
                shadow.update(_hyper(group))  # LR schedulers write into the user's groups
            self._point_pieces()
            self._shadow.step()
            for shard in self.layers.values():
                for _, piece in (e for entries in shard.pieces.values() for e in entries):
                    piece.grad = None
        self._gather_parameters()

    def _point_pieces(self) -> None:
        """Makes every piece view the current storage of its parameter and gradient (a move or a
        checkpoint load may have replaced a parameter's data; DeepSpeed may have replaced its grad)."""
        for shard in self.layers.values():
            for entries in shard.pieces.values():
                for piece, shadow in entries:
                    param = shard.params[piece.param]
                    shadow.data = _flat(param.data)[piece.start:piece.stop]
                    grad = param.grad
                    shadow.grad = None if grad is None else _flat(grad.data)[piece.start:piece.stop]

    def _gather_parameters(self) -> None:
        """Every holder's own slice of the updated parameters to every holder of the set: one all-gather per
        holder set, dtype and bucket of consecutive layers of at most :data:`GATHER_BUCKET_NUMEL` elements
        (past the layer that crosses it), each member's part padded to the longest. The bucket bounds the
        transient buffers (about ``(D + 1) / D`` times the bucket) that the sharded moments save against."""
        with torch.no_grad():
            for ranks in self._order:
                shards = [self.layers[i] for i in sorted(self.layers) if self.layers[i].ranks == ranks]
                dtypes = sorted({p.dtype for shard in shards for p in shard.params}, key=str)
                for dtype in dtypes:
                    for bucket in _layer_buckets(shards, self.bucket_numel):
                        self._gather_set(bucket, ranks, dtype)

    def _gather_set(self, shards: list[_LayerShard], ranks: tuple[int, ...], dtype: torch.dtype) -> None:
        def views(holder: int) -> list[Tensor]:
            return [
                _flat(shard.params[piece.param].data)[piece.start:piece.stop]
                for shard in shards for piece in shard.layout.pieces(holder)
                if shard.params[piece.param].dtype == dtype
            ]

        parts = [views(j) for j in range(len(ranks))]
        lengths = [sum(v.numel() for v in part) for part in parts]
        longest = max(lengths)
        if longest == 0:
            return
        mine = shards[0].holder
        device = shards[0].params[0].device
        send = torch.zeros(longest, dtype=dtype, device=device)
        if parts[mine]:
            torch.cat(parts[mine], out=send[: lengths[mine]])
        group = self._groups[ranks]
        # Into one tensor: a list of outputs would make gloo gather into a flat copy of them first.
        received = torch.empty(longest * len(ranks), dtype=dtype, device=device)
        dist.all_gather_into_tensor(received, send, group=group)
        for j, part in enumerate(parts):
            if j == mine:
                continue
            # The group numbers its members in sorted rank order; holder j is the replica order's j-th.
            member = dist.get_group_rank(group, ranks[j])
            got = received[member * longest : (member + 1) * longest]
            offset = 0
            for view in part:
                view.copy_(got[offset : offset + view.numel()])
                offset += view.numel()

    # ------------------------------------------------------------------------------ state
    def export_slices(self) -> SliceStates:
        """The state of every slice this rank keeps (the tensors themselves, not copies)."""
        state = self._shadow.state if self._shadow is not None else {}
        return {
            index: {s: [dict(state.get(shadow, {})) for _, shadow in entries] for s, entries in shard.pieces.items()}
            for index, shard in self.layers.items()
        }

    def load_full(self, by_key: Mapping[str, Mapping[str, Any]]) -> None:
        """Cuts this rank's slices out of whole per-parameter states (``"<layer>.<name>"`` -> Adam's state);
        parameters without an entry start with no state (local)."""
        if self._shadow is None:
            return
        for shard in self.layers.values():
            for entries in shard.pieces.values():
                for piece, shadow in entries:
                    entry = by_key.get(shard.keys[piece.param])
                    self._shadow.state.pop(shadow, None)
                    if entry:
                        self._shadow.state[shadow] = cut_state(entry, piece, shard.params[piece.param])

    def full_state(self) -> dict[str, PieceState]:
        """Every local parameter's whole optimizer state by key (collective over this rank's holder sets:
        each holder contributes the slices it is primary for, on the CPU). For checkpoints."""
        slices = self.export_slices()
        gathered: dict[int, dict[int, list[PieceState]]] = {i: dict(per) for i, per in slices.items()}
        for ranks in self._order:
            mine = {
                i: {shard.holder: [_cpu(state) for state in slices[i][shard.holder]]}
                for i, shard in self.layers.items() if shard.ranks == ranks
            }
            parts: list[Any] = [None] * len(ranks)
            dist.all_gather_object(parts, mine, group=self._groups[ranks])
            for part in parts:
                for i, per in part.items():
                    for s, states in per.items():
                        gathered[i].setdefault(s, [_to(state, self.layers[i].params[0].device) for state in states])
        out: dict[str, PieceState] = {}
        for i, shard in self.layers.items():
            joined = join_slices(shard.layout, [p.shape for p in shard.params], gathered[i])
            out.update({key: state for key, state in zip(shard.keys, joined) if state})
        return out

    def state_bytes(self, param: nn.Parameter) -> float:
        """Bytes of optimizer state this rank keeps for ``param`` (its pieces in the slices it keeps)."""
        if self._shadow is None:
            return 0.0
        total = 0
        for shadow in self._pieces_of.get(id(param), ()):
            total += sum(v.numel() * v.element_size() for k, v in self._shadow.state.get(shadow, {}).items() if elementwise(k, v))
        return float(total)

    def adopt(self, previous: ZeroShards) -> None:
        """Takes over the slices ``previous`` kept of the same layers under the same layout (local): the state of
        a rebuild that changed nothing (the strategy set up again, e.g. ``trainer.validate`` between fits).
        A layer whose slices differ is left without state."""
        if self._shadow is None or previous._shadow is None:
            return
        for index, shard in self.layers.items():
            old = previous.layers.get(index)
            if old is None or (old.layout, old.holder, old.keys) != (shard.layout, shard.holder, shard.keys):
                continue
            for s, entries in shard.pieces.items():
                for (piece, shadow), (old_piece, old_shadow) in zip(entries, old.pieces.get(s, ()), strict=False):
                    if piece == old_piece and old_shadow in previous._shadow.state:
                        self._shadow.state[shadow] = previous._shadow.state[old_shadow]

    def destroy(self) -> None:
        """Releases the process groups this object created (local; the others belong to the reducer)."""
        release_process_groups(self._owned)
        self._owned = []


def _layer_buckets(shards: list[_LayerShard], numel: int) -> list[list[_LayerShard]]:
    """``shards`` in order, cut after the layer that takes a bucket past ``numel`` elements."""
    out: list[list[_LayerShard]] = [[]]
    size = 0
    for shard in shards:
        out[-1].append(shard)
        size += shard.layout.total
        if size > numel:
            out.append([])
            size = 0
    return [bucket for bucket in out if bucket]


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _cpu(state: PieceState) -> PieceState:
    return {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in state.items()}


def _to(state: PieceState, device: torch.device) -> PieceState:
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in state.items()}


class ShardedStep:
    """Stands in for the user's optimizer inside a DeepSpeed engine: ``step()`` is :meth:`ZeroShards.step`;
    everything else (``param_groups``, ``zero_grad``, ``state_dict``, ...) is the user's optimizer's.

    Installed as both ``engine.optimizer`` and ``engine.basic_optimizer`` (so nothing takes it for a
    DeepSpeed wrapper).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, shards: ZeroShards) -> None:
        self.optimizer = optimizer
        self.shards = shards

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise RuntimeError("the layer-wise ZeRO-1 step takes no closure")
        self.shards.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def __getattr__(self, name: str) -> Any:
        if name in ("optimizer", "shards"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)
