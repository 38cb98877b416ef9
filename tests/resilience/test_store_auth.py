"""``resilience.store_auth``: only the job writes its TCP store (values signed with a per-job secret),
and the store host listens on the job's address only."""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from pathlib import Path

import pytest

from resihp_lightning.resilience.procs import ProcessIdentity


def _signed(secret: bytes = b"s" * 32, timeout_s: float = 1.0):
    from resihp_lightning.resilience.store_auth import SignedStore
    from resihp_lightning.testing.stores import tcp_store_client, tcp_store_server

    server = tcp_store_server(timeout_s)
    rejected: list[str] = []
    return server, SignedStore(tcp_store_client(server, timeout_s), secret, on_rejected=rejected.append), rejected


def test_signed_values_read_back_and_a_strangers_values_count_as_absent():
    import torch.distributed as dist

    stranger, store, rejected = _signed()
    job = dist.PrefixStore("resihp/run/a0", store)
    job.set("hb/0", "1:1:0:0")
    assert job.get("hb/0") == b"1:1:0:0" and job.check(["hb/0"])
    assert job.compare_set("gen1/members", "", "[0,1]") == b"[0,1]"
    assert job.compare_set("gen1/members", "", "[1]") == b"[0,1]"
    job.append("gen1/joined", "0,")
    job.append("gen1/joined", "1,")
    assert job.add("count", 2) == 2 and job.add("count", 1) == 3 and job.add("count", 0) == 3

    # A stranger with the port but not the secret: an abort marker, a vote, a joiner, a counter.
    stranger.set("resihp/run/a0/gen0/abort", json.dumps({"by": 9, "reason": "forged"}))
    assert not job.check(["resihp/run/a0/gen0/abort".removeprefix("resihp/run/a0/")])
    assert job.compare_set("gen0/abort", "", "{}") == b"", "a forged marker is not a marker"
    stranger.append("resihp/run/a0/gen1/joined", "7,")
    job.append("gen1/joined", "2,")
    assert job.get("gen1/joined") == b"0,1,", "the records after a broken one are lost (denial of service), none forged"
    stranger.set("resihp/run/a0/count", "100")
    with pytest.raises(Exception, match="not signed"):
        job.add("count", 1)
    # A valid record copied under another key does not verify there.
    stranger.set("resihp/run/a0/hb/1", stranger.get("resihp/run/a0/hb/0"))
    assert not job.check(["hb/1"])
    with pytest.raises(dist.DistStoreError):
        job.get("hb/1")
    assert rejected == [f"resihp/run/a0/{k}" for k in ("gen0/abort", "gen1/joined", "count", "hb/1")]


def test_the_secret_file_must_be_this_users_alone(tmp_path: Path):
    from resihp_lightning.resilience.store_auth import SecretError, create_secret, read_secret

    path = tmp_path / "store.secret"
    secret = create_secret(path)
    assert len(secret) == 32 and create_secret(path) == secret and read_secret(path) == secret
    assert path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o644)
    with pytest.raises(SecretError, match="mode 0600"):
        read_secret(path)
    with pytest.raises(SecretError, match="cannot read"):
        read_secret(tmp_path / "missing")


def _other_local_address() -> str | None:
    """An address of this machine other than 127.0.0.1 (a stranger's way in), if any."""
    for candidate in ("127.0.0.2",):
        with socket.socket() as probe:
            try:
                probe.bind((candidate, 0))
                return candidate
            except OSError:
                continue
    return None


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_stranger_can_neither_reach_the_store_host_elsewhere_nor_abort_register_or_stop_it(tmp_path: Path):
    """One machine: the host listens on 127.0.0.1 only and counts only signed registrations, goodbyes
    and shutdown requests. A stranger who knows the port registers a live process (this test's own,
    which would keep the host alive forever), publishes an abort marker and asks for a shutdown: the
    job reads no marker, the host does not stop, and it ends after the job's one member left."""
    import torch.distributed as dist

    from resihp_lightning.resilience.store import RendezvousStore, StoreConfig, host_key, read_address

    config = StoreConfig(run_dir=str(tmp_path), run_id="signed", linger_s=0.3)
    member = RendezvousStore(config, rank=0).open()
    host, port = member.address
    assert host == "127.0.0.1"
    other = _other_local_address()
    if other is not None:
        with socket.socket() as probe:
            assert probe.connect_ex((other, port)) != 0, f"the store host answers on {other}"
    host_process = ProcessIdentity(**read_address(tmp_path)["identity"])
    deadline = time.monotonic() + 10
    while not member._raw.check([host_key("members")]):  # the host has read the registration
        assert time.monotonic() < deadline, "the store host never read the registration"
        time.sleep(0.05)

    stranger = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=2), wait_for_workers=False)
    # The member counter is signed (the stranger's add cannot even parse it): overwrite it instead.
    stranger.set(host_key("count"), "3")
    for index in (1, 2):
        stranger.set(host_key(f"member/{index}"), json.dumps({
            "rank": 90 + index, "identity": json.loads(ProcessIdentity.current().to_json()), "beat_key": "x"}))
    stranger.set(f"{member.namespace}/gen0/abort", json.dumps({"by": 99, "reason": "forged", "failed": {"0": "x"}}))
    stranger.set(host_key("shutdown"), "1")
    time.sleep(0.8)  # four host polls
    assert host_process.alive(), "a forged shutdown stopped the store host"
    assert not member.control.check(["gen0/abort"]), "a forged abort marker was read"
    member.control.set("still", "works")
    assert member.control.get("still") == b"works"

    member.close()
    deadline = time.monotonic() + 20  # a forged registration would keep it for ever; exiting can be slow under load
    while host_process.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not host_process.alive(), "a forged registration kept the store host alive"
    assert os.stat(tmp_path / "store.secret").st_mode & 0o077 == 0


def test_racing_adds_and_votes_on_the_signed_store_lose_nothing():
    """Two adds that compute the same new count must not both succeed (each record's nonce makes the
    bytes unique); this is the step-commit vote of every optimizer step."""
    import threading

    from resihp_lightning.resilience.store_auth import SignedStore
    from resihp_lightning.testing.stores import tcp_store_client

    server, first, _ = _signed(timeout_s=10.0)
    stores = [first] + [SignedStore(tcp_store_client(server, 10.0), b"s" * 32) for _ in range(3)]
    results: list[list[int]] = [[] for _ in stores]
    winners: list[bytes] = []

    def work(i: int) -> None:
        for _ in range(25):
            results[i].append(stores[i].add("votes", 1))
        winners.append(stores[i].compare_set("decision", "", f"rank {i}"))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(n for r in results for n in r) == list(range(1, 101)), "every add got its own count"
    assert len(set(winners)) == 1 and winners[0].startswith(b"rank ")
    assert first.compare_set("decision", winners[0], "swapped") == b"swapped"
    assert first.compare_set("decision", winners[0], "again") == b"swapped", "a stale expectation swaps nothing"
