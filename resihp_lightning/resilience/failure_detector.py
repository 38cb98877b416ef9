"""Failure detection over the rendezvous store, in two levels: processes on a machine, machines on the network.

Each process runs one daemon thread. Every ``interval_s`` (0.2 s) it writes its beat,
``"<counter>:<step>:<waiting>:<generation>"``, checks the current generation's abort marker, and
decides, on *its own monotonic clock* (so clock skew between machines does not matter), who failed.
How it learns about a peer depends on where the peer runs (:mod:`.machine_board` has the layout):

* **on its machine** (same pid namespace, found from the peer's registered
  :class:`~.procs.ProcessIdentity`): through ``/proc``. ``exited``: the process is gone or a zombie
  (seen within one poll: this is what makes a ``kill -9`` visible at once); ``silent``: it has been
  stopped (SIGSTOP, state ``T``) for ``timeout_s``. A process that lives and is not stopped is never
  ``silent``, however late its beat: a beat thread starved of CPU or of the GIL under load is no
  failure (before, such a healthy rank was evicted and SIGKILLed). Its beat goes to the machine's
  board (local files) and only feeds the hang check;
* **on another machine**: through that machine's beat, which one process per machine (its monitor)
  writes to the store and which vouches for the machine's live processes. Only monitors read the
  other machines' beats; a machine silent for ``timeout_s`` is lost with all its ranks, one verdict
  naming them (``machine`` of the :class:`Failure`). A rank that dies on a machine that lives is found there, by
  its neighbours, and the others learn it from the abort marker;
* **unplaced** (no registered identity, or ``probe_local_pids`` off): as before the two levels, through
  its own beat in the store, ``hb/<rank>``, read by every process (``silent`` after ``timeout_s``).

``hung`` (with ``progress_timeout_s``): a peer whose *step* (:meth:`FailureDetector.progress`) has
not moved for that long, whose main thread is not inside a communication call, while another member
is waiting in one or is ahead. The condition on the others is what makes the right rank take the
blame: when one rank is stuck in its step, the others stop advancing too, blocked in the next
collective; a bare "no progress" rule would evict all of them. Each process sets ``waiting`` in its
own beat by looking at its main thread's innermost Python frames (``comm_frames``:
``torch.distributed``, ``deepspeed.comm``, DeepSpeed's pipeline p2p, this package). When every member
is stalled and nobody waits (a long evaluation or checkpoint everywhere), nobody is blamed. The check
runs in every process that sees every member's step: on one machine all of them, on several the
monitors. It is also what finds a process that lives but has stopped working (a deadlock).

Every process reaches its verdicts by itself, so every survivor learns of a failure, not only rank 0,
and a failure of rank 0 is no special case. Verdicts are final: a rank found failed is never
reinstated (the survivors will regroup without it). A verdict is handed to ``on_failures`` (the
world aborts the generation and publishes ``gen<g>/abort``); peers that see the marker abort at their
next poll and adopt the failures it names, so after the first detection everyone aborts within about
one interval (a process that is not its machine's monitor reads the marker from the board, where the
monitor relays it: one interval more). Every failure this process learns of, its own verdicts and the
ones declared to it, also goes to the listeners of :meth:`FailureDetector.subscribe` (reporting, e.g.
the heartbeat callback).

Silence is judged only over a view without gaps: when more than half of ``timeout_s`` passed between
two polls (this thread not scheduled, its process's GIL held, the store slow or unreachable for a
while), the poll only refreshes the peers' clocks. A late observer must not blame punctual peers, and
the beats it reads after a stall of the store are as old as the stall.
If the store cannot be reached for ``store_grace_s``, :attr:`FailureDetector.store_lost` is set and
logged (or handed to ``on_store_lost``); training may go on (gloo needs no store after its groups
exist) but no regroup is possible, and from then on the thread only watches for local exits (which
still abort the generation, so that nobody hangs; the regroup that follows raises
:class:`~resihp_lightning.resilience.failures.StoreUnavailable`) and, with ``stall_timeout_s``, for a
communication call of the main thread blocked that long (``on_stalled``): without the store no peer's
loss can be learnt, and a process cut off from the others (a machine whose link is down, a minority
of etcd members) would otherwise wait in its collective until the collective's own timeout.

A process that ends on purpose can say goodbye (``stop(goodbye=True)``: its beat, on the board and in
the store, becomes :data:`~resihp_lightning.resilience.machine_board.GOODBYE`); its peers then stop judging it (:attr:`FailureDetector.left`). One
detector runs per process: a strategy with ``fail_stop`` offers its elastic world's as
``strategy.failure_detector`` (:class:`~resihp_lightning.contract.Survivable`), so that a reporting
callback uses it instead of starting a second one.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from resihp_lightning._logging import get_logger
from resihp_lightning.errors import invalid_option
from resihp_lightning.resilience.machine_board import (
    BOARD_TOKEN_KEY,
    GOODBYE,
    LocalBoard,
    decode_machine_beat,
    encode_machine_beat,
    machine_beat_key,
)
from resihp_lightning.resilience.procs import GONE, RUNNING, STOPPED, ProcessIdentity
from resihp_lightning.resilience.store import beat_key, proc_key

log = get_logger(__name__)

_SEP = os.sep
DEFAULT_COMM_FRAMES = (
    f"torch{_SEP}distributed{_SEP}",
    f"deepspeed{_SEP}comm{_SEP}",
    f"deepspeed{_SEP}runtime{_SEP}pipe{_SEP}p2p.py",
    f"resihp_lightning{_SEP}resilience{_SEP}world.py",
    f"resihp_lightning{_SEP}resilience{_SEP}abortable_waits.py",  # a torch.distributed wait, abortable
    f"resihp_lightning{_SEP}resilience{_SEP}membership.py",
    f"resihp_lightning{_SEP}strategy{_SEP}spares.py",  # a spare waiting for the members' step
)
# Entry points that wrap a whole program (torchrun's @record) are not communication.
_NOT_COMM_FRAMES = (f"torch{_SEP}distributed{_SEP}elastic{_SEP}", f"torch{_SEP}distributed{_SEP}run.py")

EXITED, SILENT, HUNG = "exited", "silent", "hung"

def abort_key(generation: int) -> str:
    """The job key that marks ``generation`` as aborted (value: JSON with ``by``, ``reason``, ``failed``)."""
    return f"gen{generation}/abort"


@dataclass(frozen=True, kw_only=True)
class FailureDetectorConfig:
    """Options of failure detection.

    Attributes:
        interval_s: seconds between beats and checks.
        timeout_s: a peer whose beat has not changed for this long has failed (``silent``).
        progress_timeout_s: a peer stuck in its step for this long has failed (``hung``); None
            turns the check off. Must exceed the longest legitimate gap between two
            :meth:`FailureDetector.progress` calls on one rank while others wait for it.
        probe_local_pids: watch peers on this machine through ``/proc`` (exits seen at once, a live process
            never found silent) and other machines through one beat each; off: every peer through its
            own beat in the store.
        store_grace_s: store errors for this long set :attr:`FailureDetector.store_lost`.
        stall_timeout_s: once the store is lost, a communication call of the main thread (one call:
            the same frame) blocked this long is handed to ``on_stalled``; None: never.
        comm_frames: path fragments of modules whose frames mean "waiting in communication".
        comm_frame_depth: how many innermost frames of the main thread are looked at (few: the
            outer frames of any program eventually include its launcher's).
    """

    interval_s: float = 0.2
    timeout_s: float = 1.0
    progress_timeout_s: float | None = None
    probe_local_pids: bool = True
    store_grace_s: float = 5.0
    stall_timeout_s: float | None = None
    comm_frames: tuple[str, ...] = DEFAULT_COMM_FRAMES
    comm_frame_depth: int = 3

    def __post_init__(self) -> None:
        for name in ("interval_s", "timeout_s", "store_grace_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise invalid_option(f"resilience.detector.{name}", value, "seconds > 0")
        if self.timeout_s < 2 * self.interval_s:
            raise invalid_option(
                "resilience.detector.timeout_s", self.timeout_s, f">= 2 x interval_s ({2 * self.interval_s})"
            )
        if self.progress_timeout_s is not None and not (
            isinstance(self.progress_timeout_s, (int, float)) and self.progress_timeout_s >= 2 * self.interval_s
        ):
            raise invalid_option(
                "resilience.detector.progress_timeout_s", self.progress_timeout_s, "null or seconds >= 2 x interval_s"
            )
        if self.stall_timeout_s is not None and (
            not isinstance(self.stall_timeout_s, (int, float)) or isinstance(self.stall_timeout_s, bool)
            or not self.stall_timeout_s > 0
        ):
            raise invalid_option("resilience.detector.stall_timeout_s", self.stall_timeout_s, "null or seconds > 0")
        if not isinstance(self.comm_frame_depth, int) or self.comm_frame_depth < 1:
            raise invalid_option("resilience.detector.comm_frame_depth", self.comm_frame_depth, "an integer >= 1")


@dataclass(frozen=True)
class Failure:
    """One verdict: ``rank`` (original) failed for ``reason``, decided by ``reporter`` at ``at``.

    ``at`` is the reporter's ``time.monotonic()`` (comparable across processes of one machine).
    ``machine`` names the machine when the verdict is that whole machine's loss (every rank of it
    gets one, from the same poll).
    """

    rank: int
    reason: str
    reporter: int
    at: float
    machine: str | None = None


@dataclass
class _Peer:
    beat: bytes | None = None
    changed: float = 0.0
    step: int = -1
    step_changed: float = 0.0
    waiting: bool = False
    stopped_since: float | None = None  # a local peer: since when it has been seen stopped


@dataclass
class _Machine:
    """Another machine as its peers see it: its beat and when it last changed (this process's clock)."""

    key: str
    name: str
    beat: bytes | None = None
    changed: float = 0.0


@dataclass
class _Watch:
    members: tuple[int, ...] = ()
    generation: int = 0
    peers: dict[int, _Peer] = field(default_factory=dict)
    marker_seen: bool = False
    judge_unseen: bool = True
    machines: dict[str, _Machine] = field(default_factory=dict)


def main_thread_comm_frame(thread_id: int, fragments: Iterable[str], depth: int) -> FrameType | None:
    """The innermost of the thread's ``depth`` innermost Python frames that runs a communication module."""
    frame = sys._current_frames().get(thread_id)
    for _ in range(depth):
        if frame is None:
            return None
        name = frame.f_code.co_filename
        if any(f in name for f in fragments) and not any(f in name for f in _NOT_COMM_FRAMES):
            return frame
        frame = frame.f_back
    return None


def main_thread_waiting(thread_id: int, fragments: Iterable[str], depth: int) -> bool:
    """Whether the thread's innermost ``depth`` Python frames include a communication module."""
    return main_thread_comm_frame(thread_id, fragments, depth) is not None


class FailureDetector:
    """This process's heartbeat and failure-detection thread.

    Args:
        config: detection options.
        rank: this process's original rank.
        connect: returns a new store connection seen through the job's key namespace (the thread's
            own; it is never shared with the main thread).
        on_failures: called from the thread with the new failures (of current members only).
        on_abort_marker: called from the thread when another process aborted the current
            generation, with the generation and the marker's payload.
        on_store_lost: called from the thread once, when :attr:`store_lost` is set (instead of
            logging an error).
        on_stalled: called from the thread once per :meth:`watch`, with the seconds waited, when the store
            is lost and one communication call of the main thread has been blocked for ``stall_timeout_s``.
        identity: this process as its peers know it (default: :meth:`~.procs.ProcessIdentity.current`);
            benchmarks simulate many processes in one.
    """

    def __init__(
        self,
        config: FailureDetectorConfig | None = None,
        *,
        rank: int,
        connect: Callable[[], Any],
        on_failures: Callable[[list[Failure]], None] | None = None,
        on_abort_marker: Callable[[int, dict[str, Any]], None] | None = None,
        on_store_lost: Callable[[], None] | None = None,
        on_stalled: Callable[[float], None] | None = None,
        identity: ProcessIdentity | None = None,
    ) -> None:
        self.config = config or FailureDetectorConfig()
        self.identity = identity or ProcessIdentity.current()
        #: This machine's board (two-level detection; None with ``probe_local_pids`` off).
        self.board: LocalBoard | None = None
        self.rank = rank
        self._connect = connect
        self.on_failures = on_failures
        self.on_abort_marker = on_abort_marker
        self.on_store_lost = on_store_lost
        self.on_stalled = on_stalled
        self.store: Any = None
        #: Whether the store has been unreachable for ``store_grace_s`` (set once, by the thread).
        self.store_lost = False
        self._failed: dict[int, Failure] = {}
        self._left: set[int] = set()
        self._listeners: list[Callable[[list[Failure]], None]] = []
        self._identities: dict[int, ProcessIdentity] = {}
        self._watch = _Watch()
        self._step = 0
        self._hold = True  # no hang verdicts until the first watch()
        self._counter = 0
        self._main_id = threading.main_thread().ident or 0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_read = 0.0  # monotonic time of the last successful read of the beats
        self._errors_since: float | None = None
        self._machine_counter = 0
        self._monitor = False  # whether this process was its machine's monitor at the last poll
        # The main thread's communication call as last seen (the frame object itself: the same call,
        # not another call of the same function) and since when; whether its stall was reported.
        self._comm_frame: FrameType | None = None
        self._comm_since = 0.0
        self._stall_reported = False

    # --------------------------------------------------------------------------- public
    @property
    def failed(self) -> dict[int, Failure]:
        """Original rank -> verdict, for every failure seen so far (all generations)."""
        with self._lock:
            return dict(self._failed)

    @property
    def identities(self) -> dict[int, ProcessIdentity]:
        """Original rank -> process identity, for the peers known so far."""
        with self._lock:
            return dict(self._identities)

    @property
    def left(self) -> frozenset[int]:
        """Original ranks that said goodbye (stopped on purpose); they are not judged."""
        with self._lock:
            return frozenset(self._left)

    @property
    def step(self) -> int:
        """The step this process last reported with :meth:`progress`."""
        return self._step

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def start(self) -> FailureDetector:
        """Connects, writes the first beat and starts the thread (no verdicts before :meth:`watch`)."""
        if self._thread is not None:
            return self
        self.store = self._connect()
        if self.config.probe_local_pids:
            self.store.set(proc_key(self.rank), self.identity.to_json())  # peers place this process by it
            token = self.store.compare_set(BOARD_TOKEN_KEY, "", uuid.uuid4().hex)
            self.board = LocalBoard.for_job(token.decode() if isinstance(token, bytes) else token,
                                            self.identity.machine_key)
        self.store.set(beat_key(self.rank), self._beat_value())  # that it exists; later beats: see _beat
        self._last_read = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"resihp-detector-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def subscribe(self, listener: Callable[[list[Failure]], None]) -> None:
        """Calls ``listener`` with every new failure this process learns of from now on.

        Its own verdicts come from the detector thread (after ``on_failures``); failures declared to it
        (:meth:`declare`, :meth:`probe_exits`) from the caller's thread. A listener must be quick and
        must not block on the store.
        """
        with self._lock:
            self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[list[Failure]], None]) -> None:
        """Stops calling ``listener`` (no error if it was not subscribed)."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def watch(self, members: Iterable[int], generation: int, *, judge_unseen: bool = True, hold: bool = False) -> None:
        """Watches ``members`` (original ranks) of ``generation`` from now on, with fresh clocks.

        Args:
            members: original ranks (this process's own is ignored).
            generation: whose abort marker to watch.
            judge_unseen: whether a peer never heard from can be found ``silent`` (not while the
                job starts: ranks start seconds apart; an exit is still seen once it registered).
            hold: no hang verdicts until the next ``watch`` (while the generation forms).
        """
        now = time.monotonic()
        with self._lock:
            peers = {r: _Peer(changed=now, step_changed=now) for r in members if r != self.rank}
            for rank, peer in peers.items():
                old = self._watch.peers.get(rank)
                if old is not None:
                    peer.beat, peer.step = old.beat, old.step
            self._watch = _Watch(tuple(members), generation, peers, judge_unseen=judge_unseen)
            self._hold = hold
            self._stall_reported = False

    def hold(self) -> None:
        """Suspends hang verdicts (while the generation is aborted and being replaced)."""
        with self._lock:
            self._hold = True

    def progress(self, step: int) -> None:
        """Tells peers that this process's training loop reached ``step`` (call once per step)."""
        self._step = step

    def declare(self, failures: Iterable[Failure]) -> list[Failure]:
        """Records verdicts reached elsewhere (e.g. named by a peer's abort marker); returns the new ones."""
        new = self._record(failures)
        self._tell_listeners(new)
        return new

    def probe_exits(self, ranks: Iterable[int]) -> list[Failure]:
        """Checks now, from any thread, whether peers among ``ranks`` on this machine have exited.

        Uses the identities the thread has already read (no store access), records the exits as
        failures and returns the new ones. The regroup calls it while it waits, so that it need not
        wait for the thread's next poll to learn that a killed peer is gone.
        """
        new = self._record(self._exits(ranks))
        self._tell_listeners(new)
        return new

    def probe_goodbyes(self, ranks: Iterable[int], store: Any) -> frozenset[int]:
        """Checks now, from any thread, which peers among ``ranks`` have said goodbye; returns them.

        Reads the machine's board and ``store`` (the caller's own connection: the thread's is never
        shared), so that a caller need not wait for the thread's next poll: a collective that broke
        because a finished peer closed its connections learns why at once (the goodbye is written
        before the peer closes them).
        """
        with self._lock:
            left = set(self._left)
        found = set()
        for rank in ranks:
            if rank == self.rank:
                continue
            if rank in left:
                found.add(rank)
                continue
            try:
                on_board = self.board is not None and self.board.read_beat(rank) == GOODBYE
                key = beat_key(rank)
                if on_board or (store.check([key]) and store.get(key) == GOODBYE):
                    found.add(rank)
            except Exception as err:  # noqa: BLE001 - a store that fails now tells nothing either way
                log.debug("rank %d could not read rank %d's goodbye: %s", self.rank, rank, err)
        with self._lock:
            self._left.update(found)
        return frozenset(found)

    def know(self, identities: Mapping[int, ProcessIdentity]) -> None:
        """Records peers' process identities (read once by whoever has them; the thread reads
        missing ones from the store itself, at its next poll)."""
        with self._lock:
            self._identities.update(identities)

    def stop(self, goodbye: bool = False) -> None:
        """Stops the thread; peers will see this process go silent unless it has left.

        Args:
            goodbye: write :data:`~resihp_lightning.resilience.machine_board.GOODBYE` as this process's beat, so that peers stop judging it (a
                process that ends on purpose; never raises, the store may be gone already).
        """
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.config.interval_s * 5 + 1)
        self._thread = None
        if self.board is not None:
            try:
                if goodbye:
                    self.board.write_beat(self.rank, GOODBYE)
                else:
                    self.board.remove_beat(self.rank)
                own = self.identity.namespace
                self.board.remove_if_done([self.rank, *(r for r, i in self.identities.items() if i.namespace == own)])
            except OSError as err:
                log.debug("rank %d could not leave its machine's board: %s", self.rank, err)
        if goodbye and self.store is not None:
            try:
                self.store.set(beat_key(self.rank), GOODBYE)
            except Exception as err:  # noqa: BLE001 - at shutdown the store may be gone
                log.debug("rank %d could not say goodbye: %s", self.rank, err)

    # --------------------------------------------------------------------------- thread
    def _run(self) -> None:
        cfg = self.config
        while not self._stop.wait(cfg.interval_s):
            self._watch_stall()
            started = time.monotonic()
            try:
                self._tick()
                self._errors_since = None
            except Exception as err:  # noqa: BLE001 - a lost store shows up as any network error
                if self._stop.is_set():
                    return
                now = time.monotonic()
                # Unreachable since the failed poll began: an operation that gave up after its own timeout
                # (etcd without a quorum: op_timeout_s) has been failing that long already.
                self._errors_since = self._errors_since or started
                log.debug("detector on rank %d: store error: %s", self.rank, err)
                if not self.store_lost and now - self._errors_since > cfg.store_grace_s:
                    self.store_lost = True
                    if self.on_store_lost is None:
                        log.error("rank %d lost the rendezvous store (%s); no regroup is possible", self.rank, err)
                    else:
                        try:
                            self.on_store_lost()
                        except Exception:  # noqa: BLE001 - local exits are still watched
                            log.exception("on_store_lost hook failed")

    def _watch_stall(self) -> None:
        """Follows the main thread's communication call; hands a stall to ``on_stalled`` once the store is lost."""
        cfg = self.config
        frame = main_thread_comm_frame(self._main_id, cfg.comm_frames, cfg.comm_frame_depth)
        now = time.monotonic()
        if frame is None or frame is not self._comm_frame:
            self._comm_frame, self._comm_since = frame, now
            return
        waited = now - self._comm_since
        if (not self.store_lost or cfg.stall_timeout_s is None or waited < cfg.stall_timeout_s
                or self._stall_reported or self.on_stalled is None):
            return
        self._stall_reported = True
        log.error("rank %d lost the store and has waited %.0f s in one collective: its peers are gone or "
                  "unreachable", self.rank, waited)
        try:
            self.on_stalled(waited)
        except Exception:  # noqa: BLE001 - local exits are still watched
            log.exception("on_stalled hook failed")

    def _beat_value(self) -> str:
        waiting = main_thread_waiting(self._main_id, self.config.comm_frames, self.config.comm_frame_depth)
        with self._lock:
            generation = self._watch.generation
        return f"{self._counter}:{self._step}:{int(waiting)}:{generation}"

    def _beat(self) -> bytes:
        """Writes this process's beat: to the board (two levels) or to the store (unplaced peers read it)."""
        self._counter += 1
        value = self._beat_value().encode()
        if self.board is not None:
            self.board.write_beat(self.rank, value)
        else:
            self.store.set(beat_key(self.rank), value)
        return value

    def _tick(self) -> None:
        if self.store_lost:
            # No store: no beats, markers or verdicts from silence; local exits still abort.
            with self._lock:
                watch = self._watch
            self._notify(watch, self._record(self._exits(watch.peers)))
            return
        own_beat = self._beat()
        with self._lock:
            watch = self._watch
        failed, left = self.failed, self.left
        peers = {r: p for r, p in watch.peers.items() if r not in failed and r not in left}
        local, remote, unplaced = self._place(peers)
        statuses = {r: self._identities[r].status() for r in local}
        # The machine's monitor: its lowest-ranked process that runs (every local process agrees on it).
        self._monitor = self.board is not None and all(r > self.rank for r in local if statuses[r] == RUNNING)
        # A monitor that fell behind (its thread starved) is stood in for, so that its machine's beat and
        # the abort marker keep coming.
        standing_in = (self.board is not None and not self._monitor
                       and self.board.stamp_age() > max(2 * self.config.interval_s, self.config.timeout_s / 2))
        self._check_marker(watch, from_store=self.board is None or self._monitor or standing_in)
        values = self._read_beats({r: peers[r] for r in unplaced})
        # The board's beats: for this machine's beat, and the local steps of the hang check.
        reads_board = self._monitor or standing_in or self.config.progress_timeout_s is not None
        board = self.board.read_beats() if self.board is not None and reads_board else {}
        machines = self._machines(watch, remote)
        full_view = not machines or self._monitor  # sees every member's step (for the hang check)
        machine_beats: dict[str, bytes] = {}
        if self._monitor or standing_in:
            # Also on one machine: it is the store host's sign of life from this machine, and the store
            # operation whose failures tell that the store is lost.
            self._write_machine_beat({**board, self.rank: own_beat}, sorted(local | {self.rank}))
        if machines and self._monitor:
            machine_beats = self._read_machine_beats(machines)
        if self._monitor:
            # After the store operations: when the store fails, the stamp ages and every local process
            # stands in (and meets the store's errors itself, which is how each one learns it is lost).
            self.board.stamp()  # type: ignore[union-attr]
        now = time.monotonic()
        # A gap in this process's view (its thread or its whole machine not scheduled, the store slow
        # or unreachable: the beats read now may be as old as the gap) is no evidence against a peer.
        late = now - self._last_read > self.config.timeout_s / 2
        self._last_read = now
        new: list[Failure] = []
        for rank in unplaced:
            new.extend(self._judge_unplaced(watch, rank, peers[rank], values.get(rank), now, late))
        for rank in local:
            new.extend(self._judge_local(rank, peers[rank], board.get(rank), statuses[rank], now, late))
        if self._monitor:
            for machine in machines.values():
                new.extend(self._judge_machine(watch, machine, remote, peers, machine_beats.get(machine.key), now, late))
        if not late and full_view:
            new.extend(self._hung(watch, peers, {f.rank for f in new}, now))
        if new:
            self._report(watch, new)

    def _place(self, peers: Mapping[int, _Peer]) -> tuple[set[int], dict[int, str], list[int]]:
        """Splits the peers into those on this machine, those elsewhere (rank -> machine key) and
        unplaced ones (no identity registered yet, or two levels off)."""
        if self.board is None:
            return set(), {}, list(peers)
        with self._lock:
            known = dict(self._identities)
        missing = [r for r in peers if r not in known]
        if missing:
            present = [r for r in missing if self.store.check([proc_key(r)])]
            if present:
                read = {r: ProcessIdentity.from_json(v)
                        for r, v in zip(present, self.store.multi_get([proc_key(r) for r in present]))}
                self.know(read)
                known.update(read)
        own = self.identity.namespace
        local = {r for r in peers if r in known and known[r].namespace == own}
        remote = {r: known[r].machine_key for r in peers if r in known and known[r].namespace != own}
        return local, remote, [r for r in peers if r not in known]

    def _machines(self, watch: _Watch, remote: Mapping[int, str]) -> dict[str, _Machine]:
        """The other machines of the watched peers, with their clocks (kept for the watch's length)."""
        now = time.monotonic()
        for rank, key in remote.items():
            if key not in watch.machines:
                name = self._identities[rank].machine or key
                watch.machines[key] = _Machine(key, name, changed=now)
        return {k: m for k, m in watch.machines.items() if k in set(remote.values())}

    def _write_machine_beat(self, board: Mapping[int, bytes], ranks: Iterable[int]) -> None:
        """This machine's beat: the local beats of its processes (those with one on the board)."""
        self._machine_counter += 1
        # The ranks' steps only matter to the hang check; without it a rank is vouched for by name alone.
        with_steps = self.config.progress_timeout_s is not None
        vouched = {r: board[r] if with_steps or board[r] == GOODBYE else b"" for r in ranks if r in board}
        self.store.set(machine_beat_key(self.identity.machine_key),
                       encode_machine_beat(self.rank, self._machine_counter, vouched))

    def _read_machine_beats(self, machines: Mapping[str, _Machine]) -> dict[str, bytes]:
        keys = [k for k, m in machines.items() if m.beat is not None or self.store.check([machine_beat_key(k)])]
        if not keys:
            return {}
        return dict(zip(keys, self.store.multi_get([machine_beat_key(k) for k in keys])))

    @staticmethod
    def _observe(peer: _Peer, beat: bytes | None, now: float, late: bool) -> None:
        """Takes a peer's beat as read now; a late poll refreshes its clocks instead of judging them."""
        if beat != peer.beat or late:
            if beat != peer.beat and beat is not None:
                FailureDetector._parse(peer, beat, now)
            peer.beat, peer.changed = beat, now
            if late:
                peer.step_changed = now

    def _judge_unplaced(self, watch: _Watch, rank: int, peer: _Peer, beat: bytes | None, now: float,
                        late: bool) -> list[Failure]:
        """A peer seen only through its own beat in the store."""
        if beat == GOODBYE:
            with self._lock:
                self._left.add(rank)
            return []
        self._observe(peer, beat, now, late)
        if (peer.beat is not None or watch.judge_unseen) and now - peer.changed > self.config.timeout_s:
            return [Failure(rank, SILENT, self.rank, now)]
        return []

    def _judge_local(self, rank: int, peer: _Peer, beat: bytes | None, status: str, now: float,
                     late: bool) -> list[Failure]:
        """A peer on this machine: exited when its process is gone, silent when stopped for ``timeout_s``;
        a live, running process is never silent (its beat only feeds the hang check)."""
        if beat == GOODBYE:
            with self._lock:
                self._left.add(rank)
            return []
        self._observe(peer, beat, now, late)
        if status == GONE:
            # It may have said goodbye after this poll's read of the board.
            if self.board is not None and self.board.read_beat(rank) == GOODBYE or self._said_goodbye(rank):
                with self._lock:
                    self._left.add(rank)
                return []
            return [Failure(rank, EXITED, self.rank, now)]
        if status != STOPPED or late or peer.stopped_since is None:
            peer.stopped_since = now if status == STOPPED else None
            return []
        # Seen stopped at two polls in a row (not a tracer's brief stop): it has been stopped since its
        # last beat at least, which is when its silence began (as for any peer: as fast as a beat's).
        since_beat = self.board.beat_age(rank) if self.board is not None else 0.0
        if max(now - peer.stopped_since, since_beat) > self.config.timeout_s:
            return [Failure(rank, SILENT, self.rank, now)]
        return []

    def _judge_machine(self, watch: _Watch, machine: _Machine, remote: Mapping[int, str],
                       peers: Mapping[int, _Peer], beat: bytes | None, now: float, late: bool) -> list[Failure]:
        """Another machine, through its beat: its ranks' steps, and its loss when the beat stops."""
        if beat != machine.beat or late:
            machine.beat, machine.changed = beat, now
        ranks = sorted(r for r, key in remote.items() if key == machine.key)
        decoded = decode_machine_beat(beat) if beat is not None else None
        if decoded is not None:
            for rank in ranks:
                entry = decoded.ranks.get(rank)
                if entry == GOODBYE:
                    with self._lock:
                        self._left.add(rank)
                elif entry:
                    self._observe(peers[rank], entry, now, late)
        if not (machine.beat is not None or watch.judge_unseen) or now - machine.changed <= self.config.timeout_s:
            return []
        lost = [r for r in ranks if r not in self.left and not self._said_goodbye(r)]
        if lost:
            log.warning("rank %d: machine %s is silent; its ranks %s are lost", self.rank, machine.name, lost)
        return [Failure(r, SILENT, self.rank, now, machine=machine.name) for r in lost]

    def _check_marker(self, watch: _Watch, *, from_store: bool = True) -> None:
        """Looks for the current generation's abort marker: in the store (and relays it to the board), or
        on the board, where this machine's monitor relays it."""
        if watch.marker_seen or self.on_abort_marker is None:
            return
        key = abort_key(watch.generation)
        payload = None
        if not from_store and self.board is not None:
            payload = self.board.marker(watch.generation)
        elif self.store.check([key]):
            payload = self.store.get(key)
            if self.board is not None:
                self.board.relay_marker(watch.generation, payload)
        if payload is not None:
            watch.marker_seen = True
            self.on_abort_marker(watch.generation, json.loads(payload))

    def _read_beats(self, peers: Mapping[int, _Peer]) -> dict[int, bytes]:
        # multi_get waits for missing keys; only ask for beats known to exist.
        present = [r for r, p in peers.items() if p.beat is not None or self.store.check([beat_key(r)])]
        if not present:
            return {}
        return dict(zip(present, self.store.multi_get([beat_key(r) for r in present])))

    @staticmethod
    def _parse(peer: _Peer, beat: bytes, now: float) -> None:
        try:
            _, step, waiting, _ = beat.decode().split(":")
        except ValueError:
            return
        if int(step) != peer.step:
            peer.step, peer.step_changed = int(step), now
        peer.waiting = waiting == "1"

    def _said_goodbye(self, rank: int) -> bool:
        key = beat_key(rank)  # get() would wait for a key never written
        if not self.store.check([key]) or self.store.get(key) != GOODBYE:
            return False
        with self._lock:
            self._left.add(rank)
        return True

    def _exits(self, ranks: Iterable[int]) -> list[Failure]:
        """Failures of the peers among ``ranks`` on this machine whose processes are gone (known identities only)."""
        if not self.config.probe_local_pids:
            return []
        with self._lock:
            known = dict(self._identities)
            left = set(self._left)
        now = time.monotonic()
        return [
            Failure(rank, EXITED, self.rank, now)
            for rank in ranks
            if rank not in left
            and (identity := known.get(rank)) is not None and identity.comparable() and not identity.alive()
        ]

    def _hung(self, watch: _Watch, peers: Mapping[int, _Peer], dead: set[int], now: float) -> list[Failure]:
        timeout = self.config.progress_timeout_s
        with self._lock:
            if timeout is None or self._hold:
                return []
        me = _Peer(step=self._step, waiting=main_thread_waiting(
            self._main_id, self.config.comm_frames, self.config.comm_frame_depth
        ))
        live = {r: p for r, p in peers.items() if r not in dead}
        everyone = {**live, self.rank: me}
        verdicts = []
        for rank, peer in live.items():
            if peer.waiting or now - peer.step_changed <= timeout:
                continue
            others = [p for r, p in everyone.items() if r != rank]
            if any(p.waiting or p.step > peer.step for p in others):
                verdicts.append(Failure(rank, HUNG, self.rank, now))
        return verdicts

    def _report(self, watch: _Watch, failures: list[Failure]) -> None:
        self._notify(watch, self._record(failures))

    def _record(self, failures: Iterable[Failure]) -> list[Failure]:
        """Adds the verdicts not known yet (never this process's own); returns them."""
        new = []
        with self._lock:
            for failure in failures:
                if failure.rank != self.rank and failure.rank not in self._failed:
                    self._failed[failure.rank] = failure
                    new.append(failure)
        return new

    def _notify(self, watch: _Watch, new: list[Failure]) -> None:
        """Hands this thread's new verdicts to ``on_failures`` (first: it aborts), then to the listeners."""
        if not new:
            return
        log.warning(
            "rank %d: generation %d lost %s",
            self.rank, watch.generation, ", ".join(f"rank {f.rank} ({f.reason})" for f in new),
        )
        if self.on_failures is not None:
            try:
                self.on_failures(new)
            except Exception:  # noqa: BLE001 - the thread must keep beating
                log.exception("on_failures hook failed")
        self._tell_listeners(new)

    def _tell_listeners(self, new: list[Failure]) -> None:
        if not new:
            return
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(new)
            except Exception:  # noqa: BLE001 - a reporter must not stop detection
                log.exception("failure listener failed")
