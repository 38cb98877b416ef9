"""Slicing the global batch into each replica's micro-batches.

Every rank receives the same global batch (the sampler does not shard by rank). Replica r trains on
rows ``offset_r .. offset_r + m_r * micro_batch_size`` where ``offset_r`` counts the rows of the
replicas before it, so changing D or the per-replica counts m_r needs no new DataLoader.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from resihp_lightning.errors import ConfigError


@dataclass(frozen=True)
class SplitBatch:
    """A global batch in the strategy's terms.

    Attributes:
        inputs: tensors for the first stage, rows on dim 0.
        labels: what ``pipeline_loss`` gets on the last stage (a tensor or a tuple of tensors).
        seq_lens: optional ``[rows, max_docs]`` per-document lengths (zero padded).
    """

    inputs: tuple[Tensor, ...]
    labels: Any
    seq_lens: Tensor | None

    @property
    def rows(self) -> int:
        return int(self.inputs[0].shape[0])


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a replica plus its workload (tokens and sum of squared document lengths)."""

    inputs: tuple[Tensor, ...]
    labels: Any
    rows: int
    tokens: int
    sum_len_sq: int

    def as_pipeline_item(self) -> tuple[Any, Any]:
        """The ``(inputs, labels)`` pair DeepSpeed's ``PipelineEngine`` reads."""
        inputs = self.inputs[0] if len(self.inputs) == 1 else self.inputs
        return inputs, self.labels


def split_batch(module: Any, batch: Any) -> SplitBatch:
    """Applies the module's ``pipeline_batch`` and checks the result."""
    parts = module.pipeline_batch(batch)
    if not isinstance(parts, (tuple, list)) or len(parts) != 3:
        raise ConfigError("pipeline_batch must return (inputs, labels, seq_lens); got " f"{type(parts).__name__}")
    inputs, labels, seq_lens = parts
    if isinstance(inputs, Tensor):
        inputs = (inputs,)
    inputs = tuple(inputs)
    if not inputs or not all(isinstance(t, Tensor) for t in inputs):
        raise ConfigError("pipeline_batch must return inputs as a tensor or a tuple of tensors")
    rows = int(inputs[0].shape[0])
    for t in inputs:
        if int(t.shape[0]) != rows:
            raise ConfigError(f"all input tensors must have the same rows on dim 0; got {[int(x.shape[0]) for x in inputs]}")
    return SplitBatch(inputs, labels, seq_lens)


def _rows(value: Any, start: int, stop: int) -> Any:
    if isinstance(value, Tensor):
        return value[start:stop]
    if isinstance(value, (tuple, list)):
        return tuple(_rows(v, start, stop) for v in value)
    return value


def workload(inputs: Sequence[Tensor], seq_lens: Tensor | None, start: int, stop: int) -> tuple[int, int]:
    """Tokens and sum of squared document lengths of rows ``start..stop-1``.

    Without ``seq_lens`` each row counts as one document of the inputs' second dimension (1 for
    one-dimensional inputs).
    """
    if seq_lens is not None:
        lens = seq_lens[start:stop].to(torch.long)
        return int(lens.sum()), int((lens * lens).sum())
    first = inputs[0]
    length = int(first.shape[1]) if first.dim() >= 2 else 1
    rows = stop - start
    return rows * length, rows * length * length


def micro_batches(split: SplitBatch, offset: int, count: int, micro_batch_size: int) -> list[MicroBatch]:
    """``count`` micro-batches of ``micro_batch_size`` rows starting at row ``offset``."""
    out = []
    for i in range(count):
        start = offset + i * micro_batch_size
        stop = min(start + micro_batch_size, split.rows)
        tokens, sum_len_sq = workload(split.inputs, split.seq_lens, start, stop)
        out.append(
            MicroBatch(
                inputs=tuple(t[start:stop] for t in split.inputs),
                labels=_rows(split.labels, start, stop),
                rows=stop - start,
                tokens=tokens,
                sum_len_sq=sum_len_sq,
            )
        )
    return out


