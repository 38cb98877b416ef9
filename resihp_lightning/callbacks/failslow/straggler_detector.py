"""``StragglerDetector``: the Lightning callback around the fail-slow core (:mod:`.straggler_core`).

Each rank reads ``trainer.strategy.last_step_stats`` (its own busy compute per micro-batch and the
micro-batches' workload; the strategy must provide :class:`~resihp_lightning.contract.StepStatsSource`,
checked at ``setup``) in ``on_train_batch_end`` and summarises it locally. Every report interval
the summaries are all-gathered over the default process group (``all_gather_object``), so every rank
folds the same data into its own :class:`~.straggler_core.StragglerCore` and holds the same speeds, flags
and events, which lets a controller act on them without another round of communication.

Links: every ``link_probe_interval_steps`` after the warm-up, when the strategy provides
:class:`~resihp_lightning.contract.LinkProber`, the detector runs ``strategy.measure_links()`` (a
collective at the step boundary) and folds it into a :class:`~.link_core.LinkCore`: a slow link is named
like a slow device (``slow_link_detected`` / ``slow_link_recovered``), and the measured ``p2p_ms`` /
``allreduce_ms`` and per-device ``link_speeds`` are what the controller gives the planner.

Rank 0 writes ``fail_slow_detected`` / ``fail_slow_recovered`` (and the link events) to the event log and logs
``gpu_relative_perf/{min,median,max}`` and ``gpu_individual_perf/{min,median,max}`` (the metric names
of NVIDIA's ``StragglerDetectionCallback``) through the Lightning logger.

Checkpoints (Lightning's ``state_dict`` / ``load_state_dict``): the detector saves the core (every
rank's speed estimate, flag, streaks, recent step speeds, the version counter), every rank's
workload model or fit progress and its summaries not yet reported, and the report schedule. A
job resumed mid-fault therefore still knows the slow rank, and measures the next step against the
saved models without a new warm-up and fit. Lightning writes rank 0's ``state_dict`` and loads it on
every rank, so ``state_dict`` gathers the per-rank parts (it is a collective, like the strategy's own
checkpoint gathering: Lightning calls it on every rank) and each rank takes its own back on load.
The list of ``StragglerDetector.detections`` is not saved (the event log keeps them).
"""

from __future__ import annotations

import statistics
import time

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from resihp_lightning._logging import get_logger, user_info
from resihp_lightning.callbacks.events import EventLog
from resihp_lightning.callbacks.failslow.link_core import LinkCore
from resihp_lightning.callbacks.failslow.member_core import MemberCore, MemberSample
from resihp_lightning.callbacks.failslow.straggler_core import (
    StragglerConfig,
    LocalTracker,
    RankSummary,
    StragglerCore,
)
from resihp_lightning.torch_utils.collectives import all_gather_objects, broadcast_from_zero
from resihp_lightning.torch_utils.speed_probe import PROBE, probe_in_turns, relative_speeds
from resihp_lightning.config import config_from_options
from resihp_lightning.contract import (
    IdleProbes, LinkProber, Replannable, StepStatsSource, Survivable, provides, reports_device, require, tensor_degree_of,
)

log = get_logger(__name__)

#: A spare's probe: the fastest of the rounds that fit in this many seconds, this far apart (``share_idle_probe``).
IDLE_PROBE_BUDGET_S, IDLE_PROBE_PAUSE_S = 0.05, 0.01


