"""The controller's problem over processes under tensor parallelism (:mod:`...replan.tensor_regroup`), and the
detector's device that a re-split formed anew (:meth:`StragglerCore.reseat`)."""

from __future__ import annotations

import pytest

from resihp_lightning.callbacks.failslow.straggler_core import RankSummary, StragglerConfig, StragglerCore
from resihp_lightning.callbacks.replan import tensor_regroup as regroup
from resihp_lightning.callbacks.replan.replan_policy import ControllerConfig, build_problem
from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import ConfigError
from resihp_lightning.plan import Plan, Replica
from resihp_lightning.solver.tensor_search import solve_tensor
from resihp_lightning.telemetry import LayerCost


def test_domains_are_the_starting_groups_named_by_the_ranks_now():
    assert regroup.domains({r: r for r in range(6)}, 2) == ((0, 1), (2, 3), (4, 5))
    # Process 1 was lost: the survivors' ranks shift, their domains do not.
    assert regroup.domains({0: 0, 1: 2, 2: 3, 3: 4, 4: 5}, 2) == ((0,), (1, 2), (3, 4))


def test_a_named_member_carries_its_group_s_slowness_and_a_lone_process_is_its_device():
    groups = {0: (0, 1, 2), 1: (3,), 2: (4, 5)}
    processes = {r: r + 10 for r in range(6)}
    speeds = regroup.process_speeds(groups, processes, {0: 0.4, 1: 0.5, 2: 0.8}, {12: 0.3, 13: 0.2})
    # Group 0's slowness is member 2's; group 1 is one process; group 2 has no named member: its own speed.
    assert speeds == {0: 1.0, 1: 1.0, 2: 0.3, 3: 0.5, 4: 0.8, 5: 0.8}


@pytest.mark.parametrize("degree, share", [(2, 0.8), (4, 0.5), (4, 0.25), (1, None)])
def test_one_gpu_costs_give_back_the_measured_group_time(degree, share):
    profile = [LayerCost(0, 4.0, 1.5, 0.25), LayerCost(1, 10.0, 3.0, 0.5)]
    layers, fraction = regroup.one_gpu_costs(profile, degree, share)
    for measured, one_gpu in zip(profile, layers):
        # The model: a group of k runs a layer of one-GPU compute c in c (1/k + f_k).
        assert one_gpu.compute_ms * (1 / degree + fraction) == pytest.approx(measured.compute_ms)
        assert one_gpu.static_mb == measured.static_mb * degree
    if share is not None:  # own compute c/k is the share rho of the group's time
        assert layers[0].compute_ms / degree == pytest.approx(share * profile[0].compute_ms)
    configured, f = regroup.one_gpu_costs(profile, 4, 0.9, fraction=0.0)
    assert f == 0.0 and configured[1].compute_ms == pytest.approx(40.0)


def test_other_degrees_scale_like_a_ring_all_reduce():
    cost = regroup.tensor_cost((1, 2, 4), 4, 0.3)
    assert cost.fraction(1) == 0.0
    assert cost.fraction(4) == pytest.approx(0.3)
    assert cost.fraction(2) == pytest.approx(0.3 * (1 / 2) / (3 / 4))
    assert regroup.own_share([(30.0, 70.0), (40.0, 60.0), (0.0, 5.0)]) == pytest.approx(0.35)
    assert regroup.own_share([]) is None


def test_plans_move_between_group_indices_and_first_member_ids():
    from resihp_lightning.tensor_plan import TensorGroup, TensorPlan

    plan = Plan((Replica((1,), (0, 4), 3), Replica((0,), (0, 4), 1)))
    tensor_plan = TensorPlan((TensorGroup((2, 3)), TensorGroup((0, 1))), regroup.tensor_plan_of(
        plan, [TensorGroup((0, 1)), TensorGroup((2, 3))]))
    assert [r.devices for r in tensor_plan.plan.replicas] == [(2,), (0,)]
    back, groups = regroup.strategy_plan(tensor_plan)
    assert groups == [[0, 1], [2, 3]] and back.layout_key() == plan.layout_key()
    # A switch that keeps a group moves nothing of its layers; a new group's layers count whole.
    static = [1.0, 2.0, 3.0, 4.0]
    assert regroup.regroup_moved_mb({0: (0, 1), 1: (2, 3)}, groups, back, static) == 0.0
    assert regroup.regroup_moved_mb({0: (0, 1, 2, 3)}, groups, back, static) == 20.0


