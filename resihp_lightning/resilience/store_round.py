"""Which launch round the workers of a torchrun job are in, agreed through the store itself.

The fail-stop store keys each launch of a job apart (``resihp/<run id>/a<round>``), so that the
workers of a restarted group never read the keys of the last one. torchrun's
``TORCHELASTIC_RESTART_COUNT`` cannot name the round: after a membership change (a node joins, or one
agent restarts its workers after a failure and the others follow at the next rendezvous round) the
agent whose workers failed counts one more restart than the agents that only followed, so workers of
one round disagree (seen on the namespace machines: ``docs/machines.md``). Nothing else torchrun
hands a worker is unique to a round (``MASTER_PORT`` stays the same while the agents share their
TCP store), and no collective exists yet: the store namespace is needed to form the first group.

So the workers agree through the store, with their ranks (``RANK``, ``WORLD_SIZE``: unique within a
round) and one counter:

1. rank 0 starts a new round: ``n = add(started, 1) - 1`` (every round has exactly one rank 0, and it
   always starts a new round), writes the round's size and claims its slot;
2. every other rank claims slot ``rank`` in the newest round whose size is its ``WORLD_SIZE``
   (``compare_set`` on ``<n>/rank<r>``); a slot already claimed belongs to a process of an older
   round: it waits for its own rank 0 to start the next one;
3. once every slot of round ``n`` is claimed, rank 0 seals it; the others return ``n`` when it is
   sealed. A worker whose round is overtaken before it is sealed (a newer round started: it claimed
   a slot a dead worker of an old round never took) moves to the newest round and claims again.

A round is thus the set of one rank-0 start and the ``WORLD_SIZE - 1`` claims that follow it, and
every worker of one torchrun round returns the same number. Old rounds' keys stay (a few bytes each).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from resihp_lightning.resilience.failures import StoreUnavailable

_POLL_S = 0.02


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def agree_round(store: Any, *, rank: int, world_size: int, timeout_s: float) -> int:
    """The round of this worker's launch, the same on every worker of it (see the module's docstring).

    Args:
        store: a store view scoped to the run (its keys are this function's alone).
        rank: this worker's ``RANK`` in its torchrun round.
        world_size: ``WORLD_SIZE`` of that round.
        timeout_s: how long to wait for the round's other workers.

    Raises:
        StoreUnavailable: the round was not sealed within ``timeout_s`` (a worker of it never came).
    """
    token = uuid.uuid4().hex
    deadline = time.monotonic() + timeout_s
    claimed: int | None = None
    if rank == 0:
        claimed = int(store.add("started", 1)) - 1
        store.set(f"{claimed}/size", str(world_size))
        store.compare_set(f"{claimed}/rank0", "", token)
    while time.monotonic() < deadline:
        newest = int(store.add("started", 0)) - 1
        if claimed is not None and claimed < newest and not store.check([f"{claimed}/sealed"]):
            claimed = None  # overtaken before it was sealed: not this worker's round
        if claimed is None and newest >= 0 and rank != 0 and _fits(store, newest, world_size):
            if _text(store.compare_set(f"{newest}/rank{rank}", "", token)) == token:
                claimed = newest
        if claimed is not None:
            if store.check([f"{claimed}/sealed"]):
                return claimed
            if rank == 0 and store.check([f"{claimed}/rank{r}" for r in range(world_size)]):
                store.set(f"{claimed}/sealed", "1")
                return claimed
        time.sleep(_POLL_S)
    raise StoreUnavailable(
        f"rank {rank}: the workers of this launch did not all reach the store within {timeout_s:.0f} s "
        f"(round {claimed if claimed is not None else 'not found'})"
    )


def _fits(store: Any, round_number: int, world_size: int) -> bool:
    key = f"{round_number}/size"
    return store.check([key]) and _text(store.get(key)) == str(world_size)


def sealed_round(store: Any) -> int | None:
    """The newest sealed round, or ``None``: the round a process joining the running launch takes (it took
    no part in agreeing on it; :mod:`~resihp_lightning.resilience.joining`)."""
    for number in range(int(store.add("started", 0)) - 1, -1, -1):
        if store.check([f"{number}/sealed"]):
            return number
    return None
