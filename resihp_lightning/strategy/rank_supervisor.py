"""A supervisor that is no rank: starts every local rank as a child, outlives them, exits with the job's status.

Under Lightning's own launcher the command the user typed (``python train.py``) used to be rank 0: when
it died the command returned 137 at once while ranks 1.. trained on in the background. With
:class:`RankSupervisor` the command's process starts every rank (rank 0 included) as a child process and
only waits for them:

* the ranks write straight to the command's stdout and stderr (they inherit them: progress bars and
  partial lines pass unchanged);
* SIGINT and SIGTERM sent to the command are forwarded to every rank once (the ranks run in their own
  session, so a terminal's Ctrl+C reaches them only through the supervisor, exactly once); a second
  signal, or ranks still running ``grace_s`` after the first, get SIGKILL;
* each rank is started with a parent-death signal (SIGKILL), so a supervisor killed hard takes its ranks
  with it instead of leaving them training in the background;
* when every rank has exited, the command exits with the job's status (:func:`job_status`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TextIO

#: Signals the supervisor forwards to its ranks.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankExit:
    """How one rank ended.

    Attributes:
        local_rank: the rank's index on this machine.
        returncode: as :attr:`subprocess.Popen.returncode` (``-N``: killed by signal N).
        at: ``time.monotonic()`` when the supervisor saw it exit.
    """

    local_rank: int
    returncode: int
    at: float

    @property
    def status(self) -> int:
        """The rank's exit status as a shell reports it (``128 + N`` for signal N)."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    def describe(self) -> str:
        """``exit 0`` / ``exit 75`` / ``killed by SIGKILL``."""
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"killed by {name}"
        return f"exit {self.returncode}"


def job_status(exits: Sequence[RankExit], *, restart_code: int, interrupted: int | None = None) -> int:
    """The job's exit status once every rank has exited.

    In order: the ranks asked for a restart (any exited with ``restart_code``) -> ``restart_code``; the
    command was interrupted (a forwarded SIGINT / SIGTERM) and not every rank finished -> ``128 + signal``;
    some rank finished (exit 0: the survivors of a lost rank finished the run) -> 0; otherwise every rank
    failed -> the status of the first rank that failed (the cause; the others usually fail because of it).

    Args:
        exits: one per rank, in any order.
        restart_code: the status with which ranks ask for the job to be restarted (``fail_stop.exit_code``).
        interrupted: the signal the supervisor forwarded, if any.
    """
    if not exits:
        raise ValueError("job_status needs at least one rank's exit")
    statuses = [e.status for e in exits]
    if restart_code in statuses:
        return restart_code
    if interrupted is not None and any(s != 0 for s in statuses):
        return 128 + int(interrupted)
    if 0 in statuses:
        return 0
    return min(exits, key=lambda e: e.at).status


def _load_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


# Resolved here, in the supervisor: the forked child (before exec) must not load libraries or allocate.
_PRCTL = _load_prctl()


def _die_with_parent(parent_pid: int) -> None:
    """In a freshly forked rank, before exec: SIGKILL when the supervisor dies (Linux; a no-op elsewhere)."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the supervisor died before prctl took effect
        os._exit(128 + signal.SIGKILL)


@dataclass
class RankSupervisor:
    """Starts one process per local rank and waits for all of them (see the module docstring).

    Args:
        commands: the command line of each local rank, in local-rank order.
        envs: each rank's whole environment.
        cwd: the ranks' working directory (``None``: the supervisor's).
        restart_code: passed to :func:`job_status`.
        grace_s: seconds the ranks get to end after a forwarded signal before they are SIGKILLed.
        poll_s: how often the supervisor looks at its ranks.
        log: where the supervisor's own lines go (once a rank has failed or a signal came: each rank's end
            and the job's status; a run where every rank finishes prints none). Default: stderr.
    """

    commands: Sequence[Sequence[str]]
    envs: Sequence[Mapping[str, str]]
    cwd: str | None = None
    restart_code: int = 75
    grace_s: float = 30.0
    poll_s: float = 0.05
    log: TextIO | None = None
    procs: list[subprocess.Popen] = field(default_factory=list, init=False)
    exits: dict[int, RankExit] = field(default_factory=dict, init=False)
    interrupted: int | None = field(default=None, init=False)
    _kill_at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if len(self.commands) != len(self.envs) or not self.commands:
            raise ValueError("RankSupervisor needs one command and one environment per rank")

    def start(self) -> None:
        """Starts every rank (once)."""
        if self.procs:
            raise RuntimeError("the ranks were already started")
        parent = os.getpid()
        for command, env in zip(self.commands, self.envs):
            self.procs.append(subprocess.Popen(
                list(command), env=dict(env), cwd=self.cwd, start_new_session=True,
                preexec_fn=lambda: _die_with_parent(parent),
            ))

    def send(self, signum: int) -> None:
        """Sends ``signum`` to every rank still running."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def wait(self) -> int:
        """Forwards SIGINT / SIGTERM while the ranks run; returns the job's status when all have exited."""
        previous = {s: signal.signal(s, self._on_signal) for s in FORWARDED_SIGNALS}
        try:
            while len(self.exits) < len(self.procs):
                for local_rank, proc in enumerate(self.procs):
                    if local_rank not in self.exits and proc.poll() is not None:
                        self._record(local_rank, proc.returncode)
                if self._kill_at is not None and time.monotonic() >= self._kill_at:
                    self.send(signal.SIGKILL)
                    self._kill_at = None
                time.sleep(self.poll_s)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        status = job_status(list(self.exits.values()), restart_code=self.restart_code, interrupted=self.interrupted)
        if self._eventful():
            self._say(f"every rank has exited; the job's exit status is {status}")
        return status

    def run(self) -> int:
        """:meth:`start`, then :meth:`wait`."""
        self.start()
        return self.wait()

    def _record(self, local_rank: int, returncode: int) -> None:
        self.exits[local_rank] = RankExit(local_rank, returncode, time.monotonic())
        if self._eventful():  # a run where every rank finishes says nothing
            running = [r for r in range(len(self.procs)) if r not in self.exits]
            rest = f"; ranks {running} still running" if running else ""
            self._say(f"local rank {local_rank} ended ({self.exits[local_rank].describe()}){rest}")

    def _eventful(self) -> bool:
        """Whether a rank has failed or the job was interrupted (then every rank's end is told)."""
        return self.interrupted is not None or any(e.returncode != 0 for e in self.exits.values())

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.interrupted is None:
            self.interrupted = signum
            self._say(f"{signal.Signals(signum).name} received: forwarded to the ranks "
                      f"(again, or {self.grace_s:g} s later, kills them)")
            self.send(signum)
            self._kill_at = time.monotonic() + self.grace_s
        else:
            self.send(signal.SIGKILL)

    def _say(self, message: str) -> None:
        stream: Any = self.log if self.log is not None else sys.stderr
        print(f"[resihp supervisor] {message}", file=stream, flush=True)
