"""Slow links: the probe's partner schedule, the link core's estimates and flags, a real gloo probe
with one rank's sends slowed (named, the others left alone), and the measured costs in the planner's
problem."""

from __future__ import annotations

import itertools

import pytest

from resihp_lightning.callbacks.failslow.link_core import LinkCore
from resihp_lightning.callbacks.replan.replan_policy import ControllerConfig, MeasuredLinks, build_problem
from resihp_lightning.runtime.link_probe import round_robin
from resihp_lightning.telemetry import LayerCost, LinkSample


@pytest.mark.parametrize("ranks", range(2, 10))
def test_round_robin_meets_every_pair_once_and_nobody_twice_a_round(ranks):
    rounds = ranks - 1 + ranks % 2
    met = []
    for r in range(rounds):
        pairs = round_robin(ranks, r)
        busy = [x for pair in pairs for x in pair]
        assert len(busy) == len(set(busy)), (ranks, r, pairs)
        assert len(pairs) == ranks // 2
        met.extend(pairs)
    assert sorted(met) == sorted(itertools.combinations(range(ranks), 2))
    assert round_robin(ranks, rounds) == round_robin(ranks, 0)  # the schedule repeats


def _sample(step, ranks, slow, healthy_ms=2.0, slow_ms=10.0, first_round=0, rounds=3, allreduce_ms=5.0):
    """A probe as ``link_probe.measure`` would report it when the devices in ``slow`` add delay to their sends."""
    trips = {d: [] for d in range(ranks)}
    partners = {d: [] for d in range(ranks)}
    for r in range(min(rounds, ranks - 1 + ranks % 2)):
        for a, b in round_robin(ranks, first_round + r):
            ms = healthy_ms + (slow_ms - healthy_ms) * ((a in slow) + (b in slow))
            for x, y in ((a, b), (b, a)):
                trips[x].append(ms)
                partners[x].append(y)
    return LinkSample(step, 4096, trips, partners, allreduce_ms, 1 << 20)


def test_one_slow_link_is_named_after_patience_and_cleared_when_it_heals():
    core = LinkCore(slow_threshold=0.7, recovery_threshold=0.9, patience=2, window=3)
    assert core.update(_sample(10, 4, slow=set())) == []
    assert core.p2p_ms == pytest.approx(2.0) and core.allreduce_ms == pytest.approx(5.0)
    assert core.update(_sample(20, 4, slow={2}, first_round=3, allreduce_ms=30.0)) == []  # one probe: not yet
    assert core.undecided  # the detector probes again at the next step to confirm
    events = core.update(_sample(30, 4, slow={2}, first_round=6, allreduce_ms=30.0))
    assert [(e["event"], e["rank"]) for e in events] == [("slow_link_detected", 2)]
    assert core.flagged == [2] and not core.undecided
    assert core.speeds[2] == pytest.approx(0.2, abs=0.01)  # 2 ms healthy vs 10 ms round trip
    assert core.p2p_ms == pytest.approx(2.0)  # the healthy devices' round trips
    assert core.allreduce_ms == pytest.approx(5.0)  # measured while no link was flagged
    version = core.version
    for step in (40, 50, 60):
        events = core.update(_sample(step, 4, slow=set()))
    assert core.flagged == [] and core.version > version
    assert any(e["event"] == "slow_link_recovered" and e["rank"] == 2 for e in events)


def test_two_ranks_measure_the_link_but_cannot_name_an_end():
    core = LinkCore(patience=1, window=1)
    assert core.update(_sample(0, 2, slow={1})) == []
    assert core.estimates == {0: 1.0, 1: 1.0}
    assert core.p2p_ms == pytest.approx(10.0)


def test_link_core_state_round_trips_as_plain_data():
    core = LinkCore(patience=1, window=2)
    core.update(_sample(0, 4, slow={1}))
    clone = LinkCore(patience=1, window=2)
    clone.load_state_dict(core.state_dict())
    assert clone.state_dict() == core.state_dict() and clone.flagged == [1]
    assert clone.update(_sample(1, 4, slow={1})) == core.update(_sample(1, 4, slow={1}))