class StragglerDetector(Callback):
    """Per-rank speed estimates (1.0 healthy, 0.5 half speed) from workload-normalised busy time.

    Args:
        config: detector options; alternatively pass them as keyword arguments (same names).
        events: the event log; default ``<trainer.log_dir>/events.jsonl``.
        log_dir: where to put the default event log instead of the trainer's log directory.
        **options: fields of :class:`~.straggler_core.StragglerConfig` (when ``config`` is not given).
    """

    def __init__(
        self,
        config: StragglerConfig | None = None,
        *,
        events: EventLog | None = None,
        log_dir: str | None = None,
        **options: Any,
    ) -> None:
        self.config = config_from_options(StragglerConfig, config, options, "StragglerDetector")
        self.events = events
        self.log_dir = log_dir
        self.core = StragglerCore(self.config)
        self.tracker = LocalTracker(self.config.warmup_steps, self.config.fit_steps)
        cfg = self.config
        self.links = LinkCore(cfg.link_slow_threshold, cfg.link_recovery_threshold, cfg.link_patience, cfg.link_window,
                              cfg.link_min_extra_ms)
        self._probe_links = False
        self.members = MemberCore(cfg.member_threshold, cfg.member_patience, cfg.warmup_steps)
        self._pending_members: list[MemberSample] = []
        self._tensor_job = False  # the job has tensor-parallel groups (set at setup)
        #: Under tensor parallelism: the members of every group (process ids by device id) and the processes'
        #: ranks, as the last folded step saw them; the same on every rank.
        self._layout: dict[int, tuple[int, ...]] = {}
        self._ranks: dict[int, int] = {}
        self.last_members: list[MemberSample] = []
        self._reported_device: int | None = None  # the device this process reports for (None: it reports none)
        self._probe_streaks: dict[int, int] = {}  # device -> probes in a row at a healed speed (same on every rank)
        self._idle_probe_seen: dict[int, int] = {}  # idle device -> the step of its last probe counted
        self._idle_since_sync = False  # this process was a spare since its state was last synced
        self._idle_probes = False  # the strategy shares spares' probes (IdleProbes): set in setup
        self.detections: list[dict[str, Any]] = []
        self.rank = 0
        self._pending: list[RankSummary] = []
        self._interval = self.config.report_interval_steps
        self._last_step: int | None = None
        self._next_report: int | None = None

    # ------------------------------------------------------------------------------ results
    @property
    def speeds(self) -> dict[int, float]:
        """Speed per rank (flagged ranks: their estimate; others 1.0); the same on every rank."""
        return self.core.speeds

    @property
    def member_speeds(self) -> dict[int, float]:
        """Under tensor parallelism: the speed of each process named as its group's slow member, by process
        id (its global rank at the start); the same on every rank."""
        return dict(self.members.flagged)

    @property
    def tensor_groups(self) -> dict[int, tuple[int, ...]]:
        """Under tensor parallelism: each device's (group's) members as current ranks, in member order, as the
        last folded step saw them (empty before); the same on every rank."""
        return {device: tuple(sorted(self._ranks[p] for p in members)) for device, members in self._layout.items()}

    @property
    def process_ids(self) -> dict[int, int]:
        """Under tensor parallelism: each current rank's process id (its rank at the start), as last seen."""
        return {rank: process for process, rank in self._ranks.items()}

    @property
    def flagged(self) -> list[int]:
        """Ranks flagged slow, ascending (the same on every rank)."""
        return self.core.flagged

    @property
    def link_speeds(self) -> dict[int, float]:
        """Link speed per device whose link is flagged slow (others 1.0); the same on every rank."""
        return self.links.speeds

    @property
    def p2p_ms(self) -> float | None:
        """Measured round trip of one micro-batch's stage-boundary activation (``None``: not probed yet)."""
        return self.links.p2p_ms

    @property
    def allreduce_ms(self) -> float | None:
        """Measured gradient all-reduce per iteration (``None``: not probed yet)."""
        return self.links.allreduce_ms

    @property
    def version(self) -> int:
        """Bumps whenever a flag or reported speed (of a device or a link) changes (same on every rank)."""
        return self.core.version + self.links.version + self.members.version

    # ---------------------------------------------------------------------------- callbacks
    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        require(trainer.strategy, StepStatsSource, "StragglerDetector")
        if provides(trainer.strategy, Survivable) and self._resync not in trainer.strategy.recovery_listeners:
            trainer.strategy.recovery_listeners.append(self._resync)
        self.rank = trainer.global_rank
        # Under tensor parallelism a probe's pairs would mix a group's own members with other groups'.
        probing = self.config.link_probe_interval_steps > 0 and provides(trainer.strategy, LinkProber)
        self._tensor_job = tensor_degree_of(trainer.strategy) > 1
        self._probe_links = probing and not self._tensor_job
        # Checked once: the protocol lookups would otherwise run at every step's end.
        self._idle_probes = provides(trainer.strategy, IdleProbes) and provides(trainer.strategy, Replannable)
        if probing and not self._probe_links:
            user_info("StragglerDetector: links are not probed under tensor parallelism (slow links are not detected)")
        if self.events is None:
            log_dir = self.log_dir or trainer.log_dir or trainer.default_root_dir
            self.events = EventLog(Path(log_dir), rank=self.rank)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy: StepStatsSource = trainer.strategy
        self.rank = trainer.global_rank  # it changes when lost ranks' survivors regroup
        if self.events is not None:
            self.events.rank = self.rank
        if getattr(strategy, "is_spare", False):
            self._idle_since_sync = True  # its cross-rank state stops here (see _resync)
            if self._idle_probes:
                self.share_idle_probe(trainer)
            return  # a spare computes nothing, and joins no collective
        stats = strategy.last_step_stats
        if stats is None or strategy.collectives_interrupted:
            return  # no step measured yet, or the survivors of a lost rank meet again at the next step
        if stats.step == self._last_step:
            return  # no new step
        self._last_step = stats.step
        summary = self.tracker.summarize(stats)
        self._reported_device = None
        if reports_device(strategy):  # one summary per device: a tensor-parallel group's first member
            self._pending.append(summary)
            self._reported_device = stats.rank
        if self._tensor_job:  # every member: its own compute, to name a slow one
            own = sum(mb.compute_ms for mb in stats.micro_batches) - stats.tensor_wait_ms
            process = getattr(strategy, "process_id", trainer.global_rank)
            self._pending_members.append(MemberSample(stats.step, process, stats.rank, own, trainer.global_rank,
                                                      stats.tensor_wait_ms))
        if self._next_report is None:
            self._next_report = stats.step
        if stats.step >= self._next_report:
            self.report(trainer, stats.step)
        if self._tensor_job:
            self.probe_dropped_members(trainer, stats.step)
        else:
            self.probe_idle_devices(trainer, stats.step)
        # Every link_probe_interval_steps; and at the next step while a flag change awaits confirmation
        # (the link core is the same on every rank, so every rank probes at the same step).
        if (self._probe_links and stats.step >= self.config.warmup_steps
                and (stats.step % self.config.link_probe_interval_steps == 0 or self.links.undecided)):
            self.probe_links(trainer)

    def probe_dropped_members(self, trainer: Any, step: int) -> None:
        """While a device that a dropped member became is flagged (:attr:`.straggler_core.StragglerCore.seeded`), every
        ``probe_interval_steps`` every process times the speed probe (collective; the condition is the same
        on every rank); such a device at ``2 / (1 + member_threshold)`` or more of the median (where the member
        core clears a member) for ``patience`` probes in a row is cleared, and measured afresh."""
        interval = self.config.probe_interval_steps
        seeded = self.core.seeded
        if not seeded or not interval or step % interval:
            return
        strategy = trainer.strategy
        device = getattr(strategy, "root_device", "cpu")
        process = getattr(strategy, "process_id", trainer.global_rank)
        done, gathered = strategy.collective(lambda: probe_in_turns(process, device))
        if not done:
            return
        speeds = relative_speeds(gathered)
        for dev in seeded:
            members = self._layout.get(dev, ())
            speed = min((speeds[p] for p in members if p in speeds), default=None)
            if speed is None:
                continue
            healed = speed >= self._probe_clear_speed
            self._probe_streaks[dev] = self._probe_streaks.get(dev, 0) + 1 if healed else 0
            if self._probe_streaks[dev] < self.config.patience:
                continue
            del self._probe_streaks[dev]
            self._reseat(dev)  # healthy, with a model fitted afresh
            event = {"event": "fail_slow_recovered", "step": step, "rank": dev, "speed": speed, "source": "probe"}
            self.detections.append(event)
            self.events.log(event["event"], step, rank=dev, speed=speed, source="probe")
            user_info(f"straggler: rank {dev} recovered (speed probe {speed:.2f}, step {step})")
            self._clear_lone_member(event)

    @property
    def _probe_clear_speed(self) -> float:
        """A probed device's speed at which it counts as healed: where the member core clears a member."""
        return 2.0 / (1.0 + self.config.member_threshold)

    def share_idle_probe(self, trainer: Any) -> None:
        """A spare: every ``probe_interval_steps`` times the speed probe and shares the time (no collective).

        It is idle, so it can afford more rounds, spread over ``IDLE_PROBE_BUDGET_S``, and share the
        fastest: the members time theirs in turns, one process of a machine at a time, while a spare's
        probe may meet a member's compute on a shared host; load only adds time. (A slow device's first
        round already takes the budget: it is not slowed further behind the members it mirrors.)
        """
        interval = self.config.probe_interval_steps
        step = trainer.global_step
        if not interval or step % interval:
            return
        strategy = trainer.strategy
        device = getattr(strategy, "root_device", "cpu")
        deadline = time.monotonic() + IDLE_PROBE_BUDGET_S
        best = PROBE.measure_ms(device)
        while time.monotonic() + IDLE_PROBE_PAUSE_S < deadline:
            time.sleep(IDLE_PROBE_PAUSE_S)
            best = min(best, PROBE.measure_ms(device))
        strategy.share_idle_probe(step, best)

    def probe_idle_devices(self, trainer: Any, step: int) -> None:
        """While a flagged device is idle (a spare), every ``probe_interval_steps`` the members time the speed
        probe (collective) and rank 0 reads the spares' shared times; a flagged spare at ``2 / (1 +
        member_threshold)`` or more of the members' median for ``patience`` fresh probes in a row is cleared
        (``fail_slow_recovered``, the version bumps), so that a plan may take it back. The condition and the
        outcome are the same on every member."""
        strategy = trainer.strategy
        interval = self.config.probe_interval_steps
        if not interval or step % interval or not self._idle_probes:
            return
        idle = set(strategy.devices_alive) - set(strategy.current_plan.device_ids)
        flagged = sorted(idle & set(self.core.flagged))
        for device in set(self._idle_probe_seen) - idle:
            self._idle_probe_seen.pop(device)  # taken back, or gone: a later spell starts afresh
            self._probe_streaks.pop(device, None)
        if not flagged:
            return
        device = getattr(strategy, "root_device", "cpu")
        process = getattr(strategy, "process_id", trainer.global_rank)

        def probe() -> tuple[dict[int, float], dict[int, tuple[int, float]]]:
            members = probe_in_turns(process, device)
            return members, broadcast_from_zero(strategy.idle_probes() if trainer.global_rank == 0 else None)

        done, got = strategy.collective(probe)
        if not done:
            return
        members, shared = got
        median = statistics.median(members.values())
        for dev in flagged:
            if dev not in shared or shared[dev][0] <= self._idle_probe_seen.get(dev, -1):
                continue  # no new probe from it since the last one counted
            probe_step, probe_ms = shared[dev]
            self._idle_probe_seen[dev] = probe_step
            speed = median / probe_ms if probe_ms > 0 else 0.0
            self._probe_streaks[dev] = self._probe_streaks.get(dev, 0) + 1 if speed >= self._probe_clear_speed else 0
            if self._probe_streaks[dev] < self.config.patience:
                continue
            del self._probe_streaks[dev]
            event = self.core.clear_idle(dev, step, speed)
            if event is None:
                continue
            event["source"] = "idle probe"
            self.detections.append(event)
            self.events.log(event["event"], step, rank=dev, speed=event["speed"], source="idle probe")
            user_info(f"straggler: idle rank {dev} recovered (speed probe {speed:.2f}, step {step})")

    def probe_links(self, trainer: Any) -> None:
        """Measures the links now and folds the probe in (collective: every rank at the same step)."""
        strategy = trainer.strategy
        first_round = self.links.probes * self.config.link_probe_rounds
        done, sample = strategy.collective(lambda: strategy.measure_links(first_round))
        if not done:
            return
        for event in self.links.update(sample):
            self.detections.append(event)
            self.events.log(event["event"], event["step"], rank=event["rank"], link_speed=event["link_speed"])
            verb = "is slow" if event["event"] == "slow_link_detected" else "recovered"
            user_info(f"links: rank {event['rank']}'s link {verb} (speed {event['link_speed']:.2f}, step {event['step']})")

    # ------------------------------------------------------------------------------ report
    def report(self, trainer: Any, step: int) -> None:
        """Gathers every rank's pending summaries and folds them into the core (collective)."""
        strategy: StepStatsSource = trainer.strategy
        done, gathered = strategy.collective(lambda: all_gather_objects((self._pending, self._pending_members)))
        if not done:
            return  # a peer was lost: the survivors regrouped and _resync made their state agree
        self._pending, self._pending_members = [], []
        by_step: dict[int, list[RankSummary]] = {}
        members_by_step: dict[int, list[MemberSample]] = {}
        for summaries, members in gathered:
            for summary in summaries or []:
                by_step.setdefault(summary.step, []).append(summary)
            for sample in members or []:
                members_by_step.setdefault(sample.step, []).append(sample)
        step_ms = []
        for at in sorted(set(by_step) | set(members_by_step)):
            if at in members_by_step:
                self._follow_groups(members_by_step[at])
                for event in self.members.update(members_by_step[at]):
                    self._note_member(event)
            if at not in by_step:
                continue
            for event in self.core.update(by_step[at]):
                self.detections.append(event)
                fields_ = {k: v for k, v in event.items() if k not in ("event", "step")}
                self.events.log(event["event"], event["step"], **fields_)
                if event["event"] == "fail_slow_detected":
                    user_info(f"straggler: rank {event['rank']} runs at speed {event['speed']:.2f} (step {event['step']})")
                    self._follow_lone_member(event)
                    if self.config.stop_if_detected:
                        trainer.should_stop = True
                else:
                    user_info(f"straggler: rank {event['rank']} recovered (step {event['step']})")
                    self._clear_lone_member(event)
            step_ms.extend(s.step_ms for s in by_step[at] if s.step_ms > 0)
        self._schedule(step, step_ms)
        self._log_scores(trainer, step)

    def _follow_groups(self, samples: list[MemberSample]) -> None:
        """Under tensor parallelism: when a step shows a device id naming other members than before (a
        re-split or a recovery formed new groups), the device is new hardware to the per-device core
        (:meth:`~.straggler_core.StragglerCore.reseat`). A group of one flagged member (a member dropped from
        its group) starts flagged at the member's speed, so its next model is anchored there and its healing
        is seen; any other group starts healthy (a named member's slowness is the member core's to follow).
        The first step seen only records the groups (a resumed job keeps its flags)."""
        layout: dict[int, list[int]] = {}
        for sample in samples:
            layout.setdefault(sample.group, []).append(sample.process)
        groups = {device: tuple(sorted(members)) for device, members in layout.items()}
        if self._layout and groups != self._layout:
            for device in set(self._layout) - set(groups):
                self.core.forget(device)
            for device, members in groups.items():
                if self._layout.get(device) != members:
                    lone = len(members) == 1 and members[0] in self.members.flagged
                    self._reseat(device, self.members.flagged[members[0]] if lone else None)
        self._layout = groups
        self._ranks = {sample.process: sample.rank for sample in samples}
        self.last_members = list(samples)

    def _reseat(self, device: int, speed: float | None = None) -> None:
        """A device is new hardware to the core (same on every rank); the process that reports it fits a new
        workload model (its old one describes the device as it was)."""
        self.core.reseat(device, speed)
        if device == self._reported_device:
            self.tracker.fit.reset(self.tracker.fit.layers)

    def _follow_lone_member(self, event: dict[str, Any]) -> None:
        """A device that is one flagged member has a new speed: the member's is the same (it is the device)."""
        members = self._layout.get(event["rank"], ())
        if len(members) == 1 and members[0] in self.members.flagged:
            self.members.flagged[members[0]] = float(event["speed"])

    def _clear_lone_member(self, event: dict[str, Any]) -> None:
        """A device that is one flagged member healed: the member's flag goes with it."""
        members = self._layout.get(event["rank"], ())
        if len(members) == 1 and self.members.clear(members[0]):
            self._note_member({"event": "fail_slow_member_recovered", "step": event["step"], "rank": members[0],
                               "group": event["rank"]})

    def _note_member(self, event: dict[str, Any]) -> None:
        if event["event"] == "fail_slow_member_recovered":
            # The group's slowness was the member's: the group is a healthy device again, measured afresh.
            group = next((d for d, members in self._layout.items() if event["rank"] in members), None)
            if group is not None and len(self._layout[group]) > 1:
                self._reseat(group)
        self.detections.append(event)
        self.events.log(event["event"], event["step"], **{k: v for k, v in event.items() if k not in ("event", "step")})
        if event["event"] == "fail_slow_member_detected":
            user_info(f"straggler: rank {event['rank']}, a member of tensor-parallel group {event['group']}, computes at "
                      f"speed {event['speed']:.2f} (step {event['step']})")
        else:
            user_info(f"straggler: rank {event['rank']} of tensor-parallel group {event['group']} recovered "
                      f"(step {event['step']})")

    def _schedule(self, step: int, step_ms: list[float]) -> None:
        interval = self.config.report_interval_steps
        if self.config.report_time_interval is not None and step_ms:
            typical = sorted(step_ms)[len(step_ms) // 2]
            interval = max(1, round(self.config.report_time_interval * 1000.0 / max(typical, 1e-6)))
        self._interval = interval
        self._next_report = step + interval

    # -------------------------------------------------------------------------- checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        """The detector's state, the same on every rank (collective while a process group is up)."""
        mine = {"tracker": self.tracker.state_dict(), "pending": [s.to_dict() for s in self._pending]}
        ranks = dict(all_gather_objects((self.rank, mine)))
        return {
            "core": self.core.state_dict(),
            "links": self.links.state_dict(),
            "members": self.members.state_dict(),
            "ranks": ranks,
            "last_step": self._last_step,
            "next_report": self._next_report,
            "interval": self._interval,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the core and this rank's own tracker (Lightning calls it after ``setup``)."""
        self.core.load_state_dict(state_dict["core"])
        if "links" in state_dict:  # absent in checkpoints written before link probing
            self.links.load_state_dict(state_dict["links"])
        if "members" in state_dict:  # absent in checkpoints written before members were named
            self.members.load_state_dict(state_dict["members"])
        mine: Mapping[str, Any] | None = state_dict["ranks"].get(self.rank)
        if mine is not None:  # a rank new to the job starts its own warm-up
            self.tracker.load_state_dict(mine["tracker"])
            self._pending = [RankSummary.from_dict(s) for s in mine["pending"]]
        self._last_step = state_dict["last_step"]
        self._next_report = state_dict["next_report"]
        self._interval = state_dict["interval"]

    def _resync(self) -> None:
        """Inside a fail-stop recovery or a reshape: every member takes the cross-rank state of the first
        member that was not idle (a spare's is stale), the new rank 0 where it was a member.

        Survivors can be interrupted at different collectives of a step (one folded step s into its
        core, another did not), so their states may differ; the decisions they take at the same step
        must not. Each keeps its own tracker (its own measurements); pending summaries are dropped.
        """
        mine = {"core": self.core.state_dict(), "links": self.links.state_dict(), "members": self.members.state_dict(),
                "last_step": self._last_step, "next_report": self._next_report, "interval": self._interval,
                "layout": self._layout, "idle_probe_seen": self._idle_probe_seen}
        # A spare taken back (or the lowest survivor, once a spare) knows nothing since it went idle: the
        # state comes from the first process that was a member all along.
        gathered = all_gather_objects((self._idle_since_sync, mine))
        state = next((theirs for idle, theirs in gathered if not idle), gathered[0][1])
        self._idle_since_sync = False
        self.core.load_state_dict(state["core"])
        self.links.load_state_dict(state["links"])
        self.members.load_state_dict(state["members"])
        self._last_step, self._next_report, self._interval = state["last_step"], state["next_report"], state["interval"]
        self._layout = state["layout"]
        self._idle_probe_seen = dict(state["idle_probe_seen"])
        self._pending, self._pending_members = [], []
        self._probe_streaks = {}

    def _log_scores(self, trainer: Any, step: int) -> None:
        if self.rank != 0:
            return
        summary = self.core.score_summary()
        if self.config.enable_ptl_logging and summary and trainer.loggers:
            for logger in trainer.loggers:
                logger.log_metrics(summary, step=step)
        count = self.config.num_gpu_perf_scores_to_print
        if count and self.core.raw_speeds:
            worst = sorted(self.core.raw_speeds.items(), key=lambda kv: kv[1])[:count]
            user_info("straggler: lowest speeds " + ", ".join(f"rank {r}: {s:.2f}" for r, s in worst))
