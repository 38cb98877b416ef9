"""Only the job writes its TCP store: every value signed with an HMAC keyed by a per-job secret.

torch's ``TCPStore`` has no authentication: any process that reaches its port can set any key. For
the fail-stop store that means a stranger could publish an abort marker (every rank regroups), vote
in a regroup, register as a member (the store host would then outlive the job), or ask the host to
shut down. :class:`SignedStore` wraps a store connection so that:

* every value written (``set``, ``multi_set``, ``compare_set``, ``append``, and the counters of
  ``add``) is a *record*: ``magic, length, nonce, HMAC-SHA256(secret, key NUL nonce value), value``,
  the MAC binding the value to its full key (a record copied to another key does not verify). The
  random nonce makes every write's bytes unique, so that a ``compare_set`` that returns what this
  process wrote really is this process's write (two racing ``add`` calls computing the same new count
  would otherwise both see "their" bytes and one increment would be lost);
* every value read is verified; a key whose value is unsigned or badly signed counts as *absent*
  (``check`` false, ``get``/``wait`` keep waiting for a valid value until the timeout) and each such
  value is reported once per key (a warning, and :attr:`SignedStore.rejected`);
* ``append`` adds one record; a read keeps the valid records of the sequence, in order;
* ``add`` is a ``compare_set`` loop over a signed decimal counter (TCPStore's own ``add`` counts on
  the server and could not be signed), and so is ``compare_set`` with a non-empty expected value
  (the stored record's bytes are compared, not recomputed).

The secret is 32 random bytes in a file that only the job's user can read (mode 0600, checked on
every open: a file another user owns or can read is refused). On one machine the first worker
creates it in the run directory, under the run directory's lock; the store host reads it too (it
verifies registrations, goodbyes and shutdown requests). Several machines share it only through an
explicit ``secret_file`` (e.g. on the cluster's shared file system).

What it does **not** stop, said plainly:

* *reading*: a stranger who reaches the port reads every key (gloo's addresses, beats, votes);
* *deleting or overwriting*: a stranger can delete or overwrite keys; the job then sees them absent
  and waits or times out (a denial of service, never a forged value);
* *replaying* a key's own earlier value (no sequence numbers): e.g. an old heartbeat written back;
* processes of the job's own user, which can read the secret file;
* gloo's own connections between ranks, which are not authenticated either (bind the job's
  interface and keep strangers off its network for that).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import stat
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resihp_lightning._logging import get_logger
from resihp_lightning.resilience.failures import StoreUnavailable

try:
    from torch.distributed import DistStoreError as _DistStoreError
    from torch.distributed import Store as _Store
except ImportError:  # pragma: no cover
    _Store = object  # type: ignore[assignment,misc]
    _DistStoreError = TimeoutError  # type: ignore[assignment,misc]

log = get_logger(__name__)

_MAGIC = b"\xa5S"
_HEADER = struct.Struct(">2sI8s32s")  # magic, value length, nonce, MAC
#: ``compare_set(key, _ABSENT, _ABSENT)`` reads a key without waiting for it: TCPStore answers the
#: expected value for a missing key and the current value otherwise, and changes nothing.
_ABSENT = b"\x00resihp:absent\x00"


class SecretError(StoreUnavailable):
    """The job's secret file is missing, unreadable, or readable by others."""


