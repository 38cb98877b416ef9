"""Packed causal-LM rows with per-document lengths.

Documents are tokenised, each followed by EOS, and concatenated into one token stream that is cut
into rows of ``seq_len`` tokens. A document that crosses a row boundary is split into chunks (one
per row); inside a row every chunk ("segment") is attended to on its own. Each row gives:

* ``input_ids`` ``[seq_len]`` — tokens; the tail of the last row is padded with ``pad_token_id``;
* ``position_ids`` ``[seq_len]`` — restart at 0 for every segment (0 on padding);
* ``labels`` ``[seq_len]`` — the next token of the same segment, ``-100`` on each segment's last
  token and on padding (already shifted: the loss does not shift again);
* ``seq_lens`` ``[max_docs]`` — segment lengths in order, zero-padded to a width fixed for the
  whole dataset (so every micro-batch has the same shapes, which pipeline p2p needs).

The attention work of a row is Σ seq_lens²; :func:`batch_workload` gives (tokens, Σ len²) for the
straggler detector.

Instruction data (:mod:`resihp_lightning.data.instruction`) uses two options of
:class:`PackedDataset`: per-document *loss masks* (a label is kept only where the token it predicts
is a target, e.g. a completion token; prompt tokens get ``-100``) and ``split_documents=False``
(every document stays whole in one row, so a completion always sees its prompt; rows are filled
with whole documents in order and the rest of a row is padding). Without them, packing is as above.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from resihp_lightning.data.corpus import iter_documents
from resihp_lightning.data.tokenizer import Tokenizer
from resihp_lightning.errors import ConfigError, invalid_option

IGNORE_INDEX = -100


class PackedDataset(Dataset):
    """Rows of ``seq_len`` tokens packed from tokenised documents.

    Args:
        documents: token ids of each document, EOS already appended.
        seq_len: tokens per row.
        pad_token_id: id used for the padding at the end of a row.
        max_docs: width of ``seq_lens``; ``None`` uses the largest segment count of any row.
        loss_masks: per document, one flag per token: ``True`` where the token is a target (its
            prediction from the tokens before it in the same segment is trained). ``labels[t]`` is
            ``-100`` wherever token ``t + 1`` is not a target. ``None``: every token is a target.
        split_documents: ``True`` cuts the token stream into rows wherever ``seq_len`` falls (a
            document may continue in the next row); ``False`` keeps every document whole in one row
            (rows take whole documents in order, padded at the end), which needs every document to
            be at most ``seq_len`` tokens.

    Raises:
        ConfigError: no tokens at all, a bad ``seq_len``, a row with more than ``max_docs``
            segments, masks that do not match the documents, or (``split_documents=False``) a
            document longer than ``seq_len``.
    """

    def __init__(
        self,
        documents: Iterable[Sequence[int]],
        seq_len: int,
        pad_token_id: int,
        max_docs: int | None = None,
        loss_masks: Iterable[Sequence[bool]] | None = None,
        split_documents: bool = True,
    ) -> None:
        if not isinstance(seq_len, int) or seq_len < 2:
            raise invalid_option("data.seq_len", seq_len, "an integer >= 2")
        documents = list(documents)
        masks = None if loss_masks is None else list(loss_masks)
        if masks is not None and (
            len(masks) != len(documents) or any(len(m) != len(d) for m, d in zip(masks, documents))
        ):
            raise ConfigError("loss_masks must hold one flag per token of every document")
        keep = [i for i, d in enumerate(documents) if len(d) > 0]
        chunks = [np.asarray(documents[i], dtype=np.int64) for i in keep]
        if not chunks:
            raise ConfigError("the dataset is empty: the data source produced no tokens")
        self.tokens = np.concatenate(chunks)
        self.targets = None if masks is None else np.concatenate([np.asarray(masks[i], dtype=bool) for i in keep])
        self.doc_ends = np.cumsum([len(c) for c in chunks])
        self.seq_len = seq_len
        self.pad_token_id = int(pad_token_id)
        total = int(self.tokens.size)
        self.num_docs = len(chunks)
        self._seg_lens: list[list[int]] = []
        self._row_starts: list[int] = []
        if split_documents:
            ends = self.doc_ends.tolist()
            for start in range(0, total, seq_len):
                stop = min(start + seq_len, total)
                lens, pos = [], start
                i = bisect.bisect_right(ends, start)
                while pos < stop:
                    end = min(ends[i], stop)
                    lens.append(end - pos)
                    pos = end
                    i += 1
                self._seg_lens.append(lens)
                self._row_starts.append(start)
        else:
            longest = max(len(c) for c in chunks)
            if longest > seq_len:
                raise ConfigError(
                    f"a document of {longest} tokens does not fit a row of data.seq_len={seq_len} tokens "
                    "(documents that must stay whole are truncated or dropped first)"
                )
            start = 0
            for chunk in chunks:
                if not self._seg_lens or sum(self._seg_lens[-1]) + len(chunk) > seq_len:
                    self._seg_lens.append([])
                    self._row_starts.append(start)
                self._seg_lens[-1].append(len(chunk))
                start += len(chunk)
        widest = max(len(lens) for lens in self._seg_lens)
        if max_docs is None:
            max_docs = widest
        elif widest > max_docs:
            raise invalid_option("data.max_docs", max_docs, f"at least {widest} (the most segments in a row)")
        self.max_docs = int(max_docs)

    def __len__(self) -> int:
        return len(self._seg_lens)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in the dataset."""
        return int(self.tokens.size)

    def segment_lengths(self, index: int) -> list[int]:
        """Lengths of the segments of row ``index``."""
        return list(self._seg_lens[index])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = self._row_starts[index]
        lens = self._seg_lens[index]
        real = sum(lens)
        input_ids = torch.full((self.seq_len,), self.pad_token_id, dtype=torch.long)
        input_ids[:real] = torch.from_numpy(self.tokens[start : start + real])
        position_ids = torch.zeros(self.seq_len, dtype=torch.long)
        labels = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        pos = 0
        for n in lens:
            position_ids[pos : pos + n] = torch.arange(n)
            labels[pos : pos + n - 1] = input_ids[pos + 1 : pos + n]
            pos += n
        if self.targets is not None:  # keep a label only where the token it predicts is a target
            targets = torch.zeros(self.seq_len, dtype=torch.bool)
            targets[: real - 1] = torch.from_numpy(self.targets[start + 1 : start + real])
            labels[~targets] = IGNORE_INDEX
        seq_lens = torch.zeros(self.max_docs, dtype=torch.long)
        seq_lens[: len(lens)] = torch.tensor(lens, dtype=torch.long)
        return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels, "seq_lens": seq_lens}


