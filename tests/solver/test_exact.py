"""The exact planner and solve() against a brute-force enumeration, plus edge cases."""

from __future__ import annotations

import importlib
import math
import random
import time
from dataclasses import replace

import pytest
from resihp_lightning.testing.brute_oracle import count_candidates, link_problem, price, random_problem, solve_brute

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import InfeasibleError, ProblemError
from resihp_lightning.plan import Device, Layer, Plan, Problem, Replica, evaluate, validate
from resihp_lightning.solver import solve
from resihp_lightning.solver.exact import exact_search, solve_exact
from resihp_lightning.solver.exact_model import Best, Model, build_plan
from resihp_lightning.solver.heuristic import heuristic_search

REL = 1e-9


def _optimum(solver, problem: Problem) -> float | None:
    try:
        return solver(problem).iteration_ms
    except InfeasibleError:
        return None


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= REL * max(1.0, abs(b))


SEEDS = range(180)


def test_random_problems_cover_every_option():
    problems = [random_problem(s) for s in SEEDS]
    assert sum(p.shared_partition for p in problems) > 40
    assert sum(not p.shared_partition for p in problems) > 40
    assert sum(p.allow_exclude for p in problems) > 30
    assert sum(p.min_layers_per_stage > 1 for p in problems) > 20
    assert sum(p.pipeline_degrees is not None for p in problems) > 20
    assert sum(any(d.memory_mb < 1e6 for d in p.devices) for p in problems) > 40


def test_exact_agrees_with_brute_force_on_random_problems():
    mismatches, infeasible, proved = [], 0, 0
    for seed in SEEDS:
        problem = random_problem(seed)
        assert count_candidates(problem) < 200_000
        want = _optimum(solve_brute, problem)
        try:
            plan = solve_exact(problem)
        except InfeasibleError:
            got = None
        else:
            got = plan.iteration_ms
            validate(problem, plan)  # legal, memory included
            assert plan.status == "optimal" and plan.solver == "exact"
            assert got == evaluate(problem, plan).iteration_ms
            proved += 1
        infeasible += want is None
        if not _close(got, want):
            mismatches.append((seed, want, got))
    assert not mismatches
    assert 5 <= infeasible <= len(SEEDS) - 100  # memory-tight problems are part of the set
    assert proved >= 100


def test_solve_exact_backend_agrees_with_brute_force():
    config = PlannerConfig(solver="exact")
    for seed in SEEDS:
        problem = random_problem(seed)
        want = _optimum(solve_brute, problem)
        got = _optimum(lambda p: solve(p, config), problem)
        assert _close(got, want), seed


# Required dependencies: a backend that cannot be imported fails these tests (never skips them).
MILP_BACKENDS = ["cpsat", "pulp"]


@pytest.mark.parametrize("backend", MILP_BACKENDS)
def test_milp_backends_agree_with_brute_force(backend):
    # An import failure of the backend fails here (the solvers are required dependencies).
    config = PlannerConfig(solver=backend, time_limit_s=20.0, num_workers=1)
    for seed in range(1, 180, 9):
        problem = random_problem(seed)
        want = _optimum(solve_brute, problem)
        try:
            plan = solve(problem, config)
        except InfeasibleError:
            assert want is None, seed
            continue
        assert plan.solver == backend
        assert plan.status == "optimal"
        assert _close(plan.iteration_ms, want), seed
        assert _close(evaluate(problem, plan).iteration_ms, want), seed


@pytest.mark.parametrize("backend", MILP_BACKENDS)
def test_milp_time_limit_is_never_worse_than_exact(backend):
    rng = random.Random(5)
    speeds = [1.0] * 16
    speeds[3] = speeds[12] = 0.5
    problem = Problem(
        tuple(Layer(rng.uniform(2, 3), 1200.0, 150.0) for _ in range(32)),
        tuple(Device(i, s, 16000.0) for i, s in enumerate(speeds)),
        64,
        p2p_ms=0.2,
        allreduce_ms=6.0,
    )
    reference = solve_exact(problem)
    assert reference.status == "feasible"  # too big for the exact phase: the heuristic answered
    plan = solve(problem, PlannerConfig(solver=backend, time_limit_s=0.5, num_workers=1))
    validate(problem, plan)
    assert plan.solver == backend
    assert plan.iteration_ms <= reference.iteration_ms * (1 + 1e-12)
    assert plan.status in ("optimal", "feasible")


