"""What one in-process recovery cost on this rank: :class:`~resihp_lightning.failstop.recovery_record.RecoveryRecord` and the clock that times it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from resihp_lightning.contract import DeviceConditions
from resihp_lightning.plan import Plan


@dataclass(frozen=True)
class RecoveryRecord:
    """One in-process recovery, as this rank measured it.

    Times are ``time.monotonic()`` marks (comparable across the processes of one machine) or
    durations in seconds.

    Attributes:
        step: the training step that was interrupted and redone.
        generation: the new generation's number.
        failed: original rank -> how it failed (``exited``, ``silent``, ``hung``, ``left out``, ...).
        members: the survivors the plan uses (original ranks).
        plan: the plan the survivors run.
        detected_at: when the first of the failures was detected (by any process).
        aborted_at: when this rank aborted the old generation's collectives.
        regroup_s: abort to the new default group formed.
        plan_s: layer profile gathered and the survivors' plan agreed.
        restore_s: engine rebuilt and the layers new to each survivor received (``bytes_moved``).
        redo_s: the interrupted step run again on the survivors.
        spares: live processes the plan leaves idle (original ranks).
        conditions: the known slow devices and links the survivors' plan was made with.
    """

    step: int
    generation: int
    failed: dict[int, str]
    members: tuple[int, ...]
    plan: Plan
    detected_at: float
    aborted_at: float
    regroup_s: float
    plan_s: float
    restore_s: float
    bytes_moved: int
    redo_s: float = 0.0
    spares: tuple[int, ...] = ()
    conditions: DeviceConditions = field(default_factory=DeviceConditions)

    @property
    def abort_s(self) -> float:
        """Detection to this rank's abort."""
        return max(0.0, self.aborted_at - self.detected_at)

    @property
    def total_s(self) -> float:
        """Detection to the redone step's end on this rank."""
        return self.abort_s + self.regroup_s + self.plan_s + self.restore_s + self.redo_s


@dataclass
class RecoveryClock:
    """Marks of one recovery on this rank's monotonic clock."""

    started: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> float:
        now = time.monotonic()
        self.marks[name] = now - self.started - sum(self.marks.values())
        return self.marks[name]
