"""The strategy's options, checked by name (``resihp_lightning.strategy.options``)."""

from __future__ import annotations

import pytest

from resihp_lightning.errors import ConfigError
from resihp_lightning.plan import Plan, Replica
from resihp_lightning.strategy.options import StrategyOptions


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"pipeline_degree": 0}, "pipeline_degree"),
        ({"deepspeed_config": {"gradient_accumulation_steps": 2}}, "deepspeed_config.gradient_accumulation_steps"),
        ({"deepspeed_config": {"zero_optimization": {"stage": 2}}}, "deepspeed_config.zero_optimization.stage"),
        ({"process_group_backend": "mpi"}, "process_group_backend"),
    ],
)
def test_options_refuse_bad_values_by_name(kwargs, option):
    with pytest.raises(ConfigError, match=f"`{option}`"):
        StrategyOptions(**kwargs)


def test_options_accept_a_plan_as_json_dict():
    plan = Plan((Replica((0, 1), (0, 2, 4), 2),))
    assert StrategyOptions(plan=plan.to_dict()).plan.layout_key() == plan.layout_key()
