"""The multi-process fixture really runs gloo collectives and turns hangs and crashes into failures."""

from __future__ import annotations

import os
import time
from multiprocessing import forkserver

import pytest

from resihp_lightning.testing.multiproc import DistributedTestError, rank_context

pytestmark = pytest.mark.multiprocess


def _all_reduce_rank_ids(rank: int, world_size: int) -> tuple[float, str, str | None, int]:
    import torch
    import torch.distributed as dist
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    dist.init_process_group("gloo")
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return value.item(), os.environ["OMP_NUM_THREADS"], os.environ.get("RESIHP_TEST_MARK"), rank_zero_only.rank


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


def test_collective_across_four_gloo_processes(distributed, monkeypatch) -> None:
    """Each rank sees the test process's environment at launch (not the fork server's, fixed when it
    started) and Lightning's rank-zero utilities know its rank, as in a rank that imported Lightning itself."""
    if rank_context().get_start_method() == "forkserver":
        forkserver.ensure_running()  # the server starts now, before the variable is set
    monkeypatch.setenv("RESIHP_TEST_MARK", "set-after-the-server-started")
    results = distributed(_all_reduce_rank_ids, 4, timeout=120)
    assert results == [(6.0, "1", "set-after-the-server-started", rank) for rank in range(4)]


def test_hung_collective_fails_within_timeout(distributed) -> None:
    # 4 s: ranks forked from the fork server start in well under a second; the hang is 600 s.
    started = time.monotonic()
    with pytest.raises(DistributedTestError, match="timed out"):
        distributed(_rank_one_skips_the_collective, 2, timeout=4)
    assert time.monotonic() - started < 15


def test_rank_exception_is_reported_with_its_traceback(distributed) -> None:
    with pytest.raises(DistributedTestError, match="rank 2 raised:(.|\n)*rank two broke on purpose"):
        distributed(_rank_two_raises, 3, timeout=60)
