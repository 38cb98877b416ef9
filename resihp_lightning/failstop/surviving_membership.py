"""``SurvivingMembership``: who is in a job that can lose ranks, and its guarded collectives.

The fail-stop counterpart of the strategy's plain membership (``strategy/job_membership.py``): it
answers rank, world size, device id and live devices from the
:class:`~resihp_lightning.failstop.survivors.SurvivingJob`, and runs the strategy's collectives
between steps so that a lost peer regroups the survivors (:meth:`SurvivingMembership.recover`)
instead of ending the job. It also carries what the job's hot spares need: the numbered calls
whose results the members' rank 0 publishes, the reshapes that take spares in or leave devices
out, and the end-of-fit weight sync that spares join; and the admission of newcomers (processes
started after the job began, :mod:`~resihp_lightning.failstop.admission`) on both sides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from resihp_lightning._logging import get_logger, user_info, user_warn
from resihp_lightning.contract import DeviceConditions
from resihp_lightning.plan import Plan
from resihp_lightning.resilience.failure_detector import FailureDetector
from resihp_lightning.resilience.failures import PeerFailure
from resihp_lightning.resilience.joining import ready_count
from resihp_lightning.failstop.admission import AdmissionNote, AdmissionRecord, Admitted
from resihp_lightning.failstop.recovery_record import RecoveryRecord
from resihp_lightning.failstop.spares import Reshape, idle_probes, share_idle_probe
from resihp_lightning.failstop.survivors import SurvivingJob
from resihp_lightning.runtime.runtime_state import RuntimeState
from resihp_lightning.tensor.tensor_groups import TensorGroups, TensorParallelism

log = get_logger(__name__)


class SurvivingMembership:
    """The membership of a job with fail-stop recovery (see the module docstring).

    Args:
        job: the job's groups and their recovery.
        state: the strategy's runtime state (a recovery rebuilds the runtime, records the migration
            and drops a requested plan).
        global_step: the trainer's global step (a recovery reports it).
        conditions: the slow devices and links a recovery plans the survivors with (the strategy's
            ``device_conditions``, which the re-plan controller sets).
        on_regrouped: called on every process once a new group exists (the strategy points
            Lightning's rank-zero utilities at the new rank).
        lightning_state: the Lightning side's state a newcomer takes at its admission (every member calls it
            there, rank 0 sends it; :mod:`resihp_lightning.strategy.newcomer_state`).
    """

    #: Lost peers are recovered from in-process.
    survives_failures = True

    def __init__(
        self,
        job: SurvivingJob,
        state: RuntimeState,
        *,
        global_step: Callable[[], int],
        conditions: Callable[[], DeviceConditions],
        on_regrouped: Callable[[], None],
        lightning_state: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.job = job
        self.state = state
        self._global_step = global_step
        self._conditions = conditions
        self._on_regrouped = on_regrouped
        self._lightning_state = lightning_state
        #: A lost peer interrupted this step after its update: its other collectives are skipped here.
        self.interrupted = False
        #: This training step's committed result (what spares taken in by a recovery return).
        self.step_result: Any = None
        #: The last newcomers the members admitted (members only; None before any).
        self.last_admission: AdmissionNote | None = None
        #: With tensor parallelism: the groups in force (plans name them) ...
        self.tensor_groups: TensorGroups | None = None
        #: ... and what learns this process's part of the survivors' groups after a recovery.
        self.on_tensor: Callable[[TensorParallelism], None] | None = None

    # ------------------------------------------------------------------------------- views
    @property
    def rank(self) -> int:
        return self.job.rank

    @property
    def world_size(self) -> int:
        return self.job.world_size

    @property
    def device_id(self) -> int:
        """This process's device in plans: its global rank at the start, or with tensor parallelism its
        group's id among the groups in force."""
        if self.tensor_groups is not None:
            group = self.tensor_groups.group_of(self.job.device_id)
            assert group is not None  # every live process is in a group under tensor parallelism
            return group
        return self.job.device_id

    @property
    def process_id(self) -> int:
        """This process's id for the job's lifetime: its global rank at the start."""
        return self.job.device_id

    @property
    def devices_alive(self) -> tuple[int, ...]:
        if self.tensor_groups is not None:
            return tuple(range(self.tensor_groups.groups))
        return self.job.job_members

    def uses_every_device(self, plan: Plan) -> bool:
        """Whether ``plan`` keeps every current member busy (else it is a reshape that spares join)."""
        if self.tensor_groups is not None:
            return set(plan.device_ids) == set(range(self.tensor_groups.groups))
        return set(plan.device_ids) == set(self.job.members)

    @property
    def is_spare(self) -> bool:
        return self.job.is_spare

    def share_idle_probe(self, step: int, probe_ms: float) -> None:
        """A spare: publishes its speed-probe time (see :func:`~.spares.share_idle_probe`)."""
        share_idle_probe(self.job.world, self.job.device_id, step, probe_ms)

    def idle_probes(self) -> dict[int, tuple[int, float]]:
        """The spares' latest speed-probe times (device id -> ``(step, ms)``)."""
        return idle_probes(self.job.world, self.job.spares)

    @property
    def collectives_interrupted(self) -> bool:
        return self.interrupted or self.job.is_spare

    @property
    def last_recovery(self) -> RecoveryRecord | None:
        return self.job.last_recovery

    @property
    def failure_detector(self) -> FailureDetector | None:
        return self.job.world.detector

    @property
    def listeners(self) -> list[Callable[[str, dict[str, Any]], None]]:
        return self.job.listeners

    @property
    def recovery_listeners(self) -> list[Callable[[], None]]:
        return self.job.recovery_listeners

    @property
    def commit(self) -> Callable[[], None]:
        return self.job.commit

    def rank_map(self) -> dict[int, int]:
        return self.job.rank_map()

    # ------------------------------------------------------------------------- collectives
    def begin_step(self) -> None:
        """A training step starts: its collectives run again, it has no result yet."""
        self.interrupted = False
        self.step_result = None

    def collective(self, run: Callable[[], Any]) -> tuple[bool, Any]:
        """Runs a collective between steps: ``(True, result)``, or ``(False, None)`` when skipped.

        A lost peer makes the survivors regroup, and this and every later collective of the step is
        skipped here: survivors interrupted at different collectives of the same step meet again at
        the next step. A spare (no process group) skips them all.
        """
        if self.interrupted or self.job.is_spare:
            return False, None
        try:
            with self.job.world.guard():
                return True, run()
        except PeerFailure as failure:
            self.recover(failure, finished=self.step_result)
            self.interrupted = True
            return False, None

    def run_recovering(self, work: Callable[[], None]) -> None:
        """Runs ``work`` (collective) to its end: a lost peer regroups the survivors, who run it again."""
        while True:
            try:
                with self.job.world.guard():
                    work()
                return
            except PeerFailure as failure:
                self.recover(failure)

    def end_call(self, clean: bool) -> None:
        """A trainer call ended (its teardown): when no exception ended it, the process says goodbye at its exit
        unless a later call ends otherwise (see :attr:`SurvivingJob.ended_cleanly
        <resihp_lightning.failstop.survivors.SurvivingJob.ended_cleanly>`)."""
        self.job.ended_cleanly = clean

    def recover(self, failure: Any, finished: Any = None) -> None:
        """Regroups the survivors and rebuilds this process's runtime for their plan (see ``survivors``).

        Args:
            failure: what the interrupted call raised.
            finished: this training step's result when it was already committed here (a failure in a
                collective after the update), so that spares taken in do not redo it.
        """
        job, state = self.job, self.state
        step = self._global_step()
        call = job.mirror.calls
        state.last_migration = job.recover(
            failure, state.require(), state.micro_batches, step, self._on_regrouped, finished=(call, finished),
            conditions=self._conditions(),
        )
        state.pending = state.pending_groups = None
        tensor = state.require().config.tensor
        if tensor is not None:
            self.tensor_groups = tensor.groups
            if self.on_tensor is not None:
                self.on_tensor(tensor)
        record, plan = job.last_recovery, state.require().plan
        spares = f"; idle (hot spares): {list(record.spares)}" if record.spares else ""
        user_warn(
            f"ResiHPStrategy: lost rank(s) {sorted(record.failed)} at step {step}; {len(record.members)} survivors "
            f"go on under {plan.pipeline_degree}x{plan.data_degree}{spares}"
        )

    def reshape(self, plan: Plan) -> None:
        """Every process of the job: puts ``plan`` in force where it uses other devices than the members."""
        job, state = self.job, self.state
        record = job.reshape(state.require(), plan, self._on_regrouped)
        if record is not None:
            state.last_migration = record
        current = state.require().plan
        user_info(
            f"ResiHPStrategy: now {current.pipeline_degree}x{current.data_degree} on devices "
            f"{sorted(current.device_ids)}; idle (hot spares): {list(job.spares)}"
        )

    # ------------------------------------------------------------------------- newcomers
    def newcomers_waiting(self) -> int:
        """Newcomers registered to join and not admitted yet (one store read)."""
        return max(ready_count(self.job.world.store.control) - self.job.admissions.considered, 0)

    def admit_newcomers(self, call: int) -> bool:
        """Every member at the start of a training call: admits the newcomers the last commit counted (none:
        nothing happens); whether some were admitted (the members then plan for them: :meth:`plan_with_newcomers`).

        Every member reads the Lightning state, not only rank 0, which sends it: reading it may be collective
        (a callback's ``state_dict``, as when Lightning writes a checkpoint)."""
        if not self.job.admissions.due():
            return False
        started = time.perf_counter()
        lightning = self._lightning_state()
        admitted = self.job.admit_newcomers(call, lambda a: self._admission_record(call, a, lightning))
        log.info("admitted newcomers %s in %.3f s", list(admitted.ranks) if admitted else [], time.perf_counter() - started)
        if admitted is None:
            return False
        if admitted.ranks:
            self.last_admission = AdmissionNote(self._global_step(), tuple(admitted.ranks), tuple(self.job.job_members))
            user_info(f"ResiHPStrategy: admitted newcomer(s) {list(admitted.ranks)} at step {self._global_step()} "
                      f"as hot spares; live processes now {list(self.job.job_members)}")
        return bool(admitted.ranks)

    def apply_admission(self, admitted: Admitted) -> bool:
        """A spare: records the newcomers the members admitted at this call; whether they were new here."""
        return self.job.admissions.apply(admitted)

    def plan_with_newcomers(self) -> None:
        """Every member, once newcomers were admitted: plans for every live process (collective) and requests
        the plan for the next training step, whose reshape takes in the devices it uses."""
        runtime, state = self.state.require(), self.state
        started = time.perf_counter()
        plan = self.job.plan_for_job(runtime, state.micro_batches, self._conditions())
        log.info("planned for the %d live processes in %.3f s: %s", len(self.job.job_members),
                 time.perf_counter() - started, plan.layout_key())
        if plan.layout_key() != runtime.plan.layout_key():
            state.pending, state.pending_groups = plan, None
            user_info(f"ResiHPStrategy: the next step runs {plan.pipeline_degree}x{plan.data_degree} on devices "
                      f"{sorted(plan.device_ids)} (live: {list(self.job.job_members)})")

    def _admission_record(self, call: int, admitted: Admitted, lightning: dict[str, Any]) -> AdmissionRecord:
        """The members' rank 0: what the newcomers of ``admitted`` take (the plan in force, the state of this call's start)."""
        world, runtime = self.job.world, self.state.require()
        bound = runtime.optimizer
        return AdmissionRecord(
            generation=world.generation, members=tuple(world.members), job=tuple(world.job_members), call=call,
            considered=admitted.considered, newcomers_ready=self.job.commit.newcomers_ready,
            plan=runtime.plan.to_dict(), micro_batches=self.state.micro_batches, layer_sizes=runtime.layer_sizes,
            group_of=None if bound is None else dict(bound.group_of), lightning=lightning,
        )

    def await_admission(self, memory_mb: float | None) -> AdmissionRecord:
        """A newcomer: registers and waits until the members admit it (see ``SurvivingJob.await_admission``)."""
        record = self.job.await_admission(memory_mb)
        self._on_regrouped()
        return record

    # ---------------------------------------------------------------------- mirrored calls
    def next_call(self) -> int:
        """Numbers the strategy call that starts now (every process of the job, in step)."""
        return self.job.mirror.next_call()

    def mirrored(self, call: int) -> Any:
        """A spare: what the members' ``call`` returned (blocks until they publish it)."""
        return self.job.mirror.wait(call).value

    def publish(self, call: int, result: Callable[[], Any]) -> None:
        """The members' rank 0 records what ``result()`` gives as a call's result for the spares (only while
        there are spares; else ``result`` is not called). A ``None`` result is not published."""
        job = self.job
        if not job.is_spare and job.rank == 0 and job.spares:
            value = result()
            if value is not None:
                job.mirror.publish(call, value, self.state.require().plan)

    def sync_with_spares(self, everyone: bool, sync: Callable[[int], None]) -> bool:
        """End of fit: with ``everyone`` (``gather_weights="all"``) the spares join the group for the weight
        sync, ``sync(rank)`` on that group (and leave it again). Returns whether that happened (else the
        members sync as usual).

        Who takes part must not depend on each process's own view of who is alive (a spare that just
        died may still look alive to one member): the members take rank 0's list of spares, and rank 0
        announces it, so that every live spare learns whether it joins.
        """
        runtime, job = self.state.require(), self.job
        call = job.mirror.next_call()
        if job.is_spare:
            got = job.mirror.wait(call)
            include = got.include if isinstance(got, Reshape) else ()
            if job.device_id not in include:
                return True  # not taken in (gather_weights is not "all"): this module keeps its own values
        else:
            mine = list(job.spares) if everyone else []
            box: list[Any] = [mine if job.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            include = tuple(box[0])
            if job.rank == 0:
                job.mirror.announce(call, runtime.plan, runtime.plan, include=include)
            if not include:
                return False
        job.reshape(runtime, runtime.plan, self._on_regrouped, include=include, during=lambda: sync(job.world.rank))
        return True
