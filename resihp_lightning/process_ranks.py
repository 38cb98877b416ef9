"""Ranks for a job whose every process has a launcher of its own (one ``torchrun --standalone`` each).

One torchrun agent per machine restarts or tears down every worker of its machine when one of them
dies, and every other agent follows at the next rendezvous round (docs/machines.md): the in-process
recovery never gets to run. One agent per process, each ``torchrun --standalone --nproc-per-node 1
--max-restarts 0``, leaves every death to the job. Such an agent knows only its own process, so it
tells it ``RANK=0``, ``WORLD_SIZE=1``; the job's ranks come from here instead.

Every process registers ``<node name>:<local index>`` in a small ``TCPStore`` at
``RESIHP_RANKS_AT`` (``host:port``, served by local index 0 of that host); once
``RESIHP_WORLD_SIZE`` processes have, ranks follow the sorted (node name, local index) order and
node ranks the sorted node names. :func:`ensure_process_ranks` then sets what a launcher would
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` = the
first node, ``MASTER_PORT`` = a free port rank 0 picked, ``TORCHELASTIC_RUN_ID`` = ``RESIHP_JOB_ID``),
so Lightning's torchelastic environment, :func:`~.launcher_env.launcher_shape` and ``fail_stop``'s
store (hosted at ``MASTER_ADDR``) see one job. The rank store is needed only at start: its host ends
it once every process has read its rank.

Variables (all but the last three required once ``RESIHP_RANKS_AT`` is set):

* ``RESIHP_RANKS_AT``: ``host:port`` of the rank store (a machine every process can reach);
* ``RESIHP_WORLD_SIZE``: processes in the job;
* ``RESIHP_LOCAL_INDEX``: this process's index on its machine, ``0 .. RESIHP_NPROC_PER_NODE - 1``;
* ``RESIHP_NPROC_PER_NODE``: processes per machine;
* ``RESIHP_JOB_ID``: one id for the whole job (default ``resihp``; each standalone agent makes up
  its own run id, and the fail-stop store keys the job by it);
* ``RESIHP_NODE_NAME``: this machine's name in the order (default: its hostname);
* ``RESIHP_RANKS_TIMEOUT_S``: how long to wait for every process to register (default 300).

**A newcomer** (``RESIHP_JOIN=1``: a replacement machine's processes, started with the recipe's ``JOIN=1``
after the job began) does not register: the rank store ended once every process of the job had read its
rank. It sets what lets the strategy find the running job instead: ``TORCHELASTIC_RUN_ID`` =
``RESIHP_JOB_ID`` (the fail-stop store keys the job by it), ``MASTER_ADDR`` = ``RESIHP_MASTER_ADDR``, by
default the rank store's host (where the TCP fail-stop store host runs when that host is the first
machine in name order, as in the recipe; the etcd store needs no address), the job's shape
(``WORLD_SIZE`` = ``RESIHP_WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, which Lightning checks against
``Trainer(num_nodes, devices)``), ``LOCAL_RANK`` = ``RESIHP_LOCAL_INDEX`` (its device), and a placeholder
``RANK`` = ``RESIHP_WORLD_SIZE`` and ``GROUP_RANK`` = the job's machine count (never rank or node 0: the
job's rank of a newcomer comes from the fail-stop store's join counter, above every rank the job has had,
:mod:`resihp_lightning.resilience.joining`).

* ``RESIHP_JOIN``: ``1`` joins the running job (``0`` or unset: registers as one of its processes);
* ``RESIHP_MASTER_ADDR``: with ``RESIHP_JOIN=1``, the TCP fail-stop store's host (default: the host of
  ``RESIHP_RANKS_AT``).

``examples/torchrun_per_process.sh`` is the recipe. No torch at import time.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace

from resihp_lightning.errors import ConfigError

#: Set in a process once its ranks are assigned (a second call does nothing): ``1``, or ``join`` for a newcomer.
ASSIGNED = "RESIHP_RANKS_ASSIGNED"
#: The switch of a process that joins the running job (the same variable as ``fail_stop.join``'s).
JOIN = "RESIHP_JOIN"
#: A newcomer's TCP fail-stop store host.
MASTER_ADDR = "RESIHP_MASTER_ADDR"


@dataclass(frozen=True)
class RankRequest:
    """What one process asks of the rank store (read from its environment by :meth:`from_env`).

    Attributes:
        endpoint: ``(host, port)`` of the rank store.
        world_size: processes in the job.
        local_index: this process's index on its machine.
        nproc_per_node: processes per machine.
        job_id: the job's one run id.
        node_name: this machine's name in the rank order.
        timeout_s: how long to wait for every process to register.
        join: this process joins the running job (``RESIHP_JOIN=1``): it does not register.
        master_addr: with ``join``, the TCP fail-stop store's host (``RESIHP_MASTER_ADDR``, default the
            rank store's host).
    """

    endpoint: tuple[str, int]
    world_size: int
    local_index: int
    nproc_per_node: int
    job_id: str = "resihp"
    node_name: str = ""
    timeout_s: float = 300.0
    join: bool = False
    master_addr: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankRequest | None:
        """The request the ``RESIHP_*`` variables describe, ``None`` when ``RESIHP_RANKS_AT`` is unset.

        Raises:
            ConfigError: a variable is missing or has a value that is not allowed (named in the message).
        """
        env = os.environ if environ is None else environ
        at = env.get("RESIHP_RANKS_AT", "").strip()
        if not at:
            return None
        host, _, port = at.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"RESIHP_RANKS_AT={at!r}: expected host:port with a port in 1..65535")
        world = _positive_int(env, "RESIHP_WORLD_SIZE")
        per_node = _positive_int(env, "RESIHP_NPROC_PER_NODE")
        index = _positive_int(env, "RESIHP_LOCAL_INDEX", minimum=0)
        if index >= per_node:
            raise ConfigError(f"RESIHP_LOCAL_INDEX={index}: must be below RESIHP_NPROC_PER_NODE={per_node}")
        timeout = env.get("RESIHP_RANKS_TIMEOUT_S", "300")
        try:
            timeout_s = float(timeout)
        except ValueError:
            timeout_s = -1.0
        if not timeout_s > 0:
            raise ConfigError(f"RESIHP_RANKS_TIMEOUT_S={timeout!r}: expected a number of seconds > 0")
        join = joins(env)
        master_addr = env.get(MASTER_ADDR, "").strip()
        if master_addr and not join:
            raise ConfigError(f"{MASTER_ADDR}={master_addr!r} is for a process that joins the running job ({JOIN}=1); "
                              "the job's own processes take MASTER_ADDR from the rank store: unset it")
        return cls(endpoint=(host.strip("[]"), int(port)), world_size=world, local_index=index, nproc_per_node=per_node,
                   job_id=env.get("RESIHP_JOB_ID", "resihp") or "resihp",
                   node_name=env.get("RESIHP_NODE_NAME", "") or socket.gethostname(), timeout_s=timeout_s,
                   join=join, master_addr=master_addr or host.strip("[]"))


def joins(environ: Mapping[str, str] | None = None) -> bool:
    """``RESIHP_JOIN``: ``1`` joins the running job, ``0`` or unset does not.

    Raises:
        ConfigError: any other value.
    """
    value = (os.environ if environ is None else environ).get(JOIN, "").strip()
    if value not in ("", "0", "1"):
        raise ConfigError(f"{JOIN}={value!r}: allowed are 1 (join the running job), 0 or unset")
    return value == "1"


def _positive_int(env: Mapping[str, str], name: str, minimum: int = 1) -> int:
    value = env.get(name)
    if value is None or not value.strip().isdigit() or int(value) < minimum:
        raise ConfigError(f"{name}={value!r}: RESIHP_RANKS_AT is set, so {name} must be an integer >= {minimum}")
    return int(value)


@dataclass(frozen=True)
class Assignment:
    """One process's place in the job."""

    rank: int
    node_rank: int
    first_node: str


