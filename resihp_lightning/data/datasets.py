"""From data options to a training and an optional validation dataset.

:func:`build_datasets` reads a source in one of the formats (:data:`~resihp_lightning.data.instruction.FORMATS`):
raw ``text`` (:func:`~resihp_lightning.data.packed.build_packed_dataset`: documents + EOS, cut into
rows, every token a target) or instruction data (``prompt_completion`` / ``chat``,
:mod:`resihp_lightning.data.instruction`: whole examples per row, targets only on completions /
assistant turns). ``auto`` tells them apart by a JSONL file's first record.

The validation data is either a separate source (``val_source``, its format resolved the same way)
or a seeded random fraction of the training documents / examples (``val_fraction``), held out before
packing so that no document is in both. Both datasets get the same ``seq_lens`` width (``max_docs``):
every micro-batch through the pipeline has the same shapes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resihp_lightning.data.instruction import (
    INSTRUCTION_FORMATS,
    InstructionFields,
    InstructionStats,
    check_truncation,
    load_examples,
    resolve_format,
)
from resihp_lightning.data.packed import PackedDataset, read_text_documents
from resihp_lightning.data.tokenizer import Tokenizer
from resihp_lightning.errors import ConfigError, invalid_option


@dataclass
class Datasets:
    """The training dataset, the validation dataset (or ``None``) and what they hold."""

    train: PackedDataset
    val: PackedDataset | None
    format: str
    val_format: str | None = None
    stats: InstructionStats | None = None
    """instruction data: what reading the training source kept and cut (with a fraction held out: before the split)"""
    val_stats: InstructionStats | None = None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> list[str]:
        """Lines for the log: rows, documents and, for instruction data, what was truncated or dropped."""
        lines = [f"data: {_describe(self.train, self.format)}"] + [f"data: {n}" for n in self.notes]
        if self.val is not None:
            lines.append(f"validation: {_describe(self.val, self.val_format or self.format)}")
        return lines


def _describe(ds: PackedDataset, fmt: str) -> str:
    text = f"{len(ds)} rows of {ds.seq_len} tokens, {ds.num_docs} {_unit(fmt)} ({fmt}), {ds.num_tokens} tokens"
    if ds.targets is not None:
        text += f", {int(ds.targets.sum())} target tokens"
    return text


def check_val_fraction(value: Any, option: str = "data.val_fraction") -> float:
    """Returns ``value`` if it is a number in [0, 1), else raises naming ``option``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise invalid_option(option, value, "a number in [0, 1)")
    return float(value)


def holdout_indices(count: int, fraction: float, seed: int | None) -> set[int]:
    """Indices of the ``round(count * fraction)`` (at least one) items held out, drawn with ``seed``.

    Raises:
        ConfigError: nothing would be left for training.
    """
    k = max(1, round(count * fraction))
    if k >= count:
        raise ConfigError(
            f"data.val_fraction={fraction:g} of {count} documents leaves none for training; "
            "lower it or give data.val_source"
        )
    return set(random.Random(0 if seed is None else seed).sample(range(count), k))


