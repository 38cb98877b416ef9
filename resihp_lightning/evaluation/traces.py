"""Failure traces: what goes wrong on which GPU when, read from a file or drawn from published statistics.

A trace is a cluster of ``gpus`` GPUs (``gpus_per_node`` per node) over ``duration_s`` seconds and a
list of events:

* ``fail_slow``: GPU ``gpu`` computes ``slowdown`` times slower from ``start_s`` for ``duration_s``;
* ``fail_stop``: GPU ``gpu`` dies at ``start_s``; it is back (repaired or replaced) after
  ``duration_s``, or never when that is ``null``;
* ``comm_slow``: node ``node``'s network links are ``slowdown`` times slower for ``duration_s``.

The file format (JSON, or YAML when PyYAML is installed) is documented in docs/evaluation.md::

    {"gpus": 32, "duration_s": 3600, "gpus_per_node": 8,
     "events": [{"kind": "fail_slow", "start_s": 600, "duration_s": 900, "gpu": 5, "slowdown": 2.0},
                {"kind": "fail_stop", "start_s": 1800, "duration_s": null, "gpu": 12}]}

:func:`generate` draws seeded, deterministic traces (see :class:`TraceConfig` for the statistics).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resihp_lightning.errors import ConfigError, invalid_option

KINDS = ("fail_slow", "fail_stop", "comm_slow")
#: The scenarios :func:`generate` draws.
SCENARIOS = ("fail-slow", "fail-stop", "comm-slow", "mixed")


class TraceError(ConfigError):
    """A trace file or trace option is malformed (names the field and what is allowed)."""


@dataclass(frozen=True)
class TraceEvent:
    """One failure episode.

    Attributes:
        kind: ``"fail_slow"``, ``"fail_stop"`` or ``"comm_slow"``.
        start_s: when it starts, seconds from the trace's start.
        duration_s: how long it lasts; ``None`` until the end of the trace (a fail-stop never repaired).
        gpu: the GPU (``fail_slow``, ``fail_stop``).
        node: the node (``comm_slow``).
        slowdown: time factor >= 1 (compute for ``fail_slow``, network for ``comm_slow``).
    """

    kind: str
    start_s: float
    duration_s: float | None = None
    gpu: int | None = None
    node: int | None = None
    slowdown: float = 1.0

    @property
    def end_s(self) -> float:
        return math.inf if self.duration_s is None else self.start_s + self.duration_s


@dataclass(frozen=True)
class Trace:
    """A cluster and what happens to it.

    Attributes:
        gpus: GPUs in the job.
        duration_s: length of the trace.
        events: the episodes, in any order.
        gpus_per_node: GPUs per node (a ``comm_slow`` hits a node's GPUs).
        name: a label for tables.
    """

    gpus: int
    duration_s: float
    events: tuple[TraceEvent, ...] = ()
    gpus_per_node: int = 8
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(sorted(self.events, key=lambda e: (e.start_s, e.kind, e.gpu or 0, e.node or 0))))
        _validate(self)

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    def change_times(self) -> list[float]:
        """Every time the cluster's state changes (starts and ends inside the trace), ascending."""
        times = {0.0}
        for e in self.events:
            times.add(e.start_s)
            if e.end_s < self.duration_s:
                times.add(e.end_s)
        return sorted(t for t in times if t < self.duration_s)

    def state_at(self, t: float) -> GpuState:
        """The GPUs' and nodes' state at time ``t`` (an event is on for start <= t < end)."""
        slow = [1.0] * self.gpus
        alive = [True] * self.gpus
        comm = [1.0] * self.nodes
        for e in self.events:
            if not e.start_s <= t < e.end_s:
                continue
            if e.kind == "fail_slow":
                slow[e.gpu] = max(slow[e.gpu], e.slowdown)
            elif e.kind == "fail_stop":
                alive[e.gpu] = False
            else:
                comm[e.node] = max(comm[e.node], e.slowdown)
        return GpuState(tuple(1.0 / s for s in slow), tuple(alive), tuple(comm), self.gpus_per_node)

    # ------------------------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        events = []
        for e in self.events:
            item: dict[str, Any] = {"kind": e.kind, "start_s": e.start_s, "duration_s": e.duration_s}
            if e.kind == "comm_slow":
                item["node"] = e.node
            else:
                item["gpu"] = e.gpu
            if e.kind != "fail_stop":
                item["slowdown"] = e.slowdown
            events.append(item)
        return {"name": self.name, "gpus": self.gpus, "duration_s": self.duration_s,
                "gpus_per_node": self.gpus_per_node, "events": events}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, data: Any) -> Trace:
        """Reads a trace from its JSON form; every error names the field and what is allowed."""
        if not isinstance(data, Mapping):
            raise TraceError(f"a trace must be an object with gpus, duration_s and events, got {type(data).__name__}")
        allowed = {"name", "gpus", "duration_s", "gpus_per_node", "events"}
        _refuse_unknown(data, allowed, "trace")
        for key in ("gpus", "duration_s", "events"):
            if key not in data:
                raise TraceError(f"trace is missing the field '{key}'")
        if not isinstance(data["events"], list):
            raise TraceError(f"trace field 'events' must be a list, got {type(data['events']).__name__}")
        events = tuple(_event_from_dict(item, i) for i, item in enumerate(data["events"]))
        return cls(
            gpus=data["gpus"], duration_s=data["duration_s"], events=events,
            gpus_per_node=data.get("gpus_per_node", 8), name=str(data.get("name", "")),
        )

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Reads a JSON file, or a YAML file (``.yaml`` / ``.yml``, needs PyYAML)."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as err:
            raise TraceError(f"cannot read trace file {str(path)!r}: {err.strerror}") from None
        if path.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise TraceError("reading a YAML trace needs PyYAML (pip install pyyaml); or give the trace as JSON") from None
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as err:
                raise TraceError(f"trace file {str(path)!r} is not valid YAML: {err}") from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                raise TraceError(f"trace file {str(path)!r} is not valid JSON: {err}") from None
        return cls.from_dict(data)


