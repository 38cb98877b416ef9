"""Trace replay: exact token accounting on hand-checkable traces, each policy's behaviour, the oracle's bound."""

from __future__ import annotations

import pytest

from resihp_lightning.evaluation import CostModel, Trace, TraceConfig, TraceEvent, WorkloadSpec, build_profile, generate
from resihp_lightning.evaluation.cluster import Cluster
from resihp_lightning.evaluation.trace_policies import POLICY_NAMES, make_policy
from resihp_lightning.evaluation.profiles import HardwareSpec, ModelProfile, MODELS
from resihp_lightning.evaluation.replay import replay
from resihp_lightning.evaluation.run import run_trace
from resihp_lightning.plan import Layer

# Round numbers, so that every phase below can be checked by hand.
COSTS = CostModel(stop_detect_s=1.0, regroup_s=2.0, rebuild_shared_s=0.25, rebuild_per_replica_s=0.25,
                  slow_detect_iters=3, heal_detect_iters=5, plan_s=((1 << 30, 0.5),), restart_fixed_s=10.0,
                  comm_init_s_per_gpu=0.5, checkpoint_read_gbps=1.0, checkpoint_every_s=900.0)


def tiny_profile(layers: int = 4, per_device: int = 2) -> ModelProfile:
    """``layers`` layers of 1 s and 250 MB, 1000 tokens per micro-batch, no communication."""
    workload = WorkloadSpec(seq_len=1000, micro_batches_per_device=per_device)
    return ModelProfile(MODELS["llama2-7b"], HardwareSpec(), workload, tuple(Layer(1000.0, 250.0, 1.0) for _ in range(layers)),
                        p2p_ms=0.0, allreduce_ms=0.0, reference_stages=1)


def run(trace: Trace, policy: str, profile: ModelProfile | None = None):
    return replay(Cluster(trace, profile or tiny_profile(), COSTS), make_policy(policy))


def test_no_adaptation_through_a_fail_slow_by_hand():
    # 2 GPUs, 4 layers of 1 s, M = 4: the best healthy plan is 1 x 2 with 2 micro-batches each, T = 8 s,
    # 4000 tokens per iteration = 500 tokens/s. GPU 1 at half speed: T = 16 s, 250 tokens/s.
    trace = Trace(2, 100.0, (TraceEvent("fail_slow", 40.0, 40.0, gpu=1, slowdown=2.0),))
    result = run(trace, "none")
    assert result.tokens == pytest.approx(40 * 500 + 40 * 250 + 20 * 500)
    assert result.lost_tokens == 0 and result.paused_s == 0


def test_joint_planner_through_a_fail_slow_by_hand():
    trace = Trace(2, 400.0, (TraceEvent("fail_slow", 40.0, 200.0, gpu=1, slowdown=2.0),))
    result = run(trace, "joint_per_replica")
    # 40 s healthy; the detector needs 3 slowed iterations (48 s), the planner 0.5 s more; switching
    # to 3 + 1 micro-batches (T = 12 s, 333.3 tokens/s) moves nothing and pauses 0.25 s. At 240 s the
    # device heals: 5 iterations of 12 s + 0.5 s, then 0.25 s back to the healthy plan.
    expected = 40 * 500 + 48.5 * 250 + (240 - 88.75) * 4000 / 12 + 60.5 * 4000 / 12 + (400 - 300.75) * 500
    assert result.tokens == pytest.approx(expected)
    assert result.paused_s == pytest.approx(0.5)
    assert result.counts["migrate"] == 2


def test_oracle_through_a_fail_slow_by_hand():
    trace = Trace(2, 400.0, (TraceEvent("fail_slow", 40.0, 200.0, gpu=1, slowdown=2.0),))
    assert run(trace, "oracle").tokens == pytest.approx(40 * 500 + 200 * 4000 / 12 + 160 * 500)


def test_restart_loses_the_work_since_the_checkpoint_by_hand():
    trace = Trace(2, 2000.0, (TraceEvent("fail_stop", 1000.0, None, gpu=1),))
    result = run(trace, "none")
    # Checkpoint at 900 s: 100 s of work lost. Restart = detect 1 + fixed 10 + 2 GPUs x 0.5 + reading
    # the 1 GB of the one device's state at 1 GB/s = 13 s; then one device alone, T = 16 s.
    assert result.lost_tokens == pytest.approx(100 * 500)
    assert result.tokens == pytest.approx(1000 * 500 - 100 * 500 + (2000 - 1013) * 250)
    assert result.counts["restart"] == 1


