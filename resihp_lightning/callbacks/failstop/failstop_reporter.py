"""``FailStopReporter``: writes a fail-stop recovery into the run's event log.

The strategy recovers by itself (``ResiHPStrategy(fail_stop=...)``); this callback makes it visible.
After the step that was redone on the survivors it writes, on the rank that is 0 in the new group:
``fail_stop_detected`` (one per lost rank, with how it was found), ``recovery_started``,
``plan_applied`` (the survivors' plan, with the slow devices' ``speeds`` and ``link_speeds`` it was
made with) and ``recovery_finished`` (the time breakdown). When the members admit newcomers (processes
started with ``RESIHP_JOIN=1``) it writes ``newcomers_admitted`` (their ranks, the live processes from
then on, ``world``) at the step of the admission. When the job
cannot recover, ``fail_stop_unrecoverable`` is written (by every survivor, rank 0 may be the lost
one, with the writer's original ``rank``) just before the process exits with the strategy's restart
status; a process the survivors left out (evicted, or cut off with a lost machine) writes it too when
it ends, and the report shows that as its exit, not as the job's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from resihp_lightning.callbacks.events import EventLog
from resihp_lightning.contract import Survivable, require


class FailStopReporter(Callback):
    """Logs in-process recoveries (see the module docstring).

    Args:
        events: the event log; default ``<log_dir or trainer.log_dir>/events.jsonl``.
        log_dir: where to put the default event log.
    """

    def __init__(self, *, events: EventLog | None = None, log_dir: str | None = None) -> None:
        self.events = events
        self.log_dir = log_dir
        self._reported: Any = None
        self._admission_reported: Any = None

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        require(trainer.strategy, Survivable, "FailStopReporter")
        if self.events is None:
            log_dir = self.log_dir or trainer.log_dir or trainer.default_root_dir
            self.events = EventLog(Path(log_dir), rank=trainer.global_rank)
        if self._unrecoverable not in trainer.strategy.fail_stop_listeners:
            trainer.strategy.fail_stop_listeners.append(self._unrecoverable)
        self._step = lambda: trainer.global_step

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._log_recovery(trainer)
        self._log_admission(trainer)

    def _log_admission(self, trainer: Any) -> None:
        note = trainer.strategy.last_admission
        if note is None or note is self._admission_reported:
            return
        self._admission_reported = note
        self.events.rank = trainer.global_rank
        self.events.log("newcomers_admitted", note.step, ranks=list(note.ranks), live=list(note.live),
                        world=len(note.live))

    def _log_recovery(self, trainer: Any) -> None:
        record = trainer.strategy.last_recovery
        if record is None or record is self._reported:
            return
        self._reported = record
        self.events.rank = trainer.global_rank  # the writer is rank 0 of the survivors
        step = record.step
        for rank, how in sorted(record.failed.items()):
            self.events.log("fail_stop_detected", step, rank=rank, how=how, at=record.detected_at)
        members = list(record.members)
        self.events.log("recovery_started", step, generation=record.generation, members=members, failed=record.failed)
        self.events.log("plan_applied", step, plan=record.plan, migration_seconds=record.restore_s,
                        bytes_moved=record.bytes_moved, world=len(members), spares=list(record.spares),
                        speeds=dict(record.conditions.speeds), link_speeds=dict(record.conditions.link_speeds))
        self.events.log(
            "recovery_finished", step, generation=record.generation, members=members, spares=list(record.spares),
            abort_s=record.abort_s,
            regroup_s=record.regroup_s, plan_s=record.plan_s, restore_s=record.restore_s, redo_s=record.redo_s,
            total_s=record.total_s, bytes_moved=record.bytes_moved,
        )

    def _unrecoverable(self, event: str, fields: dict[str, Any]) -> None:
        if self.events is not None:
            self.events.log(event, fields.get("step"), force=True, reason=fields.get("reason"), exit_code=fields.get("exit_code"),
                            rank=fields.get("rank"))
