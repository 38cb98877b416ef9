"""The planning model (docs/architecture.md): cost formula, memory rule, validation and JSON."""

from __future__ import annotations

import json
import math

import pytest

from resihp_lightning.errors import PlanError, ProblemError
from resihp_lightning.plan import (
    Device,
    Layer,
    Plan,
    Problem,
    Replica,
    efficiency,
    even_bounds,
    even_split,
    evaluate,
    ideal_ms,
    validate,
)

DESIGN_EXAMPLE = {
    "layers": [
        {"compute_ms": 3.0, "static_mb": 700, "activation_mb": 100},
        {"compute_ms": 3.0, "static_mb": 700, "activation_mb": 100},
    ],
    "devices": [{"id": 0, "speed": 1.0, "memory_mb": 80000}, {"id": 1, "speed": 0.5, "memory_mb": 80000}],
    "micro_batches": 16,
    "p2p_ms": 0.05,
    "allreduce_ms": 4.0,
    "pipeline_degrees": [1, 2],
    "shared_partition": True,
    "allow_exclude": False,
    "min_layers_per_stage": 1,
}


@pytest.fixture
def example() -> Problem:
    return Problem.from_dict(DESIGN_EXAMPLE)


def test_pipeline_plan_cost_by_hand(example: Problem) -> None:
    plan = Plan((Replica((0, 1), (0, 1, 2), 16),))
    result = evaluate(example, plan)
    # stage 0: 3 ms / 1.0 + p2p 0.05; stage 1: 3 ms / 0.5; T = 3.05 + 6 + 15 * 6, no all-reduce (D = 1)
    assert result.stage_ms == ((3.05, 6.0),)
    assert result.iteration_ms == pytest.approx(99.05)
    # stage 0 keeps min(P - 0, m) = 2 micro-batches in flight, stage 1 keeps 1
    assert result.memory_mb == ((700 + 2 * 100, 700 + 1 * 100),)
    assert result.fits_memory


def test_data_parallel_plan_cost_by_hand(example: Problem) -> None:
    plan = Plan((Replica((0,), (0, 2), 11), Replica((1,), (0, 2), 5)))
    result = evaluate(example, plan)
    # replica 0: 6 ms x 11; replica 1: 12 ms x 5; plus the all-reduce since D = 2
    assert result.replica_ms == pytest.approx((66.0, 60.0))
    assert result.iteration_ms == pytest.approx(70.0)
    assert result.memory_mb == ((1400 + 100 * 2,), (1400 + 100 * 2,))


