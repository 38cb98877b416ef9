"""Separate "machines" on one host: Linux namespaces joined by a bridge, with faults a cluster has.

:class:`Machines` starts N machines. Each is a set of namespaces held by a small init process:

* its own **network** namespace with one interface, ``eth0``, at its own address on a private subnet,
  plugged (a veth pair) into a bridge that lives in a *switch* namespace of its own (nothing is added
  to the host's network: two harnesses never collide, whatever their addresses and names);
* its own **hostname** (UTS namespace) and an ``/etc/hosts`` naming every machine (mount namespace),
  so ``torchrun --rdzv-endpoint node0:29400`` and ``MASTER_ADDR=node0`` resolve as on a cluster;
* its own **pid** namespace with ``/proc`` mounted for it: a process sees only its machine's
  processes, and the init is pid 1 (it reaps orphans, e.g. a double-forked daemon).

The file system is shared (as a cluster's shared storage): give each machine its own ``TMPDIR`` (the
default environment of :meth:`Machine.popen` does) where a program keeps per-machine files in the
temporary directory.

Faults: :meth:`Machine.kill` SIGKILLs every process of a machine (the machine stays up and can run
new commands: a rebooted or replacement machine); :meth:`Machine.cut_link` takes its port on the
bridge down (the machine runs on, unreachable: a lost machine as its peers see it; packets are
dropped, nobody gets a reset) and :meth:`Machine.restore_link` plugs it back;
:meth:`Machine.stop` SIGSTOPs every process of it (agent and workers) and :meth:`Machine.resume`
continues them.

Clean-up is certain: :meth:`Machines.close` (the context manager's exit, and ``atexit`` for any harness
left open) SIGKILLs every machine's init, and the kernel then kills every process of that pid
namespace and frees its network namespace, veth pair included. If the process that owns the harness
dies without running either (SIGKILL), the ``unshare`` processes holding the namespaces get SIGKILL
(parent-death signal) and ``--kill-child`` takes the inits with them. Nothing is named on the host (no
``ip netns`` entry, no bridge or veth in the host's namespace), so nothing can be left over. The
parent-death signal fires when the *thread* that started the harness exits: start it from a thread
that outlives it (a test's main thread).

Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN), ``ip`` (iproute2), and ``unshare``, ``nsenter`` and
``setpriv`` (util-linux); :func:`unavailable_reason` says why not where they are missing, so tests can
skip.

    with Machines(3) as machines:
        agent = machines[0].popen(["torchrun", ..., "--rdzv-endpoint", f"{machines[0].hostname}:29400", ...])
        machines[1].cut_link()
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

#: The tools the harness runs, each looked up on ``PATH`` (and in ``/sbin`` / ``/usr/sbin``).
TOOLS = ("ip", "unshare", "nsenter", "setpriv")

#: pid 1 of a machine: reaps every orphan the machine's processes leave (a double-forked daemon), else
#: sleeps. It ignores the signals a machine's processes could send it (pid 1 of a namespace does).
_INIT = (
    "import os, time\n"
    "while True:\n"
    "    try:\n"
    "        os.wait()\n"
    "    except ChildProcessError:\n"
    "        time.sleep(0.5)\n"
)


class MachinesError(RuntimeError):
    """The harness could not start or drive a machine (the command and its output are in the message)."""


@dataclass(frozen=True, kw_only=True)
class MachinesConfig:
    """How :class:`Machines` lays out its machines.

    Attributes:
        count: how many machines (>= 1).
        subnet: the bridge's IPv4 subnet; machine ``i`` gets its ``i + 1``-th host address. Each harness
            has a switch of its own, so harnesses may use the same subnet at once.
        hostname_prefix: machine ``i`` is called ``f"{hostname_prefix}{i}"``.
        start_timeout_s: bound of each set-up command and of a machine's start.
    """

    count: int
    subnet: str = "10.77.0.0/24"
    hostname_prefix: str = "node"
    start_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"MachinesConfig.count must be an integer >= 1, got {self.count!r}")
        network = ipaddress.ip_network(self.subnet)
        if network.version != 4 or network.num_addresses - 2 < self.count:
            raise ValueError(f"MachinesConfig.subnet {self.subnet!r} must be IPv4 with room for {self.count} hosts")

    @property
    def prefix_length(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    def address(self, index: int) -> str:
        """Machine ``index``'s address on the bridge."""
        return str(ipaddress.ip_network(self.subnet).network_address + index + 1)


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


