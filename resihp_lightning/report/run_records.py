"""A run directory's records: ``steps.jsonl`` and ``events.jsonl``, and the plan labels the report prints."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resihp_lightning.errors import ConfigError
from resihp_lightning.plan import layout_label

STEPS_FILE = "steps.jsonl"
EVENTS_FILE = "events.jsonl"
TABLE_FILE = "report.txt"
PNG_FILE = "timeline.png"


@dataclass
class Run:
    """A run directory's records.

    Attributes:
        path: the run directory.
        steps: ``steps.jsonl``'s records, in file order.
        events: ``events.jsonl``'s records, in file order (empty when the run wrote none).
    """

    path: Path
    steps: list[dict[str, Any]]
    events: list[dict[str, Any]]

    def of(self, *names: str) -> list[dict[str, Any]]:
        """The events of the given kinds, in file order."""
        return [e for e in self.events if e["event"] in names]


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


def step_plan_label(record: dict[str, Any]) -> str:
    """A step record's plan: ``2x2``, or ``1x4 [2,2,3,1]`` when the replicas run different micro-batch counts."""
    return layout_label(record.get("P", 1), record.get("D", 1), record.get("micro") or [])


def event_plan_label(plan: dict[str, Any]) -> str:
    """An event's plan (``Plan.to_dict()``) labelled as :func:`step_plan_label` labels a step's."""
    replicas = plan.get("replicas") or []
    if not replicas:
        return "?"
    return layout_label(len(replicas[0]["devices"]), len(replicas), [r.get("micro_batches") for r in replicas])
