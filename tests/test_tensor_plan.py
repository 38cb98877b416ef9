"""The planning model with a TP degree per group (resihp_lightning/tensor_plan.py): group devices, the
rules a TP problem and its groups obey, the groupings of a domain, the baselines' groupings, JSON."""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys

import pytest

from resihp_lightning.errors import PlanError, ProblemError
from resihp_lightning.plan import Device, Layer, Plan, Problem, Replica, evaluate
from resihp_lightning.tensor_plan import (
    MAX_DOMAIN_SIZE,
    SearchStats,
    TensorCost,
    TensorGroup,
    TensorPlan,
    TensorProblem,
    device_key,
    domain_groupings,
    evaluate_tensor_plan,
    even_split_degrees,
    fixed_degree_groups,
    group_device,
    healthy_groups,
    resihp_rule_groups,
    validate_tensor_plan,
)

COST = TensorCost((1, 2, 4), {2: 0.02, 4: 0.05})


def _problem(gpus: list[Device], *, exclude: bool = True) -> Problem:
    return Problem([Layer(10.0, 100.0, 5.0)] * 4, gpus, 4, p2p_ms=0.5, allreduce_ms=2.0, allow_exclude=exclude)


def _two_domains(dead: tuple[int, ...] = (), slow: dict[int, float] | None = None, exclude: bool = True) -> TensorProblem:
    slow = slow or {}
    gpus = [Device(g, slow.get(g, 1.0), 1_000.0) for g in range(8) if g not in dead]
    return TensorProblem(_problem(gpus, exclude=exclude), ((0, 1, 2, 3), (4, 5, 6, 7)), COST)


# ------------------------------------------------------------------------------------- group maths
def test_a_group_is_one_device_of_k_times_its_slowest_member_plus_the_all_reduce():
    members = [Device(4, 0.8, 900.0, 0.5), Device(5, 1.0, 1000.0, 1.0), Device(6, 0.6, 1200.0, 2.0), Device(7, 1.0, 800.0)]
    cost = TensorCost((1, 2, 4), {2: 0.02, 4: 0.05})
    device = group_device(members, cost)
    assert device.id == 4  # the first member names the group
    assert device.speed == 1.0 / (1.0 / (4 * 0.6) + 0.05)
    assert device.memory_mb == 4 * 800.0
    assert device.link_speed == 0.5
    assert group_device(members[1:2], cost).speed == 1.0  # one GPU: no all-reduce, its own speed
    assert group_device(members[:2], cost, device_id=99).id == 99


def test_a_stage_on_a_group_costs_its_layers_split_k_ways_plus_the_all_reduce():
    """Priced by plan.evaluate on the group problem, a stage of layers c_l on k GPUs of slowest speed s
    takes sum_l (c_l / (k s) + c_l f_k): the formula of the module docstring, layer by layer."""
    layers = [Layer(c, 10.0, 1.0) for c in (3.0, 5.0, 7.0, 11.0)]
    gpus = [Device(g, s, 100.0) for g, s in enumerate((1.0, 0.7, 1.0, 1.0, 0.9, 1.0))]
    problem = TensorProblem(Problem(layers, gpus, 3, allow_exclude=True), ((0, 1, 2, 3), (4, 5)),
                            TensorCost((1, 2, 4), {2: 0.03, 4: 0.08}))
    groups = (TensorGroup((0, 1, 2, 3)), TensorGroup((4, 5)))
    plan = TensorPlan(groups, Plan((Replica((0, 4), (0, 1, 4), 3),)))
    stages = evaluate_tensor_plan(problem, plan).stage_ms[0]
    assert stages[0] == pytest.approx(3.0 / (4 * 0.7) + 3.0 * 0.08, rel=1e-12)
    assert stages[1] == pytest.approx(sum(c / (2 * 0.9) + c * 0.03 for c in (5.0, 7.0, 11.0)), rel=1e-12)


def test_even_split_degrees_divide_every_count():
    assert even_split_degrees(64, 8) == (1, 2, 4, 8)  # LLaMA2-70B heads and key/value heads
    assert even_split_degrees(28, 4, 152064) == (1, 2, 4)  # Qwen2.5-7B with its vocabulary split
    assert even_split_degrees(12, 6, max_degree=4) == (1, 2, 3)
    with pytest.raises(ProblemError, match="positive integer"):
        even_split_degrees(0)


# ------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("degrees, fractions, message", [
    ((), {}, "tensor.degrees must be a non-empty"),
    ((1, 0), {}, "integers >= 1"),
    ((1, 2, 2), {2: 0.1}, "lists a degree twice"),
    ((1, 2), {2: -0.1}, r"comm_fraction\[2\] must be a finite number >= 0"),
    ((1, 2), {2: math.nan}, r"comm_fraction\[2\]"),
    ((1, 2, 4), {2: 0.1}, "no fraction for degree 4"),
    ((1, 2), {2: 0.1, 3: 0.2}, "names degree 3, which is not among the allowed degrees"),
    ((1, 2), {1: 0.1, 2: 0.2}, r"comm_fraction\[1\] must be 0"),
])
def test_bad_tensor_costs_are_refused_by_name(degrees, fractions, message):
    with pytest.raises(ProblemError, match=message):
        TensorCost(degrees, fractions)


