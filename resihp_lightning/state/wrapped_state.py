"""Per-parameter optimizer state under DeepSpeed's optimizer wrappers (ZeRO-1, bf16), for layer moves.

(``Trainer(precision="bf16-mixed")`` does not come here unless ``deepspeed_config`` asks for a wrapper:
the layer-wise engine runs it over fp32 parameters, :mod:`~resihp_lightning.runtime.mixed_precision`.)

With ZeRO stage 1 or ``bf16`` DeepSpeed wraps the user's optimizer (``DeepSpeedZeroOptimizer`` /
``BF16_Optimizer``): the fp32 master weights and the optimizer's moments live in one flat partition
per parameter group and data-parallel rank, and the user's optimizer only sees those flat tensors.
This module turns that into the per-parameter shape that :func:`~resihp_lightning.state.migration.migrate`
carries (``{"<layer>.<name>": {"fp32_param": T, "exp_avg": T, "exp_avg_sq": T, "step": t, ...}}``)
and back, through DeepSpeed's public accessors ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` / ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``.

Order of a layer move: :func:`export_state` on the old engine (collective, see there),
:func:`release` and destroy the old engine, build the new module and cast incoming layers with
:func:`cast_parameters`, migrate, build the new engine, :func:`import_state` (local) and
:func:`import_scaler`.

Cost: while a move is applied every rank holds the full fp32 master value and moments of all its
layers (12 bytes per parameter with Adam, where ZeRO-1 keeps 12 / D), because DeepSpeed's accessors
work on full tensors.

The plain fp32 optimizer (no wrapper) keeps using ``optimizer.state`` directly; :func:`is_wrapped`
tells the two apart. Not supported: ``FP16_Optimizer`` (fp16 without ZeRO keeps no per-parameter
link), ZeRO stage 2/3 (refused by DeepSpeed's pipeline engine anyway) and ZeRO CPU offload.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from resihp_lightning.errors import ConfigError
from resihp_lightning.state.zero_config import deepspeed_runs_zero

#: Key of the full fp32 master value in a parameter's exported state.
MASTER = "fp32_param"
#: Key listing which entries are partitioned like the master weights (the rest are per-group scalars).
PARTITIONED = "partitioned"
#: Loss-scaler fields carried by :func:`export_scaler` (those a scaler has).
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def wrapped_config_reason(config: Mapping[str, Any]) -> str | None:
    """Why a DeepSpeed config's optimizer state cannot move between ranks, or ``None`` when it can.

    The plain fp32 optimizer, ZeRO-1 (fp32 or bf16) and bf16 without ZeRO can move. fp16 is refused:
    ``FP16_Optimizer`` (no ZeRO) has no per-parameter accessors, and fp16 with ZeRO-1 shares ZeRO's code
    path but DeepSpeed runs fp16 only on accelerators, so it has not been verified. CPU offload and
    ZeRO-2/3 are not handled.
    """
    zero = dict(config.get("zero_optimization") or {})
    stage = int(zero.get("stage", 0) or 0)
    fp16 = bool((config.get("fp16") or {}).get("enabled", False))
    if stage > 1:
        return f"ZeRO stage {stage} (only stages 0 and 1 run with a pipeline)"
    offload = zero.get("offload_optimizer") or {}
    if zero.get("cpu_offload") or offload.get("device", "none") not in (None, "none"):
        return "ZeRO optimizer offload"
    if fp16 and stage == 0:
        return "fp16 without ZeRO (DeepSpeed's FP16_Optimizer keeps no per-parameter state link)"
    if fp16:
        # DeepSpeed runs fp16 only on accelerators; nothing here has verified this path yet.
        return "fp16 (not verified: DeepSpeed refuses fp16 on CPU, where this project is tested; use bf16)"
    return None


def is_wrapped(engine: Any) -> bool:
    """Whether ``engine`` steps a DeepSpeed wrapper instead of the user's optimizer itself."""
    optimizer = getattr(engine, "optimizer", None)
    return optimizer is not None and optimizer is not getattr(engine, "basic_optimizer", None)