def _problem(speeds: dict[int, float]):
    profile = [LayerCost(i, 8.0, 1.0, 0.1) for i in range(4)]  # measured on the job's group of four
    layers, _ = regroup.one_gpu_costs(profile, 4, None, fraction=0.0)
    config = ControllerConfig(allreduce_ms=0.01, p2p_ms=0.0, memory_mb=None, tensor_comm_fraction=0.0)
    base = build_problem(layers, speeds, range(4), 4, config, PlannerConfig(solver="exact", pipeline_degrees=(1,)),
                         per_replica_bounds=True)
    return regroup.tensor_problem(base, regroup.domains({r: r for r in range(4)}, 4), regroup.tensor_cost((1, 2, 4), 4, 0.0))


def test_the_planner_drops_a_slow_member_and_takes_it_back_when_healthy():
    """The multi-process test's choices, solved here: speeds (1, 1, 1/3, 1) -> two replicas of two; healthy
    -> the one group of four (a data-parallel all-reduce, however small, is the only difference)."""
    config = PlannerConfig(solver="exact", pipeline_degrees=(1,))
    whole = {0: (0, 1, 2, 3)}
    slow = _problem({2: 1 / 3})
    dropped = solve_tensor(slow, config)
    assert dropped.status == "optimal"
    assert sorted(g.degree for g in dropped.groups) == [2, 2]
    plan, groups = regroup.strategy_plan(dropped)
    mine = next(i for i, g in enumerate(groups) if 2 in g)
    counts = {r.devices[0]: r.micro_batches for r in plan.replicas}
    assert counts[mine] == 1 and counts[1 - mine] == 3
    in_force, breaks = regroup.price_in_force(slow, whole, Plan((Replica((0,), (0, 4), 4),)))
    assert breaks is None and in_force > 1.9 * dropped.iteration_ms

    healthy = solve_tensor(_problem({}), config)
    assert [g.members for g in healthy.groups] == [(0, 1, 2, 3)]
    assert healthy.iteration_ms < regroup.price_in_force(_problem({}), {0: (0, 1), 1: (2, 3)}, plan)[0]


def test_tensor_options_are_checked_by_name():
    with pytest.raises(ConfigError, match="controller.tensor_comm_fraction"):
        ControllerConfig(tensor_comm_fraction=-0.1)
    with pytest.raises(ConfigError, match="controller.tensor_regroup"):
        ControllerConfig(tensor_regroup="yes")


def _summary(step: int, rank: int, ratio: float | None, fit_id: int) -> RankSummary:
    return RankSummary(step=step, rank=rank, replica=rank, stage=0, layers=(0, 4), ratio=ratio, micro_batches=4,
                       fit_id=fit_id, rel_scale=0.01, busy_ms=10.0, step_ms=10.0, model=None)


def test_a_device_formed_around_a_slow_member_starts_flagged_and_heals_like_any_other():
    core = StragglerCore(StragglerConfig(patience=3, window=1, min_cohort=3))
    for step in range(3):
        core.update([_summary(step, r, 1.0, 1) for r in range(3)])
    version = core.version
    core.reseat(2, 0.4)  # a member named at speed 0.4 became device 2 on its own
    # The plan was made with that speed already: no re-plan is due (the version stays).
    assert core.version == version and core.speeds[2] == 0.4 and core.flagged == [2] and core.seeded == [2]
    for step in range(3, 6):  # refitting: no ratio yet; it stays what it was seeded as
        assert core.update([_summary(step, 0, 1.0, 1), _summary(step, 1, 1.0, 1), _summary(step, 2, None, 1)]) == []
    for step in range(6, 9):  # its new model was fitted while it was slow: ratio 1 means speed 0.4
        assert core.update([_summary(step, 0, 1.0, 1), _summary(step, 1, 1.0, 1), _summary(step, 2, 1.0, 2)]) == []
    assert core.speeds[2] == 0.4
    events = []
    for step in range(9, 12):  # it heals: 2.5x faster than its model
        events += core.update([_summary(step, 0, 1.0, 1), _summary(step, 1, 1.0, 1), _summary(step, 2, 2.5, 2)])
    assert [(e["event"], e["rank"], e["step"]) for e in events] == [("fail_slow_recovered", 2, 11)]
    assert core.seeded == [] and core.version > version
    core.reseat(1)  # a group formed anew of healthy members: fresh
    assert core.speeds[1] == 1.0 and core.flagged == []
