"""The controller's pure parts: problem building, migration estimate, and the apply/reject decision."""

from __future__ import annotations

import pytest

from resihp_lightning.callbacks.replan.replan_policy import (
    ControllerConfig,
    build_problem,
    calibrate,
    decide,
    estimate_migration_s,
    moved_mb,
    quantize_speeds,
)
from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import ConfigError
from resihp_lightning.plan import Plan, Replica, evaluate
from resihp_lightning.telemetry import LayerCost

CFG = ControllerConfig()


def _profile(n=8, ms=2.0, mb=100.0):
    return [LayerCost(i, ms, mb, 1.0) for i in reversed(range(n))]  # out of order on purpose


def test_quantize_speeds_rounds_and_clips():
    assert quantize_speeds({0: 1.02, 1: 0.49, 2: 0.012, 3: 0.93}, 0.05) == pytest.approx({0: 1.0, 1: 0.5, 2: 0.05, 3: 0.95})


def test_build_problem_from_profile_speeds_and_live_ranks():
    problem = build_problem(_profile(), {1: 0.51, 3: 1.0}, ranks=[3, 0, 1], micro_batches=8,
                            config=ControllerConfig(p2p_ms=0.1, allreduce_ms=3.0, memory_mb=5000.0),
                            planner=PlannerConfig(pipeline_degrees=(1, 3)))
    assert [layer.compute_ms for layer in problem.layers] == [2.0] * 8
    assert [(d.id, d.speed, d.memory_mb) for d in problem.devices] == [(0, 1.0, 5000.0), (1, 0.5, 5000.0), (3, 1.0, 5000.0)]
    assert problem.micro_batches == 8 and problem.p2p_ms == 0.1 and problem.allreduce_ms == 3.0
    assert problem.pipeline_degrees == (1, 3) and problem.shared_partition is True
    unmeasured = build_problem([LayerCost(i, 0.0, 1.0, 0.0) for i in range(4)], {}, [0, 1], 4, CFG)
    assert [layer.compute_ms for layer in unmeasured.layers] == [1.0] * 4
    # A layer its holder has not recorded yet costs the mean of the others, as for the survivors (not 0 ms).
    partly = build_problem([LayerCost(0, 2.0, 1.0, 0.0), LayerCost(1, 0.0, 1.0, 0.0), LayerCost(2, 4.0, 1.0, 0.0)],
                           {}, [0, 1], 4, CFG)
    assert [layer.compute_ms for layer in partly.layers] == [2.0, 3.0, 4.0]


def test_the_conditions_handed_to_a_recovery_carry_the_planner_options():
    """What the controller sets as ``strategy.device_conditions`` every step: the quantized speeds and links,
    the transfer costs, and its planner options (the survivors' plan is built under them)."""
    from resihp_lightning.callbacks.replan.replan_policy import MeasuredLinks, device_conditions

    planner = PlannerConfig(solver="exact", pipeline_degrees=(2,))
    links = MeasuredLinks({2: 0.26}, p2p_ms=1.5, allreduce_ms=7.0)
    handed = device_conditions({1: 0.51}, links, CFG, planner)
    assert handed.planner is planner
    assert handed.speeds == pytest.approx({1: 0.5}) and handed.link_speeds == pytest.approx({2: 0.25})
    assert (handed.p2p_ms, handed.allreduce_ms) == (1.5, 7.0)
    assert device_conditions({}, None, CFG).planner is None


def test_moved_bytes_count_only_new_device_layer_pairs():
    static = [10.0, 20.0, 30.0, 40.0]
    old = Plan((Replica((0, 1), (0, 2, 4), 4), Replica((2, 3), (0, 2, 4), 4)))
    same = Plan((Replica((0, 1), (0, 2, 4), 2), Replica((2, 3), (0, 2, 4), 6)))  # micro-batches only
    shifted = Plan((Replica((0, 1), (0, 3, 4), 4), Replica((2, 3), (0, 3, 4), 4)))  # devices 0 and 2 take layer 2
    swapped = Plan((Replica((1, 0), (0, 2, 4), 4), Replica((2, 3), (0, 2, 4), 4)))  # devices 0 and 1 trade stages
    assert moved_mb(old, same, static) == 0.0
    assert moved_mb(old, shifted, static) == 30.0 + 30.0
    assert moved_mb(old, swapped, static) == (10 + 20) + (30 + 40)
    assert estimate_migration_s(old, shifted, static, overhead_s=0.5, bandwidth_mb_s=60.0) == pytest.approx(1.5)


