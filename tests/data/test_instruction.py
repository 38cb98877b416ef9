"""Instruction data: prompt/completion and chat JSONL, loss on completions / assistant turns only,
whole examples packed per row, validation splits, errors, and the example script end to end.

Every tokenizer and model here is built locally (a byte-level BPE trained on a few sentences, a
tiny Llama saved with it); nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resihp_lightning.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    InstructionFields,
    PackedDataset,
    build_datasets,
    build_packed_dataset,
    collate_packed,
    encode_chat,
    load_examples,
)
from resihp_lightning.data.instruction import (
    Example,
    chat_rendering,
    detect_format,
    encode_prompt_completion,
)
from resihp_lightning.data.tokenizer import HFTokenizer, load_tokenizer
from resihp_lightning.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "finetune.py"
TINY = ROOT / "examples" / "configs" / "tiny_test.yaml"
CHAT_SAMPLE = ROOT / "examples" / "data" / "chat.jsonl"
PC_SAMPLE = ROOT / "examples" / "data" / "prompt_completion.jsonl"

# A ChatML-style template (Qwen2's shape) and the same one with {% generation %} blocks.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Renders the last message differently from earlier ones: its turns cannot be found by prefixes.
LAST_DIFFERENT = (
    "{% for message in messages %}{% if loop.last %}{{ '[' + message['role'] + '] ' + message['content'] }}"
    "{% else %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endif %}{% endfor %}"
)

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "what is two plus two?"},
    {"role": "assistant", "content": "It is four."},
    {"role": "user", "content": "and hello?"},
    {"role": "assistant", "content": "hello world"},
]


def _hf_tokenizer(chat_template: str | None = CHATML):
    """A byte-level BPE (vocab 300) trained here on a few sentences, with ChatML specials."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    raw = tokenizers.Tokenizer(tokenizers.models.BPE())
    raw.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<pad>", "</s>", "<|im_start|>", "<|im_end|>"],
    )
    raw.train_from_iterator(["what is two plus two? It is four. hello world, the user asks, the assistant answers."] * 8,
                            trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", pad_token="<pad>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = chat_template
    return tok


def _target_spans(tokenizer, example: Example) -> list[str]:
    """The decoded runs of consecutive target tokens."""
    spans, run = [], []
    for token, target in zip(example.ids, example.targets):
        if target:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    if run:
        spans.append(tokenizer.decode(run))
    return spans


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _expected_labels(examples: list[Example], ds: PackedDataset) -> list[list[int]]:
    """Labels computed independently: whole examples in order, a label wherever the next token of the same
    example is a target."""
    rows, pos = [], 0
    for index in range(len(ds)):
        labels = []
        for n in ds.segment_lengths(index):
            ex = examples[pos]
            assert len(ex.ids) == n  # a segment is exactly one whole example
            labels += [ex.ids[t + 1] if ex.targets[t + 1] else IGNORE_INDEX for t in range(n - 1)] + [IGNORE_INDEX]
            pos += 1
        rows.append(labels + [IGNORE_INDEX] * (ds.seq_len - len(labels)))
    assert pos == len(examples)
    return rows


# ------------------------------------------------------------------------------ prompt / completion
def test_prompt_completion_labels_are_exactly_the_completion_tokens_shifted(tmp_path):
    tok = ByteTokenizer()
    records = [{"prompt": f"Q{i}: " + "x" * i, "completion": f" A{i}" + "y" * (i % 5)} for i in range(30)]
    examples, stats = load_examples(_write_jsonl(tmp_path / "pc.jsonl", records), tok, seq_len=48)
    assert stats.examples == 30 and stats.truncated == 0 and stats.formats == {str(tmp_path / "pc.jsonl"): "prompt_completion"}
    first = examples[0]
    assert first.ids == tok.encode("Q0: ") + tok.encode(" A0") + [tok.eos_token_id]
    assert first == encode_prompt_completion("Q0: ", " A0", tok)
    assert first.targets == [False] * 4 + [True] * 4
    ds = PackedDataset([e.ids for e in examples], seq_len=48, pad_token_id=tok.pad_token_id,
                       loss_masks=[e.targets for e in examples], split_documents=False)
    expected = _expected_labels(examples, ds)
    assert [ds[i]["labels"].tolist() for i in range(len(ds))] == expected
    # Everything trained, in order, is the completions + EOS and nothing of the prompts.
    trained = [t for i in range(len(ds)) for t in ds[i]["labels"].tolist() if t != IGNORE_INDEX]
    want = [t for r in records for t in tok.encode(r["completion"]) + [tok.eos_token_id]]
    assert trained == want


def test_instruction_rows_keep_examples_whole_and_no_label_crosses_them(tmp_path):
    tok = ByteTokenizer()
    records = [{"prompt": "p" * (3 + 7 * i % 23), "completion": "c" * (1 + 5 * i % 17)} for i in range(40)]
    examples, _ = load_examples(_write_jsonl(tmp_path / "pc.jsonl", records), tok, seq_len=40)
    data = build_datasets(tok, 40, source=tmp_path / "pc.jsonl")
    ds = data.train
    assert data.format == "prompt_completion" and ds.num_docs == 40
    for index in range(len(ds)):
        row, lens = ds[index], ds.segment_lengths(index)
        assert sum(lens) <= 40
        pos = 0
        for n in lens:
            assert row["position_ids"][pos : pos + n].tolist() == list(range(n))
            assert row["labels"][pos + n - 1] == IGNORE_INDEX  # nothing predicted across the boundary
            pos += n
        assert (row["labels"][pos:] == IGNORE_INDEX).all() and (row["input_ids"][pos:] == tok.pad_token_id).all()
    assert [ds[i]["labels"].tolist() for i in range(len(ds))] == _expected_labels(examples, ds)
    batch = collate_packed([ds[0], ds[1]])
    assert batch["labels"].shape == (2, 40) and batch["seq_lens"].shape == (2, ds.max_docs)


def test_raw_text_packing_is_unchanged(tmp_path):
    tok = ByteTokenizer()
    corpus = _write_jsonl(tmp_path / "t.jsonl", [{"text": "abc " * (i + 1)} for i in range(20)])
    old = build_packed_dataset(tok, 32, source=corpus)
    data = build_datasets(tok, 32, source=corpus)  # auto: the first record has "text"
    assert data.format == "text" and data.val is None and data.train.targets is None and len(old) == len(data.train)
    for i in range(len(old)):
        for key, value in old[i].items():
            assert torch.equal(value, data.train[i][key])
    # Documents still continue across rows in raw text.
    assert sum(data.train.segment_lengths(0)) == 32 and len(data.train.segment_lengths(1)) >= 1


def test_masks_that_do_not_match_and_documents_too_long_to_keep_whole():
    with pytest.raises(ConfigError, match="one flag per token"):
        PackedDataset([[1, 2, 3]], seq_len=8, pad_token_id=0, loss_masks=[[True, False]])
    with pytest.raises(ConfigError, match="does not fit a row of data.seq_len=4"):
        PackedDataset([[1, 2, 3, 4, 5]], seq_len=4, pad_token_id=0, split_documents=False)


# ---------------------------------------------------------------------------------------- chat
def test_chat_template_prefix_rendering_trains_the_assistant_turns_only():
    hf = _hf_tokenizer(CHATML)
    tok = HFTokenizer(hf)
    assert chat_rendering(tok) == "prefix"
    example = encode_chat(CHAT, tok)
    rendered = hf.apply_chat_template(CHAT, tokenize=False)
    assert tok.decode(example.ids) == rendered
    assert _target_spans(tok, example) == ["It is four.<|im_end|>\n", "hello world<|im_end|>\n"]
    # Each span's tokens are exactly the tokenisation of that text (cut at the turn boundaries).
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert example.ids[-2] == im_end and example.targets[-2]
    # The assistant header before each turn is context, and the packed labels train exactly the targets.
    ds = PackedDataset([example.ids], seq_len=128, pad_token_id=tok.pad_token_id, loss_masks=[example.targets],
                       split_documents=False)
    labels = ds[0]["labels"]
    trained = [i + 1 for i, t in enumerate(labels.tolist()) if t != IGNORE_INDEX]
    assert trained == [i for i, t in enumerate(example.targets) if t]
    assert labels[trained[0] - 1] == example.ids[trained[0]]


def test_chat_template_generation_blocks_give_the_assistant_mask():
    tok = HFTokenizer(_hf_tokenizer(CHATML_GENERATION))
    assert chat_rendering(tok) == "generation"
    example = encode_chat(CHAT, tok)
    assert _target_spans(tok, example) == ["It is four.<|im_end|>", "hello world<|im_end|>"]


def test_chat_without_template_uses_the_plain_format_with_the_same_masking(tmp_path):
    for tok in (ByteTokenizer(), HFTokenizer(_hf_tokenizer(None))):
        assert chat_rendering(tok) == "plain"
        example = encode_chat(CHAT, tok)
        text = tok.decode([i for i in example.ids if i != tok.eos_token_id])
        assert text == ("<|system|>\nBe brief.\n<|user|>\nwhat is two plus two?\n<|assistant|>\nIt is four."
                        "<|user|>\nand hello?\n<|assistant|>\nhello world")
        targets = [i for i, t in zip(example.ids, example.targets) if t]
        assert targets == (tok.encode("It is four.") + [tok.eos_token_id] + tok.encode("hello world") + [tok.eos_token_id])
        assert example.ids[-1] == tok.eos_token_id


def test_checkpoint_tokenizer_with_a_chat_template_is_loaded_and_used(tmp_path):
    _hf_tokenizer(CHATML).save_pretrained(tmp_path / "ckpt")
    tok = load_tokenizer(tmp_path / "ckpt")
    assert chat_rendering(tok) == "prefix"
    examples, stats = load_examples(CHAT_SAMPLE, tok, seq_len=256)
    assert stats.chat_rendering == "prefix" and stats.examples == 24 and stats.truncated == 0
    assert _target_spans(tok, examples[0]) == ["The capital of Italy is Rome.<|im_end|>\n"]
    assert "chat template (prefix-diffed turns)" in stats.summary(256)


def test_a_template_that_rerenders_earlier_turns_is_refused():
    tok = HFTokenizer(_hf_tokenizer(LAST_DIFFERENT))
    with pytest.raises(ConfigError, match="renders message 2 differently"):
        encode_chat(CHAT, tok)


def test_example_data_files_load_in_both_formats():
    tok = ByteTokenizer()
    assert detect_format(PC_SAMPLE) == "prompt_completion" and detect_format(CHAT_SAMPLE) == "chat"
    for path in (PC_SAMPLE, CHAT_SAMPLE):
        examples, stats = load_examples(path, tok, seq_len=512)
        assert stats.examples == stats.records == 24 and all(e.num_targets > 0 for e in examples)


# ------------------------------------------------------------------------------ truncation / validation
def test_long_examples_are_truncated_or_dropped_and_counted(tmp_path):
    tok = ByteTokenizer()
    path = _write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "p" * 10, "completion": "c" * 5},
                                                {"prompt": "p" * 30, "completion": "c" * 30},
                                                {"prompt": "p" * 60, "completion": "c" * 2}])
    kept, stats = load_examples(path, tok, seq_len=40, truncation="truncate")
    assert [len(e.ids) for e in kept] == [16, 40]
    assert (stats.truncated, stats.dropped_too_long, stats.dropped_no_target) == (2, 0, 1)
    assert kept[1].targets == [False] * 30 + [True] * 10
    kept, stats = load_examples(path, tok, seq_len=40, truncation="drop")
    assert [len(e.ids) for e in kept] == [16] and (stats.truncated, stats.dropped_too_long) == (0, 2)
    assert "2 longer than 40 tokens dropped" in stats.summary(40)