def test_bad_domains_are_refused_by_name():
    gpus = [Device(g, 1.0, 100.0) for g in range(4)]
    problem = _problem(gpus)
    with pytest.raises(ProblemError, match=r"GPU 1 of domains\[1\] is in domains\[0\] too"):
        TensorProblem(problem, ((0, 1), (1, 2, 3)), COST)
    with pytest.raises(ProblemError, match=r"GPU 0 of domains\[0\] is twice"):
        TensorProblem(problem, ((0, 0, 1), (2, 3)), COST)
    with pytest.raises(ProblemError, match=r"GPU 3 \(problem.devices\[3\]\) is in no domain"):
        TensorProblem(problem, ((0, 1), (2,)), COST)
    with pytest.raises(ProblemError, match=f"at most {MAX_DOMAIN_SIZE}"):
        TensorProblem(problem, (tuple(range(MAX_DOMAIN_SIZE + 1)),), COST)
    with pytest.raises(ProblemError, match=r"domains\[1\] must be a non-empty list"):
        TensorProblem(problem, ((0, 1, 2, 3), ()), COST)
    with pytest.raises(ProblemError, match="integer GPU ids"):
        TensorProblem(problem, ((0, 1, 2, "3"),), COST)


def test_bad_groups_are_refused_by_name():
    problem = _two_domains(dead=(6,))
    with pytest.raises(PlanError, match=r"groups\[0\] has degree 3; allowed degrees: \[1, 2, 4\]"):
        problem.check_groups((TensorGroup((0, 1, 2)),))
    with pytest.raises(PlanError, match=r"groups\[0\] names GPU 9, which is unknown"):
        problem.check_groups((TensorGroup((9,)),))
    with pytest.raises(PlanError, match=r"groups\[1\] names GPU 6, which is dead"):
        problem.check_groups((TensorGroup((4, 5)), TensorGroup((6, 7))))
    with pytest.raises(PlanError, match=r"GPU 1 of groups\[1\] is in groups\[0\] too"):
        problem.check_groups((TensorGroup((0, 1)), TensorGroup((1, 2))))
    with pytest.raises(PlanError, match=r"groups\[0\] mixes GPUs of domains \[0, 1\]"):
        problem.check_groups((TensorGroup((3, 4)),))
    strict = _two_domains(exclude=False)
    with pytest.raises(PlanError, match=r"GPUs \[4, 5, 6, 7\] are in no group, but the problem does not allow_exclude"):
        strict.check_groups(healthy_groups(strict, 0, 4))
    with pytest.raises(PlanError, match="every live GPU is a spare"):
        problem.group_problem(())


# ------------------------------------------------------------------------------------- domains
def test_healthy_and_affected_domains():
    problem = _two_domains(slow={5: 0.5})
    assert problem.healthy(0) and not problem.healthy(1)
    assert not _two_domains(dead=(2,)).healthy(0)
    memory = TensorProblem(_problem([Device(g, 1.0, 100.0 if g else 50.0) for g in range(4)]), ((0, 1, 2, 3),), COST)
    assert not memory.healthy(0)  # different memory
    odd = TensorProblem(_problem([Device(g, 1.0, 100.0) for g in range(6)]), ((0, 1, 2, 3), (4, 5)), COST)
    assert odd.healthy_degrees() == (1, 2)  # 4 does not divide the domain of 2
    assert healthy_groups(odd, 0, 2) == (TensorGroup((0, 1)), TensorGroup((2, 3)))


def _own_groupings(gpus: list[int], degrees: tuple[int, ...], spares: bool):
    """Every set of disjoint groups of allowed sizes over these GPUs (spares allowed or not): the test's own enumeration."""
    if not gpus:
        yield ()
        return
    first, rest = gpus[0], gpus[1:]
    if spares:
        yield from _own_groupings(rest, degrees, spares)
    for k in degrees:
        for others in itertools.combinations(rest, k - 1):
            left = [g for g in rest if g not in others]
            for tail in _own_groupings(left, degrees, spares):
                yield ((first, *others), *tail)


@pytest.mark.parametrize("exclude", [True, False])
def test_domain_groupings_are_every_grouping_once_per_multiset_of_devices(exclude):
    """Against the test's own enumeration of set partitions: the same multisets of group devices, each
    listed once, each a valid grouping (members ascending, allowed degrees, live GPUs)."""
    rng = random.Random(3 if exclude else 4)
    for _ in range(25):
        size = rng.randint(1, 5)
        degrees = tuple(sorted(rng.sample([1, 2, 3, 4], rng.randint(1, 3))))
        cost = TensorCost(degrees, {k: rng.choice([0.0, 0.01, 0.05]) for k in degrees if k > 1})
        gpus = [Device(g, rng.choice([1.0, 1.0, 0.5, 0.8]), rng.choice([100.0, 100.0, 80.0]), rng.choice([1.0, 1.0, 0.5]))
                for g in range(size) if rng.random() > 0.2]
        if not gpus:
            continue
        problem = TensorProblem(_problem(gpus, exclude=exclude), (tuple(range(size)),), cost)
        listed = domain_groupings(problem, 0)
        keys = [device_key(problem.group_device(g) for g in groups) for groups in listed]
        assert len(keys) == len(set(keys))
        live = [d.id for d in gpus]
        expected = {device_key(group_device([problem.gpu(g) for g in members], cost) for members in groups)
                    for groups in _own_groupings(live, degrees, exclude)}
        assert set(keys) == expected
        for groups in listed:
            problem.check_groups(groups)
            assert all(list(g.members) == sorted(g.members) for g in groups)


