"""A small client of etcd's v3 JSON gateway (``POST /v3/...`` on the client port), with failover.

etcd serves its v3 API as JSON over HTTP next to gRPC on every client port (the gRPC gateway, in
etcd 3.4 and later). Speaking it with ``http.client`` needs no dependency: the ``etcd3`` package
is unmaintained and breaks on current protobuf, and a gRPC client would pull in ``grpcio`` for five
calls. Keys and values travel base64-encoded; 64-bit integers come back as strings.

:class:`EtcdGateway` holds one keep-alive connection to one member at a time. A request that fails
for a reason another member may not have (connection refused or reset, no answer within
``request_timeout_s``, "no leader", "request timed out") is retried on the next member, with a short
pause, until the operation's deadline; then :class:`~.failures.StoreUnavailable` is raised. This is
how a cluster that lost one member keeps serving (the others have quorum) and how a cluster that
lost its quorum is reported instead of waited for: a member without quorum cannot answer a
linearizable read or a write, so every member times out or refuses until the deadline.

Which member first: the first endpoint served on this machine (its host resolves to an address of
this machine), else the first one, or the member another connection last reached (``start``): with
one member per machine each process talks to its own machine's member, so a lost machine costs the
others no failover (and the members share the clients' load).

Authentication: with ``user`` set, the client trades the user's password for a token
(``/v3/auth/authenticate``) and sends it with every request; a token the server no longer knows
(expired, or a member restarted) is renewed once per request. A refusal (wrong password, no token
while auth is on, a key outside the user's role) raises :class:`StoreAccessDenied` at once: no
other member would answer differently.
"""

from __future__ import annotations

import base64
import functools
import http.client
import json
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from resihp_lightning._logging import get_logger
from resihp_lightning.resilience.failures import StoreUnavailable

log = get_logger(__name__)

#: Substrings of etcd errors that mean "this credential or role is refused" (never retried).
_DENIED = ("permission denied", "authentication failed", "user name is empty", "user name not found",
           "authentication is not enabled", "role is not granted")
#: Substrings of etcd errors that mean "the token is stale": authenticate again, then retry.
_STALE_TOKEN = ("invalid auth token",)


def _refused_certificate(err: ssl.SSLError) -> bool:
    """Whether a TLS error is a certificate refused (ours by the member, or the member's by us)."""
    text = str(err).lower()
    return isinstance(err, ssl.SSLCertVerificationError) or any(
        s in text for s in ("certificate required", "bad certificate", "unknown ca", "certificate unknown")
    )


class StoreAccessDenied(StoreUnavailable):
    """The etcd cluster refused this client's credentials or its access to a key."""


def b64(data: bytes) -> str:
    """``data`` as the gateway's base64 text."""
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    """The bytes of a gateway base64 field (absent: empty)."""
    return base64.b64decode(text) if text else b""


@functools.lru_cache(maxsize=64)
def local_member(endpoints: tuple[Endpoint, ...]) -> int:
    """Index of the first endpoint whose host is an address of this machine (one this process can
    bind), else 0."""
    for index, endpoint in enumerate(endpoints):
        try:
            infos = socket.getaddrinfo(endpoint.host, None, type=socket.SOCK_STREAM)
        except OSError:
            continue
        for family, _, _, _, address in infos:
            try:
                with socket.socket(family, socket.SOCK_STREAM) as probe:
                    probe.bind((address[0], 0))
            except OSError:
                continue
            return index
    return 0


@dataclass(frozen=True)
class Endpoint:
    """One member's client URL, parsed."""

    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"not an etcd client URL: {url!r}")
        return cls(parsed.scheme, parsed.hostname, parsed.port or 2379)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