@pytest.mark.parametrize("backend", MILP_BACKENDS)
def test_milp_backends_alone_agree_with_brute_force(backend):
    """The MILP without the exact plan as hint (optimal up to its integer time units, ~1e-7)."""
    module = importlib.import_module(f"resihp_lightning.solver.{'cpsat' if backend == 'cpsat' else 'pulp_backend'}")
    function = getattr(module, f"solve_{backend}")
    config = PlannerConfig(solver=backend, time_limit_s=20.0, num_workers=1)
    for seed in range(2, 180, 9):
        problem = random_problem(seed)
        want = _optimum(solve_brute, problem)
        try:
            plan = function(problem, config, None)
        except InfeasibleError:
            assert want is None, seed
            continue
        validate(problem, plan)
        assert want is not None
        assert plan.status == "optimal", seed
        assert evaluate(problem, plan).iteration_ms == pytest.approx(want, rel=1e-5), seed


def test_heuristic_phase_is_valid_and_never_below_the_optimum():
    for seed in range(0, 180, 4):
        problem = random_problem(seed)
        want = _optimum(solve_brute, problem)
        try:
            plan = solve_exact(problem, budget=0)
        except InfeasibleError:
            continue  # the heuristic may miss a memory-tight layout; the exact phase does not
        validate(problem, plan)
        assert want is not None and plan.iteration_ms >= want * (1 - REL)
        # With no budget only the heuristic ran, unless the shape bounds alone prove its plan.
        assert plan.status == "feasible" or _close(plan.iteration_ms, want)


def test_heuristic_phase_is_close_on_medium_problems():
    gaps = []
    for seed in range(12):
        rng = random.Random(1000 + seed)
        n = rng.choice([4, 6, 8])
        speeds = [1.0] * n
        for i in rng.sample(range(n), rng.randint(1, 2)):
            speeds[i] = rng.choice([0.3, 0.5, 0.8])
        problem = Problem(
            tuple(Layer(rng.uniform(1, 3), 10, 5) for _ in range(rng.randint(4, 8))),
            tuple(Device(i, speeds[i]) for i in range(n)),
            rng.randint(n, 3 * n),
            p2p_ms=0.1,
            allreduce_ms=1.0,
            shared_partition=rng.random() < 0.5,
        )
        best = solve_exact(problem, budget=10**7)
        assert best.status == "optimal"
        quick = solve_exact(problem, budget=0)
        gaps.append(quick.iteration_ms / best.iteration_ms - 1)
    assert min(gaps) >= -REL
    assert max(gaps) < 0.02


# ----------------------------------------------------------------------------------- edge cases
def _problem(speeds, layers=4, m=4, memory=math.inf, **kw) -> Problem:
    return Problem(
        tuple(Layer(1.0 + 0.5 * (l % 2), 100.0, 10.0) for l in range(layers)),
        tuple(Device(i, s, memory) for i, s in enumerate(speeds)),
        m,
        **kw,
    )


def test_one_device():
    problem = _problem([0.5], layers=3, m=5, p2p_ms=1.0, allreduce_ms=9.0)
    plan = solve_exact(problem)
    # One device, one stage, no p2p and no all-reduce: m * compute / speed.
    assert plan.pipeline_degree == 1 and plan.data_degree == 1
    compute = sum(layer.compute_ms for layer in problem.layers)
    assert plan.iteration_ms == pytest.approx(5 * compute / 0.5)
    assert plan.status == "optimal"


def test_pipeline_degree_equal_to_layer_count():
    problem = _problem([1.0, 1.0, 1.0, 1.0], layers=4, m=3, pipeline_degrees=(4,))
    plan = solve_exact(problem)
    assert plan.pipeline_degree == 4
    assert all(r.bounds == (0, 1, 2, 3, 4) for r in plan.replicas)
    assert plan.iteration_ms == pytest.approx(solve_brute(problem).iteration_ms)


