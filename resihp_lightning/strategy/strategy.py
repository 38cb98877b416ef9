"""``ResiHPStrategy``: Lightning strategy running a DeepSpeed pipeline x data-parallel job, re-planned live."""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from resihp_lightning import _registration
from resihp_lightning._logging import get_logger
from resihp_lightning.config import PlannerConfig
from resihp_lightning.contract import MigrationRecord
from resihp_lightning.errors import ConfigError, PlanError
from resihp_lightning.plan import Device, Layer, Plan, Problem, even_split, validate
from resihp_lightning.strategy import batching, checkpoint, optim
from resihp_lightning.strategy.module import check_contract, layer_specs, tied_parameters
from resihp_lightning.strategy.options import StrategyOptions
from resihp_lightning.strategy.placement import Position, position, row_offset
from resihp_lightning.telemetry import LayerCost, MicroBatchStats, StepStats

log = get_logger(__name__)

_MB = float(2**20)


class ResiHPStrategyMixin:
    """Everything of :class:`ResiHPStrategy` that does not depend on the Lightning package.

    Combined with ``lightning.pytorch``'s ``DDPStrategy`` it is :class:`ResiHPStrategy`; combined with
    the standalone ``pytorch_lightning`` package's ``DDPStrategy`` it is
    :class:`resihp_lightning.strategy.standalone.ResiHPStrategy`. Both packages ship the same code
    under different names, so only the base class and the exception type differ.
    """

    #: Raised for bad options and modules (the Lightning package's own ``MisconfigurationException``).
    misconfiguration_error: type[Exception] = MisconfigurationException

    strategy_name = "resihp"

    def __init__(
        self,
        pipeline_degree: int | None = None,
        plan: Plan | dict | None = None,
        micro_batch_size: int = 1,
        micro_batches: int | None = None,
        deepspeed_config: dict[str, Any] | None = None,
        planner: PlannerConfig | dict | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float = timedelta(minutes=30),
        options: StrategyOptions | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        if options is None:
            options = StrategyOptions(
                pipeline_degree=pipeline_degree,
                plan=plan,
                micro_batch_size=micro_batch_size,
                micro_batches=micro_batches,
                deepspeed_config=dict(deepspeed_config or {}),
                planner=planner if planner is not None else PlannerConfig(),
                process_group_backend=process_group_backend,
                timeout=timeout,
            )
        self.options = options
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=options.process_group_backend,
            timeout=options.timeout,
            start_method="popen",
        )
        self._specs: list[Any] = []
        self._plan: Plan | None = None
        self._pending: Plan | None = None
        self._num_micro: int | None = options.micro_batches
        self._engine: Any = None
        self._reducer: Any = None
        self._tied: list[tuple[tuple[int, str], ...]] = []
        self._pipe: Any = None
        self._position: Position | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._groups: list[dict[str, Any]] = []
        self._group_of: dict[str, int] = {}
        self._layer_numel: list[int] = []
        self._loss_scale = 1.0
        self._profiler: Any = None
        self._last_step_stats: StepStats | None = None
        self._last_migration: MigrationRecord | None = None

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "resihp",
            cls,
            description=_registration.DESCRIPTION,
            override=True,
        )

    # ------------------------------------------------------------------------ public API
    @property
    def current_plan(self) -> Plan:
        """The plan in force (device ids are global ranks)."""
        if self._plan is None:
            raise RuntimeError("ResiHPStrategy has no plan before Trainer setup")
        return self._plan

    @property
    def micro_batches(self) -> int | None:
        """M, micro-batches per global batch (``None`` until known)."""
        return self._num_micro

    @property
    def micro_batch_size(self) -> int:
        return self.options.micro_batch_size

    @property
    def num_layers(self) -> int:
        return len(self._specs)

    @property
    def planner(self) -> PlannerConfig:
        """Planner options, for the controller callback."""
        return self.options.planner

    @property
    def last_step_stats(self) -> StepStats | None:
        """This rank's statistics of the last training step."""
        return self._last_step_stats

    @property
    def last_migration(self) -> MigrationRecord | None:
        """The last applied re-plan (``None`` before one); see :class:`~resihp_lightning.contract.MigrationRecord`."""
        return self._last_migration

    def local_layers(self) -> dict[int, torch.nn.Module]:
        """This rank's layer modules by global layer index (they change after a re-plan)."""
        return self._pipe.local_layers() if self._pipe is not None else {}

    @property
    def supports_per_replica_bounds(self) -> bool:
        """Whether plans whose replicas have different stage bounds can run (plain fp32 optimizer only).

        The layer-wise gradient reduction that makes them exact works on the optimizer's own
        parameters; ZeRO / bf16 / fp16 wrap the optimizer and keep DeepSpeed's stage-paired reduction.
        """
        return not self._wrapped_optimizer()

    @property
    def pending_plan(self) -> Plan | None:
        """A requested plan not applied yet."""
        return self._pending

    @property
    def profiler_recording(self) -> bool:
        """Whether training steps feed :meth:`layer_profile` (pause it while a device is slow)."""
        return self._profiler is not None and self._profiler.record_layers

    @profiler_recording.setter
    def profiler_recording(self, value: bool) -> None:
        if self._profiler is not None:
            self._profiler.record_layers = bool(value)

    def request_plan(self, plan: Plan) -> None:
        """Asks for ``plan`` to take effect at the next step boundary (call on every rank).

        Raises:
            PlanError: the plan does not fit this job (bounds, P x D vs world size, micro-batch sum,
                per-replica bounds); nothing changes and training goes on under the current plan.
        """
        self.check_plan(plan)
        self._pending = plan

    def check_plan(self, plan: Plan) -> None:
        """Raises :class:`PlanError` when ``plan`` cannot run on this job."""
        if not isinstance(plan, Plan):
            raise PlanError(f"request_plan needs a resihp_lightning.plan.Plan, got {type(plan).__name__}")
        world = self.world_size
        if not plan.replicas:
            raise PlanError("plan has no replicas")
        used = plan.pipeline_degree * plan.data_degree
        if used != world:
            raise PlanError(
                f"plan uses P x D = {plan.pipeline_degree} x {plan.data_degree} = {used} ranks but the job has "
                f"{world}; every rank must hold a stage"
            )
        if not plan.shared_bounds and self._wrapped_optimizer():
            raise PlanError(
                "replicas have different stage bounds, which needs the plain fp32 optimizer (no ZeRO / bf16 / fp16 "
                "in deepspeed_config)"
            )
        total = self._num_micro if self._num_micro is not None else sum(r.micro_batches for r in plan.replicas)
        problem = Problem(
            layers=tuple(Layer(0.0) for _ in range(self.num_layers or max(plan.replicas[0].bounds))),
            devices=tuple(Device(i) for i in range(world)),
            micro_batches=total,
            shared_partition=False,
        )
        validate(problem, plan, check_memory=False)
        from resihp_lightning.strategy.wrapped_state import wrapped_config_reason

        reason = wrapped_config_reason(self.options.deepspeed_config)
        if self._plan is not None and reason is not None:
            same = [(r.devices, r.bounds) for r in self._plan.replicas] == [(r.devices, r.bounds) for r in plan.replicas]
            if not same:
                raise PlanError(
                    f"moving layers is not supported with {reason}; only per-replica micro-batch counts can change"
                )

    def _wrapped_optimizer(self) -> bool:
        from resihp_lightning.strategy.wrapped_state import wraps_optimizer

        return wraps_optimizer(self.options.deepspeed_config)

    def layer_profile(self) -> list[LayerCost]:
        """Measured cost of every layer, gathered over ranks (collective: call on every rank).

        ``compute_ms``: forward + backward per micro-batch (median over recent recorded steps on the
        owning rank; median over replicas); ``static_mb``: parameters + gradients + optimizer state
        (under ZeRO-1 / bf16: the wrapper's fp32 masters and moments, this rank's partition);
        ``activation_mb``: the layer's output size per micro-batch.
        """
        from resihp_lightning.strategy import wrapped_state

        mine: dict[int, tuple[float, float, float]] = {}
        if self._pipe is not None:
            compute = self._profiler.layer_compute_ms() if self._profiler is not None else {}
            wrapped = wrapped_state.is_wrapped(self._engine)
            per_element = wrapped_state.state_bytes_per_element(self._engine) if wrapped else 0.0
            for index, layer in self._pipe.local_layers().items():
                static = 0.0
                for p in layer.parameters():
                    size = p.numel() * p.element_size()
                    static += size * (2 if p.requires_grad else 1)
                    if wrapped and p.requires_grad:
                        static += p.numel() * per_element
                    elif self._optimizer is not None:
                        static += sum(
                            v.numel() * v.element_size()
                            for v in self._optimizer.state.get(p, {}).values()
                            if isinstance(v, Tensor)
                        )
                activation = self._profiler.activation_bytes.get(index, 0) if self._profiler is not None else 0
                mine[index] = (compute.get(index, 0.0), static / _MB, activation / _MB)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        out = []
        for index in range(self.num_layers):
            values = [part[index] for part in gathered if index in part]
            times = sorted(v[0] for v in values)
            median = times[len(times) // 2] if len(times) % 2 else (times[len(times) // 2 - 1] + times[len(times) // 2]) / 2
            out.append(LayerCost(index, median, max(v[1] for v in values), max(v[2] for v in values)))
        return out

    # --------------------------------------------------------------------- Lightning wiring
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank reads the whole global batch; replicas slice their micro-batches out of it.
        return {"num_replicas": 1, "rank": 0}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True

    def setup_environment(self) -> None:
        super().setup_environment()
        # DeepSpeed's PipelineModule reads LOCAL_RANK from the environment.
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
        from resihp_lightning.strategy.engine import init_deepspeed_comm

        init_deepspeed_comm(self._get_process_group_backend())

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        check_contract(module, self.misconfiguration_error)
        if trainer.accumulate_grad_batches != 1:
            raise self.misconfiguration_error(
                "Trainer(accumulate_grad_batches) must be 1 with ResiHPStrategy; the pipeline accumulates over "
                "micro-batches already (set micro_batches / the batch size instead)"
            )
        self._specs = layer_specs(module, self.misconfiguration_error)
        self._tied = self._tied_parameters(module)
        reuse = None
        if self._pipe is None:
            self._plan = self._initial_plan()
        else:
            # Set up again (e.g. trainer.validate after fit): keep the plan in force and the layers
            # this rank holds; its copies of other layers are stale.
            reuse = self._pipe.local_layers()
        self._position = position(self._plan, self.global_rank)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._pipe = self._build_pipe(self._plan, reuse=reuse)
        if fitting:
            self._setup_user_optimizer(trainer)
        self._layer_numel = self._gather_layer_sizes()
        self._engine = self._new_engine(self._plan)
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        # The pipeline module moves its own (local) layers; the rest of the model stays where it is.
        return None

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self._pending is not None:
            plan, self._pending = self._pending, None
            self._apply(plan)
        split = batching.split_batch(self.lightning_module, batch)
        self._settle_micro_batches(split.rows)
        plan, pos = self.current_plan, self._position
        replica = plan.replicas[pos.replica]
        items = self._cast(
            batching.micro_batches(
                split, row_offset(plan, pos.replica, self.micro_batch_size), replica.micro_batches, self.micro_batch_size
            )
        )
        self._loss_scale = replica.micro_batches * plan.data_degree / self._num_micro
        self._profiler.begin_step()
        start = time.perf_counter()
        try:
            loss = self._engine.train_batch(batching.iterate(items))
        finally:
            self._loss_scale = 1.0
        step_ms = (time.perf_counter() - start) * 1000.0
        busy = self._profiler.end_step()
        self._last_step_stats = StepStats(
            step=self.lightning_module.trainer.global_step,
            rank=self.global_rank,
            replica=pos.replica,
            stage=pos.stage,
            layers=(pos.first, pos.stop),
            micro_batches=tuple(
                MicroBatchStats(busy[i] if i < len(busy) else 0.0, mb.tokens, mb.sum_len_sq) for i, mb in enumerate(items)
            ),
            step_ms=step_ms,
        )
        loss = loss.detach().float().reshape(())
        # The loss is already the global batch's on every rank; sync_dist only averages identical
        # values (exactly), and tells Lightning that epoch-level aggregation is distributed-safe.
        self.lightning_module.log(
            "train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=split.rows, sync_dist=True
        )
        return loss

    def validation_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Tensor:
        loss = self._evaluate(batch)
        self.lightning_module.log(
            "val_loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=self._rows, sync_dist=True
        )
        return loss

    def test_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Tensor:
        loss = self._evaluate(batch)
        self.lightning_module.log("test_loss", loss, on_step=False, on_epoch=True, batch_size=self._rows, sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        # The whole batch's outputs, in row order, on every rank (as one device would return them).
        return self._predict(batch)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        # PipelineEngine.train_batch already ran the backward passes.
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # The closure runs training_step (train_batch), which also stepped the optimizer.
        return closure()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        from resihp_lightning.strategy.migration import persistent_buffers

        tensors: dict[str, Any] = dict(self._local_params())
        for index, layer in self._pipe.local_layers().items():
            tensors.update({f"{index}.{name}": b for name, b in persistent_buffers(layer).items()})
        return checkpoint.gather_model_state(tensors, sends=self._position.replica == 0)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from resihp_lightning.strategy import wrapped_state

        params = self._local_params()
        # Under a DeepSpeed wrapper the state (with the fp32 masters) lives in its flat partitions;
        # export_state is collective over each stage's data-parallel group (every rank is here).
        state = wrapped_state.export_state(self._engine, params) if wrapped_state.is_wrapped(self._engine) else None
        return checkpoint.gather_optimizer_state(
            self._optimizer, self._groups, self._group_of, params, sends=self._position.replica == 0, state=state
        )

    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        checkpoint_dict["resihp"] = {
            "format": checkpoint.FORMAT,
            "plan": self.current_plan.to_dict(),
            "micro_batches": self._num_micro,
            "micro_batch_size": self.micro_batch_size,
            "num_layers": self.num_layers,
        }
        super().save_checkpoint(checkpoint_dict, filepath, storage_options=storage_options)

    def load_model_state_dict(self, checkpoint_dict: Mapping[str, Any], strict: bool = True) -> None:
        from resihp_lightning.strategy.migration import persistent_buffers

        tensors: dict[str, Any] = dict(self._local_params())
        for index, layer in self._pipe.local_layers().items():
            tensors.update({f"{index}.{name}": b for name, b in persistent_buffers(layer).items()})
        checkpoint.load_model_state(checkpoint_dict["state_dict"], tensors, strict=strict)
        from resihp_lightning.strategy import wrapped_state

        if wrapped_state.is_wrapped(self._engine):
            # The wrapper steps its fp32 masters: they must hold the loaded weights too.
            wrapped_state.set_masters(self._engine, self._local_params())

    def load_optimizer_state_dict(self, checkpoint_dict: Mapping[str, Any]) -> None:
        from resihp_lightning.strategy import wrapped_state

        states = checkpoint_dict.get("optimizer_states") or []
        if self._optimizer is None or not states:
            return
        params = self._local_params()
        if wrapped_state.is_wrapped(self._engine):
            saved = states[0]
            checkpoint.load_hyperparameters(self._groups, saved)
            entries = {k: wrapped_state.as_wrapped_entry(saved["state"][k], p) for k, p in params.items() if k in saved["state"]}
            wrapped_state.import_state(self._engine, params, entries)
        else:
            checkpoint.load_optimizer_state(self._optimizer, self._groups, states[0], params)

    def teardown(self) -> None:
        if self._engine is not None:
            from resihp_lightning.strategy.engine import destroy_engine

            if self._profiler is not None:
                self._profiler.detach()
            destroy_engine(self._engine)
            self._engine = None
        self._destroy_reducer()
        super().teardown()

    # ----------------------------------------------------------------------------- internals
    def _tied_parameters(self, module: Any) -> list[tuple[tuple[int, str], ...]]:
        tied = tied_parameters(module, len(self._specs), self.misconfiguration_error)
        if tied and self._wrapped_optimizer():
            raise self.misconfiguration_error(
                "pipeline_tied_parameters() needs the plain fp32 optimizer: ties are kept by the strategy's layer-wise "
                "gradient reduction, which ZeRO / bf16 / fp16 in deepspeed_config replace"
            )
        return tied

    def _initial_plan(self) -> Plan:
        world, layers = self.world_size, len(self._specs)
        if self.options.plan is not None:
            plan = self.options.plan
            try:
                self.check_plan(plan)
            except PlanError as err:
                raise self.misconfiguration_error(f"ResiHPStrategy(plan=...) is not valid for this job: {err}") from None
            if self._num_micro is None:
                self._num_micro = sum(r.micro_batches for r in plan.replicas)
            return plan
        p = self.options.pipeline_degree
        if p is None:
            p = 2 if world > 2 and world % 2 == 0 and layers >= 2 else 1
        if world % p or p > layers:
            raise ConfigError(
                f"invalid value {p!r} for option `pipeline_degree`; allowed: a divisor of the world size {world} "
                f"that is at most the {layers} layers"
            )
        d = world // p
        total = self._num_micro if self._num_micro is not None else d
        if total < d:
            raise ConfigError(f"invalid value {total!r} for option `micro_batches`; allowed: at least D = {d}")
        return Plan.uniform(list(range(world)), layers, p, total)

    def _settle_micro_batches(self, rows: int) -> None:
        mbs = self.micro_batch_size
        if rows % mbs:
            raise ConfigError(f"a training batch has {rows} rows, not a multiple of micro_batch_size={mbs}")
        count = rows // mbs
        if self.options.micro_batches is not None or self._settled:
            if count != self._num_micro:
                raise ConfigError(
                    f"a training batch has {rows} rows = {count} micro-batches of {mbs}, but the job runs "
                    f"M={self._num_micro} per step (set drop_last=True on the DataLoader, or micro_batches)"
                )
            return
        self._settled = True
        if count == self._num_micro and sum(r.micro_batches for r in self.current_plan.replicas) == count:
            return
        plan = self.current_plan
        if count < plan.data_degree:
            raise ConfigError(f"a training batch of {count} micro-batches cannot feed D={plan.data_degree} replicas")
        counts = even_split(count, plan.data_degree)
        self._num_micro = count
        self._apply(Plan(tuple(replace(r, micro_batches=c) for r, c in zip(plan.replicas, counts))), record=False)

    _settled = False

    def _loss_fn(self, outputs: Any, labels: Any) -> Tensor:
        loss = self.lightning_module.pipeline_loss(outputs, labels)
        return loss * self._loss_scale if self._loss_scale != 1.0 else loss

    def _build_pipe(
        self, plan: Plan, reuse: Mapping[int, torch.nn.Module] | None, skip_init: frozenset[int] | set[int] = frozenset()
    ) -> Any:
        from resihp_lightning.strategy.pipeline_module import BoundedPipelineModule
        from resihp_lightning.strategy.topology import PlanTopology

        kwargs: dict[str, Any] = {}
        interval = (self.options.deepspeed_config.get("pipeline") or {}).get("activation_checkpoint_interval")
        if interval:
            kwargs["activation_checkpoint_interval"] = interval
        # DeepSpeed prints its seed settings and topology on every build; keep re-plans quiet.
        with contextlib.redirect_stdout(io.StringIO()):
            return BoundedPipelineModule(
                self._specs,
                PlanTopology(plan),
                plan.replicas[position(plan, self.global_rank).replica].bounds,
                loss_fn=self._loss_fn,
                reuse=reuse,
                skip_init=skip_init,
                **kwargs,
            )

    def _local_params(self) -> dict[str, torch.nn.Parameter]:
        return optim.local_parameters(self._pipe.local_layers())

    def _setup_user_optimizer(self, trainer: Any) -> None:
        module = self.lightning_module
        # Lazily built layers (LayerSpec) are not attributes of the user's module: show them to
        # configure_optimizers through a temporary child.
        module.add_module("_resihp_pipe", self._pipe)
        try:
            self.setup_optimizers(trainer)
        finally:
            del module._modules["_resihp_pipe"]
        if len(self.optimizers) != 1:
            raise self.misconfiguration_error(
                f"configure_optimizers returned {len(self.optimizers)} optimizers; ResiHPStrategy needs exactly one"
            )
        self._optimizer = self.optimizers[0]
        params = self._local_params()
        self._group_of = optim.group_assignment(self._optimizer, params)
        self._groups = list(self._optimizer.param_groups)
        optim.assign(self._optimizer, self._groups, self._group_of, params)

    def _gather_layer_sizes(self) -> list[int]:
        mine = {i: sum(p.numel() for p in m.parameters()) for i, m in self._pipe.local_layers().items()}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        sizes = [0] * len(self._specs)
        for part in gathered:
            for i, n in part.items():
                sizes[i] = n
        return sizes

    def _new_engine(self, plan: Plan, broadcast: bool = True) -> Any:
        from resihp_lightning.strategy.engine import build_engine, engine_config
        from resihp_lightning.strategy.profiling import StageProfiler

        replica = plan.replicas[self._position.replica]
        config = engine_config(self.micro_batch_size, replica.micro_batches, plan.data_degree, self.options.deepspeed_config)
        # Plain fp32: the layer-wise reduction (any bounds; exact gradient clipping). ZeRO / bf16 / fp16
        # keep DeepSpeed's own (check_plan then requires shared bounds).
        layerwise = not self._wrapped_optimizer()
        self._destroy_reducer()  # set up again (e.g. validate after fit): the old groups go first
        if layerwise:
            from resihp_lightning.strategy.layerwise import LayerwiseReducer, install

            self._reducer = LayerwiseReducer(plan, self.global_rank, self._pipe.local_layers(), tied=self._tied)
        engine = build_engine(self._pipe, self._optimizer, config, broadcast=broadcast and not layerwise)
        if layerwise:
            if broadcast:
                self._reducer.broadcast()
            install(engine, self._reducer)
        if self._profiler is None:
            self._profiler = StageProfiler(self.root_device)
        self._profiler.attach(engine, self._pipe.local_layers())
        return engine

    def _destroy_reducer(self) -> None:
        if self._reducer is not None:
            self._reducer.destroy()
            self._reducer = None

    def _apply(self, plan: Plan, record: bool = True) -> None:
        """Puts ``plan`` in force on this rank (collective when the layout changes)."""
        from resihp_lightning.strategy.engine import destroy_engine, set_micro_batches
        from resihp_lightning.strategy.migration import migrate, plan_transfers

        old = self.current_plan
        start = time.perf_counter()
        same_layout = [(r.devices, r.bounds) for r in old.replicas] == [(r.devices, r.bounds) for r in plan.replicas]
        sent, transfer_s, state_s = 0, 0.0, 0.0
        if same_layout:
            set_micro_batches(self._engine, plan.replicas[self._position.replica].micro_batches)
            self._plan = plan
        else:
            from resihp_lightning.strategy import wrapped_state

            transfers = plan_transfers(old, plan, self._layer_numel)
            old_layers = self._pipe.local_layers()
            wrapped = wrapped_state.is_wrapped(self._engine)
            carried, exported, scaler = None, {}, {}
            if wrapped:
                # Collective over each stage's data-parallel group: before the engine's groups go.
                old_params = self._local_params()
                exporting = time.perf_counter()
                exported = wrapped_state.export_state(self._engine, old_params)
                state_s += time.perf_counter() - exporting
                scaler = wrapped_state.export_scaler(self._engine)
                carried = {old_params[key]: entry for key, entry in exported.items()}
            recording = self._profiler.record_layers
            self._profiler.detach()
            destroy_engine(self._engine)
            self._engine = None
            self._destroy_reducer()
            self._plan, self._position = plan, position(plan, self.global_rank)
            reuse = {i: m for i, m in old_layers.items() if i in self._position.layers}
            incoming = {t.layer for t in transfers if t.dst == self.global_rank}
            self._pipe = self._build_pipe(plan, reuse, skip_init=incoming)
            new_layers = self._pipe.local_layers()
            if wrapped:
                # Received values arrive in the sender's dtype (the engine's): cast the fresh layers first.
                dtype = wrapped_state.engine_param_dtype(self.options.deepspeed_config)
                wrapped_state.cast_parameters([new_layers[i] for i in incoming if i in new_layers], dtype)
            moving = time.perf_counter()
            sent, received = migrate(transfers, self.global_rank, old_layers, new_layers, self._optimizer, state=carried)
            transfer_s = time.perf_counter() - moving
            state = {f"{layer}.{name}": s for layer, per in received.items() for name, s in per.items()}
            if self._optimizer is not None:
                # Under a wrapper the user's optimizer only holds flat partitions: the state goes in below.
                optim.assign(self._optimizer, self._groups, self._group_of, self._local_params(), None if wrapped else state)
            self._engine = self._new_engine(plan, broadcast=False)
            if wrapped:
                importing = time.perf_counter()
                kept = {key: entry for key, entry in exported.items() if int(key.split(".", 1)[0]) in self._position.layers}
                wrapped_state.import_state(self._engine, self._local_params(), {**kept, **state})
                wrapped_state.import_scaler(self._engine, scaler)
                state_s += time.perf_counter() - importing
            self._profiler.record_layers = recording
        total = torch.tensor([float(sent)], dtype=torch.float64, device=self.root_device)
        if not same_layout:
            dist.all_reduce(total)
        if record:
            seconds = time.perf_counter() - start
            self._last_migration = MigrationRecord(
                plan=plan,
                seconds=seconds,
                bytes_moved=int(total.item()),
                transfer_seconds=transfer_s,
                rebuild_seconds=seconds - transfer_s,
                state_seconds=state_s,
            )
            log.info("applied plan %s: %d bytes moved in %.3f s", plan.layout_key(), int(total.item()), seconds)

    _rows = 0

    def _run_share(self, batch: Any, compute_loss: bool) -> tuple[list[batching.MicroBatch], list[Any] | None]:
        """Runs this replica's share of an evaluation batch; the last stage gets one output per micro-batch.

        Returns:
            (this replica's micro-batches, the per-micro-batch losses or outputs on the last stage,
            ``None`` elsewhere).
        """
        split = batching.split_batch(self.lightning_module, batch)
        self._rows = split.rows
        plan, pos = self.current_plan, self._position
        shares = batching.eval_shares(split.rows, self.micro_batch_size, [r.micro_batches for r in plan.replicas])
        offset, count = shares[pos.replica]
        items = self._cast(batching.micro_batches(split, offset, count, self.micro_batch_size))
        if not count:
            dist.barrier()  # eval_batch's own barrier, so that replicas without work stay in step
            return items, None
        outputs = self._engine.eval_batch(
            batching.iterate(items),
            compute_loss=compute_loss,
            reduce_output=None,
            bcast_loss=False,
            num_micro_batches=count,
        )
        return items, outputs if pos.stage == plan.pipeline_degree - 1 else None

    def _cast(self, items: list[batching.MicroBatch]) -> list[batching.MicroBatch]:
        """Floating-point inputs in the engine's parameter dtype (bf16 / fp16 runs get float32 batches)."""
        from resihp_lightning.strategy.wrapped_state import engine_param_dtype

        dtype = engine_param_dtype(self.options.deepspeed_config)
        return items if dtype == torch.float32 else batching.cast_inputs(items, dtype)

    def _evaluate(self, batch: Any) -> Tensor:
        items, losses = self._run_share(batch, compute_loss=True)
        sums = torch.zeros(2, dtype=torch.float64, device=self.root_device)
        for mb, loss in zip(items, losses or ()):
            sums[0] += float(loss.float()) * mb.rows
            sums[1] += mb.rows
        dist.all_reduce(sums)
        return (sums[0] / sums[1]).float()

    def _predict(self, batch: Any) -> Any:
        items, outputs = self._run_share(batch, compute_loss=False)
        mine = None
        if outputs is not None:
            mine = (self._position.replica, [batching.to_cpu(out) for out in outputs])
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        parts = [part for _, part in sorted(entry for entry in gathered if entry is not None)]
        return batching.to_device(batching.concat_rows([out for part in parts for out in part]), self.root_device)


class ResiHPStrategy(ResiHPStrategyMixin, DDPStrategy):
    """Pipeline (DeepSpeed ``PipelineEngine``, 1F1B) x data-parallel training that can be re-planned live.

    Use ``Trainer(strategy="resihp")`` or ``Trainer(strategy=ResiHPStrategy(...))``. Launching works as
    for DDP (Lightning's launcher on one machine, torchrun / SLURM for several). The model must be a
    :class:`~resihp_lightning.strategy.module.ResiHPModule` (see its docstring for the exact contract).

    Data: every rank must see the same global batch of M x ``micro_batch_size`` rows, so the strategy
    asks Lightning for a sampler that does not shard by rank (``num_replicas=1``); shuffling, epochs
    and ``set_epoch`` behave as usual (like Lightning's DDP, training data is shuffled by a sampler
    seeded with ``PL_GLOBAL_SEED``; with ``Trainer(use_distributed_sampler=False)`` the DataLoader's own
    sampler is used unchanged on every rank, and it must then yield the same order everywhere).
    Training batches must all have M x ``micro_batch_size`` rows (use ``drop_last=True``). Replica r
    trains on its own m_r micro-batches of that batch (rows after those of replicas 0..r-1), so
    re-plans need no new DataLoader. Validation / test / predict batches of any size are dealt out
    in micro-batches in proportion to m_r; the validation / test loss is the mean over rows, and a
    predict step returns the last layer's outputs for the whole batch, in row order, on every rank.
    With unequal m_r each replica's loss is scaled by m_r * D / M, which makes the gradient exactly
    that of the global batch.

    Gradients (plain fp32 optimizer): each layer's gradient is averaged over the ranks that hold it,
    one per replica (:mod:`~resihp_lightning.strategy.layerwise`), so replicas may have different
    stage bounds, and ``gradient_clipping`` uses the exact global norm. With ZeRO-1 / bf16 / fp16
    DeepSpeed's own stage-paired reduction runs and every replica must have the same bounds.

    Re-planning: :meth:`request_plan` (on all ranks, from any callback) validates a plan at once and
    applies it at the start of the next training step: changing only micro-batch counts updates the
    engine in place; anything else builds a new engine and moves the parameters and optimizer state of
    the layers whose owner changes, point to point (:attr:`last_migration` records time and bytes).

    Args:
        pipeline_degree: P of the initial uniform plan (default 2 when the world size is even and
            above 2, else 1).
        plan: a full initial plan instead (device ids are global ranks); replicas may have
            different stage bounds unless ZeRO / bf16 / fp16 is on.
        micro_batch_size: rows per micro-batch.
        micro_batches: M per global batch; default: inferred from the first training batch.
        deepspeed_config: DeepSpeed config entries over the defaults (``gradient_clipping`` 0.0; ZeRO-1,
            ``bf16`` and ``pipeline.activation_checkpoint_interval`` pass through). Layer moves carry
            the optimizer state of the plain optimizer and, through DeepSpeed's per-parameter accessors,
            of its ZeRO-1 / bf16 wrappers (fp32 master weights included); with fp16 or ZeRO offload only
            micro-batch counts may change live (layer moves are refused with a ``PlanError``).
        planner: planner options (kept for the controller callback).
        process_group_backend: ``"gloo"`` / ``"nccl"`` (default by device).
        timeout: collective timeout.
        options: all of the above as one :class:`StrategyOptions` (the other arguments are then ignored).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for
            Lightning's ``DDPStrategy``.
    """
