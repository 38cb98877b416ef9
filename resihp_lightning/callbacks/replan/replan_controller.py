"""``ReplanController``: closes the loop from detected speeds to an applied plan.

At the end of a training batch, when the :class:`~resihp_lightning.callbacks.failslow.straggler_detector.StragglerDetector`'s state changed (a
rank was flagged, healed, or its speed estimate moved; the detector's state is the same on every
rank, so every rank takes this branch at the same step):

1. every rank joins ``strategy.layer_profile()`` if no healthy profile is cached yet (a profile is
   taken once the detector's warm-up and fit are over and refreshed every ``profile_interval_steps``,
   both only while no rank is flagged; the strategy's per-layer recording is paused while any rank
   is flagged, so slow devices do not inflate the costs);
2. rank 0 builds the :class:`~resihp_lightning.plan.Problem` (:func:`.replan_policy.build_problem`)
   and hands it to the planner's worker process (:class:`.background_planner.BackgroundPlanner`), so
   the solve runs off the training step; when the result is back (within ``plan_wait_s`` at this step,
   or at a later step boundary while training goes on), rank 0 prices the plan in force under the same
   speeds and decides (:func:`.replan_policy.decide`: gain vs. migration cost, hysteresis, cooldown);
   it logs ``plan_computed`` and, when it says no, ``plan_rejected``. A solve whose inputs changed
   meanwhile (the speeds moved again) is superseded by a new one;
3. at each step boundary while a solve is pending, rank 0 broadcasts the verdict or "pending"
   (``broadcast_object_list``, a few bytes) and, once there is a plan, every rank calls
   ``strategy.request_plan(plan)``; the strategy applies it at the next step boundary, after which
   ``plan_applied`` is logged with the measured migration time and bytes, and the migration cost
   model is recalibrated.

A healed device changes the speeds back, so the same path plans the job back to a healthy layout.

Under tensor parallelism (``ResiHPStrategy(tensor_degree=t)``, with ``tensor_regroup`` on and a module
that names its degrees) the problem is over processes and the planner forms the groups too
(:mod:`.tensor_regroup`): a member the detector names slow is dropped from its group, the group goes
on at a smaller degree, and the verdict carries the new groups, which every rank requests with the
plan (``request_plan(plan, tensor_groups=...)``: the layers are re-split live). The dropped member is
a device of its own from then on; when the detector sees it heal, the same path takes it back.
Fail-stop is recovered by the strategy itself (``ResiHPStrategy(fail_stop=...)``): it plans for the
survivors with the device conditions and the planner options the controller hands it at every step
(``strategy.device_conditions``), and inside the recovery the controller takes the new rank 0's state
(cooldown from the recovery on); its collectives go through ``strategy.collective``, which skips the
rest of a step that a lost rank interrupted.

Checkpoints (Lightning's ``state_dict`` / ``load_state_dict``): the controller saves the step of its
last plan change (so the cooldown carries over), the migration cost model calibrated so far (rank
0's, the rank that decides), the cached healthy layer profile, the detector version it has acted on,
and the plan it last chose with whether it was still awaited. After a resume the strategy starts
under its own initial plan; when that is not the chosen plan, the controller requests the chosen plan
again at the end of the first step (the decision was taken already, so no cooldown or gain test
applies). The ``decisions`` list is not saved (the event log keeps them).

Put the controller after the detector in ``callbacks`` (Lightning runs them in order). The strategy
must provide :class:`~resihp_lightning.contract.Replannable` (``Trainer(strategy="resihp")``); any
other strategy is refused at ``setup`` with a :class:`~resihp_lightning.errors.ConfigError` naming
what it lacks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from resihp_lightning._logging import get_logger, user_info
from resihp_lightning.callbacks.replan.background_planner import BackgroundPlanner
from resihp_lightning.callbacks.failslow.straggler_detector import StragglerDetector
from resihp_lightning.callbacks.events import EventLog
from resihp_lightning.callbacks.replan import tensor_regroup as regroup
from resihp_lightning.callbacks.replan.replan_policy import (
    ControllerConfig,
    Decision,
    MeasuredLinks,
    build_problem,
    calibrate,
    decide,
    device_conditions,
    estimate_migration_s,
    moved_mb,
    price_plan_in_force,
)
from resihp_lightning.torch_utils.collectives import all_gather_objects, broadcast_from_zero
from resihp_lightning.config import PlannerConfig, config_from_dict
from resihp_lightning.contract import MemoryGauge, Replannable, Survivable, provides, require, tensor_degree_of
from resihp_lightning.errors import ConfigError, PlanError, ResiHPError
from resihp_lightning.plan import Plan, Problem, evaluate
from resihp_lightning.solver import solve
from resihp_lightning.telemetry import LayerCost
from resihp_lightning.tensor_plan import TensorPlan, TensorProblem

log = get_logger(__name__)


class ReplanController(Callback):
    """Re-plans the job when the detector's speeds change.

    Args:
        config: controller options (:class:`~.replan_policy.ControllerConfig` or a mapping of its fields).
        planner: planner options (:class:`~resihp_lightning.config.PlannerConfig` or a mapping of its
            fields); default ``PlannerConfig()``. Its ``shared_partition=None`` plans per-replica
            partitions when the strategy can run them. A fail-stop recovery plans the survivors
            under these options too (with ``fail_stop.solver`` as the backend).
        events: the event log; default ``<trainer.log_dir>/events.jsonl``.
        log_dir: where to put the default event log instead of the trainer's log directory.

    Raises:
        ConfigError: an unknown option (a moved one, e.g. ``controller.shared_partition``, says where it
            lives now).
    """

    def __init__(
        self,
        config: ControllerConfig | Mapping[str, Any] | None = None,
        *,
        planner: PlannerConfig | Mapping[str, Any] | None = None,
        events: EventLog | None = None,
        log_dir: str | None = None,
    ) -> None:
        self.config = ControllerConfig() if config is None else ControllerConfig.from_dict(config)
        self.planner = PlannerConfig() if planner is None else config_from_dict(PlannerConfig, planner, "planner")
        self.events = events
        self.log_dir = log_dir
        self.rank = 0
        self.detector: StragglerDetector | None = None
        self.decisions: list[Decision] = []
        self._seen_version = 0
        self._profile: list[LayerCost] | None = None
        self._memory: dict[int, float] | None = None  # per-device budget (memory_mb "auto"), with the profile
        self._retry_at: int | None = None  # solve again at this step (a plan held back only by the cooldown)
        self._healthy_logged = False  # rank 0 logged healthy_reference (the best plan for healthy devices)
        self._last_change_step: int | None = None
        self._chosen: Plan | None = None  # the last plan requested (applied or not)
        self._awaiting: Plan | None = None  # requested, not applied yet
        self._restore: Plan | None = None  # from a checkpoint: to put back in force after the first step
        self._overhead_s = self.config.migration_overhead_s
        self._bandwidth = self.config.migration_bandwidth_mb_s
        self._inflight = False  # a solve was started and its verdict not broadcast yet (every rank knows)
        self._planner: BackgroundPlanner | None = None  # rank 0's worker process
        self._problem: Problem | None = None  # rank 0: what the pending solve answers
        self._survivable = False  # the strategy recovers from lost ranks (it takes the device conditions)
        # Under tensor parallelism with tensor_regroup: the job's degree t, the degrees the module splits
        # over, the layers' one-GPU costs and f_t (from the last profile taken on groups of one degree).
        self._tensor_degree = 1
        self._degrees: tuple[int, ...] = ()
        self._gpu_profile: list[LayerCost] | None = None
        self._gpu_fraction = 0.0

    # ---------------------------------------------------------------------------- callbacks
    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        require(trainer.strategy, Replannable, "ReplanController")
        self.rank = trainer.global_rank
        detectors = [i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, StragglerDetector)]
        mine = next(i for i, cb in enumerate(trainer.callbacks) if cb is self)
        if not detectors:
            raise ConfigError("ReplanController needs a StragglerDetector in Trainer(callbacks=[...])")
        if detectors[0] > mine:
            raise ConfigError("put the StragglerDetector before the ReplanController in Trainer(callbacks=[...])")
        self.detector = trainer.callbacks[detectors[0]]
        if self.events is None:
            self.events = self.detector.events or EventLog(
                Path(self.log_dir or trainer.log_dir or trainer.default_root_dir), rank=self.rank)
        self._step = lambda: trainer.global_step
        if self.rank == 0 and self._planner is None:
            self._planner = BackgroundPlanner()  # its start-up overlaps the detector's warm-up
        self._survivable = provides(trainer.strategy, Survivable)
        self._tensor_degree, self._degrees = 1, ()
        if self.config.tensor_regroup and tensor_degree_of(trainer.strategy) > 1:
            named = getattr(pl_module, "pipeline_tensor_parallel_degrees", lambda: None)()
            t = tensor_degree_of(trainer.strategy)
            wanted = self.config.tensor_degrees
            if wanted is not None and t not in wanted:
                raise ConfigError(f"controller.tensor_degrees {list(wanted)} must hold the job's tensor_degree {t}")
            if named and t in named:
                self._tensor_degree = t
                self._degrees = tuple(sorted(k for k in named if k <= t and (wanted is None or k in wanted)))
            else:
                user_info("ReplanController: tensor-parallel groups stay as they are (the module does not name the "
                          "degrees its layers split over: pipeline_tensor_parallel_degrees)")
        if self._survivable and self._resync not in trainer.strategy.recovery_listeners:
            trainer.strategy.recovery_listeners.append(self._resync)

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._planner is not None:
            self._planner.close()
            self._planner = None
        self._inflight = False

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy: Replannable = trainer.strategy
        self.rank = trainer.global_rank  # it changes when lost ranks' survivors regroup
        if self.events is not None:
            self.events.rank = self.rank
        if self.detector is None:
            return  # setup did not run
        if self._survivable:  # a recovery plans the survivors with what is known now, under these planner options
            strategy.device_conditions = device_conditions(self.detector.speeds, self._measured_links(), self.config,
                                                           self.planner)
        if strategy.collectives_interrupted:
            return  # the survivors of a lost rank meet again at the next step
        step = trainer.global_step
        self._note_applied(strategy, step)
        self._put_back_chosen(strategy, step)
        flagged = bool(self.detector.flagged)
        strategy.profiler_recording = not flagged
        interval = self.config.profile_interval_steps
        first = self.detector.config.warmup_steps + self.detector.config.fit_steps
        due = (self._profile is None and step >= first) or (interval and step > 0 and step % interval == 0)
        if due and not flagged:
            if not self._take_profile(strategy):  # at the same step on every rank
                return
        wait = 0.0
        retry = self._retry_at is not None and step >= self._retry_at
        if self.detector.version != self._seen_version or retry:
            self._seen_version = self.detector.version
            self._retry_at = None
            if self._profile is None and not self._take_profile(strategy):
                return
            if self.rank == 0:
                self._submit(trainer, step)
            self._inflight, wait = True, self.config.plan_wait_s
        if not self._inflight:
            return
        verdict = self._collect_on_rank0(trainer, step, wait) if self.rank == 0 else None
        done, message = strategy.collective(lambda: broadcast_from_zero(verdict))
        if not done or message == _PENDING:
            return
        self._inflight = False
        if message is None:
            return
        if "retry_at" in message:  # held back only by the cooldown: every rank solves again then
            self._retry_at = int(message["retry_at"])
            return
        plan = Plan.from_dict(message["plan"] if "plan" in message else message)
        groups = message.get("tensor_groups")
        try:
            if groups is not None:
                strategy.request_plan(plan, tensor_groups=groups)
            else:
                strategy.request_plan(plan)
        except (PlanError, ConfigError) as err:
            self._log("plan_rejected", step, reason=f"strategy refused the plan: {err}", plan=plan)
            return
        self._chosen = self._awaiting = plan
        self._last_change_step = step

    # -------------------------------------------------------------------------- checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        """Cooldown, migration cost model, layer profile and chosen plan, as plain data."""
        return {
            "last_change_step": self._last_change_step,
            "seen_version": -1 if self._inflight else self._seen_version,  # a pending solve is redone
            "migration_overhead_s": self._overhead_s,
            "migration_bandwidth_mb_s": self._bandwidth,
            "profile": None if self._profile is None else [dataclasses.asdict(cost) for cost in self._profile],
            "chosen": None if self._chosen is None else self._chosen.to_dict(),
            "awaiting": self._awaiting is not None,
            "retry_at": self._retry_at,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s state; the chosen plan is put back after the first step."""
        profile = state_dict["profile"]
        chosen = state_dict["chosen"]
        self._last_change_step = state_dict["last_change_step"]
        self._seen_version = state_dict["seen_version"]
        self._overhead_s = state_dict["migration_overhead_s"]
        self._bandwidth = state_dict["migration_bandwidth_mb_s"]
        self._profile = None if profile is None else [LayerCost(**cost) for cost in profile]
        self._chosen = None if chosen is None else Plan.from_dict(chosen)
        self._awaiting = self._chosen if state_dict["awaiting"] else None
        self._restore = self._chosen
        self._retry_at = state_dict.get("retry_at")  # absent in checkpoints from before the retry

    def _resync(self) -> None:
        """Inside a fail-stop recovery: every survivor takes the new rank 0's decision state.

        The survivors run the plan the recovery chose (with the slow devices and links known, from
        ``strategy.device_conditions``), so no chosen plan is awaited or put back, and the recovery
        counts as a plan change for the cooldown.
        """
        import torch.distributed as dist

        self.load_state_dict(broadcast_from_zero(self.state_dict() if dist.get_rank() == 0 else None))
        self._chosen = self._awaiting = self._restore = None
        self._last_change_step = self._step()
        self._inflight = False

    # ---------------------------------------------------------------------------- internals
    def _put_back_chosen(self, strategy: Replannable, step: int) -> None:
        """After a resume, requests the chosen plan again when the strategy runs another one.

        Done at the end of the first step rather than at ``on_train_start``: by then the strategy has
        settled M from the first batch.
        """
        if self._restore is None:
            return
        plan, self._restore = self._restore, None
        if plan.layout_key() == strategy.current_plan.layout_key():
            self._awaiting = None
            return
        try:
            strategy.request_plan(plan)
        except PlanError as err:
            self._log("plan_rejected", step, reason=f"the plan chosen before the resume does not fit this job: {err}",
                      plan=plan)
            self._chosen = self._awaiting = None
            self._seen_version = -1  # plan afresh for the job as it is now
            return
        self._awaiting = plan
        user_info(f"re-planning at step {step}: putting back the plan chosen before the resume")

    def _take_profile(self, strategy: Replannable) -> bool:
        """Measures the layer costs and, with ``memory_mb="auto"``, every device's memory budget (one
        collective round at the same step on every rank). Returns whether it ran (not interrupted)."""
        gauge = self.config.memory_mb == "auto" and provides(strategy, MemoryGauge)
        device = strategy.last_step_stats.rank if strategy.last_step_stats is not None else strategy.global_rank
        if self._tensor_degree > 1:
            device = strategy.global_rank  # the planner groups processes: a budget per process

        def measure() -> tuple[list[LayerCost], list[Any] | None]:
            profile = strategy.layer_profile()
            return profile, all_gather_objects((device, strategy.device_memory_mb())) if gauge else None

        done, result = strategy.collective(measure)
        if done:
            self._profile = result[0]
            self._memory = dict(result[1]) if result[1] is not None else None
            if self._tensor_degree > 1:
                self._note_gpu_profile()
            if self.rank == 0 and not self._healthy_logged:
                self._healthy_logged = True
                self._log_healthy_reference(strategy)
        return done

    def _log_healthy_reference(self, strategy: Replannable) -> None:
        """Rank 0, with the first healthy profile: the planner's best plan for these devices all healthy and
        the plan in force, both priced on that problem (``healthy_reference``). A report compares a re-plan
        with the best healthy plan, which the job may never have run (e.g. it started 2 x 2 and 1 x 4 has
        no pipeline bubble). Solved here, once, within ``min(time_limit_s, 2 s)``."""
        current: Plan = strategy.current_plan
        micro = strategy.micro_batches or sum(r.micro_batches for r in current.replicas)
        links = dataclasses.replace(self._measured_links(), speeds={})
        step = self._step()
        try:
            problem = build_problem(self._profile, {}, current.device_ids, micro, self.config, self.planner,
                                    per_replica_bounds=strategy.supports_per_replica_bounds, links=links,
                                    memory_mb=self._memory)
            best = solve(problem, dataclasses.replace(self.planner, time_limit_s=min(self.planner.time_limit_s, 2.0)))
            current_ms = evaluate(problem, current, check=False).iteration_ms
        except (ResiHPError, ValueError) as err:
            log.info("no healthy reference at step %d: %s", step, err)
            return
        self._log("healthy_reference", step, plan=best, predicted_ms=best.iteration_ms, current_plan=current,
                  current_ms=current_ms)

    def _note_gpu_profile(self) -> None:
        """Under TP regrouping: the profile's one-GPU layer costs and f_k, when its groups share one degree k
        (a profile of mixed degrees keeps the last conversion)."""
        layout = self.detector.tensor_groups
        degrees = {len(ranks) for ranks in layout.values()}
        if len(degrees) != 1:
            return
        degree = degrees.pop()
        t, configured = self._tensor_degree, self.config.tensor_comm_fraction
        if configured is not None:  # f_k of the profile's degree, scaled from the configured f_t
            self._gpu_fraction = configured
            known = regroup.tensor_cost(self._degrees, t, configured).fraction(degree) if degree in self._degrees else 0.0
            self._gpu_profile, _ = regroup.one_gpu_costs(self._profile, degree, None, known)
            return
        samples = [(s.own_ms, s.wait_ms) for s in self.detector.last_members if len(layout.get(s.group, ())) > 1]
        share = regroup.own_share(samples)
        if degree > 1 and share is None and self._gpu_profile is not None:
            return
        self._gpu_profile, fraction = regroup.one_gpu_costs(self._profile, degree, share)
        if degree > 1 and share is not None:  # f_t of the job's degree, scaled from the measured f_k
            self._gpu_fraction = regroup.tensor_cost(self._degrees, degree, fraction).fraction(t)

    def _tensor_problem(self, strategy: Replannable, micro: int) -> TensorProblem | None:
        """Rank 0, under TP regrouping: the problem over processes for the speeds now (``None``: nothing known
        of the groups yet)."""
        layout = self.detector.tensor_groups
        processes = self.detector.process_ids
        if not layout or self._gpu_profile is None:
            return None
        speeds = regroup.process_speeds(layout, processes, self.detector.speeds, self.detector.member_speeds)
        base = build_problem(self._gpu_profile, speeds, sorted(processes), micro, self.config, self.planner,
                             per_replica_bounds=strategy.supports_per_replica_bounds, links=self._measured_links(),
                             memory_mb=self._memory)
        cost = regroup.tensor_cost(self._degrees, self._tensor_degree, self._gpu_fraction)
        return regroup.tensor_problem(base, regroup.domains(processes, self._tensor_degree), cost)

    def _submit(self, trainer: Any, step: int) -> None:
        """Rank 0: builds the problem for the speeds now and starts solving it in the background."""
        strategy: Replannable = trainer.strategy
        current: Plan = strategy.current_plan
        # Hot spares: plan over every live process, and let the plan leave slow ones idle.
        idle = strategy.supports_idle_devices
        ranks = sorted(strategy.devices_alive) if idle else sorted(current.device_ids)
        micro = strategy.micro_batches or sum(r.micro_batches for r in current.replicas)
        self._problem = None
        try:
            if self._tensor_degree > 1:
                self._problem = self._tensor_problem(strategy, micro)
            if self._problem is None:
                self._problem = build_problem(self._profile, self.detector.speeds, ranks, micro, self.config,
                                              self.planner, per_replica_bounds=strategy.supports_per_replica_bounds,
                                              allow_exclude=idle, links=self._measured_links(), memory_mb=self._memory)
        except ResiHPError as err:
            self._log("plan_rejected", step, reason=f"planner failed: {err}")
            return
        if self._planner is None:  # this rank became rank 0 in a regroup
            self._planner = BackgroundPlanner()
        self._planner.submit(self._problem, self.planner, tag=dict(self.detector.speeds))

    def _collect_on_rank0(self, trainer: Any, step: int, wait_s: float) -> Any:
        """Rank 0: the verdict to broadcast: ``_PENDING``, a plan dict to apply, ``{"retry_at": step}``, or
        ``None`` (no change)."""
        if self._problem is None or self._planner is None or not self._planner.busy:
            return None
        done, speeds, result = self._planner.poll(wait_s)
        if not done:
            return _PENDING
        if isinstance(result, BaseException):
            # Keep training under the plan in force; the log keeps what went wrong.
            if isinstance(result, ResiHPError):
                self._log("plan_rejected", step, reason=f"planner failed: {result}")
            else:
                log.error("planner raised at step %d; keeping the plan in force: %r", step, result)
                self._log("plan_rejected", step, reason=f"planner error: {type(result).__name__}: {result}")
            return None
        if isinstance(result, TensorPlan):
            return self._decide_groups(trainer, step, self._problem, result, speeds)
        return self._decide(trainer, step, self._problem, result, speeds)

    def _decide_groups(self, trainer: Any, step: int, problem: TensorProblem, result: TensorPlan,
                       speeds: dict[int, float]) -> dict[str, Any] | None:
        """Rank 0, under TP regrouping: :meth:`_decide` for a plan that may form other groups; the verdict
        carries the groups (ranks) with the plan (over their indices)."""
        strategy: Replannable = trainer.strategy
        current: Plan = strategy.current_plan
        layout = self.detector.tensor_groups
        plan, groups = regroup.strategy_plan(result)
        in_force = [list(g.members) for g in regroup.groups_in_force(layout)]
        member_speeds = self.detector.member_speeds
        self._log("plan_computed", step, plan=plan, tensor_groups=groups, predicted_ms=result.iteration_ms,
                  solve_seconds=result.solve_seconds, status=result.status,
                  speeds={d.id: d.speed for d in problem.problem.devices if d.speed != 1.0},
                  member_speeds=member_speeds, p2p_ms=problem.problem.p2p_ms,
                  allreduce_ms=problem.problem.allreduce_ms)
        over = evaluate(problem.group_problem(result.groups), result.plan, check=False).over_memory
        if over:
            _, _, device, used, capacity = over[0]
            self._log("plan_rejected", step, reason=f"group {device} would need {used:.0f} MB of its {capacity:.0f} MB",
                      predicted_ms=result.iteration_ms)
            return None
        current_ms, breaks = regroup.price_in_force(problem, layout, current)
        static = [layer.static_mb for layer in problem.problem.layers]
        same_groups = groups == in_force
        moved = moved_mb(current, plan, static) if same_groups else regroup.regroup_moved_mb(layout, groups, plan, static)
        migration = self._overhead_s + moved / self._bandwidth
        decision, held = self._judge(trainer, step, current_ms, result.iteration_ms, migration,
                                     same_groups and plan.layout_key() == current.layout_key(), breaks)
        if not decision.apply:
            return held
        change = "" if same_groups else f" with tensor-parallel groups {groups} (were {in_force})"
        user_info(f"re-planning at step {step}{change}: {decision.reason}")
        return {"plan": plan.to_dict()} if same_groups else {"plan": plan.to_dict(), "tensor_groups": groups}

    def _decide(self, trainer: Any, step: int, problem: Any, plan: Plan, speeds: dict[int, float]) -> dict[str, Any] | None:
        """Rank 0: prices the plan in force and the new one under the same speeds; the plan dict to apply,
        ``{"retry_at": step}`` when only the cooldown held it back, or None."""
        strategy: Replannable = trainer.strategy
        current: Plan = strategy.current_plan
        self._log("plan_computed", step, plan=plan, predicted_ms=plan.iteration_ms,
                  solve_seconds=plan.solve_seconds, status=plan.status,
                  speeds={r: s for r, s in speeds.items() if s != 1.0},
                  link_speeds={d.id: d.link_speed for d in problem.devices if d.link_speed != 1.0},
                  p2p_ms=problem.p2p_ms, allreduce_ms=problem.allreduce_ms)
        over = evaluate(problem, plan, check=False).over_memory
        if over:  # the solvers respect memory; a plan that does not fit is never requested all the same
            _, _, device, used, capacity = over[0]
            self._log("plan_rejected", step, reason=f"device {device} would need {used:.0f} MB of its {capacity:.0f} MB",
                      predicted_ms=plan.iteration_ms)
            return None
        current_ms, breaks = price_plan_in_force(problem, current)
        static = [layer.static_mb for layer in problem.layers]
        migration = estimate_migration_s(current, plan, static, overhead_s=self._overhead_s,
                                         bandwidth_mb_s=self._bandwidth)
        decision, held = self._judge(trainer, step, current_ms, plan.iteration_ms, migration,
                                     plan.layout_key() == current.layout_key(), breaks)
        if not decision.apply:
            return held
        user_info(f"re-planning at step {step}: {decision.reason}")
        return {"plan": plan.to_dict()}

    def _judge(self, trainer: Any, step: int, current_ms: float, new_ms: float, migration_s: float, same_plan: bool,
               breaks: str | None) -> tuple[Decision, dict[str, Any] | None]:
        """Rank 0: :func:`~.replan_policy.decide` on a computed plan, recorded; a rejection is logged, and comes
        with the verdict to broadcast (``{"retry_at": step}`` when only the cooldown held it back, else None)."""
        since = None if self._last_change_step is None else step - self._last_change_step
        decision = decide(current_ms, new_ms, same_plan=same_plan, remaining_steps=self._remaining(trainer, step),
                          migration_s=migration_s, steps_since_change=since, config=self.config,
                          current_breaks=breaks)
        self.decisions.append(decision)
        if decision.apply:
            return decision, None
        self._log("plan_rejected", step, reason=decision.reason, predicted_ms=new_ms, current_ms=current_ms)
        return decision, None if decision.retry_after_steps is None else {"retry_at": step + decision.retry_after_steps}

    def _note_applied(self, strategy: Replannable, step: int) -> None:
        if self._awaiting is None:
            return
        record = strategy.last_migration
        if record is None:
            return
        plan = record.plan
        if plan.layout_key() != self._awaiting.layout_key():
            return
        self._awaiting = None
        seconds, moved = record.seconds, float(record.bytes_moved)
        self._log("plan_applied", step, plan=plan, migration_seconds=seconds, bytes_moved=int(moved))
        self._overhead_s, self._bandwidth = calibrate(seconds, moved / 2**20, self._overhead_s, self._bandwidth)

    def _measured_links(self) -> MeasuredLinks:
        return MeasuredLinks(self.detector.link_speeds, self.detector.p2p_ms, self.detector.allreduce_ms)

    def _remaining(self, trainer: Any, step: int) -> int:
        max_steps = trainer.max_steps
        if max_steps is not None and max_steps > 0:
            return max(max_steps - step, 0)
        return self.config.horizon_steps

    def _log(self, event: str, step: int, **fields: Any) -> None:
        if self.rank == 0 and self.events is not None:
            self.events.log(event, step, **fields)


#: What rank 0 broadcasts while the background solve is still running.
_PENDING = "pending"