def tokenize_documents(
    texts: Iterable[str], tokenizer: Tokenizer, max_tokens: int | None = None
) -> list[list[int]]:
    """Tokenises documents, appending EOS to each; empty texts are skipped.

    Args:
        texts: the documents.
        tokenizer: the tokenizer.
        max_tokens: stop once this many tokens are collected (the last document is cut there).

    Returns:
        Token ids per document.
    """
    docs: list[list[int]] = []
    total = 0
    for text in texts:
        if max_tokens is not None and total >= max_tokens:
            break
        if not text:
            continue
        ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
        if max_tokens is not None and total + len(ids) > max_tokens:
            ids = ids[: max_tokens - total]
        docs.append(ids)
        total += len(ids)
    return docs


def build_packed_dataset(
    tokenizer: Tokenizer,
    seq_len: int,
    source: str | Path | None = None,
    max_files: int | None = None,
    max_tokens: int | None = None,
    max_docs: int | None = None,
    text_field: str = "text",
    shuffle_seed: int | None = None,
) -> PackedDataset:
    """Reads a corpus, tokenises it and packs it into rows.

    Args:
        tokenizer: from :func:`resihp_lightning.data.tokenizer.load_tokenizer`.
        seq_len: tokens per row.
        source: JSONL file, folder of text files, text file, or ``None`` for the standard library's
            ``.py`` files (see :func:`resihp_lightning.data.corpus.iter_documents`).
        max_files: cap on files read.
        max_tokens: cap on tokens kept.
        max_docs: width of ``seq_lens`` (``None``: computed).
        text_field: JSONL field with the text.
        shuffle_seed: read files in a seeded permutation (see ``iter_documents``).

    Raises:
        ConfigError: missing source, malformed JSONL, or no tokens.
    """
    if max_tokens is not None and max_tokens < 1:
        raise invalid_option("data.max_tokens", max_tokens, "a positive integer or null")
    docs = read_text_documents(tokenizer, source, max_files, max_tokens, text_field, shuffle_seed)
    return PackedDataset(docs, seq_len=seq_len, pad_token_id=tokenizer.pad_token_id, max_docs=max_docs)


def read_text_documents(
    tokenizer: Tokenizer,
    source: str | Path | None,
    max_files: int | None,
    max_tokens: int | None,
    text_field: str,
    shuffle_seed: int | None,
) -> list[list[int]]:
    """A raw-text corpus's documents as token ids (EOS appended; see :func:`build_packed_dataset`).

    Raises:
        ConfigError: missing source, malformed JSONL, or no text at all.
    """
    texts = iter_documents(source, max_files=max_files, text_field=text_field, shuffle_seed=shuffle_seed)
    docs = tokenize_documents(texts, tokenizer, max_tokens=max_tokens)
    if not docs:
        where = "the standard library" if source is None else repr(str(source))
        raise ConfigError(f"the dataset is empty: no text found in {where}")
    return docs


def collate_packed(rows: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """DataLoader ``collate_fn``: stacks rows into ``[rows, ...]`` tensors (same keys)."""
    if not rows:
        raise ConfigError("cannot collate an empty batch")
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def to_pipeline_batch(
    batch: Mapping[str, torch.Tensor],
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Splits a collated batch into the strategy's ``(inputs, labels, seq_lens)``.

    ``inputs`` is ``(input_ids, position_ids, seq_lens)``, what the first pipeline layer
    (:class:`resihp_lightning.models.layers.EmbeddingPipe`) takes.
    """
    seq_lens = batch["seq_lens"]
    return (batch["input_ids"], batch["position_ids"], seq_lens), batch["labels"], seq_lens


def batch_workload(seq_lens: torch.Tensor) -> tuple[int, int]:
    """``(tokens, Σ len²)`` of a batch's ``seq_lens`` (padding excluded)."""
    lens = seq_lens.to(torch.long)
    return int(lens.sum()), int((lens * lens).sum())
