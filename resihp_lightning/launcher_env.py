"""What a restarted process learns from its launcher (torchrun, SLURM); no torch, no Lightning.

* :func:`launcher_shape`: ``Trainer(num_nodes=..., devices=...)`` for the world torchrun formed this
  time (``--nnodes MIN:MAX`` may give fewer nodes after a restart; Lightning requires
  ``num_nodes * devices == WORLD_SIZE``), or srun's allocation;
* :func:`device_identity`: a process's place that survives a restart (host and local rank), since
  global ranks are dealt anew at each rendezvous;
* :func:`speeds_by_identity` / :func:`speeds_for_ranks`: speeds measured before a restart carried to the
  ranks of the new world by identity;
* :func:`restart_count`, :func:`process_started_at`, :func:`agent_store_warning`.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Mapping, Sequence


def under_torchrun() -> bool:
    """Whether this process was started by torchrun's elastic agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ


def under_srun() -> bool:
    """Whether this process is a task of ``srun`` (not an interactive allocation, not under torchrun)."""
    env = os.environ
    return ("SLURM_NTASKS" in env and "SLURM_PROCID" in env and not under_torchrun()
            and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"))


def launcher_shape(devices: int, num_nodes: int) -> tuple[int, int]:
    """``(num_nodes, devices)`` for the Trainer: the launcher's world when one started this process, else the given ones.

    Under srun ``devices`` is ``SLURM_NTASKS_PER_NODE`` and ``num_nodes`` is ``SLURM_NNODES`` (what
    Lightning's SLURM environment checks them against).

    Under torchrun ``devices`` is ``LOCAL_WORLD_SIZE`` (``--nproc-per-node``) and ``num_nodes`` is
    ``WORLD_SIZE / LOCAL_WORLD_SIZE`` (the agents that joined this rendezvous round). With one
    launcher per process (``RESIHP_RANKS_AT`` set) the ranks are taken from the job's rank store
    first (:func:`resihp_lightning.process_ranks.ensure_process_ranks`, collective).
    """
    from resihp_lightning.process_ranks import ensure_process_ranks

    ensure_process_ranks()
    if under_srun():
        env = os.environ
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]  # "2" or "2(x3)"
        nodes = env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", ""))
        if per_node.isdigit() and nodes.isdigit():
            return int(nodes), int(per_node)
        return num_nodes, devices
    if not under_torchrun():
        return num_nodes, devices
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(world // max(local, 1), 1), local


def device_identity() -> str:
    """``"<host>:<local rank>"``: stable across restarts, unlike the global rank."""
    return f"{socket.gethostname()}:{os.environ.get('LOCAL_RANK', '0')}"


def restart_count() -> int:
    """How often the launcher restarted this job's workers (torchrun's or SLURM's count; 0 otherwise)."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return 0


def speeds_by_identity(speeds: Mapping[int, float], identities: Sequence[str]) -> dict[str, float]:
    """Rank-keyed speeds keyed by device identity instead; identities held by several ranks are left out
    (they cannot be told apart after a restart)."""
    unique = {name for name, count in Counter(identities).items() if count == 1}
    return {identities[rank]: float(speed) for rank, speed in speeds.items()
            if rank < len(identities) and identities[rank] in unique}


def speeds_for_ranks(saved: Mapping[str, float], identities: Sequence[str]) -> dict[int, float]:
    """Speeds for the ranks of the new world (``identities[rank]``) from :func:`speeds_by_identity`;
    a device not seen before, or not told apart, is taken as healthy (left out)."""
    counts = Counter(identities)
    return {rank: saved[name] for rank, name in enumerate(identities) if counts[name] == 1 and name in saved}


def process_started_at() -> float | None:
    """When this process was created (Unix seconds, from ``/proc``; ``None`` where there is no ``/proc``)."""
    try:
        with open("/proc/self/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of stat: start time in clock ticks after boot
        with open("/proc/stat") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def agent_store_warning() -> str | None:
    """A warning when torchrun shares its rendezvous store with the workers across restarts.

    torch 2.13's agent hosts one TCP store for every round and the workers' default process group
    keeps the same keys in it, so a restarted worker can read an address its predecessor published
    and fail to connect (measured here: every restart of a 4 -> 3 node job failed that way).
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agents' environment makes each round's rank 0
    host a fresh store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) < 1:
        return None
    return ("torchrun shares its rendezvous store with the workers (TORCHELASTIC_USE_AGENT_STORE=True): after a "
            "restart the new workers can read their predecessors' addresses from it and fail to connect. Launch "
            "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment")
