"""How the survivors of generation g-1 agree on the members of generation g, through the store.

Protocol (all keys under the job namespace, ``gen<g>/``):

1. every survivor appends its original rank to ``gen<g>/joined`` (one ``append``: the joiners'
   list is a single key to read, however many there are);
2. the *leader* is the lowest candidate (member of g-1) that this process does not know to have
   failed. It waits until every candidate has either joined or failed (failures come from the live
   detector, so a death *during* the regroup is taken into account as it happens), or until
   ``join_timeout_s`` has passed (a rank alive but never coming, e.g. stuck in a long compute), and
   then proposes the joined ranks that have not failed, sorted, with
   ``compare_set(gen<g>/members, "", proposal)``. The leader itself may be such a rank: once
   ``join_timeout_s`` has passed without it joining, the lowest candidate that joined proposes in its
   place (so a live but stuck leader is left out like any late candidate, instead of holding every
   survivor until ``timeout_s``);
3. everyone polls ``gen<g>/members``; the first proposal written wins and is final.

Failures one survivor knows are shared with the others while they wait: each appends the candidates
it knows to have failed, with the reason, to ``gen<g>/failed``, and everyone counts the ranks named
there as failed too. Across machines a death is often known to only some survivors: a process's pid is
watched by its own machine's processes, and a survivor whose collective broke at the death (a
connection reset) starts the regroup before the neighbour that sees the exit has aborted the
generation with the dead rank's name. Without the shared record the leader would wait
``join_timeout_s`` for a candidate that its neighbours know to be dead. A verdict, as everywhere in
detection, is final: a rank named failed by any survivor is left out.

Why this is safe without a consensus library: the member list is written once, atomically, by
``compare_set``; every process reads the same value. Processes may disagree on who the leader is
(their detectors are not in lockstep) -- then two of them propose and one proposal wins. If the
leader dies before proposing, the others' detectors name it failed and the next candidate becomes
leader. A process that is not in the list learns it from the list itself
(:class:`~.failures.EvictedError`); a process that joins after the list was written reads it and
learns the same. A rank that died after joining but before the list was read ends up in the list;
the new generation's initialisation then fails (or is aborted) and the survivors agree again on
generation g+1, so that case costs one more round, not a hang. Every wait is bounded by
``timeout_s``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from resihp_lightning._logging import get_logger
from resihp_lightning.resilience.failures import EvictedError, RegroupError

log = get_logger(__name__)


def members_key(generation: int) -> str:
    return f"gen{generation}/members"


def joined_key(generation: int) -> str:
    return f"gen{generation}/joined"


def read_joined(store: Any, generation: int) -> set[int]:
    """The original ranks that joined ``generation`` so far."""
    key = joined_key(generation)
    if not store.check([key]):
        return set()
    return {int(r) for r in store.get(key).decode().split(",") if r}


def failed_key(generation: int) -> str:
    return f"gen{generation}/failed"


def read_failures(store: Any, generation: int) -> dict[int, str]:
    """Original rank -> ``"<reason> (reported by rank <r>)"`` for the failures survivors of ``generation``
    shared so far (the first report of each rank)."""
    key = failed_key(generation)
    if not store.check([key]):
        return {}
    failures: dict[int, str] = {}
    for line in filter(None, store.get(key).decode().split("\n")):
        entry = json.loads(line)
        failures.setdefault(int(entry["rank"]), f"{entry['why']} (reported by rank {entry['by']})")
    return failures


def share_failures(store: Any, generation: int, me: int, failures: Mapping[int, str]) -> None:
    """Appends ``failures`` (original rank -> reason) as known to ``me`` to ``generation``'s record."""
    if failures:
        store.append(failed_key(generation), "".join(
            json.dumps({"rank": rank, "by": me, "why": why}) + "\n" for rank, why in sorted(failures.items())
        ))


def agree_members(
    store: Any,
    *,
    generation: int,
    me: int,
    candidates: Sequence[int],
    failed: Callable[[], Mapping[int, str]],
    join_timeout_s: float,
    timeout_s: float,
    poll_s: float = 0.01,
) -> list[int]:
    """Joins ``generation`` and returns its agreed member list (original ranks, sorted).

    Args:
        store: the job-namespaced store (the caller's own connection).
        generation: the generation being formed.
        me: this process's original rank.
        candidates: the members of the previous generation.
        failed: returns the original ranks this process currently knows to have failed, with the
            reasons (shared with the other joiners, whose failures count here too).
        join_timeout_s: how long the leader waits for candidates that neither joined nor failed.
        timeout_s: how long this call may take in all.

    Raises:
        EvictedError: the agreed list does not contain ``me``.
        RegroupError: no list was agreed within ``timeout_s``.
    """
    started = time.monotonic()
    store.append(joined_key(generation), f"{me},")
    key = members_key(generation)
    proposed = False
    shared: set[int] = set()  # the failures this process has appended to the generation's record
    while True:
        if store.check([key]):
            members = json.loads(store.get(key))
            break
        now = time.monotonic()
        known = failed()
        news = {r: why for r, why in known.items() if r in candidates and r != me and r not in shared}
        share_failures(store, generation, me, news)
        shared.update(news)
        dead = set(known) | set(read_failures(store, generation))
        alive = [r for r in sorted(candidates) if r not in dead or r == me]
        late = now - started > join_timeout_s
        leader = alive[0] if alive else None
        if late and leader is not None and leader != me and not proposed:
            joined = read_joined(store, generation)
            if leader not in joined:  # alive but not coming: the lowest joined candidate stands in
                leader = next(r for r in alive if r in joined or r == me)
        if leader == me and not proposed:
            joined = read_joined(store, generation)
            waiting_for = [r for r in alive if r not in joined]
            if not waiting_for or late:
                proposal = sorted(r for r in joined if r not in dead or r == me)
                if waiting_for:
                    log.warning("generation %d: leader %d stops waiting for %s", generation, me, waiting_for)
                store.compare_set(key, "", json.dumps(proposal))
                proposed = True
                continue
        if now - started > timeout_s:
            raise RegroupError(
                f"rank {me}: no member list for generation {generation} within {timeout_s:.0f} s "
                f"(candidates {list(candidates)}, known failed {sorted(dead)})"
            )
        time.sleep(poll_s)
    if me not in members:
        raise EvictedError(me, generation, members)
    return members
