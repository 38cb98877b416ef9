"""The 1F1B event simulator against the cost formula (the relation documented in simulator.py)."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from resihp_lightning.errors import ConfigError
from resihp_lightning.plan import Device, Layer, Plan, Problem, Replica, evaluate, pipeline_ms
from resihp_lightning.solver.simulator import schedule_1f1b, simulate, simulate_replica


def _times(compute, p2p):
    return [c + (p2p if j < len(compute) - 1 else 0.0) for j, c in enumerate(compute)]


@pytest.mark.parametrize("forward_fraction", [0.0, 0.2, 1 / 3, 0.5, 1.0])
def test_uniform_stages_match_the_formula_exactly(forward_fraction):
    for stages in range(1, 7):
        for m in (1, 2, 3, 5, 9):
            for p2p in (0.0, 0.3):
                t = 2.0
                compute = [t - (p2p if j < stages - 1 else 0.0) for j in range(stages)]
                simulated, busy = simulate_replica(compute, m, p2p, forward_fraction)
                assert simulated == pytest.approx((m + stages - 1) * t, rel=1e-12)
                assert simulated == pytest.approx(pipeline_ms([t] * stages, m), rel=1e-12)
                assert busy == pytest.approx([m * t] * stages)


def test_one_stage_or_one_micro_batch_match_the_formula():
    rng = random.Random(1)
    for _ in range(100):
        compute = [rng.uniform(0.5, 4) for _ in range(rng.randint(1, 6))]
        p2p = rng.choice([0.0, 0.2])
        simulated, _ = simulate_replica(compute, 1, p2p)
        assert simulated == pytest.approx(sum(_times(compute, p2p)), rel=1e-12)
        m = rng.randint(1, 8)
        simulated, _ = simulate_replica(compute[:1], m, p2p)
        assert simulated == pytest.approx(m * compute[0], rel=1e-12)


def test_formula_is_an_upper_bound_and_close_on_random_replicas():
    rng = random.Random(2)
    ratios = []
    for _ in range(600):
        stages = rng.randint(2, 6)
        m = rng.randint(1, 12)
        p2p = rng.choice([0.0, 0.1, 0.5])
        compute = [rng.uniform(1.0, 2.0) for _ in range(stages)]
        t = _times(compute, p2p)
        simulated, _ = simulate_replica(compute, m, p2p, rng.choice([0.25, 1 / 3, 0.5]))
        formula = pipeline_ms(t, m)
        lower = max(formula - (stages - 1) * (max(t) - min(t)), sum(t), m * max(t))
        assert lower - 1e-9 <= simulated <= formula + 1e-9
        ratios.append(simulated / formula)
    assert min(ratios) > 0.8
    assert sum(ratios) / len(ratios) > 0.95  # 0.970 measured


def test_schedule_is_1f1b():
    assert schedule_1f1b(4, 0, 5) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1), ("B", 2), ("B", 3), ("B", 4)]
    assert schedule_1f1b(4, 3, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert schedule_1f1b(4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def _problem(speeds, layers=6, m=6, p2p=0.1, ar=2.0, shared=False):
    return Problem(
        tuple(Layer(1.0 + (l % 3) * 0.5, 10.0, 1.0) for l in range(layers)),
        tuple(Device(i, s) for i, s in enumerate(speeds)),
        m,
        p2p_ms=p2p,
        allreduce_ms=ar,
        shared_partition=shared,
    )


def test_events_respect_dependencies_and_memory_model():
    problem = _problem([1.0, 0.5, 1.0, 1.0], layers=8, m=7)
    plan = Plan((Replica((0, 1), (0, 3, 8), 4), Replica((2, 3), (0, 5, 8), 3)))
    sim = simulate(problem, plan, keep_events=True)
    by_stage = defaultdict(list)
    end = {}
    for e in sim.events:
        by_stage[(e.replica, e.stage)].append(e)
        end[(e.replica, e.stage, e.micro_batch, e.kind)] = e.end_ms
    for (r, j), events in by_stage.items():
        events.sort(key=lambda e: e.start_ms)
        for a, b in zip(events, events[1:]):
            assert a.end_ms <= b.start_ms + 1e-12  # one event at a time per stage
        in_flight = peak = 0
        for e in events:
            if e.kind == "F":
                in_flight += 1
                peak = max(peak, in_flight)
            elif e.kind == "B":
                in_flight -= 1
        m = plan.replicas[r].micro_batches
        assert peak == min(plan.pipeline_degree - j, m)  # the model's memory term
    for e in sim.events:
        if e.kind == "F" and e.stage > 0:
            assert e.start_ms >= end[(e.replica, e.stage - 1, e.micro_batch, "send_act")] - 1e-12
        if e.kind == "recv_grad":
            assert e.start_ms >= end[(e.replica, e.stage + 1, e.micro_batch, "B")] - 1e-12
    formula = evaluate(problem, plan)
    assert sim.makespan_ms == pytest.approx(max(sim.replica_ms) + problem.allreduce_ms)
    assert sim.makespan_ms <= formula.iteration_ms + 1e-9
    for r in range(2):
        assert sum(sim.busy_ms[r]) + sum(sim.idle_ms[r]) == pytest.approx(plan.pipeline_degree * sim.replica_ms[r])


def test_all_reduce_only_with_several_replicas():
    problem = _problem([1.0, 1.0], layers=4, m=4, ar=5.0)
    one = Plan((Replica((0, 1), (0, 2, 4), 4),))
    problem_one = Problem(problem.layers, problem.devices, 4, p2p_ms=0.1, allreduce_ms=5.0, allow_exclude=True)
    assert simulate(problem_one, one).makespan_ms == pytest.approx(simulate(problem_one, one).replica_ms[0])
    two = Plan((Replica((0,), (0, 4), 2), Replica((1,), (0, 4), 2)))
    sim = simulate(problem, two)
    assert sim.makespan_ms == pytest.approx(sim.replica_ms[0] + 5.0)
    assert sim.makespan_ms == pytest.approx(evaluate(problem, two).iteration_ms)  # P = 1: exact


def test_bad_forward_fraction_is_refused():
    problem = _problem([1.0])
    with pytest.raises(ConfigError, match="forward_fraction"):
        simulate(problem, Plan((Replica((0,), (0, 6), 6),)), forward_fraction=1.5)


# ------------------------------------------------------------------------------------ slow links
def _link_times(compute, p2p, u):
    p = len(compute)
    return [c + p2p * ((u[j] if j < p - 1 else 0.0) + ((u[j] - 1.0) if j > 0 else 0.0)) for j, c in enumerate(compute)]


@pytest.mark.parametrize("forward_fraction", [0.0, 1 / 3, 1.0])
def test_slow_links_keep_uniform_stages_exact(forward_fraction):
    rng = random.Random(3)
    for stages in range(1, 7):
        for m in (1, 2, 5, 9):
            u = [rng.choice([1.0, 2.0, 4.0]) for _ in range(stages)]
            extra = _link_times([0.0] * stages, 0.3, u)  # each stage's transfer time
            t = max(extra) + 1.0
            compute = [t - e for e in extra]  # every stage takes t with its transfers
            simulated, busy = simulate_replica(compute, m, 0.3, forward_fraction, link_slowdown=u)
            assert simulated == pytest.approx((m + stages - 1) * t, rel=1e-12)
            assert busy == pytest.approx([m * t] * stages)


def test_formula_bounds_the_simulation_with_slow_links():
    rng = random.Random(4)
    ratios = []
    for _ in range(600):
        stages, m, p2p = rng.randint(2, 6), rng.randint(1, 12), rng.choice([0.1, 0.5])
        u = [rng.choice([1.0, 1.0, 2.0, 5.0]) for _ in range(stages)]
        compute = [rng.uniform(1.0, 2.0) for _ in range(stages)]
        t = _link_times(compute, p2p, u)
        simulated, _ = simulate_replica(compute, m, p2p, rng.choice([0.25, 1 / 3, 0.5]), link_slowdown=u)
        formula = pipeline_ms(t, m)
        lower = max(formula - (stages - 1) * (max(t) - min(t)), sum(t), m * max(t))
        assert lower - 1e-9 <= simulated <= formula + 1e-9
        ratios.append(simulated / formula)
    assert min(ratios) > 0.7  # 0.77 measured: stage times spread more than without slow links
    assert sum(ratios) / len(ratios) > 0.93  # 0.96 measured


def test_simulate_prices_link_speeds_like_evaluate():
    problem = Problem(
        tuple(Layer(1.0 + (l % 3) * 0.5, 10.0, 1.0) for l in range(8)),
        tuple(Device(i, 1.0 if i != 1 else 0.5, link_speed=0.25 if i == 2 else 1.0) for i in range(4)),
        7,
        p2p_ms=0.4,
        allreduce_ms=2.0,
        shared_partition=False,
    )
    plan = Plan((Replica((0, 1), (0, 3, 8), 4), Replica((2, 3), (0, 5, 8), 3)))
    sim = simulate(problem, plan, keep_events=True)
    formula = evaluate(problem, plan)
    # One micro-batch's events of a stage add up to its t[r][j]: device 2 sends at u = 4.
    for r, replica in enumerate(plan.replicas):
        for j in range(2):
            per_mb = sum(e.end_ms - e.start_ms for e in sim.events if (e.replica, e.stage, e.micro_batch) == (r, j, 0))
            assert per_mb == pytest.approx(formula.stage_ms[r][j], rel=1e-12)
    assert sim.makespan_ms == pytest.approx(max(sim.replica_ms) + 2.0 * 4)  # the ring at device 2's link
    assert sim.makespan_ms <= formula.iteration_ms + 1e-9
    # The slow link as the receiver: it pays the extra of its incoming transfers (recv_act, send_grad).
    flipped = Plan((Replica((0, 1), (0, 3, 8), 4), Replica((3, 2), (0, 5, 8), 3)))
    sim = simulate(problem, flipped, keep_events=True)
    kinds = {e.kind for e in sim.events if (e.replica, e.stage) == (1, 1)}
    assert kinds == {"recv_act", "F", "B", "send_grad"}
    end = {(e.replica, e.stage, e.micro_batch, e.kind): e.end_ms for e in sim.events}
    for e in sim.events:
        if e.kind == "recv_grad" and e.replica == 1:
            assert e.start_ms >= end[(1, 1, e.micro_batch, "send_grad")] - 1e-12
    formula = evaluate(problem, flipped)
    # Layers 5-7 (2.0 + 1.0 + 1.5 ms) at speed 1.0, no send, the extra of its incoming transfer.
    assert formula.stage_ms[1][1] == pytest.approx(4.5 + 0.4 * (4 - 1))
