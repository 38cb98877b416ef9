"""A send that gloo does not release when its connection is cut is released by the abort.

Two real gloo processes under :class:`~resihp_lightning.resilience.world.ElasticWorld`. Rank 1 posts a
64 MB receive from rank 0 and stops itself (SIGSTOP) before reading it; rank 0 sends the 64 MB: the
socket buffers fill and the rest of the message waits in gloo's write queue, which is what gloo does not
wake when the connection fails. Rank 0's detector finds rank 1 silent after ``detect_timeout_s`` and
aborts the generation (connections cut, waits released); rank 0 must leave its send at once, regroup
alone and kill the stopped rank (``kill_evicted``). Before the waits were abortable it stayed in the
send until the group's timeout (``collective_timeout_s``, 20 s here).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from resihp_lightning.testing.harness import last_words, run_job

ELEMENTS = 16_000_000  # 64 MB of float32: more than the sockets' buffers hold
COLLECTIVE_TIMEOUT_S = 20.0


def _job(rank: int, world_size: int, run_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    from resihp_lightning.resilience import ElasticWorld, PeerFailure, StoreConfig, WorldConfig

    world = ElasticWorld(WorldConfig(store=StoreConfig(run_dir=run_dir, linger_s=1.0), join_timeout_s=5.0,
                                     regroup_timeout_s=20.0, collective_timeout_s=COLLECTIVE_TIMEOUT_S)).start()
    with world.guard():
        dist.barrier()
    if rank == 1:
        dist.irecv(torch.empty(ELEMENTS), 0)  # its "ready to receive" goes out now
        time.sleep(0.3)
        last_words(run_dir, rank, at=time.monotonic())
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
        raise AssertionError("rank 1 outlived its stop")
    started = time.monotonic()
    try:
        with world.guard():
            dist.send(torch.ones(ELEMENTS), 1)
        return {"sent": True}
    except PeerFailure as failure:
        released = time.monotonic()
        aborts = [h for h in world.history if h["event"] == "abort"]
        world.regroup()
        result = {"started": started, "released": released, "aborted": aborts[0]["at"], "failed": dict(failure.failed),
                  "members": list(world.members), "waits_released": world._waits.released}
        world.close()
        return result


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_send_blocked_on_a_stopped_peer_is_released_by_the_abort():
    outcome = run_job(_job, 2, timeout=60, wait_for=[0])
    values = outcome.values()
    assert 0 in values, outcome.describe()
    result = values[0]
    stopped = next(r.last_words for r in outcome.ranks if r.rank == 1)["at"]
    assert "released" in result, result  # the send did not complete: its receiver stopped
    assert result["failed"] == {1: "silent"} and result["members"] == [0], result
    assert result["waits_released"] >= 1, result
    # Freed at the abort (the detector's 1 s, a poll, load), not at the group's timeout.
    assert result["released"] - result["aborted"] < 1.0, result
    assert result["released"] - stopped < 6.0 < COLLECTIVE_TIMEOUT_S, (result, stopped)
