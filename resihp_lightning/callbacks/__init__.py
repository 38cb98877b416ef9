"""Callbacks: straggler detection (fail-slow), heartbeat (fail-stop), fault injection, re-planning control.

The light parts import without Lightning: :mod:`.events` (``EventLog``, ``read_events``),
:mod:`.workload_model`, :mod:`.straggler` (the detector core), :mod:`.heartbeat` (``Heartbeat``),
:mod:`.faults` (``FaultConfig``, ``Slowdown``), :mod:`.replan_policy` (the controller's decisions).
The Lightning callbacks (``StragglerDetector``, ``HeartbeatMonitor``, ``FaultInjector``,
``ReplanController``) are loaded on first access, so ``import resihp_lightning.callbacks`` stays fast.
"""

from __future__ import annotations

from resihp_lightning._lazy import lazy_getattr

_EXPORTS = {
    "EventLog": "events",
    "read_events": "events",
    "EVENT_NAMES": "events",
    "WorkloadModel": "workload_model",
    "fit_workload": "workload_model",
    "OnlineWorkloadFit": "workload_model",
    "DetectorConfig": "straggler",
    "StragglerCore": "straggler",
    "LocalTracker": "straggler",
    "Heartbeat": "heartbeat",
    "HeartbeatConfig": "heartbeat",
    "FaultConfig": "faults",
    "Slowdown": "faults",
    "ControllerConfig": "replan_policy",
    "StragglerDetector": "detector",
    "HeartbeatMonitor": "heartbeat_callback",
    "FaultInjector": "fault_injector",
    "ReplanController": "controller",
    "FailStopReporter": "recovery_log",
    "CheckpointConfig": "periodic_checkpoint",
    "periodic_checkpoint": "periodic_checkpoint",
    "newest_checkpoint": "periodic_checkpoint",
    "ElasticRestart": "elastic",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, {name: f"{__name__}.{module}" for name, module in _EXPORTS.items()}, globals())
