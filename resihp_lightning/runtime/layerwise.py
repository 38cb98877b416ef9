"""Layer-wise data-parallel gradient reduction, so that replicas may use different stage bounds.

DeepSpeed's ``PipelineEngine`` all-reduces gradients over its data-parallel group: the ranks that
hold the same *stage* in every replica. That is only right when every replica holds the same layers
in each stage. Here the unit is the *layer*: layer l is held by one rank per replica (its holder
set); every distinct holder set gets its own process group, and each rank all-reduces, per holder
set it belongs to, one flattened buffer of the gradients of its layers held by that set. The
averaging is DeepSpeed's own (sum, then times ``predivide / D``, by default ``1 / D``), so the loss
scaling ``m_r * D / M`` of the strategy still gives the exact global-batch gradient. With shared
bounds there is one holder set per stage, equal to DeepSpeed's data-parallel group, and the
reduction is the same as DeepSpeed's.

Tied parameters (one parameter used by several layers, e.g. an input embedding reused as the LM
head) are kept as equal copies, one per layer, the way DeepSpeed's ``TiedLayerSpec`` does: a tie's
gradient is the sum of its copies' gradients over every rank holding a copy (averaged over
replicas like any other), written back into every copy, so the copies receive identical updates
and stay equal; the initial broadcast makes them equal, and the clipping norm counts a tie once.

Use::

    reducer = LayerwiseReducer(plan, rank, pipe.local_layers())   # collective (creates groups)
    engine = build_engine(pipe, optimizer, config, broadcast=False)
    reducer.broadcast()            # only at the start: replica 0's values to every holder
    install(engine, reducer)       # the engine now reduces (and clips) layer-wise
    ...
    destroy_engine(engine); reducer.destroy()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from resihp_lightning.errors import ConfigError, PlanError, invalid_option
from resihp_lightning.placement import holder_sets, layer_holders, position
from resihp_lightning.plan import Plan
from resihp_lightning.runtime.mixed_precision import MixedPrecision
from resihp_lightning.torch_utils.collectives import release_process_groups
from resihp_lightning.torch_utils.shards import split_dim


#: Elements per flattened all-reduce at most (plus one tensor): DeepSpeed's ``MEMORY_OPT_ALLREDUCE_SIZE``.
BUCKET_NUMEL = 500_000_000


def _buckets(tensors: list[Tensor], numel: int) -> list[list[Tensor]]:
    """``tensors`` in order, cut after the tensor that takes a bucket past ``numel`` elements."""
    out: list[list[Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        out[-1].append(tensor)
        size += tensor.numel()
        if size > numel:
            out.append([])
            size = 0
    return [bucket for bucket in out if bucket]


def averaged_allreduce(settings: Any, tensors: list[Tensor], group: Any, world: int) -> None:
    """DeepSpeed's ``allreduce_bucket`` maths on one flattened buffer of ``tensors`` over ``group`` of ``world``
    holders; ``settings`` carries the engine's ``average``, ``prescale``, ``predivide`` and
    ``communication_dtype`` (a reducer after :func:`install`)."""
    flat = _flatten_dense_tensors(tensors)
    dtype = settings.communication_dtype
    work = flat if dtype in (None, flat.dtype) else flat.to(dtype)
    if not settings.average:
        dist.all_reduce(work, group=group)
    elif not settings.prescale:
        if settings.predivide != 1.0:
            work.mul_(1.0 / settings.predivide)
        dist.all_reduce(work, group=group)
        if settings.predivide != world:
            work.mul_(settings.predivide / world)
    else:
        work.mul_(1.0 / world)
        dist.all_reduce(work, group=group)
    if work is not flat:
        flat.copy_(work)
    for tensor, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        tensor.copy_(synced)


@dataclass
class _Tie:
    """One tied parameter as this rank sees it.

    Attributes:
        members: every copy's ``(layer, name)``, sorted; the first is the one the norm counts.
        ranks: every rank holding a copy, in any replica (sorted).
        source: the rank whose value the initial broadcast spreads (the first copy's holder in
            the first replica).
        group: the process group over ``ranks`` when this rank is in it and it has two or more
            ranks, else ``None``.
        params: this rank's copies, in ``members`` order.
    """

    members: tuple[tuple[int, str], ...]
    ranks: tuple[int, ...]
    source: int
    group: Any
    params: list[nn.Parameter]
    first_local: bool

    def is_first(self, param: nn.Parameter) -> bool:
        return self.first_local and param is self.params[0]

    @classmethod
    def build(
        cls,
        ordered: tuple[tuple[int, str], ...],
        params: list[nn.Parameter],
        holders: Sequence[tuple[int, ...]],
        rank: int,
        local_layers: Mapping[int, nn.Module],
        created: dict[frozenset[int], Any],
    ) -> _Tie:
        """``created``: every group of :func:`_create_groups` (the tie's among them when it has two or more ranks)."""
        ranks = _tie_ranks(ordered, holders)
        member = rank in ranks and len(ranks) > 1
        return cls(
            members=ordered,
            ranks=ranks,
            source=holders[ordered[0][0]][0],
            group=created[frozenset(ranks)] if member else None,
            params=params,
            first_local=bool(params) and ordered[0][0] in local_layers,
        )


def _tie_ranks(ordered: Sequence[tuple[int, str]], holders: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Every rank holding a copy of a tie, in any replica (sorted)."""
    return tuple(sorted({r for layer, _ in ordered for r in holders[layer]}))


def _create_groups(plans: Sequence[Plan], ties: Sequence[Sequence[tuple[int, str]]]) -> dict[frozenset[int], Any]:
    """The process groups of every plan's holder sets and ties (collective: every rank creates them
    all, in the same order: plan by plan, holder sets in :func:`~resihp_lightning.placement.holder_sets` order, then the ties)."""
    created: dict[frozenset[int], Any] = {}
    for plan in plans:
        holders = layer_holders(plan)
        wanted = [*holder_sets(plan), *(_tie_ranks(sorted(members), holders) for members in ties)]
        for ranks in wanted:
            if len(ranks) > 1 and frozenset(ranks) not in created:
                created[frozenset(ranks)] = dist.new_group(ranks=list(ranks))
    return created


def _resolve_ties(
    tied: Sequence[Sequence[tuple[int, str]]], local_layers: Mapping[int, nn.Module]
) -> list[tuple[tuple[tuple[int, str], ...], list[nn.Parameter]]]:
    """Each tie's sorted members and this rank's copies; errors are agreed on by every rank.

    A tie naming a missing parameter is found only on the rank holding that layer; the error is
    gathered so that every rank raises it, instead of the others waiting in the next collective.
    """
    resolved, error = [], ""
    for members in tied:
        ordered = tuple(sorted((int(layer), str(name)) for layer, name in members))
        params: list[nn.Parameter] = []
        for layer, name in ordered:
            if layer not in local_layers:
                continue
            named = dict(local_layers[layer].named_parameters())
            if name not in named:
                error = error or str(invalid_option("pipeline_tied_parameters", f"{layer}.{name}", f"parameters of layer {layer}: {sorted(named)}"))
            else:
                params.append(named[name])
        if params and any(p.shape != params[0].shape for p in params):
            error = error or str(invalid_option("pipeline_tied_parameters", [f"{l}.{n}" for l, n in ordered], "copies of one shape"))
        resolved.append((ordered, params))
    if tied and dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), "")
    if error:
        raise ConfigError(error)
    return resolved


class LayerwiseReducer:
    """All-reduces this rank's gradients layer-wise over the holder sets of ``plan``.

    Creating one is collective: every rank of the world must construct its reducer for the same
    plan at the same point (``torch.distributed.new_group`` is called once per holder set of two or
    more ranks, in :func:`~resihp_lightning.placement.holder_sets` order, on every rank). :meth:`destroy` releases the groups.

    Args:
        plan: the plan in force (device ids are global ranks).
        rank: this process's global rank.
        local_layers: this rank's layer modules by global layer index (``pipe.local_layers()``); layers
            without parameters may be left out.
        tied: groups of parameters that are one parameter, each a sequence of ``(layer, name)``
            (``name`` as in ``layer.named_parameters()``); the same on every rank.
        slices: with tensor parallelism, the plan of every slice in ranks (``plan`` is this rank's;
            see :mod:`~resihp_lightning.tensor.tensor_groups`): every rank creates the groups of
            every slice, in slice order, and reduces within its own slice.
        tensor_group: with tensor parallelism, this rank's tensor-parallel group: the gradient norm
            adds the shards of its split parameters over it (a whole parameter counts once).

    Raises:
        PlanError: ``local_layers`` names a layer this rank does not hold under ``plan``.
        ConfigError: a tied parameter does not exist in its layer, or tied copies differ in shape.
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        local_layers: Mapping[int, nn.Module],
        tied: Sequence[Sequence[tuple[int, str]]] = (),
        slices: Sequence[Plan] = (),
        tensor_group: Any = None,
    ) -> None:
        mine = position(plan, rank).layers
        extra = sorted(set(local_layers) - set(mine))
        if extra:
            raise PlanError(f"rank {rank} holds layers {mine.start}..{mine.stop - 1} under the plan, not {extra}")
        holders = layer_holders(plan)
        self.plan = plan
        self.rank = rank
        self.data_degree = plan.data_degree
        # DeepSpeed's averaging settings; install() copies the engine's.
        self.average = True
        self.prescale = False
        self.predivide = 1.0
        self.communication_dtype: torch.dtype | None = None
        self.tensor_group = tensor_group
        self._tensor_member = dist.get_rank(tensor_group) if tensor_group is not None else 0
        resolved = _resolve_ties(tied, local_layers)
        created = _create_groups(slices or (plan,), [members for members, _ in resolved])
        self._memberships = [group for ranks, group in created.items() if rank in ranks]
        self._groups: dict[tuple[int, ...], Any] = {
            ranks: created[frozenset(ranks)] for ranks in holder_sets(plan) if len(ranks) > 1 and rank in ranks
        }
        self._ties = [_Tie.build(members, params, holders, rank, local_layers, created) for members, params in resolved]
        tied_ids = {id(p) for tie in self._ties for p in tie.params}
        # Per holder set (in holder_sets order): the parameters whose gradients it reduces, and all
        # parameters (for the initial broadcast, which DeepSpeed also does for frozen ones).
        self._trained: dict[tuple[int, ...], list[nn.Parameter]] = {}
        self._all: dict[tuple[int, ...], list[nn.Parameter]] = {}
        self._layer_params: dict[int, list[nn.Parameter]] = {}
        for layer in sorted(local_layers):
            params = [p for p in local_layers[layer].parameters() if p.numel() > 0]
            self._layer_params[layer] = params
            self._all.setdefault(holders[layer], []).extend(params)
            self._trained.setdefault(holders[layer], []).extend(
                p for p in params if p.requires_grad and id(p) not in tied_ids
            )
        self._order = [h for h in holder_sets(plan) if h in self._groups and h in self._all]
        self._num_layers = len(holders)

    @property
    def groups(self) -> dict[tuple[int, ...], Any]:
        """The process groups this rank belongs to, by holder set."""
        return dict(self._groups)

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter the reducer covers (this rank's local layers)."""
        return [p for params in self._layer_params.values() for p in params]

    def reduce(self, bucket_numel: int = BUCKET_NUMEL) -> None:
        """All-reduces the gradients of this rank's layers: one flattened buffer per holder set and dtype.

        As DeepSpeed does, a trained parameter without a gradient contributes zeros (every holder
        must reduce buffers of the same size), and a buffer is cut after the tensor that takes it past
        ``bucket_numel`` elements (bounding the extra memory of the flat copy; the sums are the same).
        """
        for ranks in self._order:
            grads: dict[torch.dtype, list[Tensor]] = {}
            for p in self._trained.get(ranks, ()):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if p.grad.is_sparse:
                    raise NotImplementedError("layer-wise gradient reduction does not support sparse gradients")
                grads.setdefault(p.grad.dtype, []).append(p.grad.data)
            for dtype in sorted(grads, key=str):
                for bucket in _buckets(grads[dtype], bucket_numel):
                    self._allreduce(bucket, self._groups[ranks], len(ranks))
        for tie in self._ties:
            if not tie.params or not tie.params[0].requires_grad:
                continue
            total = torch.zeros_like(tie.params[0])
            for p in tie.params:
                if p.grad is not None:
                    total.add_(p.grad)
            if tie.group is not None:
                # Summed over every copy in every replica, then averaged over the replicas.
                self._allreduce([total], tie.group, self.data_degree)
            for p in tie.params:
                if p.grad is None:
                    p.grad = total.clone()
                else:
                    p.grad.copy_(total)

    def _allreduce(self, tensors: list[Tensor], group: Any, world: int) -> None:
        averaged_allreduce(self, tensors, group, world)

    def broadcast(self) -> None:
        """Copies every local parameter from its holder in the first replica to the other holders.

        Replaces DeepSpeed's ``_broadcast_model`` (which pairs ranks by stage): build the engine with
        ``broadcast=False`` and call this once, when replicas may have built layers differently.
        """
        with torch.no_grad():
            for ranks in self._order:
                params = self._all[ranks]
                by_dtype: dict[torch.dtype, list[Tensor]] = {}
                for p in params:
                    by_dtype.setdefault(p.dtype, []).append(p.data)
                for dtype in sorted(by_dtype, key=str):
                    tensors = by_dtype[dtype]
                    flat = _flatten_dense_tensors(tensors)
                    dist.broadcast(flat, src=ranks[0], group=self._groups[ranks])
                    for tensor, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                        tensor.copy_(synced)
            for tie in self._ties:
                if not tie.params:
                    continue
                value = tie.params[0].data.clone()
                if tie.group is not None:
                    dist.broadcast(value, src=tie.source, group=tie.group)
                for p in tie.params:
                    p.data.copy_(value)

    def grad_norm(self, pipe_group: Any = None, device: Any = None) -> Tensor:
        """The 2-norm of the whole model's gradient, the same value on every rank of ``pipe_group``.

        Each rank fills the squared norms of its own layers into a vector of one entry per layer;
        a sum over the replica's pipeline group then has exactly one contribution per entry (exact),
        and every rank adds the entries in layer order. So replicas with different bounds, whose
        reduced gradients are the same, get the same norm bit for bit.

        Args:
            pipe_group: the ranks of this rank's replica (the engine's pipeline group); ``None`` when
                this rank holds the whole model.
            device: where the collective runs (the engine's device; default: the parameters').
        """
        if device is None:
            device = next((p.device for p in self.parameters()), torch.device("cpu"))
        squares = torch.zeros(self._num_layers, dtype=torch.float64, device=device)
        copies = {id(p) for tie in self._ties for p in tie.params if not tie.is_first(p)}
        for layer, params in self._layer_params.items():
            for p in params:
                if p.grad is None or id(p) in copies:
                    continue
                # Under tensor parallelism a whole parameter is the same on every member: member 0 counts it.
                if self.tensor_group is not None and split_dim(p) is None and self._tensor_member != 0:
                    continue
                squares[layer] += p.grad.detach().float().norm(2).double() ** 2
        if self.tensor_group is not None:
            dist.all_reduce(squares, group=self.tensor_group)
        if pipe_group is not None:
            dist.all_reduce(squares, group=pipe_group)
        return squares.sum().sqrt()

    def clip(self, max_norm: float, pipe_group: Any = None, device: Any = None, norm: Tensor | None = None) -> Tensor:
        """Scales all local gradients by ``min(1, max_norm / (norm + 1e-6))`` (DeepSpeed's rule); returns the norm.

        Args:
            norm: the :meth:`grad_norm` computed already (then nothing is communicated here).
        """
        if norm is None:
            norm = self.grad_norm(pipe_group, device)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0).float()
        for p in self.parameters():
            if p.grad is not None:
                p.grad.data.mul_(coef.to(p.grad.device, p.grad.dtype))
        return norm.float()

    def destroy(self) -> None:
        """Destroys the process groups this reducer created (this rank's memberships)."""
        release_process_groups(self._memberships)
        self._groups.clear()
        self._memberships = []
        self._ties = []
        self._order = []


