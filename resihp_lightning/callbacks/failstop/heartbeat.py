"""Fail-stop reporting: what the job's :class:`~resihp_lightning.resilience.failure_detector.FailureDetector` finds.

:class:`Heartbeat` detects nothing itself. It reports the failures a detector finds, and it
either runs a detector of its own or uses one that is already running:

* **its own** (a job without ``fail_stop``): a detector over a ``torch.distributed`` store, keys
  under ``resihp/`` (process identities ``resihp/proc/<rank>``, one beat per machine
  ``resihp/mb/<machine>``; a process's own beat stays on its machine's board). By
  default rank 0 opens a new ``TCPStore`` on ``MASTER_ADDR`` (port: ``port``, or a free port that
  rank 0 broadcasts over the default process group, or ``MASTER_PORT + 1`` without one) and the
  others connect to it; any ``torch.distributed.Store`` can be passed instead. Monitoring ranks watch
  every peer; the others watch only the store's host (``store_host_rank``). When the store's host
  dies, the store goes with it: after ``timeout_s`` of store errors the host is reported
  (``"store unreachable"``) unless it had said goodbye (:meth:`Heartbeat.stop`);
* **a running one** (``detector=``; the strategy's with ``fail_stop`` on): the failures it learns of
  are reported and nothing else happens here; the strategy recovers.

How a failure is found (a process gone on this machine at once, a silent beat after ``timeout_s``,
a hung step with ``progress_timeout_s``) is the detector's: see
:mod:`resihp_lightning.resilience.failure_detector`.

A report is recorded in :attr:`Heartbeat.dead` and :attr:`Heartbeat.reports`, logged as
``fail_stop_detected`` in the event log (written even when the reporter is not rank 0, since rank 0
may be the dead one) and passed to the ``on_dead`` hook. A whole machine found lost (its machine
heartbeat stopped: the detector's second level) is, besides, one ``machine_lost`` event naming the
machine and its ranks. With its own detector, ``on_failure`` then
decides what happens to this process:

* ``"none"``: nothing; the application decides (the hook may set ``trainer.should_stop``);
* ``"exit"``: ``os._exit(exit_code)`` after the report, so the launcher (torchrun, SLURM) sees the
  job fail at once and can restart it from the last checkpoint under a plan without the device;
* ``"interrupt"``: raise ``KeyboardInterrupt`` in the main thread. A main thread blocked inside a
  C++ collective only sees it when the collective returns, so pair it with a process-group timeout.

Why the job cannot hang forever: a collective with a dead peer returns an error when the transport
notices the closed connection (gloo usually does at once) and otherwise when the process group's
timeout expires; pass ``timeout=datetime.timedelta(seconds=...)`` to ``init_process_group`` (or the
strategy's ``timeout``) to bound it, and use ``on_failure="exit"`` to end the process as soon as a
failure is reported, without waiting for the collective at all.
"""

from __future__ import annotations

import _thread
import datetime
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from resihp_lightning._logging import get_logger
from resihp_lightning.callbacks.events import EventLog
from resihp_lightning.errors import invalid_option
from resihp_lightning.resilience.failure_detector import (
    EXITED,
    HUNG,
    SILENT,
    Failure,
    FailureDetector,
    FailureDetectorConfig,
)
from resihp_lightning.resilience.procs import ProcessIdentity
from resihp_lightning.resilience.store import proc_key

log = get_logger(__name__)

MONITORS = ("rank0", "all")
ON_FAILURE = ("none", "exit", "interrupt")
#: The prefix of this callback's keys in the store (machine beats are ``resihp/mb/<machine>``).
KEY_NAMESPACE = "resihp"
#: The reason of a store host reported because its store stopped answering.
STORE_UNREACHABLE = "store unreachable"
#: ``reason`` of the ``fail_stop_detected`` events, by the detector's verdict (others are passed on).
REASONS = {SILENT: "heartbeat timeout", HUNG: "no training progress", EXITED: "process exited"}