@functools.cache
def unavailable_reason() -> str | None:
    """Why machines cannot be made here (``None`` when they can): not root, a tool missing, or the
    kernel refusing the namespaces (e.g. inside an unprivileged container). Tries one machine once."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network, UTS, mount and pid namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    missing = [name for name in TOOLS if _tool(name) is None]
    if missing:
        return f"missing {', '.join(missing)} (Debian: iproute2 for ip, util-linux for the others)"
    try:
        with Machines(MachinesConfig(count=1, start_timeout_s=10.0)) as machines:
            machines[0].check_call(["true"], timeout=10)
    except (MachinesError, OSError, subprocess.SubprocessError) as err:
        return f"namespaces refused here: {err}"
    return None


def _namespace_id(pid: int, kind: str) -> tuple[int, int] | None:
    try:
        info = os.stat(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _run(argv: Sequence[str], timeout: float) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as err:
        raise MachinesError(f"{' '.join(argv)}: no answer within {timeout:g} s") from err
    if done.returncode != 0:
        raise MachinesError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _read_line(stream: IO[bytes], timeout: float) -> bytes:
    """One line from a pipe, or ``b""`` if none comes within ``timeout`` seconds."""
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else b""


class _Holder:
    """An ``unshare`` process (parent-death signal SIGKILL) whose forked child holds new namespaces.

    ``inner_pid`` is the child's pid as the host sees it: ``nsenter --target`` enters its namespaces.
    """

    def __init__(self, flags: Sequence[str], script: str, timeout: float) -> None:
        argv = [_tool("setpriv"), "--pdeathsig", "KILL", _tool("unshare"), *flags, "--fork", "--kill-child",
                "/bin/sh", "-c", script]
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True)
        line = _read_line(self.process.stdout, timeout)
        if line.strip() != b"ready":
            exited = self.process.poll() is not None
            err = self.process.stderr.read().decode(errors="replace").strip() if exited else ""
            self.close()
            raise MachinesError(f"{' '.join(flags)}: the namespaces' holder did not start ({err or 'no answer'})")
        self.inner_pid = self._child_of(self.process.pid)

    @staticmethod
    def _child_of(parent: int) -> int:
        for pid in _all_pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                return pid
        raise MachinesError(f"unshare (pid {parent}) has no child")

    def enter(self, *kinds: str) -> list[str]:
        """``nsenter`` arguments that run a command in these namespaces."""
        return [_tool("nsenter"), f"--target={self.inner_pid}", *(f"--{kind}" for kind in kinds)]

    def close(self) -> None:
        """SIGKILLs the namespaces' holder; with a pid namespace the kernel kills every process in it."""
        for pid in (getattr(self, "inner_pid", None), self.process.pid):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.process.stdout, self.process.stderr):
            stream.close()


