"""A send that gloo does not release when its connection is cut is released by the abort.

Two real gloo processes under :class:`~resihp_lightning.resilience.world.ElasticWorld`. Rank 1 posts a
64 MB receive from rank 0 (a ``recv``, or its part of a ``broadcast`` from rank 0) and stops itself
(SIGSTOP) before reading it; rank 0 sends the 64 MB (``send``, or ``broadcast``: a collective, which gloo
runs in a worker thread): the socket buffers fill and the rest of the message waits in gloo's write
queue, which is what gloo does not wake when the connection fails. Rank 0's detector finds rank 1 silent
after ``detect_timeout_s`` and aborts the generation (connections cut, waits released); rank 0 must
leave its call at once, regroup alone (the aborted group, whose worker thread is still blocked, is not
destroyed: that would wait for it) and kill the stopped rank (``kill_evicted``). Before the waits were
abortable it stayed in the call until the group's timeout (``collective_timeout_s``, 20 s here). While it waits, the hang check
counts its main thread as waiting in communication, as it did before the wait moved to a waiter thread.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from resihp_lightning.testing.harness import last_words, run_job

ELEMENTS = 16_000_000  # 64 MB of float32: more than the sockets' buffers hold
COLLECTIVE_TIMEOUT_S = 20.0


def _job(rank: int, world_size: int, run_dir: str, op: str) -> dict:
    import torch
    import torch.distributed as dist

    from resihp_lightning.resilience import ElasticWorld, PeerFailure, StoreConfig, WorldConfig

    world = ElasticWorld(WorldConfig(store=StoreConfig(run_dir=run_dir, linger_s=1.0), join_timeout_s=5.0,
                                     regroup_timeout_s=20.0, collective_timeout_s=COLLECTIVE_TIMEOUT_S)).start()
    with world.guard():
        dist.barrier()
    if rank == 1:
        if op == "send":  # its "ready to receive" goes out now
            dist.irecv(torch.empty(ELEMENTS), 0)
        else:
            dist.broadcast(torch.empty(ELEMENTS), 0, async_op=True)
        time.sleep(0.3)
        last_words(run_dir, rank, at=time.monotonic())
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
        raise AssertionError("rank 1 outlived its stop")
    import threading

    from resihp_lightning.resilience.failure_detector import DEFAULT_COMM_FRAMES, main_thread_waiting

    seen = {}

    def look() -> None:  # what the hang check sees of the main thread while it waits in the send
        time.sleep(0.5)
        seen["waiting"] = main_thread_waiting(threading.main_thread().ident, DEFAULT_COMM_FRAMES, 3)

    from resihp_lightning.resilience.procs import STOPPED

    peer = world.detector.identities[1]
    deadline = time.monotonic() + 30
    while peer.status() != STOPPED:  # it posted its receive and stopped: nothing will read what is sent
        assert time.monotonic() < deadline, "rank 1 did not stop"
        time.sleep(0.01)
    threading.Thread(target=look, daemon=True).start()  # looks 0.5 s into the send, not into this wait
    started = time.monotonic()
    try:
        with world.guard():
            if op == "send":
                dist.send(torch.ones(ELEMENTS), 1)
            else:
                dist.broadcast(torch.ones(ELEMENTS), 0)
        return {"sent": True}
    except PeerFailure as failure:
        released = time.monotonic()
        aborts = [h for h in world.history if h["event"] == "abort"]
        world.regroup()
        result = {"started": started, "released": released, "aborted": aborts[0]["at"], "failed": dict(failure.failed),
                  "members": list(world.members), "waits_released": world._waits.released, **seen}
    # The failure's traceback held the aborted group; nothing may wait for its blocked worker thread now either.
    import gc

    gc.collect()
    result["regrouped"] = time.monotonic()
    world.close()
    result["closed"] = time.monotonic()
    return result


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("op", ["send", "broadcast"])
def test_a_send_blocked_on_a_stopped_peer_is_released_by_the_abort(op):
    outcome = run_job(_job, 2, timeout=60, wait_for=[0], op=op)
    values = outcome.values()
    assert 0 in values, outcome.describe()
    result = values[0]
    stopped = next(r.last_words for r in outcome.ranks if r.rank == 1)["at"]
    assert "released" in result, result  # the send did not complete: its receiver stopped
    assert result["failed"] == {1: "silent"} and result["members"] == [0], result
    assert result["waits_released"] >= 1, result
    assert result["waiting"], result  # a wait handed to the waiter thread still counts as communication
    # Freed at the abort (the detector's 1 s, a poll, load), not at the group's timeout; neither the regroup
    # nor dropping the failure (and with it the aborted group) waits for gloo's blocked worker thread.
    assert result["released"] - result["aborted"] < 1.0, result
    # (8 s: a regroup on a loaded machine took 3.9 s once; a wait for that thread lasts the group's 20 s timeout.)
    assert result["regrouped"] - result["released"] < 8.0 < COLLECTIVE_TIMEOUT_S, result
    assert result["closed"] - result["regrouped"] < 8.0, result
    assert result["released"] - stopped < 6.0 < COLLECTIVE_TIMEOUT_S, (result, stopped)


STEPS_OF_SLICES = 1000


def _many_small_collectives(rank: int, world_size: int) -> list[float]:
    import random

    import torch
    import torch.distributed as dist

    from resihp_lightning.resilience.abortable_waits import AbortableWaits

    # Slices of 1 ms (the least: a wait takes whole milliseconds) against a peer that joins each all_reduce 0-5 ms
    # late: many slices run out, and now and then the collective completes between a slice's end and the look
    # at it (the old code failed about one run in two with 300 collectives).
    dist.init_process_group("gloo")
    waits = AbortableWaits(current=lambda: "generation", aborted=lambda token: False, slice_s=1e-3).install()
    rng = random.Random(rank)
    sums = []
    try:
        for step in range(STEPS_OF_SLICES):
            if rank == 1:
                time.sleep(rng.uniform(0.0, 0.005))
            value = torch.tensor([float(step + rank)])
            dist.all_reduce(value)
            sums.append(float(value))
    finally:
        waits.uninstall()
        dist.destroy_process_group()
    return sums


@pytest.mark.multiprocess
def test_a_collective_that_completes_as_its_wait_slice_runs_out_is_no_failure(distributed):
    """A slice's "Operation timed out!" raced with the collective's completion once and failed a healthy
    collective (a false abort of the generation under load); every sum must arrive."""
    results = distributed(_many_small_collectives, 2, timeout=60)
    assert results[0] == results[1] == [float(2 * step + 1) for step in range(STEPS_OF_SLICES)]
