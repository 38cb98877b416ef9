"""The multi-process fixture really runs gloo collectives and turns hangs and crashes into failures."""

from __future__ import annotations

import os
import time

import pytest
from resihp_lightning.testing.multiproc import DistributedTestError

pytestmark = pytest.mark.multiprocess


def _all_reduce_rank_ids(rank: int, world_size: int) -> tuple[float, str]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return value.item(), os.environ["OMP_NUM_THREADS"]


def _rank_one_skips_the_collective(rank: int, world_size: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    if rank == 1:
        time.sleep(600)  # never joins: rank 0 blocks in all_reduce
    dist.all_reduce(torch.ones(1))


def _rank_two_raises(rank: int, world_size: int) -> None:
    if rank == 2:
        raise RuntimeError("rank two broke on purpose")
    time.sleep(600)


def test_collective_across_four_gloo_processes(distributed) -> None:
    results = distributed(_all_reduce_rank_ids, 4, timeout=120)
    assert results == [(6.0, "1")] * 4


def test_hung_collective_fails_within_timeout(distributed) -> None:
    started = time.monotonic()
    with pytest.raises(DistributedTestError, match="timed out"):
        distributed(_rank_one_skips_the_collective, 2, timeout=20)
    assert time.monotonic() - started < 40


def test_rank_exception_is_reported_with_its_traceback(distributed) -> None:
    with pytest.raises(DistributedTestError, match="rank 2 raised:(.|\n)*rank two broke on purpose"):
        distributed(_rank_two_raises, 3, timeout=60)
