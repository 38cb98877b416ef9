"""Validation, test and predict batches through the pipeline: dealt out to replicas, results joined.

Evaluation batches may have any size. Their micro-batches (the last may be short) are dealt to the
replicas in proportion to their training micro-batch counts (``batching.eval_shares``); each replica
runs its share through ``eval_batch``; the results are joined so that every rank sees what one device
would: the mean loss over rows, or the last layer's outputs for every row in row order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from resihp_lightning.runtime import batching
from resihp_lightning.runtime.pipeline_runtime import PipelineRuntime


def run_share(
    runtime: PipelineRuntime, module: Any, batch: Any, micro_batch_size: int, compute_loss: bool
) -> tuple[batching.SplitBatch, list[batching.MicroBatch], list[Any] | None]:
    """Runs this replica's share of ``batch`` (collective).

    Returns:
        (the split batch, this replica's micro-batches, their losses or outputs on the last stage
        and ``None`` elsewhere).
    """
    split = batching.split_batch(module, batch)
    shares = batching.eval_shares(split.rows, micro_batch_size, [r.micro_batches for r in runtime.plan.replicas])
    offset, count = shares[runtime.position.replica]
    items = batching.micro_batches(split, offset, count, micro_batch_size)
    return split, items, runtime.eval_batch(items, compute_loss)


def mean_loss(items: list[batching.MicroBatch], losses: list[Any] | None, device: torch.device) -> Tensor:
    """The loss averaged over every row of the batch, on every rank (collective)."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for mb, loss in zip(items, losses or ()):
        sums[0] += float(loss.float()) * mb.rows
        sums[1] += mb.rows
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).float()


def joined_outputs(replica: int, outputs: list[Any] | None, device: torch.device) -> Any:
    """The last layer's outputs for the whole batch in row order, on every rank (collective)."""
    mine = (replica, [batching.to_cpu(out) for out in outputs]) if outputs is not None else None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    parts = [part for _, part in sorted(entry for entry in gathered if entry is not None)]
    return batching.to_device(batching.concat_rows([out for part in parts for out in part]), device)
