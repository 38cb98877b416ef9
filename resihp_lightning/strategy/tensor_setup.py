"""Setting up a job with ``tensor_degree`` > 1: what it needs, and its tensor-parallel groups."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from resihp_lightning.errors import ConfigError
from resihp_lightning.strategy.module import ResiHPModuleMixin
from resihp_lightning.tensor.tensor_groups import TensorGroups, TensorParallelism, tensor_parallelism

#: The module hooks tensor parallelism needs (the contract's defaults refuse).
TENSOR_HOOKS = ("pipeline_split_layer", "pipeline_tensor_parallel_loss")
#: ... and the one ``trainer.predict`` needs.
PREDICT_HOOK = "pipeline_tensor_parallel_outputs"


def check_tensor_parallel_job(
    degree: int,
    module: Any,
    deepspeed_config: Mapping[str, Any],
    predicting: bool,
    error: type[Exception],
) -> None:
    """Checks that a job can run with ``tensor_degree=degree`` (> 1); every rank, at every setup.

    Args:
        degree: t > 1.
        module: the LightningModule.
        deepspeed_config: the engines' effective DeepSpeed config (Lightning's precision included).
        predicting: the job runs ``trainer.predict`` (the module must join split outputs).
        error: the exception type to raise (the Lightning package's ``MisconfigurationException``).

    Raises:
        lightning.pytorch.utilities.exceptions.MisconfigurationException: (the type passed as ``error``) the module lacks a hook, or a precision
            is not supported with tensor parallelism yet.
    """
    hooks = (*TENSOR_HOOKS, PREDICT_HOOK) if predicting else TENSOR_HOOKS
    missing = [hook for hook in hooks if getattr(type(module), hook, None) is getattr(ResiHPModuleMixin, hook)]
    if missing:
        raise error(
            f"ResiHPStrategy(tensor_degree={degree}) needs {type(module).__name__} to define {' and '.join(missing)} "
            "(how a layer splits over a tensor-parallel group, the loss on split outputs and, for trainer.predict, "
            "the whole outputs from split ones; CausalLMPipelineModule defines them)"
        )
    for key in ("bf16", "fp16"):
        if (deepspeed_config.get(key) or {}).get("enabled"):
            raise error(
                f"ResiHPStrategy(tensor_degree={degree}) needs the plain fp32 optimizer for now; the precision turns "
                f"on DeepSpeed's {key} mode (use Trainer(precision='32-true'))"
            )


def create_tensor_groups(degree: int, rank: int, world_size: int, module: Any, error: type[Exception]) -> TensorParallelism:
    """The job's tensor-parallel groups (collective: every rank creates every group, once per job).

    Raises:
        lightning.pytorch.utilities.exceptions.MisconfigurationException: (the type passed as ``error``) ``degree``
            does not divide the world size.
    """
    try:
        groups = TensorGroups.consecutive(degree, world_size)
    except ConfigError as err:
        raise error(str(err)) from None
    parallelism = tensor_parallelism(groups, rank, module.pipeline_split_layer)
    assert parallelism is not None  # consecutive groups cover the world
    return parallelism


def check_tensor_groups(
    groups: TensorGroups, tensor_degree: int, world_size: int, allowed: Sequence[int] | None = None
) -> None:
    """Checks requested tensor-parallel groups against the job (a re-split: ``request_plan(tensor_groups=...)``).

    Args:
        groups: the requested groups.
        tensor_degree: the job's ``tensor_degree`` option.
        world_size: the job's processes.
        allowed: the degrees the module's layers split over (``None``: unknown).

    Raises:
        ConfigError: the job has no tensor parallelism, the groups do not hold every process exactly once,
            or a group's degree is not in ``allowed``.
    """
    if tensor_degree <= 1:
        raise ConfigError(
            "request_plan(tensor_groups=...) re-splits layers over new tensor-parallel groups; this job has none "
            "(ResiHPStrategy(tensor_degree=1))"
        )
    if sorted(groups.ranks) != list(range(world_size)):
        raise ConfigError(
            f"tensor_groups {[list(g) for g in groups.members]} must hold every rank 0..{world_size - 1} exactly once "
            "(spares under tensor parallelism are not supported yet)"
        )
    refused = sorted(set(groups.degrees) - set(allowed)) if allowed is not None else []
    if refused:
        raise ConfigError(
            f"tensor_groups of degree {refused}: the module's layers split over degrees {sorted(allowed)} only "
            "(pipeline_tensor_parallel_degrees: whole heads and key-value heads, equal MLP and vocabulary parts)"
        )