class EtcdGateway:
    """Requests to an etcd cluster's JSON gateway, failing over between members.

    Not thread-safe: one instance per thread (or behind a lock).

    Args:
        endpoints: the members' client URLs (``http://10.0.0.1:2379``, ``https://...``).
        user: etcd user to authenticate as (None: no authentication).
        password: that user's password.
        request_timeout_s: bound of one HTTP request to one member.
        ca_file: CA certificate that signed the members' certificates (``https`` endpoints).
        cert_file: client certificate (members started with ``--client-cert-auth``).
        key_file: the client certificate's key.
        start: index of the member to try first (default: this machine's own, :func:`local_member`).
    """

    def __init__(
        self,
        endpoints: list[str] | tuple[str, ...],
        *,
        user: str | None = None,
        password: str | None = None,
        request_timeout_s: float = 2.0,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        start: int | None = None,
    ) -> None:
        self.endpoints = [Endpoint.parse(e) for e in endpoints]
        if not self.endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.user, self._password = user, password
        self.request_timeout_s = request_timeout_s
        self._tls: ssl.SSLContext | None = None
        if any(e.scheme == "https" for e in self.endpoints):
            self._tls = ssl.create_default_context(cafile=ca_file)
            if cert_file:
                self._tls.load_cert_chain(cert_file, key_file)
        self._index = local_member(tuple(self.endpoints)) if start is None else start % len(self.endpoints)
        self._conn: http.client.HTTPConnection | None = None
        self._token: str | None = None

    @property
    def endpoint(self) -> Endpoint:
        """The member requests go to now."""
        return self.endpoints[self._index]

    def close(self) -> None:
        """Closes the connection (the next request opens a new one)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def connect(self, deadline: float) -> None:
        """Opens a connection to a member now (and authenticates), instead of at the first request."""
        self.call("/v3/maintenance/status", {}, deadline=deadline)

    # ------------------------------------------------------------------------- requests
    def call(self, path: str, body: dict[str, Any], *, deadline: float) -> dict[str, Any]:
        """POSTs ``body`` to ``path`` on some member; its JSON answer.

        Raises:
            StoreAccessDenied: the cluster refused the credentials or the key.
            StoreUnavailable: no member answered before ``deadline`` (``time.monotonic()``).
        """
        last_error = "no attempt"
        attempts = 0
        renewed = False
        while True:
            if attempts and time.monotonic() >= deadline:
                raise StoreUnavailable(
                    f"no etcd member of {', '.join(map(str, self.endpoints))} answered {path} in time "
                    f"({attempts} attempts; last: {last_error})"
                )
            attempts += 1
            try:
                if self.user is not None and self._token is None:
                    self._authenticate(deadline)
                status, answer = self._post(path, body, deadline, with_token=True)
            except ssl.SSLError as err:
                if _refused_certificate(err):
                    raise StoreAccessDenied(f"etcd at {self.endpoint} refused the TLS handshake: {err}") from err
                last_error = f"{self.endpoint}: {type(err).__name__}: {err}"
                self._next_member()
                continue
            except (OSError, http.client.HTTPException) as err:
                last_error = f"{self.endpoint}: {type(err).__name__}: {err}"
                self._next_member()
                continue
            if status == 200:
                return answer
            message = str(answer.get("error") or answer.get("message") or answer)
            lowered = message.lower()
            if any(s in lowered for s in _STALE_TOKEN) and not renewed:
                self._token, renewed = None, True
                continue
            if any(s in lowered for s in _DENIED) or status in (401, 403):
                raise StoreAccessDenied(f"etcd at {self.endpoint} refused {path}: {message}")
            # No leader, leader changed, request timed out, too many requests: another member may do.
            last_error = f"{self.endpoint}: HTTP {status}: {message}"
            self._next_member()

    def _authenticate(self, deadline: float) -> None:
        status, answer = self._post(
            "/v3/auth/authenticate", {"name": self.user, "password": self._password or ""}, deadline, with_token=False
        )
        if status != 200:
            message = str(answer.get("error") or answer.get("message") or answer)
            if any(s in message.lower() for s in _DENIED) or status in (400, 401, 403):
                raise StoreAccessDenied(f"etcd at {self.endpoint} refused user {self.user!r}: {message}")
            raise http.client.HTTPException(f"authenticate: HTTP {status}: {message}")
        self._token = answer.get("token")

    def _post(self, path: str, body: dict[str, Any], deadline: float, *, with_token: bool) -> tuple[int, dict[str, Any]]:
        timeout = max(min(self.request_timeout_s, deadline - time.monotonic()), 0.05)
        conn = self._connection(timeout)
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        headers = {"Content-Type": "application/json"}
        if with_token and self._token:
            headers["Authorization"] = self._token
        try:
            conn.request("POST", path, body=json.dumps(body), headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except BaseException:
            self.close()
            raise
        try:
            answer = json.loads(raw) if raw else {}
        except ValueError:
            answer = {"error": raw[:200].decode("utf-8", "replace")}
        return response.status, answer if isinstance(answer, dict) else {"error": str(answer)}

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self._conn is None:
            member = self.endpoint
            if member.scheme == "https":
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    member.host, member.port, timeout=timeout, context=self._tls
                )
            else:
                conn = http.client.HTTPConnection(member.host, member.port, timeout=timeout)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conn = conn
        return self._conn

    def _next_member(self) -> None:
        self.close()
        self._index = (self._index + 1) % len(self.endpoints)
        if self._index == 0:
            time.sleep(0.05)  # every member failed once: do not spin
        # A token is valid on every member (the auth store is replicated), keep it.
