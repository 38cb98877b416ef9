"""The report of a training run, from its run directory: ``report.txt`` and ``timeline.png``.

A run directory holds ``events.jsonl`` (:mod:`resihp_lightning.callbacks.events`) and ``steps.jsonl``
(:class:`resihp_lightning.callbacks.progress.StepRecorder`). The report has two parts:

* **what happened** (:mod:`~resihp_lightning.report.timeline`): the run cut into phases at every
  incident the job detected or caused — a fail-stop (lost and evicted ranks named, the recovery and
  what it took), a fail-slow, a slow link, a healing, a plan change, a restart — with the world size,
  the plans and the throughput of each phase. Injected faults are annotations there, nothing more:
  a ``kill -9`` from outside reads the same as an injected kill;
* **the injected fault's evaluation** (:mod:`~resihp_lightning.report.injected`), when the run
  injected one (``examples/finetune.py --fault``): throughput before, during and after it against the
  ideal (the table the README shows).

The picture (:mod:`~resihp_lightning.report.plot`) draws the step time, the tokens/s with each phase's
throughput, and the processes per step, every incident and injected fault marked.
:func:`render` writes both; ``resihp report RUN_DIR`` calls it. Importing this package is cheap.
"""

from __future__ import annotations

import os
from pathlib import Path

from resihp_lightning.report.injected import Phase, Summary, format_table, summarize
from resihp_lightning.report.run_records import EVENTS_FILE, PNG_FILE, STEPS_FILE, TABLE_FILE, Run, load_run
from resihp_lightning.report.timeline import Timeline, build_timeline, format_timeline

__all__ = [
    "EVENTS_FILE", "PNG_FILE", "STEPS_FILE", "TABLE_FILE", "Phase", "Run", "Summary", "Timeline", "build_timeline",
    "format_report", "format_table", "format_timeline", "load_run", "render", "summarize",
]


def format_report(timeline: Timeline, summary: Summary) -> str:
    """The report's text: what happened, then the injected fault's evaluation (or that none was injected)."""
    parts = [format_timeline(timeline)]
    if summary.fault is None:
        parts.append("no fault injected: everything above is what the job detected")
    else:
        parts.append("the injected fault:\n" + format_table(summary))
    return "\n\n".join(parts)


def render(run_dir: str | os.PathLike[str], png: str | os.PathLike[str] | None = None,
           write_table: bool = True) -> tuple[str, Path]:
    """Reads a run, writes ``report.txt`` and the PNG (default ``<run_dir>/timeline.png``).

    Returns:
        The report's text and the PNG's path.
    """
    from resihp_lightning.report.plot import plot

    run = load_run(run_dir)
    timeline = build_timeline(run)
    summary = summarize(run)
    text = format_report(timeline, summary)
    if write_table:
        (run.path / TABLE_FILE).write_text(text + "\n", encoding="utf-8")
    out = plot(run, timeline, summary, png or run.path / PNG_FILE)
    return text, out
