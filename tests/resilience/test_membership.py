"""``resilience.membership``: the survivors agree on the next generation's members, in one process
(each joiner a thread with its own client of a real TCPStore)."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from resihp_lightning.resilience.failures import EvictedError, RegroupError
from resihp_lightning.resilience.membership import agree_members, read_failures
from resihp_lightning.testing.stores import tcp_store_client, tcp_store_server


def _agree(store_server, me, candidates, failed, results, **kwargs):
    import torch.distributed as dist

    store = dist.PrefixStore("job", tcp_store_client(store_server))
    known = failed.get(me, set()) if isinstance(failed, dict) else failed
    try:
        results[me] = agree_members(store, me=me, candidates=candidates, failed=lambda: {r: "exited" for r in known},
                                    **kwargs)
    except Exception as err:  # noqa: BLE001 - checked by the test
        results[me] = err


def _run_agreement(joiners, candidates, failed, generation=1, join_timeout_s=5.0, timeout_s=10.0, delays=None):
    server = tcp_store_server()
    results: dict[int, object] = {}
    threads = []
    for me in joiners:
        def target(me=me):
            time.sleep((delays or {}).get(me, 0.0))
            _agree(server, me, candidates, failed, results, generation=generation,
                   join_timeout_s=join_timeout_s, timeout_s=timeout_s)
        threads.append(threading.Thread(target=target))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 5)
    return results, server


def test_survivors_agree_without_the_failed_ranks():
    started = time.monotonic()
    results, _ = _run_agreement([0, 1, 3], [0, 1, 2, 3], failed={2})
    assert results == {0: [0, 1, 3], 1: [0, 1, 3], 3: [0, 1, 3]}
    assert time.monotonic() - started < 2.0  # nobody waited for the join timeout


def test_a_failure_only_one_survivor_knows_is_shared_so_nobody_waits_for_the_join_timeout():
    # Rank 3 watches rank 2's pid (one machine); ranks 0 and 1 run elsewhere and know nothing.
    started = time.monotonic()
    results, server = _run_agreement([0, 1, 3], [0, 1, 2, 3], failed={3: {2}}, join_timeout_s=5.0)
    assert results == {0: [0, 1, 3], 1: [0, 1, 3], 3: [0, 1, 3]}
    assert time.monotonic() - started < 2.0
    store = dist.PrefixStore("job", tcp_store_client(server))
    assert read_failures(store, 1) == {2: "exited (reported by rank 3)"}


def test_a_dead_leader_known_to_one_survivor_hands_the_lead_on_at_once():
    started = time.monotonic()
    results, _ = _run_agreement([1, 2], [0, 1, 2], failed={2: {0}}, join_timeout_s=5.0)
    assert results == {1: [1, 2], 2: [1, 2]}
    assert time.monotonic() - started < 2.0


def test_simultaneous_failures_are_all_left_out():
    results, _ = _run_agreement([1, 3], [0, 1, 2, 3], failed={0, 2})
    assert results == {1: [1, 3], 3: [1, 3]}


def test_next_rank_leads_when_rank_zero_failed():
    results, _ = _run_agreement([1, 2, 3], [0, 1, 2, 3], failed={0})
    assert results == {1: [1, 2, 3], 2: [1, 2, 3], 3: [1, 2, 3]}


def test_a_rank_that_never_comes_is_left_out_after_the_join_timeout():
    started = time.monotonic()
    results, _ = _run_agreement([0, 1], [0, 1, 2], failed=set(), join_timeout_s=0.5)
    assert results == {0: [0, 1], 1: [0, 1]}
    assert 0.4 < time.monotonic() - started < 3.0


def test_a_late_rank_learns_it_was_left_out():
    results, _ = _run_agreement([0, 1, 2], [0, 1, 2], failed={2}, delays={2: 0.5})
    assert results[0] == results[1] == [0, 1]
    assert isinstance(results[2], EvictedError) and results[2].members == [0, 1]


def test_no_agreement_times_out_instead_of_hanging():
    # The only candidate that could lead (0) never comes and nobody knows it failed.
    results, _ = _run_agreement([1], [0, 1], failed=set(), timeout_s=0.5)
    assert isinstance(results[1], RegroupError)
