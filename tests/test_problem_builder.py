"""The one builder of planning problems: what it makes of measured costs, and that every path that plans
gets the same problem from the same measurements and options (resihp_lightning/problem_builder.py)."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace

import pytest

from resihp_lightning.callbacks.replan.replan_policy import ControllerConfig, MeasuredLinks, build_problem, device_conditions
from resihp_lightning.config import PlannerConfig
from resihp_lightning.contract import DeviceConditions
from resihp_lightning.errors import PlanError, ProblemError
from resihp_lightning.failstop.survivor_plan import survivor_plan, survivor_problem
from resihp_lightning.plan import Layer, evaluate, validate
from resihp_lightning.problem_builder import fill_missing_costs, memory_budgets, measured_layers, problem_from_costs
from resihp_lightning.solver import solve
from resihp_lightning.telemetry import LayerCost


def _profile(n: int = 8, ms: float = 10.0, mb: float = 100.0) -> list[LayerCost]:
    return [LayerCost(i, ms, mb, 1.0) for i in range(n)]


# ------------------------------------------------------------------------------------- the builder
def test_unmeasured_layers_cost_the_mean_of_the_measured_ones_in_layer_order():
    profile = [LayerCost(2, 0.0, 5.0, 1.0), LayerCost(0, 2.0, 5.0, -1.0), LayerCost(1, 4.0, -3.0, 1.0)]
    layers = measured_layers(profile)
    assert [layer.compute_ms for layer in layers] == [2.0, 4.0, 3.0]  # layer 2 was not measured: mean of 2 and 4
    assert [(layer.static_mb, layer.activation_mb) for layer in layers] == [(5.0, 0.0), (0.0, 1.0), (5.0, 1.0)]
    assert [c.compute_ms for c in fill_missing_costs([LayerCost(i, 0.0, 1.0, 0.0) for i in range(3)])] == [1.0] * 3


def test_modelled_layers_are_taken_as_they_are_and_a_mix_is_refused():
    modelled = (Layer(0.0, 50.0, 1.0), Layer(7.0, 10.0, 1.0))  # an embedding lookup really costs 0 ms
    assert problem_from_costs(modelled, [0], 2).layers == modelled
    with pytest.raises(TypeError, match="all LayerCost"):
        problem_from_costs([modelled[0], LayerCost(1, 1.0, 1.0, 1.0)], [0], 2)


def test_devices_in_id_order_with_their_conditions_and_budgets():
    conditions = DeviceConditions(speeds={3: 0.5}, link_speeds={1: 0.25}, p2p_ms=1.5, allreduce_ms=7.0)
    problem = problem_from_costs(_profile(4), (3, 0, 1), 6, conditions=conditions, memory_mb={0: 800.0, 3: 900.0})
    assert [(d.id, d.speed, d.link_speed, d.memory_mb) for d in problem.devices] == [
        (0, 1.0, 1.0, 800.0), (1, 1.0, 0.25, math.inf), (3, 0.5, 1.0, 900.0)]
    assert (problem.micro_batches, problem.p2p_ms, problem.allreduce_ms) == (6, 1.5, 7.0)
    healthy = problem_from_costs(_profile(4), [0, 1], 6)
    assert {(d.speed, d.link_speed, d.memory_mb) for d in healthy.devices} == {(1.0, 1.0, math.inf)}
    assert (healthy.p2p_ms, healthy.allreduce_ms) == (0.0, 0.0)
    with pytest.raises(ProblemError, match="appears twice"):
        problem_from_costs(_profile(4), [0, 1, 1], 6)


def test_memory_budgets_one_number_per_device_or_unlimited():
    assert memory_budgets([0, 1], 500) == {0: 500.0, 1: 500.0}
    assert memory_budgets([0, 1], {1: 300.0, 9: 1.0}) == {0: math.inf, 1: 300.0}
    assert memory_budgets([0, 1], None) == {0: math.inf, 1: math.inf}


def test_what_the_job_can_run_then_the_planner_options_decide_the_rules():
    plain = problem_from_costs(_profile(4), [0, 1], 4)
    assert plain.shared_partition and not plain.allow_exclude
    capable = problem_from_costs(_profile(4), [0, 1], 4, per_replica_bounds=True, allow_exclude=True)
    assert not capable.shared_partition and capable.allow_exclude
    options = PlannerConfig(shared_partition=True, allow_exclude=False, pipeline_degrees=(2,), min_layers_per_stage=2,
                            min_data_degree=1)
    ruled = problem_from_costs(_profile(4), [0, 1], 4, per_replica_bounds=True, allow_exclude=True, planner=options)
    assert ruled == options.apply_to(capable)
    assert ruled.shared_partition and not ruled.allow_exclude and ruled.pipeline_degrees == (2,)


def test_the_builder_does_not_import_torch():
    code = "import sys, resihp_lightning.problem_builder\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


# ------------------------------------------------------------------- one problem on every path
def test_the_controller_and_the_survivors_build_the_same_problem_from_the_same_measurements():
    """What the controller hands the strategy (``device_conditions``) is what a recovery plans with: for the
    same profile (one layer unmeasured), speeds, links, budgets and planner options, the survivors' problem
    is the controller's problem with hot spares."""
    profile = _profile(8)
    profile[5] = LayerCost(5, 0.0, 100.0, 1.0)
    speeds, links = {1: 0.52, 4: 0.97}, MeasuredLinks({2: 0.26}, p2p_ms=1.5, allreduce_ms=7.0)
    config = ControllerConfig()
    planner = PlannerConfig(pipeline_degrees=(1, 2), min_layers_per_stage=2)
    memory = {0: 900.0, 1: 700.0, 2: 800.0, 4: 900.0}
    members = [0, 1, 2, 4]
    controller = build_problem(profile, speeds, members, 12, config, planner, per_replica_bounds=True,
                               allow_exclude=True, links=links, memory_mb=memory)
    handed = device_conditions(speeds, links, config, planner)
    assert handed.planner == planner
    assert survivor_problem(profile, members, 12, True, memory, handed) == controller
    assert controller.layers[5].compute_ms == pytest.approx(10.0)  # filled on both paths
    assert [d.speed for d in controller.devices] == pytest.approx([1.0, 0.5, 1.0, 0.95])  # quantized by the controller


