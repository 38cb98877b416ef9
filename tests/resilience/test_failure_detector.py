"""``resilience.failure_detector`` in one process: fake peers write their beats into a real TCPStore."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time

import pytest

from resihp_lightning.resilience.failure_detector import (
    EXITED,
    GOODBYE,
    HUNG,
    SILENT,
    Failure,
    FailureDetector,
    FailureDetectorConfig,
    main_thread_waiting,
)
from resihp_lightning.resilience.procs import ProcessIdentity, pid_namespace
from resihp_lightning.resilience.store import beat_key, proc_key
from resihp_lightning.testing.stores import tcp_store_client, tcp_store_server

INTERVAL, TIMEOUT = 0.05, 1.0


@pytest.fixture
def server():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)


def _scoped(server, wrap=lambda store: store):
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=10))
    return wrap(dist.PrefixStore("job", client))


def _beat(store, rank, counter, step=0):
    store.set(beat_key(rank), f"{counter}:{step}:0:0")


def _beat_for(store, seconds, ranks, start=0):
    """Fake peers ``ranks`` beat every interval for ``seconds``; returns the next counter."""
    counter = start
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        counter += 1
        for rank in ranks:
            _beat(store, rank, counter)
        time.sleep(INTERVAL)
    return counter


def _detector(server, seen, wrap=lambda store: store, **options):
    config = FailureDetectorConfig(interval_s=INTERVAL, timeout_s=TIMEOUT, probe_local_pids=False, **options)
    return FailureDetector(config, rank=0, connect=lambda: _scoped(server, wrap), on_failures=seen.extend)


class _OutageStore:
    """The detector's store connection, with a simulated outage.

    ``hold(s)``: its next write waits ``s`` seconds, as when the store host (or the whole machine) is not
    scheduled: the peers' writes are held as long, and the watcher's read comes before them.
    ``fail(s)``: every operation raises for ``s`` seconds (the store unreachable for everyone).
    """

    def __init__(self, store) -> None:
        self._store = store
        self._hold_s = 0.0
        self._fail_until = 0.0

    def hold(self, seconds: float) -> None:
        self._hold_s = seconds

    def fail(self, seconds: float) -> None:
        self._fail_until = time.monotonic() + seconds

    def __getattr__(self, name):
        operation = getattr(self._store, name)

        def call(*args, **kwargs):
            if time.monotonic() < self._fail_until:
                raise RuntimeError("Connection reset by peer")
            if name == "set" and self._hold_s:
                seconds, self._hold_s = self._hold_s, 0.0
                time.sleep(seconds)
            return operation(*args, **kwargs)

        return call


@pytest.mark.parametrize("outage", ["hold", "fail"])
def test_peers_are_not_blamed_for_a_gap_in_the_watchers_view(server, outage):
    """A store that stalls (or fails) for longer than the timeout stalls every peer's beat too: the beats
    the watcher reads right after are as old as the outage. Before, a watcher that started its poll in
    time (or whose failed polls counted as polls) judged those beats on its clock and evicted every
    healthy peer as silent; now it only refreshes their clocks. A peer that then stays silent is found."""
    peers = _scoped(server)
    seen: list[Failure] = []
    connections: list[_OutageStore] = []

    def with_outages(store):
        connections.append(_OutageStore(store))
        return connections[-1]

    detector = _detector(server, seen, wrap=with_outages)
    for rank in (1, 2):
        _beat(peers, rank, 0)
    detector.start()
    detector.watch([0, 1, 2], 0)
    try:
        counter = _beat_for(peers, 0.5, (1, 2))
        time.sleep(3 * INTERVAL)  # the watcher has read the peers' last beats before the outage
        getattr(connections[0], outage)(1.3)
        time.sleep(1.3 + 3 * INTERVAL)  # the peers' beats are held as long
        counter = _beat_for(peers, 1.2, (1, 2), counter)
        assert seen == []
        _beat_for(peers, 2 * TIMEOUT, (1,), counter)  # rank 2 is silent now: still found
        assert [(f.rank, f.reason) for f in seen] == [(2, SILENT)]
    finally:
        detector.stop()


def test_a_peer_that_said_goodbye_is_not_judged(server):
    peers = _scoped(server)
    seen: list[Failure] = []
    detector = _detector(server, seen)
    _beat(peers, 1, 0)
    detector.start()
    detector.watch([0, 1], 0)
    try:
        _beat_for(peers, 0.3, (1,))
        peers.set(beat_key(1), GOODBYE)
        time.sleep(TIMEOUT + 0.5)
        assert seen == [] and detector.left == {1}
    finally:
        detector.stop()


class _GoodbyeAfterRead:
    """A connection after whose reads of the beats peer 1 says goodbye (it ends right after this poll's read)."""

    def __init__(self, store, goodbye: bool) -> None:
        self._store = store
        self._goodbye = goodbye

    def multi_get(self, keys):
        values = self._store.multi_get(keys)
        if self._goodbye:
            self._store.set(beat_key(1), GOODBYE)
        return values

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.mark.parametrize("goodbye", [True, False])
def test_a_local_peer_that_exits_is_failed_unless_it_said_goodbye(server, goodbye):
    """Its exit is seen at once on this machine; a goodbye written after the poll read its beat still counts."""
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = ProcessIdentity(pid=int(finished.stdout), start=0, namespace=pid_namespace())
    peers = _scoped(server)
    _beat(peers, 1, 0)
    peers.set(proc_key(1), gone.to_json())
    seen: list[Failure] = []
    config = FailureDetectorConfig(interval_s=INTERVAL, timeout_s=TIMEOUT)
    detector = FailureDetector(config, rank=0, connect=lambda: _scoped(server, lambda s: _GoodbyeAfterRead(s, goodbye)),
                               on_failures=seen.extend).start()
    detector.watch([0, 1], 0)
    try:
        time.sleep(0.5)  # well under the silence timeout
        if goodbye:
            assert seen == [] and detector.left == {1}
        else:
            assert [(f.rank, f.reason) for f in seen] == [(1, EXITED)]
    finally:
        detector.stop()


def test_stop_with_goodbye_writes_the_goodbye_beat(server):
    detector = _detector(server, []).start()
    detector.stop(goodbye=True)
    assert _scoped(server).get(beat_key(0)) == GOODBYE


def test_listeners_hear_of_every_failure_once_whoever_found_it(server):
    """Listeners get this detector's verdicts and the ones declared to it, each failure once."""
    peers = _scoped(server)
    seen: list[Failure] = []
    heard: list[Failure] = []
    detector = _detector(server, seen)
    for rank in (1, 2):
        _beat(peers, rank, 0)
    detector.start()
    detector.subscribe(heard.extend)
    detector.watch([0, 1, 2], 0)
    try:
        _beat_for(peers, TIMEOUT + 0.6, (1,))  # rank 2 goes silent here
        detector.declare([Failure(3, "left out of generation 1", 1, time.monotonic())])
        detector.declare([Failure(2, EXITED, 1, time.monotonic())])  # known already: not heard again
        assert [(f.rank, f.reason) for f in seen] == [(2, SILENT)]  # on_failures: own verdicts only
        assert [(f.rank, f.reason) for f in heard] == [(2, SILENT), (3, "left out of generation 1")]
        detector.unsubscribe(heard.extend)
        detector.declare([Failure(1, EXITED, 3, time.monotonic())])
        assert len(heard) == 2
    finally:
        detector.stop()


def test_the_detector_imports_without_torch():
    code = "import sys, resihp_lightning.resilience.failure_detector\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


# ------------------------------------- hung vs. waiting (from test_resilience_units.py)
def _fake_beat(store, rank, counter, step, waiting):
    store.set(beat_key(rank), f"{counter}:{step}:{int(waiting)}:0")


def test_a_rank_stuck_outside_communication_is_blamed_not_the_ones_waiting_for_it():
    import torch.distributed as dist

    server = tcp_store_server()
    peers = dist.PrefixStore("job", tcp_store_client(server))
    config = FailureDetectorConfig(interval_s=0.05, timeout_s=1.0, progress_timeout_s=0.3, probe_local_pids=False)
    seen: list = []
    detector = FailureDetector(config, rank=0, connect=lambda: dist.PrefixStore("job", tcp_store_client(server)),
                               on_failures=seen.extend)
    for r in (1, 2):
        _fake_beat(peers, r, 0, 5, False)
    detector.start()
    detector.progress(5)
    detector.watch([0, 1, 2], 0)
    try:
        # Rank 1 waits in a collective, rank 2 computes and never reaches it; both keep beating.
        deadline = time.monotonic() + 5
        counter = 1
        while not seen and time.monotonic() < deadline:
            _fake_beat(peers, 1, counter, 5, True)
            _fake_beat(peers, 2, counter, 5, False)
            counter += 1
            time.sleep(0.05)
        assert [(f.rank, f.reason) for f in seen] == [(2, HUNG)]
    finally:
        detector.stop()


def test_nobody_is_blamed_when_every_rank_is_busy_with_something_long():
    import torch.distributed as dist

    server = tcp_store_server()
    peers = dist.PrefixStore("job", tcp_store_client(server))
    config = FailureDetectorConfig(interval_s=0.05, timeout_s=1.0, progress_timeout_s=0.2, probe_local_pids=False)
    seen: list = []
    detector = FailureDetector(config, rank=0, connect=lambda: dist.PrefixStore("job", tcp_store_client(server)),
                               on_failures=seen.extend)
    _fake_beat(peers, 1, 0, 5, False)
    detector.start()
    detector.progress(5)
    detector.watch([0, 1], 0)
    try:
        for counter in range(1, 20):  # 1 s: both stalled at step 5, nobody in a collective
            _fake_beat(peers, 1, counter, 5, False)
            time.sleep(0.05)
        assert seen == []
        time.sleep(1.3)  # now rank 1 goes silent
        assert [(f.rank, f.reason) for f in seen] == [(1, "silent")]
    finally:
        detector.stop()


def test_the_main_thread_counts_as_waiting_inside_communication_modules():
    code = compile("import time\ndef wait():\n    time.sleep(0.6)\n", "/x/torch/distributed/fake_c10d.py", "exec")
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102 - a function whose frame looks like torch.distributed's
    main = threading.main_thread().ident
    fragments = FailureDetectorConfig().comm_frames
    answers: list[bool] = []

    def look() -> None:
        time.sleep(0.3)
        answers.append(main_thread_waiting(main, fragments, 3))

    thread = threading.Thread(target=look)
    thread.start()
    namespace["wait"]()
    thread.join()
    thread = threading.Thread(target=lambda: answers.append(main_thread_waiting(main, fragments, 3)))
    thread.start()
    thread.join()
    assert answers == [True, False]


def test_once_the_store_is_lost_one_collective_blocked_for_stall_timeout_s_is_handed_on(server):
    """A process cut off from the store and from its peers (its machine's link down) would wait in its collective
    until the collective's own timeout (30 min by default): once the store is lost, the detector hands a stall of
    one communication call (the same frame) to ``on_stalled``. Calls that come and go (training going on without
    a store) are no stall, and a blocked call while the store answers is the peers' detectors' business."""
    code = compile("import time\ndef wait(s):\n    time.sleep(s)\n", "/x/torch/distributed/fake_c10d.py", "exec")
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102 - a function whose frame looks like torch.distributed's
    connections: list[_OutageStore] = []
    stalls: list[tuple[float, float]] = []

    def with_outages(store):
        connections.append(_OutageStore(store))
        return connections[-1]

    config = FailureDetectorConfig(interval_s=INTERVAL, timeout_s=TIMEOUT, probe_local_pids=False, store_grace_s=0.2,
                                   stall_timeout_s=0.5)
    detector = FailureDetector(config, rank=0, connect=lambda: _scoped(server, with_outages),
                               on_stalled=lambda waited: stalls.append((time.monotonic(), waited))).start()
    detector.watch([0], 0)
    try:
        namespace["wait"](1.0)  # the store answers: no stall is handed on
        assert stalls == [] and not detector.store_lost
        connections[0].fail(60.0)
        for _ in range(12):  # calls that come and go, the store lost meanwhile
            namespace["wait"](0.1)
        assert detector.store_lost and stalls == []
        started = time.monotonic()
        namespace["wait"](1.2)  # one call blocked
        assert len(stalls) == 1, stalls
        at, waited = stalls[0]
        assert 0.5 <= waited and 0.5 <= at - started < 0.5 + 4 * INTERVAL, (at - started, waited)
        namespace["wait"](0.8)  # once per watch
        assert len(stalls) == 1
    finally:
        detector.stop()