def assign(members: Sequence[tuple[str, int]], me: tuple[str, int], world_size: int) -> Assignment:
    """Ranks in sorted (node name, local index) order, node ranks in sorted node-name order.

    Args:
        members: every registration, ``(node name, local index)``, in any order.
        me: this process's registration.
        world_size: the processes the job expects.

    Raises:
        ConfigError: two processes registered the same place, or the count is not ``world_size``.
    """
    ordered = sorted(members)
    duplicates = sorted({m for m in ordered if ordered.count(m) > 1})
    if duplicates:
        named = ", ".join(f"{name}:{index}" for name, index in duplicates)
        raise ConfigError(f"two processes registered as {named}: give each process of a machine its own "
                          "RESIHP_LOCAL_INDEX, and each machine its own name (RESIHP_NODE_NAME or hostname)")
    if len(ordered) != world_size:
        raise ConfigError(f"{len(ordered)} processes registered, RESIHP_WORLD_SIZE is {world_size}")
    nodes = sorted({name for name, _ in ordered})
    return Assignment(rank=ordered.index(me), node_rank=nodes.index(me[0]), first_node=nodes[0])


def _serves_here(host: str) -> bool:
    """Whether ``host`` names this machine (an address of it can be bound, or it is its hostname)."""
    if host in (socket.gethostname(), "localhost"):
        return True
    try:
        address = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def ensure_process_ranks(environ: MutableMapping[str, str] | None = None, join: bool | None = None) -> Assignment | None:
    """Takes this process's ranks from the rank store if ``RESIHP_RANKS_AT`` asks for it (once per process).

    Collective over the job's processes: returns once every one has registered. Returns ``None``
    (and changes nothing) when ``RESIHP_RANKS_AT`` is unset or the ranks were already assigned. A
    newcomer (``RESIHP_JOIN=1``) registers nowhere: it gets the variables that lead it to the running
    job (module docstring) and returns ``None`` (its rank comes from the fail-stop store).

    Args:
        environ: the environment to read and update (default ``os.environ``).
        join: whether this process joins the running job (``fail_stop.join``); ``None``: ``RESIHP_JOIN`` says.

    Raises:
        ConfigError: a bad ``RESIHP_*`` variable, two processes in one place, or ``join`` that contradicts
            how this process already took its ranks.
        TimeoutError: fewer than ``RESIHP_WORLD_SIZE`` processes registered within the timeout.
    """
    env = os.environ if environ is None else environ
    done = env.get(ASSIGNED)
    if done in ("1", "join"):
        if join is not None and join != (done == "join"):
            raise ConfigError(
                f"fail_stop.join={join} but this process already took its ranks "
                + ("as a newcomer (RESIHP_JOIN=1)" if done == "join" else "as one of the job's processes from the rank store")
                + f": under one launcher per process (RESIHP_RANKS_AT) set {JOIN}=1 for a newcomer and leave fail_stop.join unset"
            )
        return None
    request = RankRequest.from_env(env)
    if request is None:
        return None
    if join is not None and join != request.join:
        request = replace(request, join=join)
    if request.join:
        _point_at_running_job(env, request)
        return None
    import torch.distributed as dist

    host, port = request.endpoint
    timeout = datetime.timedelta(seconds=request.timeout_s)
    serves = request.local_index == 0 and _serves_here(host)
    store = dist.TCPStore(host, port, None, serves, timeout, wait_for_workers=False)
    prefix = f"{request.job_id}/"
    me = (request.node_name, request.local_index)
    store.append(prefix + "members", f"{me[0]}:{me[1]},")
    deadline = time.monotonic() + request.timeout_s
    count = store.add(prefix + "count", 1)
    while count < request.world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {count} of RESIHP_WORLD_SIZE={request.world_size} processes registered at "
                               f"RESIHP_RANKS_AT={host}:{port} within {request.timeout_s:.0f} s")
        time.sleep(0.05)
        count = store.add(prefix + "count", 0)
    raw = [m for m in store.get(prefix + "members").decode().split(",") if m]
    members = [(m.rsplit(":", 1)[0], int(m.rsplit(":", 1)[1])) for m in raw]
    place = assign(members, me, request.world_size)
    if place.rank == 0:
        store.set(prefix + "master_port", str(_free_port()))
    store.wait([prefix + "master_port"], timeout)
    master_port = store.get(prefix + "master_port").decode()
    env.update(RANK=str(place.rank), WORLD_SIZE=str(request.world_size), LOCAL_RANK=str(request.local_index),
               LOCAL_WORLD_SIZE=str(request.nproc_per_node), GROUP_RANK=str(place.node_rank),
               MASTER_ADDR=place.first_node, MASTER_PORT=master_port, TORCHELASTIC_RUN_ID=request.job_id,
               TORCHELASTIC_USE_AGENT_STORE="False")
    env[ASSIGNED] = "1"
    store.set(f"{prefix}done/{me[0]}:{me[1]}", "1")
    if serves:  # the host keeps serving until every process has read its rank
        store.wait([f"{prefix}done/{name}:{index}" for name, index in sorted(members)], timeout)
    return place


def _point_at_running_job(env: MutableMapping[str, str], request: RankRequest) -> None:
    """A newcomer's variables: the job's run id, store host and shape, its device, no rank of the job's."""
    nodes = -(-request.world_size // request.nproc_per_node)
    env.update(RANK=str(request.world_size), WORLD_SIZE=str(request.world_size), LOCAL_RANK=str(request.local_index),
               LOCAL_WORLD_SIZE=str(request.nproc_per_node), GROUP_RANK=str(nodes), MASTER_ADDR=request.master_addr,
               TORCHELASTIC_RUN_ID=request.job_id, TORCHELASTIC_USE_AGENT_STORE="False")
    env[ASSIGNED] = "join"
