"""Tensor parallelism (``models/tensor_parallel.py``) against the unsplit model, on 2 real gloo
processes: a decoder layer (the same outputs and input gradient, each member's weight gradients equal
to its share of the unsplit layer's; Llama with grouped-query attention, Qwen2 with q/k/v biases), and
a whole causal LM with the vocabulary split in its embedding, head and loss (the same loss, and every
gradient equal to its share)."""

from __future__ import annotations

import pytest

TOL = 1e-5


def _rank(rank: int, world: int, model_type: str) -> dict:
    import copy

    import torch
    import torch.distributed as dist

    from resihp_lightning.errors import ConfigError
    from resihp_lightning.models.attention import positions_from_seq_lens
    from resihp_lightning.models.hf_checkpoint import build_pipeline_model, tiny_config
    from resihp_lightning.models.tensor_parallel import split_decoder_layer

    dist.init_process_group("gloo")
    config = tiny_config(model_type, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    dense = build_pipeline_model(config, seed=3).layers[1]  # a DecoderPipe, the same on both ranks
    split = copy.deepcopy(dense)
    split_decoder_layer(split.layer, dist.group.WORLD)

    gen = torch.Generator().manual_seed(7)
    seq_lens = torch.tensor([[10, 6], [16, 0]])
    position_ids = positions_from_seq_lens(seq_lens, 16)
    hidden = torch.randn(2, 16, 64, generator=gen)
    upstream = torch.randn(2, 16, 64, generator=gen)

    def run(pipe):
        x = hidden.clone().requires_grad_(True)
        out = pipe((x, position_ids, seq_lens))[0]
        out.backward(upstream)
        return out.detach(), x.grad

    out_dense, grad_dense = run(dense)
    original, calls = dist.all_reduce, []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        out_split, grad_split = run(split)
    finally:
        dist.all_reduce = original
    full = dict(dense.layer.named_parameters())
    errors = {"output": (out_split - out_dense).abs().max().item(), "input grad": (grad_split - grad_dense).abs().max().item()}
    attn, mlp = split.layer.self_attn, split.layer.mlp
    for name, module, axis in (("self_attn.q_proj", attn.q_proj, 0), ("self_attn.k_proj", attn.k_proj, 0),
                               ("self_attn.v_proj", attn.v_proj, 0), ("self_attn.o_proj", attn.o_proj, 1),
                               ("mlp.gate_proj", mlp.gate_proj, 0), ("mlp.up_proj", mlp.up_proj, 0),
                               ("mlp.down_proj", mlp.down_proj, 1)):
        whole = full[f"{name}.weight"].grad
        share = whole.chunk(world, dim=axis)[rank]
        errors[f"{name}.weight grad"] = (module.weight.grad - share).abs().max().item()
        if module.bias is not None:
            bias = full[f"{name}.bias"].grad
            bias_share = bias.chunk(world)[rank] if axis == 0 else bias
            errors[f"{name}.bias grad"] = (module.bias.grad - bias_share).abs().max().item()
    for name, param in split.layer.named_parameters():
        if "norm" in name:  # replicated: the full gradient on every member
            errors[f"{name} grad"] = (param.grad - full[name].grad).abs().max().item()
    sizes = {name: tuple(p.shape) for name, p in split.layer.named_parameters() if "proj" in name}

    refused = None
    try:
        split_decoder_layer(copy.deepcopy(build_pipeline_model(
            tiny_config(model_type, hidden_size=64, num_attention_heads=4, num_key_value_heads=1), seed=3).layers[1].layer),
            dist.group.WORLD)
    except ConfigError as err:
        refused = str(err)
    dist.destroy_process_group()
    return {"errors": errors, "sizes": sizes, "refused": refused, "all_reduces": len(calls)}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_a_decoder_layer_split_over_two_processes_computes_the_unsplit_layer(distributed, model_type):
    results = distributed(_rank, 2, timeout=100, model_type=model_type)
    for rank, result in enumerate(results):
        errors = result["errors"]
        assert len(errors) >= 2 + 7 + 2, errors  # outputs, input grad, 7 weight grads, 2 norms
        if model_type == "qwen2":
            assert {"self_attn.q_proj.bias grad", "self_attn.k_proj.bias grad", "self_attn.v_proj.bias grad"} <= set(errors)
        worst = max(errors, key=errors.get)
        assert errors[worst] < TOL, (rank, worst, errors[worst])
        # Each member holds half of every split projection: 2 of 4 query heads, 1 of 2 key-value heads
        # (head_dim 16), half of the MLP's 96 intermediate features.
        sizes = result["sizes"]
        assert sizes["self_attn.q_proj.weight"] == (32, 64) and sizes["self_attn.k_proj.weight"] == (16, 64)
        assert sizes["self_attn.o_proj.weight"] == (64, 32) and sizes["mlp.down_proj.weight"] == (64, 48)
        assert "key-value heads (1) divisible by 2" in result["refused"], result["refused"]
        # One all-reduce per split input and output: attention and MLP outputs forward, their inputs'
        # gradients backward (q/k/v and gate/up share one each).
        assert result["all_reduces"] == 4, result["all_reduces"]


def _model_rank(rank: int, world: int, model_type: str, tied: bool) -> dict:
    import copy

    import torch
    import torch.distributed as dist

    from resihp_lightning.models.attention import positions_from_seq_lens
    from resihp_lightning.models.hf_checkpoint import build_pipeline_model, tiny_config
    from resihp_lightning.models.layers import IGNORE_INDEX, causal_lm_loss
    from resihp_lightning.models.tensor_parallel import split_pipeline_layers, vocab_parallel_causal_lm_loss

    dist.init_process_group("gloo")
    config = tiny_config(model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=tied)
    dense = build_pipeline_model(config, seed=11).layers
    split = split_pipeline_layers(copy.deepcopy(dense), dist.group.WORLD)

    gen = torch.Generator().manual_seed(5)
    seq_lens = torch.tensor([[9, 7], [16, 0]])
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    labels[0, 8], labels[0, 15], labels[1, 15] = IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX  # document ends
    position_ids = positions_from_seq_lens(seq_lens, 16)

    def run(layers, loss_fn):
        x = (ids, position_ids, seq_lens)
        for layer in layers:
            x = layer(x)
        loss = loss_fn(x, labels)
        loss.backward()
        return loss.item(), x.shape[-1]

    dense_loss, vocab = run(dense, causal_lm_loss)
    split_loss, local_vocab = run(split, lambda logits, y: vocab_parallel_causal_lm_loss(logits, y, dist.group.WORLD))
    errors = {"loss": abs(split_loss - dense_loss)}
    for i, (whole, part) in enumerate(zip(dense, split)):
        full = dict(whole.named_parameters())
        for name, param in part.named_parameters():
            grad = full[name].grad
            axes = [a for a in range(grad.dim()) if grad.shape[a] != param.shape[a]]
            share = grad.chunk(world, dim=axes[0])[rank] if axes else grad
            errors[f"{i}.{name}"] = (param.grad - share).abs().max().item()
    dist.destroy_process_group()
    return {"errors": errors, "loss": dense_loss, "vocab": (vocab, local_vocab)}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_type, tied", [("llama", False), ("qwen2", True)])
def test_a_causal_lm_split_over_two_processes_has_the_unsplit_loss_and_gradients(distributed, model_type, tied):
    results = distributed(_model_rank, 2, timeout=100, model_type=model_type, tied=tied)
    for rank, result in enumerate(results):
        errors = result["errors"]
        assert result["vocab"] == (260, 130), result["vocab"]  # each member computes half of the logits
        assert "0.embed_tokens.weight" in errors and "3.lm_head.weight" in errors and len(errors) > 20, sorted(errors)
        worst = max(errors, key=errors.get)
        assert errors[worst] < TOL, (rank, worst, errors[worst])
        assert 5.0 < result["loss"] < 6.0  # about ln(260): a real cross-entropy, not a degenerate one
