"""Per-stage loading of Hugging Face checkpoints and the sharded save from the stages (issue 16, items 1, 2, 5).

The checkpoints are tiny Llama / tied-embedding Qwen2 models written here, sharded into several
safetensors files with an index, with a word-level tokenizer built here too (nothing is downloaded).
One 4-process job trains each model twice, loaded whole and loaded per stage, under the same plans (a
re-plan moves layers between processes), and saves the per-stage model from its stages.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from resihp_lightning.data import ByteTokenizer, PackedDataset, collate_packed, tokenize_documents
from resihp_lightning.errors import ConfigError
from resihp_lightning.models import load_pipeline_model, tiny_config

transformers = pytest.importorskip("transformers")
AutoModelForCausalLM = transformers.AutoModelForCausalLM

VOCAB = 260
LR = 1e-2
LLAMA_DECODERS = 4  # 6 pipeline layers
QWEN_DECODERS = 2  # 4 pipeline layers
STEPS = 4
REPLAN_AFTER = 1  # a re-plan requested after this step moves layers between processes


def _make_checkpoint(path: Path, config, seed: int) -> Path:
    """A sharded HF checkpoint (index + several safetensors files) with a local word-level tokenizer."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # non-trivial norms and biases, so that a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path, max_shard_size="200KB")
    vocab = {"[UNK]": 0, "</s>": 1, **{chr(97 + i): 2 + i for i in range(26)}}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="[UNK]").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {
        "llama": _make_checkpoint(root / "llama", tiny_config("llama", vocab_size=VOCAB, num_hidden_layers=LLAMA_DECODERS), 3),
        "qwen2": _make_checkpoint(
            root / "qwen2",
            tiny_config("qwen2", vocab_size=VOCAB, num_hidden_layers=QWEN_DECODERS, tie_word_embeddings=True),
            4,
        ),
    }
    for path in out.values():
        assert len(list(path.glob("model-*.safetensors"))) >= 2 and (path / "model.safetensors.index.json").is_file()
    return out


def _batch(seed: int, rows: int = 4, seq_len: int = 24) -> dict:
    """``rows`` packed rows of byte-tokenised documents of mixed lengths."""
    rng = torch.Generator().manual_seed(seed)
    texts = ["".join(chr(97 + int(c)) for c in torch.randint(0, 26, (n,), generator=rng))
             for n in (5, 17, 3, 30, 9, 44, 2, 12, 21, 6)]
    ds = PackedDataset(tokenize_documents(texts, ByteTokenizer()), seq_len=seq_len, pad_token_id=256)
    return collate_packed([ds[i] for i in range(rows)])


def _layer_prefixes(index: int, num_decoders: int) -> tuple[str, ...]:
    if index == 0:
        return ("model.embed_tokens.",)
    if index <= num_decoders:
        return (f"model.layers.{index - 1}.",)
    return ("model.norm.", "lm_head.")


def _keys_of(layers, weight_map, num_decoders: int) -> set[str]:
    prefixes = tuple(p for i in layers for p in _layer_prefixes(i, num_decoders))
    return {k for k in weight_map if k.startswith(prefixes)}


def _run_layers(layers, inputs):
    x = inputs
    for layer in layers:
        x = layer(x)
    return x


# ------------------------------------------------------------------------------------- one process
def test_per_stage_layers_start_on_meta_and_read_only_their_own_tensors(checkpoints):
    from resihp_lightning.torch_utils import meta
    from resihp_lightning.models import CausalLMPipelineModule

    for arch, decoders in (("llama", LLAMA_DECODERS), ("qwen2", QWEN_DECODERS)):
        path = checkpoints[arch]
        weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        whole = CausalLMPipelineModule(model_path=str(path), load="whole")
        lazy = CausalLMPipelineModule(model_path=str(path))
        assert lazy.per_stage and not whole.per_stage
        assert all(meta.has_meta(layer) for layer in lazy.layers)
        params_before = [id(p) for p in lazy.parameters()]
        # Each layer reads its own tensors only (the tied head reads the embedding's matrix).
        for index, layer in enumerate(lazy.layers):
            read = set(lazy._loader.load_layer(index, layer))
            expected = _keys_of([index], weight_map, decoders)
            if arch == "qwen2" and index == decoders + 1:
                expected = {"model.norm.weight", "model.embed_tokens.weight"}
            assert read == expected, (arch, index)
        assert [id(p) for p in lazy.parameters()] == params_before  # same Parameter objects, now filled
        # Rotary frequencies (in no checkpoint) and every tensor equal a whole-model load: logits exactly.
        for a, b in zip(whole.state_dict().values(), lazy.state_dict().values()):
            assert torch.equal(a, b)
        inputs, _, _ = whole.pipeline_batch(_batch(1))
        with torch.no_grad():
            assert torch.equal(_run_layers(whole.layers, inputs), _run_layers(lazy.layers, inputs))


