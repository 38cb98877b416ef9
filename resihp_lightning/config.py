"""Configuration dataclasses (YAML / LightningCLI friendly: plain fields, validated on creation)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from resihp_lightning.errors import ConfigError, invalid_option
from resihp_lightning.plan import Problem

T = TypeVar("T")

SOLVERS = ("cpsat", "pulp", "exact")
PULP_ENGINES = ("cbc", "highs")


@dataclass(frozen=True)
class PlannerConfig:
    """Options of the planner.

    The one place for them: ``resihp plan`` reads them from the command line, and a training job
    gives them to :class:`~resihp_lightning.callbacks.replan.replan_controller.ReplanController` (``planner=...``).

    Attributes:
        solver: backend: ``"cpsat"`` (OR-Tools CP-SAT MILP, default), ``"pulp"`` (the same MILP through
            PuLP) or ``"exact"`` (the combinatorial algorithm; also the warm start and fallback).
        time_limit_s: wall-clock limit of one solve, seconds (> 0). When the MILP stops at the limit the
            best of its incumbent and the exact algorithm's plan is returned, status ``"feasible"``.
        num_workers: CP-SAT search workers (>= 1); capped so the solver does not take every core of a
            training node.
        random_seed: seed of the solver's search (deterministic with the same seed and workers).
        relative_gap: stop when the incumbent is proven within this fraction of the optimum (>= 0);
            0 asks for a proven optimum.
        pulp_engine: MILP engine for ``solver="pulp"``: ``"cbc"`` (bundled) or ``"highs"`` (needs
            ``highspy``).
        pipeline_degrees: allowed pipeline degrees; ``None`` keeps the problem's (default: all that fit).
        shared_partition: ``True`` forces one stage partition for every replica (stock DeepSpeed),
            ``False`` allows per-replica partitions. ``None`` keeps the problem's: for the
            re-planning controller that is what the strategy can run (per-replica partitions when
            ``strategy.supports_per_replica_bounds``, i.e. the plain fp32 optimizer; else shared).
        allow_exclude: ``None`` keeps the problem's; ``True`` lets the plan leave devices unused.
        min_layers_per_stage: ``None`` keeps the problem's; otherwise the fewest layers per stage (>= 1).
        min_data_degree: ``None`` keeps the problem's (1); otherwise the fewest replicas a plan may
            have (>= 1). With ``ResiHPStrategy(fail_stop=...)`` set 2: a plan with one replica holds
            each layer on one device only, so any later death loses layers and the job must restart
            from a checkpoint instead of recovering in process.
    """

    solver: str = "cpsat"
    time_limit_s: float = 10.0
    num_workers: int = 2
    random_seed: int = 0
    relative_gap: float = 0.0
    pulp_engine: str = "cbc"
    pipeline_degrees: tuple[int, ...] | None = None
    shared_partition: bool | None = None
    allow_exclude: bool | None = None
    min_layers_per_stage: int | None = None
    min_data_degree: int | None = None

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise invalid_option("planner.solver", self.solver, SOLVERS)
        if self.pulp_engine not in PULP_ENGINES:
            raise invalid_option("planner.pulp_engine", self.pulp_engine, PULP_ENGINES)
        if not isinstance(self.time_limit_s, (int, float)) or not self.time_limit_s > 0:
            raise invalid_option("planner.time_limit_s", self.time_limit_s, "a number of seconds > 0")
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise invalid_option("planner.num_workers", self.num_workers, "an integer >= 1")
        if not isinstance(self.random_seed, int):
            raise invalid_option("planner.random_seed", self.random_seed, "an integer")
        if not isinstance(self.relative_gap, (int, float)) or self.relative_gap < 0:
            raise invalid_option("planner.relative_gap", self.relative_gap, "a number >= 0")
        if self.pipeline_degrees is not None:
            object.__setattr__(self, "pipeline_degrees", tuple(self.pipeline_degrees))
            if not self.pipeline_degrees or any(not isinstance(p, int) or p < 1 for p in self.pipeline_degrees):
                raise invalid_option("planner.pipeline_degrees", self.pipeline_degrees, "a non-empty list of integers >= 1")
        for name in ("shared_partition", "allow_exclude"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise invalid_option(f"planner.{name}", getattr(self, name), "true, false or null")
        if self.min_layers_per_stage is not None and (
            not isinstance(self.min_layers_per_stage, int) or self.min_layers_per_stage < 1
        ):
            raise invalid_option("planner.min_layers_per_stage", self.min_layers_per_stage, "an integer >= 1")
        if self.min_data_degree is not None and (
            not isinstance(self.min_data_degree, int) or isinstance(self.min_data_degree, bool) or self.min_data_degree < 1
        ):
            raise invalid_option("planner.min_data_degree", self.min_data_degree, "null or an integer >= 1")

    def apply_to(self, problem: Problem) -> Problem:
        """The problem with this config's model options (those not ``None``) written over its own."""
        changes = {name: getattr(self, name) for name in MODEL_OPTIONS if getattr(self, name) is not None}
        return replace(problem, **changes) if changes else problem

    def search_options(self) -> PlannerConfig:
        """This config without its model options: how to search, not what to plan.

        ``solve`` writes a config's model options over the problem it is given; a caller that built
        the problem with them already and then relaxes a rule on purpose (the survivors' plan drops
        ``min_data_degree`` where no plan keeps it) solves with this.
        """
        return replace(self, **{name: None for name in MODEL_OPTIONS})


