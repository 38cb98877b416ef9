"""bf16 mixed precision run by the layer-wise engine: fp32 parameters, bf16 compute under autocast.

The parameters stay fp32 and *are* the master weights; the optimizer keeps its state per parameter
in ``optimizer.state`` exactly as in a plain fp32 run. Only the forward pass (and the loss, which
runs inside it on the last stage) executes under ``torch.autocast(dtype=torch.bfloat16)``: matrix
products read bf16 copies of the weights and produce bf16 activations, the backward pass follows
the forward's dtypes, and the gradients land on the fp32 parameters in fp32. Stage-boundary
activations and their gradients travel in bf16.

So everything that moves or saves per-layer state (migration, fail-stop recovery, spares,
per-replica stage bounds, tensor-parallel re-splits, per-layer checkpoints) sees an fp32 job and
works unchanged. Gradients are all-reduced in fp32 by default; DeepSpeed's own
``communication_data_type`` config entry (``"bf16"``) makes the layer-wise reducer send them in
bf16 (see :func:`~resihp_lightning.runtime.layerwise.averaged_allreduce`).

Why autocast rather than bf16 working copies refreshed after every step: the working copies would
be a second set of tensors per layer that every move, recovery and checkpoint has to keep in step
with the masters; ``benchmarks/bf16_engine.py`` measured both on the demo model (see
``docs/precision.md``).

fp16 is not run here: it needs dynamic loss scaling (a skipped step on overflow, agreed by every
rank before the commit point), which the layer-wise engine does not have; the strategy refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from resihp_lightning.errors import ConfigError, invalid_option
from resihp_lightning.state.wrapped_state import wraps_optimizer

#: Compute dtypes the layer-wise engine runs under autocast.
COMPUTE_DTYPES = (torch.bfloat16,)


@dataclass(frozen=True)
class MixedPrecision:
    """bf16 compute over fp32 parameters, owned by the layer-wise engine.

    Attributes:
        compute_dtype: the autocast dtype of the forward pass (only ``torch.bfloat16``).

    Raises:
        ConfigError: another dtype.
    """

    compute_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise invalid_option("precision.compute_dtype", self.compute_dtype, [str(d) for d in COMPUTE_DTYPES])

    def check(self, deepspeed_config: Mapping[str, Any]) -> None:
        """Refuses DeepSpeed settings this precision cannot run with.

        Raises:
            ConfigError: a DeepSpeed optimizer wrapper (ZeRO, ``bf16`` / ``fp16`` sections: they own the
                parameters' dtype and state), or DeepSpeed's activation checkpointing (it recomputes the
                forward pass during the backward pass, outside the autocast, so the recomputed
                activations would not be the bf16 ones the forward produced).
        """
        if wraps_optimizer(deepspeed_config):
            raise ConfigError(
                "precision='bf16-mixed' of the layer-wise engine cannot run under a DeepSpeed optimizer wrapper "
                "(ZeRO / bf16 / fp16 in deepspeed_config); use one or the other"
            )
        interval = (deepspeed_config.get("pipeline") or {}).get("activation_checkpoint_interval")
        if interval:
            raise invalid_option(
                "deepspeed_config.pipeline.activation_checkpoint_interval", interval,
                "0 with precision='bf16-mixed' (DeepSpeed recomputes checkpointed layers outside the autocast); "
                "use precision='32-true', or DeepSpeed's bf16 through deepspeed_config={'bf16': {'enabled': True}}",
            )

    def autocast(self, device: torch.device | str) -> torch.autocast:
        """The autocast context of a forward pass on ``device``."""
        device_type = torch.device(device).type
        return torch.autocast(device_type=device_type, dtype=self.compute_dtype)


#: Lightning's ``precision="bf16-mixed"`` under the layer-wise engine.
BF16_MIXED = MixedPrecision()