@dataclass(frozen=True, kw_only=True)
class HeartbeatConfig:
    """Options of the heartbeat.

    Attributes:
        interval_s: seconds between beats (> 0).
        timeout_s: a peer silent for this long is dead (>= 2 x interval_s); also how long the store
            may fail before its host is reported.
        progress_timeout_s: a peer whose step has not advanced for this long, outside communication,
            while a peer waits for it or is ahead, is reported hung (>= 2 x interval_s); ``None``
            turns the check off.
        monitor: ``"rank0"`` (only rank 0 reports its peers; every rank still reports the loss of
            the store's host) or ``"all"``.
        on_failure: ``"none"``, ``"exit"`` or ``"interrupt"`` (see the module docstring; only with
            the heartbeat's own detector).
        exit_code: the status of ``os._exit`` when ``on_failure="exit"``.
        host: the store's host; default ``$MASTER_ADDR`` or 127.0.0.1.
        port: the store's port; default: a free port chosen by rank 0 and broadcast over the default
            process group, or ``$MASTER_PORT + 1`` when there is none.
        store_timeout_s: timeout of store operations (connect, get).

    The detection options (``interval_s``, ``timeout_s``, ``progress_timeout_s``) are those of
    :class:`~resihp_lightning.resilience.failure_detector.FailureDetectorConfig` (:meth:`detector_config`).
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
        if self.timeout_s < 2 * self.interval_s:
            raise invalid_option("heartbeat.timeout_s", self.timeout_s, f">= 2 x interval_s ({2 * self.interval_s:g})")
        if self.progress_timeout_s is not None and not (
            isinstance(self.progress_timeout_s, (int, float)) and self.progress_timeout_s >= 2 * self.interval_s
        ):
            raise invalid_option(
                "heartbeat.progress_timeout_s", self.progress_timeout_s, "null or seconds >= 2 x interval_s"
            )
        if self.monitor not in MONITORS:
            raise invalid_option("heartbeat.monitor", self.monitor, MONITORS)
        if self.on_failure not in ON_FAILURE:
            raise invalid_option("heartbeat.on_failure", self.on_failure, ON_FAILURE)
        if self.port is not None and (not isinstance(self.port, int) or not 0 < self.port < 65536):
            raise invalid_option("heartbeat.port", self.port, "null or a TCP port 1-65535")

    def detector_config(self) -> FailureDetectorConfig:
        """The options of the heartbeat's own detector."""
        return FailureDetectorConfig(
            interval_s=self.interval_s,
            timeout_s=self.timeout_s,
            progress_timeout_s=self.progress_timeout_s,
            store_grace_s=self.timeout_s,
        )