def test_validation_fraction_and_source(tmp_path):
    tok = ByteTokenizer()
    records = [{"prompt": f"q{i} ", "completion": f"a{i}"} for i in range(20)]
    path = _write_jsonl(tmp_path / "pc.jsonl", records)
    data = build_datasets(tok, 32, source=path, val_fraction=0.25, shuffle_seed=3)
    assert data.val is not None and data.train.num_docs == 15 and data.val.num_docs == 5
    assert data.train.max_docs == data.val.max_docs  # same micro-batch shapes through the pipeline

    def docs(ds):
        return {tok.decode(ds.tokens[s:e].tolist()) for s, e in zip([0, *ds.doc_ends[:-1].tolist()], ds.doc_ends.tolist())}

    assert not docs(data.train) & docs(data.val) and len(docs(data.train) | docs(data.val)) == 20
    again = build_datasets(tok, 32, source=path, val_fraction=0.25, shuffle_seed=3)
    assert docs(again.val) == docs(data.val)
    assert any("5 of 20 examples held out" in line for line in data.summary())
    # A separate validation file, here of another format (auto-detected on its own).
    val = _write_jsonl(tmp_path / "val.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                              {"role": "assistant", "content": "hello"}]}] * 3)
    data = build_datasets(tok, 32, source=path, val_source=val)
    assert data.val_format == "chat" and data.val.num_docs == 3 and data.train.num_docs == 20
    assert data.train.max_docs == data.val.max_docs
    # Raw text can hold a fraction out too.
    text = _write_jsonl(tmp_path / "t.jsonl", [{"text": f"doc {i}"} for i in range(10)])
    data = build_datasets(tok, 16, source=text, val_fraction=0.2)
    assert data.format == "text" and data.val.num_docs == 2 and data.train.num_docs == 8


# ------------------------------------------------------------------------------------------ errors
def test_bad_records_name_the_file_and_line(tmp_path):
    tok = ByteTokenizer()
    cases = [
        ({"prompt": "a", "completion": "b"}, "not json", "pc.jsonl:2: not valid JSON"),
        ({"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": 3}, "pc.jsonl:2: expected string fields 'prompt' and 'completion'"),
        ({"prompt": "a", "completion": "b"}, [1, 2], "pc.jsonl:2: expected a JSON object"),
        (CHAT_REC := {"messages": CHAT}, {"messages": [{"role": "user", "content": "hi"}]}, "pc.jsonl:2: the chat has no 'assistant' message"),
        (CHAT_REC, {"messages": [{"role": "assistant", "content": "hi"}]}, "pc.jsonl:2: the chat starts with an 'assistant'"),
        (CHAT_REC, {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, "pc.jsonl:2: message 0 has no string 'content'"),
        (CHAT_REC, {"messages": "hello"}, "pc.jsonl:2: the messages must be a non-empty list"),
        (CHAT_REC, {"prompt": "a", "completion": "b"}, "pc.jsonl:2: expected a field 'messages'"),
    ]
    for first, second, message in cases:
        path = _write_jsonl(tmp_path / "pc.jsonl", [first, second])
        with pytest.raises(ConfigError) as info:
            load_examples(path, tok, seq_len=64)
        assert message in str(info.value), (message, str(info.value))
    with pytest.raises(ConfigError, match=r"other\.jsonl:1: cannot tell the data format.*'text'.*'messages'.*'prompt'"):
        build_datasets(tok, 64, source=_write_jsonl(tmp_path / "other.jsonl", [{"question": "a"}]))


def test_bad_options_are_named_with_the_allowed_values(tmp_path):
    tok = ByteTokenizer()
    path = _write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}] * 4)
    with pytest.raises(ConfigError, match=r"`data.format`.*'auto', 'text', 'prompt_completion', 'chat'"):
        build_datasets(tok, 64, source=path, format="alpaca")
    with pytest.raises(ConfigError, match=r"`data.truncation`.*'truncate', 'drop'"):
        build_datasets(tok, 64, source=path, truncation="cut")
    with pytest.raises(ConfigError, match=r"`data.val_fraction`.*\[0, 1\)"):
        build_datasets(tok, 64, source=path, val_fraction=1.5)
    with pytest.raises(ConfigError, match="leaves none for training"):
        build_datasets(tok, 64, source=path, val_fraction=0.9)
    with pytest.raises(ConfigError, match="val_source or data.val_fraction, not both"):
        build_datasets(tok, 64, source=path, val_fraction=0.5, val_source=path)
    with pytest.raises(ConfigError, match="needs data.source"):
        build_datasets(tok, 64, source=None, format="chat")
    with pytest.raises(ConfigError, match="must be a .jsonl file"):
        build_datasets(tok, 64, source=_write_jsonl(tmp_path / "notes.txt", ["hello"]), format="prompt_completion")
    custom = InstructionFields(prompt="question", completion="answer")
    data = build_datasets(tok, 64, source=_write_jsonl(tmp_path / "qa.jsonl", [{"question": "a", "answer": "b"}]),
                          fields=custom)
    assert data.format == "prompt_completion" and data.train.num_docs == 1