def build_datasets(
    tokenizer: Tokenizer,
    seq_len: int,
    source: str | Path | None = None,
    format: str = "auto",
    fields: InstructionFields = InstructionFields(),
    truncation: str = "truncate",
    max_files: int | None = None,
    max_tokens: int | None = None,
    max_docs: int | None = None,
    shuffle_seed: int | None = None,
    val_source: str | Path | None = None,
    val_fraction: float = 0.0,
) -> Datasets:
    """The training and validation datasets of a source.

    Args:
        tokenizer: from :func:`resihp_lightning.data.tokenizer.load_tokenizer`.
        seq_len: tokens per row.
        source: a JSONL file, a folder, a text file, or ``None`` (the standard library's ``.py``
            files, text).
        format: ``auto``, ``text``, ``prompt_completion`` or ``chat``.
        fields: JSONL field names (``fields.text`` for text records).
        truncation: instruction examples longer than ``seq_len``: ``truncate`` or ``drop``.
        max_files: cap on files read from a folder (and the standard library).
        max_tokens: cap on tokens read (text: the last document is cut; instruction: whole examples).
        max_docs: width of ``seq_lens`` (``None``: the widest row of either dataset).
        shuffle_seed: text: the file order (see ``iter_documents``); also the seed of the held-out
            fraction.
        val_source: validation data read like ``source`` (caps do not apply to it).
        val_fraction: hold this fraction of the documents / examples out for validation instead.

    Raises:
        ConfigError: a bad option (naming it), a missing source, a bad record (naming file and
            line), or an empty dataset.
    """
    check_truncation(truncation)
    check_val_fraction(val_fraction)
    if max_tokens is not None and max_tokens < 1:
        raise invalid_option("data.max_tokens", max_tokens, "a positive integer or null")
    if val_source is not None and val_fraction:
        raise ConfigError("give data.val_source or data.val_fraction, not both")
    fmt = resolve_format(source, format, fields)
    docs, masks, stats = _read(tokenizer, seq_len, source, fmt, fields, truncation, max_files, max_tokens, shuffle_seed)
    val, notes = None, ([] if stats is None else [stats.summary(seq_len)])
    if val_fraction:
        held = holdout_indices(len(docs), val_fraction, shuffle_seed)
        val = _pack([d for i, d in enumerate(docs) if i in held],
                    None if masks is None else [m for i, m in enumerate(masks) if i in held], seq_len, tokenizer, None)
        notes.append(f"{len(held)} of {len(docs)} {_unit(fmt)} held out for validation (data.val_fraction={val_fraction:g})")
        docs = [d for i, d in enumerate(docs) if i not in held]
        masks = None if masks is None else [m for i, m in enumerate(masks) if i not in held]
    train = _pack(docs, masks, seq_len, tokenizer, max_docs)
    out = Datasets(train=train, val=val, format=fmt, val_format=fmt if val is not None else None, stats=stats,
                   notes=notes)
    if val_source is not None:
        val_fmt = resolve_format(val_source, format, fields)
        docs, masks, stats = _read(tokenizer, seq_len, val_source, val_fmt, fields, truncation, None, None, shuffle_seed)
        out.val, out.val_format, out.val_stats = _pack(docs, masks, seq_len, tokenizer, None), val_fmt, stats
        if stats is not None:
            out.notes.append(f"validation {stats.summary(seq_len)}")
    if out.val is not None:
        width = max(out.train.max_docs, out.val.max_docs)
        if max_docs is not None and width > max_docs:
            raise invalid_option("data.max_docs", max_docs, f"at least {width} (the most segments in a row)")
        # Both widths hold every row's segments; equal widths keep micro-batch shapes the same.
        out.train.max_docs = out.val.max_docs = width
    return out


def _unit(fmt: str) -> str:
    return "examples" if fmt in INSTRUCTION_FORMATS else "documents"


def _read(
    tokenizer: Tokenizer, seq_len: int, source: str | Path | None, fmt: str, fields: InstructionFields,
    truncation: str, max_files: int | None, max_tokens: int | None, shuffle_seed: int | None,
) -> tuple[list[list[int]], list[list[bool]] | None, InstructionStats | None]:
    """Token ids per document, target flags per document (``None`` for text) and instruction stats."""
    if fmt == "text":
        return read_text_documents(tokenizer, source, max_files, max_tokens, fields.text, shuffle_seed), None, None
    if source is None:
        raise ConfigError(f"data.format={fmt} needs data.source (a .jsonl file or a folder of them)")
    examples, stats = load_examples(source, tokenizer, seq_len, format=fmt, fields=fields, truncation=truncation,
                                    max_files=max_files, max_tokens=max_tokens)
    if not examples:
        raise ConfigError(f"the dataset is empty: no usable example in {str(source)!r} ({stats.summary(seq_len)})")
    return [e.ids for e in examples], [e.targets for e in examples], stats


def _pack(docs: list[list[int]], masks: list[list[bool]] | None, seq_len: int, tokenizer: Tokenizer,
          max_docs: int | None) -> PackedDataset:
    """Text documents split across rows; instruction examples (with masks) whole in one row."""
    return PackedDataset(docs, seq_len=seq_len, pad_token_id=tokenizer.pad_token_id, max_docs=max_docs,
                         loss_masks=masks, split_documents=masks is None)
