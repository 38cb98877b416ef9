"""The report's evaluation of an injected fault: throughput against the fault, and the ideal.

When the run injected a fault (``fault_injected``: ``examples/finetune.py --fault``), :func:`summarize`
splits the steps into phases that follow the events of the first injected slowdown: the device's condition
(healthy before the fault, slowed while it is on, healed after its ``end_step``) crossed with the
plans applied since the fault began (a step that migrated is left out of every phase; its cost is
reported as the migration time):

* healthy: from step ``skip`` (start-up steps 0..skip-1 left out) to the fault;
* slowed, before re-plan / slowed, after re-plan;
* healed (no re-plan during the fault), or healed, before plan-back / healed, after plan-back (the
  first plan applied after the healing).

The fault is the first ``slow`` one, or a link fault (``slow_link`` / ``delay_p2p``: detection is then
the first ``slow_link_detected`` of its rank, and there is no S/N ideal, since the compute is whole).
Throughput of a phase = its tokens / its wall time (everything the job spent, callbacks included).
The ideal is S/N x the best healthy throughput measured in the run, S being the sum of device speeds
under the fault (N - 1 + 1/factor for one slowed device): what a perfect re-plan would reach. The
best healthy throughput is the faster of the healthy phase (the starting plan) and the healed phase
after the plan-back (the planner's plan for healthy devices), so a re-plan that also removes a
bubble of the starting plan is not credited beyond what the planner's healthy plan reaches. Only
measured throughput enters the ideal. When the controller logged ``healthy_reference`` (its best
plan for the devices all healthy, priced with the plan in force on the first healthy profile) and
that plan was never measured, the report names it and its predicted speed-up over the healthy phase
(a prediction: ``--strategy.start planned`` in the example measures it). Detection
latency counts steps from the fault's first step to the first ``fail_slow_detected`` of that rank (or, under
tensor parallelism, ``fail_slow_member_detected``: the rank named as its group's slow member); recovery
latency from the fault's ``end_step`` to the first ``fail_slow_recovered`` (``fail_slow_member_recovered``)
after it.

A killed or frozen rank (``kill`` / ``hang``) splits the run around the step redone on the survivors
and compares the throughput after it with (survivors / N) x healthy. What the job itself detected,
injected or not, is :mod:`~resihp_lightning.report.timeline`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resihp_lightning.report.run_records import Run
from resihp_lightning.report.run_records import event_plan_label as _event_plan_label
from resihp_lightning.report.run_records import step_plan_label as _plan_label

#: Fault kinds that end or freeze a rank (fail-stop).
STOP_KINDS = ("kill", "hang")
#: Fault kinds that slow a rank's links (its sends / all-reduces), not its compute.
LINK_KINDS = ("slow_link", "delay_p2p")
START_PLAN_FILE = "initial_plan.json"


@dataclass
class Phase:
    """Steps of one phase and their throughput."""

    name: str
    steps: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.steps and self.seconds > 0 else None

    @property
    def span(self) -> str:
        return f"{self.steps[0]}-{self.steps[-1]}" if self.steps else "-"


@dataclass
class Summary:
    """What :func:`summarize` finds in a run."""

    steps: int
    world_size: int
    healthy: Phase
    slowed: Phase
    after: Phase
    ideal_tokens_per_s: float | None = None
    fault: dict[str, Any] | None = None
    detected_step: int | None = None
    detected_speed: float | None = None
    applied_step: int | None = None
    applied_plan: str | None = None
    migration_s: float | None = None
    bytes_moved: int | None = None
    plans: list[tuple[int, str]] = field(default_factory=list)
    recovery: dict[str, Any] | None = None
    detected_after_s: float | None = None
    phases: list[Phase] = field(default_factory=list)
    best_healthy: Phase | None = None
    healed_step: int | None = None
    recovered_step: int | None = None
    recovered_speed: float | None = None
    start_plan: dict[str, Any] | None = None
    predicted_best_healthy: float | None = None  # tokens/s the planner's healthy plan would reach (predicted)
    healthy_reference_plan: str | None = None

    @property
    def stop_fault(self) -> bool:
        """Whether the fault killed or froze a rank (fail-stop) rather than slowing it."""
        return self.fault is not None and self.fault.get("kind") in STOP_KINDS

    @property
    def detection_latency(self) -> int | None:
        if self.fault is None or self.detected_step is None:
            return None
        return self.detected_step - int(self.fault["start_step"])

    @property
    def recovery_latency(self) -> int | None:
        if self.healed_step is None or self.recovered_step is None:
            return None
        return self.recovered_step - self.healed_step


def summarize(run: Run, skip: int = 3) -> Summary:
    """Splits the run into phases (see the module docstring) and collects the loop's milestones.

    Args:
        run: from :func:`~resihp_lightning.report.run_records.load_run`.
        skip: start-up steps left out of the healthy phase (engine build, first-touch allocations).
    """
    steps = sorted(run.steps, key=lambda r: r["step"])
    world = max(int(steps[0].get("P", 1)) * int(steps[0].get("D", 1)), 1)
    faults = [e for e in run.events
              if e["event"] == "fault_injected" and e.get("kind", "slow") in ("slow", *LINK_KINDS)]
    stops = [e for e in run.events if e["event"] == "fault_injected" and e.get("kind") in STOP_KINDS]
    if not faults and stops:
        return _summarize_fail_stop(run, steps, world, stops[0], skip)
    fault = faults[0] if faults else None
    summary = Summary(len(steps), world, Phase("healthy"), Phase("slowed, before re-plan"), Phase("slowed, after re-plan"))
    fault_step = int(fault["start_step"]) if fault is not None else None
    end_step = fault.get("end_step") if fault is not None else None
    summary.fault = fault
    summary.start_plan = _start_plan(run.path)
    event_step = None  # the first plan_applied event's step, when steps.jsonl shows no migration for it
    if fault is not None:
        # Under tensor parallelism the slowed rank is named as its group's member (its device is the group).
        link = fault.get("kind") in LINK_KINDS
        detected_events = ("slow_link_detected",) if link else ("fail_slow_detected", "fail_slow_member_detected")
        detections = [e for e in run.events if e["event"] in detected_events and e.get("rank") == fault["rank"]
                      and e["step"] is not None and e["step"] >= fault_step]
        if detections:
            first = detections[0]
            summary.detected_step, summary.detected_speed = first["step"], first.get("speed", first.get("link_speed"))
        applied = [e for e in run.events if e["event"] == "plan_applied" and e["step"] is not None
                   and e["step"] >= (summary.detected_step or fault_step)]
        if applied:
            first = applied[0]
            summary.applied_plan = _event_plan_label(first.get("plan") or {})
            summary.migration_s = first.get("migration_seconds")
            summary.bytes_moved = first.get("bytes_moved")
            event_step = first["step"]
        if end_step is not None:
            summary.healed_step = int(end_step)
            recovered_events = ("slow_link_recovered",) if link else ("fail_slow_recovered", "fail_slow_member_recovered")
            recovered = [e for e in run.events if e["event"] in recovered_events and e.get("rank") == fault["rank"]
                         and e["step"] is not None and e["step"] >= int(end_step)]
            if recovered:
                summary.recovered_step = recovered[0]["step"]
                summary.recovered_speed = recovered[0].get("speed", recovered[0].get("link_speed"))
    migrated = [r["step"] for r in steps if r.get("migrated")]
    if fault_step is not None:
        def in_fault(s: int) -> bool:
            return s > fault_step and (end_step is None or s < int(end_step))

        during = [s for s in migrated if in_fault(s)]
        # A plan applied where steps.jsonl flags no migration (a resumed run's records) still has its step.
        summary.applied_step = during[0] if during else event_step if event_step is not None and in_fault(event_step) else None
    healed = Phase("healed" if summary.applied_step is None else "healed, before plan-back")
    back = Phase("healed, after plan-back")
    plan_back = None
    if end_step is not None:
        later = [s for s in migrated if s >= int(end_step)]
        plan_back = later[0] if later else None

    def phase_of(record: dict[str, Any]) -> Phase | None:
        step = record["step"]
        if record.get("migrated"):
            return None
        if fault_step is None or step < fault_step:
            return summary.healthy
        if end_step is None or step < int(end_step):
            return summary.slowed if summary.applied_step is None or step < summary.applied_step else summary.after
        return back if plan_back is not None and step > plan_back else healed

    _fill_phases(summary, steps, skip, phase_of)
    summary.phases = [p for p in (summary.healthy, summary.slowed, summary.after, healed, back)
                      if p.steps or p is summary.healthy or (p is summary.slowed and fault is not None)]
    candidates = [p for p in (summary.healthy, back) if p.tokens_per_s is not None]
    summary.best_healthy = max(candidates, key=lambda p: p.tokens_per_s) if candidates else None
    _predict_best_healthy(summary, run.events)
    if summary.best_healthy is not None:
        best = summary.best_healthy.tokens_per_s
        if fault is not None and fault.get("kind") in LINK_KINDS:
            summary.ideal_tokens_per_s = None  # a slow link leaves the compute whole: no S/N ideal
        else:
            factor = float(fault.get("factor", 1.0)) if fault is not None else 1.0
            summary.ideal_tokens_per_s = best * (world - 1 + 1.0 / factor) / world if fault is not None else best
    return summary


def _predict_best_healthy(summary: Summary, events: list[dict[str, Any]]) -> None:
    """The planner's best healthy plan's predicted throughput, when the run did not start under it: the
    measured healthy phase (the plan in force then) scaled by the two plans' predicted times on the same
    healthy problem (the controller's ``healthy_reference`` event). Reported, not used in the ideal."""
    reference = next((e for e in events if e["event"] == "healthy_reference"), None)
    measured = summary.healthy.tokens_per_s
    if reference is None or measured is None or not reference.get("predicted_ms") or not reference.get("current_ms"):
        return
    if float(reference["predicted_ms"]) >= float(reference["current_ms"]):
        return  # the plan the job ran healthy is (predicted) as fast as the planner's best
    summary.predicted_best_healthy = measured * float(reference["current_ms"]) / float(reference["predicted_ms"])
    summary.healthy_reference_plan = _event_plan_label(reference["plan"])


def _start_plan(run_dir: Path) -> dict[str, Any] | None:
    """The planner's healthy plan the job started from (``initial_plan.json``, written by examples/finetune.py
    with ``strategy.start: planned``), or ``None``."""
    import json

    path = run_dir / START_PLAN_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _fill_phases(summary: Summary, steps: list[dict[str, Any]], skip: int, phase_of: Any) -> None:
    """Records the plan changes, and adds each step from ``skip`` on to the phase ``phase_of`` gives (or none)."""
    previous = None
    for record in steps:
        label = _plan_label(record)
        if label != previous:
            summary.plans.append((record["step"], label))
            previous = label
    for record in steps:
        phase = phase_of(record) if record["step"] >= skip else None
        if phase is not None:
            phase.steps.append(record["step"])
            phase.tokens += int(record["tokens"])
            phase.seconds += float(record["wall_ms"]) / 1000.0


def _summarize_fail_stop(run: Run, steps: list[dict[str, Any]], world: int, fault: dict[str, Any], skip: int) -> Summary:
    """Phases around a killed / frozen rank: healthy, the step redone on the survivors, after recovery."""
    summary = Summary(len(steps), world, Phase("healthy"), Phase("step redone on the survivors"), Phase("after recovery"))
    summary.fault = fault
    fault_step = int(fault["start_step"])
    finished = [e for e in run.events if e["event"] == "recovery_finished"]
    summary.recovery = finished[0] if finished else None
    struck = [e for e in run.events if e["event"] == "fault_struck"]
    detected = [e for e in run.events if e["event"] == "fail_stop_detected" and e.get("rank") == fault.get("rank")]
    if struck and detected and "at" in struck[0] and "at" in detected[0]:
        summary.detected_after_s = float(detected[0]["at"]) - float(struck[0]["at"])
    if detected:
        summary.detected_step = detected[0]["step"]
    if summary.recovery is not None:
        summary.applied_step = summary.recovery["step"]
        summary.bytes_moved = summary.recovery.get("bytes_moved")
        summary.migration_s = summary.recovery.get("restore_s")
    _fill_phases(summary, steps, skip, lambda record: summary.healthy if record["step"] < fault_step
                 else summary.slowed if record["step"] == fault_step else summary.after)
    summary.phases = [summary.healthy, summary.slowed, summary.after]
    healthy = summary.healthy.tokens_per_s
    if healthy is not None:
        survivors = len(summary.recovery["members"]) if summary.recovery is not None else world - 1
        summary.ideal_tokens_per_s = healthy * survivors / world
    return summary


def _format_fail_stop(summary: Summary) -> list[str]:
    fault = summary.fault or {}
    how = "killed (SIGKILL)" if fault.get("kind") == "kill" else "frozen (SIGSTOP)"
    lines = [f"fault: rank {fault.get('rank')} {how} inside step {fault.get('start_step')}"]
    if summary.detected_after_s is not None:
        lines.append(f"detection: {summary.detected_after_s:.3f} s after the fault")
    recovery = summary.recovery
    if recovery is None:
        lines.append("recovery: none (see events.jsonl)")
    else:
        lines.append(
            f"recovery: {len(recovery['members'])} survivors; regroup {recovery['regroup_s']:.3f} s, plan "
            f"{recovery['plan_s']:.3f} s, restore {recovery['restore_s']:.3f} s "
            f"({(recovery.get('bytes_moved') or 0) / 2**20:.1f} MiB), step redone in {recovery['redo_s']:.2f} s"
        )
    return lines


def _fault_label(fault: dict[str, Any]) -> str:
    """``2.0x slowdown on rank 1`` / ``slow link on rank 2 (+20 ms per send)``."""
    if fault.get("kind") in LINK_KINDS:
        what = "slow link" if fault.get("kind") == "slow_link" else "delayed sends"
        return f"{what} on rank {fault.get('rank')} (+{fault.get('delay_ms', '?')} ms per send)"
    return f"{fault.get('factor', '?')}x slowdown on rank {fault.get('rank')}"


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(summary: Summary) -> str:
    """The report as plain text (a Markdown table plus the loop's milestones)."""
    healthy = summary.healthy.tokens_per_s
    rows = []
    for phase in summary.phases or [summary.healthy, summary.slowed, summary.after]:
        rate = phase.tokens_per_s
        share = f"{rate / healthy * 100:.0f}%" if rate is not None and healthy else "-"
        rows.append((phase.name, phase.span, _fmt(rate), share))
    ideal = summary.ideal_tokens_per_s
    if summary.stop_fault:
        survivors = len(summary.recovery["members"]) if summary.recovery is not None else summary.world_size - 1
        rows.append((f"ideal ({survivors}/{summary.world_size} of healthy)", "-", _fmt(ideal),
                     f"{ideal / healthy * 100:.0f}%" if ideal and healthy else "-"))
    elif summary.fault is not None and ideal is not None:
        ideal_note = f"ideal (S/N of best healthy, S = {summary.world_size - 1} + 1/{summary.fault.get('factor', 1):g})"
        rows.append((ideal_note, "-", _fmt(ideal), f"{ideal / healthy * 100:.0f}%" if ideal and healthy else "-"))
    width = max(len(r[0]) for r in rows)
    lines = [f"| {'phase':<{width}} | steps   | tokens/s | of healthy |", f"|{'-' * (width + 2)}|---------|----------|------------|"]
    lines += [f"| {name:<{width}} | {span:<7} | {rate:>8} | {share:>10} |" for name, span, rate, share in rows]
    fault = summary.fault
    if summary.stop_fault:
        lines += _format_fail_stop(summary)
    elif fault is None:
        lines.append("no fault injected")
    else:
        lines.append(f"fault: {_fault_label(fault)} from step {fault['start_step']}")
        if summary.detected_step is None:
            lines.append("detection: none")
        else:
            what = "link speed" if fault.get("kind") in LINK_KINDS else "speed estimate"
            speed = f", {what} {summary.detected_speed:.2f}" if summary.detected_speed is not None else ""
            lines.append(f"detection: step {summary.detected_step}, latency {summary.detection_latency} steps{speed}")
        if summary.healed_step is not None:
            if summary.recovered_step is None:
                lines.append(f"healing: step {summary.healed_step}, never reported recovered")
            else:
                speed = f", reading {summary.recovered_speed:.2f}" if summary.recovered_speed is not None else ""
                lines.append(f"healing: step {summary.healed_step}, reported recovered at step {summary.recovered_step} "
                             f"(latency {summary.recovery_latency} steps{speed})")
        best = summary.best_healthy
        if best is not None and best.tokens_per_s is not None:
            origin = ("the planner's healthy plan" if best.name != "healthy" or summary.start_plan is not None
                      else "the starting plan")
            lines.append(f"best healthy: {best.tokens_per_s:.0f} tokens/s ({best.name}, steps {best.span}, {origin})")
        predicted = summary.predicted_best_healthy
        healthy = summary.healthy.tokens_per_s
        if predicted is not None and healthy and (best is None or best.name == "healthy"):
            lines.append(f"planner's best healthy plan: {summary.healthy_reference_plan}, predicted "
                         f"{predicted / healthy:.2f}x the starting plan's speed (not run; the ideal uses measured throughput)")
        if summary.migration_s is None:
            lines.append("re-plan: none applied")
        else:
            moved = f", {summary.bytes_moved / 2**20:.1f} MiB moved" if summary.bytes_moved else ", no layers moved"
            lines.append(f"re-plan: {summary.applied_plan} applied at step {summary.applied_step}, "
                         f"migration {summary.migration_s:.2f} s{moved}")
    lines.append("plans: " + ", ".join(f"{label} from step {step}" for step, label in summary.plans))
    return "\n".join(lines)
