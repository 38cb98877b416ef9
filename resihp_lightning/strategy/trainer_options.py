"""Lightning ``Trainer`` options under a pipeline: mapped onto DeepSpeed's config, or refused by name.

The pipeline engine runs the forward, backward and optimizer step itself, so Lightning's own
precision plugin, gradient clipping and backward hooks never see them. Rather than ignore those
options silently, :func:`effective_deepspeed_config` turns them into the DeepSpeed entries that do
the same thing (as Lightning's own ``DeepSpeedStrategy`` does for precision), or, for
``precision="bf16-mixed"``, :func:`layerwise_precision` hands it to the layer-wise engine; and
:func:`refuse_unsupported` names what cannot work and what to use instead.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from resihp_lightning.runtime.mixed_precision import BF16_MIXED, MixedPrecision
from resihp_lightning.state.wrapped_state import wraps_optimizer

#: Trainer ``precision`` values and the DeepSpeed section each enables (``None``: nothing to add; fp32,
#: or ``bf16-mixed`` run by the layer-wise engine: see :func:`layerwise_precision`).
PRECISIONS: dict[str, str | None] = {
    "32-true": None,
    "32": None,
    "bf16-mixed": None,
    "bf16-true": "bf16",
}
#: Trainer precisions refused, with the reason and what to use instead.
REFUSED_PRECISIONS: dict[str, str] = {
    p: "the layer-wise engine has no fp16 loss scaling; use precision='bf16-mixed' (bf16 needs none), or DeepSpeed's "
    "fp16 wrapper through deepspeed_config={'fp16': {'enabled': True}} (shared stage bounds, no in-process "
    "recovery, accelerators only)"
    for p in ("16-mixed", "16-true", "16")
}


def _enabled(config: Mapping[str, Any], section: str) -> bool:
    return bool((config.get(section) or {}).get("enabled", False))


def layerwise_precision(deepspeed_config: Mapping[str, Any], precision: str) -> MixedPrecision | None:
    """The mixed precision the layer-wise engine runs for a Trainer ``precision``, or ``None``.

    ``precision="bf16-mixed"`` is bf16 autocast over fp32 parameters and per-parameter optimizer state
    (:mod:`~resihp_lightning.runtime.mixed_precision`), also under the layer-wise ZeRO-1
    (``zero_optimization.stage`` 1, :mod:`~resihp_lightning.state.zero_config`), unless ``deepspeed_config``
    asks for a DeepSpeed optimizer wrapper (``bf16.enabled``, ``fp16.enabled`` or DeepSpeed's ZeRO,
    ``"layerwise": False``): then DeepSpeed's bf16 wrapper runs it, as :func:`effective_deepspeed_config`
    enables it, and this returns ``None``.
    """
    if str(precision) == "bf16-mixed" and not wraps_optimizer(deepspeed_config):
        return BF16_MIXED
    return None


def effective_deepspeed_config(
    deepspeed_config: Mapping[str, Any],
    precision: str,
    gradient_clip_val: float | None,
    gradient_clip_algorithm: str | None,
    error: type[Exception],
) -> dict[str, Any]:
    """The strategy's DeepSpeed entries with the Trainer's precision and gradient clipping folded in.

    ``precision="bf16-mixed"`` adds nothing (the layer-wise engine runs it, :func:`layerwise_precision`)
    unless ``deepspeed_config`` asks for a DeepSpeed optimizer wrapper, whose bf16 mode it then enables;
    ``"bf16-true"`` enables DeepSpeed's bf16 mode; fp16 precisions are refused.

    Args:
        deepspeed_config: ``ResiHPStrategy(deepspeed_config=...)``.
        precision: the Trainer's precision (``trainer.precision``, e.g. ``"bf16-mixed"``).
        gradient_clip_val: ``Trainer(gradient_clip_val)`` (``None`` / 0: off).
        gradient_clip_algorithm: ``Trainer(gradient_clip_algorithm)`` (``"norm"`` or ``"value"``).
        error: the exception to raise (the Lightning package's ``MisconfigurationException``).

    Raises:
        lightning.pytorch.utilities.exceptions.MisconfigurationException: (the type passed as ``error``) an option has no pipeline equivalent, or it
            contradicts ``deepspeed_config``.
    """
    config = copy.deepcopy(dict(deepspeed_config))
    precision = str(precision)
    if precision in REFUSED_PRECISIONS:
        raise error(f"Trainer(precision={precision!r}) is not supported by ResiHPStrategy: {REFUSED_PRECISIONS[precision]}")
    if precision not in PRECISIONS:
        raise error(
            f"Trainer(precision={precision!r}) is not supported by ResiHPStrategy; allowed: "
            f"{', '.join(repr(p) for p in PRECISIONS)}"
        )
    section = PRECISIONS[precision]
    if precision == "bf16-mixed" and wraps_optimizer(config):
        section = "bf16"  # deepspeed_config chose a DeepSpeed wrapper: its bf16 mode runs bf16-mixed
    if section is not None:
        other = "fp16" if section == "bf16" else "bf16"
        if _enabled(config, other):
            raise error(
                f"Trainer(precision={precision!r}) asks for {section} but deepspeed_config enables {other}; "
                "set one of them"
            )
        config[section] = {**(config.get(section) or {}), "enabled": True}
    if gradient_clip_val:
        algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm")
        if algorithm != "norm":
            raise error(
                f"Trainer(gradient_clip_algorithm={algorithm!r}) is not supported by ResiHPStrategy; allowed: "
                "'norm' (clipping by the global gradient norm, the pipeline's gradient_clipping)"
            )
        current = config.get("gradient_clipping")
        if current not in (None, 0, 0.0) and float(current) != float(gradient_clip_val):
            raise error(
                f"Trainer(gradient_clip_val={gradient_clip_val}) contradicts "
                f"deepspeed_config['gradient_clipping']={current}; set one of them"
            )
        config["gradient_clipping"] = float(gradient_clip_val)
    return config


def refuse_unsupported(trainer: Any, strategy: Any, error: type[Exception]) -> None:
    """Raises ``error`` naming a Trainer option that cannot work under the pipeline, and the alternative."""
    if trainer.accumulate_grad_batches != 1:
        raise error(
            "Trainer(accumulate_grad_batches) must be 1 with ResiHPStrategy; the pipeline accumulates over "
            "micro-batches already (set micro_batches / the batch size instead)"
        )
    if not getattr(trainer.lightning_module, "automatic_optimization", True):
        raise error(
            "manual optimization (LightningModule.automatic_optimization = False) is not supported by "
            "ResiHPStrategy: the pipeline engine runs each micro-batch's forward and backward and the "
            "optimizer step itself; configure one optimizer in configure_optimizers instead"
        )
    if getattr(strategy, "_layer_sync", None) is not None:
        raise error(
            "Trainer(sync_batchnorm=True) is not supported by ResiHPStrategy: each layer runs on one stage per "
            "replica; use normalisation layers that do not synchronise (e.g. LayerNorm / RMSNorm)"
        )
