"""Which engine runs ``deepspeed_config={"zero_optimization": {"stage": 1}}``: the layer-wise ZeRO-1 or DeepSpeed's.

DeepSpeed's config name selects ZeRO-1. By default the layer-wise engine runs it
(:mod:`~resihp_lightning.state.zero_shards`): Adam's moments of each layer sharded over the layer's
holders with every slice kept twice, so a lost rank's slice is rebuilt in-process from its copy.
DeepSpeed's own ZeRO wrapper (``DeepSpeedZeroOptimizer``: no in-process recovery, shared stage bounds)
stays reachable with the explicit switch ``"layerwise": False`` inside ``zero_optimization``, and is
what runs when ``deepspeed_config`` enables DeepSpeed's ``bf16`` or ``fp16`` wrapper as well (that
wrapper owns the optimizer then). The switch is this project's key, not DeepSpeed's: it is removed
before DeepSpeed reads the config (:func:`for_deepspeed`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from resihp_lightning.errors import ConfigError, invalid_option

#: The switch inside ``deepspeed_config["zero_optimization"]``: ``True`` (default) layer-wise ZeRO-1, ``False`` DeepSpeed's.
LAYERWISE_KEY = "layerwise"
#: ``zero_optimization`` entries the layer-wise ZeRO-1 cannot honour (DeepSpeed's CPU / NVMe offload).
UNSUPPORTED_KEYS = ("offload_optimizer", "offload_param", "cpu_offload")


def _zero(config: Mapping[str, Any]) -> dict[str, Any]:
    return dict(config.get("zero_optimization") or {})


def _stage(config: Mapping[str, Any]) -> int:
    return int(_zero(config).get("stage", 0) or 0)


def _wrapper_precision(config: Mapping[str, Any]) -> bool:
    return any(bool((config.get(key) or {}).get("enabled", False)) for key in ("bf16", "fp16"))


def layerwise_zero(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` asks for ZeRO-1 run by the layer-wise engine (see the module docstring).

    Raises:
        ConfigError: ``zero_optimization.layerwise`` is not a bool, or is ``True`` together with a
            DeepSpeed ``bf16`` / ``fp16`` wrapper or an offload entry.
    """
    zero = _zero(config)
    switch = zero.get(LAYERWISE_KEY)
    if switch is not None and not isinstance(switch, bool):
        raise invalid_option(f"deepspeed_config.zero_optimization.{LAYERWISE_KEY}", switch, (True, False))
    if _stage(config) != 1 or switch is False:
        return False
    if _wrapper_precision(config):
        if switch:
            raise invalid_option(
                f"deepspeed_config.zero_optimization.{LAYERWISE_KEY}", True,
                "False (or unset) with DeepSpeed's bf16 / fp16 wrapper in deepspeed_config, which owns the optimizer; "
                "for layer-wise ZeRO-1 in bf16 use Trainer(precision='bf16-mixed') without a 'bf16' section",
            )
        return False
    offloads = [key for key in UNSUPPORTED_KEYS if zero.get(key) and (zero[key] is True or (isinstance(zero[key], Mapping)
                and zero[key].get("device", "none") not in (None, "none")))]
    if offloads:
        raise ConfigError(
            f"deepspeed_config.zero_optimization.{offloads[0]} is not supported by the layer-wise ZeRO-1; allowed: no "
            f"offload, or DeepSpeed's ZeRO wrapper with zero_optimization.{LAYERWISE_KEY}=False"
        )
    return True


def deepspeed_runs_zero(config: Mapping[str, Any]) -> bool:
    """Whether DeepSpeed's own ZeRO wrapper runs under ``config`` (stage >= 1 and not :func:`layerwise_zero`)."""
    return _stage(config) >= 1 and not layerwise_zero(config)


def for_deepspeed(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as DeepSpeed must read it: without the ``zero_optimization`` section when the layer-wise
    engine runs ZeRO-1 (DeepSpeed would wrap the optimizer), else without this project's switch (DeepSpeed
    refuses unknown keys there)."""
    out = copy.deepcopy(dict(config))
    if layerwise_zero(config):
        out.pop("zero_optimization", None)
    elif "zero_optimization" in out and isinstance(out["zero_optimization"], Mapping):
        out["zero_optimization"] = {k: v for k, v in out["zero_optimization"].items() if k != LAYERWISE_KEY}
    return out
