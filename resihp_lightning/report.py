"""The report of a training run: a throughput table and a PNG timeline from its run directory.

A run directory holds ``events.jsonl`` (:mod:`resihp_lightning.callbacks.events`) and ``steps.jsonl``
(:class:`resihp_lightning.callbacks.progress.StepRecorder`: one line per step with ``step``,
``wall_ms``, ``tokens``, ``P``, ``D``, ``micro``, ``migrated``, ...). :func:`summarize` splits the
steps into phases that follow the events of the first injected slowdown: the device's condition
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
latency counts steps from the fault's first step to the first ``fail_slow_detected`` of that rank;
recovery latency from the fault's ``end_step`` to the first ``fail_slow_recovered`` after it.

Importing this module is cheap; matplotlib is loaded (Agg backend) only to draw.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resihp_lightning.errors import ConfigError

STEPS_FILE = "steps.jsonl"
EVENTS_FILE = "events.jsonl"
#: Fault kinds that end or freeze a rank (fail-stop).
STOP_KINDS = ("kill", "hang")
#: Fault kinds that slow a rank's links (its sends / all-reduces), not its compute.
LINK_KINDS = ("slow_link", "delay_p2p")
TABLE_FILE = "report.txt"
START_PLAN_FILE = "initial_plan.json"
PNG_FILE = "timeline.png"


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


@dataclass
class Run:
    """A run directory's records."""

    path: Path
    steps: list[dict[str, Any]]
    events: list[dict[str, Any]]


def load_run(run_dir: str | os.PathLike[str]) -> Run:
    """Reads ``steps.jsonl`` and ``events.jsonl`` (the latter may be missing: a run without events).

    Raises:
        ConfigError: no such directory, no steps file, or no step recorded.
    """
    from resihp_lightning.callbacks.events import iter_jsonl, read_events

    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"run directory {str(path)!r} does not exist")
    steps_path = path / STEPS_FILE
    if not steps_path.is_file():
        raise ConfigError(f"{str(path)!r} is not a run directory: no {STEPS_FILE}")
    steps = []
    for number, record in iter_jsonl(steps_path):
        if not isinstance(record, dict) or not {"step", "wall_ms", "tokens"} <= set(record):
            raise ConfigError(f"{steps_path}:{number}: not a step record (needs step, wall_ms, tokens)")
        steps.append(record)
    if not steps:
        raise ConfigError(f"{str(steps_path)!r} records no steps (did the run train at all?)")
    events = read_events(path) if (path / EVENTS_FILE).is_file() else []
    return Run(path, steps, events)


def _plan_label(record: dict[str, Any]) -> str:
    label = f"{record.get('P', 1)}x{record.get('D', 1)}"
    micro = record.get("micro") or []
    if len(set(micro)) > 1:
        label += " [" + ",".join(str(m) for m in micro) + "]"
    return label


def _event_plan_label(plan: dict[str, Any]) -> str:
    replicas = plan.get("replicas") or []
    if not replicas:
        return "?"
    label = f"{len(replicas[0]['devices'])}x{len(replicas)}"
    micro = [r.get("micro_batches") for r in replicas]
    if len(set(micro)) > 1:
        label += " [" + ",".join(str(m) for m in micro) + "]"
    return label


