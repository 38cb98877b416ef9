"""The ``etcd`` command line of one member of a job's etcd cluster: one member per machine, on that machine.

The launch recipe (``examples/torchrun_per_process.sh`` with ``ETCD_MEMBERS``) and the machines
harness start a member the same way, with this module, on every machine named in ``--members``::

    python -m resihp_lightning.resilience.etcd_member --members node0,node1,node2 --token JOB \\
        --data-dir /var/tmp/etcd-JOB

runs (``exec``) on ``node1``::

    etcd --name node1 --data-dir /var/tmp/etcd-JOB \\
        --listen-client-urls http://10.0.0.2:2379 --advertise-client-urls http://node1:2379 \\
        --listen-peer-urls http://10.0.0.2:2380 --initial-advertise-peer-urls http://node1:2380 \\
        --initial-cluster node0=http://node0:2380,node1=http://node1:2380,node2=http://node2:2380 \\
        --initial-cluster-token JOB --initial-cluster-state new

The member is named after its machine (``--name``, default the hostname) and listens on that
machine's address only (what the name resolves to; a name that resolves to loopback, as Debian's
``/etc/hosts`` makes a machine's own name, is refused: give ``--address``). ``--print`` prints the
command instead of running it, ``--endpoints`` prints the members' client URLs, comma-separated
(the job's ``fail_stop.store.endpoints``). Arguments after ``--`` go to ``etcd`` unchanged (e.g.
``--heartbeat-interval 50 --election-timeout 500``). Torch-free.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import shutil
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from resihp_lightning.errors import ConfigError, invalid_option

ETCD = "etcd"
DEFAULT_CLIENT_PORT = 2379
DEFAULT_PEER_PORT = 2380


def parse_members(text: str | Sequence[str]) -> tuple[str, ...]:
    """Member (machine) names from ``"node0,node1,node2"`` or a sequence; refuses empty and repeated names."""
    names = tuple(n.strip() for n in (text.split(",") if isinstance(text, str) else text))
    if not names or any(not n or any(c in n for c in "=,/: ") for n in names) or len(set(names)) != len(names):
        raise invalid_option("etcd_member.members", text, "distinct machine names, comma-separated (node0,node1,node2)")
    return names


def client_endpoints(members: Sequence[str], client_port: int = DEFAULT_CLIENT_PORT) -> list[str]:
    """The members' client URLs, in ``members`` order (the job's ``fail_stop.store.endpoints``)."""
    return [f"http://{name}:{client_port}" for name in members]


@dataclass(frozen=True, kw_only=True)
class EtcdMemberConfig:
    """One member of the job's etcd cluster.

    Attributes:
        members: every member's machine name, the same list (and order) on every machine.
        name: this member's machine, one of ``members`` (default: this machine's hostname).
        address: the address it listens on (default: what ``name`` resolves to; never loopback).
        client_port: the client port on every member.
        peer_port: the peer (Raft) port on every member.
        data_dir: its data directory, on local disk (default ``$TMPDIR/resihp-etcd-<token>-<name>``).
        token: the cluster's ``--initial-cluster-token`` (the job's id: two jobs' members never join).
        extra: more ``etcd`` arguments, passed unchanged.
    """

    members: tuple[str, ...]
    name: str = ""
    address: str = ""
    client_port: int = DEFAULT_CLIENT_PORT
    peer_port: int = DEFAULT_PEER_PORT
    data_dir: str = ""
    token: str = "resihp"
    extra: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", parse_members(self.members))
        name = self.name or socket.gethostname()
        if name not in self.members:
            raise invalid_option("etcd_member.name", name, f"one of the members {', '.join(self.members)}")
        object.__setattr__(self, "name", name)
        for option in ("client_port", "peer_port"):
            port = getattr(self, option)
            if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
                raise invalid_option(f"etcd_member.{option}", port, "a TCP port 1..65535")
        if self.client_port == self.peer_port:
            raise invalid_option("etcd_member.peer_port", self.peer_port, f"a port other than client_port {self.client_port}")
        if not self.token or any(c.isspace() for c in self.token):
            raise invalid_option("etcd_member.token", self.token, "a non-empty word (the job's id)")
        object.__setattr__(self, "address", self.address or _own_address(name))
        try:
            address = ipaddress.ip_address(self.address)
        except ValueError:
            raise invalid_option("etcd_member.address", self.address, "an IP address of this machine") from None
        if address.is_loopback:
            raise invalid_option("etcd_member.address", self.address,
                                 "this machine's address on the job's network, not loopback (other machines must reach it)")
        if not self.data_dir:
            tmp = os.environ.get("TMPDIR", "/tmp")
            object.__setattr__(self, "data_dir", os.path.join(tmp, f"resihp-etcd-{self.token}-{name}"))
        object.__setattr__(self, "extra", tuple(self.extra))

    @property
    def endpoints(self) -> list[str]:
        """Every member's client URL."""
        return client_endpoints(self.members, self.client_port)

    def command(self) -> list[str]:
        """The ``etcd`` command line of this member."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        cluster = ",".join(f"{m}=http://{m}:{self.peer_port}" for m in self.members)
        return [
            ETCD, "--name", self.name, "--data-dir", self.data_dir,
            "--listen-client-urls", f"http://{host}:{self.client_port}",
            "--advertise-client-urls", f"http://{self.name}:{self.client_port}",
            "--listen-peer-urls", f"http://{host}:{self.peer_port}",
            "--initial-advertise-peer-urls", f"http://{self.name}:{self.peer_port}",
            "--initial-cluster", cluster, "--initial-cluster-token", self.token, "--initial-cluster-state", "new",
            *self.extra,
        ]


def _own_address(name: str) -> str:
    try:
        return socket.gethostbyname(name)
    except OSError as err:
        raise ConfigError(f"etcd_member: the machine name {name!r} does not resolve ({err}); give --address") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, extra = args[:cut], args[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m resihp_lightning.resilience.etcd_member",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--members", required=True, help="every member's machine name, comma-separated")
    parser.add_argument("--name", default="", help="this machine's name (default: its hostname)")
    parser.add_argument("--address", default="", help="the address to listen on (default: what --name resolves to)")
    parser.add_argument("--client-port", type=int, default=DEFAULT_CLIENT_PORT)
    parser.add_argument("--peer-port", type=int, default=DEFAULT_PEER_PORT)
    parser.add_argument("--data-dir", default="", help="default $TMPDIR/resihp-etcd-<token>-<name>")
    parser.add_argument("--token", default="resihp", help="the cluster token: the job's id")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--print", action="store_true", help="print the etcd command instead of running it")
    what.add_argument("--endpoints", action="store_true", help="print the members' client URLs, comma-separated")
    ns = parser.parse_args(args)
    try:
        if ns.endpoints:  # no member of its own needed: any machine may ask
            print(",".join(client_endpoints(parse_members(ns.members), ns.client_port)))
            return 0
        config = EtcdMemberConfig(members=ns.members, name=ns.name, address=ns.address, client_port=ns.client_port,
                                  peer_port=ns.peer_port, data_dir=ns.data_dir, token=ns.token, extra=tuple(extra))
    except ConfigError as err:
        parser.error(str(err))
    command = config.command()
    if ns.print:
        print(shlex.join(command))
        return 0
    binary = shutil.which(ETCD)
    if binary is None:
        parser.error("etcd is not installed (Debian: apt-get install etcd-server)")
    sys.stdout.flush()
    os.execv(binary, command)
    return 0  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