def test_all_devices_slow_scales_the_healthy_time():
    healthy = _problem([1.0] * 4, layers=6, m=8, p2p_ms=0.0, allreduce_ms=0.0)
    slow = _problem([0.25] * 4, layers=6, m=8, p2p_ms=0.0, allreduce_ms=0.0)
    # Without communication every time scales by 1 / speed.
    assert solve_exact(slow).iteration_ms == pytest.approx(4 * solve_exact(healthy).iteration_ms)


def test_very_slow_device_is_excluded_when_allowed():
    speeds = [1.0, 1.0, 1.0, 0.05]
    kept = solve_exact(_problem(speeds, layers=4, m=6, allreduce_ms=0.5))
    dropped = solve_exact(_problem(speeds, layers=4, m=6, allreduce_ms=0.5, allow_exclude=True))
    assert 3 not in dropped.device_ids
    assert dropped.iteration_ms < kept.iteration_ms
    brute = solve_brute(_problem(speeds, layers=4, m=6, allreduce_ms=0.5, allow_exclude=True))
    assert dropped.iteration_ms == pytest.approx(brute.iteration_ms)


def test_memory_infeasible_raises_one_line_naming_memory():
    problem = _problem([1.0, 1.0], layers=4, m=4, memory=150.0)  # every stage needs >= 110 MB + layers
    with pytest.raises(InfeasibleError) as info:
        solve_exact(problem)
    message = str(info.value)
    assert "memory" in message and "\n" not in message
    with pytest.raises(InfeasibleError):
        solve_brute(problem)
    with pytest.raises(InfeasibleError):
        solve(problem, PlannerConfig(solver="exact"))


def test_memory_limits_micro_batches_in_flight():
    # With 4 stages, stage 0 holds min(4, m) micro-batches' activations: 55 MB fits 2, not 3.
    problem = Problem(
        tuple(Layer(1.0, 10.0, 20.0) for _ in range(4)),
        tuple(Device(i, 1.0, 55.0) for i in range(4)),
        2,
        pipeline_degrees=(4,),
    )
    plan = solve_exact(problem)
    validate(problem, plan)
    assert plan.replicas[0].micro_batches == 2  # 10 + 2 * 20 = 50 <= 55
    tight = Problem(problem.layers, problem.devices, 3, pipeline_degrees=(4,))
    with pytest.raises(InfeasibleError):
        solve_exact(tight)  # 3 in flight on stage 0 needs 70 MB


def test_brute_force_refuses_big_problems():
    with pytest.raises(ProblemError, match="brute force"):
        solve_brute(_problem([1.0] * 8, layers=16, m=16))


def test_config_options_are_applied():
    problem = _problem([1.0, 1.0, 0.5, 1.0], layers=6, m=8)
    plan = solve(problem, PlannerConfig(solver="exact", pipeline_degrees=(2,), shared_partition=False))
    assert plan.pipeline_degree == 2
    plan1 = solve(problem, PlannerConfig(solver="exact", pipeline_degrees=(1,)))
    assert plan1.pipeline_degree == 1 and plan1.status == "optimal"


def test_large_problem_warm_start_is_fast():
    rng = random.Random(3)
    speeds = [1.0] * 256
    for i, s in zip(rng.sample(range(256), 4), (0.5, 0.5, 0.7, 0.7)):
        speeds[i] = s
    problem = Problem(
        tuple(Layer(rng.uniform(2, 3), 2000.0, 50.0) for _ in range(128)),
        tuple(Device(i, speeds[i], 80000.0) for i in range(256)),
        1024,
        p2p_ms=0.1,
        allreduce_ms=5.0,
    )
    start = time.perf_counter()
    plan = solve_exact(problem)
    elapsed = time.perf_counter() - start
    validate(problem, plan)
    assert elapsed < 3.0
    uniform = Plan.uniform([d.id for d in problem.devices], 128, 4, 1024)
    assert plan.iteration_ms < evaluate(problem, uniform).iteration_ms


# ---------------------------------------------------------------------------------- slow links
LINK_SEEDS = range(150)


def _healthy_links(problem: Problem) -> Problem:
    return replace(problem, devices=tuple(replace(d, link_speed=1.0) for d in problem.devices))