def test_calibrate_from_a_measured_migration():
    assert calibrate(3.0, 200.0, 1.0, 1000.0) == (1.0, 100.0)
    assert calibrate(0.4, 200.0, 1.0, 1000.0) == (0.4, 1000.0)
    assert calibrate(0.0, 0.0, 1.0, 1000.0) == (1.0, 1000.0)


def test_decide_rules_in_order():
    kw = dict(remaining_steps=1000, migration_s=2.0, steps_since_change=None, config=CFG)
    assert not decide(100.0, 60.0, same_plan=True, **kw).apply
    cool = decide(100.0, 60.0, same_plan=False, **{**kw, "steps_since_change": 2})
    assert not cool.apply and "cooldown" in cool.reason
    assert cool.retry_after_steps == CFG.cooldown_steps - 2  # held back only by the cooldown: solve again then
    cool_small = decide(100.0, 99.0, same_plan=False, **{**kw, "steps_since_change": 2})
    assert not cool_small.apply and cool_small.retry_after_steps is None  # would fail the gain rule anyway
    small = decide(100.0, 96.0, same_plan=False, **kw)
    assert not small.apply and "min_relative_gain" in small.reason
    short = decide(100.0, 60.0, same_plan=False, **{**kw, "remaining_steps": 50})  # 2 s saved < 2 x 2 s
    assert not short.apply and "migration" in short.reason and short.total_gain_s == pytest.approx(2.0)
    good = decide(100.0, 60.0, same_plan=False, **kw)
    assert good.apply and good.gain_ms == 40.0 and good.total_gain_s == pytest.approx(40.0)


def test_a_plan_in_force_that_breaks_the_planners_rules_is_priced_and_left():
    """A 3 x 1 start with planner.min_data_degree 2: the plan in force has a real predicted time (it used to
    be priced at inf, logged as "saves inf ms per step (nan%)"), and the decision names the broken rule and
    applies the planner's plan even for a small gain; the cooldown still holds it back."""
    from resihp_lightning.callbacks.replan.replan_policy import price_plan_in_force
    from resihp_lightning.solver import solve

    problem = build_problem(_profile(6), {1: 0.5}, [0, 1, 2], 8, CFG, PlannerConfig(min_data_degree=2))
    start = Plan.from_dict({"replicas": [{"devices": [0, 1, 2], "bounds": [0, 2, 4, 6], "micro_batches": 8}]})
    current_ms, breaks = price_plan_in_force(problem, start)
    assert current_ms == pytest.approx(evaluate(problem, start, check=False).iteration_ms) and current_ms < float("inf")
    assert breaks is not None and "min_data_degree" in breaks
    planned = solve(problem)
    assert price_plan_in_force(problem, planned) == (pytest.approx(planned.iteration_ms), None)
    kw = dict(same_plan=False, remaining_steps=1000, migration_s=2.0, config=CFG, current_breaks=breaks)
    small_gain = decide(current_ms, current_ms * 0.99, steps_since_change=None, **kw)
    assert small_gain.apply and "breaks the planner's rules" in small_gain.reason and "inf" not in small_gain.reason
    cooling = decide(current_ms, current_ms * 0.99, steps_since_change=1, **kw)
    assert not cooling.apply and cooling.retry_after_steps == CFG.cooldown_steps - 1


def test_controller_config_is_validated():
    with pytest.raises(ConfigError, match="controller.min_relative_gain"):
        ControllerConfig(min_relative_gain=1.5)
    with pytest.raises(ConfigError, match="controller.speed_quantum"):
        ControllerConfig(speed_quantum=0)
    with pytest.raises(ConfigError, match="controller.cooldown_steps"):
        ControllerConfig(cooldown_steps=-1)