def test_memory_overflow_is_reported_and_refused(example: Problem) -> None:
    tight = Problem.from_dict({**DESIGN_EXAMPLE, "devices": [{"id": 0, "memory_mb": 850}, {"id": 1, "memory_mb": 900}]})
    plan = Plan((Replica((0, 1), (0, 1, 2), 16),))
    over = evaluate(tight, plan).over_memory
    assert [(r, j, d) for r, j, d, _, _ in over] == [(0, 0, 0)]
    with pytest.raises(PlanError, match="device 0 .* needs 900.0 MB but has 850.0 MB"):
        validate(tight, plan)
    # One micro-batch in flight caps stage 0 at 800 MB: the same layout with m = 1 would fit.
    one = Problem.from_dict({**DESIGN_EXAMPLE, "micro_batches": 1, "devices": [{"id": 0, "memory_mb": 850}, {"id": 1, "memory_mb": 900}]})
    validate(one, Plan((Replica((0, 1), (0, 1, 2), 1),)))


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (Plan((Replica((0, 1), (0, 2), 16),)), "has 2 bounds; 2 stages need 3"),
        (Plan((Replica((0, 1), (0, 1, 1), 16),)), "must start at 0 and end at 2"),
        (Plan((Replica((0, 1), (0, 2, 2), 16),)), "stage 1 holds 0 layers"),
        (Plan((Replica((0, 7), (0, 1, 2), 16),)), "device 7, which is not in the problem"),
        (Plan((Replica((0, 0), (0, 1, 2), 16),)), "device 0 is used twice"),
        (Plan((Replica((0, 1), (0, 1, 2), 15),)), "run 15 micro-batches in all; the problem's global batch is 16"),
        (Plan((Replica((0,), (0, 2), 16), Replica((1,), (0, 2), 0))), "replica 1 runs 0 micro-batches"),
        (Plan((Replica((0,), (0, 2), 16),)), r"devices \[1\] are left out"),
        (Plan((Replica((0,), (0, 2), 8), Replica((1, 0), (0, 1, 2), 8))), "replica 1 has 2 stages"),
    ],
)
def test_bad_plans_are_refused_with_a_reason(example: Problem, plan: Plan, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        validate(example, plan)


def test_shared_partition_and_pipeline_degrees_are_enforced() -> None:
    four = Problem.from_dict(
        {**DESIGN_EXAMPLE, "layers": DESIGN_EXAMPLE["layers"] * 2, "devices": [{"id": i} for i in range(4)]}
    )
    split = Plan((Replica((0, 1), (0, 1, 4), 8), Replica((2, 3), (0, 3, 4), 8)))
    with pytest.raises(PlanError, match="shared_partition"):
        validate(four, split)
    validate(Problem.from_dict({**four.to_dict(), "shared_partition": False}), split)
    with pytest.raises(PlanError, match=r"pipeline degree 4 is not among the allowed pipeline_degrees \[1, 2\]"):
        validate(four, Plan((Replica((0, 1, 2, 3), (0, 1, 2, 3, 4), 16),)))


def test_candidate_shapes() -> None:
    base = {"layers": [{"compute_ms": 1.0}] * 4, "devices": [{"id": i} for i in range(6)], "micro_batches": 4}
    assert Problem.from_dict(base).candidate_shapes() == [(2, 3), (3, 2)]  # D=6 > M; P=6 > L
    excl = Problem.from_dict({**base, "allow_exclude": True, "pipeline_degrees": [2]})
    assert excl.candidate_shapes() == [(2, 1), (2, 2), (2, 3)]
    two_per_stage = Problem.from_dict({**base, "min_layers_per_stage": 2, "micro_batches": 8})
    assert two_per_stage.candidate_shapes() == [(1, 6), (2, 3)]


def test_ideal_and_efficiency_match_the_closed_form() -> None:
    # 4 identical layers on 4 devices, one at half speed: S/N = 3.5/4.
    problem = Problem(
        layers=tuple(Layer(2.0) for _ in range(4)),
        devices=(Device(0), Device(1), Device(2), Device(3, speed=0.5)),
        micro_batches=8,
        allreduce_ms=1.0,
    )
    healthy = Plan.uniform([0, 1, 2, 3], 4, 1, 8)  # 4 replicas x 2 micro-batches x 8 ms + AR
    healthy_ms = 2 * 8.0 + 1.0
    assert ideal_ms(problem, healthy) == pytest.approx((healthy_ms - 1.0) * 4 / 3.5 + 1.0)
    # Keeping the healthy plan: the slow replica takes 2 x 16 ms; E = T_ideal / T.
    assert efficiency(problem, healthy, healthy) == pytest.approx(((16.0 * 4 / 3.5) + 1.0) / 33.0)


def test_json_round_trip_and_unknown_fields(example: Problem) -> None:
    again = Problem.from_json(example.to_json())
    assert again == example
    plan = Plan((Replica((0,), (0, 2), 11), Replica((1,), (0, 2), 5)), iteration_ms=70.0, status="optimal", solver="x")
    assert Plan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json())["data_degree"] == 2
    with pytest.raises(ProblemError, match="unknown field 'gpus' in problem"):
        Problem.from_dict({**DESIGN_EXAMPLE, "gpus": 3})
    with pytest.raises(ProblemError, match=r"unknown field 'flops' in layers\[1\]"):
        Problem.from_dict({**DESIGN_EXAMPLE, "layers": [{"compute_ms": 1}, {"compute_ms": 1, "flops": 2}]})
    with pytest.raises(PlanError, match="plan says data_degree=3 but its replicas give 2"):
        Plan.from_dict({**plan.to_dict(), "data_degree": 3})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"devices": [{"id": 0, "speed": -1.0}]}, r"devices\[0\].speed must be a finite number > 0"),
        ({"devices": [{"id": 0}, {"id": 0}]}, "device id 0 appears twice"),
        ({"micro_batches": 0}, "micro_batches must be an integer >= 1"),
        ({"layers": []}, "problem has no layers"),
        ({"p2p_ms": math.nan}, "p2p_ms must be a finite number"),
        ({"pipeline_degrees": [0]}, "pipeline_degrees must hold integers >= 1"),
        ({"shared_partition": "yes"}, "shared_partition must be true or false"),
        ({"devices": [{"id": 0, "link_speed": 0.0}]}, r"devices\[0\].link_speed must be a finite number > 0"),
        ({"devices": [{"id": 0}, {"id": 1, "link_speed": -0.5}]}, r"devices\[1\].link_speed must be a finite number > 0"),
        ({"devices": [{"id": 0, "link_speed": math.inf}]}, r"devices\[0\].link_speed must be a finite number > 0"),
        ({"devices": [{"id": 0, "link_speed": math.nan}]}, r"devices\[0\].link_speed must be a finite number > 0"),
        ({"devices": [{"id": 0, "link_speed": True}]}, r"devices\[0\].link_speed must be a finite number > 0"),
        ({"devices": [{"id": 0, "link_speed": "slow"}]}, r"devices\[0\].link_speed must be a finite number > 0"),
    ],
)
def test_malformed_problems_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ProblemError, match=message):
        Problem.from_dict({**DESIGN_EXAMPLE, **change})