def test_measured_costs_and_link_speeds_reach_the_problem_unless_configured():
    profile = [LayerCost(i, 1.0, 10.0, 1.0) for i in range(4)]
    links = MeasuredLinks({2: 0.26}, p2p_ms=1.5, allreduce_ms=7.0)
    measured = build_problem(profile, {}, range(4), 4, ControllerConfig(), links=links)
    assert (measured.p2p_ms, measured.allreduce_ms) == (1.5, 7.0)
    assert [d.link_speed for d in measured.devices] == [1.0, 1.0, 0.25, 1.0]  # quantised like speeds
    very_slow = build_problem(profile, {}, range(4), 4, ControllerConfig(), links=MeasuredLinks({1: 0.0083}))
    assert very_slow.devices[1].link_speed == 0.0083  # below the quantum: two significant digits, not clamped
    fixed = build_problem(profile, {}, range(4), 4, ControllerConfig(p2p_ms=0.5, allreduce_ms=0.0), links=links)
    assert (fixed.p2p_ms, fixed.allreduce_ms) == (0.5, 0.0)
    before = build_problem(profile, {}, range(4), 4, ControllerConfig())
    assert (before.p2p_ms, before.allreduce_ms) == (0.0, 0.0)


def _probe_rank(rank, world_size, slow_rank, delay_ms, probes):
    import torch.distributed as dist

    from resihp_lightning.runtime.transport_delays import slow_links
    from resihp_lightning.runtime import link_probe

    dist.init_process_group("gloo")
    if rank == slow_rank:
        slow_links(lambda: delay_ms / 1000.0)
    # A 5 ms noise floor: on 2 shared cores a healthy round trip can spike by a few ms (the delay is 40).
    core = LinkCore(patience=2, window=3, min_extra_ms=5.0)
    events = []
    for p in range(probes):
        sample = link_probe.measure(rank + 100, 64 * 1024 if rank == 0 else 0, 1 << 20, p, first_round=3 * p)
        events.extend(core.update(sample))
    dist.barrier()
    return {"events": events, "estimates": core.estimates, "p2p_ms": core.p2p_ms, "allreduce_ms": core.allreduce_ms,
            "probe_bytes": sample.probe_bytes}


@pytest.mark.timeout(120)
def test_a_real_probe_names_the_rank_whose_sends_are_slow(distributed):
    results = distributed(_probe_rank, 4, timeout=100, slow_rank=2, delay_ms=40.0, probes=2)
    for result in results:  # every rank folds the same samples, so every rank decides the same
        assert [(e["event"], e["rank"]) for e in result["events"]] == [("slow_link_detected", 102)]
        assert result["estimates"][102] < 0.5
        assert all(result["estimates"][d] > 0.7 for d in (100, 101, 103)), result["estimates"]
        assert result["probe_bytes"] == 64 * 1024  # the largest stage boundary's activation
        assert result["p2p_ms"] < 40.0  # the healthy devices' round trips carry no delay
        assert result["allreduce_ms"] is None  # both probes saw the slow link: no healthy all-reduce yet
    assert results[0]["events"] == results[3]["events"]


def test_memory_budgets_reach_the_problem_per_device_or_as_configured():
    profile = [LayerCost(i, 1.0, 10.0, 1.0) for i in range(4)]
    auto = build_problem(profile, {}, iter(range(3)), 4, ControllerConfig(), memory_mb={0: 500.0, 1: 80.0})
    assert [d.memory_mb for d in auto.devices] == [500.0, 80.0, float("inf")]  # device 2 reported nothing
    fixed = build_problem(profile, {}, range(3), 4, ControllerConfig(memory_mb=64), memory_mb={0: 500.0})
    assert [d.memory_mb for d in fixed.devices] == [64.0] * 3
    unlimited = build_problem(profile, {}, range(3), 4, ControllerConfig(memory_mb=None), memory_mb={0: 500.0})
    assert all(d.memory_mb == float("inf") for d in unlimited.devices)
    with pytest.raises(Exception, match=r"controller.memory_mb.*'auto', null or a number > 0"):
        ControllerConfig(memory_mb="lots")


def test_the_cpu_budget_is_a_share_of_host_memory():
    import torch

    from resihp_lightning.runtime.device_memory import CPU_USABLE_FRACTION, memory_budget_mb

    total_kb = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal:")).split()[1])
    assert memory_budget_mb(torch.device("cpu"), 4) == pytest.approx(total_kb / 1024 / 4 * CPU_USABLE_FRACTION)
