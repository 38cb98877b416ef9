"""Replays a failure trace under one policy and counts the tokens that training keeps.

Between two changes of the cluster's state a policy runs a list of phases: each runs a layout (at
its iteration time on the cluster as it is) or pauses (detection, planning the policy must wait for,
migration, restart). Tokens accrue at ``tokens_per_iteration / T`` while a phase runs. A phase may
discard work: ``lose_partial`` the iteration in flight (a fail-stop interrupts it), ``restart`` every
token since the last checkpoint (checkpoints every ``costs.checkpoint_every_s`` from the job's last
start). When the state changes again before a policy's phases are done, the layout of the phase in
progress counts as in force and the policy reacts anew.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from resihp_lightning.evaluation.cluster import Cluster, View
from resihp_lightning.evaluation.traces import GpuState
from resihp_lightning.plan import Plan


class Layout(Protocol):
    """Something a job runs: a plan, or a plan with a baseline's own mechanism on top."""

    plan: Plan

    def iteration_ms(self, cluster: Cluster, state: GpuState) -> float: ...


@dataclass(frozen=True)
class PlanLayout:
    """A plan of the planning model, priced with :func:`~resihp_lightning.plan.evaluate`."""

    plan: Plan
    view: View = View()

    def iteration_ms(self, cluster: Cluster, state: GpuState) -> float:
        return cluster.iteration_ms(self.plan, state, self.view)


@dataclass(frozen=True)
class Phase:
    """A stretch of a policy's reaction.

    Attributes:
        seconds: how long (``inf`` for the last phase).
        layout: what runs, or (when not ``running``) what is being switched to.
        running: training runs (else the job is paused).
        label: what the phase is (``"detect"``, ``"migrate"``, ``"restart"``...).
        lose_partial: entering it discards the iteration in flight.
        restart: entering it discards the work since the last checkpoint; the job's checkpoint
            clock restarts when the next phase begins.
    """

    seconds: float
    layout: Layout
    running: bool = True
    label: str = "run"
    lose_partial: bool = False
    restart: bool = False


@dataclass(frozen=True)
class Segment:
    """A stretch of constant throughput in the replay."""

    start_s: float
    end_s: float
    tokens_per_s: float
    label: str


@dataclass
class Result:
    """What a replay gives.

    Attributes:
        policy: the policy's name.
        duration_s: the trace's length.
        tokens_per_iteration: tokens of one global batch.
        tokens: tokens trained and kept (lost work subtracted).
        lost_tokens: tokens trained and then discarded.
        segments: throughput over time (before losses).
        losses: (time, tokens) of every discard.
        paused_s: seconds with no training.
        counts: phases entered, by label.
    """

    policy: str
    duration_s: float
    tokens_per_iteration: float
    tokens: float = 0.0
    lost_tokens: float = 0.0
    segments: list[Segment] = field(default_factory=list)
    losses: list[tuple[float, float]] = field(default_factory=list)
    paused_s: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Effective throughput: tokens kept per second of the trace."""
        return self.tokens / self.duration_s


class TracePolicy(Protocol):
    """What :func:`replay` asks of a policy: the layout it starts with, and its reaction to each change."""

    name: str

    def start(self, cluster: Cluster) -> Layout: ...

    def react(self, cluster: Cluster, t: float, state: GpuState, in_force: Layout) -> list[Phase]: ...


def replay(cluster: Cluster, policy: TracePolicy) -> Result:
    """Runs ``policy`` through ``cluster.trace``; deterministic."""
    trace = cluster.trace
    result = Result(policy.name, trace.duration_s, cluster.tokens_per_iteration)
    times = trace.change_times() + [trace.duration_s]
    in_force = policy.start(cluster)
    checkpoint_from, every = 0.0, cluster.costs.checkpoint_every_s
    for k in range(len(times) - 1):
        t, t_next = times[k], times[k + 1]
        state = trace.state_at(t)
        phases = policy.react(cluster, t, state, in_force)
        if not phases or phases[-1].seconds != math.inf:
            raise RuntimeError(f"policy {policy.name} must end its reaction with an open-ended phase")
        at = t
        for index, phase in enumerate(phases):
            if at >= t_next:
                break
            if index > 0 and phases[index - 1].restart:
                checkpoint_from = at  # the restarted job starts from a checkpoint
            result.counts[phase.label] = result.counts.get(phase.label, 0) + 1
            if phase.restart:
                _lose(result, checkpoint_from + math.floor((at - checkpoint_from) / every) * every, at)
            elif phase.lose_partial:
                _lose_partial(result, at)
            end = min(at + phase.seconds, t_next)
            rate = 0.0
            if phase.running:
                ms = phase.layout.iteration_ms(cluster, state)
                rate = cluster.tokens_per_iteration / (ms / 1000.0) if math.isfinite(ms) and ms > 0 else 0.0
            if rate == 0.0:
                result.paused_s += end - at
            if end > at:
                _append(result, Segment(at, end, rate, phase.label))
            in_force = phase.layout
            at = end
    result.tokens = sum((s.end_s - s.start_s) * s.tokens_per_s for s in result.segments) - result.lost_tokens
    return result


def _append(result: Result, segment: Segment) -> None:
    last = result.segments[-1] if result.segments else None
    if last and last.end_s == segment.start_s and last.tokens_per_s == segment.tokens_per_s and last.label == segment.label:
        result.segments[-1] = Segment(last.start_s, segment.end_s, last.tokens_per_s, last.label)
    else:
        result.segments.append(segment)


def _discard(result: Result, at: float, amount: float) -> None:
    result.lost_tokens += amount
    result.losses.append((at, amount))


def _lose(result: Result, since: float, until: float) -> None:
    """Discards what was trained in (since, until], net of what was already discarded there."""
    trained = sum(max(0.0, min(s.end_s, until) - max(s.start_s, since)) * s.tokens_per_s for s in result.segments)
    already = sum(amount for when, amount in result.losses if since < when <= until)
    _discard(result, until, max(0.0, trained - already))


def _lose_partial(result: Result, at: float) -> None:
    """Discards the iteration in flight: the running segment's time since its last iteration boundary.

    Iterations are counted from the segment's start (a change of speed starts the count again).
    """
    last = result.segments[-1] if result.segments else None
    if last is None or last.end_s != at or last.tokens_per_s <= 0:
        return
    iteration_s = result.tokens_per_iteration / last.tokens_per_s
    _discard(result, at, ((at - last.start_s) % iteration_s) * last.tokens_per_s)
