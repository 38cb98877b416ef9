"""Evaluation: failure traces replayed against resilience policies (docs/evaluation.md).

* :mod:`.profiles`: first-principles model profiles (FLOPs, memory, communication) for the planner;
* :mod:`.traces`: failure traces (files, or drawn from published statistics);
* :mod:`.costs`: what detection, planning, migration and restarts cost, from this project's benchmarks;
* :mod:`.cluster`: planner devices from GPU states, cached solves, plan prices;
* :mod:`.trace_policies`: the systems compared; :mod:`.replay`: the replay itself;
* :mod:`.run`: one call that replays a trace under several policies.

Plain Python and the planner; no torch.
"""

from resihp_lightning.evaluation.costs import CostModel
from resihp_lightning.evaluation.profiles import MODELS, HardwareSpec, ModelProfile, ModelSpec, WorkloadSpec, build_profile
from resihp_lightning.evaluation.traces import SCENARIOS, Trace, TraceConfig, TraceError, TraceEvent, generate

__all__ = [
    "CostModel", "MODELS", "HardwareSpec", "ModelProfile", "ModelSpec", "WorkloadSpec", "build_profile",
    "SCENARIOS", "Trace", "TraceConfig", "TraceError", "TraceEvent", "generate",
]
