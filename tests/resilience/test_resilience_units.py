"""The recovery mechanism's parts on their own, in one process (fast; no training processes)."""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from resihp_lightning.errors import ConfigError
from resihp_lightning.resilience.failure_detector import HUNG, FailureDetectorConfig, FailureDetector, main_thread_waiting
from resihp_lightning.resilience.failures import EvictedError, PeerFailure, RegroupError
from resihp_lightning.resilience.membership import agree_members
from resihp_lightning.resilience.procs import ProcessIdentity
from resihp_lightning.resilience.sockets import SocketTracker
from resihp_lightning.resilience.store import StoreConfig, beat_key, host_key
from resihp_lightning.resilience.store_host import StoreHost
from resihp_lightning.resilience.world import WorldConfig, is_transport_error


def _server():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)


def _client(server):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=10), wait_for_workers=False)


# ------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize(
    ("build", "option"),
    [
        (lambda: WorldConfig(backend="mpi"), "resilience.backend"),
        (lambda: WorldConfig(join_timeout_s=0), "resilience.join_timeout_s"),
        (lambda: WorldConfig(join_timeout_s=50, regroup_timeout_s=40), "resilience.join_timeout_s"),
        (lambda: WorldConfig(min_world_size=0), "resilience.min_world_size"),
        (lambda: FailureDetectorConfig(interval_s=0.5, timeout_s=0.6), "resilience.detector.timeout_s"),
        (lambda: FailureDetectorConfig(progress_timeout_s=0.1), "resilience.detector.progress_timeout_s"),
        (lambda: FailureDetectorConfig(comm_frame_depth=0), "resilience.detector.comm_frame_depth"),
        (lambda: StoreConfig(port=70000), "resilience.store.port"),
        (lambda: StoreConfig(linger_s=-1), "resilience.store.linger_s"),
        (lambda: StoreConfig(run_id="a b"), "resilience.store.run_id"),
    ],
)
def test_options_are_validated(build, option):
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        build()


def test_defaults_detect_a_silent_rank_within_a_second():
    config = WorldConfig()
    assert config.detector.interval_s == 0.2 and config.detector.timeout_s == 1.0
    assert config.backend == "gloo"


def test_peer_failure_names_the_ranks():
    failure = PeerFailure(3, {2: "exited", 0: "silent"}, "rank 2 exited")
    assert failure.failed == {0: "silent", 2: "exited"}
    assert "0 (silent), 2 (exited)" in str(failure)
    assert "not yet known" in str(PeerFailure(0, {}, "collective failed"))


def test_transport_errors_are_told_from_bugs():
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    assert is_transport_error(gloo)
    assert not is_transport_error(ValueError("shapes do not match"))


# ------------------------------------------------------------------------------------ sockets
def _listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    return server


def test_tracker_cuts_connections_made_in_its_window_and_nothing_else():
    server = _listener()
    port = server.getsockname()[1]
    excluded_server = _listener()
    tracker = SocketTracker(exclude_peers=[("*", excluded_server.getsockname()[1])])
    outside = socket.create_connection(("127.0.0.1", port))
    with tracker.track():
        tracked = socket.create_connection(("127.0.0.1", port))
        store_like = socket.create_connection(("127.0.0.1", excluded_server.getsockname()[1]))
        listening = _listener()
    accepted = [server.accept()[0] for _ in range(2)]
    assert len(tracker.inodes) == 1  # neither the listener nor the excluded peer

    # A thread blocked in recv on the tracked connection is released by the shutdown.
    outcome: dict[str, float] = {}

    def blocked() -> None:
        start = time.monotonic()
        data = tracked.recv(1)  # returns b"" once shut down
        outcome["released_after"] = time.monotonic() - start
        outcome["data"] = data

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.2)
    assert tracker.shutdown() == 1
    thread.join(2)
    assert outcome["data"] == b"" and outcome["released_after"] < 1.5
    # The others still work.
    outside.sendall(b"x")
    store_like.sendall(b"y")
    assert listening.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    for sock in (server, excluded_server, outside, tracked, store_like, listening, *accepted):
        sock.close()


def test_tracker_shutdown_reaches_a_window_that_is_still_open():
    server = _listener()
    tracker = SocketTracker()
    with tracker.track():
        conn = socket.create_connection(server.getsockname())
        assert tracker.shutdown() == 1  # an abort while groups are being created
    assert conn.recv(1) == b""
    conn.close()
    server.close()


# --------------------------------------------------------------------------------- membership
def _agree(store_server, me, candidates, failed, results, **kwargs):
    import torch.distributed as dist

    store = dist.PrefixStore("job", _client(store_server))
    try:
        results[me] = agree_members(store, me=me, candidates=candidates, failed=lambda: set(failed), **kwargs)
    except Exception as err:  # noqa: BLE001 - checked by the test
        results[me] = err


def _run_agreement(joiners, candidates, failed, generation=1, join_timeout_s=5.0, timeout_s=10.0, delays=None):
    server = _server()
    results: dict[int, object] = {}
    threads = []
    for me in joiners:
        def target(me=me):
            time.sleep((delays or {}).get(me, 0.0))
            _agree(server, me, candidates, failed, results, generation=generation,
                   join_timeout_s=join_timeout_s, timeout_s=timeout_s)
        threads.append(threading.Thread(target=target))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 5)
    return results, server


