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
from types import SimpleNamespace

import pytest

from resihp_lightning.testing.multiproc import free_port, rank_context
from resihp_lightning.callbacks.events import EventLog, read_events
from resihp_lightning.callbacks.failstop.heartbeat import STORE_UNREACHABLE, Heartbeat, HeartbeatConfig
from resihp_lightning.errors import ConfigError
from resihp_lightning.resilience.failure_detector import HUNG, SILENT, Failure, FailureDetector
from resihp_lightning.resilience.procs import ProcessIdentity

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
    with pytest.raises(ConfigError, match="heartbeat.timeout_s"):  # the detector judges silence over >= 2 beats
        HeartbeatConfig(interval_s=1.0, timeout_s=1.5)
    with pytest.raises(ConfigError, match="heartbeat.progress_timeout_s"):
        HeartbeatConfig(interval_s=1.0, progress_timeout_s=1.5)
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
        assert hearts[0].reports[0]["how"] == HUNG and hearts[0].reports[0]["reporter"] == 0
        # Never before the progress timeout has passed since rank 1's last progress.
        assert hearts[0].dead[1] - stuck_at >= 0.4 - 0.15
        assert hearts[1].dead == {}  # rank 0 kept progressing
    finally:
        for heart in hearts:
            heart.stop()


def _server():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)


def _wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_rank_that_stopped_on_purpose_is_not_reported(tmp_path):
    server = _server()
    config = HeartbeatConfig(interval_s=0.05, timeout_s=1.0, monitor="all")
    hearts = [Heartbeat(config, rank=r, world_size=2, store=server) for r in range(2)]
    for heart in hearts:
        heart.start()
    try:
        time.sleep(0.3)
        hearts[1].stop()  # says goodbye
        time.sleep(1.5)
        assert hearts[0].dead == {}
    finally:
        hearts[0].stop()


def test_with_monitor_rank0_the_others_report_only_the_store_host(tmp_path):
    """Ranks 1 and 2 do not report each other; rank 0 reports rank 2, and rank 1 reports rank 0 when its
    store goes (its beats keep the test's store, so the host's loss is a silence here). The ranks share
    this process, so each runs on a simulated machine of its own: a stopped detector is then a machine
    gone silent (on one machine, a process that still runs is never silent)."""
    server = _server()
    config = HeartbeatConfig(interval_s=0.05, timeout_s=1.0)
    events = EventLog(tmp_path, rank=1)
    hearts = [Heartbeat(config, rank=r, world_size=3, store=server, events=events if r == 1 else None,
                        identity=ProcessIdentity.simulated(f"m{r}")) for r in range(3)]
    for heart in hearts:
        heart.start()
    try:
        time.sleep(0.3)
        hearts[2].detector.stop()  # rank 2 dies: no goodbye
        assert _wait_for(lambda: 2 in hearts[0].dead)
        hearts[0].detector.stop()  # the store's host dies
        assert _wait_for(lambda: 0 in hearts[1].dead)
        time.sleep(0.3)
        assert list(hearts[1].dead) == [0] and list(hearts[0].dead) == [2]
        event, machine = read_events(tmp_path)  # rank 0 was alone on its (simulated) machine
        assert (event["event"], event["rank"], event["how"], event["reason"], event["reporter"]) == (
            "fail_stop_detected", 0, SILENT, "heartbeat timeout", 1)
        assert (machine["event"], machine["machine"], machine["ranks"]) == ("machine_lost", "m0", [0])
    finally:
        hearts[1].stop()


def test_the_store_hosts_loss_is_reported_unless_it_said_goodbye():
    def store_gone(server, host_left):
        heart = Heartbeat(HeartbeatConfig(interval_s=0.05, timeout_s=1.0), rank=1, world_size=2, store=server)
        heart.start()
        if host_left:
            server.set("resihp/hb/0", "done")
        time.sleep(0.2)
        heart.detector.store = _BrokenStore()  # the host's process (and its store) are gone
        return heart

    reported = store_gone(_server(), host_left=False)
    finished = store_gone(_server(), host_left=True)
    for heart in (reported, finished):  # either way the detector stops with the store
        assert _wait_for(lambda heart=heart: heart.detector.thread is None)
    assert [(r["rank"], r["reason"]) for r in reported.reports] == [(0, STORE_UNREACHABLE)]
    assert finished.dead == {}
    for heart in (reported, finished):
        heart.stop()


class _BrokenStore:
    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("Connection reset by peer")

        return fail


