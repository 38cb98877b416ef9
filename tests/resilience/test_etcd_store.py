"""``resilience.etcd_store``: the fail-stop store on a 3-member etcd cluster started here (127.0.0.11-13).

The world's store operations must answer as torch's TCPStore answers (it is the reference here); the
cluster must keep serving with one member killed (the first endpoint, "machine 0"), say
``StoreUnavailable`` within ``op_timeout_s`` with two killed (no quorum), and refuse a process without
the job's password. Skipped where etcd is not installed.
"""

from __future__ import annotations

import datetime
import threading
import time
from pathlib import Path

import pytest

from resihp_lightning.testing.etcd_cluster import LocalEtcdCluster, etcd_unavailable_reason

pytestmark = pytest.mark.skipif(etcd_unavailable_reason() is not None, reason=str(etcd_unavailable_reason()))


def _etcd(cluster: LocalEtcdCluster, timeout_s: float = 2.0, **options):
    from resihp_lightning.resilience.etcd_config import EtcdConfig
    from resihp_lightning.resilience.etcd_store import EtcdStore

    config = EtcdConfig(endpoints=cluster.endpoints, **options)
    return EtcdStore(config, root=f"resihp/t{time.monotonic_ns()}/", timeout=datetime.timedelta(seconds=timeout_s))


def _script(store) -> list:
    """Every store operation the world uses, with the answers (or the error type) they give."""
    import torch.distributed as dist

    view = dist.PrefixStore("resihp/run/a0", store)  # as the world sees it
    out: list = []

    def record(name, action):
        try:
            out.append((name, action()))
        except Exception as err:  # noqa: BLE001 - the error type is part of the answer
            out.append((name, type(err).__name__))

    record("set", lambda: view.set("hb/0", "1:2:0:0"))
    record("get", lambda: view.get("hb/0"))
    record("check present", lambda: view.check(["hb/0"]))
    record("check absent", lambda: view.check(["hb/0", "hb/9"]))
    record("add new", lambda: view.add("count", 1))
    record("add again", lambda: view.add("count", 5))
    record("add zero", lambda: view.add("count", 0))
    record("append new", lambda: view.append("gen1/joined", "0,"))
    record("append more", lambda: view.append("gen1/joined", "3,"))
    record("appended", lambda: view.get("gen1/joined"))
    record("vote first", lambda: view.compare_set("gen1/members", "", "[0,3]"))
    record("vote late", lambda: view.compare_set("gen1/members", "", "[0]"))
    record("swap matching", lambda: view.compare_set("gen1/members", "[0,3]", "[3]"))
    record("swap stale", lambda: view.compare_set("gen1/members", "[0,3]", "[9]"))
    record("swap absent", lambda: view.compare_set("gen9/abort", "x", "y"))
    record("abort absent", lambda: view.check(["gen9/abort"]))
    record("multi_set", lambda: view.multi_set(["proc/0", "proc/1"], ["a", "b"]))
    record("multi_get", lambda: view.multi_get(["proc/0", "proc/1", "hb/0"]))
    record("delete", lambda: view.delete_key("proc/1"))
    record("delete absent", lambda: view.delete_key("proc/1"))
    record("after delete", lambda: view.check(["proc/1"]))
    record("wait present", lambda: view.wait(["proc/0"]))
    store.set_timeout(datetime.timedelta(seconds=0.3))
    record("get absent", lambda: view.get("never"))
    record("wait absent", lambda: view.wait(["never"], datetime.timedelta(seconds=0.3)))
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalEtcdCluster(tmp_path_factory.mktemp("etcd")) as running:
        yield running


def test_the_worlds_store_operations_answer_on_etcd_as_on_the_tcp_store(cluster):
    from resihp_lightning.testing.stores import tcp_store_server

    tcp = tcp_store_server(timeout_s=2.0)
    expected = _script(tcp)
    assert ("get absent", "DistStoreError") in expected  # the reference says what a timeout is
    assert _script(_etcd(cluster)) == expected


def test_a_wait_returns_when_another_connection_writes_the_key(cluster):
    first, second = _etcd(cluster, timeout_s=5.0), None
    second = first.clone()
    threading.Timer(0.3, lambda: second.set("late", "here")).start()
    started = time.monotonic()
    assert first.get("late") == b"here"
    assert 0.25 < time.monotonic() - started < 3.0


def test_concurrent_adds_and_votes_from_many_connections_are_atomic(cluster):
    base = _etcd(cluster)
    stores = [base.clone() for _ in range(4)]
    results: list[list[int]] = [[] for _ in stores]
    winners: list[bytes] = []

    def work(i: int) -> None:
        for _ in range(10):
            results[i].append(stores[i].add("counter", 1))
        winners.append(stores[i].compare_set("vote", "", f"rank {i}"))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(n for r in results for n in r) == list(range(1, 41)), "every add got its own value"
    assert len(set(winners)) == 1 and winners[0].startswith(b"rank "), "every voter saw the one winner"