def _lp_groups(wrapper: Any) -> list[list[nn.Parameter]]:
    """The wrapper's model parameters per group (``bit16_groups`` of ZeRO, ``bf16_groups`` of BF16)."""
    for name in ("bit16_groups", "bf16_groups"):
        groups = getattr(wrapper, name, None)
        if groups is not None:
            return groups
    raise ConfigError(
        f"layer moves are not supported with DeepSpeed's {type(wrapper).__name__}; allowed: the plain optimizer, "
        "ZeRO stage 1 (fp32, bf16 or fp16) and bf16 without ZeRO"
    )


def _checked_wrapper(engine: Any) -> Any:
    if not is_wrapped(engine):
        raise ValueError("the engine's optimizer is not a DeepSpeed wrapper; use optimizer.state directly")
    wrapper = engine.optimizer
    if getattr(wrapper, "cpu_offload", False):
        raise ConfigError("layer moves are not supported with ZeRO optimizer offload; allowed: offload disabled")
    _lp_groups(wrapper)
    return wrapper


def _group_index(wrapper: Any) -> dict[int, int]:
    return {id(p): i for i, group in enumerate(_lp_groups(wrapper)) for p in group}


def _flat(wrapper: Any, group: int) -> Tensor:
    """The flat fp32 partition that the user's optimizer steps for ``group`` on this rank."""
    return wrapper.optimizer.param_groups[group]["params"][0]


def export_state(engine: Any, params: Mapping[str, nn.Parameter]) -> dict[str, dict[str, Any]]:
    """The full fp32 master value and optimizer state of each of ``params``, by key.

    Collective over the data-parallel group of ``engine`` (DeepSpeed assembles each full tensor with an
    all-reduce): every rank of a stage must call it with the same keys (the same layers), before the
    engine's process groups are destroyed. Parameters the wrapper does not train are left out.

    Args:
        engine: a live ``PipelineEngine`` whose optimizer is a ZeRO-1 or BF16 wrapper.
        params: this rank's parameters by stable key (``"<layer>.<name>"``), in the same order on every
            rank of the stage.

    Returns:
        key -> ``{MASTER: fp32 tensor, <state key>: fp32 tensor (e.g. exp_avg), <scalar key>: value
        (e.g. step), PARTITIONED: tuple of the tensor state keys}``; tensors are new, on the engine's
        device, shaped like the parameter. Before the first optimizer step there is no optimizer state
        and only ``MASTER`` (and an empty ``PARTITIONED``) is returned.
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    wrapper = _checked_wrapper(engine)
    group_of = _group_index(wrapper)
    out: dict[str, dict[str, Any]] = {}
    for key, param in params.items():
        group = group_of.get(id(param))
        if group is None:
            continue
        flat = _flat(wrapper, group)
        flat_state = wrapper.optimizer.state.get(flat, {})
        partitioned = tuple(sorted(k for k, v in flat_state.items() if torch.is_tensor(v) and v.shape == flat.shape))
        entry: dict[str, Any] = {MASTER: safe_get_full_fp32_param(param), PARTITIONED: partitioned}
        for name in partitioned:
            entry[name] = safe_get_full_optimizer_state(param, name)
        for name, value in flat_state.items():
            if name not in partitioned:
                entry[name] = value.detach().clone() if torch.is_tensor(value) else value
        out[key] = entry
    return out


def master_values(engine: Any, params: Mapping[str, nn.Parameter]) -> dict[str, Tensor]:
    """Each parameter's full fp32 master value (the parameter itself when the wrapper does not train it).

    Collective over the data-parallel group of ``engine``, like :func:`export_state`.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    group_of = _group_index(_checked_wrapper(engine))
    return {
        key: safe_get_full_fp32_param(param) if id(param) in group_of else param.detach()
        for key, param in params.items()
    }