def test_resihp_rule_keeps_healthy_domains_and_forms_one_group_maximising_k_times_its_slowest():
    # Domain 1: GPUs at 1.0, 1.0, 0.9, 0.3 -> k=1: 1.0, k=2: 2.0, k=4: 1.2 (k=3 not allowed): a pair of the two fastest.
    problem = _two_domains(slow={6: 0.9, 7: 0.3})
    assert resihp_rule_groups(problem, 4) == (TensorGroup((0, 1, 2, 3)), TensorGroup((4, 5)))
    # A tie: 0.5 at 4 GPUs (4 x 0.5 = 2.0) against the pair (2 x 1.0): the larger degree wins.
    tie = _two_domains(slow={7: 0.5})
    assert resihp_rule_groups(tie, 2) == (TensorGroup((0, 1)), TensorGroup((2, 3)), TensorGroup((4, 5, 6, 7)))
    dead = _two_domains(dead=(0, 1, 2))
    assert resihp_rule_groups(dead, 4) == (TensorGroup((3,)), TensorGroup((4, 5, 6, 7)))
    with pytest.raises(PlanError, match="does not split"):
        resihp_rule_groups(problem, 3)


def test_fixed_degree_takes_the_fastest_live_gpus_in_order():
    problem = _two_domains(dead=(5,), slow={6: 0.5})
    assert fixed_degree_groups(problem, 2) == (TensorGroup((0, 1)), TensorGroup((2, 3)), TensorGroup((4, 7)))
    assert fixed_degree_groups(problem, 4) == (TensorGroup((0, 1, 2, 3)),)
    odd = TensorProblem(_problem([Device(g, 1.0, 100.0) for g in range(6)]), ((0, 1, 2, 3), (4, 5)), COST)
    with pytest.raises(PlanError, match=r"does not split every healthy domain; degrees that do: \[1, 2\]"):
        fixed_degree_groups(odd, 4)


# ------------------------------------------------------------------------------------- plans, JSON
def test_a_tensor_plan_validates_prices_and_names_its_idle_gpus():
    problem = _two_domains(dead=(5,))
    groups = (TensorGroup((0, 1, 2, 3)), TensorGroup((4, 6)), TensorGroup((7,)))
    plan = TensorPlan(groups, Plan((Replica((0, 4), (0, 2, 4), 4),)))
    validate_tensor_plan(problem, plan)
    direct = evaluate(problem.group_problem(groups), plan.plan)
    assert evaluate_tensor_plan(problem, plan).iteration_ms == direct.iteration_ms
    assert plan.idle_gpus(problem) == (7,)
    assert plan.degrees() == {0: 4, 4: 2}
    with pytest.raises(PlanError, match="device 7"):  # a group the plan names must be one of the groups' ids
        validate_tensor_plan(problem, TensorPlan(groups[:2], Plan((Replica((0, 7), (0, 2, 4), 4),))))


def test_json_round_trips():
    problem = _two_domains(dead=(5,), slow={6: 0.5})
    again = TensorProblem.from_json(problem.to_json())
    assert again == problem and again.cost.comm_fraction == {1: 0.0, 2: 0.02, 4: 0.05}
    plan = TensorPlan((TensorGroup((0, 1, 2, 3)), TensorGroup((4, 6))),
                      Plan((Replica((0, 4), (0, 2, 4), 4),), iteration_ms=12.5, status="optimal", gap=0.0),
                      SearchStats(combinations=7, solved=2, pruned=5, unproven=0, relaxations=1))
    assert TensorPlan.from_json(plan.to_json()) == plan
    data = plan.to_dict()
    data["groups"][0]["degree"] = 2
    with pytest.raises(PlanError, match=r"groups\[0\] says degree 2 but has 4 members"):
        TensorPlan.from_dict(data)
    with pytest.raises(ProblemError, match="unknown field 'tp'"):
        TensorProblem.from_dict({**problem.to_dict(), "tp": 4})
    with pytest.raises(ProblemError, match="missing the field 'domains'"):
        TensorProblem.from_dict({"problem": problem.problem.to_dict(), "tensor": {"degrees": [1]}})
    with pytest.raises(ProblemError, match=r"comm_fraction\[4\] must be a finite number >= 0"):
        TensorProblem.from_dict({**problem.to_dict(), "tensor": {"degrees": [1, 4], "comm_fraction": {"4": -1}}})


def test_the_model_and_the_search_do_not_import_torch():
    code = ("import sys; import resihp_lightning.tensor_plan, resihp_lightning.solver.tensor_search; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