def cast_inputs(items: Sequence[MicroBatch], dtype: torch.dtype) -> list[MicroBatch]:
    """``items`` with floating-point inputs in ``dtype`` (the engine's bf16 / fp16 parameters need them).

    Integer inputs (token ids, positions) and labels are left as they are.
    """
    return [
        replace(mb, inputs=tuple(t.to(dtype) if t.is_floating_point() else t for t in mb.inputs)) for mb in items
    ]


def eval_shares(rows: int, micro_batch_size: int, weights: Sequence[int]) -> list[tuple[int, int]]:
    """Splits an evaluation batch of ``rows`` rows into per-replica (row offset, micro-batch count).

    Micro-batches (the last may be short) are dealt to replicas in proportion to ``weights`` (their
    training micro-batch counts); a replica may get none when the batch is small.
    """
    total = -(-rows // micro_batch_size)
    weight_sum = sum(weights)
    counts = [total * w // weight_sum for w in weights]
    # Hand the remainder out by largest fractional part, then earliest replica.
    rest = total - sum(counts)
    order = sorted(range(len(weights)), key=lambda r: (-(total * weights[r] % weight_sum), r))
    for r in order[:rest]:
        counts[r] += 1
    shares, offset = [], 0
    for count in counts:
        shares.append((offset * micro_batch_size, count))
        offset += count
    return shares


def to_cpu(value: Any) -> Any:
    """A last-stage output (a tensor or a list of tensors), detached, on the CPU (to gather it)."""
    if isinstance(value, Tensor):
        return value.detach().cpu()
    return [to_cpu(v) for v in value]


def to_device(value: Any, device: torch.device) -> Any:
    """:func:`concat_rows`'s result on ``device`` (lists become tuples)."""
    if isinstance(value, Tensor):
        return value.to(device)
    return tuple(to_device(v, device) for v in value)


def concat_rows(outputs: Sequence[Any]) -> Any:
    """Joins per-micro-batch outputs (tensors, or lists of tensors) along rows."""
    if isinstance(outputs[0], Tensor):
        return torch.cat(list(outputs), dim=0)
    return tuple(torch.cat([out[i] for out in outputs], dim=0) for i in range(len(outputs[0])))


def iterate(items: Sequence[MicroBatch]) -> Iterator[tuple[Any, Any]]:
    """The iterator handed to ``train_batch`` / ``eval_batch``."""
    return iter([mb.as_pipeline_item() for mb in items])


def check_train_loader(loader: Any, micro_batch_size: int, micro_batches: int | None, batches_used: float) -> None:
    """Finds batch-size problems of a training DataLoader before the first step, where its attributes allow.

    Every training batch must hold M x ``micro_batch_size`` rows. A ``DataLoader`` with a
    ``batch_size`` tells the size up front; a dataset whose length it does not divide ends each epoch
    with a short batch unless ``drop_last=True``.

    Args:
        loader: ``trainer.train_dataloader``; anything but a ``torch.utils.data.DataLoader`` with a
            ``batch_size`` is not checked here (the first step checks its batches).
        micro_batch_size: rows per micro-batch.
        micro_batches: M when fixed by the options, else ``None``.
        batches_used: how many batches of an epoch training reads (``trainer.num_training_batches``).

    Raises:
        ConfigError: naming the DataLoader setting to change.
    """
    if not isinstance(loader, DataLoader) or not loader.batch_size:
        return
    size = int(loader.batch_size)
    if size % micro_batch_size:
        raise ConfigError(
            f"the training DataLoader's batch_size={size} is not a multiple of micro_batch_size={micro_batch_size}"
        )
    if micro_batches is not None and size != micro_batches * micro_batch_size:
        raise ConfigError(
            f"the training DataLoader's batch_size={size} must be micro_batches x micro_batch_size = "
            f"{micro_batches} x {micro_batch_size} = {micro_batches * micro_batch_size}"
        )
    try:
        rows = len(loader.dataset)
        full = len(loader)
    except TypeError:  # an iterable dataset: no length
        return
    if not loader.drop_last and rows % size and batches_used >= full:
        raise ConfigError(
            f"the training DataLoader's last batch of each epoch has {rows % size} rows ({rows} rows in batches of "
            f"{size}); every batch must have {size}: set drop_last=True on the DataLoader"
        )