def test_survivors_agree_without_the_failed_ranks():
    started = time.monotonic()
    results, _ = _run_agreement([0, 1, 3], [0, 1, 2, 3], failed={2})
    assert results == {0: [0, 1, 3], 1: [0, 1, 3], 3: [0, 1, 3]}
    assert time.monotonic() - started < 2.0  # nobody waited for the join timeout


def test_simultaneous_failures_are_all_left_out():
    results, _ = _run_agreement([1, 3], [0, 1, 2, 3], failed={0, 2})
    assert results == {1: [1, 3], 3: [1, 3]}


def test_next_rank_leads_when_rank_zero_failed():
    results, _ = _run_agreement([1, 2, 3], [0, 1, 2, 3], failed={0})
    assert results == {1: [1, 2, 3], 2: [1, 2, 3], 3: [1, 2, 3]}


def test_a_rank_that_never_comes_is_left_out_after_the_join_timeout():
    started = time.monotonic()
    results, _ = _run_agreement([0, 1], [0, 1, 2], failed=set(), join_timeout_s=0.5)
    assert results == {0: [0, 1], 1: [0, 1]}
    assert 0.4 < time.monotonic() - started < 3.0


def test_a_late_rank_learns_it_was_left_out():
    results, _ = _run_agreement([0, 1, 2], [0, 1, 2], failed={2}, delays={2: 0.5})
    assert results[0] == results[1] == [0, 1]
    assert isinstance(results[2], EvictedError) and results[2].members == [0, 1]


def test_no_agreement_times_out_instead_of_hanging():
    # The only candidate that could lead (0) never comes and nobody knows it failed.
    results, _ = _run_agreement([1], [0, 1], failed=set(), timeout_s=0.5)
    assert isinstance(results[1], RegroupError)


# ----------------------------------------------------------------------------------- detector
def _fake_beat(store, rank, counter, step, waiting):
    store.set(beat_key(rank), f"{counter}:{step}:{int(waiting)}:0")


def test_a_rank_stuck_outside_communication_is_blamed_not_the_ones_waiting_for_it():
    import torch.distributed as dist

    server = _server()
    peers = dist.PrefixStore("job", _client(server))
    config = FailureDetectorConfig(interval_s=0.05, timeout_s=1.0, progress_timeout_s=0.3, probe_local_pids=False)
    seen: list = []
    detector = FailureDetector(config, rank=0, connect=lambda: dist.PrefixStore("job", _client(server)),
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

    server = _server()
    peers = dist.PrefixStore("job", _client(server))
    config = FailureDetectorConfig(interval_s=0.05, timeout_s=1.0, progress_timeout_s=0.2, probe_local_pids=False)
    seen: list = []
    detector = FailureDetector(config, rank=0, connect=lambda: dist.PrefixStore("job", _client(server)),
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


# --------------------------------------------------------------------------------- store host
def test_store_host_ends_when_its_members_are_gone(tmp_path: Path):
    member = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        identity = ProcessIdentity.current()
        stat = Path(f"/proc/{member.pid}/stat").read_text()
        start = int(stat[stat.rfind(")") + 2 :].split()[19])
        member_identity = ProcessIdentity(member.pid, start, identity.namespace)
        host = StoreHost(tmp_path, host="127.0.0.1", port=0, timeout_s=5, linger_s=0.3,
                         startup_timeout_s=30, remote_idle_s=30, poll_s=0.05)
        reasons: list[str] = []
        thread = threading.Thread(target=lambda: reasons.append(host.serve()), daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while host.store is None or not (tmp_path / "store.json").exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        client = _client(host.store)
        client.add(host_key("count"), 1)
        client.set(host_key("member/0"), json.dumps({"rank": 0, "identity": vars(member_identity), "beat_key": "x"}))
        time.sleep(0.6)
        assert thread.is_alive()  # its member lives (longer than linger_s)
        member.kill()
        member.wait()
        killed = time.monotonic()
        thread.join(5)
        assert reasons == ["no member left"]
        assert time.monotonic() - killed < 2.0
        assert not (tmp_path / "store.json").exists()
    finally:
        member.kill()
        member.wait()


@pytest.mark.multiprocess
def test_a_fixed_port_store_host_is_started_once_shared_and_ends_after_everyone_left(tmp_path: Path):
    from resihp_lightning.testing.harness import free_port
    from resihp_lightning.resilience.store import RendezvousStore, read_address

    config = StoreConfig(run_dir=str(tmp_path), run_id="unit", port=free_port(), host="127.0.0.1", linger_s=0.3)
    first = RendezvousStore(config, rank=0).open()
    second = RendezvousStore(StoreConfig(**{**vars(config), "spawn": False}), rank=1).open()
    try:
        assert first.address == second.address == ("127.0.0.1", config.port)
        host = ProcessIdentity(**read_address(tmp_path)["identity"])
        assert host.alive()
        first.control.set("hello", "from 0")
        assert second.control.get("hello") == b"from 0"
        assert first.namespace == "resihp/unit/a0"
        first.close()
        time.sleep(0.8)
        assert host.alive()  # rank 1 has not left
        second.close()
        deadline = time.monotonic() + 5
        while host.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not host.alive(), "the store host outlived its members"
    finally:
        first.close()
        second.close()
