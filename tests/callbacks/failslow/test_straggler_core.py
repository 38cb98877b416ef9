"""Fail-slow detection on seeded synthetic traces (variable-length packed data, pipeline stages)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from resihp_lightning.callbacks.failslow.straggler_core import StragglerConfig, StragglerCore, run_on_trace
from resihp_lightning.errors import ConfigError
from resihp_lightning.telemetry import StepStats

from resihp_lightning.testing.synthetic import SyntheticFault, TraceSpec, generate_trace

CFG = StragglerConfig()  # warmup 2, fit 10, patience 3
HEAVY = dict(length_log_sigma=2.0, beta=3 * 0.01 / 4096)  # long tail, attention-dominated


def _detections(events, rank=None):
    return [e for e in events if e["event"] == "fail_slow_detected" and (rank is None or e["rank"] == rank)]


@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_slowed_rank_is_found_with_its_speed_within_patience(factor, seed):
    rank, start = 6, 20 + seed
    spec = TraceSpec(steps=32, seed=seed, faults=(SyntheticFault(rank, factor, start),), **HEAVY)
    core, events = run_on_trace(generate_trace(spec), CFG)
    found = _detections(events)
    assert [e["rank"] for e in found] == [rank]
    assert found[0]["step"] - start <= CFG.patience - 1 + 1  # flagged on the patience-th slow step (+1 slack)
    assert found[0]["speed"] == pytest.approx(1 / factor, rel=0.10)
    assert core.speeds[rank] == pytest.approx(1 / factor, rel=0.10)
    assert all(speed == 1.0 for r, speed in core.speeds.items() if r != rank)


@pytest.mark.parametrize("seed", range(6))
def test_heavy_sequence_length_variability_without_fault_raises_no_alarm(seed):
    spec = TraceSpec(steps=80, seed=50 + seed, spike_prob=0.02, **HEAVY)
    core, events = run_on_trace(generate_trace(spec), CFG)
    assert events == []
    assert core.flagged == []


def test_healing_is_detected_and_speed_returns_to_one():
    spec = TraceSpec(steps=50, seed=3, faults=(SyntheticFault(9, 2.0, 18, 32),), **HEAVY)
    core, events = run_on_trace(generate_trace(spec), CFG)
    kinds = [(e["event"], e["rank"]) for e in events]
    assert kinds == [("fail_slow_detected", 9), ("fail_slow_recovered", 9)]
    recovered = events[1]
    assert 32 <= recovered["step"] <= 32 + CFG.patience
    assert core.speeds[9] == 1.0


def test_stage_costs_that_differ_a_lot_do_not_confuse_it():
    costs = (3.0, 1.0, 0.6, 0.25)  # embedding-heavy first stage, cheap last stage
    healthy = TraceSpec(steps=60, seed=11, stage_cost=costs, **HEAVY)
    _, events = run_on_trace(generate_trace(healthy), CFG)
    assert events == []
    slow_cheap = replace(healthy, faults=(SyntheticFault(3, 2.0, 25),))  # the cheapest stage slows down
    core, events = run_on_trace(generate_trace(slow_cheap), CFG)
    assert [e["rank"] for e in _detections(events)] == [3]
    assert core.speeds[3] == pytest.approx(0.5, rel=0.1)


def test_without_cohort_own_history_decides():
    spec = TraceSpec(stages=8, replicas=1, micro_batches=8, steps=60, seed=5, **HEAVY)
    _, events = run_on_trace(generate_trace(spec), CFG)
    assert events == []
    core, events = run_on_trace(generate_trace(replace(spec, faults=(SyntheticFault(4, 1.5, 30),))), CFG)
    assert [e["rank"] for e in _detections(events)] == [4]
    assert core.speeds[4] == pytest.approx(1 / 1.5, rel=0.1)


def test_job_wide_slowdown_is_not_a_straggler():
    faults = tuple(SyntheticFault(rank, 1.5, 25) for rank in range(16))
    _, events = run_on_trace(generate_trace(TraceSpec(steps=45, seed=8, faults=faults)), CFG)
    assert events == []


def test_slow_rank_stays_slow_across_a_replan_that_moves_its_layers():
    spec = TraceSpec(steps=60, seed=2, faults=(SyntheticFault(5, 2.0, 20),))
    trace = generate_trace(spec)
    # From step 30 every rank holds different layers (a new plan): models are refitted on the device
    # as it now is, and the slow rank must not look healthy afterwards.
    moved = [
        [s if t < 30 else StepStats(s.step, s.rank, s.replica, s.stage, (s.layers[0], s.layers[1] + 100), s.micro_batches, s.step_ms)
         for s in step]
        for t, step in enumerate(trace)
    ]
    core, events = run_on_trace(moved, CFG)
    assert [e["event"] for e in events if e["rank"] == 5] == ["fail_slow_detected"]
    assert core.speeds[5] == pytest.approx(0.5, rel=0.1)
    assert core.raw_speeds[5] == pytest.approx(0.5, rel=0.15)  # still measured after the refit


def test_nvrx_scores_expose_the_slow_rank():
    spec = TraceSpec(steps=30, seed=4, faults=(SyntheticFault(1, 2.0, 15),))
    core, _ = run_on_trace(generate_trace(spec), CFG)
    summary = core.score_summary()
    assert set(summary) == {f"gpu_{k}_perf/{s}" for k in ("relative", "individual") for s in ("min", "median", "max")}
    assert summary["gpu_relative_perf/min"] == pytest.approx(0.5, rel=0.12)
    assert summary["gpu_relative_perf/max"] == 1.0
    assert summary["gpu_individual_perf/median"] > 0.9


def test_config_is_validated_with_the_option_named():
    with pytest.raises(ConfigError, match="detector.patience"):
        StragglerConfig(patience=0)
    with pytest.raises(ConfigError, match="gpu_relative_perf_threshold"):
        StragglerConfig(gpu_relative_perf_threshold=1.5)
    with pytest.raises(ConfigError, match="recovery_threshold"):
        StragglerConfig(recovery_threshold=0.8, gpu_individual_perf_threshold=0.9)
    with pytest.raises(TypeError):
        StragglerConfig(3)  # keyword-only
    assert StragglerCore().speeds == {}


def test_pooling_steps_finds_a_slowdown_under_heavy_timing_noise():
    """35% timing noise and 5% spikes (an oversubscribed CPU): per-step decisions cannot separate a 2x
    slowdown from noise at the default significance; pooling 6 steps can, without false alarms."""
    noisy = dict(stages=2, replicas=2, micro_batches=8, steps=40, noise=0.35, spike_prob=0.05)
    pooled = StragglerConfig(window=6, significance=2.0, fit_steps=8, gpu_individual_perf_threshold=0.75,
                            gpu_relative_perf_threshold=0.75, recovery_threshold=0.85)
    for seed in (0, 2, 4):
        trace = generate_trace(TraceSpec(seed=seed, faults=(SyntheticFault(1, 2.0, 15),), **noisy))
        _, events = run_on_trace(trace, pooled)
        found = _detections(events)
        assert found and {e["rank"] for e in found} == {1} and found[0]["step"] >= 15
        assert found[0]["speed"] == pytest.approx(0.5, abs=0.2)
        _, per_step = run_on_trace(trace, CFG)
        assert not [e for e in _detections(per_step) if e["step"] < 22]  # too noisy for single steps
    for seed in (1, 3, 5):
        _, events = run_on_trace(generate_trace(TraceSpec(seed=seed, **noisy)), pooled)
        assert events == []


def test_a_flagged_rank_that_slows_further_is_reported_again_with_the_new_speed():
    faults = (SyntheticFault(2, 2.0, 15), SyntheticFault(2, 2.0, 30))  # 0.5 from step 15, 0.25 from 30
    core, events = run_on_trace(generate_trace(TraceSpec(steps=45, seed=6, faults=faults)), CFG)
    found = _detections(events)
    assert [e["rank"] for e in found] == [2, 2]
    assert found[0]["speed"] == pytest.approx(0.5, rel=0.1) and found[0]["step"] <= 18
    assert found[1]["speed"] == pytest.approx(0.25, rel=0.1) and 30 <= found[1]["step"] <= 30 + 2 * CFG.patience
    assert core.speeds[2] == pytest.approx(0.25, rel=0.1)


def test_a_device_slow_before_its_model_is_fitted_is_found_through_its_cohort():
    # From the very start (rank 5), and during the refit that follows a re-plan at step 30 (rank 10).
    faults = (SyntheticFault(5, 2.0, 0), SyntheticFault(10, 2.5, 31))
    trace = generate_trace(TraceSpec(steps=60, seed=12, faults=faults, **HEAVY))
    moved = [
        [s if t < 30 else StepStats(s.step, s.rank, s.replica, s.stage, (s.layers[0], s.layers[1] + 100), s.micro_batches, s.step_ms)
         for s in step]
        for t, step in enumerate(trace)
    ]
    core, events = run_on_trace(moved, CFG)
    first = {}
    for e in _detections(events):
        first.setdefault(e["rank"], e)
    assert sorted(first) == [5, 10]
    assert first[5]["step"] <= CFG.warmup_steps + CFG.fit_steps + CFG.patience
    assert first[5]["speed"] == pytest.approx(0.5, rel=0.1)
    assert first[10]["step"] <= 30 + CFG.warmup_steps + CFG.fit_steps + CFG.patience
    assert core.speeds[10] == pytest.approx(0.4, rel=0.1)
    assert core.speeds[5] == pytest.approx(0.5, rel=0.1)
    assert [e for e in events if e["event"] == "fail_slow_recovered"] == []


# ------------------------------------------------------------- speeds relative to the fleet, healing
def _step_stats(step, rank, layers, times, rng):
    from resihp_lightning.telemetry import MicroBatchStats

    mbs = []
    for scale in times:
        tokens = int(rng.integers(2000, 4096))
        mbs.append(MicroBatchStats((0.01 * tokens + 5.0) * scale * float(rng.lognormal(0.0, 0.03)), tokens, tokens * 300))
    return StepStats(step, rank, rank % 2, rank // 2, layers, tuple(mbs), 1000.0)


def _contended_trace(steps, fault, *, relief=0.75, replan_at=None, seed=0):
    """Four ranks, 2 stages x 2 replicas. While ``fault`` = (rank, factor, start, end) is on, every rank's
    compute runs ``relief`` times as long as while healthy (on shared cores the slowed rank's waits leave
    its cores to the others), and the slowed rank's also ``factor`` times. ``replan_at``: from that step
    on every rank holds other layers (every model is refitted)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rank_slow, factor, start, end = fault
    trace = []
    for t in range(steps):
        active = start <= t < (end if end is not None else steps)
        moved = replan_at is not None and t >= replan_at
        step = []
        for rank in range(4):
            layers = ((0, 4) if rank // 2 == 0 else (4, 8)) if not moved else ((0, 3) if rank // 2 == 0 else (3, 8))
            scale = (relief if active else 1.0) * (factor if active and rank == rank_slow else 1.0)
            step.append(_step_stats(t, rank, layers, [scale] * 4, rng))
        trace.append(step)
    return trace


@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0])
def test_speed_estimate_removes_what_every_rank_sees_at_once(factor):
    """The slowed rank's own raw speed reads 1/(factor * 0.75) (everything got faster when it began
    to wait); relative to the other ranks in the same steps it reads 1/factor."""
    cfg = StragglerConfig(window=6, significance=2.0, gpu_individual_perf_threshold=0.75,
                         gpu_relative_perf_threshold=0.75, recovery_threshold=0.85)
    core, events = run_on_trace(_contended_trace(40, (1, factor, 18, None)), cfg)
    found = _detections(events)
    assert [e["rank"] for e in found] == [1]
    assert found[0]["speed"] == pytest.approx(1 / factor, rel=0.10)
    assert core.speeds[1] == pytest.approx(1 / factor, rel=0.10)
    assert core.raw_speeds[1] == pytest.approx(1 / (factor * 0.75), rel=0.10)