def summarize(run: Run, skip: int = 3) -> Summary:
    """Splits the run into phases (see the module docstring) and collects the loop's milestones.

    Args:
        run: from :func:`load_run`.
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
        detected_event = "slow_link_detected" if fault.get("kind") in LINK_KINDS else "fail_slow_detected"
        detections = [e for e in run.events if e["event"] == detected_event and e.get("rank") == fault["rank"]
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
            recovered_event = "slow_link_recovered" if fault.get("kind") in LINK_KINDS else "fail_slow_recovered"
            recovered = [e for e in run.events if e["event"] == recovered_event and e.get("rank") == fault["rank"]
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


def plot(run: Run, summary: Summary, out: str | os.PathLike[str]) -> Path:
    """Draws the timeline: step time and tokens/s per step, fault / detection / plan changes marked."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = sorted(run.steps, key=lambda r: r["step"])
    xs = [r["step"] for r in steps]
    wall = [r["wall_ms"] / 1000.0 for r in steps]
    rate = [r["tokens"] / (r["wall_ms"] / 1000.0) if r["wall_ms"] > 0 else 0.0 for r in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    top.plot(xs, wall, marker="o", markersize=3, linewidth=1.2, color="tab:blue", label="step wall time")
    bottom.plot(xs, rate, marker="o", markersize=3, linewidth=1.2, color="tab:purple", label="tokens/s (per step)")
    colors = ("tab:green", "tab:red", "tab:blue", "tab:olive", "tab:cyan")
    for phase, color in zip(summary.phases or [summary.healthy, summary.slowed, summary.after], colors):
        value = phase.tokens_per_s
        if value is not None:
            bottom.hlines(value, phase.steps[0], phase.steps[-1], colors=color, linewidth=2.5,
                          label=f"{phase.name}: {value:.0f}")
    if summary.ideal_tokens_per_s is not None and summary.fault is not None:
        bottom.axhline(summary.ideal_tokens_per_s, color="gray", linestyle=":", linewidth=1.5,
                       label=f"ideal: {summary.ideal_tokens_per_s:.0f}")
    marks = []
    if summary.stop_fault:
        marks.append((int(summary.fault["start_step"]), "tab:red", "--",
                      f"rank {summary.fault.get('rank')} {summary.fault.get('kind')}ed"))
    elif summary.fault is not None:
        marks.append((int(summary.fault["start_step"]), "tab:red", "--",
                      f"fault: {_fault_label(summary.fault)}"))
    if summary.detected_step is not None and not summary.stop_fault:
        marks.append((summary.detected_step, "tab:orange", "-.", f"detected (+{summary.detection_latency} steps)"))
    if summary.healed_step is not None:
        marks.append((summary.healed_step, "tab:red", ":", "device healed"))
    if summary.recovered_step is not None:
        marks.append((summary.recovered_step, "tab:orange", ":", f"recovered (+{summary.recovery_latency} steps)"))
    for step, label in summary.plans[1:]:
        marks.append((step, "tab:green", "-", f"plan {label}"))
    top_y = max(wall) if wall else 1.0
    for i, (x, color, style, text) in enumerate(marks):
        for ax in (top, bottom):
            ax.axvline(x, color=color, linestyle=style, linewidth=1.3)
        top.annotate(text, (x, top_y * (1.02 - 0.09 * (i % 4))), xytext=(4, 0), textcoords="offset points",
                     color=color, fontsize=9, va="top",
                     bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    if summary.migration_s is not None and summary.applied_step is not None:
        what = "recovery" if summary.stop_fault else "migration"
        seconds = summary.recovery["total_s"] if summary.stop_fault and summary.recovery else summary.migration_s
        top.annotate(f"{what} {seconds:.2f} s", (summary.applied_step, wall[xs.index(summary.applied_step)])
                     if summary.applied_step in xs else (summary.applied_step, top_y * 0.5),
                     xytext=(8, -12), textcoords="offset points", fontsize=8, color="tab:green",
                     bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    top.set_ylabel("step wall time (s)")
    top.set_ylim(0, top_y * 1.08)
    top.grid(alpha=0.3)
    bottom.set_ylabel("tokens/s")
    bottom.set_xlabel("training step")
    bottom.set_ylim(0, max(rate + [summary.ideal_tokens_per_s or 0]) * 1.15)
    bottom.grid(alpha=0.3)
    bottom.legend(loc="lower left", fontsize=8, ncol=2)
    title = f"{run.path.name}: {summary.world_size} processes, {summary.steps} steps"
    top.set_title(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def render(run_dir: str | os.PathLike[str], png: str | os.PathLike[str] | None = None,
           write_table: bool = True) -> tuple[str, Path]:
    """Reads a run, writes ``report.txt`` and the PNG (default ``<run_dir>/timeline.png``).

    Returns:
        The table text and the PNG's path.
    """
    run = load_run(run_dir)
    summary = summarize(run)
    text = format_table(summary)
    if write_table:
        (run.path / TABLE_FILE).write_text(text + "\n", encoding="utf-8")
    out = plot(run, summary, png or run.path / PNG_FILE)
    return text, out
