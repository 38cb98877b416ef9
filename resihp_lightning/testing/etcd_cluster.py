"""A small etcd cluster on this machine for tests and benchmarks: N ``etcd`` processes on 127.0.0.x.

Member ``i`` listens on ``127.0.0.<first + i>``, client port ``client_port`` and peer port
``client_port + 1`` on every member (the same ports on different loopback addresses, so that one
``("*", client_port)`` names them all), with short Raft timers (heartbeat 50 ms, election 500 ms) so
that losing the leader costs about half a second. Data directories live under ``base_dir``.
``kill(i)`` SIGKILLs one member; ``close()`` kills them all (also at exit).

    with LocalEtcdCluster(tmp_path, members=3) as cluster:
        store = EtcdStore(EtcdConfig(endpoints=cluster.endpoints), root="job/", timeout=...)
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from resihp_lightning.resilience.etcd_gateway import EtcdGateway

ETCD = "etcd"


def etcd_unavailable_reason() -> str | None:
    """Why no etcd cluster can be started here (None: it can)."""
    if shutil.which(ETCD) is None:
        return "etcd is not installed (Debian: apt-get install etcd-server etcd-client)"
    return None


def _free_on_all(hosts: list[str]) -> int:
    """A port number free for listening on every address in ``hosts`` (and the next one too)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        if port > 65000:
            continue
        try:
            for host in hosts:
                for p in (port, port + 1):
                    with socket.socket() as s:
                        s.bind((host, p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair on the loopback addresses")


def make_certificates(directory: Path, hosts: list[str]) -> dict[str, str]:
    """A CA, a server certificate for ``hosts`` (IP addresses) and a client certificate, made with
    ``openssl`` in ``directory``; the paths as :class:`LocalEtcdCluster`'s ``tls`` wants them (plus
    ``client_cert`` and ``client_key``)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {name: str(directory / f"{name}.pem") for name in ("ca", "ca_key", "cert", "key", "client_cert", "client_key")}

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=resihp-test-ca",
            "-keyout", paths["ca_key"], "-out", paths["ca"])
    san = directory / "san.cnf"
    san.write_text("subjectAltName=" + ",".join(f"IP:{h}" for h in hosts) + "\n")
    for cert, key, name, extra in (("cert", "key", "etcd", ["-extfile", str(san)]), ("client_cert", "client_key", "job", [])):
        csr = str(directory / f"{name}.csr")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", paths[key], "-out", csr)
        openssl("x509", "-req", "-in", csr, "-CA", paths["ca"], "-CAkey", paths["ca_key"], "-CAcreateserial",
                "-days", "1", "-out", paths[cert], *extra)
    return paths


class LocalEtcdCluster:
    """Starts ``members`` etcd processes and waits until the cluster answers.

    Args:
        base_dir: where data directories and logs go.
        members: how many (3 or 5 for a quorum that survives 1 or 2 losses).
        first: last byte of the first member's loopback address.
        start_timeout_s: how long to wait for the cluster to elect a leader.
        tls: serve clients over TLS and require a client certificate signed by ``tls["ca"]``
            (``{"ca": ..., "cert": ..., "key": ...}``: the members' certificate and key; see
            :func:`make_certificates`).
    """

    def __init__(
        self, base_dir: str | Path, members: int = 3, *, first: int = 11, start_timeout_s: float = 30.0,
        tls: dict[str, str] | None = None,
    ) -> None:
        self.base_dir = Path(base_dir)
        self.hosts = [f"127.0.0.{first + i}" for i in range(members)]
        self.client_port = _free_on_all(self.hosts)
        self.names = [f"m{i}" for i in range(members)]
        self.procs: list[subprocess.Popen | None] = [None] * members
        self.start_timeout_s = start_timeout_s
        self.tls = tls
        self.scheme = "https" if tls else "http"
        cluster = ",".join(f"{n}=http://{h}:{self.client_port + 1}" for n, h in zip(self.names, self.hosts))
        token = f"resihp-test-{os.getpid()}-{self.client_port}"
        self._commands = [
            [
                ETCD, "--name", name, "--data-dir", str(self.base_dir / f"{name}.etcd"),
                "--listen-client-urls", f"{self.scheme}://{host}:{self.client_port}",
                "--advertise-client-urls", f"{self.scheme}://{host}:{self.client_port}",
                "--listen-peer-urls", f"http://{host}:{self.client_port + 1}",
                "--initial-advertise-peer-urls", f"http://{host}:{self.client_port + 1}",
                "--initial-cluster", cluster, "--initial-cluster-token", token, "--initial-cluster-state", "new",
                "--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "warn",
                *(["--cert-file", tls["cert"], "--key-file", tls["key"], "--client-cert-auth",
                   "--trusted-ca-file", tls["ca"]] if tls else []),
            ]
            for name, host in zip(self.names, self.hosts)
        ]

    @property
    def endpoints(self) -> list[str]:
        """Client URLs of all members (dead ones included)."""
        return [f"{self.scheme}://{h}:{self.client_port}" for h in self.hosts]

    def start(self) -> LocalEtcdCluster:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        for i in range(len(self.hosts)):
            self.start_member(i)
        atexit.register(self.close)
        deadline = time.monotonic() + self.start_timeout_s
        tls = self.tls or {}
        gateway = EtcdGateway(self.endpoints, request_timeout_s=1.0, ca_file=tls.get("ca"),
                              cert_file=tls.get("client_cert"), key_file=tls.get("client_key"))
        try:
            # A write answers once a leader exists and a majority has the entry.
            gateway.call("/v3/kv/put", {"key": "X19zdGFydF9f", "value": ""}, deadline=deadline)
        except Exception:
            self.close()
            raise
        finally:
            gateway.close()
        return self

    def start_member(self, index: int) -> None:
        """Starts member ``index`` (again: it rejoins with its data directory)."""
        with open(self.base_dir / f"{self.names[index]}.log", "ab") as log:
            self.procs[index] = subprocess.Popen(  # noqa: S603 - etcd with fixed arguments
                self._commands[index], stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
            )

    def kill(self, index: int) -> None:
        """SIGKILLs member ``index`` and reaps it."""
        proc = self.procs[index]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def close(self) -> None:
        for index in range(len(self.procs)):
            self.kill(index)

    def __enter__(self) -> LocalEtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