def test_a_running_detector_is_reported_on_and_left_running(tmp_path):
    """The strategy's detector (fail_stop): the heartbeat reports what it learns, its own verdicts and the
    ones declared to it, and acts on none (on_failure applies to an own detector only)."""
    import torch.distributed as dist

    server = _server()
    peers = dist.PrefixStore("job", server)
    detector = FailureDetector(
        HeartbeatConfig(interval_s=0.05, timeout_s=1.0).detector_config(), rank=1,
        connect=lambda: dist.PrefixStore("job", dist.TCPStore("127.0.0.1", server.port, None, False)),
    ).start()
    peers.set("hb/0", "0:0:0:0")
    detector.watch([0, 1, 2], 0)
    events = EventLog(tmp_path, rank=1)
    heart = Heartbeat(HeartbeatConfig(monitor="all", on_failure="interrupt"), detector=detector, events=events).start()
    try:
        counter = 0
        while 2 not in heart.dead and counter < 100:  # rank 0 beats, rank 2 was never heard of: silent
            counter += 1
            peers.set("hb/0", f"{counter}:0:0:0")
            time.sleep(0.05)
        detector.declare([Failure(0, "left out of generation 1", 2, time.monotonic())])
        assert [(r["rank"], r["how"], r["reason"], r["reporter"]) for r in heart.reports] == [
            (2, SILENT, "heartbeat timeout", 1), (0, "left out of generation 1", "left out of generation 1", 2)]
        assert [e["rank"] for e in read_events(tmp_path)] == [2, 0]
        heart.stop()
        assert detector.thread is not None  # left running: it is the strategy's
    finally:
        detector.stop()


def test_a_lost_machine_is_one_machine_lost_event_naming_its_ranks(tmp_path):
    server = _server()
    detector = FailureDetector(rank=0, connect=lambda: server).start()
    events = EventLog(tmp_path, rank=0)
    heart = Heartbeat(HeartbeatConfig(monitor="all"), detector=detector, events=events).start()
    try:
        now = time.monotonic()
        detector.declare([Failure(2, SILENT, 0, now, machine="m1"), Failure(3, SILENT, 0, now, machine="m1"),
                          Failure(1, "exited", 0, now)])
        logged = [(e["event"], e.get("rank"), e.get("machine"), e.get("ranks")) for e in read_events(tmp_path)]
        assert logged == [("fail_stop_detected", 2, None, None), ("fail_stop_detected", 3, None, None),
                          ("fail_stop_detected", 1, None, None), ("machine_lost", None, "m1", [2, 3])]
        assert sorted(heart.dead) == [1, 2, 3]
    finally:
        heart.stop()
        detector.stop()


def test_the_monitor_reports_on_the_running_detector_and_says_what_does_not_apply(tmp_path):
    from resihp_lightning.callbacks.failstop.heartbeat_monitor import HeartbeatMonitor  # Lightning: not in the spawned ranks

    server = _server()
    detector = FailureDetector(rank=0, connect=lambda: server).start()
    trainer = SimpleNamespace(global_rank=0, world_size=2, log_dir=str(tmp_path), default_root_dir=str(tmp_path),
                              should_stop=False, strategy=SimpleNamespace(failure_detector=detector))
    monitor = HeartbeatMonitor(on_failure="exit", timeout_s=5.0)
    try:
        with pytest.warns(UserWarning, match="timeout_s=5.0, on_failure='exit' do not apply"):
            monitor.setup(trainer, None, "fit")
        assert monitor.heartbeat.detector is detector and not monitor.heartbeat.owns_detector
        detector.declare([Failure(1, "exited", 0, time.monotonic())])
        assert list(monitor.dead) == [1] and trainer.should_stop is False  # the strategy recovers
        monitor.teardown(trainer, None, "fit")
        assert detector.thread is not None
    finally:
        detector.stop()


def test_without_a_running_detector_the_monitor_runs_its_own_and_stops_the_trainer(tmp_path):
    from resihp_lightning.callbacks.failstop.heartbeat_monitor import HeartbeatMonitor  # Lightning: not in the spawned ranks

    trainer = SimpleNamespace(global_rank=0, world_size=2, log_dir=str(tmp_path), default_root_dir=str(tmp_path),
                              should_stop=False, strategy=SimpleNamespace(failure_detector=None))  # fail_stop off
    monitor = HeartbeatMonitor(port=free_port(), interval_s=0.05, timeout_s=5.0)
    monitor.setup(trainer, None, "fit")
    heartbeat = monitor.heartbeat
    try:
        assert heartbeat.owns_detector and heartbeat.detector.thread is not None
        monitor.on_train_batch_start(SimpleNamespace(global_step=7), None, None, 0)
        assert heartbeat.detector.step == 7
        heartbeat.detector.declare([Failure(1, "exited", 0, time.monotonic())])
        assert list(monitor.dead) == [1] and trainer.should_stop is True
        assert [e["rank"] for e in read_events(tmp_path)] == [1]
    finally:
        monitor.teardown(trainer, None, "fit")
    assert monitor.heartbeat is None and heartbeat.detector.thread is None
    assert heartbeat.store.get("resihp/hb/0") == b"done"  # said goodbye
