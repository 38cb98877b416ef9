"""In-process recovery from lost training processes: detect, abort, regroup the survivors.

The pieces, one job each:

* :mod:`.store` / :mod:`.store_host`: a rendezvous store in a process of its own, so that no
  worker's death (rank 0's included) takes it down; :mod:`.store_auth` signs its values with a
  per-job secret so that only the job writes it;
* :mod:`.etcd_store` (:mod:`.etcd_config`, :mod:`.etcd_gateway`, :mod:`.etcd_admin`): the same
  store on a replicated etcd cluster, which no single machine's loss takes down;
* :mod:`.failure_detector`: failure detection in two levels (:mod:`.machine_board`): processes on a machine
  through ``/proc`` (:mod:`.procs`) and a board of local files, machines through one heartbeat each in
  that store; progress (hangs) from the beats;
* :mod:`.sockets`: which TCP connections belong to a generation's groups; cutting them releases a
  blocked gloo collective;
* :mod:`.abortable_waits`: waits on ``torch.distributed`` work that the abort ends where cutting the
  connections does not (a gloo send queued for writing);
* :mod:`.failures`: the errors a lost peer or store raises (``PeerFailure``, ``PeerFinished`` ...);
* :mod:`.membership`: how the survivors agree on the next generation's members;
* :mod:`.joining`: how a process started after the job began registers and waits to be admitted;
* :mod:`.world`: :class:`~.world.ElasticWorld`, the lifecycle of the job's groups, generation by generation;
* :mod:`.frameworks`: forgetting DeepSpeed's cached groups after a regroup.

Tests and benchmarks run jobs whose members die on purpose with ``resihp_lightning/testing/harness.py``.

``import resihp_lightning.resilience`` does not import torch; the names below load on first use.
"""

from __future__ import annotations

from resihp_lightning._lazy import lazy_getattr

_LAZY = {
    "ElasticWorld": "resihp_lightning.resilience.world",
    "WorldConfig": "resihp_lightning.resilience.world",
    "Generation": "resihp_lightning.resilience.world",
    "is_transport_error": "resihp_lightning.resilience.world",
    "FailureDetectorConfig": "resihp_lightning.resilience.failure_detector",
    "FailureDetector": "resihp_lightning.resilience.failure_detector",
    "Failure": "resihp_lightning.resilience.failure_detector",
    "StoreConfig": "resihp_lightning.resilience.store",
    "RendezvousStore": "resihp_lightning.resilience.store",
    "SocketTracker": "resihp_lightning.resilience.sockets",
    "reset_deepspeed": "resihp_lightning.resilience.frameworks",
    "ResilienceError": "resihp_lightning.resilience.failures",
    "PeerFailure": "resihp_lightning.resilience.failures",
    "PeerFinished": "resihp_lightning.resilience.failures",
    "AbortedWait": "resihp_lightning.resilience.abortable_waits",
    "AbortableWaits": "resihp_lightning.resilience.abortable_waits",
    "EvictedError": "resihp_lightning.resilience.failures",
    "RegroupError": "resihp_lightning.resilience.failures",
    "StoreUnavailable": "resihp_lightning.resilience.failures",
    "AdmissionError": "resihp_lightning.resilience.failures",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
