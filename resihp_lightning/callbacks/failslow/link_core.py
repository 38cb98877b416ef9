"""Slow links from link probes: a link speed per device, flags, events, and measured comm costs (no torch).

The strategy's link probe (``strategy.measure_links()``, :mod:`resihp_lightning.runtime.link_probe`)
times round trips between pairs of ranks at a step boundary, each rank meeting other partners from one
probe to the next, and one all-reduce. :class:`LinkCore` turns the probes into what the detector and
the planner need:

* **link speed per device**: per probe, a device's round trip is its *fastest* one (a healthy device
  has at least one healthy partner unless every partner it met is slow; a device whose own link is
  slow is slow with every partner), and its speed is the median device's round trip divided by its
  own (capped at 1.0). The estimate is the median over the last ``link_window`` probes. A slow link
  shows on both ends of each pair, so a device can only be named where it met at least two partners:
  with two ranks in the job the link is measured but not attributed (both ends read 1.0).
* **flags**: a device is flagged after ``link_patience`` probes below ``link_slow_threshold``
  (``slow_link_detected``) and cleared after as many at or above ``link_recovery_threshold``
  (``slow_link_recovered``), like a slow device. A probe counts as slow only when the device's round
  trip also exceeds the median by ``link_min_extra_ms``: round trips of small activations on a fast
  network are fractions of a millisecond, and scheduling noise alone can double them.
* **costs for the planner**: ``p2p_ms`` is the median round trip of the unflagged devices (the probe
  carries one micro-batch's stage-boundary activation each way: forward activation + backward
  gradient), ``allreduce_ms`` the probe's all-reduce while no link is flagged (a slow member slows
  the all-reduce for everyone; the planning model prices that from the link speeds itself).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any

from resihp_lightning.telemetry import LinkSample


class LinkCore:
    """Link speeds and flags from a stream of :class:`~resihp_lightning.telemetry.LinkSample`.

    Args:
        slow_threshold: flag a device whose link speed is below this (0 < x < 1).
        recovery_threshold: clear a flag when the speed is at or above this (>= ``slow_threshold``).
        patience: consecutive probes below (or at or above) a threshold before a flag changes.
        window: probes pooled (median) into each device's estimate.
        min_extra_ms: a probe reads slow only when the round trip exceeds the median's by this much.
    """

    def __init__(self, slow_threshold: float = 0.7, recovery_threshold: float = 0.9, patience: int = 2,
                 window: int = 3, min_extra_ms: float = 0.5) -> None:
        self.slow_threshold = slow_threshold
        self.recovery_threshold = recovery_threshold
        self.patience = patience
        self.window = window
        self.min_extra_ms = min_extra_ms
        self.version = 0
        self.probes = 0
        self._history: dict[int, deque[float]] = {}
        self._streak: dict[int, int] = {}
        self._flagged: dict[int, float] = {}
        self._round_trips: deque[float] = deque(maxlen=window)
        self._allreduce_ms: float | None = None

    # ----------------------------------------------------------------------------- results
    @property
    def speeds(self) -> dict[int, float]:
        """Link speed of each flagged device (the others are 1.0 for planning)."""
        return dict(self._flagged)

    @property
    def estimates(self) -> dict[int, float]:
        """The current estimate of every device probed so far."""
        return {d: statistics.median(h) for d, h in self._history.items() if h}

    @property
    def flagged(self) -> list[int]:
        """Devices whose link is flagged slow, ascending."""
        return sorted(self._flagged)

    @property
    def undecided(self) -> bool:
        """Whether some device is part-way to a flag change: its streak has begun, or its last probe read
        on the other side of its flag than the pooled estimate says (probe again soon to confirm it)."""
        for device, history in self._history.items():
            if self._streak.get(device, 0) > 0:
                return True
            if history:
                flagged = device in self._flagged
                latest_slow = history[-1] < (self.recovery_threshold if flagged else self.slow_threshold)
                if latest_slow != flagged:
                    return True
        return False

    @property
    def p2p_ms(self) -> float | None:
        """Measured healthy round trip of one micro-batch's boundary activation (``None`` before a probe)."""
        return statistics.median(self._round_trips) if self._round_trips else None

    @property
    def allreduce_ms(self) -> float | None:
        """Measured all-reduce of the largest per-rank gradient while no link was flagged (``None`` before)."""
        return self._allreduce_ms

    # ------------------------------------------------------------------------------ update
    def update(self, sample: LinkSample) -> list[dict[str, Any]]:
        """Folds one probe in; returns the events it caused (``slow_link_detected`` / ``slow_link_recovered``)."""
        self.probes += 1
        fastest = {d: min(trips) for d, trips in sample.round_trips_ms.items() if trips}
        attributable = {d for d, partners in sample.partners.items() if len(set(partners)) >= 2}
        if not fastest:
            return []
        median = statistics.median(fastest.values())
        # A reading counts only when attributable and over the probe's own median by a margin; it is slow
        # in this probe when also below the threshold against that median (a load spike on the whole
        # machine slows every device alike).
        significant = {d for d, ms in fastest.items() if d in attributable and ms - median > self.min_extra_ms}
        slow_now = {d for d in significant if median / fastest[d] < self.slow_threshold}
        # Healthy costs only: a slow link (flagged, or slow in this probe) inflates them, and the planning
        # model prices link speeds on top of the healthy costs itself.
        healthy = [ms for d, ms in fastest.items() if d not in self._flagged and d not in slow_now]
        if healthy:
            self._round_trips.append(statistics.median(healthy))
        if not self._flagged and not slow_now and sample.allreduce_ms > 0:
            self._allreduce_ms = sample.allreduce_ms
        # A link's speed is measured against the healthy round trip the planner is given as p2p_ms, so
        # that p2p_ms / link_speed is the round trip this device was measured at.
        reference = self.p2p_ms or median
        events: list[dict[str, Any]] = []
        for device, ms in sorted(fastest.items()):
            speed = min(1.0, reference / ms) if device in significant else 1.0
            history = self._history.setdefault(device, deque(maxlen=self.window))
            history.append(speed)
            events.extend(self._decide(device, statistics.median(history), sample.step))
        return events

    def _decide(self, device: int, speed: float, step: int) -> list[dict[str, Any]]:
        slow = device in self._flagged
        crossing = speed >= self.recovery_threshold if slow else speed < self.slow_threshold
        self._streak[device] = self._streak.get(device, 0) + 1 if crossing else 0
        if slow and not crossing and abs(speed - self._flagged[device]) > 0.1:
            self._flagged[device] = round(speed, 3)  # still slow, at another speed: plan for it
            self.version += 1
            return [{"event": "slow_link_detected", "step": step, "rank": device, "link_speed": round(speed, 3)}]
        if self._streak[device] < self.patience:
            return []
        self._streak[device] = 0
        self.version += 1
        if slow:
            del self._flagged[device]
            return [{"event": "slow_link_recovered", "step": step, "rank": device, "link_speed": round(speed, 3)}]
        self._flagged[device] = round(speed, 3)
        return [{"event": "slow_link_detected", "step": step, "rank": device, "link_speed": round(speed, 3)}]

    # -------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Plain data: estimates' history, streaks, flags, measured costs, counters."""
        return {
            "version": self.version,
            "probes": self.probes,
            "history": {d: list(h) for d, h in self._history.items()},
            "streak": dict(self._streak),
            "flagged": dict(self._flagged),
            "round_trips": list(self._round_trips),
            "allreduce_ms": self._allreduce_ms,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.version = int(state["version"])
        self.probes = int(state["probes"])
        self._history = {int(d): deque(h, maxlen=self.window) for d, h in state["history"].items()}
        self._streak = {int(d): int(s) for d, s in state["streak"].items()}
        self._flagged = {int(d): float(s) for d, s in state["flagged"].items()}
        self._round_trips = deque(state["round_trips"], maxlen=self.window)
        self._allreduce_ms = state["allreduce_ms"]
