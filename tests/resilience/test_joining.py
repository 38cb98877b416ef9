"""``resilience.joining``: a newcomer's rank, registration and admission wait, over a real TCPStore in one process."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from resihp_lightning.resilience.failures import AdmissionError
from resihp_lightning.resilience.joining import (
    announce_ready,
    claim_rank,
    publish_start_size,
    read_info,
    ready_count,
    ready_ranks,
    wait_admission,
    write_admission,
)
from resihp_lightning.testing.stores import tcp_store_client, tcp_store_server


def _job_store(server):
    return dist.PrefixStore("job", tcp_store_client(server))


def test_newcomers_get_ranks_above_every_rank_of_the_job_and_none_twice():
    server = tcp_store_server()
    store = _job_store(server)
    publish_start_size(store, 4)
    publish_start_size(_job_store(server), 7)  # a later process's write does not change the start
    claimed: list[int] = []
    lock = threading.Lock()

    def claim() -> None:
        rank = claim_rank(_job_store(server), timeout_s=5)
        with lock:
            claimed.append(rank)

    threads = [threading.Thread(target=claim) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(claimed) == [4, 5, 6, 7, 8, 9]
    assert claim_rank(store, timeout_s=5) == 10  # a dead newcomer's number is never handed out again


def test_without_a_running_job_a_newcomer_fails_clearly_and_in_time():
    server = tcp_store_server()  # held: the store lives as long as its server object
    store = _job_store(server)
    started = time.monotonic()
    with pytest.raises(AdmissionError, match="no running job found"):
        claim_rank(store, timeout_s=0.3, poll_s=0.02)
    assert time.monotonic() - started < 2


def test_the_ready_list_is_read_in_registration_order_and_the_count_never_runs_ahead_of_it():
    server = tcp_store_server()
    store = _job_store(server)
    assert ready_count(store) == 0 and ready_ranks(store, 0, 3) == []
    announce_ready(store, 5, {"memory_mb": 1024.0})
    announce_ready(_job_store(server), 4, {"memory_mb": None})
    assert ready_count(store) == 2
    assert ready_ranks(store, 0, 2) == [5, 4] and ready_ranks(store, 1, 2) == [4] and ready_ranks(store, 2, 2) == []
    assert read_info(store, 5) == {"memory_mb": 1024.0} and read_info(store, 6) == {}


def test_a_newcomer_waits_for_its_admission_record_and_is_told_when_none_comes():
    server = tcp_store_server()
    store = _job_store(server)
    threading.Timer(0.2, lambda: write_admission(_job_store(server), 4, b"record")).start()
    assert wait_admission(store, 4, timeout_s=5, poll_s=0.01) == b"record"
    started = time.monotonic()
    with pytest.raises(AdmissionError, match="no member admitted it within"):
        wait_admission(store, 5, timeout_s=0.3, poll_s=0.01)
    assert time.monotonic() - started < 2
    with pytest.raises(RuntimeError, match="store lost"):
        wait_admission(store, 5, timeout_s=5, poll_s=0.01, check=_raise("store lost"))


def _raise(message: str):
    def check() -> None:
        raise RuntimeError(message)

    return check
