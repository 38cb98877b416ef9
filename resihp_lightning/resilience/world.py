"""A job's process groups as a sequence of generations that survive the loss of members.

:class:`ElasticWorld` owns the whole lifecycle of the default process group, one generation at a
time (the model is torchft's Manager + reconfigurable ProcessGroup, reduced to one job on gloo):

* **generation 0** is every rank: ``init_process_group(backend, store=PrefixStore(".../gen0/pg",
  store), rank, world_size)`` over the store host (:mod:`.store`), never over a store inside a
  worker;
* **failure** is reported by the detector (:mod:`.failure_detector`) from its thread, or seen by the main
  thread as a broken collective inside :meth:`ElasticWorld.guard`;
* **abort** (:meth:`ElasticWorld.abort`, any thread, idempotent) shuts down the generation's TCP
  connections (:mod:`.sockets`), so that a collective the main thread is blocked in raises at once,
  releases the waits that gloo does not end when a connection fails (:mod:`.abortable_waits`: a send
  queued for writing), and publishes ``gen<g>/abort`` so that the other processes abort within one
  detector poll even before they have named the dead peer themselves. :meth:`ElasticWorld.guard` turns what the
  blocked call raises into :class:`~.failures.PeerFailure`;
* **regroup** (:meth:`ElasticWorld.regroup`, main thread): the survivors agree on the members of
  generation g+1 (:mod:`.membership`), destroy the old groups, reset DeepSpeed's cached groups
  (:mod:`.frameworks`), and initialise the new default group under a fresh key prefix (over keys
  used before, a member could read a peer's stale address from the last generation before the peer
  overwrote it; two clean re-inits over reused keys did work here, but nothing guards that race).
  If a member fails while the new generation forms, that generation is aborted like any other and
  the survivors go on to the next one, all inside one ``regroup()`` call, bounded by
  ``regroup_timeout_s``.

**The end.** :meth:`ElasticWorld.close` with ``goodbye`` (a process that finished its work) says goodbye
before it destroys its groups: its peers count it :attr:`ElasticWorld.finished`, not failed; nobody aborts or
waits for it in a regroup, and a guarded collective that needed it raises :class:`~.failures.PeerFinished`.

Each process keeps its *original* rank (``RANK`` at start) as its identity for the job's lifetime
(it names its device and its heartbeat); its rank in the current generation is its index in the
sorted member list (:meth:`ElasticWorld.rank_of`, :meth:`ElasticWorld.original_of`).

**Newcomers.** A process started after the job began opens its world with :meth:`ElasticWorld.join`
instead of :meth:`ElasticWorld.start`: it claims an original rank above every rank the job has had
(:mod:`.joining`), starts beating, and belongs to no generation until the members admit it. At a step
boundary every process of the job records the newcomers in the job (:meth:`ElasticWorld.admit`) and
each newcomer enters the current generation as a spare (:meth:`ElasticWorld.enter`); from then on it is
a spare like any other, which a later reshape or regroup takes in. Admitting changes no process group.

**Spares.** A generation need not contain every live process of the job: :meth:`ElasticWorld.reshape`
forms the next generation over a chosen subset (planned, no failure), and the live processes left out
stay in the job as *spares* (:attr:`ElasticWorld.spares`). A spare has no process group; it keeps
beating, watches the current generation's abort marker (so it learns of failures), takes part in
every regroup (the candidates are all live processes of the job, :attr:`ElasticWorld.job_members`),
and follows every reshape (:meth:`ElasticWorld.reshape` on a process outside the new members only
records the generation). The death of a spare aborts nothing: it just leaves the job.

Groups created later in a generation (``dist.new_group`` by a DeepSpeed engine, the layer-wise
reducer, ...) must be tracked so that an abort cuts their connections too. With
``track_new_groups`` (default), torch's ``_new_process_group_helper`` (the one function every group
creation goes through) is wrapped for as long as the world is open; :meth:`ElasticWorld.track` does
the same explicitly for code that creates groups some other way. ``TORCH_GLOO_LAZY_INIT`` (gloo
connecting on first use, outside any window) is not supported.

Each generation rendezvouses over a store connection of its own, tracked with the generation, so
that an abort also releases the main thread when it is blocked inside ``init_process_group``
waiting for a peer that died after joining.

NCCL: an abort also calls ``abort()`` on the generation's NCCL backends (``ncclCommAbort``), which is
the documented way to release a blocked NCCL collective; this path has not been exercised here (no
multi-GPU machine) and the socket shutdown does not apply to NCCL's own transport.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from resihp_lightning._logging import get_logger
from resihp_lightning.errors import invalid_option
from resihp_lightning.resilience.abortable_waits import AbortableWaits, AbortedWait
from resihp_lightning.resilience.failure_detector import FailureDetectorConfig, Failure, FailureDetector, abort_key
from resihp_lightning.resilience.failures import (
    EvictedError,
    PeerFailure,
    PeerFinished,
    RegroupError,
    ResilienceError,
    StoreUnavailable,
)
from resihp_lightning.resilience.frameworks import reset_deepspeed
from resihp_lightning.resilience.joining import claim_rank, publish_start_size
from resihp_lightning.resilience.membership import agree_members, read_failures
from resihp_lightning.resilience.sockets import SocketTracker
from resihp_lightning.resilience.stall_dump import StallDump
from resihp_lightning.resilience.store import RendezvousStore, StoreConfig, proc_key

log = get_logger(__name__)

BACKENDS = ("gloo", "nccl")

# Substrings of the errors a collective raises when its transport broke (gloo, NCCL, TCPStore).
_TRANSPORT_MARKERS = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "Socket closed",
    "Timed out",
    "timed out",
    "NCCL communicator was aborted",
    "NCCL error",
    "ncclRemoteError",
)


def is_transport_error(err: BaseException) -> bool:
    """Whether ``err`` looks like a broken connection or a timed-out collective (not a program bug)."""
    import torch.distributed as dist

    if isinstance(err, (AbortedWait, getattr(dist, "DistNetworkError", ()), getattr(dist, "DistStoreError", ()))):
        return True
    text = str(err)
    return any(marker in text for marker in _TRANSPORT_MARKERS)


@dataclass(frozen=True, kw_only=True)
class WorldConfig:
    """Options of the elastic world.

    Attributes:
        backend: ``"gloo"`` or ``"nccl"``.
        collective_timeout_s: timeout of each generation's process groups. Failures do not wait
            for it (they are aborted); it only bounds what nothing else catches.
        join_timeout_s: how long the regroup's leader waits for a survivor that neither joined nor
            failed (e.g. one still computing when the abort came). Should exceed the longest
            stretch of compute between two collectives.
        regroup_timeout_s: bound of one :meth:`ElasticWorld.regroup` call, retries included.
        min_world_size: a regroup that leaves fewer members raises :class:`~.failures.RegroupError`.
        kill_evicted: the regroup's leader sends SIGKILL to each process the survivors left out
            (hung or silent) that runs on its machine, so that it neither holds its device nor keeps
            its launcher waiting (a frozen Lightning launcher process never exits otherwise).
        track_new_groups: wrap torch's group creation so that every group of a generation is
            tracked for abort.
        reset_deepspeed: forget DeepSpeed's cached groups at each regroup.
        store: the store host's options.
        detector: failure detection options.
    """

    backend: str = "gloo"
    collective_timeout_s: float = 600.0
    join_timeout_s: float = 30.0
    regroup_timeout_s: float = 120.0
    min_world_size: int = 1
    kill_evicted: bool = True
    track_new_groups: bool = True
    reset_deepspeed: bool = True
    store: StoreConfig = field(default_factory=StoreConfig)
    detector: FailureDetectorConfig = field(default_factory=FailureDetectorConfig)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise invalid_option("resilience.backend", self.backend, BACKENDS)
        for name in ("collective_timeout_s", "join_timeout_s", "regroup_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise invalid_option(f"resilience.{name}", value, "seconds > 0")
        if not isinstance(self.min_world_size, int) or self.min_world_size < 1:
            raise invalid_option("resilience.min_world_size", self.min_world_size, "an integer >= 1")
        if self.join_timeout_s >= self.regroup_timeout_s:
            raise invalid_option(
                "resilience.join_timeout_s", self.join_timeout_s, f"< regroup_timeout_s ({self.regroup_timeout_s})"
            )


@dataclass
class Generation:
    """One generation of the job's process groups.

    Attributes:
        number: 0, 1, 2, ...
        members: original ranks, sorted; a member's rank in this generation is its index.
        sockets: the connections of this generation's groups.
        store_client: the store connection its groups rendezvous through.
        formed: its default group is initialised and every member confirmed it.
        aborted_at: ``time.monotonic()`` of the abort, or None.
        abort_reason: why it was aborted.
    """

    number: int
    members: tuple[int, ...]
    sockets: SocketTracker
    store_client: Any = None
    formed: bool = False
    aborted_at: float | None = None
    abort_reason: str | None = None

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, original: int) -> int:
        """The rank in this generation of the process with original rank ``original``."""
        return self.members.index(original)

    def original_of(self, rank: int) -> int:
        """The original rank of this generation's rank ``rank``."""
        return self.members[rank]


