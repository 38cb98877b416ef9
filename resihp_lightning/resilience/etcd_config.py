"""The options of the etcd store (:mod:`.etcd_store`), importable without torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resihp_lightning.errors import invalid_option
from resihp_lightning.resilience.etcd_gateway import Endpoint


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key that starts with ``prefix`` (etcd's ``range_end``)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


ETCD_OPTIONS = ("endpoints", "user", "password_file", "ca_file", "cert_file", "key_file",
                "request_timeout_s", "op_timeout_s", "poll_s")
#: Every key of a job lives under ``resihp/<run id>/`` (the job user's role grants this prefix).
ETCD_KEY_PREFIX = "resihp/"


def check_etcd_values(values: Mapping[str, Any], option: str) -> None:
    """Raises :class:`~resihp_lightning.errors.ConfigError` naming ``<option>.<field>`` for a bad value."""
    endpoints = values.get("endpoints")
    if isinstance(endpoints, str) or not isinstance(endpoints, (list, tuple)) or not endpoints:
        raise invalid_option(f"{option}.endpoints", endpoints, "a non-empty list of etcd client URLs (http://host:2379)")
    for url in endpoints:
        try:
            Endpoint.parse(str(url))
        except ValueError:
            raise invalid_option(f"{option}.endpoints", url, "http://host:port or https://host:port") from None
    for name in ("request_timeout_s", "op_timeout_s", "poll_s"):
        value = values.get(name, 1.0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise invalid_option(f"{option}.{name}", value, "seconds > 0")
    if (values.get("user") is None) != (values.get("password_file") is None):
        raise invalid_option(f"{option}.password_file", values.get("password_file"),
                             "a file with the password of `user` (both set, or neither)")
    if (values.get("cert_file") is None) != (values.get("key_file") is None):
        raise invalid_option(f"{option}.key_file", values.get("key_file"), "set together with cert_file")


@dataclass(frozen=True, kw_only=True)
class EtcdConfig:
    """Where the job's etcd cluster is and how to log in.

    Attributes:
        endpoints: the members' client URLs, e.g. ``["http://10.0.0.1:2379", "http://10.0.0.2:2379",
            "http://10.0.0.3:2379"]`` (all of them: requests fail over between them).
        user: etcd user of the job (None: the cluster has auth off; anyone who reaches it can write).
        password_file: file holding that user's password (one line; keep it readable by the job's
            user only).
        ca_file: CA certificate of ``https://`` endpoints.
        cert_file: client certificate, for members started with ``--client-cert-auth``.
        key_file: its key.
        request_timeout_s: bound of one request to one member before trying the next.
        op_timeout_s: bound of one store operation over all members (retries included): after it,
            :class:`~.failures.StoreUnavailable` (e.g. the cluster lost its quorum).
        poll_s: longest pause between two polls of a ``get``/``wait`` for a key that is not there yet.
    """

    endpoints: tuple[str, ...]
    user: str | None = None
    password_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    request_timeout_s: float = 2.0
    op_timeout_s: float = 10.0
    poll_s: float = 0.05

    def __post_init__(self) -> None:
        check_etcd_values(vars(self), "resilience.store.etcd")
        object.__setattr__(self, "endpoints", tuple(str(e) for e in self.endpoints))

    def password(self) -> str | None:
        """The password, read from ``password_file`` (None without a user)."""
        if self.password_file is None:
            return None
        return Path(self.password_file).read_text().strip()

    def peer_addresses(self) -> list[tuple[str, int]]:
        """``("*", port)`` of every member's client port, for the socket tracker's exclusions (any
        address: an endpoint may be a host name, and the tracker compares the peer's IP)."""
        return [("*", port) for port in sorted({Endpoint.parse(e).port for e in self.endpoints})]
