"""bf16 mixed precision of the layer-wise engine: which Trainer precision selects it, and what it computes.

The multi-process behaviour (recovery, spares, per-replica bounds, checkpoints) is tested in
``tests/failstop/test_bf16_recovery.py`` and ``tests/state/test_bf16_checkpoint.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from resihp_lightning.errors import ConfigError
from resihp_lightning.runtime.mixed_precision import BF16_MIXED, MixedPrecision
from resihp_lightning.strategy.trainer_options import layerwise_precision


def test_bf16_mixed_selects_the_layerwise_engine_unless_deepspeed_config_picks_a_wrapper():
    assert layerwise_precision({}, "bf16-mixed") is BF16_MIXED
    assert layerwise_precision({"communication_data_type": "bf16"}, "bf16-mixed") is BF16_MIXED
    # ZeRO-1 is the layer-wise engine's too, unless switched to DeepSpeed's wrapper.
    assert layerwise_precision({"zero_optimization": {"stage": 1}}, "bf16-mixed") is BF16_MIXED
    for wrapper in ({"bf16": {"enabled": True}}, {"zero_optimization": {"stage": 1, "layerwise": False}}, {"fp16": {"enabled": True}}):
        assert layerwise_precision(wrapper, "bf16-mixed") is None, wrapper
    for other in ("32-true", "bf16-true"):
        assert layerwise_precision({}, other) is None, other


def test_only_bf16_compute_is_offered():
    with pytest.raises(ConfigError, match=r"precision.compute_dtype.*bfloat16"):
        MixedPrecision(torch.float16)


def test_autocast_computes_in_bf16_and_keeps_fp32_parameters_and_gradients():
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with BF16_MIXED.autocast("cpu"):
        out = layer(torch.randn(3, 4))
        loss = nn.functional.mse_loss(out, torch.zeros(3, 4))
    loss.backward()
    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32
    for p in layer.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32


def test_deepspeed_settings_it_cannot_run_with_are_refused_by_name():
    BF16_MIXED.check({"communication_data_type": "bf16", "pipeline": {"activation_checkpoint_interval": 0}})
    with pytest.raises(ConfigError, match="DeepSpeed optimizer wrapper"):
        BF16_MIXED.check({"zero_optimization": {"stage": 1, "layerwise": False}})
    with pytest.raises(ConfigError, match=r"activation_checkpoint_interval.*outside the autocast"):
        BF16_MIXED.check({"pipeline": {"activation_checkpoint_interval": 1}})
