"""Two-level failure detection in one process: real peers on this machine, simulated machines beside it.

Local peers are real processes (``sleep`` in a child interpreter) whose identities the test registers:
their liveness comes from ``/proc`` only, they never beat. Other machines are simulated: detectors in
this process, each given an identity on a machine of its own name
(:meth:`~resihp_lightning.resilience.procs.ProcessIdentity.simulated`), over a real TCPStore.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest

from resihp_lightning.resilience.failure_detector import EXITED, SILENT, Failure, FailureDetector, FailureDetectorConfig
from resihp_lightning.resilience.machine_board import (
    GOODBYE,
    LocalBoard,
    decode_machine_beat,
    encode_machine_beat,
    machine_beat_key,
)
from resihp_lightning.resilience.procs import GONE, RUNNING, STOPPED, ProcessIdentity
from resihp_lightning.resilience.store import proc_key

INTERVAL, TIMEOUT = 0.05, 1.0


@pytest.fixture
def server():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)


class _Counting:
    """A store connection that counts the operations made through it."""

    def __init__(self, store) -> None:
        self._store = store
        self.calls = 0

    def __getattr__(self, name):
        operation = getattr(self._store, name)

        def call(*args, **kwargs):
            self.calls += 1
            return operation(*args, **kwargs)

        return call


def _connect(server, connections=None):
    import torch.distributed as dist

    def connect():
        client = dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=10))
        store = _Counting(dist.PrefixStore("job", client))
        if connections is not None:
            connections.append(store)
        return store

    return connect


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _wait_for(condition, timeout: float = 5.0) -> float:
    """Seconds until ``condition()`` held (raises after ``timeout``)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)
    return time.monotonic() - started


def test_process_status_tells_running_stopped_and_gone():
    child = _sleeper()
    try:
        identity = ProcessIdentity.of(child.pid)
        assert identity.status() == RUNNING
        os.kill(child.pid, signal.SIGSTOP)
        _wait_for(lambda: identity.status() == STOPPED)
        os.kill(child.pid, signal.SIGCONT)
        _wait_for(lambda: identity.status() == RUNNING)
    finally:
        child.kill()
    _wait_for(lambda: identity.status() == GONE)  # a zombie until reaped: gone already
    child.wait()
    assert identity.status() == GONE


def test_simulated_machines_do_not_compare_pids_but_see_them():
    here, there = ProcessIdentity.simulated("a"), ProcessIdentity.simulated("b")
    assert here.machine_key != there.machine_key and here.machine == "a"
    assert not there.comparable() and there.visible() and not there.kill()  # never killed from another machine


def test_machine_beats_round_trip():
    ranks = {3: b"7:12:1:2", 5: GOODBYE}
    beat = decode_machine_beat(encode_machine_beat(3, 9, ranks).encode())
    assert (beat.writer, beat.counter, beat.ranks) == (3, 9, ranks)
    assert decode_machine_beat(b"garbage") is None


