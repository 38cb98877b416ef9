"""Naming the slow member of a tensor-parallel group (plain Python; the detector feeds it).

The members of a group finish every split layer together: a slow member slows the whole group, and
the group's busy time (what the per-device detector sees) cannot say which member it is. Each
member's *own* compute can: its busy time minus its time inside the group's all-reduces
(:mod:`resihp_lightning.torch_utils.wait_clock`), since the fast members wait there for the slow one
and the slow one arrives last. A member whose own compute stays at ``threshold`` times the median of
its group's other members or more for ``patience`` steps is flagged, at speed ``1 / ratio``; it is
cleared when its ratio stays below the midpoint ``(1 + threshold) / 2`` as long. A member that is in no
group of two or more any more (its group was split or dropped it) keeps its flag: as a device of its
own, the per-device detector follows it from then on (it starts that device flagged at the member's
speed) and clears the member's flag when the device heals (:meth:`MemberCore.clear`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from resihp_lightning.errors import invalid_option


@dataclass(frozen=True)
class MemberSample:
    """One process's step as a member of a tensor-parallel group.

    Attributes:
        step: the trainer's global step.
        process: the process's id for the job's lifetime (its global rank at the start).
        group: its group's id (the planning device it is part of).
        own_ms: its busy compute time minus its time in the group's all-reduces.
        rank: its rank in the job's current groups (``-1``: not told).
        wait_ms: its time in the group's all-reduces (the rest of its busy time).
    """

    step: int
    process: int
    group: int
    own_ms: float
    rank: int = -1
    wait_ms: float = 0.0


@dataclass
class MemberCore:
    """Flags the slow members of tensor-parallel groups (see the module docstring).

    Args:
        threshold: a member is slow when its own compute is at least this many times its group's other
            members' median (> 1).
        patience: consecutive steps the condition must hold to flag, or to clear, a member (>= 1).
        warmup_steps: steps before this one are not judged (the first steps carry one-time costs).
    """

    threshold: float = 2.0
    patience: int = 3
    warmup_steps: int = 0
    #: Flagged members: process id -> speed (the other members' median / its own compute).
    flagged: dict[int, float] = field(default_factory=dict)
    #: Bumps whenever a member is flagged or cleared.
    version: int = 0
    _streaks: dict[int, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.threshold, (int, float)) or not self.threshold > 1:
            raise invalid_option("member_threshold", self.threshold, "a number > 1")
        if not isinstance(self.patience, int) or isinstance(self.patience, bool) or self.patience < 1:
            raise invalid_option("member_patience", self.patience, "an integer >= 1")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise invalid_option("warmup_steps", self.warmup_steps, "an integer >= 0")

    def update(self, samples: Iterable[MemberSample]) -> list[dict[str, Any]]:
        """Folds one step's samples (every member of every group) in; returns the events it caused."""
        by_group: dict[int, list[MemberSample]] = {}
        for sample in samples:
            if sample.step >= self.warmup_steps:
                by_group.setdefault(sample.group, []).append(sample)
        events = []
        clear = (1.0 + self.threshold) / 2.0
        for group in sorted(by_group):
            members = sorted(by_group[group], key=lambda s: s.process)
            if len(members) < 2:
                continue
            for sample in members:
                others = [s.own_ms for s in members if s is not sample]
                baseline = statistics.median(others)
                if baseline <= 0 or sample.own_ms <= 0:
                    continue
                ratio = sample.own_ms / baseline
                slow = sample.process in self.flagged
                # A streak counts steps that argue for a change of the member's flag.
                changing = ratio < clear if slow else ratio >= self.threshold
                streak = self._streaks.setdefault(sample.process, [])
                if not changing:
                    streak.clear()
                    continue
                streak.append(ratio)
                if len(streak) < self.patience:
                    continue
                if slow:
                    del self.flagged[sample.process]
                    events.append({"event": "fail_slow_member_recovered", "step": sample.step, "rank": sample.process,
                                   "group": group})
                else:
                    speed = 1.0 / statistics.median(streak)
                    self.flagged[sample.process] = speed
                    events.append({"event": "fail_slow_member_detected", "step": sample.step, "rank": sample.process,
                                   "group": group, "speed": speed})
                streak.clear()
        if events:
            self.version += 1
        return events

    def clear(self, process: int) -> bool:
        """Drops a member's flag without an event of its own (the device it became healed); whether it had one."""
        self._streaks.pop(process, None)
        if self.flagged.pop(process, None) is None:
            return False
        self.version += 1
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"flagged": dict(self.flagged), "streaks": {p: list(s) for p, s in self._streaks.items()},
                "version": self.version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.flagged = {int(p): float(s) for p, s in state.get("flagged", {}).items()}
        self._streaks = {int(p): [float(r) for r in s] for p, s in state.get("streaks", {}).items()}
        self.version = int(state.get("version", 0))