def test_a_per_stage_module_outside_the_strategy_loads_on_first_use_and_saves(checkpoints, tmp_path):
    from resihp_lightning.torch_utils import meta
    from resihp_lightning.models import CausalLMPipelineModule

    path = checkpoints["qwen2"]
    module = CausalLMPipelineModule(model_path=str(path))
    inputs, labels, _ = module.pipeline_batch(_batch(2))
    with torch.no_grad():
        logits = _run_layers(module.layers, inputs)
    assert not any(meta.has_meta(layer) for layer in module.layers)
    reference = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    with torch.no_grad():
        ref = reference(input_ids=inputs[0][:1, :5]).logits[0]
    torch.testing.assert_close(logits[0, :5], ref, atol=1e-5, rtol=0)

    # A state dict (Model.load_from_checkpoint, an exported file) fills layers still on meta: its values,
    # not the checkpoint's.
    trained = {k: v + 1 if v.is_floating_point() else v for k, v in module.state_dict().items()}
    restored = CausalLMPipelineModule(model_path=str(path))
    restored.load_state_dict(trained)
    assert all(torch.equal(v, trained[k]) for k, v in restored.state_dict().items())

    # Outside the strategy save_hf_checkpoint writes the module's own weights (the tokenizer comes along).
    fresh = CausalLMPipelineModule(model_path=str(path))
    out = fresh.save_hf_checkpoint(tmp_path / "out")
    assert (out / "tokenizer.json").is_file()
    saved = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert saved.config.tie_word_embeddings
    for key, value in reference.state_dict().items():
        assert torch.equal(value, saved.state_dict()[key]), key


def test_load_option_and_checkpoints_per_stage_cannot_read(checkpoints, tmp_path):
    from resihp_lightning.models import CausalLMPipelineModule
    from resihp_lightning.strategy.module import resolve_gather_weights

    with pytest.raises(ConfigError, match=r"model\.load.*'per_stage', 'whole'"):
        CausalLMPipelineModule(model_path=str(checkpoints["llama"]), load="lazy")
    with pytest.raises(ConfigError, match=r"model\.load"):
        load_pipeline_model(checkpoints["llama"], load="stage")
    # A pytorch_model.bin checkpoint has no per-tensor access: per-stage loading names load='whole'.
    config = tiny_config("llama", num_hidden_layers=1)
    config.save_pretrained(tmp_path / "bin")
    torch.save(AutoModelForCausalLM.from_config(config).state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="load='whole'"):
        load_pipeline_model(tmp_path / "bin", load="per_stage")
    # gather_weights="auto": the module's preference ("none" for a per-stage model), else "all".
    per_stage = CausalLMPipelineModule(model_path=str(checkpoints["llama"]))
    whole = CausalLMPipelineModule(model_path=str(checkpoints["llama"]), load="whole")
    assert resolve_gather_weights("auto", per_stage) == "none"
    assert resolve_gather_weights("auto", whole) == "all"
    assert resolve_gather_weights("rank0", per_stage) == "rank0"