def test_auth_refuses_a_stranger_and_admits_the_job(tmp_path: Path):
    """Auth on: without the password, with a wrong one, or outside the job's prefix, every call is refused."""
    from resihp_lightning.resilience.etcd_admin import new_password_file, setup_job_user
    from resihp_lightning.resilience.etcd_config import EtcdConfig
    from resihp_lightning.resilience.etcd_gateway import StoreAccessDenied
    from resihp_lightning.resilience.store import RendezvousStore, StoreConfig

    with LocalEtcdCluster(tmp_path / "etcd", first=21) as cluster:
        password = new_password_file(tmp_path / "job.pw")
        setup_job_user(cluster.endpoints, user="job", password=password, root_password="root-secret")
        assert (tmp_path / "job.pw").stat().st_mode & 0o077 == 0

        job = StoreConfig(run_id="authjob", etcd=EtcdConfig(
            endpoints=cluster.endpoints, user="job", password_file=str(tmp_path / "job.pw")))
        member = RendezvousStore(job, rank=0).open()
        member.control.set("gen0/abort", "")
        assert member.control.check(["gen0/abort"])

        (tmp_path / "wrong.pw").write_text("guess\n")
        strangers = {
            "no credentials": StoreConfig(run_id="authjob", etcd=EtcdConfig(endpoints=cluster.endpoints)),
            "wrong password": StoreConfig(run_id="authjob", etcd=EtcdConfig(
                endpoints=cluster.endpoints, user="job", password_file=str(tmp_path / "wrong.pw"))),
        }
        for what, config in strangers.items():
            started = time.monotonic()
            with pytest.raises(StoreAccessDenied):
                RendezvousStore(config, rank=7).open()
            assert time.monotonic() - started < 2.0, f"{what}: refused at once, not retried until a timeout"
        anonymous = _etcd(cluster)
        for action in (lambda: anonymous.set("resihp/authjob/a0/gen1/abort", "{}"),
                       lambda: anonymous.check(["resihp/authjob/a0/gen0/abort"]),
                       lambda: anonymous.compare_set("resihp/authjob/a0/gen1/members", "", "[7]")):
            with pytest.raises(StoreAccessDenied):
                action()
        outside = _etcd(cluster, user="job", password_file=str(tmp_path / "job.pw"))
        outside.root = b"elsewhere/"
        with pytest.raises(StoreAccessDenied, match="permission denied"):
            outside.set("x", "1")
        member.close()


@pytest.mark.timeout(120)
def test_one_member_lost_costs_nothing_two_lost_say_unavailable_within_the_op_timeout(tmp_path: Path):
    """Member 0 ("machine 0", the first endpoint every client tries) is killed: the others have quorum.
    A second one killed: no quorum, and every operation raises StoreUnavailable after op_timeout_s
    instead of waiting; a member back restores the quorum and the keys (a write that timed out may
    have been applied after all)."""
    from resihp_lightning.resilience.failures import StoreUnavailable

    with LocalEtcdCluster(tmp_path / "etcd", first=31) as cluster:
        store = _etcd(cluster, timeout_s=5.0, op_timeout_s=5.0, request_timeout_s=1.0)
        store.set("hb/0", "1")
        assert store.compare_set("gen0/abort", "", "first") == b"first"

        cluster.kill(0)
        started = time.monotonic()
        store.set("hb/0", "2")
        failover_s = time.monotonic() - started
        assert store.get("hb/0") == b"2"
        assert store.compare_set("gen1/abort", "", "second") == b"second"
        assert store.add("count", 1) == 1
        assert failover_s < 5.0, "one lost member is survived within one operation (an election included)"

        cluster.kill(1)
        hasty = _etcd(cluster, timeout_s=5.0, op_timeout_s=1.5, request_timeout_s=0.5)
        hasty.root = store.root
        for name, action in (("set", lambda: hasty.set("hb/0", "3")), ("get", lambda: hasty.get("hb/0")),
                             ("compare_set", lambda: hasty.compare_set("gen2/abort", "", "x")),
                             ("wait", lambda: hasty.wait(["gen9/abort"]))):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="no etcd member"):
                action()
            took = time.monotonic() - started
            assert 1.2 < took < 4.0, f"{name} without quorum gave up after {took:.1f} s, not op_timeout_s (1.5 s)"

        cluster.start_member(1)
        deadline = time.monotonic() + 30
        while True:
            try:
                beat = store.get("hb/0")
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "the quorum did not come back"
        # A write that timed out without quorum may still be applied once the quorum is back (the
        # member had accepted it): its outcome is unknown to the writer, as with any lost answer.
        assert beat in (b"2", b"3")
        assert store.compare_set("gen1/abort", "", "late") == b"second", "nothing committed was lost"


def test_tls_with_client_certificates_admits_the_jobs_certificate_only(tmp_path: Path):
    """Members started with --client-cert-auth: the job's certificate (signed by the job's CA) is let in;
    a client without one, or one that does not trust the members' CA, is refused at once."""
    import shutil

    from resihp_lightning.resilience.etcd_gateway import StoreAccessDenied
    from resihp_lightning.testing.etcd_cluster import make_certificates

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    tls = make_certificates(tmp_path / "pki", ["127.0.0.71"])
    with LocalEtcdCluster(tmp_path / "etcd", members=1, first=71, tls=tls) as cluster:
        assert cluster.endpoints[0].startswith("https://")
        job = _etcd(cluster, ca_file=tls["ca"], cert_file=tls["client_cert"], key_file=tls["client_key"])
        job.set("gen0/abort", "x")
        assert job.get("gen0/abort") == b"x"
        for what, options in (("no client certificate", {"ca_file": tls["ca"]}),
                              ("members' CA not trusted", {"cert_file": tls["client_cert"], "key_file": tls["client_key"]})):
            started = time.monotonic()
            with pytest.raises(StoreAccessDenied, match="TLS"):
                _etcd(cluster, op_timeout_s=5.0, **options).set("gen0/abort", "forged")
            assert time.monotonic() - started < 2.0, what
        assert job.get("gen0/abort") == b"x"
