"""Is a process on this machine still alive? (for the store host and the failure detector)

A process is named by its pid *and* its start time (field 22 of ``/proc/<pid>/stat``), so that a
recycled pid is not mistaken for the original process, and by the identity of the pid namespace it
lives in (boot id + pid namespace inode), so that two containers on one host, or two hosts, never
compare pids. A zombie (killed but not yet reaped by its parent, e.g. torchrun) counts as dead: that
is what makes a ``kill -9`` visible at once instead of after a heartbeat timeout.
"""

from __future__ import annotations

import functools
import json
import os
import socket
from dataclasses import asdict, dataclass


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def pid_namespace() -> str:
    """An identity shared by exactly the processes whose pids can be compared with this one's."""
    boot = (_read("/proc/sys/kernel/random/boot_id") or "").strip()
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    if not boot or not namespace:
        return f"host:{socket.gethostname()}:no-proc"  # never equal to a /proc-based identity
    return f"{boot}/{namespace}"


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid``, or None if there is no such process."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    # The command name (field 2) is in parentheses and may contain spaces and parentheses.
    rest = text[text.rfind(")") + 2 :].split()
    return rest[0], int(rest[19])


@dataclass(frozen=True)
class ProcessIdentity:
    """A process, named so that another process on the same machine can tell whether it lives.

    Attributes:
        pid: its pid.
        start: its start time in clock ticks since boot (0 when unknown).
        namespace: see :func:`pid_namespace`.
    """

    pid: int
    start: int
    namespace: str

    @classmethod
    def current(cls) -> ProcessIdentity:
        """This process."""
        stat = _stat(os.getpid())
        return cls(pid=os.getpid(), start=stat[1] if stat else 0, namespace=pid_namespace())

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> ProcessIdentity:
        return cls(**json.loads(text))

    def comparable(self) -> bool:
        """Whether this process can check the liveness of that one (same machine and pid namespace)."""
        return self.namespace == pid_namespace() and not self.namespace.endswith(":no-proc")

    def alive(self) -> bool:
        """Whether the process still runs (not exited, not a zombie, pid not recycled).

        Only meaningful when :meth:`comparable`; otherwise it answers True (unknown).
        """
        if not self.comparable():
            return True
        stat = _stat(self.pid)
        if stat is None:
            return False
        state, start = stat
        if state in ("Z", "X", "x"):
            return False
        return not (self.start and start != self.start)

    def kill(self) -> bool:
        """Sends SIGKILL when this process runs on this machine (pid and start time checked first, so a
        recycled pid is never hit). Returns whether a signal was sent."""
        import signal

        if not self.comparable() or not self.alive():
            return False
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            return False
        return True
