"""The store host process: a ``TCPStore`` server that belongs to no training process.

Run by :class:`~resihp_lightning.resilience.store.RendezvousStore` (never by hand, though
``python -m resihp_lightning.resilience.store_host --help`` works). With ``--detach`` it forks once
more and the first process exits at once, so the worker that spawned it does not have to reap it and
the host is in a session of its own.

Lifetime (see :mod:`~resihp_lightning.resilience.store` for why): every ``poll`` seconds the host
reads the members that registered under ``resihp/host/member/<i>`` and decides, for each, whether it
still counts: not if it left (``resihp/host/left/<i>``: finished or evicted); on this machine, while
its process lives (``/proc``, zombies are dead); on another machine, while its heartbeat key changed
within ``--remote-idle`` seconds (measured on the host's own clock). The worker that spawned the
host counts until somebody registers. When nobody counts for ``--linger`` seconds, or nobody ever
registered within ``--startup-timeout``, or ``resihp/host/shutdown`` is set, the host takes the
run directory's lock, checks once more, removes its address file and exits.

The server listens on ``--host`` only (torch's ``TCPStore`` server would listen on every interface:
the host hands it a socket bound to the job's address). With ``--secret-file`` the host counts only
registrations, goodbyes and shutdown requests signed with the job's secret (:mod:`.store_auth`): a
stranger who reaches the port cannot keep it alive by registering, nor stop it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resihp_lightning.resilience.failures import StoreUnavailable
from resihp_lightning.resilience.procs import ProcessIdentity
from resihp_lightning.resilience.store import LOCK_FILE, file_lock, host_key, read_address, write_address

log = logging.getLogger("resihp_lightning.resilience.store_host")


@dataclass
class _Member:
    index: int
    identity: ProcessIdentity
    beat_key: str | None
    beat: bytes | None = None
    beat_changed: float = 0.0


class StoreHost:
    """The server and its lifetime rule (one per job).

    Args:
        run_dir: the job's run directory (address file and lock).
        host: address to bind.
        port: port to bind (0: any free port).
        timeout_s: store operation timeout.
        linger_s: exit this long after the last member is gone.
        startup_timeout_s: exit if nobody registers within this long.
        remote_idle_s: a remote member counts while its heartbeat changed within this long.
        spawner: the worker that started the host (counts until someone registers).
        poll_s: seconds between checks.
        secret: the job's secret: registrations, goodbyes and shutdown requests count only when
            signed with it (:mod:`.store_auth`); None: every value counts.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        host: str,
        port: int,
        timeout_s: float,
        linger_s: float,
        startup_timeout_s: float,
        remote_idle_s: float,
        spawner: ProcessIdentity | None = None,
        poll_s: float = 0.2,
        secret: bytes | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.host, self.port = host, port
        self.timeout_s, self.linger_s = timeout_s, linger_s
        self.startup_timeout_s, self.remote_idle_s = startup_timeout_s, remote_idle_s
        self.spawner, self.poll_s = spawner, poll_s
        self.secret = secret
        self.store: Any = None
        self._listener: socket.socket | None = None
        self._members: dict[int, _Member] = {}
        self._count = 0
        self._count_error: str | None = None

    def serve(self) -> str:
        """Runs the server until the lifetime rule ends it; returns why it ended."""
        import torch.distributed as dist

        # torch's server listens on every interface; a socket bound here to the job's address keeps
        # it off the others (127.0.0.1 on one machine).
        self._listener = bound_listener(bind_address(self.host, self.port), self.port)
        server = dist.TCPStore(
            self.host, self._listener.getsockname()[1], None, True, datetime.timedelta(seconds=self.timeout_s),
            wait_for_workers=False, master_listen_fd=self._listener.fileno(),
        )
        if self.secret is not None:
            from resihp_lightning.resilience.store_auth import SignedStore

            self.store = SignedStore(server, self.secret)
        else:
            self.store = server
        identity = ProcessIdentity.current()
        write_address(self.run_dir, {"host": self.host, "port": server.port, "identity": vars(identity)})
        log.info("store host %d serving %s:%d%s", os.getpid(), self.host, server.port,
                 " (signed values only)" if self.secret is not None else "")
        started = last_alive = time.monotonic()
        while True:
            time.sleep(self.poll_s)
            if self.store.check([host_key("shutdown")]):
                reason = "shutdown requested"
                break
            now = time.monotonic()
            if self._anyone_alive(now):
                last_alive = now
                continue
            registered = bool(self._members)
            if (registered and now - last_alive > self.linger_s) or (
                not registered and now - started > self.startup_timeout_s
            ):
                # Under the lock: a worker registering right now must either be seen or see no host.
                with file_lock(self.run_dir / LOCK_FILE, self.timeout_s):
                    if self._anyone_alive(time.monotonic()):
                        last_alive = time.monotonic()
                        continue
                    info = read_address(self.run_dir)
                    if info is not None and info.get("identity", {}).get("pid") == os.getpid():
                        (self.run_dir / "store.json").unlink(missing_ok=True)
                reason = "no member left" if registered else "nobody registered"
                break
        log.info("store host %d exits: %s", os.getpid(), reason)
        return reason

    def _anyone_alive(self, now: float) -> bool:
        self._read_members(now)
        alive = False
        for member in self._members.values():
            if self.store.check([host_key(f"left/{member.index}")]):
                continue
            if member.identity.comparable():
                alive = alive or member.identity.alive()
                continue
            if member.beat_key is None:  # the launch round is being agreed: the key comes after
                key = host_key(f"member/{member.index}/beat")
                if not self.store.check([key]):
                    alive = alive or now - member.beat_changed <= self.remote_idle_s
                    continue
                member.beat_key = self.store.get(key).decode()
            beat = self.store.get(member.beat_key) if self.store.check([member.beat_key]) else None
            if beat != member.beat:
                member.beat, member.beat_changed = beat, now
            alive = alive or now - member.beat_changed <= self.remote_idle_s
        if not self._members and self.spawner is not None:
            return self.spawner.alive()
        return alive

    def _read_members(self, now: float) -> None:
        try:
            count = int(self.store.add(host_key("count"), 0))
        except StoreUnavailable as err:  # a stranger overwrote the signed counter: no new registrations
            if self._count_error is None:
                log.warning("store host: %s; registrations after it are ignored", err)
            self._count_error = str(err)
            count = self._count
        self._count = count
        for index in range(count):
            key = host_key(f"member/{index}")
            if index in self._members or not self.store.check([key]):
                continue
            info = json.loads(self.store.get(key))
            self._members[index] = _Member(
                index, ProcessIdentity(**info["identity"]), info["beat_key"], beat_changed=now
            )
            self.store.set(host_key("members"), str(len(self._members)))  # how many the host counts


