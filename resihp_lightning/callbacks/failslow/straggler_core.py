"""Fail-slow detection core: per-rank speed estimates from busy compute time, plain Python + numpy.

Two halves, so that only a few numbers per rank travel between processes:

* :class:`LocalTracker` runs on each rank. It fits the rank's own workload model
  (:mod:`.workload_model`) on its micro-batches after a warm-up and turns each later step into one
  number, ``ratio`` = median over the step's micro-batches of predicted / observed time (1.0 while
  the device runs as it did during the fit). It returns a small :class:`RankSummary`.
* :class:`StragglerCore` sees every rank's summary (after an all-gather, so every rank holds the same
  state and takes the same decisions) and keeps, per rank, a speed estimate, a flag and the events.

A rank's raw step speed is ``raw = anchor * ratio``; ``anchor`` is the speed the device had when its
current model was fitted (1.0 at the start; the last estimate when a re-plan gave the rank new layers
and its model was refitted on the device as it then was). Its *speed* in a step is that raw speed
divided by the median raw speed of the other unflagged ranks in the same step
(``StragglerCore._relative_to_fleet`` says why: it removes what changes for every rank at once,
e.g. the CPU a waiting rank leaves to the others on shared cores). A rank is *slow this step* when

1. it departs from its own history and the fleet: ``speed < gpu_individual_perf_threshold`` and the
   drop exceeds ``significance`` times the model's residual scale for that many micro-batches, and
2. it departs from its stage cohort (the data-parallel peers holding the same layers):
   ``speed / median(peers' speeds) < gpu_relative_perf_threshold``. A slowdown shared by the whole
   cohort is therefore not a straggler. Without a cohort (D = 1, or per-replica partitions)
   condition 1 alone decides, its significance test guarding against noise.

With ``window`` > 1 both tests apply to the median of the rank's last ``window`` step speeds, and
the noise term shrinks accordingly (for noisy clocks, e.g. oversubscribed CPUs).
``patience`` consecutive slow steps flag the rank; its reported speed is the median of its speeds
over those slow steps (so 0.5 for a device at half speed); with ``window`` > 1 a step counts as slow
only once the rank has ``window`` step speeds. A flagged rank heals after ``patience`` consecutive
steps whose median speed *since the first of them* (at most ``window`` steps) is
``>= recovery_threshold``: the slow steps still in the window do not hold the healed device back,
so healing is reported as fast as the fault was. A flagged rank whose estimate (the median of the
last ``max(patience, window)`` speeds) stays more than ``speed_change_threshold`` (relative) away from
its reported speed for ``patience`` steps is reported again with the new speed; the median of the
rank's speeds over its slow episode refines the reported speed the same way (``StragglerCore._follow``).

When a rank's model is (re)fitted, the anchor comes from its cohort if it has one: every member's
model is evaluated at the cohort's typical micro-batch, and a rank predicted slower than the cohort
reference by more than ``gpu_relative_perf_threshold`` starts with that relative speed. So a device
that was already slow while its model was fitted (from the start, or a fault during the refit after a
re-plan) is still found, and a rank flagged in error is cleared. Known limit: without a cohort (D = 1
or per-replica partitions) the anchor can only be carried over, and such a device is not found.

Both halves have ``state_dict()`` / ``load_state_dict()`` returning plain data (numbers, strings,
lists, tuples, dicts), so that a resumed job keeps its fitted models, flags and speed estimates.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from resihp_lightning.callbacks.failslow.workload_model import OnlineWorkloadFit
from resihp_lightning.errors import invalid_option
from resihp_lightning.telemetry import StepStats

#: Steps of a slow episode whose median refines a flagged rank's reported speed.
EPISODE_STEPS = 32
#: Asymptotic standard error of a median relative to a mean: sqrt(pi / 2).
_MEDIAN_SE = math.sqrt(math.pi / 2)


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """Options of the straggler detector (names shared with NVIDIA's ``StragglerDetectionCallback``
    keep their meaning; scores here are workload-normalised speeds, 1.0 = healthy).

    Attributes:
        report_time_interval: seconds between cross-rank reports; ``None`` reports every
            ``report_interval_steps`` steps. When set, the step interval is derived from the measured
            step time (the same on every rank, so every rank gathers at the same step).
        report_interval_steps: steps between cross-rank reports (>= 1) when no time interval is set.
        calc_relative_gpu_perf: compute and log ``gpu_relative_perf/{min,median,max}`` (speed of a
            rank divided by the fastest rank's).
        calc_individual_gpu_perf: compute and log ``gpu_individual_perf/{min,median,max}`` (speed of a
            rank divided by its own best).
        num_gpu_perf_scores_to_print: print this many of the lowest speeds at each report (rank 0; 0 = off).
        gpu_relative_perf_threshold: a rank departs from its cohort when its speed divided by the
            cohort median is below this (0 < x < 1).
        gpu_individual_perf_threshold: a rank departs from its own history when its speed is below
            this (0 < x < 1). 0.9 detects 1.2x slowdowns; NVIDIA's default 0.75 would miss them.
        stop_if_detected: stop training (``trainer.should_stop``) when a rank is flagged.
        enable_ptl_logging: log the scores through the Lightning logger.
        warmup_steps: steps skipped before fitting a rank's workload model (also after a re-plan).
        fit_steps: steps whose micro-batches fit the model.
        patience: consecutive slow (or healthy) steps before a rank is flagged (or cleared).
        window: steps pooled (median) into each step's decision; 1 decides on the step alone. Raise it
            where timing noise is large (oversubscribed CPUs): the noise of the pooled speed shrinks
            by sqrt(window), at the cost of up to ``window - 1`` steps of extra latency.
        recovery_threshold: speed (relative to the other ranks, median over the steps since the
            healing began) at or above which a flagged rank counts as healthy again.
        significance: a drop must exceed this many standard errors of the step's speed.
        speed_change_threshold: re-report a flagged rank when its estimate stays this fraction away
            from the reported speed for ``patience`` steps.
        min_cohort: the fewest ranks (itself included) that make a cohort.
        link_probe_interval_steps: probe the links every this many steps after the warm-up (0 = off),
            and at every step while a link's flag change awaits its ``link_patience`` confirmations:
            round trips between pairs of ranks and one all-reduce, timed at a step boundary
            (``strategy.measure_links()``); they name slow links and give the planner measured
            ``p2p_ms`` / ``allreduce_ms`` (:mod:`.link_core`).
        link_probe_rounds: partners each rank meets per probe (a slow link is named only on a device
            that met at least two).
        link_slow_threshold: a device's link is flagged below this speed (its fastest round trip vs
            the median device's; 0 < x < 1).
        link_recovery_threshold: a flagged link is cleared at or above this speed.
        link_patience: consecutive probes past a threshold before a link's flag changes.
        link_window: probes pooled (median) into a link's speed estimate.
        link_min_extra_ms: a probe reads a link slow only when its round trip exceeds the median
            device's by at least this many ms (sub-millisecond round trips are noisy; >= 0).
        member_threshold: under tensor parallelism, a group member is named slow when its own compute
            (busy time minus its wait in the group's all-reduces) is at least this many times its group's
            other members' median (> 1; :mod:`.member_core`).
        member_patience: consecutive steps (after ``warmup_steps``) before a member's flag changes (>= 1).
        probe_interval_steps: devices that nothing else measures are timed on the same fixed work this
            often (:mod:`~resihp_lightning.torch_utils.speed_probe`): under tensor parallelism, while a
            member dropped from its group is flagged as a device of its own, every process probes; while
            a flagged device is idle (a hot spare a plan left out for slowness), it probes and shares its
            time, and the members probe to compare. Such a device is cleared when its probe speed is at
            least ``2 / (1 + member_threshold)`` of the members' median (where the member core clears a
            member) for ``patience`` probes in a row; a cleared spare can be taken back by the next plan.
            0: no probes.
    """

    report_time_interval: float | None = None
    report_interval_steps: int = 1
    calc_relative_gpu_perf: bool = True
    calc_individual_gpu_perf: bool = True
    num_gpu_perf_scores_to_print: int = 0
    gpu_relative_perf_threshold: float = 0.9
    gpu_individual_perf_threshold: float = 0.9
    stop_if_detected: bool = False
    enable_ptl_logging: bool = True
    warmup_steps: int = 2
    fit_steps: int = 10
    patience: int = 3
    window: int = 1
    recovery_threshold: float = 0.95
    significance: float = 4.0
    speed_change_threshold: float = 0.1
    min_cohort: int = 2
    link_probe_interval_steps: int = 5
    link_probe_rounds: int = 3
    link_slow_threshold: float = 0.7
    link_recovery_threshold: float = 0.9
    link_patience: int = 2
    link_window: int = 3
    link_min_extra_ms: float = 0.5
    member_threshold: float = 2.0
    member_patience: int = 3
    probe_interval_steps: int = 1

    def __post_init__(self) -> None:
        if self.report_time_interval is not None and not (
            _is_number(self.report_time_interval) and self.report_time_interval > 0
        ):
            raise invalid_option("detector.report_time_interval", self.report_time_interval, "null or seconds > 0")
        for name, low in (("report_interval_steps", 1), ("warmup_steps", 0), ("fit_steps", 1), ("patience", 1), ("window", 1),
                          ("num_gpu_perf_scores_to_print", 0), ("min_cohort", 2), ("link_probe_interval_steps", 0),
                          ("link_probe_rounds", 1), ("link_patience", 1), ("link_window", 1), ("member_patience", 1),
                          ("probe_interval_steps", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise invalid_option(f"detector.{name}", value, f"an integer >= {low}")
        for name in ("gpu_relative_perf_threshold", "gpu_individual_perf_threshold", "recovery_threshold",
                     "link_slow_threshold", "link_recovery_threshold"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 < value < 1:
                raise invalid_option(f"detector.{name}", value, "a number strictly between 0 and 1")
        if self.recovery_threshold < self.gpu_individual_perf_threshold:
            raise invalid_option(
                "detector.recovery_threshold", self.recovery_threshold,
                f"a number >= gpu_individual_perf_threshold ({self.gpu_individual_perf_threshold}) so flags do not flap",
            )
        if self.link_recovery_threshold < self.link_slow_threshold:
            raise invalid_option(
                "detector.link_recovery_threshold", self.link_recovery_threshold,
                f"a number >= link_slow_threshold ({self.link_slow_threshold}) so flags do not flap",
            )
        if not _is_number(self.member_threshold) or not self.member_threshold > 1:
            raise invalid_option("detector.member_threshold", self.member_threshold, "a number > 1")
        for name in ("significance", "speed_change_threshold", "link_min_extra_ms"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise invalid_option(f"detector.{name}", value, "a number >= 0")
        for name in ("calc_relative_gpu_perf", "calc_individual_gpu_perf", "stop_if_detected", "enable_ptl_logging"):
            if not isinstance(getattr(self, name), bool):
                raise invalid_option(f"detector.{name}", getattr(self, name), "true or false")


@dataclass(frozen=True)
class RankSummary:
    """What one rank reports about one step (small and picklable).

    Attributes:
        step, rank, replica, stage, layers: as in :class:`~resihp_lightning.telemetry.StepStats`.
        ratio: median predicted / observed time over the step's micro-batches; ``None`` while the
            rank's workload model is not fitted yet.
        micro_batches: how many micro-batches the ratio summarises.
        fit_id: counts the rank's model fits (changes when the model was refitted).
        rel_scale: the model's relative residual scale (noise of one micro-batch).
        busy_ms: total busy compute time of the step (for raw-time baselines and logging).
        step_ms: the step's wall time.
        model: ``(alpha, beta, gamma, ref_tokens, ref_sum_len_sq)`` of the rank's current workload
            model (``None`` before the first fit), for comparing models within a cohort.
    """

    step: int
    rank: int
    replica: int
    stage: int
    layers: tuple[int, int]
    ratio: float | None
    micro_batches: int
    fit_id: int
    rel_scale: float
    busy_ms: float
    step_ms: float
    model: tuple[float, float, float, float, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain data (for checkpoints)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankSummary:
        values = dict(data)
        values["layers"] = tuple(values["layers"])
        values["model"] = None if values["model"] is None else tuple(values["model"])
        return cls(**values)


class LocalTracker:
    """One rank's half of the detector: fits its workload model, summarises each step."""

    def __init__(self, warmup_steps: int = 2, fit_steps: int = 10) -> None:
        self.fit = OnlineWorkloadFit(warmup_steps, fit_steps)

    def state_dict(self) -> dict[str, Any]:
        """This rank's workload model and fit progress, as plain data."""
        return self.fit.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.fit.load_state_dict(state)

    def summarize(self, stats: StepStats) -> RankSummary:
        """Feeds one step and returns its summary."""
        mbs = stats.micro_batches
        samples = [(float(mb.tokens), float(mb.sum_len_sq), float(mb.compute_ms)) for mb in mbs]
        # A tensor-parallel group of another degree runs the same layers at another speed: a new model.
        key = tuple(stats.layers) if stats.tensor_degree == 1 else (*stats.layers, stats.tensor_degree)
        self.fit.add_step(key, samples)
        model = self.fit.model
        ratio = None
        count = 0
        if model is not None:
            # Plain Python: a step has a handful of micro-batches, where numpy's call overhead dominates.
            a, b, g = model.coefficients
            ratios = [max(a * t + b * s + g, 1e-9) / y for t, s, y in samples if y > 0]
            if ratios:
                ratio = statistics.median(ratios)
                count = len(ratios)
        return RankSummary(
            step=stats.step,
            rank=stats.rank,
            replica=stats.replica,
            stage=stats.stage,
            layers=tuple(stats.layers),
            ratio=ratio,
            micro_batches=count,
            fit_id=self.fit.fits,
            rel_scale=model.rel_scale if model is not None else 0.0,
            busy_ms=float(sum(mb.compute_ms for mb in mbs)),
            step_ms=float(stats.step_ms),
            model=None if model is None else (*model.coefficients, model.ref_tokens, model.ref_sum_len_sq),
        )


@dataclass
class _RankState:
    fit_id: int = 0
    anchor: float = 1.0
    flagged: bool = False
    speed: float = 1.0
    last_raw: float | None = None
    best_raw: float = 0.0
    slow_streak: int = 0
    healthy_streak: int = 0
    change_streak: int = 0
    refine_streak: int = 0
    #: flagged from another source (a member named slow that became a device of its own): its
    #: healing may need a probe (its model may describe it slow, with no peer to compare with)
    seeded: bool = False
    history: deque = field(default_factory=deque)
    #: the speeds of the current slow episode (since the streak that flagged it or the last change)
    episode: deque = field(default_factory=lambda: deque(maxlen=EPISODE_STEPS))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("history", "episode")}
        out["history"] = [float(v) for v in self.history]
        out["episode"] = [float(v) for v in self.episode]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], history_len: int) -> _RankState:
        values = {k: v for k, v in data.items() if k not in ("history", "episode")}
        return cls(**values, history=deque(data["history"], maxlen=history_len),
                   episode=deque(data.get("episode", ()), maxlen=EPISODE_STEPS))


