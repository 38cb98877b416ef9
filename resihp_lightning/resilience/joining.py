"""How a process started after the job began joins it in-process: its rank, its registration, its admission.

A job's processes can leave in-process (a death, a device left idle as a hot spare); this module is
the store side of the other direction, a newcomer (a replacement machine, a process restarted by
hand) entering the running job. Keys, all under the job's store namespace:

* ``join/start_size``: the number of processes the job started with, written by every process at
  start (``compare_set``: the first write stays). A newcomer that finds no such key finds no running
  job there, and waits for one (bounded);
* ``join/claims``: a counter. A newcomer's original rank is ``start_size + add(join/claims, 1) - 1``:
  above every rank the job has had, never a dead rank's number again (verdicts are final: a process
  found dead is never taken back, and a number names one process for the job's lifetime);
* ``join/info/<rank>``: what the members need to know of the newcomer before they plan with it (its
  memory budget), written before it counts as ready;
* ``join/ready`` (an ``append`` list of ranks, in registration order) and ``join/ready_count`` (a
  counter, added to after the append): the newcomers ready to be admitted. The members read the
  count once per step (one store read by one process: :class:`~resihp_lightning.failstop.step_commit.StepCommit`),
  and admit the first ``count`` entries of the list that they have not admitted yet;
* ``join/admitted/<rank>``: the admission record the members' rank 0 writes for the newcomer (what
  it needs to run the job's loop from the step it enters at); the newcomer waits for it.

No verdict is needed to admit: every process that the newcomer will meet learns of it at the same
step boundary (:mod:`resihp_lightning.failstop.admission` has the members' side).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from resihp_lightning.resilience.failures import AdmissionError

START_SIZE_KEY = "join/start_size"
CLAIMS_KEY = "join/claims"
READY_KEY = "join/ready"
READY_COUNT_KEY = "join/ready_count"


def info_key(rank: int) -> str:
    return f"join/info/{rank}"


def admission_key(rank: int) -> str:
    return f"join/admitted/{rank}"


def publish_start_size(store: Any, world_size: int) -> None:
    """Records the job's starting world size (every process at start; the first write stays)."""
    store.compare_set(START_SIZE_KEY, "", str(int(world_size)))


def claim_rank(store: Any, timeout_s: float, poll_s: float = 0.05) -> int:
    """A newcomer's original rank: above every rank the job has had (see the module docstring).

    Raises:
        AdmissionError: no job recorded its start in this store within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not store.check([START_SIZE_KEY]):
        if time.monotonic() > deadline:
            raise AdmissionError(
                f"no running job found in the fail-stop store within {timeout_s:.0f} s (nothing recorded its start: "
                "give the newcomer the job's MASTER_ADDR / MASTER_PORT, or its run id, and its store options)"
            )
        time.sleep(poll_s)
    start_size = int(_text(store.get(START_SIZE_KEY)))
    return start_size + int(store.add(CLAIMS_KEY, 1)) - 1


def announce_ready(store: Any, rank: int, info: Mapping[str, Any]) -> None:
    """Registers newcomer ``rank`` as ready to be admitted, with what the members plan with (``info``)."""
    store.set(info_key(rank), json.dumps(dict(info)))
    store.append(READY_KEY, f"{rank},")
    store.add(READY_COUNT_KEY, 1)  # after the append: a count never names an entry not yet in the list


def ready_count(store: Any) -> int:
    """How many newcomers have registered as ready so far (one store read)."""
    return int(store.add(READY_COUNT_KEY, 0))


def ready_ranks(store: Any, first: int, last: int) -> list[int]:
    """Entries ``first .. last - 1`` of the ready list (registration order)."""
    if last <= first or not store.check([READY_KEY]):
        return []
    ranks = [int(r) for r in _text(store.get(READY_KEY)).split(",") if r]
    return ranks[first:last]


def read_info(store: Any, rank: int) -> dict[str, Any]:
    """What newcomer ``rank`` registered about itself (empty when nothing)."""
    key = info_key(rank)
    return json.loads(_text(store.get(key))) if store.check([key]) else {}


def write_admission(store: Any, rank: int, payload: bytes) -> None:
    """The members' rank 0: hands newcomer ``rank`` its admission record."""
    store.set(admission_key(rank), payload)


def wait_admission(
    store: Any, rank: int, timeout_s: float, poll_s: float = 0.02, check: Callable[[], None] | None = None
) -> bytes:
    """A newcomer: waits for its admission record (bounded).

    Args:
        store: the job's store.
        rank: the newcomer's original rank.
        timeout_s: how long to wait.
        poll_s: pause between two reads.
        check: called between reads (e.g. raises when the store is lost).

    Raises:
        AdmissionError: no record within ``timeout_s``.
    """
    key = admission_key(rank)
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise AdmissionError(
                f"rank {rank} registered to join the running job but no member admitted it within {timeout_s:.0f} s "
                "(the members admit newcomers at a training step's commit: is the job still training, with fail_stop "
                "on the layer-wise engine?)"
            )
        time.sleep(poll_s)
    return store.get(key)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
