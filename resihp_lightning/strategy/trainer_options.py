"""Lightning ``Trainer`` options under a pipeline: mapped onto DeepSpeed's config, or refused by name.

The pipeline engine runs the forward, backward and optimizer step itself, so Lightning's own
precision plugin, gradient clipping and backward hooks never see them. Rather than ignore those
options silently, :func:`effective_deepspeed_config` turns them into the DeepSpeed entries that do
the same thing (as Lightning's own ``DeepSpeedStrategy`` does for precision), and
:func:`refuse_unsupported` names what cannot work and what to use instead.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

#: Trainer ``precision`` values and the DeepSpeed section each enables (``None``: fp32, nothing to add).
PRECISIONS: dict[str, str | None] = {
    "32-true": None,
    "32": None,
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "fp16",
    "16-true": "fp16",
}


def _enabled(config: Mapping[str, Any], section: str) -> bool:
    return bool((config.get(section) or {}).get("enabled", False))


def effective_deepspeed_config(
    deepspeed_config: Mapping[str, Any],
    precision: str,
    gradient_clip_val: float | None,
    gradient_clip_algorithm: str | None,
    error: type[Exception],
) -> dict[str, Any]:
    """The strategy's DeepSpeed entries with the Trainer's precision and gradient clipping folded in.

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
    if precision not in PRECISIONS:
        raise error(
            f"Trainer(precision={precision!r}) is not supported by ResiHPStrategy; allowed: "
            f"{', '.join(repr(p) for p in PRECISIONS)} (the pipeline engine's bf16 / fp16 modes)"
        )
    section = PRECISIONS[precision]
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