def test_a_live_local_peer_is_never_silent_a_stopped_one_is_and_a_killed_one_exits_at_once(server):
    """Peers 1 and 2 run on this machine and never beat (as when a CPU hog starves their beat threads, or
    a long call holds their GIL): they are not silent, however long. Stopped, peer 1 is silent after the
    timeout, as before; killed, peer 2 has exited at the next poll."""
    children = {1: _sleeper(), 2: _sleeper()}
    peers = _connect(server)()
    for rank, child in children.items():
        peers.set(proc_key(rank), ProcessIdentity.of(child.pid).to_json())
    seen: list[Failure] = []
    config = FailureDetectorConfig(interval_s=INTERVAL, timeout_s=TIMEOUT)
    detector = FailureDetector(config, rank=0, connect=_connect(server), on_failures=seen.extend).start()
    detector.watch([0, 1, 2], 0)
    try:
        time.sleep(3 * TIMEOUT)
        assert seen == []
        os.kill(children[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        os.kill(children[2].pid, signal.SIGKILL)
        killed = time.monotonic()
        _wait_for(lambda: len(seen) == 2, timeout=3 * TIMEOUT)
        by_rank = {f.rank: f for f in seen}
        assert by_rank[2].reason == EXITED and by_rank[2].at - killed < 5 * INTERVAL
        assert by_rank[1].reason == SILENT and TIMEOUT <= by_rank[1].at - stopped < TIMEOUT + 0.5
    finally:
        detector.stop()
        for child in children.values():
            child.kill()
            child.wait()


def _machines(server, layout: dict[str, list[int]], seen: dict[int, list[Failure]], connections: dict[int, list]):
    """Starts one detector per rank, each on its simulated machine, all watching every rank."""
    detectors = {}
    config = FailureDetectorConfig(interval_s=INTERVAL, timeout_s=TIMEOUT)
    everyone = sorted(r for ranks in layout.values() for r in ranks)
    for machine, ranks in layout.items():
        for rank in ranks:
            seen[rank], connections[rank] = [], []
            detectors[rank] = FailureDetector(config, rank=rank, connect=_connect(server, connections[rank]),
                                              on_failures=seen[rank].extend,
                                              identity=ProcessIdentity.simulated(machine)).start()
    for detector in detectors.values():
        detector.watch(everyone, 0)
    return detectors


def test_a_lost_machine_is_one_verdict_naming_its_ranks_and_only_monitors_use_the_store(server):
    """Machines a (ranks 0, 1) and b (2, 3): per poll, the store sees the monitors (ranks 0 and 2) only;
    rank 1 and 3 watch their neighbour through /proc and the board. When b stops beating, a's monitor
    loses ranks 2 and 3 in one poll, naming machine b."""
    seen: dict[int, list[Failure]] = {}
    connections: dict[int, list] = {}
    detectors = _machines(server, {"a": [0, 1], "b": [2, 3]}, seen, connections)
    try:
        time.sleep(0.5)
        before = {r: connections[r][0].calls for r in detectors}
        polls = 20
        time.sleep(polls * INTERVAL)
        made = {r: connections[r][0].calls - before[r] for r in detectors}
        # Non-monitors use the store only while standing in for a monitor that fell behind (under load).
        assert made[1] + made[3] < (made[0] + made[2]) / 4, made
        assert 0 < made[0] <= 3 * (polls + 2) and 0 < made[2] <= 3 * (polls + 2), made
        assert all(not s for s in seen.values())
        for rank in (2, 3):  # machine b goes silent (no goodbye)
            detectors[rank].stop()
        lost_at = time.monotonic()
        _wait_for(lambda: len(seen[0]) == 2, timeout=3 * TIMEOUT)
        assert {(f.rank, f.reason, f.machine) for f in seen[0]} == {(2, SILENT, "b"), (3, SILENT, "b")}
        assert len({f.at for f in seen[0]}) == 1  # one poll, one verdict
        # Silence counts from the machine's last beat, which came up to a poll interval before the stop.
        assert TIMEOUT - 2 * INTERVAL <= seen[0][0].at - lost_at < TIMEOUT + 0.5
        assert seen[1] == []  # not a monitor: it learns it from the abort marker, through the board
    finally:
        for detector in detectors.values():
            detector.stop()


def test_a_machine_whose_monitor_falls_behind_is_not_lost(server):
    """Machine b's monitor (rank 2) stops polling while its process runs (a starved thread): rank 3 stands
    in for it, b's beat goes on, and nobody is found failed, on b (rank 2 lives) or elsewhere."""
    seen: dict[int, list[Failure]] = {}
    connections: dict[int, list] = {}
    detectors = _machines(server, {"a": [0, 1], "b": [2, 3]}, seen, connections)
    try:
        time.sleep(0.5)
        detectors[2].stop()
        time.sleep(3 * TIMEOUT)
        assert all(not s for s in seen.values()), seen
        assert connections[3][0].calls > 0  # rank 3 writes b's beat now
        beat = decode_machine_beat(connections[0][0].get(machine_beat_key(ProcessIdentity.simulated("b").machine_key)))
        assert beat.writer == 3 and 3 in beat.ranks  # (rank 2's stopped detector took its beat off the board)
    finally:
        for detector in detectors.values():
            detector.stop()


def test_goodbyes_reach_the_board_and_the_last_one_removes_it(server):
    seen: dict[int, list[Failure]] = {}
    detectors = _machines(server, {"a": [0, 1]}, seen, {})
    board: LocalBoard = detectors[0].board
    assert board.path.is_dir()
    _wait_for(lambda: all(d.identities for d in detectors.values()))  # they know each other
    detectors[1].stop(goodbye=True)
    assert board.path.is_dir()  # rank 0 is still here
    _wait_for(lambda: detectors[0].left == {1})
    assert board.read_beat(1) == GOODBYE
    detectors[0].stop(goodbye=True)
    assert not board.path.exists()
    assert seen == {0: [], 1: []}