def test_slow_rank_then_recovery_replans_and_replans_back():
    """The loop on numbers: a 2x2 job, rank 1 at half speed, then healed."""
    from resihp_lightning.solver import solve

    planner = PlannerConfig(solver="exact")
    profile = [LayerCost(i, 2.0, 50.0, 1.0) for i in range(8)]
    healthy = Plan.uniform([0, 1, 2, 3], 8, 2, 8)
    slow = build_problem(profile, {1: 0.5}, range(4), 8, CFG, planner)
    adapted = solve(slow, planner)
    current_ms = evaluate(slow, healthy).iteration_ms
    assert adapted.iteration_ms < current_ms * 0.9
    migration = estimate_migration_s(healthy, adapted, [50.0] * 8, overhead_s=1.0, bandwidth_mb_s=1000.0)
    go = decide(current_ms, adapted.iteration_ms, same_plan=adapted.layout_key() == healthy.layout_key(),
                remaining_steps=10_000, migration_s=migration, steps_since_change=None, config=CFG)
    assert go.apply
    stay = decide(current_ms, adapted.iteration_ms, same_plan=False, remaining_steps=10,
                  migration_s=migration, steps_since_change=None, config=CFG)
    assert not stay.apply
    healed = build_problem(profile, {1: 1.0}, range(4), 8, CFG, planner)
    back = solve(healed, planner)
    assert back.iteration_ms <= evaluate(healed, healthy).iteration_ms + 1e-9  # the healthy optimum
    assert evaluate(healed, adapted).iteration_ms > back.iteration_ms * (1 + CFG.min_relative_gain)
    again = decide(evaluate(healed, adapted).iteration_ms, back.iteration_ms, same_plan=False, remaining_steps=10_000,
                   migration_s=migration, steps_since_change=20, config=CFG)
    assert again.apply


def test_shared_partition_follows_the_strategy_unless_the_planner_sets_it():
    auto = PlannerConfig()
    assert auto.shared_partition is None
    per_replica = build_problem(_profile(4), {}, [0, 1], 4, CFG, auto, per_replica_bounds=True)
    shared_only = build_problem(_profile(4), {}, [0, 1], 4, CFG, auto, per_replica_bounds=False)
    assert per_replica.shared_partition is False and shared_only.shared_partition is True
    forced = build_problem(_profile(4), {}, [0, 1], 4, CFG, PlannerConfig(shared_partition=True), per_replica_bounds=True)
    assert forced.shared_partition is True
    assert build_problem(_profile(4), {}, [0, 1], 4, CFG).shared_partition is True  # default: what any strategy runs
    with pytest.raises(ConfigError, match="planner.shared_partition"):
        PlannerConfig(shared_partition="yes")


def test_shared_partition_is_a_planner_option_only():
    from resihp_lightning.callbacks.replan.replan_controller import ReplanController

    moved = r"`controller.shared_partition` was removed; use `planner.shared_partition`"
    with pytest.raises(ConfigError, match=moved):
        ControllerConfig.from_dict({"shared_partition": True})
    with pytest.raises(ConfigError, match=moved):
        ReplanController({"cooldown_steps": 2, "shared_partition": False})
    with pytest.raises(ConfigError, match=r"unknown option `controller.cooldwn_steps`; allowed: .*cooldown_steps"):
        ControllerConfig.from_dict({"cooldwn_steps": 2})
    controller = ReplanController({"cooldown_steps": 2}, planner={"solver": "exact", "shared_partition": False})
    assert controller.config == ControllerConfig(cooldown_steps=2)
    assert controller.planner == PlannerConfig(solver="exact", shared_partition=False)
    assert ReplanController().planner == PlannerConfig()
    with pytest.raises(ConfigError, match=r"unknown option `planner.workers`"):
        ReplanController(planner={"workers": 2})


def test_a_device_at_a_tenth_of_the_speed_is_left_idle_when_the_strategy_allows_spares():
    """With fail-stop recovery on (``strategy.supports_idle_devices``) the problem lets the plan leave a device
    out; the one at 0.1 then idles instead of holding up every step with even one micro-batch."""
    from resihp_lightning.solver import solve

    planner = PlannerConfig(solver="exact", pipeline_degrees=(1,))
    profile = [LayerCost(i, 2.0, 10.0, 0.0) for i in range(8)]
    spares = build_problem(profile, {3: 0.1}, range(4), 8, CFG, planner, per_replica_bounds=True, allow_exclude=True)
    without = build_problem(profile, {3: 0.1}, range(4), 8, CFG, planner, per_replica_bounds=True)
    assert spares.allow_exclude and not without.allow_exclude
    idle = solve(spares, planner)
    busy = solve(without, planner)
    assert sorted(idle.device_ids) == [0, 1, 2] and sorted(busy.device_ids) == [0, 1, 2, 3]
    assert idle.iteration_ms * 2 < busy.iteration_ms
    # The planner option still decides when set.
    assert not build_problem(profile, {}, range(4), 8, CFG, PlannerConfig(allow_exclude=False), allow_exclude=True).allow_exclude
