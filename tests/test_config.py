"""Planner options are validated on creation and name the option and what is allowed."""

from __future__ import annotations

import pytest

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import ConfigError
from resihp_lightning.plan import Problem


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"solver": "gurobi"}, r"invalid value 'gurobi' for option `planner.solver`; allowed: 'cpsat', 'pulp', 'exact'"),
        ({"time_limit_s": 0}, r"`planner.time_limit_s`; allowed: a number of seconds > 0"),
        ({"num_workers": 0}, r"`planner.num_workers`"),
        ({"relative_gap": -0.1}, r"`planner.relative_gap`"),
        ({"pulp_engine": "glpk"}, r"`planner.pulp_engine`; allowed: 'cbc', 'highs'"),
        ({"pipeline_degrees": []}, r"`planner.pipeline_degrees`"),
        ({"min_layers_per_stage": 0}, r"`planner.min_layers_per_stage`"),
    ],
)
def test_bad_options_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PlannerConfig(**kwargs)
    assert issubclass(ConfigError, ValueError)


def test_model_options_override_the_problem_only_when_set() -> None:
    problem = Problem.from_dict(
        {"layers": [{"compute_ms": 1.0}] * 4, "devices": [{"id": 0}, {"id": 1}], "micro_batches": 2}
    )
    assert PlannerConfig().apply_to(problem) == problem
    changed = PlannerConfig(shared_partition=False, pipeline_degrees=[2], allow_exclude=True).apply_to(problem)
    assert (changed.shared_partition, changed.pipeline_degrees, changed.allow_exclude) == (False, (2,), True)
    assert changed.layers == problem.layers


def test_callback_options_resolve_from_a_config_or_keywords() -> None:
    from resihp_lightning.config import config_from_options

    given = PlannerConfig(solver="exact")
    assert config_from_options(PlannerConfig, given, {}, "Planner") is given
    assert config_from_options(PlannerConfig, None, {"num_workers": 3}, "Planner").num_workers == 3
    with pytest.raises(TypeError, match="unknown Planner option 'workers'; allowed: .*num_workers"):
        config_from_options(PlannerConfig, None, {"workers": 3}, "Planner")
    with pytest.raises(TypeError, match="not both"):
        config_from_options(PlannerConfig, given, {"num_workers": 3}, "Planner")


def test_search_options_keep_how_to_search_and_drop_the_rules() -> None:
    problem = Problem.from_dict(
        {"layers": [{"compute_ms": 1.0}] * 4, "devices": [{"id": 0}, {"id": 1}], "micro_batches": 2}
    )
    full = PlannerConfig(solver="exact", time_limit_s=3.0, num_workers=1, random_seed=7, relative_gap=0.1,
                         pipeline_degrees=[2], shared_partition=False, allow_exclude=True, min_layers_per_stage=2,
                         min_data_degree=2)
    search = full.search_options()
    assert search == PlannerConfig(solver="exact", time_limit_s=3.0, num_workers=1, random_seed=7, relative_gap=0.1)
    assert search.apply_to(problem) == problem and full.apply_to(problem) != problem