_CLASSES: dict[type, type] = {}


def _layerwise_class(base: type) -> type:
    """``base`` (a ``PipelineEngine`` class) with layer-wise reduction and clipping (made once per base)."""
    if getattr(base, "_resihp_layerwise", False):
        return base
    if base not in _CLASSES:
        from deepspeed.runtime.pipe import schedule

        class LayerwisePipelineEngine(base):  # type: ignore[misc, valid-type]
            """A ``PipelineEngine`` that reduces and clips gradients with a :class:`LayerwiseReducer`.

            Its optimizer step has a commit point: every collective of the step (the loss average, the
            clipping norm) runs before it, ``_resihp_commit`` (when set) runs at it, and only local work
            follows. A peer lost before the commit point leaves no rank with an updated model, so the
            step can be redone exactly on the survivors.
            """

            _resihp_layerwise = True
            _resihp_reducer: LayerwiseReducer
            _resihp_commit: Any = None
            _resihp_precision: Any = None  # a MixedPrecision: forward passes (and the loss) under autocast
            _resihp_loss: Any = None
            _resihp_norm: Any = None

            def allreduce_gradients(self, bucket_size: int = BUCKET_NUMEL) -> None:
                if self.is_gradient_accumulation_boundary():
                    self._resihp_reducer.reduce(bucket_size)

            def clip_fp32_gradients(self) -> Tensor:
                group = self.grid.get_pipe_parallel_group() if self.grid.pipe_parallel_size > 1 else None
                return self._resihp_reducer.clip(self.gradient_clipping(), group, self.device, norm=self._resihp_norm)

            def _broadcast_model(self) -> None:
                self._resihp_reducer.broadcast()

            def _committed_optimizer_step(self, lr_kwargs: Any = None) -> None:
                with torch.no_grad():
                    self._resihp_loss = _aggregate_loss(self, base)
                if self.gradient_clipping() > 0.0:
                    group = self.grid.get_pipe_parallel_group() if self.grid.pipe_parallel_size > 1 else None
                    self._resihp_norm = self._resihp_reducer.grad_norm(group, self.device)
                if self._resihp_commit is not None:
                    self._resihp_commit()
                try:
                    base._exec_optimizer_step(self, lr_kwargs)
                finally:
                    self._resihp_norm = None

            def _aggregate_total_loss(self) -> Any:
                loss, self._resihp_loss = self._resihp_loss, None
                return loss if loss is not None else _aggregate_loss(self, base)

            def _mixed_forward_pass(self, buffer_id: int) -> None:
                # The backward pass runs outside autocast (it follows the forward's dtypes), as torch asks.
                if self._resihp_precision is None:
                    return base._exec_forward_pass(self, buffer_id)
                with self._resihp_precision.autocast(self.device):
                    return base._exec_forward_pass(self, buffer_id)

            _INSTRUCTION_MAP = {
                **base._INSTRUCTION_MAP,
                schedule.OptimizerStep: _committed_optimizer_step,
                schedule.ForwardPass: _mixed_forward_pass,
            }

        LayerwisePipelineEngine.__name__ = LayerwisePipelineEngine.__qualname__ = f"Layerwise{base.__name__}"
        _CLASSES[base] = LayerwisePipelineEngine
    return _CLASSES[base]