class Machine:
    """One machine of a :class:`Machines` harness: run commands in it and inject faults.

    Attributes:
        index: its position in the harness (0-based).
        hostname: its hostname, known to every machine's ``/etc/hosts``.
        address: its IPv4 address on the bridge.
        tmpdir: its private temporary directory (``TMPDIR`` of the commands :meth:`popen` starts).
    """

    def __init__(self, harness: Machines, index: int, holder: _Holder) -> None:
        self.index = index
        self.hostname = f"{harness.config.hostname_prefix}{index}"
        self.address = harness.config.address(index)
        self.port_name = f"port{index}"  # its veth's end on the bridge, in the switch namespace
        self.tmpdir = harness.workdir / self.hostname / "tmp"
        self.tmpdir.mkdir(parents=True)
        self._harness = harness
        self._holder = holder
        self._pid_namespace = _namespace_id(holder.inner_pid, "pid")
        self._launchers: list[subprocess.Popen] = []  # the host-side nsenter of each popen

    def __repr__(self) -> str:
        return f"Machine({self.hostname}, {self.address})"

    # --- running commands ------------------------------------------------------------------------
    def command(self, argv: Sequence[str], cwd: str | os.PathLike | None = None) -> list[str]:
        """``argv`` wrapped to run inside this machine (its network, hostname, ``/etc/hosts``, pids)."""
        workdir = os.fspath(cwd) if cwd is not None else os.getcwd()
        # nsenter waits for the command (and stops itself while the command is stopped): it dies with
        # this process (parent-death signal), so that a stopped one cannot outlive the harness.
        return [_tool("setpriv"), "--pdeathsig", "KILL", *self._holder.enter("net", "uts", "mount", "pid"),
                f"--wd={workdir}", "--", *map(os.fspath, argv)]

    def environment(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """``env`` (default: this process's environment) with ``TMPDIR`` set to the machine's own."""
        merged = dict(os.environ if env is None else env)
        merged["TMPDIR"] = str(self.tmpdir)
        return merged

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Starts ``argv`` on this machine in a session of its own (``subprocess.Popen`` keywords pass on).

        The returned process is ``nsenter``'s, on the host; it exits with the command's status.
        """
        kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen(self.command(argv, cwd), env=self.environment(env), **kwargs)
        self._launchers.append(process)
        return process

    def check_call(self, argv: Sequence[str], timeout: float = 30.0) -> str:
        """Runs ``argv`` on this machine to completion and returns its output (raises if it fails)."""
        return _run(self.command(argv), timeout)

    # --- what runs on it -------------------------------------------------------------------------
    def pids(self) -> list[int]:
        """Host pids of every process of this machine (its init excluded)."""
        if self._pid_namespace is None:
            return []
        return [pid for pid in _all_pids()
                if pid != self._holder.inner_pid and _namespace_id(pid, "pid") == self._pid_namespace]

    def host_pid(self, pid: int) -> int:
        """The host pid of the process this machine knows as ``pid`` (what ``os.getpid()`` says inside it)."""
        for host_pid in self.pids():
            try:
                status = Path(f"/proc/{host_pid}/status").read_text()
            except OSError:
                continue
            nspids = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if nspids and int(nspids[-1]) == pid:
                return host_pid
        raise MachinesError(f"{self.hostname} runs no process {pid}")

    def _signal_all(self, signum: int, rounds: int = 5) -> list[int]:
        hit: set[int] = set()
        for _ in range(rounds):  # again, for children forked while the first signals went out
            pids = [pid for pid in self.pids() if pid not in hit]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signum)
                    hit.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        return sorted(hit)

    # --- faults ----------------------------------------------------------------------------------
    def kill(self, timeout: float = 10.0) -> list[int]:
        """SIGKILLs every process of this machine (it stays up: new commands can run on it).

        Returns:
            The host pids killed. Raises :class:`MachinesError` if some still live after ``timeout``.
        """
        killed = self._signal_all(signal.SIGKILL)
        self._continue_launchers()  # a launcher stopped with its command could not reap it otherwise
        deadline = time.monotonic() + timeout
        while (left := [pid for pid in self.pids() if not _is_zombie(pid)]):
            if time.monotonic() > deadline:
                raise MachinesError(f"{self.hostname}: processes {left} survive SIGKILL")
            time.sleep(0.05)
        return killed

    def stop(self) -> list[int]:
        """SIGSTOPs every process of this machine (alive, silent). Returns the host pids stopped."""
        return self._signal_all(signal.SIGSTOP)

    def resume(self) -> list[int]:
        """SIGCONTs every process of this machine."""
        resumed = self._signal_all(signal.SIGCONT, rounds=1)
        self._continue_launchers()
        return resumed

    def _continue_launchers(self) -> None:
        """nsenter stops itself when its command stops, and waits for a SIGCONT of its own."""
        for launcher in self._launchers:
            if launcher.poll() is None:
                try:
                    os.kill(launcher.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def cut_link(self) -> None:
        """Takes this machine's port on the bridge down: it runs on, but no packet reaches it or leaves it."""
        self._harness.switch_ip("link", "set", self.port_name, "down")

    def restore_link(self) -> None:
        """Plugs this machine's port back in."""
        self._harness.switch_ip("link", "set", self.port_name, "up")

    def close(self) -> None:
        self._holder.close()
        for launcher in self._launchers:
            if launcher.poll() is None:
                launcher.kill()
            try:
                launcher.wait(5)
            except subprocess.TimeoutExpired:
                pass


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


_OPEN: set[Machines] = set()
_OPEN_LOCK = threading.Lock()


def _close_all_open() -> None:
    for harness in list(_OPEN):
        harness.close()


atexit.register(_close_all_open)


class Machines:
    """N machines on one bridge (see the module's documentation). A context manager.

    Args:
        config: the layout, or just the number of machines.
        workdir: where the machines' hosts file and temporary directories go (default: a new temporary
            directory, removed at :meth:`close`).
    """

    def __init__(self, config: MachinesConfig | int, workdir: str | os.PathLike | None = None) -> None:
        self.config = config if isinstance(config, MachinesConfig) else MachinesConfig(count=config)
        self.tag = uuid.uuid4().hex[:8]
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix=f"machines-{self.tag}-") if workdir is None else workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.machines: list[Machine] = []
        self._switch: _Holder | None = None
        self._closed = False
        with _OPEN_LOCK:
            _OPEN.add(self)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # --- set-up ----------------------------------------------------------------------------------
    def _start(self) -> None:
        cfg = self.config
        hosts = self.workdir / "hosts"
        names = [f"{cfg.hostname_prefix}{i}" for i in range(cfg.count)]
        hosts.write_text("127.0.0.1\tlocalhost\n" + "".join(f"{cfg.address(i)}\t{name}\n" for i, name in enumerate(names)))
        ip = _tool("ip")
        self._switch = _Holder(["--net"], f"{ip} link set lo up && echo ready && exec sleep infinity", cfg.start_timeout_s)
        self.switch_ip("link", "add", "br0", "type", "bridge")
        self.switch_ip("link", "set", "br0", "up")
        init = f"{sys.executable} -S -c '{_INIT}'"
        for index, name in enumerate(names):
            script = (f"hostname {name} && mount --bind {hosts} /etc/hosts && {ip} link set lo up && echo ready "
                      f"&& exec {init} >/dev/null 2>&1")
            holder = _Holder(["--net", "--uts", "--mount", "--pid", "--mount-proc", "--propagation", "private"], script,
                             cfg.start_timeout_s)
            machine = Machine(self, index, holder)
            self.machines.append(machine)
            self.switch_ip("link", "add", machine.port_name, "type", "veth", "peer", "name", "eth0", "netns",
                           str(holder.inner_pid))
            self.switch_ip("link", "set", machine.port_name, "master", "br0", "up")
            machine_ip = [*holder.enter("net"), "--", ip]
            _run([*machine_ip, "addr", "add", f"{machine.address}/{cfg.prefix_length}", "dev", "eth0"], cfg.start_timeout_s)
            _run([*machine_ip, "link", "set", "eth0", "up"], cfg.start_timeout_s)

    def switch_ip(self, *args: str) -> str:
        """Runs ``ip ARGS`` in the switch's network namespace (where the bridge and the machines' ports are)."""
        assert self._switch is not None
        return _run([*self._switch.enter("net"), "--", _tool("ip"), *args], self.config.start_timeout_s)

    # --- access ----------------------------------------------------------------------------------
    def __getitem__(self, index: int) -> Machine:
        return self.machines[index]

    def __iter__(self):
        return iter(self.machines)

    def __len__(self) -> int:
        return len(self.machines)

    def __enter__(self) -> Machines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- tear-down -------------------------------------------------------------------------------
    def close(self) -> None:
        """Kills every process of every machine and frees every namespace (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for machine in self.machines:
            machine.close()
        if self._switch is not None:
            self._switch.close()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        with _OPEN_LOCK:
            _OPEN.discard(self)