def test_peers_not_the_rank_itself_make_its_cohort_median():
    """With cohorts of two (2 x 2), a 1.5x fault departs by 0.67 from its peer: found, not diluted."""
    cfg = StragglerConfig(window=6, significance=2.0, gpu_individual_perf_threshold=0.75,
                         gpu_relative_perf_threshold=0.75, recovery_threshold=0.85)
    _, events = run_on_trace(_contended_trace(40, (3, 1.5, 18, None), relief=1.0), cfg)
    assert [e["rank"] for e in _detections(events)] == [3]


@pytest.mark.parametrize("replan_at", [None, 20])
def test_a_healed_device_is_reported_recovered_within_the_detection_latency(replan_at):
    """3x on rank 2 from step 10 to 26 (issue 17). With ``replan_at`` every rank refits its model
    during the fault, the others while they run faster than before it; after the healing every rank
    reads about 0.75 of its own model, the healed one included, and only the fleet comparison
    shows that it is as fast as the others again."""
    cfg = StragglerConfig(window=6, significance=2.0, gpu_individual_perf_threshold=0.75,
                         gpu_relative_perf_threshold=0.75, recovery_threshold=0.85)
    trace = _contended_trace(44, (2, 3.0, 10, 26), replan_at=replan_at)
    core, events = run_on_trace(trace, cfg)
    detected = _detections(events, 2)
    recovered = [e for e in events if e["event"] == "fail_slow_recovered"]
    assert detected and [e["rank"] for e in recovered] == [2], events
    latency = detected[0]["step"] - 10
    ready = 26 if replan_at is None else replan_at + cfg.warmup_steps + cfg.fit_steps  # first step with a model
    assert recovered[0]["step"] - max(26, ready) <= latency, (events, latency)
    assert recovered[0]["speed"] >= 0.95
    assert core.speeds[2] == 1.0 and core.flagged == []
    assert all(e["event"] != "fail_slow_detected" or e["step"] < 26 for e in events), events