def test_link_problems_cover_every_option_and_links_matter():
    problems = [link_problem(s) for s in LINK_SEEDS]
    assert sum(p.shared_partition for p in problems) > 40 and sum(not p.shared_partition for p in problems) > 40
    assert sum(p.allow_exclude for p in problems) > 40
    assert sum(any(d.link_speed < 1 for d in p.devices) for p in problems) > 90
    assert sum(any(d.link_speed > 1 for d in p.devices) for p in problems) > 20
    # The optimum moves with the links in a good share of them (else the tests below prove little).
    moved = sum(
        not _close(_optimum(solve_brute, p), _optimum(solve_brute, _healthy_links(p))) for p in problems[::2]
    )
    assert moved >= 20


def test_evaluate_prices_links_as_the_transfer_by_transfer_oracle():
    rng = random.Random(11)
    checked = 0
    for seed in LINK_SEEDS:
        problem = link_problem(seed)
        ids = [d.id for d in problem.devices]
        for _ in range(5):
            p, d = rng.choice(problem.candidate_shapes())
            chosen = rng.sample(ids, p * d) if problem.allow_exclude else rng.sample(ids, len(ids))
            cuts = sorted(rng.sample(range(1, problem.num_layers), p - 1)) if p > 1 else []
            bounds = (0, *cuts, problem.num_layers)
            if any(bounds[j + 1] - bounds[j] < problem.min_layers_per_stage for j in range(p)):
                continue
            counts = [1] * d
            for _ in range(problem.micro_batches - d):
                counts[rng.randrange(d)] += 1
            plan = Plan(tuple(Replica(tuple(chosen[r * p:(r + 1) * p]), bounds, counts[r]) for r in range(d)))
            assert evaluate(problem, plan).iteration_ms == pytest.approx(price(problem, plan), rel=1e-12)
            checked += 1
    assert checked > 300


def test_exact_agrees_with_brute_force_on_slow_link_problems():
    config = PlannerConfig(solver="exact")
    mismatches, proved = [], 0
    for seed in LINK_SEEDS:
        problem = link_problem(seed)
        want = _optimum(solve_brute, problem)
        try:
            plan = solve_exact(problem)
        except InfeasibleError:
            got = None
        else:
            got = plan.iteration_ms
            validate(problem, plan)
            assert plan.status == "optimal" and plan.gap == 0.0
            assert got == evaluate(problem, plan).iteration_ms
            proved += 1
        if not _close(got, want) or not _close(_optimum(lambda p: solve(p, config), problem), want):
            mismatches.append((seed, want, got))
    assert not mismatches
    assert proved >= 100


def test_layout_enumeration_alone_agrees_with_brute_force_on_slow_links():
    """exact_search without the decomposition (which usually proves first): slow links in every position."""
    for seed in range(0, 150, 2):
        problem = link_problem(seed)
        want = _optimum(solve_brute, problem)
        model = Model(problem)
        best = Best()
        if seed % 4:
            heuristic_search(model, best)
        exact_search(model, 10**7, best)
        got = None if math.isinf(best.value) else best.value
        assert _close(got, want), (seed, want, got)
        if got is not None:
            plan = build_plan(model, best.grid, best.bounds, best.counts)
            assert evaluate(problem, plan).iteration_ms == pytest.approx(got, rel=REL)


@pytest.mark.parametrize("backend", MILP_BACKENDS)
def test_milp_backends_agree_with_brute_force_on_slow_links(backend):
    """The MILP alone (no hint) and with the exact plan as hint, on problems with slow links."""
    module = importlib.import_module(f"resihp_lightning.solver.{'cpsat' if backend == 'cpsat' else 'pulp_backend'}")
    function = getattr(module, f"solve_{backend}")
    config = PlannerConfig(solver=backend, time_limit_s=20.0, num_workers=1)
    for seed in range(1, 150, 3):
        problem = link_problem(seed)
        want = _optimum(solve_brute, problem)
        hint = None
        if seed % 2 and want is not None:
            hint = solve_exact(problem)
        try:
            plan = function(problem, config, hint)
        except InfeasibleError:
            assert want is None, seed
            continue
        validate(problem, plan)
        assert want is not None and plan.status == "optimal", seed
        assert evaluate(problem, plan).iteration_ms == pytest.approx(want, rel=1e-5), seed


