"""The run's event log: one JSON object per line in ``<log_dir>/events.jsonl``.

Every record has ``time`` (Unix seconds), ``step`` (the trainer's global step, or ``null``) and
``event`` (one of :data:`EVENT_NAMES`), plus the event's own fields:

========================== =======================================================================================================
event                      fields
========================== =======================================================================================================
fault_injected             kind, rank and the fault's parameters (factor, start/end step, ...)
fail_slow_detected         rank, speed (1.0 healthy, 0.5 half speed)
fail_slow_recovered        rank, speed
fail_slow_member_detected  rank (a process), group (its tensor-parallel group), speed (its own compute vs its group's)
fail_slow_member_recovered rank, group
slow_link_detected         rank, link_speed (its links' round trips vs the median device's; 1.0 healthy)
slow_link_recovered        rank, link_speed
fault_struck               kind, rank, at (a kill / hang fault fired inside the step; monotonic time)
fail_stop_detected         rank, how (exited, silent = heartbeat, hung = progress, left out), at (FailStopReporter);
                           or rank, reason, how, reporter (HeartbeatMonitor)
machine_lost               machine, ranks, reporter (a whole machine's heartbeat stopped; HeartbeatMonitor, after its ranks'
                           fail_stop_detected)
recovery_started           generation, members (the survivors), failed
recovery_finished          generation, members, spares (idle), abort_s, regroup_s, plan_s, restore_s, redo_s, total_s, bytes_moved
fail_stop_unrecoverable    reason, exit_code, rank (the original rank of the process that exits with it)
healthy_reference          plan (the planner's best for the devices all healthy), predicted_ms, current_plan, current_ms
plan_computed              plan (Plan JSON), predicted_ms, solve_seconds, status, speeds, link_speeds, p2p_ms, allreduce_ms
plan_applied               plan, migration_seconds, bytes_moved (after a recovery also world, spares)
plan_rejected              reason
worker_failed              rank, error, at (a process's ``fit`` raised: a lost peer, the launcher's SIGTERM; every rank writes)
job_restarted              restart_count, checkpoint, checkpoint_step, world_before, world_after, lost, new, process_started_at,
                           setup_at, read_s, plan_s, loaded_at, resumed_at (Unix seconds / seconds; at the resume's train start)
========================== =======================================================================================================

Only writer ranks write (rank 0 by default) so that a multi-rank job produces one log; a rank
that must report while rank 0 may be gone (a heartbeat that lost rank 0) passes ``force=True``.
Each record is one ``write`` of a whole line on a file opened in append mode, so lines from
different processes do not interleave.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from resihp_lightning.errors import ConfigError

#: Every event the log accepts (:meth:`EventLog.log` refuses others).
EVENT_NAMES = (
    "fault_injected",
    "fail_slow_detected",
    "fail_slow_recovered",
    "fail_slow_member_detected",
    "fail_slow_member_recovered",
    "slow_link_detected",
    "slow_link_recovered",
    "fail_stop_detected",
    "machine_lost",
    "fault_struck",
    "recovery_started",
    "recovery_finished",
    "newcomers_admitted",
    "fail_stop_unrecoverable",
    "healthy_reference",
    "plan_computed",
    "plan_applied",
    "plan_rejected",
    "worker_failed",
    "job_restarted",
)
EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends events to ``<log_dir>/events.jsonl`` and keeps them in memory.

    Args:
        log_dir: the run's log directory (created when needed); ``None`` keeps events in memory only.
        rank: this process's global rank (default: ``$RANK`` or 0).
        writer_ranks: ranks that write to the file; ``None`` means every rank.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        *,
        rank: int | None = None,
        writer_ranks: Iterable[int] | None = (0,),
    ) -> None:
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.writer_ranks = None if writer_ranks is None else frozenset(writer_ranks)
        self.path = None if log_dir is None else Path(log_dir) / EVENTS_FILE
        self.events: list[dict[str, Any]] = []

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes its events to the file."""
        return self.writer_ranks is None or self.rank in self.writer_ranks

    def log(self, event: str, step: int | None = None, *, force: bool = False, **fields: Any) -> dict[str, Any]:
        """Records one event.

        Args:
            event: one of :data:`EVENT_NAMES`.
            step: the trainer's global step (``None`` when not known).
            force: write to the file even when this rank is not a writer rank.
            **fields: the event's fields (JSON-serialisable; objects with ``to_dict`` are converted).

        Returns:
            The record as written.
        """
        if event not in EVENT_NAMES:
            raise ConfigError(f"unknown event {event!r}; allowed: {', '.join(EVENT_NAMES)}")
        record: dict[str, Any] = {"time": time.time(), "step": step, "event": event}
        record.update({key: _jsonable(value) for key, value in fields.items()})
        self.events.append(record)
        if self.path is not None and (force or self.is_writer):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            line = json.dumps(record, allow_nan=False) + "\n"
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(line)
                handle.flush()
        return record

    def of(self, event: str) -> list[dict[str, Any]]:
        """The in-memory events of one kind, in order."""
        return [e for e in self.events if e["event"] == event]


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads an events log (a run directory or the ``events.jsonl`` file itself).

    A truncated last line (a process killed mid-write) is skipped; any other malformed line raises.

    Raises:
        ConfigError: the file does not exist or a line is not a JSON object with an ``event``.
    """
    path = Path(path)
    if path.is_dir():
        path = path / EVENTS_FILE
    if not path.is_file():
        raise ConfigError(f"no events log at {str(path)!r}")
    records = []
    for number, record in iter_jsonl(path):
        if not isinstance(record, dict) or "event" not in record:
            raise ConfigError(f"{path}:{number}: not an event record")
        records.append(record)
    return records


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """Yields ``(line number, parsed value)`` for every non-empty line of a JSON-lines file.

    A last line that does not parse is skipped (a run killed mid-write); any other bad line raises.

    Raises:
        ConfigError: naming the file and line that is not JSON.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                return
            raise ConfigError(f"{path}:{number}: not a JSON line") from None
        yield number, value


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return value.item()
    return value
