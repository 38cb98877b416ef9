"""``SurvivingJob``: the strategy's side of fail-stop recovery, one object for the job's lifetime.

It owns the :class:`~resihp_lightning.resilience.world.ElasticWorld` (the job's process groups,
generation by generation), the optimizer step's :class:`~.step_commit.StepCommit` vote, and the
recovery itself: regroup the survivors, re-initialise ``deepspeed.comm`` on the new group, plan for
the survivors, and let the :class:`~resihp_lightning.runtime.pipeline_runtime.PipelineRuntime` restore the layers each survivor now
needs. The strategy wraps each training step in :meth:`SurvivingJob.run_step` (a step that lost a
peer before its commit point is redone) and each collective after the commit point in
``ResiHPStrategy.collective`` (skipped after a recovery: the survivors meet again at the next step).

Plans may leave live processes idle (:mod:`~.spares`): :meth:`SurvivingJob.reshape` changes the
members at a step boundary (taking spares back, leaving devices out), and a recovery regroups every
live process of the job, spares included, and then leaves out whom the survivors' plan does not use.

Processes started after the job began join it (:mod:`~.admission`): built with ``join``, a
``SurvivingJob`` claims a rank and waits to be admitted (:meth:`SurvivingJob.await_admission`); the
members admit newcomers at a step boundary (:meth:`SurvivingJob.admit_newcomers`) and plan for every
live process (:meth:`SurvivingJob.plan_for_job`).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn, TypeVar

from resihp_lightning._logging import get_logger
from resihp_lightning.contract import DeviceConditions, MigrationRecord
from resihp_lightning.errors import ConfigError, PlanError
from resihp_lightning.placement import lost_layers
from resihp_lightning.plan import Plan
from resihp_lightning.resilience.failures import PeerFailure, ResilienceError, StoreUnavailable
from resihp_lightning.resilience.joining import announce_ready, wait_admission
from resihp_lightning.resilience.world import ElasticWorld
from resihp_lightning.runtime.device_memory import memory_budget_mb
from resihp_lightning.runtime.engine import init_deepspeed_comm
from resihp_lightning.failstop.admission import AdmissionRecord, Admissions, Admitted, newcomer_counter, newcomer_info
from resihp_lightning.failstop.fail_stop_config import FailStopConfig
from resihp_lightning.failstop.recovery_record import RecoveryClock, RecoveryRecord
from resihp_lightning.failstop.step_commit import StepCommit
from resihp_lightning.failstop.survivor_plan import survivor_plan, tensor_survivor_conditions
from resihp_lightning.runtime.pipeline_runtime import PipelineRuntime
from resihp_lightning.failstop.spares import CallMirror
from resihp_lightning.tensor.resplit import lost_parts, surviving_groups
from resihp_lightning.tensor.tensor_groups import TensorGroups, tensor_parallelism

log = get_logger(__name__)

T = TypeVar("T")

_open_jobs: list[SurvivingJob] = []


def _leaving_by_exception() -> bool:
    """Whether the interpreter is ending because of an unhandled exception (it sets ``sys.last_value``
    before the exit handlers run)."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def close_open_jobs() -> None:
    """Closes every open :class:`SurvivingJob` of this process, as the interpreter's exit does.

    For a harness whose processes end with ``os._exit`` (no exit handlers): it calls this where a real
    process would exit normally, so that the job's end is what it is outside tests.
    """
    for job in list(_open_jobs):
        job.close()


