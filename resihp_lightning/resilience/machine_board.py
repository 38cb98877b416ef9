"""The two levels of failure detection: a board per machine, one heartbeat per machine across the network.

**Level 1, on a machine.** The processes of one machine (those whose pids can be probed through
``/proc``, :mod:`.procs`) share a directory, the machine's :class:`LocalBoard` (in ``/dev/shm``, else
the temporary directory, named by a token the job's first detector puts in the store, and by the
machine). Each
process writes its beat there (``beat-<rank>``: ``"<counter>:<step>:<waiting>:<generation>"``, or
:data:`GOODBYE`); nothing of it crosses the network. A local peer's liveness is read from ``/proc``:
gone or a zombie is ``exited`` at once, stopped (``T``) for the silence timeout is ``silent``, and a
process that lives and is not stopped is never ``silent`` however late its beat (its beat thread may be
starved by a CPU hog or a long GIL-holding call: that is the progress timeout's business, not a
failure). The beats only carry the step and the "waiting in communication" flag for the hang check.

**Level 2, across machines.** One process per machine, its *monitor* (the lowest-ranked local process
that runs), writes the machine's beat to the store, ``mb/<machine key>`` (:func:`encode_machine_beat`:
who wrote it, a counter, and the ranks of the machine's processes it vouches for, with their local
beats when the hang check needs their steps), reads the other machines' beats in one ``multi_get``,
and relays the current generation's abort marker to the board (``abort-<generation>``), where the
other local processes read it. A machine whose beat has not changed for the silence timeout is lost,
and with it all its ranks (one verdict naming them). If the monitor's thread falls behind (its stamp
on the board older than half the silence timeout, and at least two intervals), any other local
process writes the machine's beat and reads the store's marker in its place for as long, so a
machine goes silent only when none of its processes gets to run, or when it is cut off.

Per interval the store sees at most three operations per machine (its beat, the read of the other
machines' beats, the marker check), whatever the number of processes; on one machine, two (the beat,
which is also the store host's sign of life from the machine, and the marker check).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: The beat of a process that stopped on purpose (never judged again).
GOODBYE = b"done"
#: Store key (job namespace) of the token that names the job's boards.
BOARD_TOKEN_KEY = "detector/board"
_STAMP = "monitor.stamp"


def machine_beat_key(machine: str) -> str:
    """The job key of a machine's beat (``machine``: :attr:`~.procs.ProcessIdentity.machine_key`)."""
    return f"mb/{machine}"


@dataclass(frozen=True)
class MachineBeat:
    """A machine's beat: written by ``writer`` (original rank), its ``counter``-th, vouching for ``ranks``
    (original rank -> that process's local beat)."""

    writer: int
    counter: int
    ranks: dict[int, bytes]


def encode_machine_beat(writer: int, counter: int, ranks: dict[int, bytes]) -> str:
    """``"<writer>:<counter>|<rank>=<local beat>;..."``."""
    body = ";".join(f"{rank}={beat.decode()}" for rank, beat in sorted(ranks.items()))
    return f"{writer}:{counter}|{body}"


def decode_machine_beat(value: bytes) -> MachineBeat | None:
    """The beat :func:`encode_machine_beat` wrote, or None if ``value`` is not one."""
    try:
        head, _, body = value.decode().partition("|")
        writer, counter = (int(x) for x in head.split(":"))
        ranks = {}
        for entry in filter(None, body.split(";")):
            rank, _, beat = entry.partition("=")
            ranks[int(rank)] = beat.encode()
    except ValueError:
        return None
    return MachineBeat(writer, counter, ranks)


def board_root() -> Path:
    """Where the boards of this user's jobs live: in memory (``/dev/shm``) where there is one, else the
    temporary directory (on a disk, each beat's ``os.replace`` can cost milliseconds: a journal commit)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"resihp-{os.getuid()}" / "boards"


class LocalBoard:
    """A machine's shared directory for its processes' beats, the monitor's stamp and relayed abort markers.

    Every write is a whole-file ``os.replace``, so a reader sees the old content or the new, never half.

    Args:
        path: the directory (created).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_job(cls, token: str, machine: str) -> LocalBoard:
        """The board of job ``token`` on ``machine`` (a machine key)."""
        return cls(board_root() / token / machine)

    def _write(self, name: str, data: bytes) -> None:
        tmp = self.path / f".{name}.{os.getpid()}.{id(self)}"
        try:
            tmp.write_bytes(data)
        except FileNotFoundError:  # removed under us (everyone else said goodbye); this process still runs
            self.path.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
        os.replace(tmp, self.path / name)

    def _read(self, name: str) -> bytes | None:
        try:
            return (self.path / name).read_bytes()
        except OSError:
            return None

    def write_beat(self, rank: int, beat: bytes) -> None:
        self._write(f"beat-{rank}", beat)

    def read_beats(self) -> dict[int, bytes]:
        """Original rank -> latest beat, for every process that wrote one here."""
        beats = {}
        try:
            names = os.listdir(self.path)
        except OSError:
            return beats
        for name in names:
            if name.startswith("beat-") and name[5:].isdigit():
                beat = self._read(name)
                if beat is not None:
                    beats[int(name[5:])] = beat
        return beats

    def read_beat(self, rank: int) -> bytes | None:
        return self._read(f"beat-{rank}")

    def beat_age(self, rank: int) -> float:
        """Seconds since ``rank`` last wrote its beat here (0 when it never did: no evidence)."""
        try:
            return max(time.time() - (self.path / f"beat-{rank}").stat().st_mtime, 0.0)
        except OSError:
            return 0.0

    def stamp(self) -> None:
        """Records that the monitor ran now (``time.monotonic()``: one clock per machine)."""
        self._write(_STAMP, repr(time.monotonic()).encode())

    def stamp_age(self) -> float:
        """Seconds since the monitor last ran (infinite when it never did)."""
        value = self._read(_STAMP)
        try:
            return time.monotonic() - float(value) if value else float("inf")
        except ValueError:
            return float("inf")

    def relay_marker(self, generation: int, payload: bytes) -> None:
        self._write(f"abort-{generation}", payload)

    def marker(self, generation: int) -> bytes | None:
        return self._read(f"abort-{generation}")

    def remove_beat(self, rank: int) -> None:
        """Removes ``rank``'s beat (it stopped without a goodbye; its neighbours judge it by ``/proc``)."""
        (self.path / f"beat-{rank}").unlink(missing_ok=True)

    def remove_if_done(self, ranks: Iterable[int]) -> bool:
        """Removes the board when none of ``ranks`` (every process known to run on this machine) nor any
        other process still beats here: each said goodbye or stopped. Returns whether it did."""
        beats = self.read_beats()
        if any(beats.get(rank, GOODBYE) != GOODBYE for rank in ranks) or any(b != GOODBYE for b in beats.values()):
            return False
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            self.path.parent.rmdir()  # the job's directory, once no machine of it is left here
        except OSError:
            pass
        return True
