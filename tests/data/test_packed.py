"""Packed causal-LM data: tokenizers, corpora, packing invariants, collation, errors."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from resihp_lightning.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    HFTokenizer,
    PackedDataset,
    batch_workload,
    build_packed_dataset,
    collate_packed,
    iter_documents,
    load_tokenizer,
    stdlib_source_files,
    to_pipeline_batch,
    tokenize_documents,
)
from resihp_lightning.errors import ConfigError


def test_byte_tokenizer_round_trip_and_vocab():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓ 🐍'\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id]) == text
    assert tok.vocab_size == 259
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3
    assert min(tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) >= 256
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def _docs(lengths, seed=0):
    """Documents whose tokens are random ids < 200 followed by EOS (258)."""
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, 200, n - 1)) + [258] for n in lengths]


@pytest.mark.parametrize("seq_len", [8, 13, 64])
def test_packing_invariants(seq_len):
    lengths = [1, 5, 30, 2, 17, 8, 8, 41, 3, 1, 9]
    docs = _docs(lengths)
    ds = PackedDataset(docs, seq_len=seq_len, pad_token_id=256)
    stream = np.concatenate(docs)
    doc_of = np.repeat(np.arange(len(docs)), lengths)  # document index of every stream position
    assert ds.num_tokens == stream.size
    assert len(ds) == -(-stream.size // seq_len)
    real_tokens = []
    for r in range(len(ds)):
        row = ds[r]
        assert all(row[k].shape == (seq_len,) for k in ("input_ids", "position_ids", "labels"))
        assert row["seq_lens"].shape == (ds.max_docs,)
        lens = [int(n) for n in row["seq_lens"] if n > 0]
        assert (row["seq_lens"][len(lens):] == 0).all()  # zero padding only at the end
        real = sum(lens)
        base = r * seq_len
        assert torch.equal(row["input_ids"][:real], torch.from_numpy(stream[base : base + real]))
        assert (row["input_ids"][real:] == 256).all() and (row["labels"][real:] == IGNORE_INDEX).all()
        real_tokens.append(row["input_ids"][:real])
        start = 0
        for n in lens:
            seg_docs = doc_of[base + start : base + start + n]
            assert (seg_docs == seg_docs[0]).all()  # one document per segment
            assert torch.equal(row["position_ids"][start : start + n], torch.arange(n))
            assert torch.equal(row["labels"][start : start + n - 1], row["input_ids"][start + 1 : start + n])
            assert row["labels"][start + n - 1] == IGNORE_INDEX
            start += n
        # segments are maximal: adjacent segments belong to different documents
        starts = np.cumsum([0] + lens[:-1])
        assert len(set(doc_of[base + starts].tolist())) == len(lens)
    assert torch.equal(torch.cat(real_tokens), torch.from_numpy(stream))
    assert ds.max_docs == max(len(ds.segment_lengths(i)) for i in range(len(ds)))


def test_long_documents_are_split_into_chunks_and_end_with_eos():
    tok = ByteTokenizer()
    docs = tokenize_documents(["x" * 50, "", "yy"], tok)
    assert [d[-1] for d in docs] == [tok.eos_token_id] * 2  # the empty text is dropped
    ds = PackedDataset(docs, seq_len=16, pad_token_id=tok.pad_token_id)
    assert [ds.segment_lengths(i) for i in range(len(ds))] == [[16], [16], [16], [3, 3]]
    assert tokenize_documents(["abcdef", "ghijkl"], tok, max_tokens=9) == [
        list(b"abcdef") + [tok.eos_token_id], list(b"gh")
    ]


def test_collate_and_pipeline_batch():
    ds = PackedDataset(_docs([3, 9, 4, 20, 2]), seq_len=10, pad_token_id=256)
    batch = collate_packed([ds[i] for i in range(len(ds))])
    assert batch["input_ids"].shape == (len(ds), 10)
    assert batch["seq_lens"].shape == (len(ds), ds.max_docs)
    inputs, labels, seq_lens = to_pipeline_batch(batch)
    assert inputs[0] is batch["input_ids"] and inputs[1] is batch["position_ids"] and inputs[2] is seq_lens
    assert labels is batch["labels"]
    lens = [n for i in range(len(ds)) for n in ds.segment_lengths(i)]
    assert batch_workload(seq_lens) == (sum(lens), sum(n * n for n in lens))
    loader = torch.utils.data.DataLoader(ds, batch_size=3, collate_fn=collate_packed)
    assert [b["input_ids"].shape[0] for b in loader] == [3, len(ds) - 3]
    assert torch.equal(torch.cat([b["labels"] for b in loader]), batch["labels"])


def test_max_docs_fixed_width_and_too_small():
    docs = _docs([2, 2, 2, 2, 2])
    assert PackedDataset(docs, seq_len=10, pad_token_id=0, max_docs=7)[0]["seq_lens"].tolist() == [2] * 5 + [0, 0]
    with pytest.raises(ConfigError, match="data.max_docs"):
        PackedDataset(docs, seq_len=10, pad_token_id=0, max_docs=3)


def test_jsonl_folder_and_file_sources(tmp_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"text": "first"}) + "\n\n" + json.dumps({"text": "second", "id": 2}) + "\n")
    assert list(iter_documents(jsonl)) == ["first", "second"]
    folder = tmp_path / "f"
    (folder / "b").mkdir(parents=True)
    (folder / "b" / "z.txt").write_text("zz")
    (folder / "a.txt").write_text("aa")
    (folder / ".hidden").write_text("no")
    (folder / "blob.bin").write_bytes(b"\x00\x01binary")
    assert list(iter_documents(folder)) == ["aa", "zz"]
    assert list(iter_documents(folder, max_files=1)) == ["aa"]
    assert list(iter_documents(folder / "a.txt")) == ["aa"]
    ds = build_packed_dataset(ByteTokenizer(), seq_len=4, source=jsonl)
    assert ds.num_tokens == len("first") + len("second") + 2


def test_clear_errors_for_bad_data(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        list(iter_documents(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON"):
        list(iter_documents(bad))
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"body": "x"}\n')
    with pytest.raises(ConfigError, match="string field 'text'"):
        list(iter_documents(nofield))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="dataset is empty"):
        build_packed_dataset(ByteTokenizer(), seq_len=8, source=empty)
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "emptydir" / "e.txt").write_text("")
    with pytest.raises(ConfigError, match="dataset is empty"):
        build_packed_dataset(ByteTokenizer(), seq_len=8, source=tmp_path / "emptydir")
    with pytest.raises(ConfigError, match="dataset is empty"):
        PackedDataset([], seq_len=8, pad_token_id=0)
    with pytest.raises(ConfigError, match="data.seq_len"):
        PackedDataset([[1, 2]], seq_len=1, pad_token_id=0)


def test_stdlib_corpus_is_real_and_deterministic():
    files = stdlib_source_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 100
    assert files == stdlib_source_files()
    assert all(f.suffix == ".py" and root in f.parents for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert root / "os.py" in files
    a = build_packed_dataset(ByteTokenizer(), seq_len=256, max_files=20, max_tokens=50_000, shuffle_seed=1)
    b = build_packed_dataset(ByteTokenizer(), seq_len=256, max_files=20, max_tokens=50_000, shuffle_seed=1)
    assert a.num_tokens == 50_000 and np.array_equal(a.tokens, b.tokens)
    c = build_packed_dataset(ByteTokenizer(), seq_len=256, max_files=20, max_tokens=50_000)
    first = files[0].read_bytes()[:1000]
    assert bytes(c.tokens[:1000].tolist()) == first  # unshuffled: sorted order, first file first
    assert not np.array_equal(a.tokens, c.tokens)


def test_checkpoint_tokenizer_is_used_when_present(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1, "def": 2, "f": 3, "return": 4}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="[UNK]").save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_id == 1 and tok.pad_token_id == 1 and tok.vocab_size == 5
    assert tok.encode("def f return zz") == [2, 3, 4, 0]
    ds = PackedDataset(tokenize_documents(["def f", "return"], tok), seq_len=8, pad_token_id=tok.pad_token_id)
    assert ds[0]["input_ids"][:5].tolist() == [2, 3, 1, 4, 1]
    assert ds.segment_lengths(0) == [3, 2]
