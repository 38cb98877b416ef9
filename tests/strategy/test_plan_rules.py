"""Which plans a job can run (strategy/plan_rules.py): the checks on a requested plan."""

from __future__ import annotations

import pytest

from resihp_lightning.errors import PlanError
from resihp_lightning.plan import Plan, Replica
from resihp_lightning.strategy.plan_rules import check_plan

PLAIN: dict = {}
ZERO1 = {"zero_optimization": {"stage": 1, "layerwise": False}}  # DeepSpeed's ZeRO-1 wrapper


def test_a_plan_on_every_live_device_with_the_jobs_batch_runs():
    check_plan(Plan.uniform([0, 1, 2, 3], 8, 2, 8), [0, 1, 2, 3], 8, 8, PLAIN)
    check_plan(Plan.uniform([3, 1, 2, 0], 8, 4, 3), (0, 1, 2, 3), 0, None, PLAIN)  # L and M from the plan itself
    with pytest.raises(PlanError, match="global batch is 6"):
        check_plan(Plan.uniform([0, 1, 2, 3], 8, 2, 8), [0, 1, 2, 3], 8, 6, PLAIN)
    with pytest.raises(PlanError, match="bounds"):
        check_plan(Plan.uniform([0, 1, 2, 3], 8, 2, 8), [0, 1, 2, 3], 10, 8, PLAIN)  # the model has 10 layers


def test_per_replica_bounds_run_with_the_plain_optimizer_only():
    uneven = Plan((Replica((0, 1), (0, 3, 8), 4), Replica((2, 3), (0, 5, 8), 4)))
    check_plan(uneven, [0, 1, 2, 3], 8, 8, PLAIN)
    with pytest.raises(PlanError, match="layer-wise engine"):
        check_plan(uneven, [0, 1, 2, 3], 8, 8, ZERO1)
    check_plan(uneven, [0, 1, 2, 3], 8, 8, {"zero_optimization": {"stage": 1}})  # the layer-wise ZeRO-1 runs them


def test_idle_devices_only_with_hot_spares_and_never_a_device_outside_the_job():
    two_of_three = Plan.uniform([0, 2], 8, 1, 4)
    with pytest.raises(PlanError, match="every rank must hold a stage"):
        check_plan(two_of_three, [0, 1, 2], 8, 4, PLAIN)
    check_plan(two_of_three, [0, 1, 2], 8, 4, PLAIN, idle_allowed=True)
    with pytest.raises(PlanError, match=r"devices \[5\]"):
        check_plan(Plan.uniform([0, 5], 8, 1, 4), [0, 1, 2], 8, 4, PLAIN, idle_allowed=True)
