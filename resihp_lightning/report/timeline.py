"""What happened in a run, from what the job detected: phases split at every incident in ``events.jsonl``.

Nothing here needs an injected fault: a ``kill -9`` from outside, a device that turned slow by itself,
a plan the controller applied are all in the event log (:mod:`resihp_lightning.callbacks.events`).
:func:`build_timeline` turns the log into *incidents*, each at the step from which it holds:

=================== =====================================================================================
incident            from
=================== =====================================================================================
``fail_stop``       a recovery: ``fail_stop_detected`` (one per rank: ``exited`` = lost; ``silent``, ``hung``,
                    ``left out`` = evicted) with its ``recovery_started`` / ``plan_applied`` /
                    ``recovery_finished`` (the survivors, the spares, the time it took); or
                    ``fail_stop_unrecoverable`` (the job stopped with its restart status; written by a rank
                    the survivors had left out, e.g. one cut off with its machine, it is that rank's exit:
                    an annotation)
``fail_slow``       ``fail_slow_detected`` / ``fail_slow_member_detected`` (a slow device / tensor-parallel member)
``slow_link``       ``slow_link_detected``
``healed``          ``fail_slow_recovered`` / ``fail_slow_member_recovered`` / ``slow_link_recovered``
``plan``            ``plan_applied`` outside a recovery (the controller's re-plan, a spare taken back)
``restart``         ``job_restarted`` (the job resumed from a checkpoint, maybe on another world)
``joined``          ``newcomers_admitted`` (processes started with ``RESIHP_JOIN=1`` entered the running job
                    as hot spares; the next plan may take them in)
=================== =====================================================================================

The steps are cut into :class:`TimelinePhase` s at every incident's step; each phase carries the
world size (processes in the job, spares included), the plans it ran, the device conditions then
(slow ranks, slow links, ranks lost so far) and its throughput. A step that migrated or that was
redone by a recovery is left out of every phase's throughput (its cost is the incident's). Injected
faults (``fault_injected``, ``fault_struck``) split nothing: they are annotations, and an injected kill
adds how soon its death was detected.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from resihp_lightning.report.run_records import Run, event_plan_label, step_plan_label

#: ``fail_stop_detected.how`` values of a process that was still alive when the survivors left it out.
EVICTED_HOW = ("silent", "hung", "left out")


@dataclass
class Incident:
    """One thing the job detected or did, from the step at which it holds.

    Attributes:
        step: the first step the incident's new condition applies to.
        kind: ``fail_stop``, ``unrecoverable``, ``fail_slow``, ``slow_link``, ``healed``, ``plan``, ``restart``
            or ``joined``.
        text: one line for the report.
        ranks: the ranks it names (lost / evicted / slow / healed).
        world: the world size from this step on (``None``: unchanged).
        seconds: what it cost (a recovery's ``total_s``, a migration's seconds).
        plan: the plan applied with it (label), if any.
        clears: for a healing, the kind of condition it ends (``fail_slow`` or ``slow_link``).
        time: when it was logged (Unix seconds): the report lists incidents in this order.
        restarted_at: set when it happened in an attempt whose steps a later restart redid: the step
            that restart resumed from (the incident then splits no phase).
    """

    step: int
    kind: str
    text: str
    ranks: tuple[int, ...] = ()
    world: int | None = None
    seconds: float | None = None
    plan: str | None = None
    clears: str | None = None
    time: float = 0.0
    restarted_at: int | None = None

    @property
    def superseded(self) -> bool:
        """Whether a later restart redid this incident's steps."""
        return self.restarted_at is not None