def test_even_splits() -> None:
    assert even_bounds(10, 3) == (0, 4, 7, 10)
    assert even_split(10, 4) == (3, 3, 2, 2)
    plan = Plan.uniform(list(range(6)), 7, 3, 5)
    assert [r.devices for r in plan.replicas] == [(0, 1, 2), (3, 4, 5)]
    assert [r.micro_batches for r in plan.replicas] == [3, 2]
    with pytest.raises(PlanError, match="must divide the 6 devices"):
        Plan.uniform(list(range(6)), 7, 4, 5)


# ------------------------------------------------------------------------------------ link speeds
def _slow_link(allreduce_ms: float = 2.0, **kw) -> Problem:
    """4 devices, 8 layers of 2 ms, p2p 1 ms; device 2's links run at a tenth of the speed (u = 10)."""
    return Problem(
        tuple(Layer(2.0, 10.0, 5.0) for _ in range(8)),
        tuple(Device(i, 1.0, link_speed=0.1 if i == 2 else 1.0) for i in range(4)),
        8,
        p2p_ms=1.0,
        allreduce_ms=allreduce_ms,
        **kw,
    )


def test_slow_link_costs_by_hand() -> None:
    problem = _slow_link()
    # Even 2 x 2: device 2 holds stage 0 of replica 1 and pays its send at u = 10: 4 + 1 * 10.
    # Device 3 (stage 1, healthy link) pays nothing extra. The ring includes device 2: 2 ms x 10.
    even = evaluate(problem, Plan.uniform([0, 1, 2, 3], 8, 2, 8))
    assert even.stage_ms == ((5.0 + 4.0, 8.0), (8.0 + 10.0, 8.0))
    assert even.replica_ms == pytest.approx((9 + 8 + 3 * 9, 18 + 8 + 3 * 18))
    assert even.iteration_ms == pytest.approx(80.0 + 20.0)
    # One pipeline of 4, device 2 in the middle: it sends at u (10) and adds u - 1 (9) to what it
    # receives: 4 + 10 + 9. The last stage pays no send; D = 1, so no all-reduce.
    middle = evaluate(problem, Plan((Replica((0, 1, 2, 3), (0, 2, 4, 6, 8), 8),)))
    assert middle.stage_ms == ((5.0, 5.0, 23.0, 4.0),)
    assert middle.iteration_ms == pytest.approx(37.0 + 7 * 23.0)
    # Last: only the extra of its incoming transfer (u - 1 = 9) is its own.
    last = evaluate(problem, Plan((Replica((0, 1, 3, 2), (0, 2, 4, 6, 8), 8),)))
    assert last.stage_ms == ((5.0, 5.0, 5.0, 13.0),)
    # A one-stage replica has no transfers; the all-reduce still runs at device 2's link.
    alone = evaluate(problem, Plan(tuple(Replica((i,), (0, 8), 2) for i in range(4))))
    assert alone.stage_ms == ((16.0,),) * 4
    assert alone.iteration_ms == pytest.approx(32.0 + 20.0)
    # Idling device 2 (allow_exclude): three replicas, the ring at healthy speed.
    excluding = _slow_link(allow_exclude=True)
    without = evaluate(excluding, Plan(tuple(Replica((i,), (0, 8), m) for i, m in ((0, 3), (1, 3), (3, 2)))))
    assert without.iteration_ms == pytest.approx(3 * 16.0 + 2.0)


