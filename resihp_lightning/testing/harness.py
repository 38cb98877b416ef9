"""Runs a local job whose members may die on purpose, and never hangs (tests and benchmarks).

Like ``multiproc.py`` beside it (fresh processes from the same fork server, torchrun-style
environment, one thread each, a hard timeout), except that a rank that dies or stops is an *outcome* to report, not a failure of the
harness: :func:`run_job` waits for the ranks named in ``wait_for`` (default: all) to return, then
SIGKILLs whatever is left (a SIGSTOPped rank included) and reports each rank as ``ok``, ``error``,
``died`` or ``killed``. A rank whose function returned ends as a real process exiting normally ends its
fail-stop job (:func:`~resihp_lightning.failstop.survivors.close_open_jobs`: a goodbye after a clean fit);
one whose function raised ends without it, as a crash. A rank that is about to kill itself can leave :func:`last_words` (e.g. the
``time.monotonic()`` of its death; that clock is shared by the processes of one machine).

The store host a job started is found through the job's run directory; :func:`run_job` can wait for
it to end by itself (``store_host_grace_s``) and kills it otherwise, so no test leaks one.

``joiners`` adds processes outside the job's world (a replacement that joins the running job, e.g.
with ``RESIHP_JOIN=1``): each has the job's torchrun environment and its own variables on top, and is
reported under the index after the world's ranks.
"""

from __future__ import annotations

import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resihp_lightning.testing.multiproc import enter_rank, free_port, rank_context
from resihp_lightning.resilience.procs import ProcessIdentity
from resihp_lightning.resilience.store import read_address


def last_words(run_dir: str, rank: int, **values: Any) -> None:
    """Leaves ``values`` for the harness before this rank dies on purpose."""
    path = Path(run_dir) / f"last-words-{rank}.pkl"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(values))
    os.replace(tmp, path)


@dataclass
class RankOutcome:
    """What became of one rank: ``status`` is ``ok``, ``error``, ``died`` or ``killed`` (by the harness)."""

    rank: int
    status: str
    value: Any = None
    error: str | None = None
    exitcode: int | None = None
    last_words: dict[str, Any] | None = None


@dataclass
class JobOutcome:
    """Every rank's outcome, and what became of the store host."""

    ranks: list[RankOutcome]
    run_dir: str
    wall_s: float
    store_host_pid: int | None = None
    store_host_ended_by_itself: bool | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def values(self) -> dict[int, Any]:
        """Rank -> return value, for the ranks that returned."""
        return {r.rank: r.value for r in self.ranks if r.status == "ok"}

    def errors(self) -> dict[int, str]:
        return {r.rank: r.error or "" for r in self.ranks if r.status == "error"}

    def describe(self) -> str:
        lines = [f"job in {self.run_dir} ({self.wall_s:.1f} s):"]
        for r in self.ranks:
            if r.status == "error":
                detail = r.error
            else:
                detail = repr(r.value)[:300] if r.status == "ok" else f"exit {r.exitcode}"
            lines.append(f"  rank {r.rank}: {r.status}: {detail}")
        for name in [f"rank{r.rank}.log" for r in self.ranks] + ["store_host.log"]:
            log_file = Path(self.run_dir) / name
            if log_file.exists():
                tail = [line[:300] for line in log_file.read_text().splitlines()[-12:]]
                lines.append(f"  {name}:\n    " + "\n    ".join(tail))
        return "\n".join(lines)


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, run_dir: str, env: dict, parent_env: dict,
    kwargs: dict,
) -> None:
    enter_rank(rank, world_size, port, env, parent_env)
    import logging

    handler = logging.FileHandler(Path(run_dir) / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter("%(relativeCreated)8.0f %(name)s: %(message)s"))
    package_logger = logging.getLogger("resihp_lightning")
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    out = Path(run_dir) / f"result-{rank}.pkl"
    try:
        import torch

        torch.set_num_threads(1)
        result: tuple[str, Any] = ("ok", fn(rank, world_size, run_dir, **kwargs))
    except BaseException:  # noqa: BLE001 - everything travels back to the harness
        result = ("error", traceback.format_exc())
    try:
        payload = pickle.dumps(result)
    except Exception:  # noqa: BLE001 - an unpicklable result is an error too
        payload = pickle.dumps(("error", f"unpicklable result: {result!r:.300}"))
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, out)
    if result[0] == "ok":
        # What the interpreter's exit would do for the job: a fail-stop job that ended cleanly says goodbye
        # (its peers may still be in collectives that do not need it) and leaves its groups and the store.
        from resihp_lightning.failstop.survivors import close_open_jobs

        close_open_jobs()
    # No interpreter teardown: threads or groups of a broken job must not keep the process alive.
    os._exit(0)