def import_state(engine: Any, params: Mapping[str, nn.Parameter], state: Mapping[str, Mapping[str, Any]]) -> None:
    """Writes exported per-parameter state into a freshly built engine (local: no communication).

    For each key in both ``params`` and ``state`` the fp32 master value is written (and the model
    parameter is set to it, cast to its dtype, exactly as DeepSpeed does after a step); when state
    entries are present the user's optimizer gets state for the wrapper's flat partitions (zeros, then
    every parameter's slice) and is linked to the parameters as DeepSpeed links it after its first
    step. Every rank of a stage must import the full state of all the stage's parameters, since each
    keeps only its own partition. One flat partition has one ``step``: a parameter without state in a
    group whose other parameters have some starts from zero moments at that step (the plain optimizer
    would start it at step 0); after the first step every trained parameter has state, so a move never
    produces this mix.

    Raises:
        ValueError: parameters of one group carry different scalar state (e.g. ``step``) or different
            state keys, which one flat partition cannot represent.
    """
    from deepspeed.utils import (
        lazy_init_hp_params_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    wrapper = _checked_wrapper(engine)
    group_of = _group_index(wrapper)
    lp_groups = _lp_groups(wrapper)
    members: dict[int, list[tuple[nn.Parameter, Mapping[str, Any]]]] = {}
    for key, param in params.items():
        group = group_of.get(id(param))
        if group is not None and key in state:
            members.setdefault(group, []).append((param, state[key]))
    inner = wrapper.optimizer
    for group, entries in members.items():
        partitioned = {tuple(entry.get(PARTITIONED, ())) for _, entry in entries}
        if len(partitioned) != 1:
            raise ValueError(f"parameter group {group}: parameters carry different optimizer state keys {sorted(partitioned)}")
        keys = partitioned.pop()
        scalars = [{k: v for k, v in entry.items() if k not in keys and k not in (MASTER, PARTITIONED)} for _, entry in entries]
        if any(not _same_scalars(scalars[0], other) for other in scalars[1:]):
            raise ValueError(f"parameter group {group}: parameters carry different scalar optimizer state")
        flat = _flat(wrapper, group)
        if keys:
            fresh: dict[str, Any] = {k: torch.zeros_like(flat) for k in keys}
            fresh.update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars[0].items()})
            inner.state[flat] = fresh
            lazy_init_hp_params_optimizer_state(lp_groups[group], flat, inner.state)
        with torch.no_grad():
            for param, entry in entries:
                master = entry[MASTER].to(device=flat.device, dtype=torch.float32)
                safe_set_full_fp32_param(param, master)
                param.data.copy_(master.to(param.dtype))
                for name in keys:
                    safe_set_full_optimizer_state(param, entry[name].to(device=flat.device, dtype=flat.dtype), name)


