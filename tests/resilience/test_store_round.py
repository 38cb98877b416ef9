"""``resilience.store_round``: the workers of one torchrun launch agree on its round through the store.

Threads stand in for the workers of successive launches (each with its own store connection), started
in shuffled order with delays: every worker of one launch must get the same round, a new launch a new
one, also when a worker of the last launch never reached the store (its slot is a hole a new worker
could fall into) and when the new launch has another size.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from resihp_lightning.resilience.failures import StoreUnavailable


def _launch(server, world_size: int, *, ranks=None, delays=None, timeout_s: float = 10.0) -> dict[int, object]:
    import torch.distributed as dist

    from resihp_lightning.resilience.store_round import agree_round
    from resihp_lightning.testing.stores import tcp_store_client

    ranks = list(range(world_size)) if ranks is None else ranks
    delays = delays or {}
    results: dict[int, object] = {}

    def worker(rank: int) -> None:
        time.sleep(delays.get(rank, random.uniform(0, 0.1)))
        store = dist.PrefixStore("resihp/job/rounds", tcp_store_client(server, timeout_s))
        try:
            results[rank] = agree_round(store, rank=rank, world_size=world_size, timeout_s=timeout_s)
        except StoreUnavailable as err:
            results[rank] = err

    threads = [threading.Thread(target=worker, args=(r,)) for r in random.sample(ranks, len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s + 5)
    return results


def test_every_worker_of_a_launch_gets_its_round_holes_and_size_changes_included():
    from resihp_lightning.testing.stores import tcp_store_server

    random.seed(7)
    server = tcp_store_server(10.0)
    first = _launch(server, 4)
    assert len(set(first.values())) == 1, first
    # Next launch: 3 workers (a machine left), rank 0 last.
    second = _launch(server, 3, delays={0: 0.4})
    assert len(set(second.values())) == 1 and second[0] != first[0], second
    # A launch whose rank 1 never reaches the store: rank 0 gives up (no hang).
    started = time.monotonic()
    broken = _launch(server, 2, ranks=[0], timeout_s=1.0)
    assert isinstance(broken[0], StoreUnavailable) and time.monotonic() - started < 4
    # The launch after it: rank 1 comes first and finds the broken launch's free slot; it must still
    # end in the same round as its own rank 0.
    third = _launch(server, 2, delays={1: 0.0, 0: 0.5})
    assert len(set(third.values())) == 1 and third[0] not in (first[0], second[0]), third


@pytest.mark.parametrize("backend", ["tcp", "etcd"])
def test_a_torchrun_launch_uses_the_agreed_round_as_its_store_namespace(backend, tmp_path, monkeypatch):
    """Under torchrun the namespace is the agreed round, whatever each agent's restart count says (its
    value is not read: after a membership change the agents disagree on it), launch after launch."""
    import torch.distributed as dist  # noqa: F401 - the store's client

    from resihp_lightning.resilience.store import RendezvousStore, StoreConfig

    if backend == "etcd":
        from resihp_lightning.testing.etcd_cluster import LocalEtcdCluster, etcd_unavailable_reason

        if etcd_unavailable_reason():
            pytest.skip(etcd_unavailable_reason())
        from resihp_lightning.resilience.etcd_config import EtcdConfig

        cluster = LocalEtcdCluster(tmp_path / "etcd", members=1, first=61).start()
        config = StoreConfig(run_id="launch", etcd=EtcdConfig(endpoints=cluster.endpoints))
    else:
        cluster = None
        config = StoreConfig(run_dir=str(tmp_path), run_id="launch", linger_s=0.5)
    monkeypatch.setenv("WORLD_SIZE", "2")
    opened: dict[int, RendezvousStore] = {}
    errors: list[BaseException] = []

    def open_as(rank: int) -> None:
        try:
            opened[rank] = RendezvousStore(config, rank=rank).open()
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    try:
        for launch in range(2):
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
            threads = [threading.Thread(target=open_as, args=(r,)) for r in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert not errors, errors
            assert opened[0].namespace == opened[1].namespace == f"resihp/launch/a{launch}"
            opened[0].control.set("hello", str(launch))
            assert opened[1].control.get("hello") == str(launch).encode()
            for store in opened.values():
                store.close()
    finally:
        if cluster is not None:
            cluster.close()