@dataclass(frozen=True)
class GpuState:
    """The cluster at one moment.

    Attributes:
        speed: per GPU, 1 / slowdown.
        alive: per GPU.
        comm: per node, the network slowdown (>= 1).
        gpus_per_node: GPUs per node.
    """

    speed: tuple[float, ...]
    alive: tuple[bool, ...]
    comm: tuple[float, ...]
    gpus_per_node: int

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node


@dataclass(frozen=True)
class TraceConfig:
    """How :func:`generate` draws a trace. Defaults follow published numbers (docs/evaluation.md).

    Arrivals are Poisson; ``*_per_hour`` rates are for the whole job (the paper injects at fixed
    rates whatever the scale) unless ``per_1000_gpus`` scales them by gpus / 1000.

    Attributes:
        gpus: GPUs in the job.
        hours: trace length.
        gpus_per_node: GPUs per node.
        fail_slow_per_hour: compute fail-slow episodes per hour.
        fail_slow_severities: slowdowns drawn uniformly (the paper's weak / medium / strong SM-clock
            locks read as 1.2 / 1.5 / 2.0; ByteDance's injected 1.16 / 1.40 / 2.03 are close).
        fail_slow_median_min: median episode length, minutes (log-normal, sigma ``duration_sigma``).
        fail_stop_every_min: one fail-stop every this many minutes (the paper: 30); ``None`` draws
            Poisson arrivals at ``fail_stop_per_gpu_day`` instead.
        fail_stop_per_gpu_day: field rate (Llama 3: 419 interruptions / 16,384 GPUs / 54 days).
        repair_min: minutes until a dead GPU is back; ``None`` never.
        comm_slow_per_hour: network slowdown episodes per hour (one node each).
        comm_slow_severities: network slowdowns drawn uniformly.
        comm_slow_median_min: median length, minutes (Greyhound: mean 24 min for communication).
        duration_sigma: log-normal sigma of episode lengths.
        min_duration_min: shortest episode (minutes).
        max_duration_min: longest episode (Greyhound saw up to about 10 hours).
        per_1000_gpus: scale the per-hour rates by gpus / 1000.
    """

    gpus: int = 256
    hours: float = 8.0
    gpus_per_node: int = 8
    fail_slow_per_hour: float = 2.0
    fail_slow_severities: tuple[float, ...] = (1.2, 1.5, 2.0)
    fail_slow_median_min: float = 20.0
    fail_stop_every_min: float | None = 30.0
    fail_stop_per_gpu_day: float = 4.7e-4
    repair_min: float | None = 60.0
    comm_slow_per_hour: float = 2.0
    comm_slow_severities: tuple[float, ...] = (2.0, 4.0, 8.0)
    comm_slow_median_min: float = 20.0
    duration_sigma: float = 1.0
    min_duration_min: float = 1.0
    max_duration_min: float = 600.0
    per_1000_gpus: bool = False


