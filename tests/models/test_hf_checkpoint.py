"""HF Llama / Qwen2 checkpoints as pipeline layers: logits, loss, isolation, round-trip, errors."""

from __future__ import annotations

import json

import pytest
import torch

from resihp_lightning.data import ByteTokenizer, PackedDataset, collate_packed, tokenize_documents
from resihp_lightning.errors import ConfigError
from resihp_lightning.models import (
    causal_lm_loss,
    hf_state_dict,
    load_pipeline_model,
    pipeline_state_dict,
    positions_from_seq_lens,
    save_hf_checkpoint,
    tiny_config,
)

transformers = pytest.importorskip("transformers")
AutoModelForCausalLM = transformers.AutoModelForCausalLM

VOCAB = 260


def _make_checkpoint(path, config, seed):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random non-trivial norms and biases, so that a mix-up of those weights would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "llama": _make_checkpoint(root / "llama", tiny_config("llama", vocab_size=VOCAB, num_hidden_layers=3), 1),
        # Qwen2 with tied embeddings, as its small models ship.
        "qwen2": _make_checkpoint(
            root / "qwen2", tiny_config("qwen2", vocab_size=VOCAB, num_hidden_layers=2, tie_word_embeddings=True), 2
        ),
    }


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


def _run(layers, inputs):
    x = inputs
    for layer in layers:
        x = layer(x)
    return x


def _packed_batch(seed=0, seq_len=40):
    """A collated batch of byte-tokenised documents of mixed lengths (several per row)."""
    rng = torch.Generator().manual_seed(seed)
    texts = []
    for n in (5, 17, 3, 30, 9, 44, 2, 12, 21, 6):
        texts.append("".join(chr(97 + int(c)) for c in torch.randint(0, 26, (n,), generator=rng)))
    ds = PackedDataset(tokenize_documents(texts, ByteTokenizer()), seq_len=seq_len, pad_token_id=256)
    return collate_packed([ds[i] for i in range(len(ds))])


def _segments(seq_lens_row):
    start = 0
    for n in seq_lens_row.tolist():
        if n > 0:
            yield start, n
            start += n


def _inputs(batch):
    return batch["input_ids"], batch["position_ids"], batch["seq_lens"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_logits_equal_hf_per_document_and_round_trip(checkpoints, arch, tmp_path):
    pipe = load_pipeline_model(checkpoints[arch])
    hf = _hf(checkpoints[arch])
    batch = _packed_batch()
    with torch.no_grad():
        logits = _run(pipe.layers, _inputs(batch))
        for r in range(logits.shape[0]):
            for start, n in _segments(batch["seq_lens"][r]):
                ref = hf(input_ids=batch["input_ids"][r : r + 1, start : start + n]).logits[0]
                torch.testing.assert_close(logits[r, start : start + n], ref, atol=1e-5, rtol=0)

    # "Train": perturb every parameter (the head and embedding differently, which unties a tied model).
    with torch.no_grad():
        for p in (p for layer in pipe.layers for p in layer.parameters()):
            p.add_(torch.randn_like(p) * 0.02)
        logits = _run(pipe.layers, _inputs(batch))
    out = save_hf_checkpoint(pipe.layers, pipe.config, tmp_path / "out")
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == arch
    assert saved.get("tie_word_embeddings", False) is False  # diverged copies are saved untied
    reloaded = _hf(out)
    with torch.no_grad():
        for r in range(logits.shape[0]):
            for start, n in _segments(batch["seq_lens"][r]):
                ref = reloaded(input_ids=batch["input_ids"][r : r + 1, start : start + n]).logits[0]
                torch.testing.assert_close(logits[r, start : start + n], ref, atol=1e-5, rtol=0)


def test_untouched_tied_model_is_saved_tied(checkpoints, tmp_path):
    pipe = load_pipeline_model(checkpoints["qwen2"])
    out = save_hf_checkpoint(pipe.layers, pipe.config, tmp_path / "tied")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    hf, reloaded = _hf(checkpoints["qwen2"]), _hf(out)
    ids = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, atol=1e-6, rtol=0)


