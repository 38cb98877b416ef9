"""Callbacks: straggler detection (fail-slow), heartbeat (fail-stop), fault injection, re-planning control.

Grouped by concern: :mod:`.failslow` (the detector), :mod:`.replan` (the controller),
:mod:`.faults` (fault injection), :mod:`.restart` (periodic checkpoints, elastic restart),
:mod:`.failstop` (heartbeat, recovery reports), plus :mod:`.events` and :mod:`.progress`.
The light parts import without Lightning: :mod:`.events` (``EventLog``, ``read_events``),
:mod:`.failslow.workload_model`, :mod:`.failslow.straggler_core` (the detector core),
:mod:`.failstop.heartbeat` (``Heartbeat``), :mod:`.faults.slowdowns` (``FaultConfig``, ``Slowdown``),
:mod:`.replan.replan_policy` (the controller's decisions).
The Lightning callbacks (``StragglerDetector``, ``HeartbeatMonitor``, ``FaultInjector``,
``ReplanController``) are loaded on first access, so ``import resihp_lightning.callbacks`` stays fast.
"""

from __future__ import annotations

from resihp_lightning._lazy import lazy_getattr

_EXPORTS = {
    "EventLog": "events",
    "read_events": "events",
    "EVENT_NAMES": "events",
    "WorkloadModel": "failslow.workload_model",
    "fit_workload": "failslow.workload_model",
    "OnlineWorkloadFit": "failslow.workload_model",
    "StragglerConfig": "failslow.straggler_core",
    "StragglerCore": "failslow.straggler_core",
    "LocalTracker": "failslow.straggler_core",
    "Heartbeat": "failstop.heartbeat",
    "HeartbeatConfig": "failstop.heartbeat",
    "FaultConfig": "faults.slowdowns",
    "Slowdown": "faults.slowdowns",
    "ControllerConfig": "replan.replan_policy",
    "StragglerDetector": "failslow.straggler_detector",
    "HeartbeatMonitor": "failstop.heartbeat_monitor",
    "FaultInjector": "faults.fault_injector",
    "ReplanController": "replan.replan_controller",
    "FailStopReporter": "failstop.failstop_reporter",
    "CheckpointConfig": "restart.periodic_checkpoint",
    "periodic_checkpoint": "restart.periodic_checkpoint",
    "newest_checkpoint": "restart.periodic_checkpoint",
    "ElasticRestart": "restart.elastic_restart",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, {name: f"{__name__}.{module}" for name, module in _EXPORTS.items()}, globals())
