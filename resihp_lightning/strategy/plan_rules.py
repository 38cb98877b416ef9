"""Which plans a job can run: the initial plan from the options, and the checks on a requested plan."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from resihp_lightning.errors import ConfigError, PlanError
from resihp_lightning.placement import same_layout
from resihp_lightning.plan import Layer, Plan, even_split, validate
from resihp_lightning.problem_builder import problem_from_costs
from resihp_lightning.strategy.options import StrategyOptions
from resihp_lightning.state.wrapped_state import wrapped_config_reason, wraps_optimizer


def check_plan(
    plan: Any,
    devices: Sequence[int],
    num_layers: int,
    micro_batches: int | None,
    deepspeed_config: Mapping[str, Any],
    current: Plan | None = None,
    idle_allowed: bool = False,
) -> None:
    """Raises :class:`~resihp_lightning.errors.PlanError` when ``plan`` cannot run on the job.

    Args:
        plan: the candidate.
        devices: the job's live devices (original ranks); every one must hold a stage unless
            ``idle_allowed``.
        num_layers: L (0 before the model is known: then the plan's own bounds count).
        micro_batches: M, when known; the plan's per-replica counts must add up to it.
        deepspeed_config: the strategy's DeepSpeed entries (some configurations cannot move layers).
        current: the plan in force, if any.
        idle_allowed: the plan may leave live devices idle (hot spares: fail-stop recovery on).
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"request_plan needs a resihp_lightning.plan.Plan, got {type(plan).__name__}")
    if not plan.replicas:
        raise PlanError("plan has no replicas")
    world = len(devices)
    used = plan.pipeline_degree * plan.data_degree
    outside = sorted(set(plan.device_ids) - set(devices))
    if idle_allowed and outside:
        raise PlanError(f"plan uses devices {outside}, which are not live processes of the job {sorted(devices)}")
    if not idle_allowed and used != world:
        raise PlanError(
            f"plan uses P x D = {plan.pipeline_degree} x {plan.data_degree} = {used} ranks but the job has "
            f"{world}; every rank must hold a stage (plans that leave devices idle need fail_stop and the plain "
            "fp32 optimizer)"
        )
    if not plan.shared_bounds and wraps_optimizer(deepspeed_config):
        raise PlanError(
            "replicas have different stage bounds, which needs the layer-wise engine (no DeepSpeed ZeRO / bf16 / fp16 "
            "wrapper in deepspeed_config; zero_optimization.stage=1 without layerwise=False runs there)"
        )
    total = micro_batches if micro_batches is not None else sum(r.micro_batches for r in plan.replicas)
    # The job's shape only: costs and speeds do not decide whether a plan can run. Per-replica bounds are
    # allowed here and refused above for the configurations that cannot run them.
    layers = [Layer(0.0)] * (num_layers or max(plan.replicas[0].bounds))
    problem = problem_from_costs(layers, devices, total, per_replica_bounds=True, allow_exclude=idle_allowed)
    validate(problem, plan, check_memory=False)
    reason = wrapped_config_reason(deepspeed_config)
    if current is not None and reason is not None and not same_layout(current, plan):
        raise PlanError(f"moving layers is not supported with {reason}; only per-replica micro-batch counts can change")


def initial_plan(options: StrategyOptions, world: int, num_layers: int) -> Plan:
    """The plan the job starts with: ``options.plan`` (checked) or a uniform P x D plan over ``world``
    devices (with tensor parallelism: the groups).

    Raises:
        PlanError: ``options.plan`` does not fit the job.
        ConfigError: ``pipeline_degree`` or ``micro_batches`` does not fit the job.
    """
    if options.plan is not None:
        check_plan(options.plan, range(world), num_layers, options.micro_batches, options.deepspeed_config)
        return options.plan
    p = options.pipeline_degree
    if p is None:
        p = 2 if world > 2 and world % 2 == 0 and num_layers >= 2 else 1
    if world % p or p > num_layers:
        devices = (f"the {world} tensor-parallel groups (world size / tensor_degree {options.tensor_degree})"
                   if options.tensor_degree > 1 else f"the world size {world}")
        raise ConfigError(
            f"invalid value {p!r} for option `pipeline_degree`; allowed: a divisor of {devices} "
            f"that is at most the {num_layers} layers"
        )
    d = world // p
    total = options.micro_batches if options.micro_batches is not None else d
    if total < d:
        raise ConfigError(f"invalid value {total!r} for option `micro_batches`; allowed: at least D = {d}")
    return Plan.uniform(list(range(world)), num_layers, p, total)


def settle_micro_batches(rows: int, micro_batch_size: int, micro_batches: int | None, fixed: bool, plan: Plan) -> Plan | None:
    """Checks a training batch of ``rows`` rows; returns the plan with M settled, when it changes.

    Args:
        rows: the batch's rows.
        micro_batch_size: rows per micro-batch.
        micro_batches: M as known so far (``None``: not yet).
        fixed: M is fixed (by the options or an earlier batch): the batch must have exactly M.
        plan: the plan in force.

    Returns:
        ``None`` when the plan already deals out the batch's micro-batches; else ``plan`` with them
        split evenly over its replicas (the first batch of a job whose M was left open).

    Raises:
        ConfigError: the batch does not fit (naming the DataLoader setting to change).
    """
    if rows % micro_batch_size:
        raise ConfigError(f"a training batch has {rows} rows, not a multiple of micro_batch_size={micro_batch_size}")
    count = rows // micro_batch_size
    if fixed:
        if count != micro_batches:
            raise ConfigError(
                f"a training batch has {rows} rows = {count} micro-batches of {micro_batch_size}, but the job runs "
                f"M={micro_batches} per step (set drop_last=True on the DataLoader, or micro_batches)"
            )
        return None
    if count == micro_batches and sum(r.micro_batches for r in plan.replicas) == count:
        return None
    if count < plan.data_degree:
        raise ConfigError(f"a training batch of {count} micro-batches cannot feed D={plan.data_degree} replicas")
    counts = even_split(count, plan.data_degree)
    return Plan(tuple(replace(r, micro_batches=c) for r, c in zip(plan.replicas, counts)))