# ------------------------------------------------------ the survivors' plan honours the options
def _survivors(conditions: DeviceConditions | None = None, **kwargs):
    members = [0, 1, 2, 4, 5, 6]  # rank 3 died
    kwargs.setdefault("min_data_degree", 2)
    plan = survivor_plan(_profile(8), members, 12, True, "exact", conditions=conditions, **kwargs)
    problem = survivor_problem(_profile(8), members, 12, True, kwargs.get("memory_mb"), conditions)
    return plan, problem


def test_the_planners_pipeline_degrees_change_the_survivors_plan():
    default, default_problem = _survivors()
    assert default.pipeline_degree == 1  # six equal survivors: pure data parallelism is fastest
    handed = device_conditions({}, None, ControllerConfig(), PlannerConfig(pipeline_degrees=(2,)))
    plan, problem = _survivors(handed)
    assert plan.pipeline_degree == 2 and plan.data_degree >= 2
    validate(problem, plan)
    with pytest.raises(PlanError, match="pipeline degree 1"):
        validate(problem, default)  # the defaults' plan breaks the user's rule
    # The option costs time: the defaults' plan is faster on the defaults' problem, the option's plan is valid there.
    validate(default_problem, plan)
    assert evaluate(default_problem, plan).iteration_ms > default.iteration_ms


def test_allow_exclude_false_keeps_a_very_slow_survivor_working():
    slow = {1: 0.1}
    spared, _ = _survivors(DeviceConditions(speeds=slow))
    assert 1 not in spared.device_ids  # by default the slow survivor is left idle: it is faster
    plan, problem = _survivors(DeviceConditions(speeds=slow, planner=PlannerConfig(allow_exclude=False)))
    assert sorted(plan.device_ids) == [0, 1, 2, 4, 5, 6]
    validate(problem, plan)
    assert plan.iteration_ms >= spared.iteration_ms
    assert evaluate(problem, plan).iteration_ms == pytest.approx(plan.iteration_ms)


def test_the_planners_min_data_degree_is_kept_when_larger_and_the_fail_stop_backend_is_used():
    options = PlannerConfig(solver="cpsat", pipeline_degrees=(2,), min_data_degree=3)
    plan, problem = _survivors(DeviceConditions(planner=options), min_data_degree=2)
    assert plan.data_degree >= 3 and plan.pipeline_degree == 2
    assert plan.solver == "exact"  # fail_stop.solver, the survivors' own option
    validate(problem, plan)


def test_when_no_plan_keeps_the_planners_replicas_the_survivors_run_with_fewer(recwarn):
    # Memory for four of the eight layers on each of three survivors: any plan pipelines over >= 2 of them,
    # so no plan has three replicas; the survivors keep going with a warning rather than stop.
    options = PlannerConfig(min_data_degree=3, min_layers_per_stage=2)
    plan = survivor_plan(_profile(8), [0, 1, 2], 6, True, "exact", memory_mb=450.0, min_data_degree=1,
                         conditions=DeviceConditions(planner=options))
    assert plan.data_degree < 3 and plan.pipeline_degree >= 2
    problem = survivor_problem(_profile(8), [0, 1, 2], 6, True, 450.0, DeviceConditions(planner=options))
    assert all(r.bounds[j + 1] - r.bounds[j] >= 2 for r in plan.replicas for j in range(r.num_stages))  # still kept
    assert evaluate(problem, plan, check=False).fits_memory
    assert any("no plan with 3 replicas fits the 3 survivors" in str(w.message) for w in recwarn.list)


def test_without_a_controller_the_survivors_plan_is_the_defaults_plan():
    plan, problem = _survivors(None)
    assert problem == problem_from_costs(_profile(8), [0, 1, 2, 4, 5, 6], 12, per_replica_bounds=True, allow_exclude=True)
    best = solve(replace(problem, min_data_degree=2), PlannerConfig(solver="exact"))
    assert plan.layout_key() == best.layout_key()
