"""Runs a benchmark's ranks as spawned processes and collects what they put on a queue.

Each rank runs ``target(rank, port, *args, queue)`` (``port``: a free loopback port for the process
group). A rank that dies ends the wait at once instead of leaving it to the timeout.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from typing import Any


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environment(rank: int, port: int, world: int) -> None:
    """In a spawned rank: what torchrun would set for rank ``rank`` of a one-machine job of ``world`` on ``port``
    (one thread per process)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")


def run_ranks(target: Callable[..., None], args: tuple, world: int, messages: int, timeout: float) -> list[Any]:
    """Starts ``world`` ranks and returns the first ``messages`` items they put on the queue.

    Raises:
        RuntimeError: a rank exited with an error, or the messages did not come within ``timeout``.
    """
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(rank, port, *args, queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    out: list[Any] = []
    try:
        while len(out) < messages:
            try:
                out.append(queue.get(timeout=1.0))
            except Exception:  # queue.Empty
                dead = [p.exitcode for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"benchmark job failed (exit codes {dead}) or timed out") from None
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    return out
