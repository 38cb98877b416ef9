"""The fail-stop half of :class:`~resihp_lightning.strategy.strategy.ResiHPStrategyMixin`: steps of a job that can lose ranks.

With ``fail_stop`` on, the strategy holds a :class:`~resihp_lightning.failstop.survivors.SurvivingJob`
(``self._job``). This mixin is everything the strategy does with it between Lightning's hooks:

* a training step runs as :meth:`_job_step` inside ``SurvivingJob.run_step``: a member applies a
  requested plan (a reshape when the plan takes in or leaves out devices) and runs its share; a
  hot spare returns what the members' step returned (``CallMirror``), or joins a reshape;
* a lost peer, seen in a step or in a callback's collective (:meth:`collective`), regroups the
  survivors (:meth:`_recover`);
* at the end of fit the spares join the members for the weight sync (:meth:`_sync_with_spares`).

The strategy declares the state used here in its ``__init__`` (``_job``, ``_runtime``, ``_pending``,
``_interrupted``, ``_step_result``, ``_last_migration``, ``_num_micro``, ``device_conditions``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor

from resihp_lightning._logging import user_info, user_warn
from resihp_lightning.plan import Plan
from resihp_lightning.resilience.failures import PeerFailure
from resihp_lightning.runtime import batching
from resihp_lightning.failstop.recovery_record import RecoveryRecord
from resihp_lightning.strategy.loss_logging import LossLogRecorder
from resihp_lightning.state.module_weights import sync_module_layers
from resihp_lightning.failstop.spares import Reshape


class ResilientStepsMixin:
    """Runs the strategy's steps, collectives and end-of-fit sync on a job that survives lost ranks."""

    @property
    def is_spare(self) -> bool:
        """Whether the plan in force leaves this process idle (it mirrors the members' steps)."""
        return self._job is not None and self._job.is_spare

    @property
    def last_recovery(self) -> RecoveryRecord | None:
        """The last in-process fail-stop recovery (``None`` before one)."""
        return self._job.last_recovery if self._job is not None else None

    @property
    def fail_stop_listeners(self) -> list[Callable[[str, dict[str, Any]], None]]:
        """Called as ``listener(event, fields)`` before this process exits unrecoverably (empty without fail_stop)."""
        return self._job.listeners if self._job is not None else []

    @property
    def recovery_listeners(self) -> list[Callable[[], None]]:
        """Called on every survivor inside a recovery (callbacks re-synchronise their state there)."""
        return self._job.recovery_listeners if self._job is not None else []

    @property
    def collectives_interrupted(self) -> bool:
        """Whether a lost peer interrupted this step after its update, or this process is a spare (it has
        no process group); callbacks skip their collectives then."""
        return self._interrupted or self.is_spare

    def collective(self, run: Callable[[], Any]) -> tuple[bool, Any]:
        """Runs a callback's collective between steps (see :class:`~resihp_lightning.contract.StepStatsSource`).

        Without fail-stop recovery it simply runs. With it, a lost peer makes the survivors regroup
        (:meth:`_recover`), and this and every later collective of the step is skipped on this rank:
        survivors interrupted at different collectives of the same step meet again at the next step.
        """
        if self._job is None:
            return True, run()
        if self._interrupted or self._job.is_spare:
            return False, None
        try:
            with self._job.world.guard():
                return True, run()
        except PeerFailure as failure:
            self._recover(failure, finished=self._step_result)
            self._interrupted = True
            return False, None

    def _job_step(self, split: batching.SplitBatch, call: int, pending: list[Plan]) -> Any:
        """One attempt at a training step under fail-stop recovery: a member applies a requested plan and
        runs its share; a spare returns what the members' step returned (a dict), or joins a reshape."""
        job, runtime = self._job, self._require_runtime()
        while True:
            finished = job.take_finished(call)
            if finished is not None:  # the members committed this step before a recovery took us in
                return finished
            if job.is_spare:
                pending.clear()  # the members' rank 0 announces plan changes; a spare's own request is moot
                got = job.mirror.wait(call)
                if isinstance(got, Reshape):
                    if runtime.plan.layout_key() != got.old.layout_key():
                        runtime.follow(got.old)
                    self._reshape(got.plan)
                    continue
                if got.plan is not None:
                    runtime.follow(got.plan)
                return got.value
            plan = pending.pop() if pending else None
            if plan is not None:
                if set(plan.device_ids) == set(job.members):
                    self._last_migration = runtime.switch(plan)
                else:
                    if job.rank == 0:
                        job.mirror.announce(call, runtime.plan, plan)
                    self._reshape(plan)
                    continue
            return self._run_replica_share(split)

    def _reshape(self, plan: Plan) -> None:
        """Every process of the job: puts ``plan`` in force where it uses other devices than the members."""
        record = self._job.reshape(self._require_runtime(), plan, self._note_ranks)
        if record is not None:
            self._last_migration = record
        user_info(
            f"ResiHPStrategy: now {self.current_plan.pipeline_degree}x{self.current_plan.data_degree} on devices "
            f"{sorted(self.current_plan.device_ids)}; idle (hot spares): {list(self._job.spares)}"
        )

    def _replay_step(self, result: dict[str, Any], rows: int, call: int) -> Tensor:
        """Logs and returns a step's committed result on a process that did not compute it."""
        module = self.lightning_module
        self._last_step_stats = None
        self._step_result = result
        self._interrupted = not self.is_spare  # taken in by a recovery after the members' update
        loss = torch.tensor(result["loss"], device=self.root_device)
        LossLogRecorder.log_values(module, result.get("logs") or {}, self.root_device)
        self._log_train_loss(loss, rows)
        self._publish(call, result)
        self._job.progress(module.trainer.global_step + 1)
        return loss

    def _publish(self, call: int, result: Any) -> None:
        """The members' rank 0 records a call's result for the spares (only while there are spares)."""
        job = self._job
        if result is not None and not job.is_spare and job.rank == 0 and job.spares:
            job.mirror.publish(call, result, self.current_plan)

    def _sync_with_spares(self, trained: dict[str, Tensor]) -> bool:
        """End of fit under fail-stop recovery: with ``gather_weights="all"`` the spares join the group for
        the weight sync (and leave it again). Returns whether that happened (else the members sync as usual).

        Who takes part must not depend on each process's own view of who is alive (a spare that just
        died may still look alive to one member): the members take rank 0's list of spares, and rank 0
        announces it, so that every live spare learns whether it joins.
        """
        runtime, job = self._require_runtime(), self._job
        call = job.mirror.next_call()
        if job.is_spare:
            got = job.mirror.wait(call)
            include = got.include if isinstance(got, Reshape) else ()
            if job.device_id not in include:
                return True  # not taken in (gather_weights is not "all"): this module keeps its own values
        else:
            mine = list(job.spares) if self.options.gather_weights == "all" else []
            box: list[Any] = [mine if job.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            include = tuple(box[0])
            if job.rank == 0:
                job.mirror.announce(call, runtime.plan, runtime.plan, include=include)
            if not include:
                return False

        def sync() -> None:
            sync_module_layers(runtime.plan_in_ranks(), job.world.rank, self._specs, self._keys, trained, None,
                               runtime.casts_model)

        job.reshape(runtime, runtime.plan, self._note_ranks, include=include, during=sync)
        return True

    def _recover(self, failure: Any, finished: dict[str, Any] | None = None) -> None:
        """Regroups the survivors and rebuilds this rank's runtime for their plan (see ``survivors``).

        Args:
            failure: what the interrupted call raised.
            finished: this training step's result when it was already committed here (a failure in a
                collective after the update), so that spares taken in do not redo it.
        """
        step = self.lightning_module.trainer.global_step
        call = self._job.mirror.calls
        self._last_migration = self._job.recover(
            failure, self._require_runtime(), self._num_micro, step, self._note_ranks, finished=(call, finished),
            conditions=self.device_conditions,
        )
        self._pending = None
        record = self._job.last_recovery
        spares = f"; idle (hot spares): {list(record.spares)}" if record.spares else ""
        user_warn(
            f"ResiHPStrategy: lost rank(s) {sorted(record.failed)} at step {step}; {len(record.members)} survivors "
            f"go on under {self.current_plan.pipeline_degree}x{self.current_plan.data_degree}{spares}"
        )

    def _note_ranks(self) -> None:
        """Points Lightning's rank-zero utilities at this process's rank in the current group."""
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank
