"""The survivors' plan after a fail-stop: it may leave survivors idle (hot spares), only where that is faster."""

from __future__ import annotations

from resihp_lightning.plan import Device, Layer, Problem
from resihp_lightning.failstop.survivor_plan import survivor_plan
from resihp_lightning.telemetry import LayerCost


def test_seven_survivors_whose_memory_needs_two_stages_run_2x3_with_a_spare_not_a_7_stage_pipeline():
    # 8 layers of 100 MB; a device holds at most 5 of them, so every plan has P >= 2.
    profile = [LayerCost(i, 2.0, 100.0, 0.0) for i in range(8)]
    members = [0, 1, 2, 4, 5, 6, 7]  # rank 3 died
    plan = survivor_plan(profile, members, micro_batches=12, per_replica_bounds=True, solver="exact", memory_mb=500.0)
    assert (plan.pipeline_degree, plan.data_degree) == (2, 3), plan
    assert set(plan.device_ids) < set(members) and len(plan.device_ids) == 6
    # What the idle device buys: the only plan on all seven is the 7-stage pipeline, and it is slower.
    layers = tuple(Layer(2.0, 100.0, 0.0) for _ in range(8))
    everyone = Problem(layers, tuple(Device(d, 1.0, 500.0) for d in members), 12, shared_partition=False)
    from resihp_lightning.solver import solve

    seven = solve(everyone)
    assert seven.pipeline_degree == 7 and seven.iteration_ms > plan.iteration_ms * 1.3


def test_a_tie_keeps_every_survivor_working():
    # Three survivors, M = 4: 1 x 3 (2, 1, 1 micro-batches) is as fast as 1 x 2 (2, 2); the plan uses all three.
    profile = [LayerCost(i, 1.0, 1.0, 0.0) for i in range(8)]
    plan = survivor_plan(profile, [0, 2, 3], micro_batches=4, per_replica_bounds=True, solver="exact")
    assert sorted(plan.device_ids) == [0, 2, 3], plan


def test_a_survivor_with_less_memory_gets_a_plan_that_fits_it():
    """Per-device budgets (what the recovery gathers from every survivor): device 1 can hold two layers'
    state only, so no plan gives it more; with equal budgets the plan is free to."""
    from resihp_lightning.plan import Device, Layer, Problem, evaluate

    profile = [LayerCost(i, 10.0, 100.0, 1.0) for i in range(8)]
    members = [0, 1, 3]
    budgets = {0: 1e6, 1: 230.0, 3: 1e6}
    plan = survivor_plan(profile, members, micro_batches=6, per_replica_bounds=True, solver="exact", memory_mb=budgets)
    problem = Problem(tuple(Layer(10.0, 100.0, 1.0) for _ in range(8)), tuple(Device(d, 1.0, budgets[d]) for d in members), 6)
    assert evaluate(problem, plan).fits_memory, plan
    held_by_1 = [r.bounds[j + 1] - r.bounds[j] for r in plan.replicas for j, d in enumerate(r.devices) if d == 1]
    assert all(n <= 2 for n in held_by_1), plan
    unconstrained = survivor_plan(profile, members, micro_batches=6, per_replica_bounds=True, solver="exact")
    assert unconstrained.iteration_ms < plan.iteration_ms  # the budget costs time: it did bind


def test_survivors_keep_two_replicas_where_one_fits_and_fall_back_with_a_warning(recwarn):
    # Three survivors, 8 equal layers: without the constraint the best plan could pipeline (3x1); with
    # min_data_degree=2 every layer stays on two devices.
    profile = [LayerCost(i, 10.0, 100.0, 0.0) for i in range(8)]
    plan = survivor_plan(profile, [0, 1, 2], micro_batches=6, per_replica_bounds=True, solver="exact", min_data_degree=2)
    assert plan.data_degree >= 2, plan
    # Memory for 4 layers per device: two replicas would need 8 layers on a device; the survivors pipeline.
    tight = survivor_plan(profile, [0, 1, 2], micro_batches=6, per_replica_bounds=True, solver="exact",
                          memory_mb=450.0, min_data_degree=2)
    assert tight.data_degree == 1 and tight.pipeline_degree >= 2, tight
    assert any("no plan with 2 replicas fits the 3 survivors" in str(w.message) for w in recwarn.list)


def test_the_survivors_are_planned_with_the_known_slow_device_and_link():
    """``conditions`` (what the controller knew before the failure): the slow device's replica runs fewer
    micro-batches than the others, a device with a slow link is left idle rather than joining the
    all-reduce, and the measured all-reduce is priced. Without them every survivor gets an even share."""
    from resihp_lightning.contract import DeviceConditions
    from resihp_lightning.plan import evaluate

    profile = [LayerCost(i, 10.0, 1.0, 0.0) for i in range(8)]
    members = [0, 1, 2, 4]

    def share_of(plan, device):
        return sum(r.micro_batches for r in plan.replicas if device in r.devices)

    healthy = survivor_plan(profile, members, micro_batches=12, per_replica_bounds=True, solver="exact")
    assert healthy.data_degree == 4 and {share_of(healthy, d) for d in members} == {3}, healthy

    slow = DeviceConditions(speeds={1: 0.5})
    plan = survivor_plan(profile, members, micro_batches=12, per_replica_bounds=True, solver="exact", conditions=slow)
    assert share_of(plan, 1) < min(share_of(plan, d) for d in plan.device_ids if d != 1), plan

    link = DeviceConditions(link_speeds={2: 0.01}, p2p_ms=1.0, allreduce_ms=5.0)
    plan = survivor_plan(profile, members, micro_batches=12, per_replica_bounds=True, solver="exact", conditions=link)
    assert 2 not in plan.device_ids, plan
    problem = Problem(tuple(Layer(10.0, 1.0, 0.0) for _ in range(8)),
                      tuple(Device(d, 1.0, link_speed=0.01 if d == 2 else 1.0) for d in members), 12,
                      p2p_ms=1.0, allreduce_ms=5.0, shared_partition=False, allow_exclude=True)
    assert abs(evaluate(problem, plan).iteration_ms - plan.iteration_ms) < 1e-6  # priced on that problem
    assert evaluate(problem, healthy).iteration_ms > plan.iteration_ms * 1.5  # the healthy plan pays the slow link
