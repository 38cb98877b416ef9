"""A global batch cut into micro-batches and evaluation shares (``resihp_lightning.runtime.batching``)."""

from __future__ import annotations

import itertools

import pytest
import torch

from resihp_lightning.errors import ConfigError
from resihp_lightning.runtime import batching


def test_micro_batches_slice_rows_and_workload():
    x = torch.arange(24.0).reshape(8, 3)
    y = torch.arange(8)
    seq = torch.tensor([[3, 0], [1, 2], [3, 0], [2, 1], [3, 0], [3, 0], [1, 1], [2, 0]])
    split = batching.SplitBatch((x,), y, seq)
    items = batching.micro_batches(split, offset=2, count=3, micro_batch_size=2)
    assert [mb.labels.tolist() for mb in items] == [[2, 3], [4, 5], [6, 7]]
    assert torch.equal(items[0].inputs[0], x[2:4])
    assert [(mb.tokens, mb.sum_len_sq) for mb in items] == [(6, 9 + 4 + 1), (6, 18), (4, 1 + 1 + 4)]
    no_lens = batching.micro_batches(batching.SplitBatch((x,), (y, y), None), 0, 1, 4)
    assert (no_lens[0].tokens, no_lens[0].sum_len_sq) == (4 * 3, 4 * 9)
    assert isinstance(no_lens[0].labels, tuple) and no_lens[0].labels[1].tolist() == [0, 1, 2, 3]


def test_eval_shares_cover_the_batch_in_proportion():
    for rows, mbs, weights in itertools.product([1, 5, 10, 17, 64], [1, 2, 4], [(1,), (2, 2), (3, 1), (1, 1, 1, 5)]):
        shares = batching.eval_shares(rows, mbs, weights)
        total = -(-rows // mbs)
        assert sum(count for _, count in shares) == total
        offset = 0
        for (start, count), w in zip(shares, weights):
            assert start == offset * mbs
            assert abs(count - total * w / sum(weights)) < 1
            offset += count


def test_split_batch_checks_the_module_output():
    class Module:
        def __init__(self, out):
            self.out = out

        def pipeline_batch(self, batch):
            return self.out

    assert batching.split_batch(Module((torch.zeros(4, 2), torch.zeros(4), None)), None).rows == 4
    with pytest.raises(ConfigError, match="pipeline_batch must return"):
        batching.split_batch(Module((torch.zeros(4, 2), torch.zeros(4))), None)
    with pytest.raises(ConfigError, match="same rows"):
        batching.split_batch(Module(((torch.zeros(4, 2), torch.zeros(3, 2)), torch.zeros(4), None)), None)
