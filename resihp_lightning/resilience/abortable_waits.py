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
blocking ``torch.distributed`` function and every caller of an async op waits in). A wait whose work is
not complete yet is handed to a waiter thread and the caller waits for it *or* for the abort of the
generation it started in (:meth:`AbortableWaits.release`, called by the abort after the cut): the caller
then raises :class:`AbortedWait` (a transport error to :meth:`ElasticWorld.guard
<.world.ElasticWorld.guard>`) at once. The abandoned wait stays in its waiter thread until gloo gives up
(the group's timeout); that thread is not reused, and nothing joins it. Cost: one hand-over between two
threads per wait that is not complete on entry (tens of microseconds).

Not for NCCL: ``Work.wait`` there makes the caller's CUDA stream wait, which must happen on the caller's
thread; an NCCL world does not install it (its abort calls ``ncclCommAbort``).
"""

from __future__ import annotations

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
    """One wait handed to a waiter thread."""

    __slots__ = ("work", "args", "kwargs", "token", "done", "result", "error", "released")

    def __init__(self, work: Any, args: tuple, kwargs: dict, token: Any) -> None:
        self.work, self.args, self.kwargs, self.token = work, args, kwargs, token
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.released = False


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
            job.done.set()


_original_wait: Callable[..., Any] | None = None
_installed: AbortableWaits | None = None


def _wait(work: Any, *args: Any, **kwargs: Any) -> Any:
    """``Work.wait`` while an :class:`AbortableWaits` is installed."""
    waits = _installed
    assert _original_wait is not None
    if waits is None:
        return _original_wait(work, *args, **kwargs)
    token = waits.current()
    if token is None or work.is_completed():
        return _original_wait(work, *args, **kwargs)
    return waits.wait(work, token, args, kwargs)


class AbortableWaits:
    """``Work.wait`` made abortable per generation (see the module docstring).

    Args:
        current: the caller's current generation (any object; None: waits are not handed over), used as
            the token an abort releases.
        aborted: whether a token's generation is aborted already (a wait that starts after the abort is
            released at once: its send may be one that gloo queued after the cut).
    """

    def __init__(self, current: Callable[[], Any], aborted: Callable[[Any], bool]) -> None:
        self.current = current
        self._aborted = aborted
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
        job.done.wait()
        if job.released:
            raise AbortedWait(token)
        if job.error is not None:
            raise job.error
        return job.result

    def release(self, token: Any) -> int:
        """Ends every wait that started under ``token`` (any thread); returns how many were pending."""
        with self._lock:
            jobs = [j for j in self._pending.values() if j.token is token and not j.done.is_set()]
            for job in jobs:
                job.released = True
                del self._pending[id(job)]
            self.released += len(jobs)
        for job in jobs:
            job.done.set()
        return len(jobs)

    def _finished(self, job: _Job, waiter: _Waiter) -> bool:
        """A waiter's wait returned: whether the waiter goes back to work (False after a released wait)."""
        with self._lock:
            if job.released:
                return False
            self._pending.pop(id(job), None)
            self._idle.append(waiter)
            return True
