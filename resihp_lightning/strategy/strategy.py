"""``ResiHPStrategy``: Lightning wiring around a :class:`~resihp_lightning.runtime.pipeline_runtime.PipelineRuntime`.

The strategy turns Lightning's hooks into calls on the parts it composes, each built from the state
it needs:

* the runtime in force, the requested plan and M: one :class:`~resihp_lightning.runtime.runtime_state.RuntimeState`
  that every part shares;
* the job's membership (rank, world size, device id, live devices, guarded collectives):
  :class:`~.job_membership.PlainMembership`, or with ``fail_stop``
  :class:`~resihp_lightning.failstop.surviving_membership.SurvivingMembership`;
* the training steps: a step runner of the same mode (:class:`~resihp_lightning.runtime.training_steps.PlainSteps`,
  :class:`~resihp_lightning.failstop.surviving_steps.SurvivingSteps`) that returns a
  :class:`~resihp_lightning.runtime.training_steps.StepOutcome`;
* tensor parallelism: :class:`~.tensor_modes.WholeLayers` or :class:`~.tensor_modes.SplitLayers`;
* checkpoints and the end-of-fit weights (:class:`~.model_state.ModelState`) and the validation /
  test / predict steps (:class:`~.evaluation_steps.EvaluationSteps`).

Everything that depends on the plan lives in the runtime.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from resihp_lightning import _registration
from resihp_lightning._logging import quiet_agreed_errors, user_info, user_warn
from resihp_lightning.contract import DeviceConditions, MigrationRecord
from resihp_lightning.errors import ConfigError, PlanError
from resihp_lightning.failstop.admission import AdmissionNote
from resihp_lightning.failstop.fail_stop_config import JOIN_VARIABLE, FailStopConfig, joins_from_env
from resihp_lightning.failstop.recovery_record import RecoveryRecord
from resihp_lightning.failstop.surviving_membership import SurvivingMembership
from resihp_lightning.failstop.surviving_steps import SurvivingSteps
from resihp_lightning.failstop.survivors import SurvivingJob
from resihp_lightning.placement import row_offset
from resihp_lightning.resilience.failure_detector import FailureDetector
from resihp_lightning.plan import Plan
from resihp_lightning.process_ranks import ensure_process_ranks
from resihp_lightning.runtime import batching, link_probe
from resihp_lightning.runtime.device_memory import memory_budget_mb
from resihp_lightning.runtime.engine import init_deepspeed_comm
from resihp_lightning.runtime.pipeline_runtime import PipelineRuntime, RuntimeConfig
from resihp_lightning.runtime.runtime_state import RuntimeState
from resihp_lightning.runtime.training_steps import PlainSteps, ReplicaShare, StepRunner
from resihp_lightning.state.bound_optimizer import BoundOptimizer
from resihp_lightning.state.module_weights import LayerKeys
from resihp_lightning.state.wrapped_state import wraps_optimizer
from resihp_lightning.strategy.evaluation_steps import EvaluationSteps
from resihp_lightning.strategy.job_membership import Membership, PlainMembership
from resihp_lightning.strategy.launcher import supervised
from resihp_lightning.strategy.loss_logging import LossLogRecorder
from resihp_lightning.strategy.model_state import ModelState
from resihp_lightning.strategy import newcomer_state
from resihp_lightning.strategy.module import check_contract, layer_specs, resolve_gather_weights, tied_parameters
from resihp_lightning.strategy.options import StrategyOptions
from resihp_lightning.strategy.plan_rules import check_plan, initial_plan, settle_micro_batches
from resihp_lightning.strategy.tensor_modes import SplitLayers, TensorMode, WholeLayers
from resihp_lightning.strategy.tensor_setup import check_tensor_groups, check_tensor_parallel_job, create_tensor_groups
from resihp_lightning.tensor.tensor_groups import TensorGroups, TensorParallelism
from resihp_lightning.torch_utils.wait_clock import TENSOR_PARALLEL_WAIT
from resihp_lightning.strategy.trainer_options import effective_deepspeed_config, layerwise_precision, refuse_unsupported
from resihp_lightning.telemetry import LayerCost, LinkSample, StepStats


class ResiHPStrategyMixin:
    """Everything of :class:`ResiHPStrategy` that does not depend on the Lightning package.

    Combined with ``lightning.pytorch``'s ``DDPStrategy`` it is :class:`ResiHPStrategy`; combined with
    the standalone ``pytorch_lightning`` package's ``DDPStrategy`` it is
    :class:`resihp_lightning.strategy.standalone.ResiHPStrategy`. Both packages ship the same code
    under different names, so only the base class and the exception type differ.
    """

    #: Raised for bad options and modules (the Lightning package's own ``MisconfigurationException``).
    misconfiguration_error: type[Exception] = MisconfigurationException
    #: The Lightning package's no-op precision plugin (the engine itself runs bf16 / fp16).
    plain_precision: type = Precision

    strategy_name = "resihp"

    def __init__(
        self,
        pipeline_degree: int | None = None,
        plan: Plan | dict | None = None,
        micro_batch_size: int = 1,
        micro_batches: int | None = None,
        deepspeed_config: dict[str, Any] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float = timedelta(minutes=30),
        gather_weights: str = "auto",
        fail_stop: FailStopConfig | dict | bool | None = None,
        tensor_degree: int = 1,
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
                process_group_backend=process_group_backend,
                timeout=timeout,
                gather_weights=gather_weights,
                fail_stop=fail_stop,
                tensor_degree=tensor_degree,
            )
        self.options = options
        #: This process joins a running job (``fail_stop.join`` or ``RESIHP_JOIN=1``).
        self._joins = options.fail_stop.joins if options.fail_stop is not None else _join_without_fail_stop()
        # One launcher per process (RESIHP_RANKS_AT): the job's ranks before Lightning reads them (a newcomer
        # only learns where the running job is: it claims its rank from the job's store).
        ensure_process_ranks(join=self._joins)
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
        self._tied: list[tuple[tuple[int, str], ...]] = []
        self._keys: LayerKeys | None = None
        self._micro_batches_settled = False
        self._last_step_stats: StepStats | None = None
        self._deepspeed_config: dict[str, Any] | None = None
        self._loss_log = LossLogRecorder()
        self._state = RuntimeState(micro_batches=options.micro_batches)
        # The modes: a plain job until a fail-stop job forms its groups (setup_distributed), whole layers
        # until a tensor-parallel job forms its groups (setup).
        lightning = super(ResiHPStrategyMixin, self)
        self._membership: Membership = PlainMembership(
            lambda: lightning.global_rank, lambda: lightning.world_size, options.tensor_degree
        )
        self._steps: StepRunner = PlainSteps(self._state, self._run_replica_share)
        self._tensor: TensorMode = WholeLayers()
        self._compose()
        #: The slow devices and links a fail-stop recovery plans the survivors with (the controller sets it).
        self.device_conditions = DeviceConditions()
        self._skip_batches = 0  # a newcomer's training loader leaves out this many batches (once)
        self._exception_seen = False  # the current trainer call raised (Lightning's on_exception)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register("resihp", cls, description=_registration.DESCRIPTION, override=True)

    # ------------------------------------------------------------------------ public API
    @property
    def current_plan(self) -> Plan:
        """The plan in force (device ids are global ranks)."""
        if self._state.runtime is None:
            raise RuntimeError("ResiHPStrategy has no plan before Trainer setup")
        return self._state.runtime.plan

    @property
    @override
    def global_rank(self) -> int:
        # Under fail-stop recovery the rank is the one in the current generation of the job's groups.
        return self._membership.rank

    @property
    @override
    def world_size(self) -> int:
        return self._membership.world_size

    @property
    def device_id(self) -> int:
        """This process's device id in plans: its global rank when the job started (stable across regroups);
        with ``tensor_degree`` t, its tensor-parallel group's (global rank // t)."""
        return self._membership.device_id

    @property
    def process_id(self) -> int:
        """This process's id for the job's lifetime: its global rank when the job started (``device_id`` is
        its tensor-parallel group's under tensor parallelism)."""
        return self._membership.process_id

    @property
    def tensor_degree(self) -> int:
        """Processes per planning device: the ``tensor_degree`` option until a re-split or a recovery forms
        other groups, then the largest of theirs (1: no tensor parallelism)."""
        return self._tensor.degree if self._tensor.splits_layers else self.options.tensor_degree

    @property
    def tensor_groups(self) -> TensorGroups | None:
        """The tensor-parallel groups in force (``None`` without tensor parallelism, or before setup)."""
        return self._membership.tensor_groups

    @property
    def reports_device(self) -> bool:
        """Whether this process's step statistics speak for its device (under tensor parallelism only its
        group's member 0 reports: the members finish every layer together)."""
        return self._tensor.reports_device

    @property
    def devices_alive(self) -> tuple[int, ...]:
        """The device ids of the job's live processes (hot spares included)."""
        return self._membership.devices_alive

    def share_idle_probe(self, step: int, probe_ms: float) -> None:
        """An idle process: publishes its speed-probe time (``IdleProbes`` in ``resihp_lightning.contract``)."""
        self._membership.share_idle_probe(step, probe_ms)

    def idle_probes(self) -> dict[int, tuple[int, float]]:
        """The idle processes' latest speed-probe times: device id -> ``(step, ms)``."""
        return self._membership.idle_probes()

    @property
    def supports_idle_devices(self) -> bool:
        """Whether a plan may leave live devices idle as hot spares (``fail_stop`` on, the layer-wise engine: no DeepSpeed optimizer wrapper)."""
        return self.options.fail_stop is not None and self.supports_per_replica_bounds

    @property
    def runtime(self) -> PipelineRuntime | None:
        """This rank's pipeline runtime (``None`` before setup)."""
        return self._state.runtime

    @property
    def micro_batches(self) -> int | None:
        """M, micro-batches per global batch (``None`` until known)."""
        return self._state.micro_batches

    @property
    def micro_batch_size(self) -> int:
        return self.options.micro_batch_size

    @property
    def num_layers(self) -> int:
        return len(self._specs)

    @property
    def last_step_stats(self) -> StepStats | None:
        """This rank's statistics of the last training step."""
        return self._last_step_stats

    @property
    def last_migration(self) -> MigrationRecord | None:
        """The last applied re-plan (``None`` before one); see :class:`~resihp_lightning.contract.MigrationRecord`."""
        return self._state.last_migration

    def local_layers(self) -> dict[int, torch.nn.Module]:
        """This rank's layer modules by global layer index (they change after a re-plan)."""
        return self._state.runtime.local_layers() if self._state.runtime is not None else {}

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        """The DeepSpeed entries in force: ``deepspeed_config`` with the Trainer's precision and clipping."""
        return self._deepspeed_config if self._deepspeed_config is not None else self.options.deepspeed_config

    @property
    def supports_per_replica_bounds(self) -> bool:
        """Whether plans whose replicas have different stage bounds can run (plain fp32 optimizer only).

        The layer-wise gradient reduction that makes them exact works on the optimizer's own
        parameters; ZeRO / bf16 / fp16 wrap the optimizer and keep DeepSpeed's stage-paired reduction.
        """
        return not wraps_optimizer(self.deepspeed_config)

    @property
    def pending_plan(self) -> Plan | None:
        """A requested plan not applied yet."""
        return self._state.pending

    @property
    def profiler_recording(self) -> bool:
        """Whether training steps feed :meth:`layer_profile` (pause it while a device is slow)."""
        return self._state.runtime is not None and self._state.runtime.profiler.record_layers

    @profiler_recording.setter
    def profiler_recording(self, value: bool) -> None:
        if self._state.runtime is not None:
            self._state.runtime.profiler.record_layers = bool(value)

    def request_plan(self, plan: Plan, tensor_groups: TensorGroups | Sequence[Sequence[int]] | None = None) -> None:
        """Asks for ``plan`` to take effect at the next step boundary (call on every rank).

        With ``fail_stop`` on, the plan may leave live devices idle (hot spares) and may take spares
        back; a spare's own request is ignored (the members decide, and tell the spares).

        Args:
            plan: the plan (over the devices, or with tensor parallelism over the groups).
            tensor_groups: with ``tensor_degree`` > 1, new tensor-parallel groups for ``plan``: each the
                global ranks of its members (numbered in ascending rank order), of any degree the module's
                layers split over, every rank in one (e.g. ``[[0, 1], [2], [3]]`` after ``tensor_degree=4`` on 4
                processes). At the next step boundary every layer is re-cut over its new group, its shards and
                optimizer state moving member to member (``docs/tensor_parallel.md``); ``plan`` names the new
                groups by their index. A re-split that the split itself refuses there (a module that does not
                name its degrees) is dropped with a warning on every process, and training goes on.

        Raises:
            PlanError: the plan does not fit this job (bounds, P x D vs world size, micro-batch sum,
                per-replica bounds); nothing changes and training goes on under the current plan.
            ConfigError: (nothing changes either) ``tensor_groups`` without tensor parallelism, groups that do not hold every process
                exactly once, or a degree the module's layers do not split over
                (``pipeline_tensor_parallel_degrees``).
        """
        groups = None
        if tensor_groups is not None:
            groups = tensor_groups if isinstance(tensor_groups, TensorGroups) else TensorGroups(tuple(map(tuple, tensor_groups)))
            degrees = getattr(self.lightning_module, "pipeline_tensor_parallel_degrees", lambda: None)()
            check_tensor_groups(groups, self.options.tensor_degree, self.world_size, degrees)
            check_plan(plan, range(groups.groups), self.num_layers, self._state.micro_batches, self.deepspeed_config,
                       None, idle_allowed=False)
        else:
            self.check_plan(plan)
        self._state.pending, self._state.pending_groups = plan, groups

    def check_plan(self, plan: Plan) -> None:
        """Raises :class:`~resihp_lightning.errors.PlanError` when ``plan`` cannot run on this job (see ``plan_rules.check_plan``)."""
        current = self._state.runtime.plan if self._state.runtime is not None else None
        check_plan(plan, self.devices_alive, self.num_layers, self._state.micro_batches, self.deepspeed_config, current,
                   idle_allowed=self.supports_idle_devices)

    def measure_links(self, first_round: int = 0) -> LinkSample:
        """Times the links of the current group at a step boundary (collective; see :mod:`.link_probe`).

        Each rank's probe carries the activation its stage boundary sends per micro-batch (as the
        profiler saw it) and the all-reduce is priced for the largest per-rank gradient.

        Args:
            first_round: the round of the partner schedule to start at (rotate it between probes).
        """
        runtime = self._state.require()
        pos, plan = runtime.position, runtime.plan
        boundary = 0
        if pos.stage < plan.pipeline_degree - 1:
            boundary = runtime.profiler.activation_bytes.get(pos.stop - 1, 0)
        gradient = sum(p.numel() * p.element_size() for p in runtime.local_parameters().values() if p.requires_grad)
        step = self.lightning_module.trainer.global_step
        return link_probe.measure(self.device_id, boundary, gradient, step, first_round, device=self.root_device)

    def device_memory_mb(self) -> float:
        """This rank's memory budget for the model's state and activations, in MB (see :mod:`.device_memory`)."""
        return memory_budget_mb(self.root_device, getattr(self, "num_processes", None))

    def layer_profile(self) -> list[LayerCost]:
        """Measured cost of every layer, gathered over ranks (collective: call on every rank).

        See :meth:`~resihp_lightning.runtime.pipeline_runtime.PipelineRuntime.layer_profile`.
        """
        return self._state.require().layer_profile()

    # ------------------------------------------------------------ fail-stop (contract.Survivable)
    @property
    def is_spare(self) -> bool:
        """Whether the plan in force leaves this process idle (it mirrors the members' steps)."""
        return self._membership.is_spare

    @property
    def last_recovery(self) -> RecoveryRecord | None:
        """The last in-process fail-stop recovery (``None`` before one)."""
        return self._membership.last_recovery

    @property
    def last_admission(self) -> AdmissionNote | None:
        """The last newcomers the members admitted (``RESIHP_JOIN=1`` processes; ``None`` before any, and on a
        newcomer or a spare)."""
        return self._membership.last_admission

    @property
    def failure_detector(self) -> FailureDetector | None:
        """The failure detector of the job's groups (``fail_stop`` on), which reporting callbacks subscribe to."""
        return self._membership.failure_detector

    @property
    def fail_stop_listeners(self) -> list[Callable[[str, dict[str, Any]], None]]:
        """Called as ``listener(event, fields)`` before this process exits unrecoverably (empty without fail_stop)."""
        return self._membership.listeners

    @property
    def recovery_listeners(self) -> list[Callable[[], None]]:
        """Called on every survivor inside a recovery (callbacks re-synchronise their state there)."""
        return self._membership.recovery_listeners

    @property
    def collectives_interrupted(self) -> bool:
        """Whether a lost peer interrupted this step after its update, or this process is a spare (it has
        no process group); callbacks skip their collectives then."""
        return self._membership.collectives_interrupted

    def collective(self, run: Callable[[], Any]) -> tuple[bool, Any]:
        """Runs a callback's collective between steps (see :class:`~resihp_lightning.contract.StepStatsSource`).

        Without fail-stop recovery it simply runs. With it, a lost peer makes the survivors regroup,
        and this and every later collective of the step is skipped on this rank: survivors
        interrupted at different collectives of the same step meet again at the next step.
        """
        return self._membership.collective(run)

    # ------------------------------------------------------------------ checkpoints, weights
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Every tensor of the model under the LightningModule's own keys, on rank 0 (collective).

        Layers come from the ranks of the first replica, in full precision (fp32 masters under bf16);
        everything else from rank 0's module.
        """
        return self._model_state.module_state(self.lightning_module)

    def export_weights(self, path: str | os.PathLike) -> None:
        """Writes the trained model's ``state_dict`` (the module's own keys) to ``path`` on rank 0 (collective).

        ``Model().load_state_dict(torch.load(path))`` restores it in a plain process.
        """
        state = self.lightning_module_state_dict()
        if self.global_rank == 0:
            torch.save(state, path)
        self.barrier()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self._model_state.optimizer_state()

    @override
    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        checkpoint_dict["resihp"] = self._model_state.checkpoint_section()
        super().save_checkpoint(checkpoint_dict, filepath, storage_options=storage_options)

    @override
    def load_model_state_dict(self, checkpoint_dict: Mapping[str, Any], strict: bool = True) -> None:
        self._model_state.load_module_state(self.lightning_module, checkpoint_dict, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint_dict: Mapping[str, Any]) -> None:
        self._model_state.load_optimizer_state(checkpoint_dict)

    # --------------------------------------------------------------------- Lightning wiring
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank reads the whole global batch; replicas slice their micro-batches out of it.
        return {"num_replicas": 1, "rank": 0}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self.options.fail_stop is not None and type(self._launcher).__name__ == "_SubprocessScriptLauncher":
            self._launcher = supervised(self._launcher, restart_code=self.options.fail_stop.exit_code)

    @override
    def setup_distributed(self) -> None:
        if self.options.fail_stop is None:
            super().setup_distributed()
            return
        if self._membership.survives_failures:  # set up again (trainer.validate after fit): the groups exist
            return
        # As DDPStrategy.setup_distributed, but the default group comes from a world that can regroup.
        if self.num_nodes > 1 and not self.options.fail_stop.spans_machines:
            raise self.misconfiguration_error(
                "ResiHPStrategy(fail_stop=...) on several machines needs fail_stop.store_port (a fixed port for the "
                "rendezvous store host, which runs on node 0 at MASTER_ADDR) or fail_stop.store with backend 'etcd'"
            )
        if self._joins and self.options.tensor_degree > 1:
            raise ConfigError("fail_stop.join (RESIHP_JOIN=1) with tensor_degree > 1 is not supported (idle processes under "
                              "tensor parallelism are not); allowed: tensor_degree=1")
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        # As Lightning's own connection does: the cluster environment names the main node (under srun
        # from SLURM_NODELIST), where the store host runs on several machines.
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        # A newcomer (fail_stop.join) claims its rank from the running job's store; it forms no group here.
        job = SurvivingJob(
            self.options.fail_stop, None if self._joins else self.global_rank, None if self._joins else self.world_size,
            self._process_group_backend, self.options.timeout.total_seconds(), node_rank=self.node_rank,
            join=self._joins, admit_newcomers=self.options.tensor_degree == 1,
        )
        membership = SurvivingMembership(
            job, self._state, global_step=lambda: self.lightning_module.trainer.global_step,
            conditions=lambda: self.device_conditions, on_regrouped=self._note_ranks,
            lightning_state=lambda: newcomer_state.capture(self.lightning_module.trainer),
        )
        self._membership = membership
        self._steps = SurvivingSteps(membership, self._state, self._run_replica_share)
        self._compose()
        self._note_ranks()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # DeepSpeed's PipelineModule reads LOCAL_RANK from the environment.
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
        if not self.is_spare:  # a spare (set up again after fit) has no process group
            init_deepspeed_comm(self._get_process_group_backend())
        quiet_agreed_errors(self.global_rank)

    @override
    def connect(self, model: Any) -> None:
        super().connect(model)
        # ResiHPModule defines validation_step for the strategy to run; a fit without a validation
        # loader is not the mistake Lightning's warning suspects.
        warnings.filterwarnings("ignore", message=r"You defined a `validation_step` but have no `val_dataloader`")

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self._exception_seen = False
        self.accelerator.setup(trainer)
        module = self.lightning_module
        check_contract(module, self.misconfiguration_error)
        refuse_unsupported(trainer, self, self.misconfiguration_error)
        if self._deepspeed_config is None:
            precision = self.precision_plugin.precision
            self._deepspeed_config = effective_deepspeed_config(
                self.options.deepspeed_config, precision, trainer.gradient_clip_val, trainer.gradient_clip_algorithm,
                self.misconfiguration_error,
            )
            # The engine casts and scales itself; Lightning's plugin must not autocast or change dtypes.
            self.precision_plugin = self.plain_precision()
            self.precision_plugin.precision = precision
        self._specs = layer_specs(module, self.misconfiguration_error)
        self._keys = LayerKeys(module, self._specs)
        self._tied = self._tied_parameters(module)
        self.options.gather_weights = resolve_gather_weights(self.options.gather_weights, module, self.misconfiguration_error)
        if self.options.tensor_degree > 1:
            check_tensor_parallel_job(self.options.tensor_degree, module, self.deepspeed_config,
                                      trainer.state.fn == TrainerFn.PREDICTING, self.misconfiguration_error)
            if not self._tensor.splits_layers:  # the first setup forms the groups (collective)
                self._tensor = SplitLayers(create_tensor_groups(self.options.tensor_degree, self.global_rank,
                                                                self.world_size, module, self.misconfiguration_error))
                self._membership.tensor_groups = self._tensor.parallelism.groups
                if isinstance(self._membership, SurvivingMembership):
                    self._membership.on_tensor = self._tensor_recovered
        self._compose()
        previous = self._state.runtime
        if previous is not None and previous.idle:  # set up again on a spare: nothing to build
            self.setup_precision_plugin()
            return
        if previous is None and self._joins:  # a newcomer: no layers until a plan takes it in
            self._join_running_job(trainer)
            return
        if previous is None:
            plan, reuse, profiler = self._initial_plan(), None, None
        else:
            # Set up again (e.g. trainer.validate after fit): keep the plan in force, the layers this
            # rank holds (its copies of other layers are stale) and the measured layer costs.
            plan, reuse, profiler = previous.plan, previous.local_layers(), previous.profiler
        config = self._runtime_config(module)
        ranks = self._tensor.runtime_ranks(self._membership.rank_map())
        runtime = PipelineRuntime(config, plan, self.device_id, ranks=ranks, reuse=reuse, profiler=profiler)
        self._state.runtime = runtime
        if trainer.state.fn == TrainerFn.FITTING:
            optimizer = self._setup_user_optimizer(trainer)
        else:  # the fitted optimizer, if any, so that layer_profile() still counts its state
            optimizer = previous.optimizer.optimizer if previous is not None and previous.optimizer is not None else None
        runtime.start(optimizer, previous=previous)
        self.setup_precision_plugin()

    def _runtime_config(self, module: Any) -> RuntimeConfig:
        return RuntimeConfig(
            layers=self._specs,
            loss_fn=self._pipeline_loss,
            micro_batch_size=self.micro_batch_size,
            deepspeed_config=self.deepspeed_config,
            device=self.root_device,
            tied=tuple(self._tied),
            commit=self._membership.commit,
            load_layer=getattr(module, "pipeline_load_layer", None),
            tensor=self._tensor.parallelism,
            precision=layerwise_precision(self.options.deepspeed_config, self.precision_plugin.precision),
        )

    def _join_running_job(self, trainer: Any) -> None:
        """A newcomer's setup: its optimizer, then its admission (it waits at most
        ``fail_stop.admission_timeout_s``), then an idle runtime under the plan in force and the members'
        Lightning state (loop counters, data position, LR schedulers, callbacks)."""
        if trainer.state.fn != TrainerFn.FITTING:
            raise self.misconfiguration_error("a process joins a running job in trainer.fit (fail_stop.join / RESIHP_JOIN=1)")
        if not self.supports_idle_devices:
            raise self.misconfiguration_error(
                "fail_stop.join (RESIHP_JOIN=1) needs hot spares, i.e. the layer-wise engine: the plain fp32 optimizer, "
                "no DeepSpeed ZeRO / bf16 / fp16 optimizer wrapper in deepspeed_config or the Trainer's precision"
            )
        assert isinstance(self._membership, SurvivingMembership)
        optimizer = self._setup_user_optimizer(trainer, show_pipe=False)
        record = self._membership.await_admission(self.device_memory_mb())
        runtime = PipelineRuntime(self._runtime_config(self.lightning_module), Plan.from_dict(record.plan),
                                  self.device_id, layer_sizes=record.layer_sizes)
        bound = None if record.group_of is None else BoundOptimizer(optimizer, list(optimizer.param_groups),
                                                                      dict(record.group_of))
        runtime.start_idle(bound)
        self._state.runtime = runtime
        self._state.micro_batches = record.micro_batches
        self._micro_batches_settled = True
        newcomer_state.apply(trainer, record.lightning)
        self._skip_batches = int(record.lightning["data"]["batches"])
        self.setup_precision_plugin()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # A newcomer's training loader starts at the members' batch of the current epoch (once).
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._skip_batches and trainer is not None and trainer.training:
            dataloader, self._skip_batches = newcomer_state.SkipFirstBatches(dataloader, self._skip_batches), 0
        return super().process_dataloader(dataloader)

    def newcomers_waiting(self) -> int:
        """Processes registered to join this running job and not admitted yet (``fail_stop`` only: one store read;
        0 otherwise). The members admit them at the next training step's boundary."""
        membership = self._membership
        return membership.newcomers_waiting() if isinstance(membership, SurvivingMembership) else 0

    # Lightning's own collectives (ModelCheckpoint, early stopping, ...) between steps: with fail-stop
    # recovery a lost peer regroups the survivors, and the call answers as a single process would.
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        parent = super().barrier
        self.collective(lambda: parent(*args, **kwargs))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        parent = super().broadcast
        done, result = self.collective(lambda: parent(obj, src))
        return result if done else obj

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        parent = super().reduce
        done, result = self.collective(lambda: parent(tensor, group=group, reduce_op=reduce_op))
        return result if done else tensor

    @override
    def model_to_device(self) -> None:
        # The pipeline module moves its own (local) layers; the rest of the model stays where it is.
        return None

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        module = self.lightning_module
        split = batching.split_batch(module, batch)
        self._settle_micro_batches(split.rows)
        plan = self._take_pending_plan()
        start = time.perf_counter()
        # Under fail_stop a step that lost a peer before its commit point is redone on the survivors,
        # under their plan; a hot spare computes nothing and takes the members' result.
        outcome = self._steps.run(split, plan, self.root_device)
        step = module.trainer.global_step
        if outcome.share is not None:
            self._last_step_stats = outcome.share.stats(step, self.device_id, (time.perf_counter() - start) * 1000.0)
            _, logs = self.collective(lambda: self._loss_log.replay(module, self.root_device))
            self._steps.record_logs(logs or {})
        else:
            self._last_step_stats = None
            LossLogRecorder.log_values(module, outcome.logs or {}, self.root_device)
        self._log_train_loss(outcome.loss, split.rows)
        self._steps.finish(step)
        return outcome.loss

    @override
    def validation_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Tensor:
        loss, rows = self._evaluation.loss(self.lightning_module, batch, self.root_device)
        self.lightning_module.log("val_loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=rows, sync_dist=True)
        return loss

    @override
    def test_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Tensor:
        loss, rows = self._evaluation.loss(self.lightning_module, batch, self.root_device)
        self.lightning_module.log("test_loss", loss, on_step=False, on_epoch=True, batch_size=rows, sync_dist=True)
        return loss

    @override
    def predict_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation.predict(self.lightning_module, batch, self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        # PipelineEngine.train_batch already ran the backward passes.
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # The closure runs training_step (train_batch), which also stepped the optimizer.
        return closure()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        batching.check_train_loader(
            trainer.train_dataloader, self.micro_batch_size, self.options.micro_batches, trainer.num_training_batches
        )

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        # A rank lost during the weight sync (fail_stop): the survivors regroup and sync again.
        self._membership.run_recovering(self._model_state.gather_trained_weights)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._exception_seen = True

    @override
    def teardown(self) -> None:
        if self._state.runtime is not None:
            self._state.runtime.teardown()
        super().teardown()
        # Like DDP, the job's groups outlive teardown (trainer.validate after fit reuses them);
        # SurvivingJob closes its world when the process exits, with a goodbye after a clean end
        # (Lightning calls on_exception before teardown when the call raised).
        self._membership.end_call(clean=not self._exception_seen)
        self._exception_seen = False

    # ----------------------------------------------------------------------------- internals
    def _compose(self) -> None:
        """(Re)builds the parts that hold the modes and the module's layers (after either changes)."""
        self._model_state = ModelState(
            self._state, self._membership, self._tensor, self._specs, self._keys, self.options.gather_weights,
            self.micro_batch_size,
        )
        self._evaluation = EvaluationSteps(self._state, self._membership, self._tensor, self.micro_batch_size,
                                           self._loss_log)

    def _note_ranks(self) -> None:
        """Points Lightning's rank-zero utilities at this process's rank in the current group."""
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    def _log_train_loss(self, loss: Tensor, rows: int) -> None:
        # The loss is already the global batch's on every rank; sync_dist only averages identical values
        # (exactly), and tells Lightning that epoch-level aggregation is distributed-safe. Its reduce
        # goes through ``reduce`` (a guarded collective): on a spare or after an interruption it
        # returns the value unchanged, with the same logging options (Lightning requires that).
        self.lightning_module.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=rows,
                                  sync_dist=True)

    def _take_pending_plan(self) -> Plan | None:
        """The requested plan, checked again (the first batch may have fixed M since the request), or None."""
        if self._state.pending is None:
            return None
        plan, self._state.pending = self._state.pending, None
        groups, self._state.pending_groups = self._state.pending_groups, None
        if groups is not None:
            try:
                self._reshape(groups, plan)
            except ConfigError as err:  # every process refused it before anything changed
                user_warn(f"ResiHPStrategy: dropping the requested re-split: {err}")
            return None
        try:
            self.check_plan(plan)
        except PlanError as err:
            user_warn(f"ResiHPStrategy: dropping the requested plan {plan.layout_key()}: {err}")
            return None
        return plan

    def _reshape(self, groups: TensorGroups, plan: Plan) -> None:
        """Re-cuts the layers over new tensor-parallel groups (collective; the pending request of every rank).
        Under ``fail_stop`` a peer lost meanwhile regroups the survivors, whose plan replaces the request."""
        assert isinstance(self._tensor, SplitLayers)
        membership = self._membership
        done, record = membership.collective(
            lambda: self._tensor.reshape(self._state.require(), groups, plan, membership.process_id, membership.rank_map())
        )
        if not done:
            return
        membership.tensor_groups = groups
        self._state.last_migration = record
        user_info(
            f"ResiHPStrategy: re-split over tensor-parallel groups {[list(g) for g in groups.members]}: "
            f"{record.bytes_moved / 2**20:.1f} MiB moved in {record.seconds:.2f} s"
        )

    def _tensor_recovered(self, parallelism: TensorParallelism) -> None:
        """A recovery formed the survivors' tensor-parallel groups: the loss and the outputs use them."""
        assert isinstance(self._tensor, SplitLayers)
        self._tensor.parallelism = parallelism

    def _run_replica_share(self, split: batching.SplitBatch) -> ReplicaShare:
        """This replica's m_r micro-batches of the global batch through the pipeline, under the plan in force."""
        runtime = self._state.require()
        plan, pos = runtime.plan, runtime.position
        replica = plan.replicas[pos.replica]
        offset = row_offset(plan, pos.replica, self.micro_batch_size)
        items = batching.micro_batches(split, offset, replica.micro_batches, self.micro_batch_size)
        waited = TENSOR_PARALLEL_WAIT.reading()
        with self._loss_log.recording(self.lightning_module):
            loss, busy = runtime.train_batch(
                items, loss_scale=replica.micro_batches * plan.data_degree / self._state.micro_batches
            )
        tensor = runtime.config.tensor
        return ReplicaShare(loss=loss, busy=busy, items=items, position=pos,
                            tensor_wait_ms=(TENSOR_PARALLEL_WAIT.reading() - waited) * 1000.0,
                            tensor_degree=1 if tensor is None else len(tensor.groups.members[runtime.device]))

    def _pipeline_loss(self, outputs: Any, labels: Any) -> Tensor:
        return self._tensor.pipeline_loss(self.lightning_module, outputs, labels)

    def _tied_parameters(self, module: Any) -> list[tuple[tuple[int, str], ...]]:
        tied = tied_parameters(module, len(self._specs), self.misconfiguration_error)
        if tied and not self.supports_per_replica_bounds:
            raise self.misconfiguration_error(
                "pipeline_tied_parameters() needs the plain fp32 optimizer: ties are kept by the strategy's layer-wise "
                "gradient reduction, which DeepSpeed's ZeRO / bf16 / fp16 wrappers in deepspeed_config replace"
            )
        return tied

    def _initial_plan(self) -> Plan:
        try:
            plan = initial_plan(self.options, self.world_size // self.options.tensor_degree, len(self._specs))
        except PlanError as err:
            raise self.misconfiguration_error(f"ResiHPStrategy(plan=...) is not valid for this job: {err}") from None
        if self.options.plan is not None and self._state.micro_batches is None:
            self._state.micro_batches = sum(r.micro_batches for r in plan.replicas)
        return plan

    def _settle_micro_batches(self, rows: int) -> None:
        """Checks a training batch's size; the first one fixes M when the options left it open."""
        fixed = self.options.micro_batches is not None or self._micro_batches_settled
        self._micro_batches_settled = True
        plan = settle_micro_batches(rows, self.micro_batch_size, self._state.micro_batches, fixed, self.current_plan)
        if plan is not None:
            self._state.micro_batches = sum(r.micro_batches for r in plan.replicas)
            self._state.require().switch(plan)

    def _setup_user_optimizer(self, trainer: Any, show_pipe: bool = True) -> Optimizer:
        module = self.lightning_module
        # Lazily built layers (LayerSpec) are not attributes of the user's module: show them to
        # configure_optimizers through a temporary child (a newcomer has none yet).
        if show_pipe:
            module.add_module("_resihp_pipe", self._state.require().pipe)
        try:
            self.setup_optimizers(trainer)
        finally:
            if show_pipe:
                del module._modules["_resihp_pipe"]
        if len(self.optimizers) != 1:
            raise self.misconfiguration_error(
                f"configure_optimizers returned {len(self.optimizers)} optimizers; ResiHPStrategy needs exactly one"
            )
        return self.optimizers[0]


def _join_without_fail_stop() -> bool:
    """``False``; refuses ``RESIHP_JOIN=1`` on a strategy without ``fail_stop`` (only such a job admits newcomers)."""
    if joins_from_env():
        raise ConfigError(f"{JOIN_VARIABLE}=1 (join a running job) needs ResiHPStrategy(fail_stop=...); allowed without "
                          f"it: {JOIN_VARIABLE} unset or 0")
    return False


class ResiHPStrategy(ResiHPStrategyMixin, DDPStrategy):
    """Pipeline (DeepSpeed ``PipelineEngine``, 1F1B) x data-parallel training that can be re-planned live.

    Use ``Trainer(strategy="resihp")`` or ``Trainer(strategy=ResiHPStrategy(...))`` with a
    :class:`~resihp_lightning.strategy.module.ResiHPModule`; launch as for DDP. Every rank reads the
    whole global batch of M x ``micro_batch_size`` rows and each replica trains on its own share;
    :meth:`~resihp_lightning.strategy.strategy.ResiHPStrategyMixin.request_plan` switches plans at the next step boundary. How the parts fit together, the
    data and gradient rules and fail-stop recovery: ``docs/architecture.md`` (and the README).

    Args:
        pipeline_degree: P of the initial uniform plan (default 2 when the world size is even and
            above 2, else 1).
        plan: a full initial plan instead (device ids are global ranks, or tensor-parallel groups).
        micro_batch_size: rows per micro-batch.
        micro_batches: M per global batch; default: inferred from the first training batch.
        deepspeed_config: DeepSpeed config entries over the defaults (ZeRO-1, ``bf16``,
            ``gradient_clipping``, ``pipeline.activation_checkpoint_interval``, ...).
        process_group_backend: ``"gloo"`` / ``"nccl"`` (default by device).
        timeout: collective timeout.
        gather_weights: who receives every layer's trained weights at the end of ``fit``: ``"all"``,
            ``"rank0"``, ``"none"`` or ``"auto"`` (the module's ``pipeline_gather_weights()``, else ``"all"``).
        fail_stop: in-process recovery from dead or hung ranks
            (:class:`~resihp_lightning.failstop.fail_stop_config.FailStopConfig`, ``True`` for the
            defaults; default off).
        tensor_degree: t, processes that split each layer (tensor parallelism; 1: none). Consecutive
            ranks form a group, and plans name groups (``docs/tensor_parallel.md``).
        options: all of the above as one :class:`~resihp_lightning.strategy.options.StrategyOptions` (the other arguments are then ignored).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for
            Lightning's ``DDPStrategy``.
    """
