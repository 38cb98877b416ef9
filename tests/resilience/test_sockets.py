"""``resilience.sockets``: the tracker that cuts the connections a window of group creation made."""

from __future__ import annotations

import socket
import threading
import time

from resihp_lightning.resilience.sockets import SocketTracker


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
