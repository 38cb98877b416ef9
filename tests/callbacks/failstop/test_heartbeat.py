"""Fail-stop detection with real processes: a rank dies (os._exit), a survivor reports exactly it in time.

The ``distributed`` fixture treats a rank that exits without a result as a test failure, which is
what this test needs to cause on purpose; so the dying job is started here with the same recipe
(processes from the fixture's fork server, torchrun-style environment, a hard timeout that kills
everything) and results returned through a queue.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest

from resihp_lightning.testing.multiproc import free_port, rank_context
from resihp_lightning.callbacks.events import EventLog, read_events
from resihp_lightning.callbacks.failstop.heartbeat import Heartbeat, HeartbeatConfig
from resihp_lightning.errors import ConfigError

INTERVAL, TIMEOUT = 0.2, 1.0


# Rank 2 dies 1 s after the start, then rank 0 (which hosts the heartbeat store) 2.5 s later.
DEATHS = {2: 1.0, 0: 3.5}


def _member(rank, world, port, pg_port, log_dir, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=5),
        )
        events = EventLog(log_dir, rank=rank)
        config = HeartbeatConfig(interval_s=INTERVAL, timeout_s=TIMEOUT, monitor="all")
        heartbeat = Heartbeat(config, events=events).start()  # port picked by rank 0, broadcast
        dist.barrier()
        begin = time.monotonic()
        if rank in DEATHS:
            time.sleep(DEATHS[rank])
            with open(os.path.join(log_dir, f"death{rank}"), "w") as handle:
                handle.write(repr(time.time()))
            os._exit(0)
        deadline = begin + max(DEATHS.values()) + TIMEOUT + 3 * INTERVAL + 3.0
        while len(heartbeat.dead) < len(DEATHS) and time.monotonic() < deadline:
            time.sleep(0.05)
        # The job must not hang in a collective with dead peers: gloo fails it (at the latest at
        # the 5 s process-group timeout).
        started = time.monotonic()
        try:
            dist.barrier()
            collective = "returned"
        except RuntimeError:
            collective = "raised"
        queue.put((rank, dict(heartbeat.dead), collective, time.monotonic() - started))
    except BaseException as err:  # noqa: BLE001
        queue.put((rank, f"error: {err!r}", None, None))
    queue.close()
    queue.join_thread()  # flush before os._exit skips the queue's feeder thread
    os._exit(0)


def _run_job(world, tmp_path):
    ctx = rank_context()
    queue = ctx.Queue()
    port, pg_port = free_port(), free_port()
    procs = [ctx.Process(target=_member, args=(r, world, port, pg_port, str(tmp_path), queue), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    results = {}
    survivors = world - len(DEATHS)
    try:
        deadline = time.monotonic() + 50
        while len(results) < survivors and time.monotonic() < deadline:
            try:
                rank, *rest = queue.get(timeout=0.5)
                results[rank] = rest
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
    finally:
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)
    assert len(results) == survivors, f"survivors hung or died: got results from {sorted(results)}"
    deaths = {rank: float((tmp_path / f"death{rank}").read_text()) for rank in DEATHS}
    return results, deaths


@pytest.mark.multiprocess
def test_survivors_report_exactly_the_dead_ranks_in_time_and_do_not_hang(tmp_path):
    """4 ranks; a peer dies, then the store's host: both are reported by every survivor within
    timeout_s + interval_s, nobody else is, and a collective afterwards fails instead of hanging."""
    results, deaths = _run_job(4, tmp_path)
    assert sorted(results) == [1, 3]
    for rank, (dead, collective, collective_s) in results.items():
        assert isinstance(dead, dict), dead
        assert sorted(dead) == [0, 2], f"rank {rank} reported {dead}"
        for victim, died in deaths.items():
            latency = dead[victim] - died
            assert 0 < latency <= TIMEOUT + INTERVAL + 1.5, f"rank {rank} reported {victim} after {latency:.2f} s"
        assert collective == "raised" and collective_s < 6.0
    logged = [e for e in read_events(tmp_path) if e["event"] == "fail_stop_detected"]
    assert {e["rank"] for e in logged} == {0, 2}
    assert {e["reporter"] for e in logged if e["rank"] == 0} == {1, 3}


def test_config_is_validated():
    with pytest.raises(ConfigError, match="heartbeat.timeout_s"):
        HeartbeatConfig(interval_s=2.0, timeout_s=1.0)
    with pytest.raises(ConfigError, match="heartbeat.on_failure"):
        HeartbeatConfig(on_failure="reboot")
    with pytest.raises(ConfigError, match="heartbeat.monitor"):
        HeartbeatConfig(monitor="some")


def test_hung_training_loop_is_reported_when_progress_is_watched(tmp_path):
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    config = HeartbeatConfig(interval_s=0.05, timeout_s=1.0, progress_timeout_s=0.4, monitor="all")
    hearts = [Heartbeat(config, rank=r, world_size=2, store=server) for r in range(2)]
    for heart in hearts:
        heart.start()
    try:
        for step in range(8):  # both make progress: no report
            for heart in hearts:
                heart.progress(step)
            time.sleep(0.1)
        assert hearts[0].dead == {} and hearts[1].dead == {}
        stuck_at = time.time()
        # Rank 1's loop is stuck (its thread still beats); rank 0 goes on. Wait with a generous
        # deadline: the shared CI machine may delay the monitor thread, which must not fail the test.
        while not hearts[0].dead and time.time() - stuck_at < 10.0:
            hearts[0].progress(hearts[0].step + 1)
            time.sleep(0.1)
        assert list(hearts[0].dead) == [1]
        assert hearts[0].reports[0]["reason"] == "no training progress"
        # Never before the progress timeout has passed since rank 1's last progress.
        assert hearts[0].dead[1] - stuck_at >= 0.4 - 0.15
        assert hearts[1].dead == {}  # rank 0 kept progressing
    finally:
        for heart in hearts:
            heart.stop()