@dataclass
class TimelinePhase:
    """Consecutive steps under one set of conditions.

    Attributes:
        first / last: its first and last step.
        world: processes in the job (spares included).
        condition: ``healthy`` or what held (``rank 1 slow (0.49)``, ``without rank 2``, ...).
        plans: the plans its steps ran (labels, in order).
        steps / tokens / seconds: the steps counted in its throughput and their sums.
    """

    first: int
    last: int
    world: int
    condition: str
    plans: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    @property
    def span(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.steps and self.seconds > 0 else None


@dataclass
class Annotation:
    """An injected fault (``fault_injected``), or the exit of a rank the survivors left out: shown, but it splits nothing."""

    step: int
    text: str
    time: float = 0.0


@dataclass
class Timeline:
    """What :func:`build_timeline` finds.

    Attributes:
        steps: how many steps the run recorded.
        phases: in step order.
        incidents: in step order.
        annotations: the injected faults, and the exits of ranks the survivors had left out.
        transition_steps: steps left out of every phase's throughput (migrations, redone steps) and their wall seconds.
        typical_step_s: the median wall time of the steps in phases (what a transition step is compared with).
        skip: the start-up steps (0..skip-1) left out of the first phase's throughput.
    """

    steps: int
    phases: list[TimelinePhase]
    incidents: list[Incident]
    annotations: list[Annotation]
    transition_steps: dict[int, float]
    typical_step_s: float | None
    skip: int = 0

    @property
    def worlds(self) -> list[int]:
        """The world sizes in order, each once per change (``[4, 3]`` after one rank was lost)."""
        sizes: list[int] = []
        for phase in self.phases:
            if not sizes or sizes[-1] != phase.world:
                sizes.append(phase.world)
        return sizes

    @property
    def world_label(self) -> str:
        """``4 processes`` or ``4 -> 3 processes``."""
        return " -> ".join(str(w) for w in self.worlds) + " processes"


def build_timeline(run: Run, skip: int = 3) -> Timeline:
    """Builds the timeline of ``run`` (see the module docstring).

    Args:
        run: from :func:`~resihp_lightning.report.run_records.load_run`.
        skip: start-up steps left out of the first phase's throughput (engine build, first-touch allocations).
    """
    steps = sorted(run.steps, key=lambda r: r["step"])
    migrated = {r["step"] for r in steps if r.get("migrated")}
    incidents = _incidents(run)
    for incident in incidents:
        # The controller logs plan_applied after the step that migrated (the next global step); the steps say which.
        if incident.kind == "plan" and incident.step not in migrated and incident.step - 1 in migrated:
            incident.step -= 1
    for restart in [i for i in incidents if i.kind == "restart"]:
        for incident in incidents:
            if incident.time < restart.time and incident.step >= restart.step and not incident.superseded:
                incident.restarted_at = restart.step  # its steps were redone by the restarted job
    incidents.sort(key=lambda i: (i.step, i.time))
    annotations = _annotations(run)
    wall_s = {r["step"]: float(r["wall_ms"]) / 1000.0 for r in steps}
    redone = {i.step for i in incidents if i.kind == "fail_stop" and i.seconds is not None and not i.superseded}
    transition = {step: wall_s[step] for step in sorted(migrated | redone) if step in wall_s}
    phases = _phases(steps, [i for i in incidents if not i.superseded], run, skip, transition)
    counted = [float(r["wall_ms"]) / 1000.0 for r in steps if r["step"] >= skip and r["step"] not in transition]
    typical = statistics.median(counted) if counted else None
    return Timeline(len(steps), phases, incidents, annotations, transition, typical, skip)


def _initial_world(run: Run, steps: list[dict[str, Any]]) -> int:
    restarts = [e for e in run.of("job_restarted") if e.get("step") is not None and e["step"] <= steps[0]["step"]]
    if restarts and restarts[-1].get("world_after"):
        return int(restarts[-1]["world_after"])
    if steps[0].get("world"):  # recorded since tensor parallelism and spares made P x D no count of processes
        return int(steps[0]["world"])
    return max(int(steps[0].get("P", 1)) * int(steps[0].get("D", 1)), 1)


def _phases(steps: list[dict[str, Any]], incidents: list[Incident], run: Run, skip: int,
            transition: dict[int, float]) -> list[TimelinePhase]:
    world = _initial_world(run, steps)
    conditions: dict[str, str] = {}  # key -> text, in the order they arose
    lost: list[int] = []
    pending = list(incidents)  # in step order
    phases: list[TimelinePhase] = []
    current: TimelinePhase | None = None
    for record in steps:
        step = record["step"]
        while pending and pending[0].step <= step:  # every incident opens a phase
            incident = pending.pop(0)
            world = incident.world if incident.world is not None else world
            _apply(incident, conditions, lost)
            current = None
        if current is None:
            held = list(conditions.values())
            if lost:
                held.append(f"without rank{'s' if len(lost) > 1 else ''} {', '.join(str(r) for r in lost)}")
            current = TimelinePhase(step, step, world, ", ".join(held) or "healthy")
            phases.append(current)
        current.last = step
        label = step_plan_label(record)
        if not current.plans or current.plans[-1] != label:
            current.plans.append(label)
        if step >= skip and step not in transition:
            current.steps.append(step)
            current.tokens += int(record["tokens"])
            current.seconds += float(record["wall_ms"]) / 1000.0
    return phases


def _apply(incident: Incident, conditions: dict[str, str], lost: list[int]) -> None:
    """Updates the device conditions (keyed ``<kind>:<rank>``) and the lost ranks with one incident."""
    if incident.kind in ("fail_slow", "slow_link"):
        for rank in incident.ranks:
            conditions[f"{incident.kind}:{rank}"] = incident.text
    elif incident.kind == "healed":
        for rank in incident.ranks:
            conditions.pop(f"{incident.clears}:{rank}", None)
    elif incident.kind == "fail_stop":
        for rank in incident.ranks:
            lost.append(rank)
            for key in [k for k in conditions if k.endswith(f":{rank}")]:
                del conditions[key]  # a lost rank's slowness no longer holds anything up
    elif incident.kind == "restart":
        conditions.clear()
        lost.clear()


def _incidents(run: Run) -> list[Incident]:
    incidents = _fail_stop_incidents(run)
    recovered_plans = {(e["step"], e.get("generation")) for e in run.of("recovery_finished")}
    recovery_steps = {step for step, _ in recovered_plans}
    for event in run.events:
        name, step = event["event"], event.get("step")
        if step is None:
            continue
        rank = event.get("rank")
        before = len(incidents)
        if name == "fail_slow_detected":
            incidents.append(Incident(step, "fail_slow", f"rank {rank} slow{_reading(event.get('speed'))}", (rank,)))
        elif name == "fail_slow_member_detected":
            incidents.append(Incident(step, "fail_slow", f"rank {rank} slow in tensor-parallel group {event.get('group')}"
                                      f"{_reading(event.get('speed'))}", (rank,)))
        elif name == "slow_link_detected":
            incidents.append(Incident(step, "slow_link", f"rank {rank}'s links slow{_reading(event.get('link_speed'))}",
                                      (rank,)))
        elif name in ("fail_slow_recovered", "fail_slow_member_recovered"):
            incidents.append(Incident(step, "healed", f"rank {rank} healed{_reading(event.get('speed'))}", (rank,),
                                      clears="fail_slow"))
        elif name == "slow_link_recovered":
            incidents.append(Incident(step, "healed", f"rank {rank}'s links healed{_reading(event.get('link_speed'))}",
                                      (rank,), clears="slow_link"))
        elif name == "plan_applied" and not (step in recovery_steps and "world" in event):
            label = event_plan_label(event.get("plan") or {})
            seconds = event.get("migration_seconds")
            incidents.append(Incident(step, "plan", f"plan {label} applied{_migration(seconds, event.get('bytes_moved'))}",
                                      world=event.get("world"), seconds=seconds, plan=label))
        elif name == "newcomers_admitted":
            ranks = tuple(int(r) for r in event.get("ranks") or ())
            world = event.get("world")
            incidents.append(Incident(step, "joined", f"rank{'s' if len(ranks) > 1 else ''} "
                                      f"{', '.join(str(r) for r in ranks)} joined the running job (admitted as hot "
                                      f"spare{'s' if len(ranks) > 1 else ''}); {world} processes", ranks, world=world))
        elif name == "job_restarted":
            lost_ranks = tuple(event.get("lost") or ())
            world = event.get("world_after")
            text = (f"job restarted from the checkpoint of step {event.get('checkpoint_step', step)} on {world} processes "
                    f"(before: {event.get('world_before')})")
            if lost_ranks:
                text += f"; lost: {', '.join(str(r) for r in lost_ranks)}"
            incidents.append(Incident(step, "restart", text, lost_ranks, world=world))
        for incident in incidents[before:]:
            incident.time = float(event.get("time") or 0.0)
    return incidents


def _fail_stop_incidents(run: Run) -> list[Incident]:
    """One incident per recovery (its detections folded in), and one per detection no recovery followed."""
    finished = run.of("recovery_finished")
    struck = {e.get("rank"): e for e in run.of("fault_struck")}
    detections = run.of("fail_stop_detected")
    incidents = []
    used: set[int] = set()
    previous_step = -1
    for record in finished:
        step = record["step"]
        started = next((e for e in run.of("recovery_started") if e.get("generation") == record.get("generation")), None)
        failed = {int(r): how for r, how in ((started or {}).get("failed") or {}).items()}
        mine = [i for i, e in enumerate(detections) if i not in used and e.get("step") is not None
                and previous_step < e["step"] <= step]
        used.update(mine)
        for i in mine:
            failed.setdefault(int(detections[i]["rank"]), detections[i].get("how") or detections[i].get("reason") or "?")
        members = list(record.get("members") or [])
        spares = list(record.get("spares") or [])
        plan = next((event_plan_label(e.get("plan") or {}) for e in run.of("plan_applied")
                     if e.get("step") == step and "world" in e), None)
        what = "; ".join(_lost_text(rank, how, struck, [detections[i] for i in mine]) for rank, how in sorted(failed.items()))
        text = (f"{what}; recovered in-process in {record.get('total_s', 0.0):.2f} s (regroup {record.get('regroup_s', 0.0):.3f} s, "
                f"plan {record.get('plan_s', 0.0):.3f} s, restore {record.get('restore_s', 0.0):.3f} s"
                f"{_mib(record.get('bytes_moved'))}, step redone in {record.get('redo_s', 0.0):.2f} s) on "
                f"{len(members)} processes (ranks {', '.join(str(m) for m in members)}"
                f"{'; spares ' + ', '.join(str(s) for s in spares) if spares else ''})")
        if plan is not None:
            text += f", plan {plan}"
        incidents.append(Incident(step, "fail_stop", text, tuple(sorted(failed)), world=len(members) + len(spares),
                                  seconds=record.get("total_s"), plan=plan, time=float(record.get("time") or 0.0)))
        previous_step = step
    leftover = [e for i, e in enumerate(detections) if i not in used and e.get("step") is not None]
    for event in leftover:
        how = event.get("how") or event.get("reason") or "?"
        incidents.append(Incident(event["step"], "fail_stop", _lost_text(int(event["rank"]), how, struck, [event])
                                  + "; no recovery recorded", (int(event["rank"]),), time=float(event.get("time") or 0.0)))
    for event in run.of("fail_stop_unrecoverable"):
        if event.get("step") is not None and event.get("rank") not in _left_behind(run):
            incidents.append(Incident(event["step"], "unrecoverable", f"the job could not recover in-process "
                                      f"({event.get('reason')}): exit {event.get('exit_code')} for a restart",
                                      time=float(event.get("time") or 0.0)))
    return incidents


def _lost_text(rank: int, how: str, struck: dict[Any, dict[str, Any]], detections: list[dict[str, Any]]) -> str:
    verb = "evicted" if how in EVICTED_HOW else "lost"
    text = f"rank {rank} {verb} ({how})"
    fault = struck.get(rank)
    detected = next((e for e in detections if e.get("rank") == rank and "at" in e), None)
    if fault is not None and detected is not None and "at" in fault:
        text += f", detected {float(detected['at']) - float(fault['at']):.3f} s after the injected {fault.get('kind')}"
    return text


def _left_behind(run: Run) -> set[int]:
    """Ranks the survivors named lost or evicted in a recovery (a later exit of theirs is not the job's)."""
    return {int(r) for e in run.of("recovery_started") for r in (e.get("failed") or {})}


def _annotations(run: Run) -> list[Annotation]:
    notes = []
    left_behind = _left_behind(run)
    for event in run.of("fail_stop_unrecoverable"):
        if event.get("step") is not None and event.get("rank") in left_behind:
            notes.append(Annotation(int(event["step"]), f"rank {event['rank']}, left out by the survivors, ended with "
                                    f"exit {event.get('exit_code')} ({event.get('reason')})", float(event.get("time") or 0.0)))
    for event in run.of("fault_injected"):
        kind = event.get("kind", "slow")
        start = event.get("start_step", event.get("step"))
        if kind in ("kill", "hang"):
            what = f"injected: rank {event.get('rank')} {'killed' if kind == 'kill' else 'frozen'} inside step {start}"
        elif kind in ("slow_link", "delay_p2p"):
            what = f"injected: slow link on rank {event.get('rank')} (+{event.get('delay_ms', '?')} ms per send) from step {start}"
        else:
            what = f"injected: {event.get('factor', '?')}x slowdown on rank {event.get('rank')} from step {start}"
        if event.get("end_step") is not None:
            what += f" to step {event['end_step']}"
        notes.append(Annotation(int(start) if start is not None else 0, what, float(event.get("time") or 0.0)))
    return notes


def _reading(value: Any) -> str:
    return "" if value is None else f" ({float(value):.2f})"


def _mib(count: Any) -> str:
    return f", {int(count) / 2**20:.1f} MiB moved" if count else ""


def _migration(seconds: Any, moved: Any) -> str:
    if seconds is None:
        return ""
    return f" (migration {float(seconds):.2f} s{_mib(moved) or ', no layers moved'})"


def format_timeline(timeline: Timeline) -> str:
    """The timeline as text: a phase table, then every incident and annotation by step."""
    first = next((p.tokens_per_s for p in timeline.phases if p.tokens_per_s is not None), None)
    rows = []
    for number, phase in enumerate(timeline.phases, start=1):
        rate = phase.tokens_per_s
        share = f"{rate / first * 100:.0f}%" if rate is not None and first else "-"
        rows.append((str(number), phase.span, str(phase.world), " -> ".join(phase.plans), phase.condition,
                     "-" if rate is None else f"{rate:.0f}", share))
    header = ("#", "steps", "processes", "plans", "condition", "tokens/s", "of first")
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]
    right = {5, 6}

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    lines = [f"what happened ({timeline.steps} steps, {timeline.world_label}; phases split at what the job detected):",
             line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [line(r) for r in rows]
    left_out = [f"the start-up steps 0-{timeline.skip - 1}"] if timeline.skip > 0 else []
    if timeline.transition_steps:
        left_out.append(f"the steps that migrated or were redone ({', '.join(str(s) for s in sorted(timeline.transition_steps))})")
    if left_out:
        lines.append(f"tokens/s leaves out {' and '.join(left_out)}")
    # By step; what a restart redid goes just before the restart (its step is lower than that of the loss behind it).
    notes = [((i.step if i.restarted_at is None else i.restarted_at, 1, i.time),
              f"step {i.step}: {i.text}{' (in the attempt before the restart)' if i.superseded else ''}"
              f"{_step_cost(timeline, i)}") for i in timeline.incidents]
    notes += [((a.step, 0, a.time), a.text) for a in timeline.annotations]
    lines += [text for _, text in sorted(notes, key=lambda n: n[0])]
    if not timeline.incidents:
        lines.append("nothing detected: no fail-slow, fail-stop, healing or plan change")
    return "\n".join(lines)


def _step_cost(timeline: Timeline, incident: Incident) -> str:
    """What the incident's step took against a typical step (``step 12 took 5.1 s, typically 1.2 s``)."""
    seconds = timeline.transition_steps.get(incident.step)
    if seconds is None or incident.superseded or timeline.typical_step_s is None or incident.kind not in ("fail_stop", "plan"):
        return ""
    return f"; step {incident.step} took {seconds:.2f} s (typical step {timeline.typical_step_s:.2f} s)"
