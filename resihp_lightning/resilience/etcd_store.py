"""The fail-stop store on an etcd cluster: a ``torch.distributed.Store`` that no single machine takes down.

The default store host (:mod:`.store_host`) is one process on one machine: when that machine is lost,
so is every way for the survivors to agree. With ``fail_stop.store = {"backend": "etcd", ...}`` the
job's keys live in an etcd cluster instead (three or five members, one per machine, started by the
launch recipe: see ``docs/machines.md``). etcd replicates every write to a majority before it
answers (Raft), so the store keeps working while a majority of its members live, machine 0's
included, and the survivors' agreement (abort markers, membership votes) stays linearizable.

:class:`EtcdStore` is a Python subclass of ``torch.distributed.Store``: the world uses it exactly
like the TCP store (``PrefixStore`` over it, ``init_process_group(store=...)`` for gloo's
rendezvous, the detector's beats, ``compare_set`` votes, ``append``), through :class:`.EtcdGateway`.
How each operation maps onto etcd:

* ``set``: one ``put``;
* ``get``, ``wait``: a linearizable ``range``, polled (2 ms doubling to ``poll_s``) until the keys
  exist or the store's timeout passes (then ``DistStoreError``, like TCPStore);
* ``check``: one transaction of ``range`` (count only) per key; ``multi_get``/``multi_set``: one
  transaction;
* ``compare_set``: one transaction: put if the key is absent (expected ``""``) or holds the expected
  value, else return what it holds (TCPStore's semantics);
* ``add``, ``append``: a read, then a transaction that writes only if the key's ``mod_revision`` is
  unchanged; retried on a conflict.

**When etcd loses its quorum** (a majority of members dead or unreachable), no member answers a
write or a linearizable read: every operation raises :class:`~.failures.StoreUnavailable` after
``op_timeout_s`` (it never hangs). The job then behaves as with a lost store host: training goes on
while no one fails (gloo needs no store once its groups exist), the detector reports the store lost
after its grace period, and the next failure ends the job with ``fail_stop.exit_code`` (a restart).
A lost minority costs nothing but the operations in flight on the lost members, retried on the
others (plus one leader election, about ``--election-timeout``, if the leader was lost). An operation
that raised ``StoreUnavailable`` may still take effect when the quorum returns (a member had
accepted it before the deadline): like any lost answer, its outcome is unknown to the writer.

**Non-idempotent retries.** A ``put`` or ``compare_set`` retried after a lost answer is harmless. An
``add`` or ``append`` whose answer was lost (the member died after applying it) may be applied twice:
``append`` is used for sets (the regroup's join list), where a repeat is harmless; ``add`` counts
registrations and a planned reshape's quiescence, where it could make a count one too high.

**Authentication** (``user`` and ``password_file``): etcd's role-based access (``auth enable``, one
user per job with read-write on the job's key prefix; ``python -m
resihp_lightning.resilience.etcd_admin`` sets it up). A process without the password, or with
another user's, is refused (:class:`.StoreAccessDenied`). Over ``http://`` endpoints the password and
the token cross the network in clear text: on a network you do not trust, use ``https://`` endpoints
with ``ca_file`` (and, for members started with ``--client-cert-auth``, ``cert_file``/``key_file``).

The job's keys are not deleted at the end (etcd keeps them): a cluster started per job (the recipe)
goes with its data directory; on a shared cluster, remove ``resihp/<run id>/`` afterwards
(``etcdctl del --prefix resihp/<run id>/``).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable
from typing import Any

from resihp_lightning.resilience.etcd_config import EtcdConfig, prefix_end
from resihp_lightning.resilience.etcd_gateway import EtcdGateway, b64, unb64

try:  # torch is a dependency, but the config must import without it (docs, CLI parsing)
    from torch.distributed import DistStoreError as _DistStoreError
    from torch.distributed import Store as _Store
except ImportError:  # pragma: no cover - torch without distributed
    _Store = object  # type: ignore[assignment,misc]
    _DistStoreError = TimeoutError  # type: ignore[assignment,misc]


class EtcdStore(_Store):  # type: ignore[misc,valid-type]
    """A ``torch.distributed.Store`` whose keys live in etcd under ``root``.

    One instance is one connection: share it between threads only behind a lock
    (:class:`~.store.LockedStore`).

    Args:
        config: the cluster and the credentials.
        root: prefix of every key (the world's keys carry their own ``resihp/<run id>/`` prefix: ``""``).
        timeout: how long ``get``/``wait`` wait for a key (the store's timeout, ``set_timeout``).
        password: the password (default: read from ``config.password_file``).
        start: index of the member to try first (default: this machine's own).
    """

    def __init__(
        self, config: EtcdConfig, *, root: str, timeout: datetime.timedelta, password: str | None = None,
        start: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.root = root.encode()
        self.set_timeout(timeout)
        self.gateway = EtcdGateway(
            config.endpoints,
            user=config.user,
            password=password if password is not None else config.password(),
            request_timeout_s=config.request_timeout_s,
            ca_file=config.ca_file,
            cert_file=config.cert_file,
            key_file=config.key_file,
            start=start,
        )

    def clone(self) -> EtcdStore:
        """Another connection to the same keys, first to the member this one reaches now (after a
        failover, not the lost member again)."""
        return EtcdStore(self.config, root=self.root.decode(), timeout=self.timeout, password=self.gateway._password,
                         start=self.gateway._index)

    def connect_now(self) -> EtcdStore:
        """Opens the connection (and authenticates) now rather than at the first operation."""
        self.gateway.connect(self._op_deadline())
        return self

    # --------------------------------------------------------------------------- helpers
    def _key(self, key: str) -> str:
        return b64(self.root + key.encode())

    def _op_deadline(self) -> float:
        return time.monotonic() + self.config.op_timeout_s

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.gateway.call(path, body, deadline=self._op_deadline())

    def _ranges(self, keys: list[str], count_only: bool = False) -> list[dict[str, Any] | None]:
        """The kv of each key (None where absent), read in one transaction."""
        ops = [{"request_range": {"key": self._key(k), **({"count_only": True} if count_only else {})}} for k in keys]
        answer = self._call("/v3/kv/txn", {"success": ops})
        found: list[dict[str, Any] | None] = []
        for response in answer.get("responses", []):
            rng = response.get("response_range", {})
            if count_only:
                found.append({} if int(rng.get("count", 0)) else None)
            else:
                kvs = rng.get("kvs") or []
                found.append(kvs[0] if kvs else None)
        return found

    def _read(self, key: str) -> dict[str, Any] | None:
        answer = self._call("/v3/kv/range", {"key": self._key(key)})
        kvs = answer.get("kvs") or []
        return kvs[0] if kvs else None

    def _wait_for(self, keys: list[str], timeout: datetime.timedelta | None = None) -> list[bytes]:
        """The values of ``keys`` once they all exist; ``DistStoreError`` after the timeout."""
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        pause = 0.002
        while True:
            found = self._ranges(keys)
            if all(kv is not None for kv in found):
                return [unb64(kv.get("value")) for kv in found]  # type: ignore[union-attr]
            if time.monotonic() + pause > deadline:
                missing = [k for k, kv in zip(keys, found) if kv is None]
                raise _DistStoreError(f"etcd store: wait timeout after {limit * 1000:.0f}ms, keys: {missing}")
            time.sleep(pause)
            pause = min(pause * 2, self.config.poll_s)

    def _swap(self, key: str, update: Any) -> bytes:
        """Writes ``update(current value or None)`` if the key did not change meanwhile; retried."""
        while True:
            kv = self._read(key)
            new = update(unb64(kv.get("value")) if kv is not None else None)
            if kv is None:
                compare = {"key": self._key(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
            else:
                compare = {"key": self._key(key), "result": "EQUAL", "target": "MOD", "mod_revision": kv["mod_revision"]}
            answer = self._call("/v3/kv/txn", {
                "compare": [compare], "success": [{"request_put": {"key": self._key(key), "value": b64(new)}}],
            })
            if answer.get("succeeded"):
                return new

    # ----------------------------------------------------------------------- Store API
    def set(self, key: str, value: str | bytes) -> None:
        self._call("/v3/kv/put", {"key": self._key(key), "value": b64(_bytes(value))})

    def get(self, key: str) -> bytes:
        return self._wait_for([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_for(list(keys)) if keys else []

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        ops = [{"request_put": {"key": self._key(k), "value": b64(_bytes(v))}} for k, v in zip(keys, values)]
        if ops:
            self._call("/v3/kv/txn", {"success": ops})

    def check(self, keys: list[str]) -> bool:
        return all(kv is not None for kv in self._ranges(list(keys), count_only=True)) if keys else True

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if keys:
            self._wait_for(list(keys), timeout)

    def add(self, key: str, amount: int) -> int:
        if amount == 0:
            kv = self._read(key)
            return int(unb64(kv.get("value"))) if kv is not None else 0
        return int(self._swap(key, lambda old: str(int(old or b"0") + amount).encode()))

    def append(self, key: str, value: str | bytes) -> None:
        tail = _bytes(value)
        self._swap(key, lambda old: (old or b"") + tail)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        expected_b, desired_b = _bytes(expected), _bytes(desired)
        k = self._key(key)
        put = [{"request_put": {"key": k, "value": b64(desired_b)}}]
        if expected_b:
            compare = {"key": k, "result": "EQUAL", "target": "VALUE", "value": b64(expected_b)}
        else:
            compare = {"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        answer = self._call("/v3/kv/txn", {"compare": [compare], "success": put, "failure": [{"request_range": {"key": k}}]})
        if answer.get("succeeded"):
            return desired_b
        kvs = (answer.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        if not kvs:
            return expected_b  # absent and a non-empty value expected: TCPStore answers ``expected``
        current = unb64(kvs[0].get("value"))
        if not expected_b and current == b"":  # present but empty equals the empty expectation
            return self._set_if_empty(key, desired_b)
        return current

    def _set_if_empty(self, key: str, desired: bytes) -> bytes:
        k = self._key(key)
        answer = self._call("/v3/kv/txn", {
            "compare": [{"key": k, "result": "EQUAL", "target": "VALUE", "value": ""}],
            "success": [{"request_put": {"key": k, "value": b64(desired)}}],
            "failure": [{"request_range": {"key": k}}],
        })
        if answer.get("succeeded"):
            return desired
        kvs = (answer.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        return unb64(kvs[0].get("value")) if kvs else b""

    def delete_key(self, key: str) -> bool:
        answer = self._call("/v3/kv/deleterange", {"key": self._key(key)})
        return int(answer.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        answer = self._call("/v3/kv/range", {"key": b64(self.root), "range_end": b64(prefix_end(self.root)),
                                             "count_only": True})
        return int(answer.get("count", 0))

    # torch's C++ side calls these two by their C++ names.
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    def delete_all(self) -> int:
        """Deletes every key under ``root`` (a finished job's); how many there were."""
        answer = self._call("/v3/kv/deleterange", {"key": b64(self.root), "range_end": b64(prefix_end(self.root))})
        return int(answer.get("deleted", 0))


def _bytes(value: str | bytes | Iterable[int]) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