def test_heuristic_phase_is_valid_on_slow_links():
    for seed in range(0, 150, 3):
        problem = link_problem(seed)
        want = _optimum(solve_brute, problem)
        try:
            plan = solve_exact(problem, budget=0, decomposition_budget=0)
        except InfeasibleError:
            continue
        validate(problem, plan)
        assert want is not None and plan.iteration_ms >= want * (1 - REL)
        assert plan.iteration_ms * (1 - plan.gap) <= want * (1 + REL)  # the reported bound is a bound


def _routing_problem(**kw) -> Problem:
    """4 devices, 8 layers of 2 ms, p2p 1 ms (half a layer); device 2's links run at 0.1 (u = 10)."""
    memory = kw.pop("memory_mb", math.inf)
    return Problem(
        tuple(Layer(2.0, 100.0, 10.0) for _ in range(8)),
        tuple(Device(i, 1.0, memory, 0.1 if i == 2 else 1.0) for i in range(4)),
        8,
        p2p_ms=1.0,
        **kw,
    )


@pytest.mark.parametrize("shared", [True, False])
def test_planner_routes_around_a_slow_link(shared):
    # Cheap all-reduce: device 2 keeps working, but as a one-stage replica (no transfers on its link).
    problem = _routing_problem(allreduce_ms=0.2, shared_partition=shared)
    even = Plan.uniform([0, 1, 2, 3], 8, 2, 8)  # device 2 holds stage 0 of replica 1: 4 x 2 + 1 x 10 ms
    assert evaluate(problem, even).iteration_ms == pytest.approx(18 + 8 + 3 * 18 + 2.0)
    for config in (PlannerConfig(solver="exact"), PlannerConfig(num_workers=1)):
        plan = solve(problem, config)
        validate(problem, plan)
        assert plan.status == "optimal"
        holding = [r for r in plan.replicas if 2 in r.devices]
        assert holding and all(r.num_stages == 1 for r in holding)  # never between stages
        assert plan.iteration_ms == pytest.approx(2 * 16.0 + 0.2 * 10)  # 4 x 1 stage, 2 micro-batches; AR x 10
        assert plan.iteration_ms < evaluate(problem, even).iteration_ms
        assert plan.iteration_ms == pytest.approx(solve_brute(problem).iteration_ms)
    # With the same links healthy the planner would pipeline (the slow link is what it avoids).
    assert solve(problem.healthy(), PlannerConfig(solver="exact")).iteration_ms < plan.iteration_ms


def test_planner_idles_a_slow_link_when_memory_forces_pipelines():
    # 8 layers of 100 MB on 500 MB devices: every plan has P >= 2, so device 2 would carry transfers.
    problem = _routing_problem(allreduce_ms=2.0, memory_mb=500.0, allow_exclude=True, shared_partition=False)
    plan = solve(problem, PlannerConfig(solver="exact"))
    assert plan.status == "optimal" and 2 not in plan.device_ids
    kept = solve(replace(problem, allow_exclude=False), PlannerConfig(solver="exact"))
    assert 2 in kept.device_ids and plan.iteration_ms < kept.iteration_ms
    # Made to keep it, the planner puts it last, where only its incoming transfer is slower (9 ms, not 10).
    assert all(r.devices[-1] == 2 for r in kept.replicas if 2 in r.devices)
    assert plan.iteration_ms == pytest.approx(solve_brute(problem).iteration_ms)
    assert kept.iteration_ms == pytest.approx(solve_brute(replace(problem, allow_exclude=False)).iteration_ms)
    cpsat = solve(problem, PlannerConfig(num_workers=1))
    assert cpsat.iteration_ms == pytest.approx(plan.iteration_ms)


