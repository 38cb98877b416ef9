"""Replays one trace under several policies on one shared cluster (solves are cached across them)."""

from __future__ import annotations

from collections.abc import Sequence

from resihp_lightning.config import PlannerConfig
from resihp_lightning.evaluation.cluster import Cluster
from resihp_lightning.evaluation.costs import CostModel
from resihp_lightning.evaluation.trace_policies import POLICY_NAMES, make_policy
from resihp_lightning.evaluation.profiles import ModelProfile
from resihp_lightning.evaluation.replay import Result, replay
from resihp_lightning.evaluation.traces import Trace


def run_trace(
    trace: Trace,
    profile: ModelProfile,
    policies: Sequence[str] = POLICY_NAMES,
    costs: CostModel | None = None,
    planner: PlannerConfig | None = None,
    *,
    cluster: Cluster | None = None,
) -> dict[str, Result]:
    """Replays ``trace`` under each policy (by name, :data:`~resihp_lightning.evaluation.trace_policies.POLICY_NAMES`); deterministic.

    Args:
        trace: the failure trace.
        profile: the model on one planner device (its ``workload.tp`` GPUs per device).
        policies: the policies to run.
        costs: reaction costs (default :class:`~resihp_lightning.evaluation.costs.CostModel`).
        planner: the planner's options (default: the exact search with a 1 s work budget).
        cluster: a :class:`~resihp_lightning.evaluation.cluster.Cluster` of this trace and profile to reuse (its solves are cached, e.g. the
            healthy plan :func:`healthy_tokens_per_s` also needs); default: a new one.

    Returns:
        Each policy's :class:`~resihp_lightning.evaluation.replay.Result`, in the order given.
    """
    cluster = cluster or Cluster(trace, profile, costs, planner)
    return {name: replay(cluster, make_policy(name)) for name in policies}


def healthy_tokens_per_s(
    trace: Trace, profile: ModelProfile, planner: PlannerConfig | None = None, *, cluster: Cluster | None = None
) -> float:
    """Throughput of the healthy plan with nothing failing (the ceiling of every policy); ``cluster``
    as in :func:`run_trace`."""
    from resihp_lightning.evaluation.trace_policies import NoAdaptation, healthy_state

    cluster = cluster or Cluster(trace, profile, None, planner)
    layout = NoAdaptation().start(cluster)
    return cluster.tokens_per_iteration / (layout.iteration_ms(cluster, healthy_state(cluster)) / 1000.0)
