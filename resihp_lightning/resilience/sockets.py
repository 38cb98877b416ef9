"""Which TCP connections belong to a generation's process groups, and cutting them on abort.

Why sockets: on gloo, nothing that can be called from another thread releases a collective the main
thread is blocked in. ``ProcessGroup.abort()``, ``shutdown()`` and ``destroy_process_group()`` leave
it blocked until the group's timeout (30 min by default), and only the ranks that talked to the dead
peer directly get an error (``Connection closed by peer``); the others wait for them. Shutting the
connections down (``shutdown(SHUT_RDWR)``) wakes gloo's I/O loop with an error on every pair, and
the blocked call raises at once. Measured on torch 2.13: a main thread blocked in ``all_reduce`` or
``recv`` raises within about a millisecond of the shutdown.

Which sockets: torch does not expose gloo's file descriptors, so a :class:`SocketTracker` diffs
``/proc/self/fd`` around the code that creates a generation's groups (``init_process_group`` and
every later ``new_group``, e.g. a DeepSpeed engine's) and keeps the socket *inodes* that appeared,
which, unlike fd numbers, cannot be reused by an unrelated socket while the socket is open.

What is never touched:

* listening sockets: gloo's listener thread treats an error on ``accept`` as fatal and terminates
  the process (``listener.cc: accept: Invalid argument``, seen here), so listeners are skipped;
* sockets connected to an excluded peer (the rendezvous store's address): the detector's and the
  control connection to the store must survive every abort;
* non-TCP sockets and everything created outside a tracking window.

A socket another thread happens to open inside a window is recorded too (there is no way to tell
whose it is); windows are short and only wrap group creation, so this is unlikely, and the worst
effect is one foreign connection cut during an abort. Linux only (``/proc``); elsewhere
:attr:`SocketTracker.supported` is false, tracking records nothing and an abort falls back on the
process group's timeout.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterable, Iterator

from resihp_lightning._logging import get_logger

log = get_logger(__name__)

_FD_DIR = "/proc/self/fd"


def socket_inodes() -> dict[int, int]:
    """This process's open sockets, as file descriptor -> socket inode (empty without ``/proc``)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            found[int(name)] = int(target[8:-1])
    return found


def _peer(sock: socket.socket) -> tuple[str, int] | None:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return None
    if host.startswith("::ffff:"):  # IPv4-mapped IPv6
        host = host[7:]
    return host, int(port)


def _is_tcp(sock: socket.socket) -> bool:
    return sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM


def _listening(sock: socket.socket) -> bool:
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return False


@contextlib.contextmanager
def _borrowed(fd: int, inode: int) -> Iterator[socket.socket | None]:
    """A duplicate of ``fd`` as a socket object, or None if ``fd`` no longer is socket ``inode``.

    The duplicate shares the connection (``shutdown`` acts on it) but closing it leaves ``fd``
    open for its owner.
    """
    try:
        dup = os.dup(fd)
    except OSError:
        yield None
        return
    try:
        if os.fstat(dup).st_ino != inode:
            os.close(dup)
            yield None
            return
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        yield None
        return
    try:
        yield sock
    finally:
        sock.close()


class SocketTracker:
    """Records the TCP connections opened inside :meth:`track` windows; :meth:`shutdown` cuts them.

    Args:
        exclude_peers: ``(host, port)`` endpoints whose connections are never recorded (the
            rendezvous store). Host ``"*"`` matches any address.
    """

    def __init__(self, exclude_peers: Iterable[tuple[str, int]] = ()) -> None:
        self.exclude_peers = {(h, int(p)) for h, p in exclude_peers}
        #: Whether this system lets a process list its open sockets (Linux ``/proc/self/fd``).
        self.supported = os.path.isdir(_FD_DIR)
        self._inodes: set[int] = set()
        self._open: list[frozenset[int]] = []  # inode snapshots of the windows now open
        self._lock = threading.Lock()

    @property
    def inodes(self) -> frozenset[int]:
        """The recorded socket inodes."""
        with self._lock:
            return frozenset(self._inodes)

    @contextlib.contextmanager
    def track(self, *, include_excluded: bool = False) -> Iterator[None]:
        """Records the TCP connections opened while the block runs (nested windows are fine).

        Args:
            include_excluded: record connections to excluded peers too (for a connection to the
                store that belongs to the generation, e.g. the one its groups rendezvous through).
        """
        if not self.supported:
            yield
            return
        before = frozenset(socket_inodes().values())
        with self._lock:
            self._open.append(before)
        try:
            yield
        finally:
            with self._lock:
                self._open.remove(before)
            self._record(before, include_excluded)

    def _record(self, before: frozenset[int], include_excluded: bool) -> None:
        for fd, inode in socket_inodes().items():
            if inode in before:
                continue
            with _borrowed(fd, inode) as sock:
                if sock is None or not _is_tcp(sock) or _listening(sock):
                    continue
                peer = _peer(sock)
                if not include_excluded and peer is not None and self._excluded(peer):
                    continue
                with self._lock:
                    self._inodes.add(inode)

    def _excluded(self, peer: tuple[str, int]) -> bool:
        return peer in self.exclude_peers or ("*", peer[1]) in self.exclude_peers

    def shutdown(self) -> int:
        """Shuts down (``SHUT_RDWR``) every recorded connection that is still open.

        Connections opened inside a window that is still open are recorded first, so that an abort
        also releases a group being created right now. Safe to call from any thread, repeatedly.

        Returns:
            How many connections were shut down.
        """
        if not self.supported:
            return 0
        with self._lock:
            pending = list(self._open)
        for before in pending:
            self._record(before, include_excluded=False)
        targets = self.inodes
        count = 0
        for fd, inode in socket_inodes().items():
            if inode not in targets:
                continue
            with _borrowed(fd, inode) as sock:
                if sock is None or _listening(sock):
                    continue
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    count += 1
                except OSError as err:  # already disconnected
                    log.debug("socket %d already down: %s", inode, err)
        return count

    def clear(self) -> None:
        """Forgets every recorded connection (after the generation's groups are destroyed)."""
        with self._lock:
            self._inodes.clear()