#: The options of :class:`PlannerConfig` that are rules of the problem (:meth:`PlannerConfig.apply_to`).
MODEL_OPTIONS = ("pipeline_degrees", "shared_partition", "allow_exclude", "min_layers_per_stage", "min_data_degree")


#: Options that moved to another section: ``"section.option"`` -> where it lives now.
MOVED_OPTIONS = {
    "controller.shared_partition": "planner.shared_partition",
}


def moved_option(key: str) -> ConfigError | None:
    """The error for an option that moved to another section (``None`` when ``key`` did not move).

    Args:
        key: ``"section.option"`` as the user spelled it (``"controller.shared_partition"``).
    """
    new = MOVED_OPTIONS.get(key)
    if new is None:
        return None
    return ConfigError(f"option `{key}` was removed; use `{new}` instead (the planner's options are all in "
                       f"PlannerConfig, given to ReplanController(planner=...))")


def config_from_dict(cls: type[T], data: T | Mapping[str, Any], section: str) -> T:
    """A config dataclass from itself or a mapping (e.g. YAML), refusing unknown keys by name.

    Args:
        cls: the config dataclass.
        data: an instance of ``cls`` (returned as is) or a mapping of its fields.
        section: the section's name for messages (``"controller"``).

    Raises:
        ConfigError: ``data`` is neither, or has a key that is not a field (a moved option says where
            it lives now).
    """
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"`{section}` must be a {cls.__name__} or a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    for key in sorted(set(data) - known):
        raise moved_option(f"{section}.{key}") or ConfigError(
            f"unknown option `{section}.{key}`; allowed: {', '.join(sorted(known))}")
    return cls(**data)


def config_from_options(cls: type[T], config: T | None, options: Mapping[str, Any], owner: str) -> T:
    """The config a callback runs with: ``config`` as given, or ``cls(**options)``.

    Callbacks accept either a config dataclass or its fields as keyword arguments; this refuses a mix
    of both and names an unknown option together with the allowed ones.

    Args:
        cls: the config dataclass.
        config: the config passed by the user, if any.
        options: keyword arguments passed instead.
        owner: the callback's name, for messages.
    """
    if config is not None and options:
        raise TypeError(f"pass either a config or {owner} options as keywords, not both")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown {owner} option {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
    return config if config is not None else cls(**options)


@dataclass
class ScratchModelConfig:
    """Shape of a model trained from scratch (used when no checkpoint directory is given).

    Read by :class:`~resihp_lightning.models.lightning_module.CausalLMPipelineModule`; kept here, free of torch and
    transformers, so that configuration files are parsed before those heavy imports.

    Attributes:
        model_type: ``"llama"`` or ``"qwen2"`` (Qwen2 adds biases to the q / k / v projections).
        vocab_size: tokens in the vocabulary; the default, 260, covers the byte-level fallback tokenizer.
        hidden_size: width of the residual stream (a multiple of ``num_attention_heads``).
        num_hidden_layers: decoder layers (each one pipeline layer; the embedding and the head are two more).
        num_attention_heads: query heads per layer.
        num_key_value_heads: key / value heads (grouped-query attention; divides ``num_attention_heads``).
        intermediate_size: width of the MLP's gate / up projections.
        max_position_embeddings: the longest sequence the rotary embedding is set up for.
        tie_word_embeddings: share one matrix between the input embedding and the LM head.
    """

    model_type: str = "llama"
    vocab_size: int = 260
    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
