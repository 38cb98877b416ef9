"""Fail-stop detection: a background heartbeat per rank over a TCP key-value store.

Every rank runs a daemon thread that, every ``interval_s``, writes ``resihp/hb/<rank>`` =
``"<counter>:<step>"`` to a :class:`torch.distributed.TCPStore`. A monitoring rank (rank 0 by
default, or every rank) reads the peers' keys on the same beat and notes, *on its own monotonic
clock*, when each value last changed (so clock skew between hosts does not matter). A peer whose
value has not changed for ``timeout_s`` is reported dead; a report therefore arrives within
``timeout_s + interval_s`` of the death. With ``progress_timeout_s`` set, a peer whose *step* has not
advanced for that long is reported too (its process is alive but its training loop is stuck).

The store: by default rank 0 opens a new ``TCPStore`` on ``MASTER_ADDR`` (port: ``port``, or a free
port that rank 0 broadcasts over the default process group, or ``MASTER_PORT + 1`` without one) and
the others connect to it; any ``torch.distributed.Store`` can be passed instead. When the store's
host dies, every other rank's writes fail; after ``timeout_s`` of failures the host rank is
reported dead (unless it had said goodbye: :meth:`Heartbeat.stop` writes ``"done"``).

A report is recorded in :attr:`Heartbeat.dead`, logged as ``fail_stop_detected`` in the event log
(written even when the reporter is not rank 0, since rank 0 may be the dead one) and passed to the
``on_dead`` hook. Then ``on_failure`` decides what happens to this process:

* ``"none"``: nothing; the application decides (the hook may set ``trainer.should_stop``);
* ``"exit"``: ``os._exit(exit_code)`` after the report, so the launcher (torchrun, SLURM) sees the
  job fail at once and can restart it from the last checkpoint under a plan without the device;
* ``"interrupt"``: raise ``KeyboardInterrupt`` in the main thread. A main thread blocked inside a
  C++ collective only sees it when the collective returns, so pair it with a process-group timeout.

Why the job cannot hang forever: a collective with a dead peer returns an error when the transport
notices the closed connection (gloo usually does at once) and otherwise when the process group's
timeout expires; pass ``timeout=datetime.timedelta(seconds=...)`` to ``init_process_group`` (or the
strategy's ``timeout``) to bound it, and use ``on_failure="exit"`` to end the process as soon as the
heartbeat has reported, without waiting for the collective at all.
"""

from __future__ import annotations

import _thread
import datetime
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from resihp_lightning._logging import get_logger
from resihp_lightning.callbacks.events import EventLog
from resihp_lightning.errors import invalid_option

log = get_logger(__name__)

MONITORS = ("rank0", "all")
ON_FAILURE = ("none", "exit", "interrupt")
KEY_PREFIX = "resihp/hb/"


