"""Runs a function on N real gloo processes, torchrun-style, and fails instead of hanging.

Each rank is a fresh process (forked from a fork server that imported torch, Lightning and DeepSpeed
once: :func:`rank_context`) with ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/
``LOCAL_RANK`` set as torchrun would (so Lightning's environment detection sees an externally launched
job) and ``OMP_NUM_THREADS=1``. The function runs *before* any process group exists; it calls
``torch.distributed.init_process_group("gloo")`` itself (or lets Lightning / DeepSpeed do it).
Return values and exceptions travel back through pickle files. If any rank fails, the others are
killed and the rank's traceback is raised; if the job outlives ``timeout`` (a hung collective), every
rank is killed and the test fails with the ranks still alive named.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


class DistributedTestError(AssertionError):
    """A rank raised, died or hung."""


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun gives rank ``rank`` of a one-machine job (one thread per process)."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "OMP_NUM_THREADS": "1",
    }


#: What the fork server imports once, so that no rank of any job pays these imports again (several
#: seconds each on a small machine: Lightning and DeepSpeed the most; the models package brings
#: Hugging Face transformers, ~1 s more per rank of the model tests).
PRELOAD = (
    "torch", "torch.distributed", "lightning.pytorch", "deepspeed", "resihp_lightning.strategy.strategy",
    "resihp_lightning.models",
)


def rank_context() -> Any:
    """The multiprocessing context every test job's ranks start from.

    A ``forkserver`` whose server imported :data:`PRELOAD` once: each rank is a fresh process (no
    state of the test process, unlike ``fork``) that does not import torch, Lightning and DeepSpeed
    again (unlike ``spawn``). Where there is no fork server, ``spawn``. The server is shared by every
    caller of this process; the preload list takes effect when it starts (the first job).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def start_rank_server() -> None:
    """Starts :func:`rank_context`'s fork server now, in the background (no-op without one).

    Its imports (several seconds) then overlap with whatever this process does next, e.g. a test
    session's single-process tests, instead of delaying the first job.
    """
    if rank_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def enter_rank(rank: int, world_size: int, port: int, env: dict[str, str], parent_env: dict[str, str]) -> None:
    """Makes a freshly started rank look as if it had been started by torchrun from the test process.

    A rank forked from the fork server inherits the server's environment, fixed when it started; so
    the test process's environment at launch is applied first (as a spawned rank would have it), then
    torchrun's variables and ``env``. What a preloaded module read from the environment at import is
    read again: Lightning's rank-zero rank (``RANK``).
    """
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(torchrun_env(rank, world_size, port))
    os.environ.update(env)
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    if rank_zero is not None:
        rank_zero.rank_zero_only.rank = rank


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, out: str, env: dict, parent_env: dict, kwargs: dict
) -> None:
    enter_rank(rank, world_size, port, env, parent_env)
    try:
        import torch

        torch.set_num_threads(1)
        result = ("ok", fn(rank, world_size, **kwargs))
    except BaseException:  # noqa: BLE001 - everything must travel back to the test
        result = ("error", traceback.format_exc())
    with open(out, "wb") as handle:
        pickle.dump(result, handle)
    # Skip interpreter teardown: a peer blocked in a collective must not keep this process alive.
    os._exit(0)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn(rank, world_size, **kwargs)`` on ``world_size`` processes and returns their results.

    Args:
        fn: a module-level (picklable) function.
        world_size: how many ranks.
        timeout: seconds for the whole job, process start included; past it every rank is killed.
        env: extra environment variables for every rank.
        **kwargs: picklable keyword arguments for ``fn``.

    Raises:
        DistributedTestError: a rank raised (its traceback is in the message), died, or the job hung.
    """
    ctx = rank_context()
    port = free_port()
    parent_env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="resihp-dist-") as tmp:
        outs = [str(Path(tmp) / f"rank{r}.pkl") for r in range(world_size)]
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world_size, port, outs[r], dict(env or {}), parent_env, kwargs), daemon=True)
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        failure: str | None = None
        while True:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            for r, p in enumerate(procs):
                if not p.is_alive() and failure is None:
                    failure = _failure_of(r, p, outs[r])
            if failure is not None or not alive:
                break
            if time.monotonic() > deadline:
                failure = f"distributed job timed out after {timeout:.0f} s; ranks {alive} still running (hung collective?)"
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)
        if failure is not None:
            raise DistributedTestError(failure)
        return [pickle.loads(Path(o).read_bytes())[1] for o in outs]


def _failure_of(rank: int, proc: Any, out: str) -> str | None:
    path = Path(out)
    if not path.exists():
        return f"rank {rank} died with exit code {proc.exitcode} before reporting a result"
    status, payload = pickle.loads(path.read_bytes())
    if status == "error":
        return f"rank {rank} raised:\n{payload}"
    return None
