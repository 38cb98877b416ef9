"""Is a process on this machine still alive? (for the store host and the failure detector)

A process is named by its pid *and* its start time (field 22 of ``/proc/<pid>/stat``), so that a
recycled pid is not mistaken for the original process, and by the identity of the pid namespace it
lives in (boot id + pid namespace inode), so that two containers on one host, or two hosts, never
compare pids. A zombie (killed but not yet reaped by its parent, e.g. torchrun) counts as dead: that
is what makes a ``kill -9`` visible at once instead of after a heartbeat timeout. A process that lives
is either running (any state but stopped: ``R``, ``S``, ``D``, ...) or stopped (``T``: SIGSTOP, ``t``:
held by a tracer); :meth:`ProcessIdentity.status` tells them apart.

**Machines.** The processes that can probe each other this way form one *machine* (the failure
detector's first level watches them through ``/proc``; machines watch each other through one heartbeat
each). ``$RESIHP_MACHINE_ID`` splits one host into several simulated machines (tests and benchmarks):
processes with different values count as different machines (:meth:`ProcessIdentity.comparable` is
false between them, so nobody probes or kills a process of another machine) and the machine is named
by the value instead of the host name.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
from dataclasses import asdict, dataclass

#: Environment variable that names this process's machine (simulated machines on one host).
MACHINE_ENV = "RESIHP_MACHINE_ID"
_MACHINE_SEP = "|machine="
#: :meth:`ProcessIdentity.status` of a live process that is not stopped (running, sleeping, in I/O).
RUNNING = "running"
#: :meth:`ProcessIdentity.status` of a stopped process (SIGSTOP, or held by a tracer).
STOPPED = "stopped"
#: :meth:`ProcessIdentity.status` of a process that exited, is a zombie, or whose pid was recycled.
GONE = "gone"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


def machine_name() -> str:
    """This process's machine, for people: ``$RESIHP_MACHINE_ID`` or the host name."""
    return os.environ.get(MACHINE_ENV) or socket.gethostname()


@functools.lru_cache(maxsize=1)
def pid_namespace() -> str:
    """An identity shared by exactly the processes of this machine (whose pids can be compared with this one's)."""
    boot = (_read("/proc/sys/kernel/random/boot_id") or "").strip()
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    if not boot or not namespace:
        return f"host:{socket.gethostname()}:no-proc"  # never equal to a /proc-based identity
    simulated = os.environ.get(MACHINE_ENV)
    return f"{boot}/{namespace}{_MACHINE_SEP}{simulated}" if simulated else f"{boot}/{namespace}"


def machine_key(namespace: str) -> str:
    """A short name of the machine whose processes share ``namespace``, safe in store keys and file names."""
    return hashlib.sha1(namespace.encode()).hexdigest()[:12]


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
        namespace: see :func:`pid_namespace` (processes with equal namespaces share a machine).
        machine: the machine's name for people (:func:`machine_name`; empty when unknown).
    """

    pid: int
    start: int
    namespace: str
    machine: str = ""

    @classmethod
    def current(cls) -> ProcessIdentity:
        """This process."""
        stat = _stat(os.getpid())
        return cls(pid=os.getpid(), start=stat[1] if stat else 0, namespace=pid_namespace(), machine=machine_name())

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity:
        """The process ``pid`` of this machine (start time read now; 0 when it is gone)."""
        stat = _stat(pid)
        return cls(pid=pid, start=stat[1] if stat else 0, namespace=pid_namespace(), machine=machine_name())

    @classmethod
    def simulated(cls, machine: str) -> ProcessIdentity:
        """This process as if it ran on a machine of its own named ``machine`` (tests and benchmarks that
        run several ranks, or several machines' ranks, in one process)."""
        current = cls.current()
        base = current.namespace.split(_MACHINE_SEP)[0]
        return cls(pid=current.pid, start=current.start, namespace=f"{base}{_MACHINE_SEP}{machine}", machine=machine)

    @property
    def machine_key(self) -> str:
        """:func:`machine_key` of this process's machine."""
        return machine_key(self.namespace)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> ProcessIdentity:
        return cls(**json.loads(text))

    def comparable(self) -> bool:
        """Whether this process can check the liveness of that one (same machine and pid namespace)."""
        return self.namespace == pid_namespace() and not self.namespace.endswith(":no-proc")

    def visible(self) -> bool:
        """Whether ``/proc`` shows this process here (same kernel and pid namespace; simulated machines of
        one host see each other's processes, though they are not :meth:`comparable`)."""
        own = pid_namespace()
        return self.namespace.split(_MACHINE_SEP)[0] == own.split(_MACHINE_SEP)[0] and not own.endswith(":no-proc")

    def status(self) -> str:
        """:data:`RUNNING`, :data:`STOPPED` (``T``/``t``: SIGSTOP or a tracer) or :data:`GONE` (exited, a
        zombie, or its pid recycled). Only meaningful when :meth:`visible`; otherwise :data:`RUNNING` (unknown)."""
        if not self.visible():
            return RUNNING
        stat = _stat(self.pid)
        if stat is None:
            return GONE
        state, start = stat
        if state in ("Z", "X", "x") or (self.start and start != self.start):
            return GONE
        return STOPPED if state in ("T", "t") else RUNNING

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