@dataclass(frozen=True, kw_only=True)
class HeartbeatConfig:
    """Options of the heartbeat.

    Attributes:
        interval_s: seconds between beats (> 0).
        timeout_s: a peer silent for this long is dead (> interval_s).
        progress_timeout_s: a peer whose step has not advanced for this long is reported hung;
            ``None`` turns the check off (long evaluations and checkpoints would trip it).
        monitor: ``"rank0"`` (only rank 0 checks peers; every rank still notices the loss of the
            store's host) or ``"all"``.
        on_failure: ``"none"``, ``"exit"`` or ``"interrupt"`` (see the module docstring).
        exit_code: the status of ``os._exit`` when ``on_failure="exit"``.
        host: the store's host; default ``$MASTER_ADDR`` or 127.0.0.1.
        port: the store's port; default: a free port chosen by rank 0 and broadcast over the default
            process group, or ``$MASTER_PORT + 1`` when there is none.
        store_timeout_s: timeout of store operations (connect, get).
    """

    interval_s: float = 1.0
    timeout_s: float = 10.0
    progress_timeout_s: float | None = None
    monitor: str = "rank0"
    on_failure: str = "none"
    exit_code: int = 1
    host: str | None = None
    port: int | None = None
    store_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("interval_s", "timeout_s", "store_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise invalid_option(f"heartbeat.{name}", value, "seconds > 0")
        if self.timeout_s <= self.interval_s:
            raise invalid_option("heartbeat.timeout_s", self.timeout_s, f"more than interval_s ({self.interval_s})")
        if self.progress_timeout_s is not None and not (
            isinstance(self.progress_timeout_s, (int, float)) and self.progress_timeout_s > self.interval_s
        ):
            raise invalid_option("heartbeat.progress_timeout_s", self.progress_timeout_s, "null or seconds > interval_s")
        if self.monitor not in MONITORS:
            raise invalid_option("heartbeat.monitor", self.monitor, MONITORS)
        if self.on_failure not in ON_FAILURE:
            raise invalid_option("heartbeat.on_failure", self.on_failure, ON_FAILURE)
        if self.port is not None and (not isinstance(self.port, int) or not 0 < self.port < 65536):
            raise invalid_option("heartbeat.port", self.port, "null or a TCP port 1-65535")


@dataclass
class _Peer:
    value: str | None = None
    changed: float = 0.0
    step: str | None = None
    step_changed: float = 0.0


class Heartbeat:
    """One rank's heartbeat thread (writer, and monitor where configured).

    Args:
        config: heartbeat options.
        rank: this rank (default ``$RANK``).
        world_size: ranks in the job (default ``$WORLD_SIZE``).
        store: a ``torch.distributed.Store`` to use instead of opening a TCPStore.
        events: where ``fail_stop_detected`` is logged.
        on_dead: called with the newly dead ranks (from the heartbeat thread).
        store_host_rank: the rank whose death takes the store down (0 for the default store).
    """

    def __init__(
        self,
        config: HeartbeatConfig | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        store: Any = None,
        events: EventLog | None = None,
        on_dead: Callable[[list[int]], None] | None = None,
        store_host_rank: int = 0,
    ) -> None:
        self.config = config or HeartbeatConfig()
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        self.store = store
        self._own_store = store is None
        self.events = events
        self.on_dead = on_dead
        self.store_host_rank = store_host_rank
        self.step = 0
        self.dead: dict[int, float] = {}  # rank -> time.time() of the report
        self.reports: list[dict[str, Any]] = []
        self._server: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peers: dict[int, _Peer] = {}
        self._counter = 0
        self._host_done = False
        self._failing_since: float | None = None
        self._lock = threading.Lock()

    @property
    def monitoring(self) -> bool:
        return self.config.monitor == "all" or self.rank == 0

    # --------------------------------------------------------------------------- lifecycle
    def start(self) -> Heartbeat:
        """Opens the store when needed, writes the first beat and starts the thread."""
        if self._thread is not None:
            return self
        if self.store is None:
            self.store = self._open_store()
        self._beat()
        now = time.monotonic()
        self._peers = {r: _Peer(changed=now, step_changed=now) for r in range(self.world_size) if r != self.rank}
        self._thread = threading.Thread(target=self._run, name=f"resihp-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Says goodbye (peers will not report this rank) and stops the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.interval_s * 4 + 1)
            self._thread = None
        try:
            if self.store is not None:
                self.store.set(KEY_PREFIX + str(self.rank), "done")
        except Exception:  # noqa: BLE001 - the store may be gone already at shutdown
            pass

    def progress(self, step: int) -> None:
        """Tells peers that this rank's training loop reached ``step`` (call once per step)."""
        self.step = step

    # ------------------------------------------------------------------------------ thread
    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self._beat()
                self._failing_since = None
                if self.monitoring:
                    self._check_peers()
                elif self.rank != self.store_host_rank:
                    self._check_host_said_goodbye()
            except Exception as err:  # noqa: BLE001 - a dead store host shows up as any network error
                if self._host_done or self._stop.is_set():
                    return
                now = time.monotonic()
                self._failing_since = self._failing_since or now
                log.debug("heartbeat store error on rank %d: %s", self.rank, err)
                if now - self._failing_since > self.config.timeout_s and self.rank != self.store_host_rank:
                    self._report([self.store_host_rank], "store unreachable")
                    return

    def _beat(self) -> None:
        self._counter += 1
        self.store.set(KEY_PREFIX + str(self.rank), f"{self._counter}:{self.step}")

    def _check_host_said_goodbye(self) -> None:
        key = KEY_PREFIX + str(self.store_host_rank)
        if self.store.check([key]) and self.store.get(key) == b"done":
            self._host_done = True

    def _check_peers(self) -> None:
        now = time.monotonic()
        newly_dead, hung = [], []
        for rank, peer in self._peers.items():
            if rank in self.dead:
                continue
            key = KEY_PREFIX + str(rank)
            value = self.store.get(key).decode() if self.store.check([key]) else None
            if value == "done":
                if rank == self.store_host_rank:
                    self._host_done = True
                peer.changed = peer.step_changed = now
                continue
            if value != peer.value:
                peer.value, peer.changed = value, now
                step = value.split(":", 1)[1] if value else None
                if step != peer.step:
                    peer.step, peer.step_changed = step, now
            if now - peer.changed > self.config.timeout_s:
                newly_dead.append(rank)
            elif self.config.progress_timeout_s is not None and now - peer.step_changed > self.config.progress_timeout_s:
                hung.append(rank)
        if newly_dead:
            self._report(newly_dead, "heartbeat timeout")
        if hung:
            self._report(hung, "no training progress")

    def _report(self, ranks: Sequence[int], reason: str) -> None:
        with self._lock:
            ranks = [r for r in ranks if r not in self.dead]
            if not ranks:
                return
            stamp = time.time()
            for rank in ranks:
                self.dead[rank] = stamp
                record = {"rank": rank, "reason": reason, "reporter": self.rank, "time": stamp}
                self.reports.append(record)
                if self.events is not None:
                    self.events.log("fail_stop_detected", self.step, force=True, rank=rank, reason=reason, reporter=self.rank)
        log.warning("rank %d reports rank(s) %s dead (%s)", self.rank, ranks, reason)
        if self.on_dead is not None:
            try:
                self.on_dead(list(ranks))
            except Exception:  # noqa: BLE001 - a failing hook must not silence the action below
                log.exception("heartbeat on_dead hook failed")
        if self.config.on_failure == "exit":
            os._exit(self.config.exit_code)
        elif self.config.on_failure == "interrupt":
            _thread.interrupt_main()

    # ------------------------------------------------------------------------------- store
    def _open_store(self) -> Any:
        import torch.distributed as dist

        cfg = self.config
        host = cfg.host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        timeout = datetime.timedelta(seconds=cfg.store_timeout_s)
        port = cfg.port
        if port is None and dist.is_available() and dist.is_initialized():
            if self.rank == 0:
                self._server = dist.TCPStore(host, 0, None, True, timeout, wait_for_workers=False)
                chosen = [self._server.port]
            else:
                chosen = [None]
            dist.broadcast_object_list(chosen, src=0)
            port = int(chosen[0])
        elif port is None:
            port = int(os.environ.get("MASTER_PORT", "29500")) + 1
        if self.rank == 0 and self._server is None:
            self._server = dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False)
        if self.rank == 0:
            return self._server
        return dist.TCPStore(host, port, None, False, timeout)
