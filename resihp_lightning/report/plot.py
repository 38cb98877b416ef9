"""The timeline picture: step time, tokens/s and processes per step, every incident marked.

matplotlib is imported (Agg backend) only when drawing.
"""

from __future__ import annotations

import os
from pathlib import Path

from resihp_lightning.report.injected import Summary
from resihp_lightning.report.run_records import Run
from resihp_lightning.report.timeline import Incident, Timeline

#: Marker colour and line style per incident kind.
STYLES = {
    "fail_stop": ("tab:red", "-"),
    "unrecoverable": ("darkred", "-"),
    "fail_slow": ("tab:orange", "-."),
    "slow_link": ("tab:orange", "-."),
    "healed": ("tab:cyan", ":"),
    "plan": ("tab:green", "-"),
    "restart": ("tab:purple", "-"),
}
PHASE_COLORS = ("tab:green", "tab:red", "tab:blue", "tab:olive", "tab:cyan", "tab:brown", "tab:pink", "tab:gray")


def marker_label(incident: Incident) -> str:
    """A short label for the picture (the report's line says the rest)."""
    if incident.kind == "fail_stop":
        ranks = ", ".join(str(r) for r in incident.ranks)
        verb = "evicted" if "evicted" in incident.text.split(";")[0] else "lost"
        label = f"rank{'s' if len(incident.ranks) > 1 else ''} {ranks} {verb}"
        if incident.seconds is not None:
            label += f", recovered in {incident.seconds:.2f} s on {incident.world}"
        return label
    if incident.kind == "plan":
        return f"plan {incident.plan}" + (f" ({incident.seconds:.2f} s)" if incident.seconds is not None else "")
    if incident.kind == "restart":
        return f"restart on {incident.world}"
    if incident.kind == "unrecoverable":
        return "unrecoverable: exit for a restart"
    return incident.text


def plot(run: Run, timeline: Timeline, summary: Summary | None, out: str | os.PathLike[str]) -> Path:
    """Draws the picture into ``out`` (PNG).

    Args:
        run: the run's records.
        timeline: from :func:`~resihp_lightning.report.timeline.build_timeline`: the phases and incidents drawn.
        summary: the injected-fault evaluation, whose ideal is drawn when there was an injected fault.
        out: the PNG's path.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = sorted(run.steps, key=lambda r: r["step"])
    xs = [r["step"] for r in steps]
    wall = [r["wall_ms"] / 1000.0 for r in steps]
    rate = [r["tokens"] / (r["wall_ms"] / 1000.0) if r["wall_ms"] > 0 else 0.0 for r in steps]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(11, 7.5), sharex=True,
                                              gridspec_kw={"height_ratios": [3, 2, 1]})
    top.plot(xs, wall, marker="o", markersize=3, linewidth=1.2, color="tab:blue", label="step wall time")
    middle.plot(xs, rate, marker="o", markersize=3, linewidth=1.2, color="tab:purple", label="tokens/s (per step)")
    for number, phase in enumerate(timeline.phases, start=1):
        value = phase.tokens_per_s
        if value is not None:
            middle.hlines(value, phase.first - 0.4, phase.last + 0.4, colors=PHASE_COLORS[(number - 1) % len(PHASE_COLORS)],
                          linewidth=2.5, label=f"{number}. {phase.condition} ({phase.world}): {value:.0f}")
    ideal = summary.ideal_tokens_per_s if summary is not None and summary.fault is not None else None
    if ideal is not None:
        middle.axhline(ideal, color="gray", linestyle=":", linewidth=1.5, label=f"ideal under the injected fault: {ideal:.0f}")
    world_x = [p.first for p in timeline.phases] + [timeline.phases[-1].last]
    world_y = [p.world for p in timeline.phases] + [timeline.phases[-1].world]
    bottom.step(world_x, world_y, where="post", color="tab:gray", linewidth=2)
    bottom.set_ylim(0, max(world_y) + 1)
    bottom.set_ylabel("processes")
    marks = [(i.step, *STYLES.get(i.kind, ("black", "-")), marker_label(i)) for i in timeline.incidents]
    marks += [(a.step, "gray", "--", a.text) for a in timeline.annotations]
    marks.sort(key=lambda m: m[0])
    top_y = max(wall) if wall else 1.0
    for i, (x, color, style, text) in enumerate(marks):
        for ax in (top, middle, bottom):
            ax.axvline(x, color=color, linestyle=style, linewidth=1.3)
        top.annotate(text, (x, top_y * (1.02 - 0.09 * (i % 5))), xytext=(4, 0), textcoords="offset points",
                     color=color, fontsize=8.5, va="top",
                     bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    top.set_ylabel("step wall time (s)")
    top.set_ylim(0, top_y * 1.08)
    top.grid(alpha=0.3)
    middle.set_ylabel("tokens/s")
    middle.set_ylim(0, max(rate + [ideal or 0]) * 1.15 or 1.0)
    middle.grid(alpha=0.3)
    middle.legend(loc="best", fontsize=7.5, ncol=2)
    bottom.set_xlabel("training step")
    bottom.grid(alpha=0.3)
    top.set_title(f"{run.path.name}: {timeline.steps} steps on {timeline.world_label}")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