def create_secret(path: Path) -> bytes:
    """Creates ``path`` with 32 random bytes (mode 0600) unless it exists; returns the secret."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_secret(path)
    with os.fdopen(fd, "wb") as handle:
        handle.write(secrets.token_bytes(32))
    return read_secret(path)


def read_secret(path: Path) -> bytes:
    """The secret in ``path``, if only this user owns and can read it.

    Raises:
        SecretError: missing, owned by another user, readable or writable by group or others, or empty.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        raise SecretError(f"cannot read the store secret {path}: {err}") from err
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(
                f"the store secret {path} must belong to uid {os.getuid()} with mode 0600 "
                f"(owner {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o})"
            )
        secret = handle.read()
    if len(secret) < 16:
        raise SecretError(f"the store secret {path} holds {len(secret)} bytes (at least 16 needed)")
    return secret


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class SignedStore(_Store):  # type: ignore[misc,valid-type]
    """A store connection whose values are HMAC-signed records (see the module's docstring).

    Args:
        inner: the connection (a ``TCPStore`` client or server).
        secret: the job's secret.
        on_rejected: called with the key of each rejected value (default: a warning, once per key).
    """

    def __init__(self, inner: Any, secret: bytes, on_rejected: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self._secret = secret
        self.set_timeout(inner.timeout)
        #: Keys whose value was refused (unsigned or badly signed), in order of first refusal.
        self.rejected: list[str] = []
        self._on_rejected = on_rejected

    def clone_over(self, inner: Any) -> SignedStore:
        """The same signing over another connection."""
        return SignedStore(inner, self._secret, self._on_rejected)

    # ----------------------------------------------------------------------- records
    def _mac(self, key: str, nonce: bytes, value: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + nonce + value, hashlib.sha256).digest()

    def seal(self, key: str, value: Any) -> bytes:
        """``value`` as a signed record for ``key`` (with a fresh nonce: never the same bytes twice)."""
        value = _bytes(value)
        nonce = secrets.token_bytes(8)
        return _HEADER.pack(_MAGIC, len(value), nonce, self._mac(key, nonce, value)) + value

    def open_records(self, key: str, raw: bytes) -> bytes | None:
        """The verified value of ``raw`` (the concatenated values of its valid records), or None if none is valid."""
        out: list[bytes] = []
        offset, bad = 0, False
        while offset < len(raw):
            if len(raw) - offset < _HEADER.size:
                bad = True
                break
            magic, length, nonce, mac = _HEADER.unpack_from(raw, offset)
            value = raw[offset + _HEADER.size: offset + _HEADER.size + length]
            if magic != _MAGIC or len(value) != length:
                bad = True
                break  # framing lost: the rest cannot be parsed
            if hmac.compare_digest(mac, self._mac(key, nonce, value)):
                out.append(value)
            else:
                bad = True
            offset += _HEADER.size + length
        if bad:
            self._reject(key)
        if not out and (bad or not raw):
            return None if bad else b""
        return b"".join(out)

    def _reject(self, key: str) -> None:
        if key in self.rejected:
            return
        self.rejected.append(key)
        if self._on_rejected is not None:
            self._on_rejected(key)
        else:
            log.warning("store key %r holds a value not signed by this job: ignored (a stranger wrote it?)", key)

    # ----------------------------------------------------------------------- Store API
    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, self.seal(key, value))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.inner.multi_set(list(keys), [self.seal(k, v) for k, v in zip(keys, values)])

    def _peek(self, key: str) -> bytes | None:
        """The raw value of ``key``, or None if it is absent: one atomic request, no wait (a check
        followed by a get would wait out the whole timeout if the key went away in between)."""
        raw = self.inner.compare_set(key, _ABSENT, _ABSENT)
        return None if raw == _ABSENT else raw

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str], timeout: datetime.timedelta | None = None) -> list[bytes]:
        keys = list(keys)
        if not keys:
            return []
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        raws = self.inner.multi_get(keys)  # blocks until every key exists (the inner timeout)
        while True:
            values = [self.open_records(k, r) for k, r in zip(keys, raws)]
            if all(v is not None for v in values):
                return values  # type: ignore[return-value]
            if time.monotonic() > deadline:
                bad = [k for k, v in zip(keys, values) if v is None]
                raise _DistStoreError(f"signed store: wait timeout after {limit * 1000:.0f}ms, no valid value for {bad}")
            time.sleep(0.01)
            raws = self.inner.multi_get(keys)

    def check(self, keys: list[str]) -> bool:
        for key in keys:
            raw = self._peek(key)
            if raw is None or self.open_records(key, raw) is None:
                return False
        return True

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if keys:
            self.multi_get(list(keys), timeout)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        expected_b, desired_b = _bytes(expected), _bytes(desired)
        while True:
            if expected_b:
                raw = self._peek(key) or b""
                current = self.open_records(key, raw) if raw else None
                if current != expected_b:  # absent: TCPStore answers ``expected``
                    return expected_b if not raw else (current if current is not None else b"")
            else:
                raw = b""
            sealed = self.seal(key, desired_b)
            answer = self.inner.compare_set(key, raw, sealed)
            if answer == sealed:
                return desired_b
            if not expected_b:  # somebody else's value was there first
                value = self.open_records(key, answer)
                return value if value is not None else b""
            # the record changed between the read and the swap: read it again

    def append(self, key: str, value: Any) -> None:
        self.inner.append(key, self.seal(key, value))

    def add(self, key: str, amount: int) -> int:
        while True:
            raw = self._peek(key) or b""
            value = self.open_records(key, raw) if raw else b"0"
            if value is None:
                raise StoreUnavailable(f"the counter {key!r} holds a value not signed by this job")
            number = int(value or b"0")
            if amount == 0:
                return number
            new = self.seal(key, str(number + amount))
            if self.inner.compare_set(key, raw, new) == new:
                return number + amount

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    # torch's C++ side calls these two by their C++ names.
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        super().set_timeout(timeout)
        if hasattr(self, "inner"):
            self.inner.set_timeout(timeout)