_active: ElasticWorld | None = None
_original_helper: Callable[..., Any] | None = None


def _tracked_helper(*args: Any, **kwargs: Any) -> Any:
    """torch's ``_new_process_group_helper``, inside the active generation's tracking window."""
    assert _original_helper is not None
    world = _active
    if world is None or world._gen is None:
        return _original_helper(*args, **kwargs)
    with world._gen.sockets.track():
        return _original_helper(*args, **kwargs)


def _install_group_hook(world: ElasticWorld) -> None:
    global _active, _original_helper
    from torch.distributed import distributed_c10d as c10d

    if _original_helper is None:
        helper = getattr(c10d, "_new_process_group_helper", None)
        if helper is None:
            log.warning("this torch has no _new_process_group_helper; wrap group creation in world.track()")
            _active = world
            return
        _original_helper = helper
        c10d._new_process_group_helper = _tracked_helper
    _active = world


def _uninstall_group_hook(world: ElasticWorld) -> None:
    global _active, _original_helper
    if _active is not world:
        return
    _active = None
    if _original_helper is not None:
        from torch.distributed import distributed_c10d as c10d

        c10d._new_process_group_helper = _original_helper
        _original_helper = None


def _keep_forever(gen: Generation) -> None:
    """Never destroys the process groups of aborted generation ``gen``.

    A gloo group's destructor joins its worker threads, and one of them may be blocked until the group's
    timeout in a send gloo does not release (see :mod:`.abortable_waits`): destroying the group would
    block the regroup (measured) or the interpreter's exit for that long. The groups (closed connections,
    a few objects) are kept for the rest of the process instead; an extra reference count makes sure no
    collection or interpreter shutdown ever frees them.
    """
    import ctypes

    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    log.debug("generation %d: %d aborted groups kept", gen.number, len(c10d._world.pg_map))