def test_loss_and_gradients_equal_hf_forward_per_document(checkpoints):
    pipe = load_pipeline_model(checkpoints["llama"])
    hf = _hf(checkpoints["llama"])
    batch = _packed_batch(seed=3)
    loss = causal_lm_loss(_run(pipe.layers, _inputs(batch)), batch["labels"])
    loss.backward()

    # Reference: HF's own loss on each document alone (HF shifts the labels itself), token-weighted.
    total, count = 0.0, 0
    for r in range(batch["input_ids"].shape[0]):
        for start, n in _segments(batch["seq_lens"][r]):
            if n < 2:
                continue
            ids = batch["input_ids"][r : r + 1, start : start + n]
            total = total + hf(input_ids=ids, labels=ids).loss * (n - 1)
            count += n - 1
    ref = total / count
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        pipe.layers[0].embed_tokens.weight.grad, hf.model.embed_tokens.weight.grad, atol=1e-6, rtol=1e-4
    )
    torch.testing.assert_close(
        pipe.layers[2].layer.self_attn.q_proj.weight.grad, hf.model.layers[1].self_attn.q_proj.weight.grad,
        atol=1e-6, rtol=1e-4,
    )


def test_documents_in_a_row_do_not_see_each_other(checkpoints):
    pipe = load_pipeline_model(checkpoints["qwen2"])
    seq_lens = torch.tensor([[7, 9, 8]])
    ids = torch.randint(0, VOCAB, (1, 24))
    inputs = (ids, positions_from_seq_lens(seq_lens, 24), seq_lens)
    changed = ids.clone()
    changed[0, 7:16] = (changed[0, 7:16] + 5) % VOCAB
    with torch.no_grad():
        a = _run(pipe.layers, inputs)
        b = _run(pipe.layers, (changed, inputs[1], seq_lens))
    assert torch.equal(a[0, :7], b[0, :7])
    assert torch.equal(a[0, 16:], b[0, 16:])
    assert not torch.allclose(a[0, 7:16], b[0, 7:16])


def test_qwen2_sliding_window_matches_hf(tmp_path):
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, use_sliding_window=True, sliding_window=4, max_window_layers=1,
    )
    path = _make_checkpoint(tmp_path / "sw", cfg, 5)
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation="eager").eval()
    pipe = load_pipeline_model(path)
    ids = torch.randint(0, VOCAB, (1, 12))
    seq_lens = torch.tensor([[12]])
    with torch.no_grad():
        logits = _run(pipe.layers, (ids, positions_from_seq_lens(seq_lens, 12), seq_lens))
        torch.testing.assert_close(logits, hf(ids).logits, atol=1e-5, rtol=0)


def test_state_keys_map_to_hf_names(checkpoints):
    pipe = load_pipeline_model(checkpoints["llama"])
    mapped = hf_state_dict(pipeline_state_dict(pipe.layers), pipe.config.num_hidden_layers)
    assert set(mapped) == set(_hf(checkpoints["llama"]).state_dict())
    with pytest.raises(ConfigError, match="does not map"):
        hf_state_dict({"7.layer.mlp.up_proj.weight": torch.zeros(1)}, 3)


def test_clear_errors_for_bad_checkpoints(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="does not exist") as err:
        load_pipeline_model(missing)
    assert str(missing) in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_pipeline_model(tmp_path / "empty")
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"unsupported architecture model_type='gpt2'.*supported: llama, qwen2"):
        load_pipeline_model(gpt)
    noweights = tmp_path / "noweights"
    tiny_config("llama").save_pretrained(noweights)
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        load_pipeline_model(noweights)


def test_lightning_module_contract_and_hf_export(checkpoints, tmp_path):
    from resihp_lightning.models import CausalLMPipelineModule, ScratchModelConfig, export_hf_checkpoint
    from resihp_lightning.strategy.module import ResiHPModule, check_contract

    module = CausalLMPipelineModule(
        model_path=str(checkpoints["qwen2"]), learning_rate=1e-3, weight_decay=0.1, warmup_steps=2
    )
    assert isinstance(module, ResiHPModule)
    check_contract(module)
    layers = module.pipeline_layers()
    assert len(layers) == module.hf_config.num_hidden_layers + 2
    batch = _packed_batch(seed=4)
    inputs, labels, seq_lens = module.pipeline_batch(batch)
    assert seq_lens is batch["seq_lens"] and labels is batch["labels"]
    loss = module.pipeline_loss(_run(layers, inputs), labels)
    assert 0 < loss.item() < 2 * torch.log(torch.tensor(float(VOCAB))).item()
    opt = module.configure_optimizers()["optimizer"]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(module.parameters()))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    with pytest.raises(ConfigError, match="collate_packed"):
        module.pipeline_batch((batch["input_ids"], batch["labels"]))

    # A Lightning checkpoint with ResiHPStrategy's layer-keyed state exports to an HF directory.
    with torch.no_grad():
        layers[-1].lm_head.weight.mul_(1.5)
        logits = _run(layers, inputs)
    ckpt = {"state_dict": {f"{i}.{k}": v for i, m in enumerate(layers) for k, v in m.state_dict().items()}}
    module.on_save_checkpoint(ckpt)
    out = export_hf_checkpoint(ckpt, tmp_path / "export")
    reloaded = _hf(out)
    with torch.no_grad():
        start, n = next(_segments(batch["seq_lens"][0]))
        ref = reloaded(input_ids=batch["input_ids"][:1, start : start + n]).logits[0]
    torch.testing.assert_close(logits[0, start : start + n], ref, atol=1e-5, rtol=0)

    # Tied embeddings are named as one parameter (Qwen2 small models tie them).
    last = len(layers) - 1
    assert list(module.pipeline_tied_parameters()) == [("0.embed_tokens.weight", f"{last}.lm_head.weight")]

    scratch = CausalLMPipelineModule(scratch=ScratchModelConfig(model_type="llama", num_hidden_layers=2))
    assert len(scratch.pipeline_layers()) == 4 and scratch.vocab_size == VOCAB
    assert list(scratch.pipeline_tied_parameters()) == []
    with pytest.raises(ConfigError, match="model.scratch.model_type"):
        CausalLMPipelineModule(scratch=ScratchModelConfig(model_type="gpt2"))