# -------------------------------------------------------------------------------------- end to end
def _tiny_chat_checkpoint(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _hf_tokenizer(CHATML)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_example_fine_tunes_on_chat_data_with_a_validation_loss(tmp_path):
    """2 gloo processes (2 stages), a tiny Llama whose tokenizer has a chat template, 4 steps, validated twice."""
    ckpt = _tiny_chat_checkpoint(tmp_path / "ckpt")
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("RESIHP_RUN_DIR", None)
    args = ["--config", str(TINY), "--run_dir", str(run_dir), "--model.model_path", str(ckpt), "--fault", "null",
            "--replan", "false", "--strategy.fail_stop", "null", "--trainer.devices", "2", "--trainer.max_steps", "4",
            "--strategy.pipeline_degree", "2", "--strategy.micro_batches", "2", "--data.source", str(CHAT_SAMPLE),
            "--data.seq_len", "96", "--data.max_tokens", "null", "--data.val_fraction", "0.25",
            "--data.val_every_n_steps", "2"]
    result = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "format chat; chats rendered by the chat template (prefix-diffed turns)" in result.stdout
    assert "6 of 24 examples held out for validation" in result.stdout
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert all(math.isfinite(s["loss"]) and s["loss"] > 0 for s in steps)
    val = [json.loads(line) for line in (run_dir / "val.jsonl").read_text().splitlines()]
    assert [v["steps"] for v in val] == [2, 4] and all(math.isfinite(v["val_loss"]) and v["val_loss"] > 0 for v in val)
    assert f"validation loss {val[-1]['val_loss']:.4f} after 4 steps" in result.stdout