class Heartbeat:
    """Reports the failures a :class:`~resihp_lightning.resilience.failure_detector.FailureDetector` finds.

    Args:
        config: heartbeat options.
        rank: this rank (default ``$RANK``; the detector's with ``detector``).
        world_size: ranks in the job (default ``$WORLD_SIZE``).
        store: a ``torch.distributed.Store`` for the own detector instead of opening a TCPStore.
        events: where ``fail_stop_detected`` is logged.
        on_dead: called with the newly dead ranks (from the detector's thread, or the thread that
            declared the failure to it).
        store_host_rank: the rank whose death takes the store down (0 for the default store); it is
            reported by every rank, also with ``monitor="rank0"``.
        detector: a running detector to report on (it is neither started nor stopped here, and
            ``on_failure`` does not apply); ``None`` starts an own one.
        identity: this process as an own detector's peers know it (default: the current process; tests
            that run several ranks in one process give each a machine of its own,
            :meth:`~resihp_lightning.resilience.procs.ProcessIdentity.simulated`).
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
        detector: FailureDetector | None = None,
        identity: ProcessIdentity | None = None,
    ) -> None:
        self.config = config or HeartbeatConfig()
        self.identity = identity
        if detector is not None:
            self.rank = detector.rank
        else:
            self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        self.store = store
        self.events = events
        self.on_dead = on_dead
        self.store_host_rank = store_host_rank
        self.detector = detector
        self.owns_detector = detector is None
        self.step = 0
        #: Reported ranks: rank -> ``time.time()`` of the report.
        self.dead: dict[int, float] = {}
        #: Every report in order: ``rank``, ``reason``, ``how`` and ``reporter``; after the ranks of a lost
        #: machine, ``machine`` and its ``ranks``.
        self.reports: list[dict[str, Any]] = []
        self._server: Any = None
        self._started = False
        self._lock = threading.Lock()

    @property
    def monitoring(self) -> bool:
        """Whether this rank reports the failures of all its peers (else only the store host's)."""
        return self.config.monitor == "all" or self.rank == 0

    # --------------------------------------------------------------------------- lifecycle
    def start(self) -> Heartbeat:
        """Starts reporting; with an own detector, opens the store when needed and starts the detector."""
        if self._started:
            return self
        if self.owns_detector:
            self.detector = self._start_own_detector()
        assert self.detector is not None
        self.detector.subscribe(self._report)
        self._started = True
        return self

    def stop(self) -> None:
        """Stops reporting; an own detector says goodbye (peers will not report this rank) and stops."""
        if not self._started or self.detector is None:
            return
        self.detector.unsubscribe(self._report)
        if self.owns_detector:
            self.detector.stop(goodbye=True)
        self._started = False

    def progress(self, step: int) -> None:
        """Records that this rank's training loop reached ``step`` (call once per step); an own detector
        tells its peers (the owner of a running one tells it)."""
        self.step = step
        if self.owns_detector and self.detector is not None:
            self.detector.progress(step)

    # ----------------------------------------------------------------------------- reports
    def _report(self, failures: list[Failure]) -> None:
        """The detector's listener: records, logs and acts on the failures this rank reports."""
        mine = [f for f in failures if self.monitoring or f.rank == self.store_host_rank]
        if not mine:
            return
        with self._lock:
            stamp = time.time()
            for failure in mine:
                reason = REASONS.get(failure.reason, failure.reason)
                self.dead[failure.rank] = stamp
                self.reports.append({"rank": failure.rank, "reason": reason, "how": failure.reason,
                                     "reporter": failure.reporter, "time": stamp})
                if self.events is not None:
                    self.events.log("fail_stop_detected", self.step, force=True, rank=failure.rank, how=failure.reason,
                                    reason=reason, reporter=failure.reporter)
            lost_machines: dict[str, list[int]] = {}
            for failure in mine:
                if failure.machine is not None:
                    lost_machines.setdefault(failure.machine, []).append(failure.rank)
            for machine, machine_ranks in lost_machines.items():
                self.reports.append({"machine": machine, "ranks": machine_ranks, "time": stamp})
                if self.events is not None:
                    self.events.log("machine_lost", self.step, force=True, machine=machine, ranks=machine_ranks,
                                    reporter=mine[0].reporter)
        ranks = [f.rank for f in mine]
        log.warning("rank %d reports rank(s) %s dead (%s)", self.rank, ranks, ", ".join(f.reason for f in mine))
        if self.on_dead is not None:
            try:
                self.on_dead(ranks)
            except Exception:  # noqa: BLE001 - a failing hook must not silence the action below
                log.exception("heartbeat on_dead hook failed")
        if not self.owns_detector:
            return
        if self.config.on_failure == "exit":
            os._exit(self.config.exit_code)
        elif self.config.on_failure == "interrupt":
            _thread.interrupt_main()

    def _store_lost(self) -> None:
        """The own detector lost the store: its host is gone, unless it finished (said goodbye).

        Either way the detector stops (from its own thread): without the store, peers that finish
        later cannot say goodbye, and their exits would be reported as failures.
        """
        detector = self.detector
        assert detector is not None
        if self.rank == self.store_host_rank or self.store_host_rank in detector.left:
            log.debug("rank %d: the heartbeat store is gone after its host finished", self.rank)
        else:
            detector.declare([Failure(self.store_host_rank, STORE_UNREACHABLE, self.rank, time.monotonic())])
        detector.stop()

    # --------------------------------------------------------------------------- own detector
    def _start_own_detector(self) -> FailureDetector:
        import torch.distributed as dist

        if self.store is None:
            self.store = self._open_store()
        scoped = dist.PrefixStore(KEY_NAMESPACE, self.store)
        # Peers on this machine see this process's exit at once instead of after timeout_s of silence.
        identity = self.identity or ProcessIdentity.current()
        scoped.set(proc_key(self.rank), identity.to_json())
        detector = FailureDetector(
            self.config.detector_config(),
            rank=self.rank,
            connect=lambda: scoped,
            on_store_lost=self._store_lost,
            identity=identity,
        )
        detector.start()
        if self.monitoring:
            watched = list(range(self.world_size))
        else:
            watched = [self.store_host_rank]
        detector.watch(watched, 0)
        return detector

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
