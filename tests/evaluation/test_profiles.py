"""Model profiles against hand-computed FLOPs, memory and communication (resihp_lightning/evaluation/profiles.py)."""

from __future__ import annotations

import pytest

from resihp_lightning.errors import ConfigError
from resihp_lightning.evaluation.profiles import MODELS, HardwareSpec, WorkloadSpec, build_profile, layer_forward_flops


def test_llama2_7b_layer_by_hand():
    model = MODELS["llama2-7b"]
    workload = WorkloadSpec(seq_len=4096, micro_batches_per_device=2)
    # QKV 4096 x (4096 + 2 * 4096), output 4096 x 4096, SwiGLU 3 x 4096 x 11008 = 202,375,168 weights.
    matmul_params = 4096 * 12288 + 4096 * 4096 + 3 * 4096 * 11008
    assert matmul_params == 202_375_168
    linear, attention = layer_forward_flops(model, workload)
    assert linear == 2 * 4096 * 202_375_168
    assert attention == 2 * 4096 * 4096**2  # causal: half of 4 h s^2
    assert model.layer_params() == 202_375_168 + 2 * 4096  # plus two RMSNorm weights
    assert model.total_params() == 32000 * 4096 * 2 + 32 * 202_383_360 + 4096  # 6.74 B, the published size

    profile = build_profile(model, workload)
    layer = profile.layers[1]
    rate = 312e12 * 0.43  # A100 bf16 peak at the stated utilisation
    assert layer.compute_ms == pytest.approx((linear + attention) * 4 / rate * 1000)  # fwd + 2x bwd + recompute
    assert layer.static_mb == pytest.approx(202_383_360 * 16 / 1e6)
    assert layer.activation_mb == pytest.approx(2 * 4096 * 4096 / 1e6)  # the bf16 layer input
    assert len(profile.layers) == 32 + 2  # embedding, 32 layers, head
    assert profile.layers[-1].compute_ms == pytest.approx(2 * 4096 * 4096 * 32000 * 3 / rate * 1000)
    # p2p: activation forward + gradient backward over one 25 GB/s link at 80%.
    assert profile.p2p_ms == pytest.approx(2 * 2 * 4096 * 4096 / 20e9 * 1000)


def test_attention_grows_with_sum_of_squared_lengths():
    model = MODELS["llama2-7b"]
    one = layer_forward_flops(model, WorkloadSpec(seq_len=8192))
    four = layer_forward_flops(model, WorkloadSpec(seq_len=8192, doc_lengths=(2048,) * 4))
    assert one[0] == four[0]
    assert four[1] == pytest.approx(one[1] / 4)  # 4 x 2048^2 = 8192^2 / 4
    long = layer_forward_flops(model, WorkloadSpec(seq_len=32768))
    assert long[1] == pytest.approx(16 * one[1])


def test_published_parameter_counts():
    assert MODELS["llama2-70b"].total_params() == pytest.approx(68.98e9, rel=2e-3)
    assert MODELS["llama2-13b"].total_params() == pytest.approx(13.02e9, rel=2e-3)
    assert MODELS["qwen2.5-7b"].total_params() == pytest.approx(7.62e9, rel=2e-3)
    assert MODELS["qwen2.5-72b"].total_params() == pytest.approx(72.7e9, rel=2e-3)


def test_a_tp_group_is_one_device():
    one = build_profile("llama2-70b", WorkloadSpec(tp=1))
    four = build_profile("llama2-70b", WorkloadSpec(tp=4))
    assert four.device_memory_mb == 4 * one.device_memory_mb
    assert four.layers[1].static_mb == one.layers[1].static_mb  # the group holds the whole layer
    assert four.layers[1].compute_ms < one.layers[1].compute_ms / 4 * 1.1  # 4 GPUs plus NVLink all-reduces
    assert four.layers[1].compute_ms > one.layers[1].compute_ms / 4


def test_bad_options_are_named():
    with pytest.raises(ConfigError, match="model"):
        build_profile("gpt-5")
    with pytest.raises(ConfigError, match="workload.doc_lengths"):
        WorkloadSpec(seq_len=10, doc_lengths=(3, 3))
    with pytest.raises(ConfigError, match="hardware.utilisation"):
        HardwareSpec(utilisation=1.5)


def test_tensor_cost_matches_the_tp_group_profile():
    """A healthy TP-k group of the per-GPU model (speed 1 / (1/k + f_k) on one-GPU layers) runs a decoder
    layer exactly as the TP-k profile prices it; the degrees split heads, key/value heads and vocabulary."""
    from resihp_lightning.evaluation.profiles import tensor_cost
    from resihp_lightning.plan import Device
    from resihp_lightning.tensor_plan import group_device

    workload = WorkloadSpec(seq_len=8192)
    cost = tensor_cost("llama2-70b", workload)
    assert cost.degrees == (1, 2, 4, 8)  # 64 heads, 8 key/value heads, 32000 tokens
    one_gpu = build_profile("llama2-70b", workload).layers[1].compute_ms
    nvlink = 300e9 * 0.8
    assert cost.comm_fraction[4] == pytest.approx(4 * 2 * 3 / 4 * 2 * 8192 * 8192 / nvlink * 1000 / one_gpu)
    for k in (2, 4, 8):
        group = group_device([Device(i, 1.0, 72_000.0) for i in range(k)], cost)
        tp_k = build_profile("llama2-70b", WorkloadSpec(seq_len=8192, tp=k)).layers[1].compute_ms
        assert one_gpu / group.speed == pytest.approx(tp_k, rel=1e-12)
    assert tensor_cost("qwen2.5-7b").degrees == (1, 2, 4)  # 28 heads, 4 key/value heads


def test_tensor_cost_with_uneven_splits_allows_every_degree():
    from resihp_lightning.evaluation.profiles import tensor_cost, tp_allreduce_ms, layer_compute_ms

    workload = WorkloadSpec(seq_len=8192)
    cost = tensor_cost("llama2-70b", workload, max_degree=4, uneven=True)
    assert cost.degrees == (1, 2, 3, 4)
    model = MODELS["llama2-70b"]
    expected = tp_allreduce_ms(model, workload, HardwareSpec(), 3) / layer_compute_ms(model, workload, HardwareSpec())
    assert cost.comm_fraction[3] == pytest.approx(expected)