def _aggregate_loss(engine: Any, base: type) -> Any:
    """The engine's loss average over replicas: its grid's own when it has one (groups of different
    tensor-parallel degrees, :class:`~resihp_lightning.runtime.tensor_grid.TensorGrid`), else DeepSpeed's."""
    aggregate = getattr(engine.grid, "aggregate_loss", None)
    return aggregate(engine) if aggregate is not None else base._aggregate_total_loss(engine)


def install(engine: Any, reducer: LayerwiseReducer, precision: MixedPrecision | None = None, zero: Any = None) -> Any:
    """Makes ``engine`` (a built ``PipelineEngine``) reduce gradients with ``reducer``; returns the engine.

    With ``precision`` (:mod:`~resihp_lightning.runtime.mixed_precision`) every forward pass of the
    schedule, the last stage's loss included, runs under its autocast: bf16 compute over the fp32
    parameters, whose gradients and optimizer state stay fp32 and per parameter.

    With ``zero`` (a :class:`~resihp_lightning.state.zero_shards.ZeroShards`) the optimizer step is the
    layer-wise ZeRO-1's: the engine's optimizer becomes a
    :class:`~resihp_lightning.state.zero_shards.ShardedStep` in front of the user's.

    The engine's class is swapped for a subclass that overrides three DeepSpeed methods:

    * ``allreduce_gradients`` — the one place DeepSpeed's data-parallel reduction enters; the
      schedule's ``ReduceGrads`` instruction reaches it through the stock ``_exec_reduce_grads``
      (which keeps managing ``_force_grad_boundary`` and ``pipeline_enable_backward_allreduce``),
      and any other caller of it (``DeepSpeedEngine.backward`` when backward all-reduce is enabled)
      gets the layer-wise reduction too, rather than the stage-paired one.
    * ``clip_fp32_gradients`` — DeepSpeed's pipeline-mode clipping sums parameter norms only on the
      rank with model-parallel rank 0 of each pipeline (other stages' parameters count only when
      marked ``model_parallel``), so its norm is not the model's. The override takes the exact norm
      over the whole replica (see :meth:`LayerwiseReducer.grad_norm`).
    * ``_broadcast_model`` — layer-wise, should anything call it again.

    Why ``allreduce_gradients`` and not the ``ReduceGrads`` entry of ``_INSTRUCTION_MAP``: the stage
    profiler (``profiling.StageProfiler.attach``) puts an instance copy of the engine's class table on
    the engine; a replaced class-level entry would be shadowed by that copy when the profiler attaches
    first, silently bringing back the stage-paired reduction. The stock ``_exec_reduce_grads`` calls
    ``self.allreduce_gradients``, so overriding the method works under any table.

    Why a class swap rather than per-instance bound methods: no engine -> method -> engine reference
    cycles (engines are rebuilt on every re-plan and should be freed at once), and ``isinstance`` /
    ``type(engine).__name__`` tell whether an engine is converted.

    Raises:
        ConfigError: the engine uses ZeRO, bf16, fp16 or MoE (their optimizer wrappers own and reduce
            the gradients themselves).
        PlanError: the reducer does not cover exactly the engine's trained parameters.
    """
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if not isinstance(engine, PipelineEngine):
        raise TypeError(f"install needs a DeepSpeed PipelineEngine, got {type(engine).__name__}")
    stage = engine.zero_optimization_stage()
    if stage:
        raise invalid_option("deepspeed_config.zero_optimization.stage", stage, "0 with per-replica stage bounds")
    for key, enabled in (("bf16", engine.bfloat16_enabled()), ("fp16", engine.fp16_enabled())):
        if enabled:
            raise invalid_option(f"deepspeed_config.{key}.enabled", True, "false with per-replica stage bounds")
    if getattr(engine, "has_moe_layers", False):
        raise invalid_option("model", "MoE layers", "dense layers with per-replica stage bounds")
    trained = {id(p) for p in engine.module.parameters() if p.requires_grad and p.numel() > 0}
    covered = {id(p) for p in reducer.parameters() if p.requires_grad}
    if trained != covered:
        raise PlanError(
            f"the layer-wise reducer covers {len(covered)} trained parameters but the engine trains {len(trained)}; "
            "build the reducer from this engine's pipe.local_layers()"
        )
    reducer.average = bool(engine.gradient_average)
    reducer.prescale = not engine.postscale_gradients()
    reducer.predivide = float(engine.gradient_predivide_factor())
    reducer.communication_dtype = engine.communication_data_type
    engine._resihp_reducer = reducer
    engine._resihp_precision = precision
    if zero is not None:
        from resihp_lightning.state.zero_shards import ShardedStep

        engine.optimizer = engine.basic_optimizer = ShardedStep(engine.optimizer, zero)
    engine.__class__ = _layerwise_class(type(engine))
    return engine