def _same_scalars(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if torch.is_tensor(x) or torch.is_tensor(y):
            if not (torch.is_tensor(x) and torch.is_tensor(y) and torch.equal(x.cpu(), y.cpu())):
                return False
        elif x != y:
            return False
    return True


def export_scaler(engine: Any) -> dict[str, Any]:
    """The wrapper's loss-scaler state (the same on every rank; empty without a wrapper)."""
    scaler = getattr(getattr(engine, "optimizer", None), "loss_scaler", None) if is_wrapped(engine) else None
    return {name: getattr(scaler, name) for name in _SCALER_FIELDS if scaler is not None and hasattr(scaler, name)}


def import_scaler(engine: Any, state: Mapping[str, Any]) -> None:
    """Restores :func:`export_scaler`'s result into a new engine's wrapper (dynamic fp16 loss scale)."""
    scaler = getattr(engine.optimizer, "loss_scaler", None) if is_wrapped(engine) else None
    for name, value in state.items():
        if scaler is not None and hasattr(scaler, name):
            setattr(scaler, name, value)


def release(engine: Any) -> None:
    """Detaches the wrapper from the module's parameters: removes its gradient hooks and hp links.

    Needed before the parameters are reused by another engine; otherwise the old wrapper's hooks keep
    firing on backward (measured with bf16 ``immediate_grad_update``: wrong losses). ``destroy_engine``
    should call this. A no-op without a wrapper or when called again.
    """
    wrapper = getattr(engine, "optimizer", None)
    if is_wrapped(engine) and hasattr(wrapper, "destroy") and not getattr(wrapper, "_resihp_released", False):
        wrapper.destroy()
        wrapper._resihp_released = True


def wraps_optimizer(config: Mapping[str, Any]) -> bool:
    """Whether DeepSpeed wraps the optimizer under ``config`` (its ZeRO, bf16 or fp16). ZeRO stage 1 is the
    layer-wise engine's unless ``zero_optimization.layerwise`` is false (:mod:`~resihp_lightning.state.zero_config`)."""
    return deepspeed_runs_zero(config) or engine_param_dtype(config) != torch.float32


def engine_param_dtype(config: Mapping[str, Any]) -> torch.dtype:
    """The dtype DeepSpeed gives model parameters under ``config`` (bf16 / fp16 / fp32)."""
    if (config.get("bf16") or {}).get("enabled", False):
        return torch.bfloat16
    if (config.get("fp16") or {}).get("enabled", False):
        return torch.float16
    return torch.float32


def cast_parameters(layers: Iterable[nn.Module], dtype: torch.dtype) -> None:
    """Casts the parameters (not the buffers, as DeepSpeed) of freshly built layers to ``dtype``.

    Call on layers that will receive migrated values, before receiving: the sender's parameters already
    have the engine's dtype and point-to-point receives need matching buffers.
    """
    for layer in layers:
        for param in layer.parameters():
            if param.dtype != dtype and param.is_floating_point():
                param.data = param.data.to(dtype)


def set_masters(engine: Any, params: Mapping[str, nn.Parameter]) -> None:
    """Sets the wrapper's fp32 master value of each of ``params`` from the parameter itself (local).

    After new values are written into the model's parameters (e.g. a checkpoint's weights) the
    wrapper would otherwise step from its stale master copy and overwrite them.
    """
    from deepspeed.utils import safe_set_full_fp32_param

    group_of = _group_index(_checked_wrapper(engine))
    with torch.no_grad():
        for param in params.values():
            if id(param) in group_of:
                safe_set_full_fp32_param(param, param.detach().float())


def as_wrapped_entry(entry: Mapping[str, Any], param: nn.Parameter) -> dict[str, Any]:
    """A saved per-parameter state in :func:`export_state`'s shape (a plain optimizer's state gets the
    parameter's value as its master and its parameter-shaped tensors as the partitioned entries)."""
    if MASTER in entry:
        return dict(entry)
    out = dict(entry)
    out[MASTER] = param.detach().float()
    out[PARTITIONED] = tuple(sorted(k for k, v in entry.items() if torch.is_tensor(v) and v.shape == param.shape))
    return out


def as_plain_entry(entry: Mapping[str, Any]) -> tuple[dict[str, Any], Tensor | None]:
    """A saved per-parameter state for the plain optimizer, and the fp32 master value if it had one."""
    return {k: v for k, v in entry.items() if k not in (MASTER, PARTITIONED)}, entry.get(MASTER)


def state_bytes_per_element(engine: Any) -> float:
    """Bytes of wrapper-held state (fp32 masters and optimizer tensors) per trained model element here.

    The wrapper keeps them in flat partitions (1 / D of each group under ZeRO-1), so this is this
    rank's actual memory for them spread evenly over its trained parameters.
    """
    wrapper = _checked_wrapper(engine)
    held = 0
    for group in range(len(_lp_groups(wrapper))):
        flat = _flat(wrapper, group)
        held += flat.numel() * flat.element_size()
        held += sum(v.numel() * v.element_size() for v in wrapper.optimizer.state.get(flat, {}).values() if torch.is_tensor(v))
    elements = sum(p.numel() for group in _lp_groups(wrapper) for p in group)
    return held / elements if elements else 0.0