class ElasticWorld:
    """The job's process groups, regrouped over the survivors when members fail.

    Args:
        config: options.
        rank: this process's original rank (default ``$RANK``; ignored with ``join``).
        world_size: the number of processes at start (default ``$WORLD_SIZE``; ignored with ``join``).
        join: this process joins a running job (:meth:`join`, not :meth:`start`); its rank is claimed
            from the job's store.

    Example::

        world = ElasticWorld(WorldConfig(detector=FailureDetectorConfig(progress_timeout_s=60))).start()
        step = 0
        while step < steps:
            try:
                with world.guard():
                    train_step(step)
                world.progress(step := step + 1)
            except PeerFailure as failure:
                world.regroup()          # now world.world_size == survivors
                rebuild(world, failure)  # re-plan, new engine, restore lost layers, redo the step
        world.close()
    """

    def __init__(
        self,
        config: WorldConfig | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        join: bool = False,
    ) -> None:
        self.config = config or WorldConfig()
        self.joining = join
        if join:  # claimed from the store by join()
            self.original_rank, self.initial_world_size = -1, 0
        else:
            self.original_rank = int(os.environ.get("RANK", "0")) if rank is None else rank
            self.initial_world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
            if not 0 <= self.original_rank < self.initial_world_size:
                raise invalid_option("rank", self.original_rank, f"0 .. {self.initial_world_size - 1}")
        self.store: RendezvousStore | None = None
        self.detector: FailureDetector | None = None
        self._gen: Generation | None = None
        self._job: tuple[int, ...] = ()  # the job's processes (members and spares) as of the last regroup
        self._lock = threading.RLock()
        self.history: list[dict[str, Any]] = []  # one record per abort and per generation formed
        self._stall_dump: StallDump | None = None  # set at start (it needs the run directory)
        self._waits: AbortableWaits | None = None  # gloo: waits an abort ends (see abortable_waits)

    # ------------------------------------------------------------------------ properties
    @property
    def current(self) -> Generation:
        """The current generation."""
        if self._gen is None:
            raise ResilienceError("the world is not started")
        return self._gen

    @property
    def generation(self) -> int:
        return self.current.number

    @property
    def members(self) -> tuple[int, ...]:
        """Original ranks of the current generation's members, in rank order."""
        return self.current.members

    @property
    def rank(self) -> int:
        """This process's rank in the current generation (ValueError on a spare)."""
        return self.current.rank_of(self.original_rank)

    @property
    def is_member(self) -> bool:
        """Whether this process belongs to the current generation (else it is a spare)."""
        return self.original_rank in self.current.members

    @property
    def job_members(self) -> tuple[int, ...]:
        """Original ranks of the job's live processes, members and spares, sorted (the finished ones left out)."""
        gone = set(self.failed) | self.finished
        return tuple(r for r in self._job if r == self.original_rank or r not in gone)

    @property
    def job_processes(self) -> tuple[int, ...]:
        """Original ranks of the job's processes as of the last regroup, failed since or not."""
        return tuple(sorted(set(self._job) | set(self.current.members)))

    @property
    def spares(self) -> tuple[int, ...]:
        """Live processes of the job outside the current generation, sorted."""
        members = set(self.current.members)
        return tuple(r for r in self.job_members if r not in members)

    @property
    def world_size(self) -> int:
        return self.current.world_size

    def rank_of(self, original: int) -> int:
        """Current rank of the process with original rank ``original`` (ValueError if not a member)."""
        return self.current.rank_of(original)

    def original_of(self, rank: int) -> int:
        """Original rank of the current generation's rank ``rank``."""
        return self.current.original_of(rank)

    @property
    def failed(self) -> dict[int, str]:
        """Original rank -> reason, for every failure known to this process."""
        if self.detector is None:
            return {}
        return {rank: f.reason for rank, f in self.detector.failed.items()}

    @property
    def finished(self) -> frozenset[int]:
        """Original ranks of the processes that said goodbye (ended on purpose, see :meth:`close`): no failures."""
        if self.detector is None:
            return frozenset()
        return self.detector.left

    @property
    def aborted(self) -> bool:
        """Whether the current generation is aborted (a regroup is due)."""
        return self._gen is not None and self._gen.aborted_at is not None

    @property
    def admitted(self) -> bool:
        """Whether this process belongs to the job (false only on a newcomer the members have not admitted yet)."""
        return self.current.number >= 0

    # ------------------------------------------------------------------------- lifecycle
    def start(self) -> ElasticWorld:
        """Opens the store (starting its host if needed), starts detection and forms generation 0.

        Raises:
            StoreUnavailable: no store host could be reached or started.
        """
        if self.joining:
            raise ResilienceError("a world that joins a running job opens with join(), not start()")
        self._open(RendezvousStore(self.config.store, rank=self.original_rank).open())
        self._try(lambda: publish_start_size(self.store.control, self.initial_world_size))  # type: ignore[union-attr]
        self._job = tuple(range(self.initial_world_size))
        try:
            self._form(0, self._job)
        except PeerFailure:
            # A member failed while the job started: the survivors regroup as after any failure.
            self.regroup()
        return self

    def join(self, timeout_s: float) -> ElasticWorld:
        """Opens the running job's store as a newcomer: claims an original rank above every rank the job has
        had and starts beating; the process belongs to no generation until :meth:`enter`.

        Args:
            timeout_s: how long to wait for a running job to be found in the store.

        Raises:
            AdmissionError: no running job recorded its start in the store within ``timeout_s``.
            StoreUnavailable: no store host is reachable (a newcomer never starts one).
        """
        if not self.joining:
            raise ResilienceError("join() is for a world built with join=True")
        config = dataclasses.replace(self.config.store, spawn=False)
        store = RendezvousStore(config, rank=None).open(claim=lambda s: claim_rank(s, timeout_s))
        self.original_rank = int(store.rank)  # type: ignore[arg-type]
        self._open(store)
        self._job = (self.original_rank,)
        self._gen = Generation(-1, (), SocketTracker(), formed=True)  # no generation yet: not admitted
        self.detector.watch((), -1, hold=True)  # type: ignore[union-attr]
        log.info("rank %d: joining the running job, waiting for its members to admit it", self.original_rank)
        return self

    def _open(self, store: RendezvousStore) -> None:
        """Starts detection (and group tracking) over the opened ``store``."""
        cfg = self.config
        self.store = store
        self._stall_dump = StallDump(cfg.store.resolved_run_dir(), self.original_rank)
        self.detector = FailureDetector(
            cfg.detector,
            rank=self.original_rank,
            connect=lambda: store.scoped(store.connect()),
            on_failures=self._on_failures,
            on_abort_marker=self._on_abort_marker,
            on_stalled=self._on_stalled,
        ).start()
        if cfg.track_new_groups:
            _install_group_hook(self)
        if cfg.backend == "gloo":
            self._waits = AbortableWaits(
                current=lambda: self._gen if self._gen is not None and self._gen.number >= 0 else None,
                aborted=lambda gen: gen.aborted_at is not None,
            ).install()

    def admit(self, newcomers: Sequence[int]) -> None:
        """Records ``newcomers`` (original ranks) as processes of the job: spares until a plan takes them in.

        Every process of the job calls it at the same step boundary (members and spares); no process
        group changes. Newcomers already recorded are skipped.
        """
        new = sorted(set(newcomers) - set(self._job))
        if not new:
            return
        with self._lock:
            self._job = tuple(sorted(set(self._job) | set(new)))
        assert self.detector is not None
        watched = tuple(sorted(set(self.current.members) | set(self.job_members)))
        self.detector.watch(watched, self.generation, hold=self.aborted)
        self.history.append({"event": "admitted", "generation": self.generation, "ranks": new, "at": time.monotonic()})
        log.info("rank %d: admitted newcomers %s to the job (generation %d)", self.original_rank, new, self.generation)

    def enter(self, generation: int, members: Sequence[int], job: Sequence[int]) -> None:
        """A newcomer: takes its place in the job as its members admitted it, a spare of ``generation``.

        Args:
            generation: the generation in force at the admission.
            members: its members (original ranks).
            job: every process of the job then, members and spares (this one included).
        """
        with self._lock:
            self._job = tuple(sorted(set(job) | {self.original_rank}))
        self._follow(generation, tuple(sorted(members)))

    def close(self, done: bool = True, goodbye: bool = False) -> None:
        """Stops detection, destroys the groups and leaves the store (the host ends after the last).

        Args:
            done: tell the store host that this process is done (it ends after the last one).
            goodbye: this process ends on purpose (it finished its work): it says goodbye first, before its
                groups close its connections, so that peers neither call its exit a failure nor abort the
                collectives they are still in without it (see :class:`~.failures.PeerFinished`). Without a
                goodbye its exit is a failure like any death.
        """
        if self.detector is not None:
            self.detector.stop(goodbye=goodbye)
        if self._stall_dump is not None:
            self._stall_dump.disarm()
        _uninstall_group_hook(self)
        if self._waits is not None:
            self._waits.uninstall()
        if self._gen is not None:
            self._teardown(self._gen)
        if self.store is not None:
            self.store.close(done=done)

    def __enter__(self) -> ElasticWorld:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close(done=exc[0] is None)

    # ------------------------------------------------------------------------ training loop
    def progress(self, step: int) -> None:
        """Tells peers that the training loop reached ``step`` (feeds the hang check)."""
        if self.detector is not None:
            self.detector.progress(step)

    def check(self) -> None:
        """Raises :class:`~.failures.PeerFailure` if the current generation is aborted."""
        gen = self.current
        if gen.aborted_at is not None:
            raise self._peer_failure(gen)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Runs a block of collectives; a failure of the generation comes out as :class:`~.failures.PeerFailure`.

        Inside, an exception raised while the generation is aborted, or one that looks like a
        broken transport (:func:`is_transport_error`), aborts the generation (so that every peer
        learns) and is re-raised as ``PeerFailure`` (chained). Other exceptions pass unchanged.
        """
        self.check()
        gen = self.current
        try:
            yield
        except ResilienceError:
            raise
        except Exception as err:
            if gen.aborted_at is None and not is_transport_error(err):
                raise
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            if gen.aborted_at is None:
                self._raise_if_finished(gen, err, first_line)
            self.abort(f"collective failed on rank {self.original_rank}: {first_line[:200]}", generation=gen)
            raise self._peer_failure(gen) from err

    def _raise_if_finished(self, gen: Generation, err: Exception, first_line: str) -> None:
        """A broken collective whose only missing members finished (said goodbye): :class:`~.failures.PeerFinished`,
        without an abort (the other members' collectives that do not need them go on)."""
        if self.detector is None or self.store is None:
            return
        others = [r for r in gen.members if r != self.original_rank]
        finished = self.detector.probe_goodbyes(others, self.store.control)
        if not finished:
            return
        failed = set(self._failed_now(tuple(r for r in others if r not in finished)))
        if failed & set(gen.members):
            return  # a real failure among them: it regroups as usual
        log.warning("rank %d: a collective of generation %d needed finished rank(s) %s", self.original_rank,
                    gen.number, sorted(finished))
        raise PeerFinished(gen.number, finished, first_line[:200]) from err

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Records the connections of groups created in the block as the current generation's."""
        with self.current.sockets.track():
            yield

    # ----------------------------------------------------------------------------- abort
    def abort(
        self,
        reason: str,
        *,
        failed: list[Failure] | None = None,
        publish: bool = True,
        generation: Generation | None = None,
    ) -> bool:
        """Aborts the current generation: cuts its connections and tells the other processes.

        Safe from any thread and idempotent. The main thread, if blocked in one of the
        generation's collectives, gets an exception right away.

        Args:
            reason: why (logged, published, carried by :class:`~.failures.PeerFailure`).
            failed: failures that caused it (published so that peers adopt them).
            publish: write the generation's abort marker for the other processes.
            generation: abort only if this is still the current generation.

        Returns:
            Whether this call aborted the generation (False if it already was, or was replaced).
        """
        with self._lock:
            gen = self._gen
            if gen is None or gen.aborted_at is not None or (generation is not None and gen is not generation):
                return False
            gen.aborted_at = time.monotonic()
            gen.abort_reason = reason
            # On the record before anything is released: a caller freed by the abort may read it at once.
            self.history.append({"event": "abort", "generation": gen.number, "at": gen.aborted_at, "reason": reason})
            if self._stall_dump is not None:
                # Late for the regroup: where this process was stuck goes to a file, before the others
                # leave it out (after join_timeout_s) and kill it. Armed under the lock, with the abort
                # itself: a regroup that finds the generation aborted (and disarms) finds it armed.
                self._stall_dump.arm(self.config.join_timeout_s / 2)
        if self.detector is not None:
            self.detector.hold()
        cut = gen.sockets.shutdown()
        # After the cut: a wait gloo does not end (a send queued for writing) ends here; gloo raises in the others.
        released = self._waits.release(gen) if self._waits is not None else 0
        self._abort_backends(gen)
        log.warning(
            "rank %d aborts generation %d (%d connections cut, %d waits released): %s", self.original_rank,
            gen.number, cut, released, reason,
        )
        if publish:
            self._publish_abort(gen, reason, failed or [])
        return True

    def _publish_abort(self, gen: Generation, reason: str, failed: list[Failure]) -> None:
        import json

        known = {f.rank: f.reason for f in failed}
        known.update({r: why for r, why in self.failed.items() if r in gen.members})
        payload = json.dumps(
            {"by": self.original_rank, "reason": reason, "failed": {str(r): w for r, w in known.items()}}
        )
        try:
            on_detector_thread = self.detector is not None and threading.current_thread() is self.detector.thread
            store = self.detector.store if on_detector_thread else self.store.control  # type: ignore[union-attr]
            store.compare_set(abort_key(gen.number), "", payload)
        except Exception as err:  # noqa: BLE001 - peers still find out through their own detectors
            log.warning("rank %d could not publish the abort of generation %d: %s", self.original_rank, gen.number, err)

    def _abort_backends(self, gen: Generation) -> None:
        if self.config.backend != "nccl":
            return
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        for group in list(dist.distributed_c10d._world.pg_map):
            try:
                backend = group._get_backend(torch.device("cuda"))
                backend.abort()
            except Exception as err:  # noqa: BLE001 - not an NCCL group, or gone already
                log.debug("no NCCL abort for a group: %s", err)

    def _on_failures(self, failures: list[Failure]) -> None:
        gen = self._gen
        if gen is None:
            return
        relevant = [f for f in failures if f.rank in gen.members]
        if relevant:
            named = ", ".join(f"rank {f.rank} {f.reason}" for f in relevant)
            self.abort(f"{named} (seen by rank {self.original_rank})", failed=relevant, generation=gen)

    def _on_abort_marker(self, number: int, payload: dict[str, Any]) -> None:
        now = time.monotonic()
        by = int(payload.get("by", -1))
        named = [
            Failure(int(r), f"{why} (reported by rank {by})", by, now) for r, why in payload.get("failed", {}).items()
        ]
        if self.detector is not None:
            self.detector.declare(named)
        gen = self._gen
        if gen is not None and gen.number == number and by != self.original_rank:
            self.abort(f"aborted by rank {by}: {payload.get('reason', '?')}", publish=False, generation=gen)

    def _on_stalled(self, waited_s: float) -> None:
        """The store is lost and a collective has waited ``waited_s``: end the generation (the regroup that
        follows raises ``StoreUnavailable``) rather than wait for the collective's own timeout."""
        self.abort(f"the store is lost and a collective of rank {self.original_rank} has waited {waited_s:.0f} s",
                   publish=False)

    def _failed_now(self, ranks: tuple[int, ...]) -> dict[int, str]:
        if self.detector is not None:
            self.detector.probe_exits(ranks)
        return self.failed

    def _peer_failure(self, gen: Generation) -> PeerFailure:
        failed = {r: why for r, why in self.failed.items() if r in gen.members}
        return PeerFailure(gen.number, failed, gen.abort_reason or "aborted")

    # ----------------------------------------------------------------------------- regroup
    def regroup(self) -> Generation:
        """Forms the next generation over the survivors (main thread; call on :class:`~.failures.PeerFailure`).

        Every live process of the job takes part, spares included: the new generation has them all
        (a later :meth:`reshape` can leave some out again).

        Aborts the current generation if it is not yet. Retries with the generation after if a
        member fails while the new one forms.

        Returns:
            The new current generation.

        Raises:
            EvictedError: this process is not among the survivors (the others declared it failed).
            RegroupError: no generation could be formed within ``regroup_timeout_s``, or fewer than
                ``min_world_size`` members are left.
            StoreUnavailable: the store is gone.
        """
        cfg = self.config
        started = time.monotonic()
        self.abort(f"regroup requested by rank {self.original_rank}")
        if self._stall_dump is not None:  # this process reached the regroup in time
            self._stall_dump.disarm()
        while True:
            old = self.current
            number = old.number + 1
            remaining = cfg.regroup_timeout_s - (time.monotonic() - started)
            if remaining <= 0:
                raise RegroupError(
                    f"rank {self.original_rank}: no new generation within {cfg.regroup_timeout_s:.0f} s"
                )
            if self.detector is not None and self.detector.store_lost:
                raise StoreUnavailable("the rendezvous store is lost; the job cannot regroup")
            try:
                # Finished processes (goodbye) are no candidates: nobody waits join_timeout_s for them.
                candidates = tuple(sorted((set(old.members) | set(self._job)) - self.finished))
                members = agree_members(
                    self.store.control,  # type: ignore[union-attr]
                    generation=number,
                    me=self.original_rank,
                    candidates=candidates,
                    failed=lambda: self._failed_now(candidates),
                    join_timeout_s=cfg.join_timeout_s,
                    timeout_s=remaining,
                )
            except EvictedError:
                self._teardown(old)
                raise
            except ResilienceError:
                raise
            except Exception as err:  # noqa: BLE001 - the control connection broke
                raise StoreUnavailable(f"the rendezvous store failed during the regroup: {err}") from err
            agreed_at = time.monotonic()
            # Those left out count as failed everywhere, also where nobody had named them yet.
            left_out = [r for r in candidates if r not in members]
            # With "generation N formed" (after the old groups' teardown and the new groups' forming),
            # these lines place a slow regroup: agreement, or teardown and forming.
            log.info("rank %d: generation %d agreed on members %s (left out: %s) after %.2f s", self.original_rank,
                     number, list(members), left_out, agreed_at - started)
            if self.detector is not None:
                # A survivor's verdict shared during the agreement names the cause; else being left out is it.
                shared = read_failures(self.store.control, number) if left_out else {}  # type: ignore[union-attr]
                why = f"left out of generation {number}"
                self.detector.declare(Failure(r, shared.get(r, why), members[0], agreed_at) for r in left_out)
            if members[0] == self.original_rank:
                for rank in sorted(set(candidates) - set(members)):
                    self._try(lambda r=rank: self.store.mark_left(r, "evicted"))  # type: ignore[union-attr]
                    self._kill_evicted(rank)
            if len(members) < cfg.min_world_size:
                self._teardown(old)
                raise RegroupError(
                    f"generation {number} would have {len(members)} members (< {cfg.min_world_size})"
                )
            self._teardown(old)
            self._job = tuple(members)
            try:
                self._form(number, tuple(members))
            except PeerFailure as failure:
                log.warning("rank %d: generation %d failed while forming: %s", self.original_rank, number, failure)
                continue
            self.history[-1].update(agreed_at=agreed_at, regroup_started=started)
            return self.current

    def _kill_evicted(self, rank: int) -> None:
        """SIGKILLs the evicted ``rank`` when it still runs on this machine (``kill_evicted``)."""
        if not self.config.kill_evicted or self.detector is None:
            return
        identity = self.detector.identities.get(rank)
        if identity is not None and identity.kill():
            log.warning("rank %d: killed evicted rank %d (pid %d), which was still running here",
                        self.original_rank, rank, identity.pid)

    def reshape(self, members: Sequence[int]) -> Generation:
        """Replaces a healthy generation by one over exactly ``members`` (main thread, planned).

        Every live process of the job calls it with the same ``members`` (they agreed beforehand, e.g.
        through a record in the store), members of the old or the new generation or neither: members
        of the new one form it, the others record it and become (or stay) spares. Live processes of
        the job outside ``members`` stay in the job.

        Raises:
            PeerFailure: a member failed while the generation formed (regroup, as after any failure).
            ValueError: ``members`` is empty or names a process outside the job.
        """
        wanted = tuple(sorted(set(members)))
        unknown = sorted(set(wanted) - set(self.job_processes))
        if not wanted or unknown:
            raise ValueError(f"a generation needs processes of the job; got {list(members)} (unknown: {unknown})")
        old = self.current
        number = old.number + 1
        if self.is_member:
            self._quiesce(old)
            self._teardown(old)
        if self.original_rank in wanted:
            self._form(number, wanted)
        else:
            self._follow(number, wanted)
        return self.current

    def _quiesce(self, gen: Generation, poll_s: float = 0.001) -> None:
        """Waits, through the store, until every member of ``gen`` has stopped using its groups.

        A member that destroyed its groups while a peer was still finishing a collective with it
        would break that collective (``Connection closed by peer``) and send the peer into a regroup
        of its own. Raises :class:`~.failures.PeerFailure` if the generation is aborted meanwhile.
        """
        store = self.store.control  # type: ignore[union-attr]
        key = f"gen{gen.number}/quiesced"
        count = int(store.add(key, 1))
        while count < gen.world_size:
            self.check()
            time.sleep(poll_s)
            count = int(store.add(key, 0))

    def _follow(self, number: int, members: tuple[int, ...]) -> None:
        """Records a generation this process is not a member of (a spare), and watches its abort marker."""
        assert self.detector is not None
        gen = Generation(number, members, SocketTracker(), formed=True)
        with self._lock:
            self._gen = gen
        self.detector.watch(self.job_members, number)
        self.history.append({"event": "followed", "generation": number, "members": list(members), "at": time.monotonic()})
        log.info("rank %d (spare): generation %d has members %s", self.original_rank, number, list(members))

    def _form(self, number: int, members: tuple[int, ...]) -> None:
        import torch
        import torch.distributed as dist

        cfg = self.config
        assert self.store is not None and self.detector is not None
        gen = Generation(number, members, SocketTracker(exclude_peers=self.store.peer_addresses))
        with self._lock:
            self._gen = gen
        # While it forms, no hang verdicts; at start, no silence verdicts on ranks not yet heard of.
        watched = tuple(sorted(set(members) | set(self.job_members)))
        self.detector.watch(watched, number, judge_unseen=number > 0, hold=True)
        try:
            dead = sorted(set(members) & set(self.failed))
            if dead:  # known before this generation existed: no detector verdict will come for them again
                self.abort(f"generation {number} names failed ranks {dead}", generation=gen)
            with gen.sockets.track(include_excluded=True):
                gen.store_client = self.store.connect()
            self.check()
            prefix = dist.PrefixStore(f"{self.store.namespace}/gen{number}/pg", gen.store_client)
            with self.guard(), gen.sockets.track():
                dist.init_process_group(
                    cfg.backend,
                    store=prefix,
                    rank=gen.rank_of(self.original_rank),
                    world_size=len(members),
                    timeout=datetime.timedelta(seconds=cfg.collective_timeout_s),
                )
            device = torch.device("cuda", torch.cuda.current_device()) if cfg.backend == "nccl" else torch.device("cpu")
            confirm = torch.ones(1, device=device)
            with self.guard():
                dist.all_reduce(confirm)
            if int(confirm.item()) != len(members):
                raise RegroupError(f"generation {number}: confirmation summed to {confirm.item()}, not {len(members)}")
        except PeerFailure:
            raise
        except ResilienceError:
            raise
        except Exception as err:  # noqa: BLE001 - init failed some other way: abort it like a failure
            self.abort(f"generation {number} could not form on rank {self.original_rank}: {err}", generation=gen)
            raise self._peer_failure(gen) from err
        self.detector.watch(watched, number)  # fresh clocks for the training loop
        self._try(lambda: self._learn_identities(members))
        gen.formed = True
        self.history.append({"event": "formed", "generation": number, "members": list(members), "at": time.monotonic()})
        log.info("rank %d: generation %d formed with members %s", self.original_rank, number, list(members))

    def _learn_identities(self, members: tuple[int, ...]) -> None:
        """Hands the members' process identities to the detector now (every member registered
        before it joined), so that a kill right after the start is seen without waiting a poll."""
        from resihp_lightning.resilience.procs import ProcessIdentity

        assert self.store is not None and self.detector is not None
        missing = [r for r in members if r != self.original_rank and r not in self.detector.identities]
        if missing:
            values = self.store.control.multi_get([proc_key(r) for r in missing])
            self.detector.know({r: ProcessIdentity.from_json(v) for r, v in zip(missing, values)})

    def _teardown(self, gen: Generation) -> None:
        # No socket shutdown here: an aborted generation's are cut already, and a healthy one's
        # (at close) are closed by destroy, which lets data already sent reach the peers.
        import torch.distributed as dist

        if dist.is_initialized():
            if gen.aborted_at is not None and self.config.backend == "gloo":
                _keep_forever(gen)
            try:
                dist.destroy_process_group()
            except Exception as err:  # noqa: BLE001 - a broken group may not destroy cleanly
                log.debug("destroying generation %d: %s", gen.number, err)
        # torch names each new group after a per-process counter, which only destroying an initialised
        # default group resets: a process whose init of this generation was aborted half-way counted
        # one group more than its peers and would rendezvous the next generation under another name.
        from torch.distributed import distributed_c10d as c10d

        c10d._world.group_count = 0
        gen.sockets.clear()
        gen.store_client = None
        if self.config.reset_deepspeed:
            reset_deepspeed()

    @staticmethod
    def _try(action: Callable[[], Any]) -> None:
        try:
            action()
        except Exception as err:  # noqa: BLE001 - bookkeeping only
            log.debug("store bookkeeping failed: %s", err)