def run_job(
    fn: Callable[..., Any],
    world_size: int,
    *,
    timeout: float = 60.0,
    wait_for: Sequence[int] | None = None,
    run_dir: str | None = None,
    env: dict[str, str] | None = None,
    store_host_grace_s: float = 0.0,
    joiners: Sequence[Mapping[str, str]] = (),
    **kwargs: Any,
) -> JobOutcome:
    """Runs ``fn(rank, world_size, run_dir, **kwargs)`` on ``world_size`` spawned processes.

    Args:
        fn: a module-level (picklable) function; its return value must pickle.
        world_size: how many ranks.
        timeout: seconds for the whole job; ranks still running then are killed.
        wait_for: the ranks expected to return (default all); once they have, the rest are killed.
        run_dir: the job's run directory (default: a new temporary one, removed afterwards unless
            the job failed).
        env: extra environment variables for every rank.
        store_host_grace_s: how long to let the store host end by itself after the ranks are gone
            before killing it.
        joiners: one environment per extra process outside the world (it runs ``fn`` too, as index
            ``world_size + i``, with ``WORLD_SIZE`` the world's and these variables over ``env``; give it
            its ``LOCAL_RANK``).
        **kwargs: picklable keyword arguments for ``fn``.
    """
    ctx = rank_context()
    port = free_port()
    parent_env = dict(os.environ)
    own_dir = run_dir is None
    run_dir = run_dir or tempfile.mkdtemp(prefix="resihp-job-")
    total = world_size + len(joiners)
    expected = set(range(total) if wait_for is None else wait_for)
    envs = [dict(env or {}) for _ in range(world_size)] + [{**(env or {}), **extra} for extra in joiners]
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, run_dir, envs[r], parent_env, kwargs), daemon=True)
        for r in range(total)
    ]
    started = time.monotonic()
    for proc in procs:
        proc.start()
    host: ProcessIdentity | None = None
    deadline = started + timeout
    while time.monotonic() < deadline:
        host = host or _store_host(run_dir)
        done = {r for r in range(total) if (Path(run_dir) / f"result-{r}.pkl").exists()}
        errored = any(_status(run_dir, r) == "error" for r in done)
        if expected <= done or errored or not any(p.is_alive() for p in procs):
            break
        time.sleep(0.02)
    wall = time.monotonic() - started
    killed = set()
    for rank, proc in enumerate(procs):
        if proc.is_alive() and _kill(proc.pid):
            killed.add(rank)
    for proc in procs:
        proc.join(5)
    outcomes = [_outcome(run_dir, r, procs[r], r in killed) for r in range(total)]
    host = host or _store_host(run_dir)
    ended = None
    if host is not None:
        limit = time.monotonic() + store_host_grace_s
        while host.alive() and time.monotonic() < limit:
            time.sleep(0.05)
        ended = not host.alive()
        if not ended:
            _kill(host.pid)
    outcome = JobOutcome(outcomes, run_dir, wall, host.pid if host else None, ended)
    if own_dir and all(o.status == "ok" for o in outcomes if o.rank in expected):
        _remove(run_dir)
    return outcome


def _kill(pid: int) -> bool:
    """SIGKILLs ``pid``; False if it had exited already (it may between a check and the kill)."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def _store_host(run_dir: str) -> ProcessIdentity | None:
    info = read_address(Path(run_dir))
    return ProcessIdentity(**info["identity"]) if info else None


def _status(run_dir: str, rank: int) -> str | None:
    try:
        return pickle.loads((Path(run_dir) / f"result-{rank}.pkl").read_bytes())[0]
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _outcome(run_dir: str, rank: int, proc: Any, killed: bool) -> RankOutcome:
    words_path = Path(run_dir) / f"last-words-{rank}.pkl"
    words = pickle.loads(words_path.read_bytes()) if words_path.exists() else None
    path = Path(run_dir) / f"result-{rank}.pkl"
    if path.exists():
        status, payload = pickle.loads(path.read_bytes())
        if status == "ok":
            return RankOutcome(rank, "ok", value=payload, last_words=words)
        return RankOutcome(rank, "error", error=payload, last_words=words)
    return RankOutcome(rank, "killed" if killed else "died", exitcode=proc.exitcode, last_words=words)


def _remove(run_dir: str) -> None:
    for path in sorted(Path(run_dir).rglob("*"), reverse=True):
        try:
            path.rmdir() if path.is_dir() else path.unlink()
        except OSError:
            pass
    try:
        Path(run_dir).rmdir()
    except OSError:
        pass