TIED_STEPS = 3
TIED_LR = 1e-2


def _tied_batches():
    return [_packed_batch(seed=10 + step, seq_len=24) for step in range(TIED_STEPS)]


def _tied_reference(path):
    """One process: the pipeline layers with the head's matrix really being the embedding's."""
    from resihp_lightning.models import CausalLMPipelineModule

    module = CausalLMPipelineModule(model_path=str(path), learning_rate=TIED_LR, weight_decay=0.1)
    layers = module.pipeline_layers()
    layers[-1].lm_head.weight = layers[0].embed_tokens.weight
    optimizer = module.configure_optimizers()
    losses = []
    for batch in _tied_batches():
        inputs, labels, _ = module.pipeline_batch(batch)
        rows = labels.shape[0]
        optimizer.zero_grad()
        total = 0.0
        for k in range(rows):
            loss = causal_lm_loss(_run(layers, tuple(t[k : k + 1] for t in inputs)), labels[k : k + 1]) / rows
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return losses, layers[0].embed_tokens.weight.detach().clone()


def _tied_rank(rank, world, path):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from resihp_lightning.models import CausalLMPipelineModule
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    class Losses(pl.Callback):
        def __init__(self):
            self.values = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.values.append(float(outputs["loss"]))

    losses = Losses()
    module = CausalLMPipelineModule(model_path=str(path), learning_rate=TIED_LR, weight_decay=0.1)
    # Loaded per stage; "all" gathers every layer into every rank's module at the end (the default for
    # a per-stage module is "none").
    strategy = ResiHPStrategy(pipeline_degree=2, micro_batch_size=1, gather_weights="all")
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=TIED_STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=False, callbacks=[losses],
    )
    trainer.fit(module, DataLoader(_tied_batches(), batch_size=None))
    state = strategy.lightning_module_state_dict()  # the module's own keys
    last = len(module.layers) - 1
    return {"losses": losses.values, "embed": state.get("layers.0.embed_tokens.weight"),
            "head": state.get(f"layers.{last}.lm_head.weight"),
            # After fit every rank's module holds both copies, trained and equal.
            "module_tied": torch.equal(module.layers[0].embed_tokens.weight, module.layers[last].lm_head.weight)}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_tied_embeddings_train_as_one_parameter_across_stages(checkpoints, distributed):
    results = distributed(_tied_rank, 2, timeout=280, path=str(checkpoints["qwen2"]))
    ref_losses, ref_embed = _tied_reference(checkpoints["qwen2"])
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(ref_losses, abs=1e-5, rel=0), rank
    embed, head = results[0]["embed"], results[0]["head"]
    assert torch.equal(embed, head)  # the two copies are still one value
    assert all(result["module_tied"] for result in results)
    torch.testing.assert_close(embed, ref_embed, atol=1e-5, rtol=0)


def test_a_scratch_module_comes_back_from_its_saved_hyperparameters(tmp_path):
    """``load_from_checkpoint`` rebuilds the module from ``hparams``, which hold the scratch shape as a dict."""
    import lightning.pytorch as pl

    from resihp_lightning.config import ScratchModelConfig
    from resihp_lightning.models import CausalLMPipelineModule

    module = CausalLMPipelineModule(scratch=ScratchModelConfig(hidden_size=32, num_hidden_layers=1), seed=3)
    path = tmp_path / "scratch.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "pytorch-lightning_version": pl.__version__}, path)
    restored = CausalLMPipelineModule.load_from_checkpoint(path, map_location="cpu")
    assert restored.hparams["scratch"]["hidden_size"] == 32 and len(restored.pipeline_layers()) == 3
    for key, value in module.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key