def bind_address(host: str, port: int) -> str:
    """The address to listen on: ``host``, unless a fixed port (other machines connect) and a name
    that resolves to loopback here (Debian maps the host's own name to 127.0.1.1 in /etc/hosts):
    then every interface, with a warning, rather than a store the other machines cannot reach."""
    try:
        address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return host
    loopback = address.startswith("127.") or address == "::1"
    if port and loopback and host not in ("localhost", "127.0.0.1", "::1") and not host.startswith("127."):
        log.warning("store host: %s resolves to %s here; listening on every interface so that the other "
                    "machines can connect (set fail_stop.store host/MASTER_ADDR to this machine's address)",
                    host, address)
        return "0.0.0.0"
    return host


def bound_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` only (port 0: a free one)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(512)
    return listener


def _detach() -> None:
    """Forks; the parent exits so that whoever spawned it can reap it at once."""
    if os.fork() > 0:
        os._exit(0)


def _secret(path: str | None) -> bytes | None:
    if path is None:
        return None
    from resihp_lightning.resilience.store_auth import read_secret

    return read_secret(Path(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--linger", type=float, default=2.0)
    parser.add_argument("--startup-timeout", type=float, default=120.0)
    parser.add_argument("--remote-idle", type=float, default=30.0)
    parser.add_argument("--spawner", default=None, help="the spawning worker's identity (JSON)")
    parser.add_argument("--secret-file", default=None, help="the job's secret: only values signed with it count")
    parser.add_argument("--detach", action="store_true")
    args = parser.parse_args(argv)
    if args.detach:
        _detach()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s store_host[%(process)d] %(message)s", stream=sys.stderr)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    host = StoreHost(
        run_dir,
        host=args.host,
        port=args.port,
        timeout_s=args.timeout,
        linger_s=args.linger,
        startup_timeout_s=args.startup_timeout,
        remote_idle_s=args.remote_idle,
        spawner=ProcessIdentity.from_json(args.spawner) if args.spawner else None,
        secret=_secret(args.secret_file),
    )
    try:
        host.serve()
    except Exception:  # noqa: BLE001 - logged for the run directory, then the host ends
        log.exception("store host failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