def test_in_process_recovery_loses_only_the_iteration_in_flight_by_hand():
    trace = Trace(2, 2000.0, (TraceEvent("fail_stop", 1004.0, None, gpu=1),))
    result = run(trace, "joint_shared")
    # 1004 s = 125 iterations of 8 s + 4 s in flight (lost). Pause: detect 1 + regroup 2 + plan 0.5 +
    # rebuild 0.25 (device 0 already holds every layer); then T = 16 s.
    assert result.lost_tokens == pytest.approx(4 * 500)
    assert result.tokens == pytest.approx(1004 * 500 - 2000 + (2000 - 1007.75) * 250)


def four_gpu_trace(*events: TraceEvent, duration: float = 3000.0) -> Trace:
    return Trace(4, duration, events, gpus_per_node=2)


def test_recycle_reroutes_into_bubbles_without_restarting():
    profile = tiny_profile(layers=8, per_device=1)  # 4 devices, M = 4
    trace = four_gpu_trace(TraceEvent("fail_stop", 500.0, None, gpu=3))
    recycle = run(trace, "recycle", profile)
    assert "restart" not in recycle.counts and recycle.counts["reroute"] == 1
    none = run(trace, "none", profile)
    assert none.counts["restart"] == 1 and none.lost_tokens > 0
    assert recycle.tokens > none.tokens


def test_oobleck_drops_the_whole_node_and_takes_it_back_when_repaired():
    profile = tiny_profile(layers=8, per_device=2)
    trace = four_gpu_trace(TraceEvent("fail_stop", 500.0, 1000.0, gpu=3))
    cluster = Cluster(trace, profile, COSTS)
    policy = make_policy("oobleck")
    result = replay(cluster, policy)
    assert result.counts["reconfigure"] == 2  # out at 500 s, back at 1500 s
    state = trace.state_at(600.0)
    assert cluster.iteration_ms(policy.healthy, state, policy.view) == float("inf")


def test_greyhound_escalates_from_resplit_and_checkpoint_restart_restarts():
    profile = tiny_profile(layers=8, per_device=4)
    trace = four_gpu_trace(TraceEvent("fail_slow", 300.0, 2000.0, gpu=1, slowdown=2.0))
    greyhound = run(trace, "greyhound", profile)
    assert greyhound.counts.get("resplit", 0) >= 1
    restart = run(trace, "checkpoint_restart", profile)
    assert restart.counts["restart"] == 1  # alarm at 1.25 x, then a restart without GPU 1
    assert run(trace, "none", profile).tokens < greyhound.tokens


def test_resihp_rules_fill_a_dead_position_from_a_spare():
    profile = tiny_profile(layers=8, per_device=2)
    trace = four_gpu_trace(TraceEvent("fail_stop", 500.0, 500.0, gpu=0), TraceEvent("fail_slow", 1500.0, 1000.0, gpu=2, slowdown=2.0))
    result = run(trace, "resihp_rules", profile)
    assert result.counts["recover"] == 1 and "restart" not in result.counts
    assert result.counts.get("migrate", 0) >= 1


@pytest.mark.parametrize("scenario", ["fail-slow", "fail-stop", "mixed"])
def test_the_oracle_bounds_every_policy(scenario):
    trace = generate(scenario, TraceConfig(gpus=16, hours=2.0, fail_slow_per_hour=4, comm_slow_per_hour=2), seed=3)
    profile = build_profile("llama2-7b", WorkloadSpec(seq_len=8192))
    results = run_trace(trace, profile)
    oracle = results["oracle"].tokens
    for name in POLICY_NAMES:
        assert results[name].tokens <= oracle * (1 + 1e-9), name
        assert results[name].tokens > 0, name
    assert results["joint_per_replica"].tokens >= results["none"].tokens


def test_traces_are_seeded_and_follow_the_scenario():
    config = TraceConfig(gpus=64, hours=8.0)
    a, b = generate("mixed", config, seed=1), generate("mixed", config, seed=1)
    assert a == b and a != generate("mixed", config, seed=2)
    stops = [e for e in generate("fail-stop", config).events]
    assert [e.start_s for e in stops] == [1800.0 * k for k in range(1, 16)]  # one every 30 minutes
    assert all(e.kind == "fail_stop" and e.duration_s == 3600.0 for e in stops)
    slow = generate("fail-slow", config, seed=0).events
    assert slow and all(e.kind == "fail_slow" and e.slowdown in (1.2, 1.5, 2.0) and 60 <= e.duration_s <= 36000 for e in slow)