@pytest.mark.parametrize("solver", ["exact", "cpsat"])
def test_cutoff_returns_only_faster_plans_and_proves_when_there_is_none(solver):
    """solve(..., cutoff=T) against brute force: above the optimum it returns the optimum; at or below it
    (and on a problem where nothing fits) it raises NoBetterPlan, proven whenever the search was complete."""
    from resihp_lightning.solver import NoBetterPlan

    config = PlannerConfig(solver=solver, time_limit_s=5.0)
    checked = below = 0
    for seed in range(0, 120, 3):
        problem = random_problem(seed)
        if count_candidates(problem) > 20_000:
            continue
        optimum = _optimum(solve_brute, problem)
        if optimum is None:
            with pytest.raises(NoBetterPlan) as caught:
                solve(problem, config, cutoff=1e9)
            assert caught.value.proven
            continue
        plan = solve(problem, config, cutoff=optimum * 1.5 + 1.0)
        assert plan.iteration_ms < optimum * 1.5 + 1.0
        if plan.status == "optimal":
            assert _close(plan.iteration_ms, optimum)
        validate(problem, plan)
        for cutoff in (optimum, optimum * 0.9):
            with pytest.raises(NoBetterPlan) as caught:
                solve(problem, config, cutoff=cutoff)
            assert caught.value.bound_ms <= optimum * (1 + REL)
            below += caught.value.proven
        checked += 1
    assert checked >= 25 and below >= 2 * checked - 4


def test_cutoff_closes_every_shape_at_once_on_a_large_problem():
    """At 256 devices an outside incumbent 1% below the optimum is refused fast, without the MILP."""
    from resihp_lightning.solver import NoBetterPlan

    speeds = [1.0] * 256
    speeds[5] = 0.5
    problem = Problem([Layer(10.0, 700.0, 50.0)] * 96, [Device(i, speeds[i], 24_000.0) for i in range(256)], 1024,
                      p2p_ms=0.05, allreduce_ms=5.0)
    optimum = solve(problem, PlannerConfig(solver="exact"))
    assert optimum.status == "optimal"
    start = time.perf_counter()
    with pytest.raises(NoBetterPlan) as caught:
        solve(problem, PlannerConfig(), cutoff=optimum.iteration_ms * 0.99)
    assert caught.value.proven and time.perf_counter() - start < 2.0


def test_cutoff_left_open_by_the_exact_search_goes_to_the_milp(monkeypatch):
    """When the exact search finds nothing below the cutoff without proving it, CP-SAT (no hint) decides:
    its plan when faster than the cutoff, else NoBetterPlan carrying CP-SAT's proof."""
    import resihp_lightning.solver.exact as exact_module
    from resihp_lightning.solver import NoBetterPlan

    def unproven(problem, **_):
        raise NoBetterPlan("left open", proven=False, bound_ms=0.0)

    monkeypatch.setattr(exact_module, "solve_exact", unproven)
    checked = 0
    for seed in range(0, 60, 3):
        problem = random_problem(seed)
        if count_candidates(problem) > 20_000:
            continue
        optimum = _optimum(solve_brute, problem)
        if optimum is None:
            continue
        plan = solve(problem, PlannerConfig(), cutoff=optimum * 1.2 + 1.0)
        assert plan.status == "optimal" and _close(plan.iteration_ms, optimum) and plan.solver == "cpsat"
        with pytest.raises(NoBetterPlan) as caught:
            solve(problem, PlannerConfig(), cutoff=optimum)
        assert caught.value.proven and caught.value.bound_ms == optimum
        checked += 1
    assert checked >= 10


def test_first_below_the_cutoff_stops_at_a_faster_plan():
    """solve_exact(cutoff=T, first=True): a valid plan faster than T when one exists (not claimed optimal),
    NoBetterPlan when none does."""
    from resihp_lightning.solver import NoBetterPlan

    checked = 0
    for seed in range(0, 90, 3):
        problem = random_problem(seed)
        if count_candidates(problem) > 20_000:
            continue
        optimum = _optimum(solve_brute, problem)
        if optimum is None:
            continue
        plan = solve_exact(problem, cutoff=optimum * 1.3 + 1.0, first=True)
        validate(problem, plan)
        assert optimum * (1 - REL) <= plan.iteration_ms < optimum * 1.3 + 1.0
        assert plan.status in ("optimal", "feasible")
        with pytest.raises(NoBetterPlan):
            solve_exact(problem, cutoff=optimum, first=True)
        checked += 1
    assert checked >= 15