def test_healthy_and_fast_links_are_the_model_without_link_speeds() -> None:
    from dataclasses import replace

    from resihp_lightning.plan import device_classes, stage_p2p_ms

    problem = _slow_link()
    plan = Plan.uniform([0, 1, 2, 3], 8, 2, 8)
    healthy = problem.healthy()
    assert all(d.link_speed == 1.0 and d.speed == 1.0 for d in healthy.devices)
    # With every link at 1.0 (or faster: priced as 1.0) the stage times are the old formula, bit for bit.
    for links in ([1.0] * 4, [1.0, 2.0, 1.5, 1.0]):
        fast = replace(problem, devices=tuple(replace(d, link_speed=x) for d, x in zip(problem.devices, links)))
        ev = evaluate(fast, plan)
        assert ev.stage_ms == ((8.0 + 1.0, 8.0), (8.0 + 1.0, 8.0))
        assert ev.iteration_ms == 9 + 8 + 3 * 9 + 2.0
        assert len(device_classes(fast)) == 1
    for j, p in ((0, 1), (0, 3), (1, 3), (2, 3)):
        assert stage_p2p_ms(0.3, 1.0, j, p) == (0.3 if j < p - 1 else 0.0)
    # Classes tell slow links apart: healthy first, the slow link after it.
    classes = device_classes(problem)
    assert [(c.ids, c.link_slowdown) for c in classes] == [((0, 1, 3), 1.0), ((2,), 10.0)]


def test_link_speed_json_round_trip() -> None:
    problem = _slow_link()
    data = json.loads(problem.to_json())
    assert [d.get("link_speed") for d in data["devices"]] == [None, None, 0.1, None]  # the default is left out
    assert Problem.from_json(problem.to_json()) == problem
    assert "link_speed" not in Problem.from_dict(DESIGN_EXAMPLE).to_json()


def test_min_data_degree_keeps_every_layer_on_two_devices_in_every_backend():
    """The unconstrained optimum runs one replica (the all-reduce is dear); with
    min_data_degree=2 every backend returns the best plan with two replicas or more, and validate
    refuses a one-replica plan."""
    from resihp_lightning.errors import PlanError
    from resihp_lightning.plan import Device, Layer, Plan, Problem, evaluate, validate
    from resihp_lightning.solver import solve
    from resihp_lightning.config import PlannerConfig

    layers = tuple(Layer(10.0) for _ in range(8))
    devices = tuple(Device(i) for i in range(4))
    free = Problem(layers, devices, micro_batches=8, p2p_ms=1.0, allreduce_ms=500.0, allow_exclude=True)
    two = Problem(layers, devices, micro_batches=8, p2p_ms=1.0, allreduce_ms=500.0, allow_exclude=True, min_data_degree=2)
    unconstrained = solve(free, PlannerConfig(solver="exact"))
    assert unconstrained.data_degree == 1
    with pytest.raises(PlanError, match="min_data_degree is 2"):
        validate(two, unconstrained)
    plans = [solve(two, PlannerConfig(solver=name)) for name in ("exact", "cpsat", "pulp")]
    for plan in plans:
        assert plan.data_degree >= 2 and plan.status == "optimal", plan
        assert plan.iteration_ms == pytest.approx(plans[0].iteration_ms)
        assert evaluate(two, plan).iteration_ms == pytest.approx(plan.iteration_ms)
    assert two.to_dict()["min_data_degree"] == 2 and Problem.from_dict(two.to_dict()) == two
    assert PlannerConfig(min_data_degree=2).apply_to(free).min_data_degree == 2
    with pytest.raises(Exception, match=r"planner.min_data_degree.*integer >= 1"):
        PlannerConfig(min_data_degree=0)