class SurvivingJob:
    """The job's groups and their recovery (see the module docstring).

    Building one is collective: every process of the job forms generation 0 together. A process that
    joins a running job (``join``) only claims its rank and starts beating; it takes its place with
    :meth:`await_admission`.

    Args:
        config: the strategy's ``fail_stop`` options.
        rank: this process's global rank at start (its device id for the job's lifetime; ignored with ``join``).
        world_size: the number of processes at start (ignored with ``join``).
        backend: ``"gloo"`` or ``"nccl"``.
        collective_timeout_s: the strategy's collective timeout.
        node_rank: this machine's index (the store host runs on node 0 when the port is fixed).
        join: this process joins the running job as a newcomer.
        admit_newcomers: whether the job admits newcomers (it needs hot spares: the layer-wise engine, no
            tensor parallelism); the commit vote then counts them.
    """

    def __init__(
        self, config: FailStopConfig, rank: int | None, world_size: int | None, backend: str, collective_timeout_s: float,
        node_rank: int = 0, join: bool = False, admit_newcomers: bool = True,
    ) -> None:
        self.config = config
        self.backend = backend
        world_config = config.world_config(backend, collective_timeout_s, node_rank)
        if join:
            self.world = ElasticWorld(world_config, join=True).join(config.admission_timeout_s)
        else:
            self.world = ElasticWorld(world_config, rank=rank, world_size=world_size).start()
        self.commit = StepCommit(self.world, newcomer_counter(self.world) if admit_newcomers else None)
        self.admissions = Admissions(self.world, self.commit)
        self.mirror = CallMirror(self.world)
        #: A newcomer's ``time.monotonic()`` when it registered as ready and when it was admitted.
        self.admission_clock: dict[str, float] = {}
        self.last_recovery: RecoveryRecord | None = None
        #: Called as ``listener(event, fields)`` before the process exits unrecoverably (event logs).
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        #: Called on every survivor inside each recovery, after the runtime is rebuilt (state resync).
        self.recovery_listeners: list[Callable[[], None]] = []
        self._redo_pending = False
        self._finished: tuple[int, Any] | None = None  # (call, result) committed before the last recovery
        self._closed = False
        #: Whether the last trainer call ended cleanly (no exception): then the process says goodbye at its exit.
        self.ended_cleanly = False
        _open_jobs.append(self)
        atexit.register(self.close)

    # ------------------------------------------------------------------------------- views
    @property
    def device_id(self) -> int:
        return self.world.original_rank

    @property
    def rank(self) -> int:
        """Rank in the current group; a spare's is after the members' (it has no group); a newcomer not
        admitted yet answers its claimed rank (above every rank of the job: never rank 0)."""
        world = self.world
        if not world.admitted:
            return world.original_rank
        if world.is_member:
            return world.rank
        return world.world_size + world.spares.index(world.original_rank)

    @property
    def world_size(self) -> int:
        """Live processes of the job, members and spares (a newcomer not admitted yet: itself)."""
        if not self.world.admitted:
            return 1
        return self.world.world_size + len(self.world.spares)

    @property
    def is_spare(self) -> bool:
        """Whether the plan in force leaves this process idle (see :mod:`~.spares`)."""
        return not self.world.is_member

    @property
    def members(self) -> tuple[int, ...]:
        """Device ids of the current group's processes (those the plan in force uses), in rank order."""
        return tuple(self.world.members)

    @property
    def spares(self) -> tuple[int, ...]:
        """Device ids of live processes the plan in force leaves idle."""
        return tuple(self.world.spares)

    @property
    def job_members(self) -> tuple[int, ...]:
        """Device ids of every live process of the job, members and spares."""
        return tuple(self.world.job_members)

    def rank_map(self) -> dict[int, int]:
        """Device id -> rank in the current default group."""
        return {d: self.world.rank_of(d) for d in self.world.members}

    # ---------------------------------------------------------------------------- running
    def run_step(self, attempt: Callable[[], T], recover: Callable[[PeerFailure], None]) -> T:
        """Runs ``attempt`` (one training step); on a lost peer, ``recover`` and run it again.

        A store lost inside the step (the commit vote goes through it: an etcd cluster without its quorum,
        or this process cut off from it) ends the process with ``config.exit_code``, as a lost store does
        in a recovery: no step can be committed on every survivor without it.
        """
        while True:
            started = time.monotonic()
            try:
                with self.world.guard():
                    result = attempt()
            except PeerFailure as failure:
                recover(failure)
                self._redo_pending = True
                continue
            except StoreUnavailable as err:
                step = self.world.detector.step if self.world.detector is not None else -1
                self.unrecoverable(step, f"the store is lost: {err}")
            if self._redo_pending and self.last_recovery is not None:
                self.last_recovery = replace(self.last_recovery, redo_s=time.monotonic() - started)
            self._redo_pending = False
            return result

    def progress(self, step: int) -> None:
        """Tells the peers' hang check that this process finished ``step``."""
        self.world.progress(step)

    def close(self) -> None:
        """Leaves the job's groups and tells the store host this process is done (once; at exit by default).

        A process whose last trainer call ended cleanly (:attr:`ended_cleanly`) and that is not leaving by an
        unhandled exception says goodbye first: its peers do not call its exit a failure (see
        ``docs/fail_stop.md``, the end of training). Any other exit is a failure to its peers.
        """
        if not self._closed:
            self._closed = True
            if self in _open_jobs:
                _open_jobs.remove(self)
            self.world.close(goodbye=self.ended_cleanly and not _leaving_by_exception())

    # ---------------------------------------------------------------------------- recovery
    def recover(
        self,
        failure: PeerFailure,
        runtime: PipelineRuntime,
        micro_batches: int,
        step: int,
        on_regrouped: Callable[[], None],
        finished: tuple[int, Any] | None = None,
        conditions: DeviceConditions | None = None,
    ) -> MigrationRecord:
        """Regroups the survivors, plans for them and restores the layers each one now needs.

        Collective over the survivors. Ends the process with ``config.exit_code`` when the job
        cannot go on in-process (no regroup, a layer lost with all its holders, a wrapped optimizer).

        Args:
            failure: what the step raised.
            runtime: this process's runtime (its engine is abandoned, its layers kept).
            micro_batches: M of the job (the survivors' plan deals all of it out).
            step: the interrupted training step.
            on_regrouped: called once the new group exists (the strategy re-points Lightning's ranks).
            finished: ``(call, result)``: the strategy call that was interrupted, and its result when
                this process already committed it (a failure in a collective after the update; else
                ``None``). The survivors take it from a member of the old group (:meth:`take_finished`):
                a spare taken in must not redo a step the members completed.
            conditions: the slow devices and links known before the failure (``strategy.device_conditions``);
                the new rank 0's are used for the plan.
        """
        world = self.world
        before, held_by, aborted_at = world.job_processes, self.members, world.current.aborted_at
        clock = RecoveryClock()
        try:
            world.regroup()  # every live process of the job, spares included
        except ResilienceError as err:
            self.unrecoverable(step, f"the survivors could not regroup: {err}")
        self._regrouped(on_regrouped)
        clock.mark("regroup")
        members = self.members
        self._agree_old_plan(runtime, held_by, finished)
        tensor = runtime.config.tensor
        if tensor is None:
            lost = lost_layers(runtime.plan, members)
        else:  # a layer is lost when some part of its split tensors has no live holder
            lost = lost_parts(tensor.groups, runtime.plan, set(members))
        if lost:
            self.unrecoverable(step, f"layers {lost} had no live holder (every replica holding them failed)")
        conditions = conditions or DeviceConditions()
        groups = surviving_groups(tensor.groups, set(members)) if tensor is not None else None
        plan = self._agree_plan(runtime, members, micro_batches, conditions, groups)
        clock.mark("plan")
        try:
            if tensor is None:
                record = runtime.recover(plan, self.rank_map(), between=lambda: self._leave_out_idle(plan, on_regrouped))
            else:
                ranks = self.rank_map()
                made = tensor_parallelism(groups.relabelled(ranks), self.world.rank, tensor.split_layer)
                record = runtime.recover_tensor(replace(made, groups=groups), plan, ranks)
        except (PlanError, ConfigError) as err:
            self.unrecoverable(step, str(err))
        clock.mark("restore")
        self.mirror.forget_published_plan()
        if not self.is_spare:
            for listener in self.recovery_listeners:
                listener()
        known = {r: f for r, f in world.detector.failed.items() if r in before and r not in members}
        self.last_recovery = RecoveryRecord(
            step=step,
            generation=world.generation,
            failed={r: known[r].reason if r in known else "left out" for r in before if r not in members},
            members=self.members,
            spares=self.spares,
            plan=plan,
            detected_at=min((f.at for f in known.values()), default=aborted_at or clock.started),
            aborted_at=aborted_at or clock.started,
            regroup_s=clock.marks["regroup"],
            plan_s=clock.marks["plan"],
            restore_s=clock.marks["restore"],
            bytes_moved=record.bytes_moved,
            conditions=conditions,
        )
        log.warning("recovered from %s at step %d: %d survivors under %s", failure, step, len(members), plan.layout_key())
        return record

    def reshape(
        self,
        runtime: PipelineRuntime,
        plan: Plan,
        on_regrouped: Callable[[], None],
        include: tuple[int, ...] = (),
        during: Callable[[], None] | None = None,
    ) -> MigrationRecord | None:
        """Puts ``plan`` in force when it uses other devices than the current members (collective
        over the whole job: every live process calls it at the same step boundary).

        The members stop their engine; the group grows to everyone who holds or will hold a layer
        (and ``include``); the layers move; ``during`` runs on that group (e.g. a weight sync); the
        group shrinks to ``plan``'s devices, whose engine is built. Processes outside ``plan`` end as
        spares. A member that fails meanwhile surfaces as ``PeerFailure`` (the caller recovers).

        Returns:
            The migration record, on processes that took part in the transfer (else ``None``).
        """
        world = self.world
        target = tuple(sorted(plan.device_ids))
        union = tuple(sorted(set(world.members) | set(target) | set(include)))
        captured = runtime.release()
        if union != world.members:
            world.reshape(union)
            self._regrouped(on_regrouped)
        record = None
        if world.is_member:

            def between() -> dict[int, int] | None:
                if during is not None:
                    during()
                return self._leave_out_idle(plan, on_regrouped)

            record = runtime.relocate(plan, captured, self.rank_map(), between)
        else:
            if target != world.members:
                world.reshape(target)
            runtime.follow(plan)
        self.mirror.forget_published_plan()
        if world.is_member:
            for listener in self.recovery_listeners:
                listener()
        return record

    def _leave_out_idle(self, plan: Plan, on_regrouped: Callable[[], None]) -> dict[int, int] | None:
        """Shrinks the group to ``plan``'s devices when it has others; the new rank map (``None`` on a spare)."""
        target = tuple(sorted(plan.device_ids))
        if target != self.members:
            self.world.reshape(target)
            self._regrouped(on_regrouped)
        return self.rank_map() if not self.is_spare else None

    def _regrouped(self, on_regrouped: Callable[[], None]) -> None:
        if not self.is_spare:
            init_deepspeed_comm(self.backend)
        on_regrouped()

    def _agree_old_plan(self, runtime: PipelineRuntime, held_by: tuple[int, ...], finished: tuple[int, Any] | None) -> None:
        """Every process of the new group takes the plan in force, and whether the interrupted call was
        already committed, from a surviving member of the old group (a spare's copy of the plan may lag
        the members' last switch), so that all compute the same transfers and redo the same step."""
        import torch.distributed as dist

        holders = [d for d in self.members if d in held_by]
        source = holders[0] if holders else self.members[0]
        mine = {"plan": runtime.plan.to_dict(), "finished": finished, "admissions": self.admissions.state()}
        box: list[Any] = [mine if self.device_id == source else None]
        dist.broadcast_object_list(box, src=self.world.rank_of(source))
        plan = Plan.from_dict(box[0]["plan"])
        if runtime.idle and plan.layout_key() != runtime.plan.layout_key():
            runtime.follow(plan)
        # Which newcomers are admitted: a spare may have missed the record of the last admission, and a
        # spare taken in did not vote on the last commit.
        self.admissions.adopt(box[0]["admissions"])
        agreed = box[0]["finished"]
        self._finished = (agreed[0], agreed[1]) if agreed is not None and agreed[1] is not None else None

    def take_finished(self, call: int) -> Any:
        """The result of ``call`` when the last recovery found it committed by the members (once), else None."""
        if self._finished is None or self._finished[0] != call:
            return None
        result, self._finished = self._finished[1], None
        return result

    # ---------------------------------------------------------------------------- newcomers
    def await_admission(self, memory_mb: float | None) -> AdmissionRecord:
        """A newcomer: registers as ready and waits until the members admit it (bounded by
        ``fail_stop.admission_timeout_s``); then it is a spare of the job's current generation.

        Args:
            memory_mb: this process's memory budget (the members plan with it).

        Raises:
            AdmissionError: no member admitted it in time.
            StoreUnavailable: the store was lost meanwhile.
        """
        world = self.world
        store = world.store.control

        def check() -> None:
            if world.detector is not None and world.detector.store_lost:
                raise StoreUnavailable("the rendezvous store was lost while this newcomer waited to be admitted")

        self.admission_clock["registered"] = time.monotonic()
        announce_ready(store, world.original_rank, newcomer_info(memory_mb))
        record = AdmissionRecord.from_bytes(
            wait_admission(store, world.original_rank, self.config.admission_timeout_s, check=check)
        )
        self.admission_clock["admitted"] = time.monotonic()
        world.enter(record.generation, record.members, record.job)
        self.mirror.calls = record.call - 1  # its loop's next strategy call is the admission's step
        self.admissions.adopt((record.considered, record.newcomers_ready))
        log.warning("rank %d admitted to the job at call %d (generation %d, members %s)", world.original_rank,
                    record.call, record.generation, list(record.members))
        return record

    def admit_newcomers(self, call: int, record: Callable[[Admitted], AdmissionRecord]) -> Admitted | None:
        """Every member at the start of training call ``call``: admits the newcomers the last commit counted,
        when there are any (no store access otherwise). The members' rank 0 writes their admission records
        (``record`` builds one) and names them in the call's records for the spares.

        Returns:
            The admission, or ``None`` when none was due.
        """
        if not self.admissions.due():
            return None
        admitted = self.admissions.admit(record if self.rank == 0 else None)
        if self.rank == 0:
            self.mirror.note_admission(call, admitted)
            self.mirror.forget_published_plan()  # the newcomers' first record carries the plan
        return admitted

    def plan_for_job(self, runtime: PipelineRuntime, micro_batches: int, conditions: DeviceConditions) -> Plan:
        """The plan for every live process of the job, spares and newcomers included (collective over the
        members): the survivors' planner, with each newcomer as a healthy device of the memory it registered."""
        devices = self.job_members
        spares = tuple(d for d in devices if d not in self.members)
        return self._agree_plan(runtime, devices, micro_batches, conditions, known_budgets=self.admissions.budgets(spares))

    def _agree_plan(self, runtime: PipelineRuntime, members: tuple[int, ...], micro_batches: int,
                    conditions: DeviceConditions, groups: TensorGroups | None = None,
                    known_budgets: dict[int, float] | None = None) -> Plan:
        """Rank 0 of the new group plans from the measured layer costs and the known device conditions;
        every survivor gets its plan. With tensor parallelism the plan is over the survivors' ``groups``.
        ``known_budgets``: memory budgets of planned devices outside the group (newcomers)."""
        import torch.distributed as dist

        profile = runtime.layer_profile()  # collective: each layer's costs from a survivor that held it
        budgets: list[Any] = [None] * dist.get_world_size()  # the survivors take over layers: plan within memory
        dist.all_gather_object(budgets, (self.device_id, memory_budget_mb(runtime.config.device)))
        memory: dict[int, Any] = {**(known_budgets or {}), **dict(budgets)}
        devices: Any = members
        if groups is not None:
            devices = range(groups.groups)
            conditions, memory = tensor_survivor_conditions(runtime.config.tensor.groups, groups, memory, conditions)
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = survivor_plan(profile, devices, micro_batches, runtime.per_replica_bounds, self.config.solver,
                                       memory_mb=memory, min_data_degree=self.config.min_data_degree,
                                       conditions=conditions).to_dict()
            except Exception as err:  # noqa: BLE001 - every survivor must learn it, not wait in the broadcast
                box[0] = {"error": f"{type(err).__name__}: {err}"}
        dist.broadcast_object_list(box, src=0)
        if "error" in box[0]:
            self.unrecoverable(-1, f"no plan for the survivors: {box[0]['error']}")
        return Plan.from_dict(box[0])

    def unrecoverable(self, step: int, reason: str) -> NoReturn:
        """Ends this process with ``config.exit_code`` after telling the listeners, for a launcher to restart the job.

        No teardown: the groups are broken, and the store host notices the exit by itself.
        """
        print(f"ResiHPStrategy: the fail-stop at step {step} cannot be recovered in-process: {reason}", file=sys.stderr, flush=True)
        for listener in self.listeners:
            try:
                listener("fail_stop_unrecoverable", {"step": step, "reason": reason, "exit_code": self.config.exit_code,
                                                     "rank": self.world.original_rank})
            except Exception as err:  # noqa: BLE001 - exiting anyway
                log.warning("a fail-stop listener failed: %s", err)
        os._exit(self.config.exit_code)
