"""Waits on ``torch.distributed`` work that an abort ends, where gloo alone would wait for the group's timeout.

Why: cutting a generation's connections (:mod:`.sockets`) makes gloo raise in a blocked call *almost*
always. Not when a send's data is already queued for writing: gloo's TCP pair keeps a send of an
unbound buffer (every ``send``, ``isend`` and the sends inside collectives) in its write queue when the
socket's buffer is full (a large message to a peer that stopped reading) or when a write fails with
``EPIPE`` / ``ECONNRESET`` (the connection was just cut or reset, and the pair's loop has not processed
the error yet). When the pair then fails, it wakes the buffers of every pending operation except these:
the wait for the send's completion lasts until the group's timeout (``collective_timeout_s``, minutes).
Reproduced here: a 64 MB ``send`` to a peer that stopped mid-message stays blocked after the cut until the
timeout (``tests/resilience/test_abortable_waits.py``); seen in tests as a survivor stuck in a
pipeline ``send`` (``routed_send``) or a tensor-parallel ``all_reduce`` after an abort, never reaching the
regroup, left out after ``join_timeout_s`` and killed, and the job lost.

What: while a world on gloo is open, :class:`AbortableWaits` replaces ``Work.wait`` (the one call every
blocking ``torch.distributed`` function and every caller of an async op waits in), for work not complete
on entry, so that the caller leaves when the generation the wait started in is aborted, raising
:class:`AbortedWait` (a transport error to :meth:`ElasticWorld.guard <.world.ElasticWorld.guard>`):

* a collective (gloo runs it in its own worker thread) is waited for in slices of ``slice_s`` (50 ms) on
  the caller's thread, with a look at the abort between slices: a timed wait of such work that runs out
  has no effect on it (measured: an all-reduce waited in 20 slices completes normally, and the next
  collective works). Nothing changes for a collective that completes within its first slice;
* a send or a receive cannot be waited in slices (gloo treats a timed-out send or receive as a failure
  of the whole group), so its wait is handed to a waiter thread and the caller waits for it *or* for the
  abort (:meth:`AbortableWaits.release`, called by the abort after the cut). The abandoned wait stays in
  its waiter thread until gloo gives up (the group's timeout); that thread is not reused, nothing joins
  it. Cost: one hand-over between two threads per send or receive.

The worker thread of an abandoned collective stays blocked too, and destroying its group joins it
(measured: ``destroy_process_group`` blocked for the rest of the group's timeout): the world never
destroys the groups of an aborted generation (:meth:`ElasticWorld.regroup
<.world.ElasticWorld.regroup>` keeps them, a few objects per recovery).

Not for NCCL: ``Work.wait`` there makes the caller's CUDA stream wait, which must happen on the caller's
thread; an NCCL world does not install it (its abort calls ``ncclCommAbort``).
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from typing import Any

from resihp_lightning._logging import get_logger

log = get_logger(__name__)


class AbortedWait(RuntimeError):
    """A wait on a collective or point-to-point operation ended by the abort of its generation."""

    def __init__(self, generation: Any) -> None:
        number = getattr(generation, "number", generation)
        super().__init__(f"Socket closed: generation {number} was aborted while this process waited in a "
                         f"collective (released by the abort, not by gloo)")


class _Job:
    """One wait handed to a waiter thread.

    The caller blocks in ``ended.acquire()``: a C call, so that its innermost Python frame stays in this
    module, which the failure detector counts as waiting in communication (``comm_frames``).
    """

    __slots__ = ("work", "args", "kwargs", "token", "ended", "result", "error", "state")

    def __init__(self, work: Any, args: tuple, kwargs: dict, token: Any) -> None:
        self.work, self.args, self.kwargs, self.token = work, args, kwargs, token
        self.ended = threading.Lock()
        self.ended.acquire()  # released once: when the wait returns or the abort releases it
        self.result: Any = None
        self.error: BaseException | None = None
        self.state = "waiting"  # then "done" or "released" (under the owner's lock)


class _Waiter:
    """A daemon thread that runs the waits handed to it, one at a time; it ends after a wait it was released from."""

    def __init__(self, owner: AbortableWaits) -> None:
        self._owner = owner
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="resihp-wait", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                job.result = _original_wait(job.work, *job.args, **job.kwargs)  # type: ignore[misc]
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                job.error = err
            if not self._owner._finished(job, self):
                return  # released by an abort: the caller is gone; this thread is not reused
            job.ended.release()


_original_wait: Callable[..., Any] | None = None
_installed: AbortableWaits | None = None


def _point_to_point(work: Any) -> bool:
    """Whether ``work`` is a send or a receive, or of an unknown kind: its wait cannot be timed (gloo treats a
    send or receive that timed out as a failure of the whole group)."""
    from torch._C._distributed_c10d import OpType

    try:
        kind = int(work._get_op_type())  # an int, which never equals the enum's members
    except Exception:  # noqa: BLE001 - a work type that does not say: the safe way
        return True
    return kind in {int(OpType.SEND), int(OpType.RECV), int(OpType.RECVANYSOURCE), int(OpType.UNKNOWN)}


def _wait(work: Any, *args: Any, **kwargs: Any) -> Any:
    """``Work.wait`` while an :class:`AbortableWaits` is installed (a wait with its own timeout is left alone)."""
    waits = _installed
    assert _original_wait is not None
    if waits is None or args or kwargs:
        return _original_wait(work, *args, **kwargs)
    token = waits.current()
    try:
        completed = work.is_completed()
    except Exception:  # noqa: BLE001 - a work type that does not say: wait for it as any other
        completed = False
    if token is None or completed:
        return _original_wait(work)
    if _point_to_point(work):
        return waits.wait(work, token, (), {})
    return waits.wait_in_slices(work, token)


class AbortableWaits:
    """``Work.wait`` made abortable per generation (see the module docstring).

    Args:
        current: the caller's current generation (any object; None: waits are not handed over), used as
            the token an abort releases.
        aborted: whether a token's generation is aborted already (a wait that starts after the abort is
            released at once: its send may be one that gloo queued after the cut).
        slice_s: how long a collective is waited for between two looks at the abort.
    """

    def __init__(self, current: Callable[[], Any], aborted: Callable[[Any], bool], slice_s: float = 0.05) -> None:
        self.current = current
        self._aborted = aborted
        self._slice = datetime.timedelta(seconds=slice_s)
        self._lock = threading.Lock()
        self._pending: dict[int, _Job] = {}
        self._idle: list[_Waiter] = []
        #: Waits released by an abort so far (their waiter threads may still be blocked in gloo).
        self.released = 0

    # ------------------------------------------------------------------------------ install
    def install(self) -> AbortableWaits:
        """Replaces ``torch.distributed.Work.wait`` (one instance at a time per process)."""
        global _installed, _original_wait
        import torch.distributed as dist

        if _original_wait is None:
            _original_wait = dist.Work.wait
            dist.Work.wait = _wait
        _installed = self
        return self

    def uninstall(self) -> None:
        """Puts ``Work.wait`` back (if this instance installed it)."""
        global _installed, _original_wait
        if _installed is not self:
            return
        import torch.distributed as dist

        _installed = None
        if _original_wait is not None:
            dist.Work.wait = _original_wait
            _original_wait = None

    # -------------------------------------------------------------------------------- waits
    def wait(self, work: Any, token: Any, args: tuple, kwargs: dict) -> Any:
        """Waits for ``work`` in a waiter thread; raises :class:`AbortedWait` when ``token`` is aborted first."""
        job = _Job(work, args, kwargs, token)
        with self._lock:
            self._pending[id(job)] = job
            waiter = self._idle.pop() if self._idle else None
        if waiter is None:
            waiter = _Waiter(self)
        waiter.jobs.put(job)
        if self._aborted(token):
            self.release(token)
        job.ended.acquire()
        if job.state == "released":
            raise AbortedWait(token)
        if job.error is not None:
            raise job.error
        return job.result

    def wait_in_slices(self, work: Any, token: Any) -> Any:
        """Waits for a collective on the caller's thread, ``slice_s`` at a time; :class:`AbortedWait` once
        ``token`` is aborted."""
        assert _original_wait is not None
        while True:
            if self._aborted(token):
                with self._lock:
                    self.released += 1
                raise AbortedWait(token)
            try:
                return _original_wait(work, self._slice)
            except RuntimeError:
                if work.is_completed():
                    # Its own outcome: it failed, or it completed between the slice's end and this look
                    # (then the slice's "Operation timed out!" is no failure of the collective).
                    return _original_wait(work)
                # else only this slice ran out ("Operation timed out!"): the work goes on

    def release(self, token: Any) -> int:
        """Ends every wait that started under ``token`` (any thread); returns how many were pending."""
        with self._lock:
            jobs = [j for j in self._pending.values() if j.token is token and j.state == "waiting"]
            for job in jobs:
                job.state = "released"
                del self._pending[id(job)]
            self.released += len(jobs)
        for job in jobs:
            job.ended.release()
        return len(jobs)

    def _finished(self, job: _Job, waiter: _Waiter) -> bool:
        """A waiter's wait returned: whether the waiter goes back to work (False after a released wait)."""
        with self._lock:
            if job.state == "released":
                return False
            job.state = "done"
            self._pending.pop(id(job), None)
            self._idle.append(waiter)
            return True
