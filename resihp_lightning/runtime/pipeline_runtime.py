"""``PipelineRuntime``: the pipeline of one plan on one process group, and the switch to another plan.

The runtime owns everything that depends on the plan in force: the
:class:`~resihp_lightning.runtime.pipeline_module.BoundedPipelineModule` holding this process's
layers, the DeepSpeed ``PipelineEngine``, the layer-wise gradient reducer (plain fp32 optimizer), the
stage profiler and the optimizer-state carrier. It knows nothing of Lightning: the strategy feeds it
micro-batches and asks it to switch plans.

Identity: plans name *devices* (the global rank each process started with). DeepSpeed and
``torch.distributed`` address *ranks of the current default process group*. ``ranks`` maps one to the
other (identity when the group is the job's original world), so the runtime can be built on any
subset of the job's processes once they form a process group of their own.

Idle: a plan may leave this process's device out (a hot spare, see
:mod:`~resihp_lightning.failstop.spares`). Its runtime then holds no layers, no pipe and no engine,
only the plan in force (:meth:`PipelineRuntime.follow`), so that it computes the same transfers as
the others when a later plan takes it back (:meth:`PipelineRuntime.relocate`).

Lifecycle::

    runtime = PipelineRuntime(config, plan, device)     # builds this process's layers
    runtime.start(optimizer)                            # binds the optimizer, builds the engine
    loss, busy_ms = runtime.train_batch(items, loss_scale)
    record = runtime.switch(new_plan)                   # collective; moves only what changes owner
    captured = runtime.release()                        # the group changes: stop the engine first
    record = runtime.relocate(plan, captured, ranks, between)   # moves over the union, builds on the new group
    runtime.teardown()
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from resihp_lightning.torch_utils import meta
from resihp_lightning._logging import get_logger
from resihp_lightning.contract import MigrationRecord
from resihp_lightning.errors import ConfigError
from resihp_lightning.placement import Position, Transfer, layer_holders, plan_transfers, position, relabel, same_layout
from resihp_lightning.plan import Plan
from resihp_lightning.torch_utils.shards import gather_shards, shard_of, split_dim
from resihp_lightning.runtime import batching, engine as engines
from resihp_lightning.runtime.layerwise import LayerwiseReducer, install
from resihp_lightning.runtime.mixed_precision import MixedPrecision
from resihp_lightning.runtime.mixed_reduction import MixedDegreeReducer
from resihp_lightning.runtime.tensor_grid import TensorGrid
from resihp_lightning.state.migration import migrate
from resihp_lightning.torch_utils.layer_tensors import layer_tensors
from resihp_lightning.state.bound_optimizer import BoundOptimizer, local_parameters
from resihp_lightning.state.optimizer_state import CapturedState, StateCarrier, carrier_for
from resihp_lightning.state import zero_config
from resihp_lightning.state.sharded_moments import OldHolding, ShardedStateCarrier
from resihp_lightning.state.zero_holders import shard_holders
from resihp_lightning.state.zero_shards import ZeroShards
from resihp_lightning.runtime.pipeline_module import BoundedPipelineModule, materialize_layer
from resihp_lightning.runtime.profiling import StageProfiler
from resihp_lightning.tensor.resplit import resplit
from resihp_lightning.tensor.tensor_groups import TensorGroups, TensorParallelism, destroy_process_groups
from resihp_lightning.runtime.topology import PlanTopology, TensorPlanTopology
from resihp_lightning.telemetry import LayerCost

log = get_logger(__name__)

_MB = float(2**20)


@dataclass(frozen=True)
class RuntimeConfig:
    """What stays the same whatever the plan.

    Attributes:
        layers: the model's layers in order (``nn.Module`` or DeepSpeed ``LayerSpec``).
        loss_fn: ``loss_fn(outputs, labels)``, the mean loss of one micro-batch on the last stage.
        micro_batch_size: rows per micro-batch.
        deepspeed_config: DeepSpeed config entries over the defaults (see ``engine.engine_config``).
        device: where this process's layers run.
        tied: groups of ``(layer, name)`` that are one parameter.
        commit: called at the optimizer step's commit point (plain fp32 optimizer; see
            :mod:`~resihp_lightning.failstop.step_commit`); ``None``: no vote.
        load_layer: ``load_layer(index, layer, device)`` gives an ``nn.Module`` layer built on the meta
            device its values (the module's ``pipeline_load_layer``); called for every layer this
            process holds that is still on meta when a pipe is built. ``None``: such a layer is refused.
        tensor: tensor parallelism (plans name groups; this process holds its member's shard of its
            group's layers, split from a copy of each); ``None``: none.
        precision: bf16 mixed precision run by the layer-wise engine (forward under autocast, fp32
            parameters and optimizer state; :mod:`~resihp_lightning.runtime.mixed_precision`); ``None``:
            the parameters' own dtype (fp32, or DeepSpeed's bf16 / fp16 wrapper from ``deepspeed_config``).
    """

    layers: Sequence[Any]
    loss_fn: Callable[[Any, Any], Tensor]
    micro_batch_size: int
    deepspeed_config: Mapping[str, Any]
    device: torch.device
    tied: Sequence[tuple[tuple[int, str], ...]] = field(default_factory=tuple)
    commit: Callable[[], None] | None = None
    load_layer: Callable[[int, nn.Module, torch.device], None] | None = None
    tensor: TensorParallelism | None = None
    precision: MixedPrecision | None = None


class PipelineRuntime:
    """This process's part of a pipeline x data-parallel job under one plan (see the module docstring).

    Building one is collective over the current default process group (DeepSpeed creates its groups).

    Args:
        config: what does not depend on the plan.
        plan: the plan to build (device ids).
        device: this process's device id in ``plan`` (with ``config.tensor``: its group's id).
        ranks: device id -> rank in the current default process group; default: the identity. With
            ``config.tensor``: group id -> the rank of this process's slice there.
        reuse: layer modules this process already holds, by global layer index (kept as they are).
        profiler: a profiler to keep measuring with (its per-layer history carries over); default: a new one.
        layer_sizes: for a device that ``plan`` leaves idle from the start (a process that joined the running
            job): every layer's parameter count, as the others measured it. The runtime then holds nothing
            and builds nothing; :meth:`start_idle` binds the optimizer, and a later plan takes it in.
    """

    def __init__(
        self,
        config: RuntimeConfig,
        plan: Plan,
        device: int,
        ranks: Mapping[int, int] | None = None,
        reuse: Mapping[int, nn.Module] | None = None,
        profiler: StageProfiler | None = None,
        layer_sizes: Sequence[int] | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self._ranks = dict(ranks) if ranks is not None else None
        self._id_ranks: dict[int, int] | None = None  # job-wide process id -> rank, after a TP regroup
        self._plan = plan
        self._position = _position_or_none(plan, device)
        if self._position is None and layer_sizes is None:
            raise ValueError(f"device {device} is not in the plan a runtime starts with")
        if self._position is not None and layer_sizes is not None:
            raise ValueError(f"device {device} is in the plan: layer_sizes is for a runtime that starts idle")
        self._loss_scale = 1.0
        # Layers built on the meta device (per-stage loading): a layer this process gives away in a
        # re-plan goes back to meta, so that a process holds the storage of its own layers only.
        self._release_given_away = any(isinstance(layer, nn.Module) and meta.has_meta(layer) for layer in config.layers)
        self._pipe: BoundedPipelineModule | None = self._build_pipe(plan, reuse) if layer_sizes is None else None
        self._held: dict[int, nn.Module] = {}  # this process's layers while it has no pipe (mid-move, idle)
        self._engine: Any = None
        self._reducer: LayerwiseReducer | None = None
        self._carrier: StateCarrier = carrier_for(None, config.deepspeed_config)
        self._profiler = profiler if profiler is not None else StageProfiler(config.device)
        self._layer_numel: list[int] = list(layer_sizes or [])

    # ------------------------------------------------------------------------------ views
    @property
    def plan(self) -> Plan:
        """The plan in force."""
        return self._plan

    @property
    def position(self) -> Position:
        """This process's replica, stage and layers under the plan in force (RuntimeError when idle)."""
        if self._position is None:
            raise RuntimeError(f"device {self.device} is idle under the plan in force (a spare)")
        return self._position

    @property
    def idle(self) -> bool:
        """Whether the plan in force leaves this process's device out (a spare: no layers, no engine)."""
        return self._position is None

    @property
    def pipe(self) -> BoundedPipelineModule:
        """The DeepSpeed pipeline module holding this process's layers."""
        if self._pipe is None:
            raise RuntimeError(f"device {self.device} is idle under the plan in force (a spare)")
        return self._pipe

    @property
    def shard_index(self) -> int:
        """Which shard of its layers this process holds: its index in its tensor-parallel group (0 without
        tensor parallelism). Writers of whole layers (checkpoints, saves) are the processes with 0."""
        return self.config.tensor.member if self.config.tensor is not None else 0

    @property
    def layer_sizes(self) -> list[int]:
        """Parameter count of every layer of the model (what balances the senders of a migration)."""
        return list(self._layer_numel)

    def plan_in_ranks(self) -> Plan:
        """The plan in force with device ids replaced by ranks of the current default group."""
        return self._in_ranks(self._plan)

    @property
    def engine(self) -> Any:
        """The DeepSpeed ``PipelineEngine`` (``None`` before :meth:`start`)."""
        return self._engine

    @property
    def per_replica_bounds(self) -> bool:
        """Whether replicas may have different stage bounds (the plain fp32 optimizer)."""
        return self._carrier.per_replica_bounds

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype DeepSpeed gives the parameters (floating-point inputs are cast to it)."""
        return self._carrier.param_dtype

    @property
    def profiler(self) -> StageProfiler:
        return self._profiler

    def local_layers(self) -> dict[int, nn.Module]:
        """This process's layer modules by global layer index (none when idle)."""
        return self._pipe.local_layers() if self._pipe is not None else dict(self._held)

    def local_parameters(self) -> dict[str, nn.Parameter]:
        """This process's parameters by stable key ``"<layer>.<name>"``."""
        return local_parameters(self.local_layers())

    def local_tensors(self) -> dict[str, Tensor]:
        """Parameters and persistent buffers by key: what a checkpoint stores of this process's layers."""
        layers = self.local_layers()
        return {f"{index}.{name}": t for index in sorted(layers) for name, t in layer_tensors(layers[index]).items()}

    # -------------------------------------------------------------------------- lifecycle
    def start(self, optimizer: Optimizer | None, broadcast: bool = True, previous: PipelineRuntime | None = None) -> None:
        """Binds the user's optimizer (``None`` outside fitting) and builds the engine (collective).

        Args:
            optimizer: the optimizer from ``configure_optimizers``; the runtime keeps its parameter
                groups and refills them with this process's parameters after every switch.
            broadcast: make every replica's copy of a layer equal to the first replica's (at the start,
                when replicas may have built layers with different random values).
            previous: the runtime this one replaces under the same plan and layers (the strategy set up
                again, e.g. ``trainer.validate`` between two fits): optimizer state it keeps outside the
                user's optimizer (the layer-wise ZeRO-1's slices) carries over when ``optimizer`` is the one
                it trained with.
        """
        params = self.local_parameters()
        bound = BoundOptimizer.bind(optimizer, params) if optimizer is not None else None
        self._carrier = carrier_for(bound, self.config.deepspeed_config)
        self._layer_numel = self._gather_layer_sizes()
        self._build_engine(broadcast)
        if previous is not None:
            self._carrier.carry_over(previous._carrier)

    def start_idle(self, optimizer: BoundOptimizer | None) -> None:
        """Binds the optimizer of a runtime that starts idle (no collective): ``optimizer`` carries the
        parameter-group map the others gathered; it trains nothing until a plan brings layers here."""
        if not self.idle:
            raise RuntimeError(f"start_idle() is for a runtime that starts idle; device {self.device} holds layers")
        self._carrier = carrier_for(optimizer, self.config.deepspeed_config)
        self._carrier.bind({}, {})

    def switch(self, plan: Plan) -> MigrationRecord:
        """Puts ``plan`` in force (collective when the layout changes); returns what it cost.

        Only micro-batch counts changed: the engine is updated in place. Otherwise the engine is rebuilt
        around the layers this process keeps, and the layers new to it arrive, with their optimizer
        state, point to point from one old holder each (:func:`~resihp_lightning.placement.plan_transfers`).
        """
        start = time.perf_counter()
        if same_layout(self._plan, plan):
            engines.set_micro_batches(self._engine, plan.replicas[self._position.replica].micro_batches)
            self._plan = plan
            return MigrationRecord(plan=plan, seconds=time.perf_counter() - start, bytes_moved=0)
        if self.mixed_degrees:
            # Layers moving between groups of different degrees are cut anew: a re-split over the same groups.
            return self.reshape(self.config.tensor, plan)
        captured = self._carrier.capture(self._engine, self.local_parameters())
        state_s = time.perf_counter() - start
        self._stop_engine()
        return self._move(plan, captured, start, state_s)

    def release(self) -> CapturedState:
        """Stops the engine and keeps the optimizer state of this process's layers, before the job's
        default group changes under a planned reshape (then :meth:`relocate`). Collective over the
        engine's groups; an idle runtime has nothing to release."""
        captured = self._carrier.capture(self._engine, self.local_parameters())
        if self._engine is not None:
            self._stop_engine()
        return captured

    def relocate(
        self,
        plan: Plan,
        captured: CapturedState,
        ranks: Mapping[int, int],
        between: Callable[[], Mapping[int, int] | None] | None = None,
    ) -> MigrationRecord:
        """Puts ``plan`` in force across a change of the default group (after :meth:`release`).

        The layers move over the current default group, whose members ``ranks`` maps (every holder
        under the old plan and every device of ``plan`` must be in it); then ``between`` may change
        the group again (leave out the devices ``plan`` does not use) and returns the new ranks
        (``None`` on a process that is not in the new group: it is idle under ``plan``), and the
        engine is built there.
        """
        self._ranks = dict(ranks)
        return self._move(plan, captured, time.perf_counter(), 0.0, between)

    def follow(self, plan: Plan) -> None:
        """An idle runtime adopts the plan the members put in force (it still holds nothing)."""
        if not self.idle or _position_or_none(plan, self.device) is not None:
            raise RuntimeError(f"follow() is for a device that stays idle; device {self.device} is in the plan")
        self._plan = plan

    def recover(
        self, plan: Plan, ranks: Mapping[int, int], between: Callable[[], Mapping[int, int] | None] | None = None
    ) -> MigrationRecord:
        """Puts ``plan`` in force after processes died: the survivors now form a new default group.

        The old engine is abandoned without a collective (its groups are broken); the step that was
        interrupted left no optimizer update (see :mod:`~resihp_lightning.failstop.step_commit`), so its
        partial gradients are dropped. Layers this process holds under ``plan`` and did not hold come
        from a live holder under the old plan (collective over the new group).

        Args:
            plan: the plan for the survivors (device ids).
            ranks: device id -> rank in the new default group, for exactly the live devices.
            between: as for :meth:`relocate` (the plan may leave survivors idle).

        Raises:
            PlanError: a layer of ``plan`` has no live holder (it is lost; restart from a checkpoint).
            ConfigError: a DeepSpeed wrapper owns the optimizer state (its flat partitions cannot be
                read without the broken groups).
        """
        start = time.perf_counter()
        self._drop_broken_engine()
        captured = self._carrier.capture(None, self.local_parameters())
        self._ranks = dict(ranks)
        return self._move(plan, captured, start, 0.0, between)

    def reshape(self, tensor: TensorParallelism, plan: Plan, ranks: Mapping[int, int] | None = None) -> MigrationRecord:
        """Puts ``plan`` over new tensor-parallel groups in force (another degree, other members).

        Every layer this process holds under ``plan`` is split anew over its new group, from a copy of the
        model's layer, and its shards (weights and optimizer state) arrive piece by piece from the old
        holders (:mod:`~resihp_lightning.tensor.resplit`): nothing is gathered whole, nothing touches the
        disk. Collective over the current default group; every process of it must be in a new group.

        Args:
            tensor: this process's part of the new groups (:func:`~resihp_lightning.tensor.tensor_groups.tensor_parallelism`
                created their process groups).
            plan: the plan over the new groups' ids.
            ranks: device id -> rank of the current default group (default: the identity).

        Raises:
            ConfigError: this runtime has no tensor parallelism, a process is in no new group, or a layer
                does not split over its new group (the module's reason, e.g. heads that do not divide);
                every process raises it before anything changes.
        """
        return self._resplit_to(tensor, plan, ranks, alive=None)

    def recover_tensor(self, tensor: TensorParallelism, plan: Plan, ranks: Mapping[int, int]) -> MigrationRecord:
        """:meth:`recover` under tensor parallelism: the survivors' new groups and their plan.

        The old engine and the old groups are abandoned without a collective; every layer is cut anew
        over the new groups from the live processes' shards (:meth:`reshape`, with the lost processes
        sending nothing), so a lost member's shards come from another group holding the same layers.

        Args:
            tensor: this process's part of the survivors' groups (their process groups exist).
            plan: the plan over the new groups' ids.
            ranks: device id -> rank in the new default group, for exactly the live processes.

        Raises:
            PlanError: a part of a layer has no live holder (restart from a checkpoint).
            ConfigError: a DeepSpeed wrapper owns the optimizer state, or a layer does not split over its
                new group.
        """
        self._drop_broken_engine()
        return self._resplit_to(tensor, plan, ranks, alive=set(ranks))

    def _drop_broken_engine(self) -> None:
        """After processes died: lets go of the engine (no collective) and of the interrupted step's partial
        gradients (the step left no update: see :mod:`~resihp_lightning.failstop.step_commit`).

        Raises:
            ConfigError: a DeepSpeed wrapper owns the optimizer state (its flat partitions cannot be read
                without the broken groups).
        """
        if not self._carrier.per_replica_bounds:
            raise ConfigError(
                "in-process recovery needs the layer-wise engine: DeepSpeed's ZeRO-1 / bf16 wrappers keep optimizer "
                "state in partitions spread over the lost group; restart from a checkpoint instead"
            )
        self._abandon_engine()
        for param in self.local_parameters().values():
            param.grad = None

    def _resplit_to(
        self, tensor: TensorParallelism, plan: Plan, ranks: Mapping[int, int] | None, alive: set[int] | None
    ) -> MigrationRecord:
        """:meth:`reshape` and :meth:`recover_tensor` (``alive``: the live processes after a loss)."""
        start = time.perf_counter()
        old_tensor = self.config.tensor
        if old_tensor is None:
            raise ConfigError("reshape() changes tensor-parallel groups; this runtime has no tensor parallelism")
        me = old_tensor.groups.rank(self.device, old_tensor.member)
        group = tensor.groups.group_of(me)
        new_position = _position_or_none(plan, group) if group is not None else None
        new_layers: dict[int, nn.Module] = {}
        error = None
        try:
            if new_position is None:
                raise ConfigError(
                    f"device {me} is in no group of the new plan: spares under tensor parallelism are not supported yet"
                )
            for i in new_position.layers:
                new_layers[i] = self._split_copy(i, materialize_layer(self.config.layers[i], skip_init=True), tensor)
        except (ConfigError, ValueError) as err:
            error = f"device {me}: {err}"
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        failed = [e for e in errors if e]
        if failed:
            raise ConfigError(f"the tensor-parallel groups {tensor.groups.members} cannot be applied: {failed[0]}")
        for layer in new_layers.values():
            layer.to(self.config.device)
        self._carrier.prepare_incoming(list(new_layers.values()))
        rank_of = (lambda d: d) if ranks is None else dict(ranks).__getitem__
        old_layers = self.local_layers()
        captured = self._carrier.capture(self._engine, self.local_parameters())
        # The layer-wise ZeRO-1's slices made whole on every live old holder (collective), then cut like the
        # parameters: a full gather on the old holders, as a plan change without tensor parallelism does.
        captured = self._carrier.complete(captured, OldHolding(
            self._plan, alive if alive is not None else old_tensor.groups.ranks, rank_of, me, old_layers,
            old_tensor.groups.members,
        ))
        state_s = time.perf_counter() - start
        if self._engine is not None:
            self._stop_engine()
        moving = time.perf_counter()
        sent, received = resplit(
            old_tensor.groups, self._plan, tensor.groups, plan, me, old_layers, new_layers,
            self._carrier.outgoing(captured), rank_of, alive=alive,
        )
        transfer_s = time.perf_counter() - moving
        total = torch.tensor([float(sent)], dtype=torch.float64, device=self.config.device)
        dist.all_reduce(total)
        if tensor is not old_tensor and alive is None:  # after a loss the old groups died with their generation
            destroy_process_groups(old_tensor)
        self._id_ranks = dict(ranks) if ranks is not None else None
        self.config = dataclasses.replace(self.config, tensor=tensor)
        self.device = group
        # Uniform groups: this member's slice; otherwise the members 0 (the plan's whole-layer writers).
        member = tensor.member if tensor.groups.uniform else 0
        self._ranks = {g: rank_of(d) for g, d in tensor.groups.slice_ranks(member).items()}
        self._plan, self._position = plan, new_position
        self._pipe, self._held = self._build_pipe(plan, new_layers), {}
        self._layer_numel = self._gather_layer_sizes()
        params = self.local_parameters()
        received_by_key = {f"{layer}.{name}": s for layer, per in received.items() for name, s in per.items()}
        self._carrier.bind(params, received_by_key)
        self._build_engine(broadcast=False)
        restoring = time.perf_counter()
        self._carrier.restore(self._engine, params, CapturedState(), received_by_key)
        state_s += time.perf_counter() - restoring
        seconds = time.perf_counter() - start
        log.info("re-split over groups %s: %d bytes moved in %.3f s", tensor.groups.members, int(total.item()), seconds)
        return MigrationRecord(
            plan=plan, seconds=seconds, bytes_moved=int(total.item()), transfer_seconds=transfer_s,
            rebuild_seconds=seconds - transfer_s, state_seconds=state_s,
        )

    def _move(
        self,
        plan: Plan,
        captured: CapturedState,
        start: float,
        state_s: float,
        between: Callable[[], Mapping[int, int] | None] | None = None,
    ) -> MigrationRecord:
        """Receives the layers new to this process, then builds ``plan``'s pipe and engine (collective)."""
        old, old_layers = self._plan, self.local_layers()
        alive = set(self._ranks) if self._ranks is not None else None
        transfers = [
            Transfer(t.layer, self._rank(t.src), self._rank(t.dst))
            for t in plan_transfers(old, plan, self._layer_numel, alive=alive)
        ]
        recording = self._profiler.record_layers
        old_position = self._position
        self._plan, self._position = plan, _position_or_none(plan, self.device)
        me = self._rank(self.device)
        incoming = {t.layer for t in transfers if t.dst == me}
        held = self._position.layers if self._position is not None else range(0)
        # The layers this process holds under ``plan``: kept objects (their Parameters keep the optimizer
        # state keyed by them) and fresh ones for what arrives, built without weight init.
        new_layers = {i: old_layers[i] if i in old_layers else self._fresh_layer(i, skip_init=i in incoming) for i in held}
        for i in held:
            if i in incoming:  # a layer on the meta device gets storage for what arrives
                meta.allocate(new_layers[i], self.config.device)
            new_layers[i].to(self.config.device)
        self._carrier.prepare_incoming([new_layers[i] for i in incoming])
        self._pipe, self._held = None, old_layers
        moving = time.perf_counter()
        try:
            captured = self._carrier.complete(captured, self._old_holding(old, old_layers, alive))
            sent, received = migrate(transfers, me, old_layers, new_layers, self._carrier.outgoing(captured))
            transfer_s = time.perf_counter() - moving
            total = torch.tensor([float(sent)], dtype=torch.float64, device=self.config.device)
            dist.all_reduce(total)
            if between is not None:
                ranks = between()
                self._ranks = dict(ranks) if ranks is not None else None
        except BaseException:
            # A peer failed mid-move: every process goes back to the old plan, whose holders still have
            # their layers (senders keep theirs), so that the recovery restores from a consistent state.
            self._plan, self._position = old, old_position
            if self._release_given_away:  # storage given to layers that did not arrive
                for i in incoming:
                    if i not in old_layers and isinstance(self.config.layers[i], nn.Module):
                        meta.release(new_layers[i])
            raise
        self._held = new_layers
        if self._release_given_away:
            for i, layer in old_layers.items():
                if i not in new_layers and isinstance(self.config.layers[i], nn.Module):
                    meta.release(layer)
        received_by_key = {f"{layer}.{name}": s for layer, per in received.items() for name, s in per.items()}
        if self._position is None:  # idle under ``plan``: nothing to build or train
            self._carrier.bind({}, {})
        else:
            self._pipe = self._build_pipe(plan, new_layers)
            params = self.local_parameters()
            self._carrier.bind(params, received_by_key)
            self._build_engine(broadcast=False)
            state_start = time.perf_counter()
            self._carrier.restore(self._engine, params, captured, received_by_key)
            state_s += time.perf_counter() - state_start
        self._profiler.record_layers = recording
        seconds = time.perf_counter() - start
        log.info("applied plan %s: %d bytes moved in %.3f s", plan.layout_key(), int(total.item()), seconds)
        return MigrationRecord(
            plan=plan,
            seconds=seconds,
            bytes_moved=int(total.item()),
            transfer_seconds=transfer_s,
            rebuild_seconds=seconds - transfer_s,
            state_seconds=state_s,
        )

    def _old_holding(self, old: Plan, old_layers: Mapping[int, nn.Module], alive: set[int] | None) -> OldHolding:
        """Where the layer-wise ZeRO-1's slices live under ``old`` (the plan being left, over this runtime's
        devices; ``alive``: the live ones, ``None``: all). Under tensor parallelism (groups of one degree, no
        process lost: a loss goes through :meth:`recover_tensor`) each member's shard has its own slices."""
        tensor = self.config.tensor
        if tensor is None:
            return OldHolding(old, alive if alive is not None else old.device_ids, self._rank, self.device, old_layers)
        groups = tensor.groups
        return OldHolding(old, groups.ranks, self._rank_of_id, groups.rank(self.device, tensor.member), old_layers,
                          groups.members)

    def teardown(self) -> None:
        """Releases the engine, its process groups and the reducer's (the layers stay usable)."""
        if self._engine is not None:
            self._stop_engine()

    # --------------------------------------------------------------------------- running
    def train_batch(self, items: Sequence[batching.MicroBatch], loss_scale: float = 1.0) -> tuple[Tensor, list[float]]:
        """One training step on this replica's micro-batches.

        Args:
            items: this replica's micro-batches.
            loss_scale: factor on each micro-batch loss (``m_r * D / M`` makes unequal replicas exact).

        Returns:
            (the global batch's mean loss, this process's busy ms per micro-batch).
        """
        self._loss_scale = loss_scale
        self._profiler.begin_step()
        try:
            loss = self._engine.train_batch(batching.iterate(self._cast(items)))
        finally:
            self._loss_scale = 1.0
        return loss, self._profiler.end_step()

    def eval_batch(self, items: Sequence[batching.MicroBatch], compute_loss: bool) -> list[Any] | None:
        """Runs this replica's evaluation micro-batches (collective; may be empty).

        Returns:
            the per-micro-batch losses (``compute_loss``) or outputs on the last stage, else ``None``.
        """
        if not items:
            dist.barrier()  # eval_batch's own barrier, so that replicas without work stay in step
            return None
        outputs = self._engine.eval_batch(
            batching.iterate(self._cast(items)),
            compute_loss=compute_loss,
            reduce_output=None,
            bcast_loss=False,
            num_micro_batches=len(items),
        )
        return outputs if self._position.stage == self._plan.pipeline_degree - 1 else None

    def layer_profile(self) -> list[LayerCost]:
        """Measured cost of every layer, gathered over the group (collective).

        ``compute_ms``: forward + backward per micro-batch (median over recent recorded steps on the
        holding process; median over replicas); ``static_mb``: parameters + gradients + optimizer
        state (under ZeRO-1 / bf16: the wrapper's fp32 masters and moments, this process's share);
        ``activation_mb``: the layer's output size per micro-batch.
        """
        compute = self._profiler.layer_compute_ms()
        mine: dict[int, tuple[float, float, float]] = {}
        for index, layer in self.local_layers().items():
            static = 0.0
            for p in layer.parameters():
                static += p.numel() * p.element_size() * (2 if p.requires_grad else 1)
                static += self._carrier.state_bytes(self._engine, p)
            activation = self._profiler.activation_bytes.get(index, 0)
            mine[index] = (compute.get(index, 0.0), static / _MB, activation / _MB)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        out = []
        for index in range(len(self.config.layers)):
            values = [part[index] for part in gathered if index in part]
            median = statistics.median(v[0] for v in values)
            out.append(LayerCost(index, median, max(v[1] for v in values), max(v[2] for v in values)))
        return out

    def trained_tensors(self) -> dict[str, Tensor]:
        """:meth:`local_tensors` with parameters in full precision (a wrapper's fp32 masters); under tensor
        parallelism the unsplit tensors, on every member of the group.

        Collective over each stage's data-parallel group under a DeepSpeed wrapper, and over the
        tensor-parallel group.
        """
        tensors = self.local_tensors()
        params = self.local_parameters()
        tensors.update(self._carrier.trained_values(self._engine, params))
        if self.config.tensor is not None:
            tensors = gather_shards(tensors, self.shard_dims(), self.config.tensor.group)
        return tensors

    def shard_dims(self) -> dict[str, int]:
        """The split dimension of each of this process's split parameters, by key (none without tensor
        parallelism)."""
        return {key: dim for key, p in self.local_parameters().items() if (dim := split_dim(p)) is not None}

    @property
    def casts_model(self) -> bool:
        """Whether the engine keeps the model's parameters in bf16 / fp16."""
        return self.param_dtype != torch.float32

    # ------------------------------------------------------------------------ checkpoints
    def optimizer_checkpoint_state(self) -> dict[str, dict[str, Any]]:
        """This process's per-parameter optimizer state by key (collective over stages when wrapped); under
        tensor parallelism the state of the unsplit parameters (collective over the group)."""
        state = self._carrier.checkpoint_state(self._engine, self.local_parameters())
        if self.config.tensor is None:
            return state
        params, dims = self.local_parameters(), self.shard_dims()
        # A state tensor shaped like its split parameter (Adam's moments) is split like it.
        flat = {(key, name): value for key in sorted(state) for name, value in sorted(state[key].items())}
        split = {
            entry: dims[entry[0]] for entry, value in flat.items()
            if entry[0] in dims and isinstance(value, Tensor) and value.shape == params[entry[0]].shape
        }
        whole = gather_shards(flat, split, self.config.tensor.group)
        out: dict[str, dict[str, Any]] = {key: {} for key in state}
        for (key, name), value in whole.items():
            out[key][name] = value
        return out

    def load_optimizer_checkpoint(self, saved: Mapping[str, Any]) -> None:
        """Restores hyper-parameters and this process's optimizer state from a saved optimizer state (of
        the unsplit parameters: under tensor parallelism each process takes its shards)."""
        cut = self.saved_shards()
        if cut is not None:
            tensor = self.config.tensor
            params, degree = self.local_parameters(), len(tensor.groups.members[self.device])
            state = dict(saved["state"])
            for key, dim in self.shard_dims().items():
                if key in state:
                    whole = _whole_shape(params[key].shape, dim, degree)
                    state[key] = {
                        name: cut(key, value) if isinstance(value, Tensor) and value.shape == whole else value
                        for name, value in state[key].items()
                    }
            saved = {**saved, "state": state}
        self._carrier.load_checkpoint(self._engine, self.local_parameters(), saved)

    def saved_shards(self) -> Callable[[str, Tensor], Tensor] | None:
        """Under tensor parallelism, ``cut(key, whole)``: this process's part of a saved whole tensor of its
        layer tensor ``key`` (the tensor itself when that is not split); ``None`` without."""
        tensor = self.config.tensor
        if tensor is None:
            return None
        dims = self.shard_dims()

        def cut(key: str, whole: Tensor) -> Tensor:
            dim = dims.get(key)
            return whole if dim is None else shard_of(whole, dim, tensor.group)

        return cut

    def weights_loaded(self) -> None:
        """Tells the optimizer wrapper that new values were written into the parameters."""
        if self._carrier.bound is not None:
            self._carrier.weights_loaded(self._engine, self.local_parameters())

    @property
    def optimizer(self) -> BoundOptimizer | None:
        """The bound user optimizer (``None`` outside fitting)."""
        return self._carrier.bound

    # ------------------------------------------------------------------------- internals
    def _rank(self, device: int) -> int:
        return device if self._ranks is None else self._ranks[device]

    def _in_ranks(self, plan: Plan) -> Plan:
        return plan if self._ranks is None else relabel(plan, self._ranks)

    def _scaled_loss(self, outputs: Any, labels: Any) -> Tensor:
        loss = self.config.loss_fn(outputs, labels)
        return loss * self._loss_scale if self._loss_scale != 1.0 else loss

    def _cast(self, items: Sequence[batching.MicroBatch]) -> list[batching.MicroBatch]:
        """Floating-point inputs in the engine's parameter dtype (bf16 / fp16 runs get float32 batches)."""
        dtype = self.param_dtype
        return list(items) if dtype == torch.float32 else batching.cast_inputs(items, dtype)

    def _build_pipe(self, plan: Plan, reuse: Mapping[int, nn.Module] | None) -> BoundedPipelineModule:
        reuse = dict(reuse or {})
        for index in position(plan, self.device).layers:
            layer = reuse.get(index, self.config.layers[index])
            if isinstance(layer, nn.Module) and meta.has_meta(layer):
                self._load(index, layer)
            if self.config.tensor is not None and index not in reuse:
                # A private copy is split: the module keeps its unsplit layer (the trained values are
                # gathered back into it at the end); one loaded per stage goes back to meta, so that a
                # process keeps the storage of its shards only.
                reuse[index] = self._split_copy(index, materialize_layer(layer))
                if self._release_given_away and isinstance(layer, nn.Module):
                    meta.release(layer)
        kwargs: dict[str, Any] = {}
        interval = (self.config.deepspeed_config.get("pipeline") or {}).get("activation_checkpoint_interval")
        if interval:
            kwargs["activation_checkpoint_interval"] = interval
        # DeepSpeed prints its seed settings and topology on every build; keep re-plans quiet.
        grid = self._mixed_grid(plan)
        with contextlib.redirect_stdout(io.StringIO()):
            return BoundedPipelineModule(
                self.config.layers,
                grid.topology() if grid is not None else self._topology(plan),
                plan.replicas[position(plan, self.device).replica].bounds,
                loss_fn=self._scaled_loss,
                reuse=reuse,
                grid=grid,
                **kwargs,
            )

    @property
    def mixed_degrees(self) -> bool:
        """Whether the tensor-parallel groups in force differ in degree (:mod:`.tensor_grid` runs them)."""
        tensor = self.config.tensor
        return tensor is not None and len({len(group) for group in tensor.groups.members}) > 1

    def _members(self) -> dict[int, tuple[int, ...]]:
        """Group id -> its members' ranks in the current default group."""
        members = self.config.tensor.groups.members
        rank = self._rank_of_id
        return {g: tuple(rank(d) for d in group) for g, group in enumerate(members)}

    def _rank_of_id(self, device: int) -> int:
        """The current default group's rank of the process with job-wide id ``device`` (its global rank at
        the start; the identity until a recovery regroups the survivors)."""
        return device if self._id_ranks is None else self._id_ranks[device]

    def groups_in_ranks(self) -> TensorGroups:
        """The tensor-parallel groups in force, in ranks of the current default group."""
        groups = self.config.tensor.groups
        return groups if self._id_ranks is None else groups.relabelled(self._id_ranks)

    def _mixed_grid(self, plan: Plan) -> TensorGrid | None:
        """A :class:`~.tensor_grid.TensorGrid` for ``plan`` when the groups differ in degree (collective)."""
        if not self.mixed_degrees:
            return None
        return TensorGrid(plan, self._members(), dist.get_rank())

    def _fresh_layer(self, index: int, skip_init: bool) -> nn.Module:
        """A layer this process starts to hold (its values arrive by migration when ``skip_init``): the
        model's layer, or under tensor parallelism this member's split of a copy of it."""
        layer = materialize_layer(self.config.layers[index], skip_init=skip_init)
        return layer if self.config.tensor is None else self._split_copy(index, layer)

    def _split_copy(self, index: int, layer: nn.Module, tensor: TensorParallelism | None = None) -> nn.Module:
        """This member's split of a copy of ``layer`` over its group (default: the one in force); a layer on
        the meta device is given storage first: the split needs values to cut, which a migration then
        overwrites."""
        tensor = tensor if tensor is not None else self.config.tensor
        layer = copy.deepcopy(layer)
        if meta.has_meta(layer):
            meta.allocate(layer, self.config.device)
        return tensor.split_layer(index, layer, tensor.group)

    def _topology(self, plan: Plan) -> PlanTopology | TensorPlanTopology:
        if self.config.tensor is None:
            return PlanTopology(self._in_ranks(plan))
        return TensorPlanTopology(self.groups_in_ranks().slice_plans(plan))

    def _load(self, index: int, layer: nn.Module) -> None:
        """Gives a layer still on the meta device its values through ``config.load_layer``."""
        if self.config.load_layer is None:
            raise ConfigError(
                f"pipeline layer {index} ({type(layer).__name__}) has tensors on the meta device and nothing loads "
                "them: define pipeline_load_layer(index, layer, device) on the module"
            )
        started = time.perf_counter()
        self.config.load_layer(index, layer, self.config.device)
        left = [slot.name for slot in meta.meta_slots(layer)]
        if left:
            raise ConfigError(f"pipeline_load_layer({index}, ...) left tensors on the meta device: {left[:5]}")
        log.debug("loaded layer %d in %.3f s", index, time.perf_counter() - started)

    def _build_engine(self, broadcast: bool) -> None:
        """Builds the engine for the pipe in force (collective)."""
        plan = self._plan
        replica = plan.replicas[self._position.replica]
        config = engines.engine_config(
            self.config.micro_batch_size, replica.micro_batches, plan.data_degree,
            zero_config.for_deepspeed(self.config.deepspeed_config),
        )
        tensor = self.config.tensor
        if tensor is not None:
            # Stage-boundary activations are whole on every member (after a row split's sum): each member
            # sends its own copy to its counterpart, rather than DeepSpeed's scatter + all-gather.
            config["pipeline"] = {**config.get("pipeline", {}), "pipe_partitioned": False, "grad_partitioned": False}
        # Plain fp32: the layer-wise reduction (any bounds; exact gradient clipping). ZeRO / bf16 / fp16
        # keep DeepSpeed's own (the strategy then requires shared bounds).
        layerwise = self._carrier.per_replica_bounds
        if self.config.precision is not None:
            self.config.precision.check(config)
        if layerwise and self.mixed_degrees:
            grid = self._pipe._grid
            self._reducer = MixedDegreeReducer(
                plan, self._members(), dist.get_rank(), self.local_layers(), tensor.group, grid.get_pipe_parallel_group(),
                tied=self.config.tied,
            )
        elif layerwise:
            self._reducer = LayerwiseReducer(
                self._in_ranks(plan), self._rank(self.device), self.local_layers(), tied=self.config.tied,
                slices=self.groups_in_ranks().slice_plans(plan) if tensor is not None else (),
                tensor_group=tensor.group if tensor is not None else None,
            )
        bound = self._carrier.bound
        self._engine = engines.build_engine(
            self._pipe, bound.optimizer if bound is not None else None, config, broadcast=broadcast and not layerwise
        )
        if self._reducer is not None:
            if broadcast:
                self._reducer.broadcast()
            zero = self._zero_shards(plan)
            install(self._engine, self._reducer, precision=self.config.precision, zero=zero)
            self._engine._resihp_commit = self.config.commit
        self._profiler.attach(self._engine, self.local_layers())

    def _zero_shards(self, plan: Plan) -> ZeroShards | None:
        """The layer-wise ZeRO-1's slices for ``plan`` when it runs (:mod:`~resihp_lightning.state.zero_shards`).

        Each shard's moments are sliced over the processes holding the same shard
        (:mod:`~resihp_lightning.state.zero_holders`): the reducer's holder sets without tensor parallelism or
        with groups of one degree (this process's slice of the job); with groups of different degrees, sets per
        degree, whose process groups every process creates here (collective, in one order).
        """
        carrier = self._carrier
        if not isinstance(carrier, ShardedStateCarrier) or carrier.bound is None:
            return None
        if not self.mixed_degrees:
            carrier.shards = ZeroShards(
                layer_holders(self._in_ranks(plan)), self._rank(self.device), self.local_layers(), carrier.bound,
                self._reducer.groups,
            )
            return carrier.shards
        members = self._members()
        units = shard_holders(plan, [members[g] for g in range(len(members))])
        rank = dist.get_rank()
        sets = sorted({unit.holders for per in units.values() for unit in per.values() if len(unit.holders) > 1})
        created = {ranks: dist.new_group(ranks=sorted(ranks)) for ranks in sets}
        carrier.shards = ZeroShards(
            {layer: unit.holders for layer, unit in units.get(rank, {}).items()}, rank, self.local_layers(),
            carrier.bound, {ranks: group for ranks, group in created.items() if rank in ranks}, owned=list(created.values()),
        )
        return carrier.shards

    def _stop_engine(self) -> None:
        self._profiler.detach()
        grid = getattr(self._engine.module, "_grid", None)
        engines.destroy_engine(self._engine)
        if isinstance(grid, TensorGrid):
            grid.destroy()
        self._engine = None
        if self._reducer is not None:
            self._reducer.destroy()
            self._reducer = None
        if isinstance(self._carrier, ShardedStateCarrier) and self._carrier.shards is not None:
            self._carrier.shards.destroy()

    def _abandon_engine(self) -> None:
        """Drops the engine and the reducer without any collective (their groups died with a peer)."""
        self._profiler.detach()
        if self._engine is not None:
            engines.abandon_engine(self._engine)
        self._engine = None
        self._reducer = None

    def _gather_layer_sizes(self) -> list[int]:
        mine = {i: sum(p.numel() for p in m.parameters()) for i, m in self.local_layers().items()}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        sizes = [0] * len(self.config.layers)
        for part in gathered:
            for i, n in part.items():
                sizes[i] = n
        return sizes


def _whole_shape(shard: torch.Size, dim: int, degree: int) -> torch.Size:
    """The shape of the unsplit tensor whose shards along ``dim`` over ``degree`` members have shape ``shard``."""
    return torch.Size(n * degree if d == dim else n for d, n in enumerate(shard))


def _position_or_none(plan: Plan, device: int) -> Position | None:
    """``device``'s position under ``plan``, or ``None`` when the plan leaves it idle."""
    try:
        return position(plan, device)
    except KeyError:
        return None