class StragglerCore:
    """The cross-rank half: speeds, flags, healing and NVRx-style scores from every rank's summary.

    Args:
        config: detector options.
    """

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self._states: dict[int, _RankState] = {}
        self.version = 0  # bumps whenever a flag or a reported speed changes
        self.last_step: int | None = None
        self.scores: dict[str, dict[int, float]] = {}

    # ------------------------------------------------------------------------------- results
    @property
    def speeds(self) -> dict[int, float]:
        """Speed per known rank: the estimate for flagged ranks, 1.0 for the others."""
        return {rank: (s.speed if s.flagged else 1.0) for rank, s in sorted(self._states.items())}

    @property
    def raw_speeds(self) -> dict[int, float]:
        """The latest unsmoothed step speed of every rank that has one."""
        return {rank: s.last_raw for rank, s in sorted(self._states.items()) if s.last_raw is not None}

    @property
    def flagged(self) -> list[int]:
        return sorted(rank for rank, s in self._states.items() if s.flagged)

    def forget(self, rank: int) -> None:
        """Drops a rank (it left the job)."""
        self._states.pop(rank, None)

    def reseat(self, rank: int, speed: float | None = None) -> None:
        """Device id ``rank`` now names other hardware (a tensor-parallel group formed anew): its history is
        dropped; with ``speed`` it starts flagged at that speed (it holds a member known to be slow), so its
        next model fit is anchored there and its healing is reported like any flagged device's. The version
        does not change: the speeds the plan was made with are the same (no re-plan is due)."""
        state = _RankState(history=deque(maxlen=self._history_len()))
        if speed is not None:
            state.flagged, state.speed, state.anchor, state.seeded = True, float(speed), float(speed), True
        self._states[rank] = state

    def clear_idle(self, rank: int, step: int, probe_speed: float) -> dict[str, Any] | None:
        """An idle device (a hot spare) that its speed probe found healed: unflagged, its history dropped
        (it is measured afresh when a plan uses it again), and the version bumps, so that a re-plan may
        take it back. Returns the ``fail_slow_recovered`` event, or ``None`` when it was not flagged."""
        state = self._states.get(rank)
        if state is None or not state.flagged:
            return None
        self._states[rank] = _RankState(history=deque(maxlen=self._history_len()))
        self.version += 1
        return self._event("fail_slow_recovered", step, rank, probe_speed)

    @property
    def seeded(self) -> list[int]:
        """Flagged ranks that were started flagged by :meth:`reseat`, ascending."""
        return sorted(rank for rank, s in self._states.items() if s.flagged and s.seeded)

    # ---------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Every rank's speed estimate, flag, streaks and recent step speeds, as plain data."""
        return {
            "version": self.version,
            "last_step": self.last_step,
            "scores": {name: {rank: float(v) for rank, v in values.items()} for name, values in self.scores.items()},
            "ranks": {rank: state.to_dict() for rank, state in sorted(self._states.items())},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned (the history keeps the current config's length)."""
        history_len = self._history_len()
        self.version = int(state["version"])
        self.last_step = state["last_step"]
        self.scores = {name: dict(values) for name, values in state["scores"].items()}
        self._states = {int(rank): _RankState.from_dict(data, history_len) for rank, data in state["ranks"].items()}

    def _history_len(self) -> int:
        return max(self.config.patience, self.config.window)

    # -------------------------------------------------------------------------------- update
    def update(self, summaries: Iterable[RankSummary]) -> list[dict[str, Any]]:
        """Folds one step's summaries (one per rank) into the state.

        Returns:
            Events as dicts ``{"event", "step", "rank", "speed"}`` with event ``fail_slow_detected``
            or ``fail_slow_recovered``.
        """
        cfg = self.config
        summaries = [s for s in summaries if s is not None]
        raws: dict[int, float] = {}
        noise: dict[int, float] = {}
        layers_of: dict[int, tuple[int, int]] = {}
        step = max((s.step for s in summaries), default=self.last_step)
        self.last_step = step
        for summary in summaries:
            state = self._states.setdefault(summary.rank, _RankState(history=deque(maxlen=self._history_len())))
            if summary.ratio is None or not summary.ratio > 0:
                continue
            if summary.fit_id != state.fit_id:
                # A new model was fitted on the device as it is now: its speed comes from comparing
                # its model with its cohort's, or, without a cohort, is carried across the refit.
                cohort_anchor = self._cohort_anchor(summary, summaries)
                if cohort_anchor is not None:
                    state.anchor = cohort_anchor
                else:
                    state.anchor = state.speed if state.flagged else 1.0
                state.fit_id = summary.fit_id
            raws[summary.rank] = state.anchor * summary.ratio
            noise[summary.rank] = state.anchor * summary.rel_scale * _MEDIAN_SE / math.sqrt(max(summary.micro_batches, 1))
            layers_of[summary.rank] = summary.layers
        relative = self._relative_to_fleet(raws)
        pooled_rel: dict[int, float] = {}
        for rank, rel in relative.items():
            recent = list(self._states[rank].history)[-(cfg.window - 1):] + [rel] if cfg.window > 1 else [rel]
            pooled_rel[rank] = statistics.median(recent)
        cohort_median = self._cohort_medians(pooled_rel, layers_of)
        events: list[dict[str, Any]] = []
        for rank, raw in raws.items():
            state = self._states[rank]
            state.last_raw = raw
            state.best_raw = max(state.best_raw, raw)
            pooled_n = min(cfg.window, len(state.history) + 1)
            state.history.append(relative[rank])
            pooled = pooled_rel[rank]
            own = pooled < cfg.gpu_individual_perf_threshold and (1.0 - pooled) > cfg.significance * noise[rank] / math.sqrt(pooled_n)
            med = cohort_median.get(rank)
            cohort = med is None or pooled / med < cfg.gpu_relative_perf_threshold
            # With window > 1, decide only on a full window: right after the first fit a median of
            # one or two noisy steps would otherwise count towards patience (a false alarm seen on
            # oversubscribed CPUs).
            slow = own and cohort and len(state.history) >= cfg.window
            state.slow_streak = state.slow_streak + 1 if slow else 0
            # Healing is judged on the steps since it began (at most ``window``), not on a window that
            # still holds the slow steps: a healed device is reported within ``patience`` steps.
            since = list(state.history)[-min(cfg.window, state.healthy_streak + 1):]
            healed = statistics.median(since) >= cfg.recovery_threshold
            state.healthy_streak = state.healthy_streak + 1 if healed else 0
            if not state.flagged:
                if state.slow_streak >= cfg.patience:
                    # The steps of the streak are all slow ones (the pooled test lags the fault).
                    state.episode = deque(list(state.history)[-state.slow_streak:], maxlen=EPISODE_STEPS)
                    estimate = statistics.median(state.episode)
                    state.flagged, state.speed = True, estimate
                    state.change_streak = state.refine_streak = 0
                    events.append(self._event("fail_slow_detected", step, rank, estimate))
            elif state.healthy_streak >= cfg.patience:
                state.flagged, state.speed, state.seeded = False, 1.0, False
                state.slow_streak = 0
                events.append(self._event("fail_slow_recovered", step, rank, statistics.median(since)))
            else:
                event = self._follow(state, cfg)
                if event is not None:
                    events.append(self._event("fail_slow_detected", step, rank, event))
        if events:
            self.version += 1
        self._update_scores(raws)
        return events

    @staticmethod
    def _follow(state: _RankState, cfg: StragglerConfig) -> float | None:
        """A flagged, not healed rank: returns a new speed to report, or ``None``.

        Two estimates: ``recent``, the median of the last ``max(patience, window)`` speeds, and
        ``settled``, the median of the episode (its speeds since it was flagged or last changed, at
        most :data:`EPISODE_STEPS`). One step's speed is noisy (on shared CPUs +-40%), so the first
        report, from the few steps of the flagging streak, is refined by the episode: when
        ``settled`` stays more than ``speed_change_threshold`` away from the reported speed for
        ``patience`` steps, it is reported. A real change of the device's speed moves every recent
        speed to one side of the reported speed and ``recent`` away from both the reported speed and
        ``settled``; after ``patience`` such steps ``recent`` is reported and the episode starts
        again from the recent steps (a few noisy steps on both sides, the usual excursion on shared
        CPUs, are no change).
        """
        threshold = cfg.speed_change_threshold
        state.episode.append(state.history[-1])
        recent = statistics.median(state.history)
        settled = statistics.median(state.episode)
        one_side = all(v < state.speed for v in state.history) or all(v > state.speed for v in state.history)
        changed = (one_side and recent < cfg.recovery_threshold and abs(recent - state.speed) > threshold * state.speed
                   and abs(recent - settled) > threshold * settled)
        state.change_streak = state.change_streak + 1 if changed else 0
        if state.change_streak >= cfg.patience:
            state.episode = deque(state.history, maxlen=EPISODE_STEPS)
            state.speed, state.change_streak, state.refine_streak = recent, 0, 0
            return recent
        refine = len(state.episode) >= 2 * len(state.history) and abs(settled - state.speed) > threshold * state.speed
        state.refine_streak = state.refine_streak + 1 if refine else 0
        if state.refine_streak >= cfg.patience:
            state.speed, state.refine_streak = settled, 0
            return settled
        return None

    def _relative_to_fleet(self, raws: Mapping[int, float]) -> dict[int, float]:
        """Each rank's step speed divided by the median step speed of the other unflagged ranks.

        This is where the speed estimate is built. A rank's raw speed compares its busy time with
        its own model, fitted while the job was healthy, so it also moves with everything that
        changes for *every* rank at once: on shared CPU cores, a slowed rank that waits leaves its
        cores to the others, whose compute then runs faster (healthy ranks read 1.2-1.4 in the demo
        while one rank runs at half speed), and the slowed rank's own compute gets the cores more
        easily too, so its raw speed reads high (0.62-0.72 for a 2x fault). Such job-wide effects
        (contention, clocks, data) shift every rank alike, and dividing by the healthy fleet's speed
        in the same step removes them; what is left is how much slower the rank is than the devices
        the planner would move its work to, which is what the planner's speeds mean. Without other
        ranks (or when every other rank is flagged) the reference is 1.0.

        What it cannot remove is contention that differs *between* ranks: with two processes per
        core the slowed rank's compute, timed while the others wait on it, is relieved more than
        theirs, and a 3x fault reads 0.35-0.39 instead of 0.33. With one process per device (or per
        core) the estimate is within about 5% of 1/factor for 1.5x, 2x and 3x (benchmarks/README.md).
        """
        flagged = {rank for rank, state in self._states.items() if state.flagged}
        pool = sorted(v for r, v in raws.items() if r not in flagged)  # O(N log N) for any number of ranks
        out: dict[int, float] = {}
        for rank, raw in raws.items():
            skip = None if rank in flagged else bisect.bisect_left(pool, raw)  # the rank's own entry
            reference = _median_without(pool, skip)
            out[rank] = raw / max(reference, 1e-9) if reference is not None else raw
        return out

    def _cohort_anchor(self, summary: RankSummary, summaries: Sequence[RankSummary]) -> float | None:
        """The rank's speed relative to its cohort, from the members' workload models.

        Every member's model is evaluated at the cohort's typical micro-batch; the reference is the
        median prediction (the faster of two with a cohort of two). Returns ``None`` without a
        cohort, 1.0 when the rank is within ``gpu_relative_perf_threshold`` of the reference.
        """
        members = [s for s in summaries if s.layers == summary.layers and s.model is not None]
        if summary.model is None or len(members) < self.config.min_cohort:
            return None
        tokens = statistics.median(s.model[3] for s in members)
        sq = statistics.median(s.model[4] for s in members)
        preds = {s.rank: max(s.model[0] * tokens + s.model[1] * sq + s.model[2], 1e-9) for s in members}
        reference = statistics.median(preds.values()) if len(preds) >= 3 else min(preds.values())
        relative = reference / preds[summary.rank]
        return relative if relative < self.config.gpu_relative_perf_threshold else 1.0

    def _cohort_medians(self, speeds: dict[int, float], layers_of: dict[int, tuple[int, int]]) -> dict[int, float]:
        """Per rank: the median speed of its cohort's *other* members (its peers). With a cohort of two,
        a median that included the rank itself would halve any departure."""
        groups: dict[tuple[int, int], list[int]] = {}
        for rank, layers in layers_of.items():
            groups.setdefault(layers, []).append(rank)
        medians: dict[int, float] = {}
        for ranks in groups.values():
            if len(ranks) >= self.config.min_cohort:
                for r in ranks:
                    medians[r] = statistics.median([speeds[o] for o in ranks if o != r])
        return medians

    def _update_scores(self, raws: dict[int, float]) -> None:
        if not raws:
            return
        best = max(raws.values())
        scores: dict[str, dict[int, float]] = {}
        if self.config.calc_relative_gpu_perf:
            scores["gpu_relative_perf"] = {r: v / best for r, v in raws.items()}
        if self.config.calc_individual_gpu_perf:
            scores["gpu_individual_perf"] = {r: v / max(self._states[r].best_raw, 1e-12) for r, v in raws.items()}
        self.scores = scores

    def score_summary(self) -> dict[str, float]:
        """``{"gpu_relative_perf/min": ..., ".../median", ".../max", ...}`` from the latest scores."""
        out: dict[str, float] = {}
        for name, values in self.scores.items():
            arr = np.fromiter(values.values(), dtype=float)
            out[f"{name}/min"] = float(arr.min())
            out[f"{name}/median"] = float(np.median(arr))
            out[f"{name}/max"] = float(arr.max())
        return out

    @staticmethod
    def _event(event: str, step: int | None, rank: int, speed: float) -> dict[str, Any]:
        return {"event": event, "step": step, "rank": rank, "speed": round(float(speed), 4)}


def run_on_trace(trace: Sequence[Sequence[StepStats]], config: StragglerConfig | None = None) -> tuple[StragglerCore, list[dict[str, Any]]]:
    """Runs the whole detector (one tracker per rank + the core) over a recorded trace.

    Args:
        trace: ``trace[t]`` holds every rank's StepStats of step t.
        config: detector options.

    Returns:
        The core after the last step and every event it produced, in order.
    """
    config = config or StragglerConfig()
    trackers: dict[int, LocalTracker] = {}
    core = StragglerCore(config)
    events: list[dict[str, Any]] = []
    for step_stats in trace:
        summaries = []
        for stats in step_stats:
            tracker = trackers.get(stats.rank)
            if tracker is None:
                tracker = trackers[stats.rank] = LocalTracker(config.warmup_steps, config.fit_steps)
            summaries.append(tracker.summarize(stats))
        events.extend(core.update(summaries))
    return core, events


def _median_without(values: Sequence[float], skip: int | None) -> float | None:
    """The median of sorted ``values`` without the entry at index ``skip`` (``None``: all of them)."""
    n = len(values) - (skip is not None)
    if n <= 0:
        return None

    def at(k: int) -> float:
        return values[k + 1 if skip is not None and k >= skip else k]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2.0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