def test_checkpoint_load_and_teardown_leave_layers_on_meta_alone(checkpoints):
    import warnings

    from resihp_lightning.torch_utils import meta
    from resihp_lightning.models import CausalLMPipelineModule
    from resihp_lightning.state.layer_checkpoint import load_module_state
    from resihp_lightning.state.module_weights import LayerKeys

    whole = CausalLMPipelineModule(model_path=str(checkpoints["llama"]), load="whole")
    module = CausalLMPipelineModule(model_path=str(checkpoints["llama"]))
    module.pipeline_load_layer(1, module.layers[1], "cpu")  # this "rank" holds layer 1 only
    keys = LayerKeys(module, module.pipeline_layers())
    local = {f"1.{k}": v for k, v in module.layers[1].state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "copying into a meta parameter is a no-op" warnings
        load_module_state(module, keys, whole.state_dict(), local, layer_keyed=False)
        module.cpu()  # Lightning's teardown: the meta layers stay where they are
    assert [meta.has_meta(layer) for layer in module.layers] == [True, False] + [True] * LLAMA_DECODERS
    # Once layers are loaded one by one (the strategy's way), the others are not read behind its back.
    with pytest.raises(ConfigError, match=r"layers \[0, 2, 3, 4, 5\].*held by other processes"):
        module.load_layers()
    assert not module.layers[0]._forward_pre_hooks
    # Layers moved away go back to meta; given storage again they keep their Parameter objects.
    params = [id(p) for p in module.layers[1].parameters()]
    meta.release(module.layers[1])
    assert meta.has_meta(module.layers[1]) and not meta.has_meta(module.layers[1].rotary_emb)
    meta.allocate(module.layers[1], "cpu")
    assert not meta.has_meta(module.layers[1]) and [id(p) for p in module.layers[1].parameters()] == params


# ------------------------------------------------------------------------------------- 4 processes
def _plans():
    from resihp_lightning.plan import Plan, Replica

    start = Plan((Replica((0, 1, 2, 3), (0, 2, 3, 4, 6), 4),))  # 4 stages
    # 2 x 2 with different bounds per replica: every process but 3 gets layers it did not hold.
    moved = Plan((Replica((2, 0), (0, 3, 6), 2), Replica((1, 3), (0, 4, 6), 2)))
    return start, moved


def _fit(module, world: int, batches, plan=None, pipeline_degree=None, replan=None, summary=False):
    """Trains ``module`` and returns what the test checks (losses, which layers hold storage, ...)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from resihp_lightning.torch_utils import meta
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    def real_layers(pl_module):
        return [i for i, layer in enumerate(pl_module.layers) if not meta.has_meta(layer)]

    class Probe(pl.Callback):
        def __init__(self):
            self.losses, self.at_start = [], None

        def on_train_start(self, trainer, pl_module):
            self.at_start = (real_layers(pl_module), sorted(trainer.strategy.local_layers()))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))
            if replan is not None and trainer.global_step == REPLAN_AFTER:
                trainer.strategy.request_plan(replan)

    probe = Probe()
    strategy = ResiHPStrategy(plan=plan, pipeline_degree=pipeline_degree, micro_batch_size=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=len(batches), logger=False,
        enable_progress_bar=False, enable_model_summary=summary, enable_checkpointing=False,
        use_distributed_sampler=False, callbacks=[probe],
    )
    trainer.fit(module, DataLoader(batches, batch_size=None))
    return strategy, {
        "losses": probe.losses,
        "at_start": probe.at_start,
        "at_end": (real_layers(module), sorted(strategy.local_layers())),
        "gather_weights": strategy.options.gather_weights,
        "plan": strategy.current_plan.to_dict(),
    }


def _job_rank(rank: int, world: int, llama: str, qwen2: str, out: str) -> dict:
    import warnings

    from resihp_lightning.models import CausalLMPipelineModule

    warnings.filterwarnings("ignore")
    start, moved = _plans()
    results = {}
    for name, path, batches, fit_args in (
        ("llama", llama, [_batch(10 + s) for s in range(STEPS)], {"plan": start, "replan": moved}),
        ("qwen2", qwen2, [_batch(20 + s) for s in range(2)], {"pipeline_degree": 2}),
    ):
        for load in ("whole", "per_stage"):
            module = CausalLMPipelineModule(model_path=path, learning_rate=LR, weight_decay=0.1, load=load)
            reads: list[str] = []
            if module.per_stage:
                load_layer = module._loader.load_layer
                module._loader.load_layer = lambda i, layer, device, f=load_layer: reads.extend(f(i, layer, device))
            # Lightning's model summary counts the parameters of layers still on the meta device too.
            strategy, result = _fit(module, world, batches, summary=module.per_stage, **fit_args)
            result["reads"] = reads
            # What a Lightning checkpoint stores: rank 0 gathers every layer from its holders (module keys).
            state = strategy.lightning_module_state_dict()
            result["state"] = {k: v.clone() for k, v in state.items()} if rank == 0 else None
            if module.per_stage:  # the sharded save, from the stages of the first replica
                result["saved"] = str(module.save_hf_checkpoint(Path(out) / name))
            results[f"{name}/{load}"] = result
    return results


def _whole_model(state, path, tmp: Path):
    """The whole-load run's gathered weights as an HF model (written by the existing single-rank save)."""
    from resihp_lightning.models import save_hf_checkpoint
    from transformers import AutoConfig

    layer_keyed = {k.removeprefix("layers."): v for k, v in state.items()}
    out = save_hf_checkpoint(layer_keyed, AutoConfig.from_pretrained(path), tmp)
    return AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_per_stage_load_trains_like_a_whole_load_and_saves_from_the_stages(checkpoints, distributed, tmp_path):
    from safetensors import safe_open

    results = distributed(_job_rank, 4, timeout=280, llama=str(checkpoints["llama"]),
                          qwen2=str(checkpoints["qwen2"]), out=str(tmp_path / "saved"))
    start, moved = _plans()
    llama_map = json.loads((checkpoints["llama"] / "model.safetensors.index.json").read_text())["weight_map"]
    for rank, result in enumerate(results):
        whole, lazy = result["llama/whole"], result["llama/per_stage"]
        layers = list(range(LLAMA_DECODERS + 2))
        # Whole: every rank holds every layer. Per stage: only its own, and it read only their tensors.
        assert whole["at_start"][0] == layers and whole["gather_weights"] == "all"
        real, held = lazy["at_start"]
        assert real == held == list(range(start.replicas[0].bounds[rank], start.replicas[0].bounds[rank + 1]))
        assert set(lazy["reads"]) == _keys_of(held, llama_map, LLAMA_DECODERS) and len(lazy["reads"]) == len(set(lazy["reads"]))
        # Same losses, before and after the re-plan; after it, a process keeps storage for its layers only.
        assert lazy["plan"] == moved.to_dict() == whole["plan"]
        assert lazy["losses"] == pytest.approx(whole["losses"], abs=1e-6, rel=0)
        real, held = lazy["at_end"]
        assert real == held and lazy["gather_weights"] == "none"
        if rank == 0:  # a Lightning checkpoint of the per-stage module is complete and equal
            assert lazy["state"].keys() == whole["state"].keys()
            for key, value in whole["state"].items():
                assert not lazy["state"][key].is_meta
                torch.testing.assert_close(lazy["state"][key], value, atol=1e-6, rtol=0, msg=key)
        qwhole, qlazy = result["qwen2/whole"], result["qwen2/per_stage"]
        assert qlazy["losses"] == pytest.approx(qwhole["losses"], abs=1e-6, rel=0)
        assert qlazy["at_start"][0] == qlazy["at_start"][1] != list(range(QWEN_DECODERS + 2))

    for name, decoders, arch_map in (("llama", LLAMA_DECODERS, llama_map), ("qwen2", QWEN_DECODERS, None)):
        out = Path(results[0][f"{name}/per_stage"]["saved"])
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files = sorted(p.name for p in out.glob("*.safetensors"))
        saved = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        reference = _whole_model(results[0][f"{name}/whole"]["state"], checkpoints[name], tmp_path / f"whole-{name}")
        # One file per stage of the first replica; the index lists every tensor of the model.
        plan = moved if name == "llama" else None
        stages = plan.replicas[0].bounds if plan is not None else (0, 2, decoders + 2)
        assert files == [f"model-{k + 1:05d}-of-{len(stages) - 1:05d}.safetensors" for k in range(len(stages) - 1)]
        expected = set(saved.state_dict())
        if saved.config.tie_word_embeddings:
            expected.discard("lm_head.weight")
        assert set(index["weight_map"]) == expected
        for k, file in enumerate(files):
            with safe_open(str(out / file), framework="pt") as handle:
                assert set(handle.keys()) == _keys_of(range(stages[k], stages[k + 1]), index["weight_map"], decoders)
        # The stages' trained weights are the whole-load run's, and so are the logits.
        ref_state = reference.state_dict()
        for key, value in saved.state_dict().items():
            torch.testing.assert_close(value, ref_state[key], atol=1e-6, rtol=0, msg=key)
        ids = _batch(5)["input_ids"][:2, :16]
        with torch.no_grad():
            torch.testing.assert_close(saved(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-6, rtol=0)
        assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
        config = json.loads((out / "config.json").read_text())
        assert config["dtype"] == "float32" and config.get("_attn_implementation") is None
        if name == "qwen2":  # the head's copy still equals the embedding: the checkpoint stays tied
            assert config["tie_word_embeddings"] is True and "lm_head.weight" not in index["weight_map"]
