"""``SurvivingJob``: the strategy's side of fail-stop recovery, one object for the job's lifetime.

It owns the :class:`~resihp_lightning.resilience.world.ElasticWorld` (the job's process groups,
generation by generation), the optimizer step's :class:`~.fail_stop.StepCommit` vote, and the
recovery itself: regroup the survivors, re-initialise ``deepspeed.comm`` on the new group, plan for
the survivors, and let the :class:`~.runtime.PipelineRuntime` restore the layers each survivor now
needs. The strategy wraps each training step in :meth:`SurvivingJob.run_step` (a step that lost a
peer before its commit point is redone) and each collective after the commit point in
``ResiHPStrategy.collective`` (skipped after a recovery: the survivors meet again at the next step).
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
from resihp_lightning.contract import MigrationRecord
from resihp_lightning.errors import ConfigError, PlanError
from resihp_lightning.placement import lost_layers
from resihp_lightning.plan import Plan
from resihp_lightning.resilience.errors import PeerFailure, ResilienceError
from resihp_lightning.resilience.world import ElasticWorld
from resihp_lightning.strategy.engine import init_deepspeed_comm
from resihp_lightning.strategy.fail_stop import FailStopConfig, RecoveryClock, RecoveryRecord, StepCommit, survivor_plan
from resihp_lightning.strategy.runtime import PipelineRuntime

log = get_logger(__name__)

T = TypeVar("T")


class SurvivingJob:
    """The job's groups and their recovery (see the module docstring).

    Building one is collective: every process of the job forms generation 0 together.

    Args:
        config: the strategy's ``fail_stop`` options.
        rank: this process's global rank at start (its device id for the job's lifetime).
        world_size: the number of processes at start.
        backend: ``"gloo"`` or ``"nccl"``.
        collective_timeout_s: the strategy's collective timeout.
        node_rank: this machine's index (the store host runs on node 0 when the port is fixed).
    """

    def __init__(
        self, config: FailStopConfig, rank: int, world_size: int, backend: str, collective_timeout_s: float, node_rank: int = 0
    ) -> None:
        self.config = config
        self.backend = backend
        world_config = config.world_config(backend, collective_timeout_s, node_rank)
        self.world = ElasticWorld(world_config, rank=rank, world_size=world_size).start()
        self.commit = StepCommit(self.world)
        self.last_recovery: RecoveryRecord | None = None
        #: Called as ``listener(event, fields)`` before the process exits unrecoverably (event logs).
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        #: Called on every survivor inside each recovery, after the runtime is rebuilt (state resync).
        self.recovery_listeners: list[Callable[[], None]] = []
        self._redo_pending = False
        self._closed = False
        atexit.register(self.close)

    # ------------------------------------------------------------------------------- views
    @property
    def device_id(self) -> int:
        return self.world.original_rank

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def members(self) -> tuple[int, ...]:
        """Device ids of the live processes, in rank order."""
        return tuple(self.world.members)

    def rank_map(self) -> dict[int, int]:
        """Device id -> rank in the current default group."""
        return {d: self.world.rank_of(d) for d in self.world.members}

    # ---------------------------------------------------------------------------- running
    def run_step(self, attempt: Callable[[], T], recover: Callable[[PeerFailure], None]) -> T:
        """Runs ``attempt`` (one training step); on a lost peer, ``recover`` and run it again."""
        while True:
            started = time.monotonic()
            try:
                with self.world.guard():
                    result = attempt()
            except PeerFailure as failure:
                recover(failure)
                self._redo_pending = True
                continue
            if self._redo_pending and self.last_recovery is not None:
                self.last_recovery = replace(self.last_recovery, redo_s=time.monotonic() - started)
            self._redo_pending = False
            return result

    def progress(self, step: int) -> None:
        """Tells the peers' hang check that this process finished ``step``."""
        self.world.progress(step)

    def close(self) -> None:
        """Leaves the job's groups and tells the store host this process is done (once; at exit by default)."""
        if not self._closed:
            self._closed = True
            self.world.close()

    # ---------------------------------------------------------------------------- recovery
    def recover(
        self,
        failure: PeerFailure,
        runtime: PipelineRuntime,
        micro_batches: int,
        step: int,
        on_regrouped: Callable[[], None],
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
        """
        world = self.world
        before, aborted_at = self.members, world.current.aborted_at
        clock = RecoveryClock()
        try:
            world.regroup()
        except ResilienceError as err:
            self.unrecoverable(step, f"the survivors could not regroup: {err}")
        on_regrouped()
        init_deepspeed_comm(self.backend)
        clock.mark("regroup")
        members = self.members
        lost = lost_layers(runtime.plan, members)
        if lost:
            self.unrecoverable(step, f"layers {lost} had no live holder (every replica holding them failed)")
        plan = self._agree_plan(runtime, members, micro_batches)
        clock.mark("plan")
        try:
            record = runtime.recover(plan, self.rank_map())
        except (PlanError, ConfigError) as err:
            self.unrecoverable(step, str(err))
        clock.mark("restore")
        for listener in self.recovery_listeners:
            listener()
        known = {r: f for r, f in world.detector.failed.items() if r in before and r not in members}
        self.last_recovery = RecoveryRecord(
            step=step,
            generation=world.generation,
            failed={r: known[r].reason if r in known else "left out" for r in before if r not in members},
            members=members,
            plan=plan,
            detected_at=min((f.at for f in known.values()), default=aborted_at or clock.started),
            aborted_at=aborted_at or clock.started,
            regroup_s=clock.marks["regroup"],
            plan_s=clock.marks["plan"],
            restore_s=clock.marks["restore"],
            bytes_moved=record.bytes_moved,
        )
        log.warning("recovered from %s at step %d: %d survivors under %s", failure, step, len(members), plan.layout_key())
        return record

    def _agree_plan(self, runtime: PipelineRuntime, members: tuple[int, ...], micro_batches: int) -> Plan:
        """Rank 0 of the new group plans from the measured layer costs; every survivor gets its plan."""
        import torch.distributed as dist

        profile = runtime.layer_profile()  # collective: each layer's costs from a survivor that held it
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = survivor_plan(profile, members, micro_batches, runtime.per_replica_bounds, self.config.solver).to_dict()
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
                listener("fail_stop_unrecoverable", {"step": step, "reason": reason, "exit_code": self.config.exit_code})
            except Exception as err:  # noqa: BLE001 - exiting anyway
                log.warning("a fail-stop listener failed: %s", err)
        os._exit(self.config.exit_code)