def generate(scenario: str, config: TraceConfig | None = None, seed: int = 0) -> Trace:
    """Draws a trace of ``scenario`` (one of :data:`SCENARIOS`), deterministically from ``seed``.

    * ``fail-slow``: compute fail-slow episodes only;
    * ``fail-stop``: fail-stops only (one every ``fail_stop_every_min``, a GPU chosen at random);
    * ``comm-slow``: network slowdowns only;
    * ``mixed``: all three, drawn independently.
    """
    if scenario not in SCENARIOS:
        raise invalid_option("scenario", scenario, SCENARIOS)
    config = config or TraceConfig()
    rng = random.Random(f"{scenario}/{seed}/{config.gpus}")
    horizon = config.hours * 3600.0
    scale = config.gpus / 1000.0 if config.per_1000_gpus else 1.0
    events: list[TraceEvent] = []
    if scenario in ("fail-slow", "mixed"):
        for start in _poisson(rng, config.fail_slow_per_hour * scale, horizon):
            events.append(TraceEvent("fail_slow", start, _duration(rng, config.fail_slow_median_min, config),
                                     gpu=rng.randrange(config.gpus), slowdown=rng.choice(config.fail_slow_severities)))
    if scenario in ("fail-stop", "mixed"):
        if config.fail_stop_every_min is not None:
            step = config.fail_stop_every_min * 60.0
            starts = [step * k for k in range(1, int(horizon // step) + 1) if step * k < horizon]
        else:
            starts = _poisson(rng, config.fail_stop_per_gpu_day * config.gpus / 24.0, horizon)
        dead: dict[int, float] = {}
        for start in starts:
            # A GPU that is still dead cannot die again: pick among the live ones.
            live = [g for g in range(config.gpus) if dead.get(g, -1.0) <= start]
            gpu = rng.choice(live)
            repair = None if config.repair_min is None else config.repair_min * 60.0
            dead[gpu] = math.inf if repair is None else start + repair
            events.append(TraceEvent("fail_stop", start, repair, gpu=gpu))
    if scenario in ("comm-slow", "mixed"):
        nodes = math.ceil(config.gpus / config.gpus_per_node)
        for start in _poisson(rng, config.comm_slow_per_hour * scale, horizon):
            events.append(TraceEvent("comm_slow", start, _duration(rng, config.comm_slow_median_min, config),
                                     node=rng.randrange(nodes), slowdown=rng.choice(config.comm_slow_severities)))
    return Trace(config.gpus, horizon, tuple(events), config.gpus_per_node, name=f"{scenario} seed {seed}")


def _poisson(rng: random.Random, per_hour: float, horizon_s: float) -> list[float]:
    times, t = [], 0.0
    if per_hour <= 0:
        return times
    while True:
        t += rng.expovariate(per_hour / 3600.0)
        if t >= horizon_s:
            return times
        times.append(round(t, 3))


def _duration(rng: random.Random, median_min: float, config: TraceConfig) -> float:
    minutes = median_min * math.exp(rng.gauss(0.0, config.duration_sigma))
    return round(60.0 * min(max(minutes, config.min_duration_min), config.max_duration_min), 3)


# ----------------------------------------------------------------------------------- validation
def _refuse_unknown(data: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise TraceError(f"unknown field '{unknown[0]}' in {where}; allowed: {', '.join(sorted(allowed))}")


def _event_from_dict(item: Any, index: int) -> TraceEvent:
    where = f"events[{index}]"
    if not isinstance(item, Mapping):
        raise TraceError(f"{where} must be an object, got {type(item).__name__}")
    kind = item.get("kind")
    if kind not in KINDS:
        raise TraceError(f"{where}.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    allowed = {"kind", "start_s", "duration_s"} | ({"node", "slowdown"} if kind == "comm_slow" else {"gpu"})
    if kind == "fail_slow":
        allowed.add("slowdown")
    _refuse_unknown(item, allowed, f"{where} ({kind})")
    for key in ("start_s", "node" if kind == "comm_slow" else "gpu") + (("slowdown",) if kind != "fail_stop" else ()):
        if key not in item:
            raise TraceError(f"{where} ({kind}) is missing the field '{key}'")
    return TraceEvent(kind, item["start_s"], item.get("duration_s"), gpu=item.get("gpu"), node=item.get("node"),
                      slowdown=item.get("slowdown", 1.0))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _validate(trace: Trace) -> None:
    if not isinstance(trace.gpus, int) or isinstance(trace.gpus, bool) or trace.gpus < 1:
        raise TraceError(f"trace field 'gpus' must be an integer >= 1, got {trace.gpus!r}")
    if not _number(trace.duration_s) or trace.duration_s <= 0:
        raise TraceError(f"trace field 'duration_s' must be a number of seconds > 0, got {trace.duration_s!r}")
    if not isinstance(trace.gpus_per_node, int) or isinstance(trace.gpus_per_node, bool) or trace.gpus_per_node < 1:
        raise TraceError(f"trace field 'gpus_per_node' must be an integer >= 1, got {trace.gpus_per_node!r}")
    for i, e in enumerate(trace.events):
        where = f"events[{i}] ({e.kind}, start_s={e.start_s!r})"
        if e.kind not in KINDS:
            raise TraceError(f"{where}: kind must be one of {', '.join(KINDS)}")
        if not _number(e.start_s) or not 0 <= e.start_s:
            raise TraceError(f"{where}: start_s must be a number of seconds >= 0, got {e.start_s!r}")
        if e.duration_s is not None and (not _number(e.duration_s) or e.duration_s <= 0):
            raise TraceError(f"{where}: duration_s must be a number of seconds > 0 or null, got {e.duration_s!r}")
        if e.kind == "comm_slow":
            if not isinstance(e.node, int) or isinstance(e.node, bool) or not 0 <= e.node < trace.nodes:
                raise TraceError(f"{where}: node must be an integer in 0..{trace.nodes - 1}, got {e.node!r}")
        elif not isinstance(e.gpu, int) or isinstance(e.gpu, bool) or not 0 <= e.gpu < trace.gpus:
            raise TraceError(f"{where}: gpu must be an integer in 0..{trace.gpus - 1}, got {e.gpu!r}")
        if not _number(e.slowdown) or e.slowdown < 1:
            raise TraceError(f"{where}: slowdown must be a number >= 1 (a time factor), got {e.slowdown!r}")