def test_the_reported_speed_is_refined_over_the_slow_episode():
    """Per-step speeds that jump between two levels (seen on shared CPUs): the first report comes from
    the few steps of the flagging streak; the episode's median then replaces it, and single noisy
    windows do not make it jump."""
    from resihp_lightning.callbacks.failslow.straggler_core import RankSummary

    cfg = StragglerConfig(window=6, significance=2.0, gpu_individual_perf_threshold=0.75,
                         gpu_relative_perf_threshold=0.75, recovery_threshold=0.85)
    core = StragglerCore(cfg)
    levels = [0.45, 0.25, 0.45, 0.45, 0.25, 0.25]  # median 0.35 over any whole number of cycles
    reported = []
    for step in range(60):
        slow = levels[step % len(levels)] if step >= 10 else 1.0
        summaries = [RankSummary(step, r, r % 2, r // 2, (0, 4) if r < 2 else (4, 8), slow if r == 1 else 1.0, 4, 1,
                                 0.03, 100.0, 1000.0) for r in range(4)]
        reported += [(e["step"], e["speed"]) for e in core.update(summaries) if e["event"] == "fail_slow_detected"]
    assert reported and reported[-1][1] == pytest.approx(0.35, rel=0.10), reported
    assert len(reported) <= 3, reported


def test_a_tensor_parallel_degree_change_refits_the_workload_model():
    """The same layers at degree 1 cost about twice their time at degree 2: a new model, not a slowdown."""
    from resihp_lightning.callbacks.failslow.straggler_core import LocalTracker
    from resihp_lightning.telemetry import MicroBatchStats, StepStats

    tracker = LocalTracker(warmup_steps=1, fit_steps=2)

    def step(at: int, degree: int, ms: float) -> StepStats:
        mbs = tuple(MicroBatchStats(ms * (1 + 0.1 * i), 100 * (1 + i), 1000 * (1 + i)) for i in range(4))
        return StepStats(at, 0, 0, 0, (0, 4), mbs, tensor_degree=degree)

    for at in range(4):
        summary = tracker.summarize(step(at, 2, 10.0))
    assert summary.ratio == pytest.approx(1.0, rel=0.05)
    after = tracker.summarize(step(4, 1, 20.0))
    assert after.ratio is None and after.fit_id == 1  # warming up again: no verdict on a degree change
    for at in range(5, 8):
        after = tracker.summarize(step(at, 1, 20.0))
    assert after.fit_id == 2 and after.ratio == pytest.approx(1.0, rel=0.05)
