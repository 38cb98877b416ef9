"""Who is in the job: the ``Membership`` interface of the strategy, and the plain job's.

The strategy asks its membership for this process's rank, the world size, its device id in plans,
the live devices, and runs its collectives between steps through it. Two kinds:

* :class:`PlainMembership`: a job whose processes all stay (Lightning's DDP ranks; with
  ``tensor_degree`` t a device is a group of t consecutive ranks). Collectives simply run.
* :class:`~resihp_lightning.failstop.surviving_membership.SurvivingMembership` (``fail_stop`` on): the
  ranks of a :class:`~resihp_lightning.failstop.survivors.SurvivingJob`, which can lose processes
  and keep live ones idle as hot spares; a lost peer in a collective regroups the survivors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from resihp_lightning.tensor.tensor_groups import TensorGroups


class Membership(Protocol):
    """What the strategy asks about the job's processes (see the module docstring)."""

    #: Whether lost peers are recovered from in-process.
    survives_failures: bool

    @property
    def rank(self) -> int:
        """This process's rank (under fail-stop recovery: in the current generation of the groups)."""
        ...

    @property
    def world_size(self) -> int:
        """Live processes of the job."""
        ...

    @property
    def device_id(self) -> int:
        """This process's device id in plans (stable across regroups)."""
        ...

    @property
    def process_id(self) -> int:
        """This process's id for the job's lifetime (its global rank at the start)."""
        ...

    #: With tensor parallelism, the groups in force once known (plans name them); ``None`` before.
    tensor_groups: TensorGroups | None

    @property
    def devices_alive(self) -> tuple[int, ...]:
        """The device ids of the job's live processes (hot spares included)."""
        ...

    @property
    def is_spare(self) -> bool:
        """Whether the plan in force leaves this process idle (it mirrors the members' calls)."""
        ...

    def share_idle_probe(self, step: int, probe_ms: float) -> None:
        """A spare: publishes its speed-probe time for the members' rank 0."""
        ...

    def idle_probes(self) -> dict[int, tuple[int, float]]:
        """The spares' latest speed-probe times (device id -> ``(step, ms)``; empty without spares)."""
        ...

    @property
    def collectives_interrupted(self) -> bool:
        """Whether this process skips the collectives of the current step."""
        ...

    @property
    def last_recovery(self) -> Any:
        """The last in-process recovery (``None`` before one)."""
        ...

    @property
    def last_admission(self) -> Any:
        """The last newcomers admitted to the job (``AdmissionNote``; ``None`` before any)."""
        ...

    @property
    def failure_detector(self) -> Any:
        """The failure detector of the job's groups (``None`` for a plain job)."""
        ...

    @property
    def listeners(self) -> list[Callable[[str, dict[str, Any]], None]]:
        """Called before the process exits unrecoverably."""
        ...

    @property
    def recovery_listeners(self) -> list[Callable[[], None]]:
        """Called on every survivor inside a recovery."""
        ...

    @property
    def commit(self) -> Callable[[], None] | None:
        """The optimizer step's commit vote for the runtime (``None``: no vote)."""
        ...

    def rank_map(self) -> dict[int, int] | None:
        """Device id -> rank in the current default group (``None``: the identity)."""
        ...

    def collective(self, run: Callable[[], Any]) -> tuple[bool, Any]:
        """Runs a collective between steps: ``(True, result)``, or ``(False, None)`` when skipped."""
        ...

    def run_recovering(self, work: Callable[[], None]) -> None:
        """Runs ``work`` (collective) to its end, again on the survivors after a lost peer."""
        ...

    def next_call(self) -> int:
        """Numbers a strategy call whose result spares mirror."""
        ...

    def mirrored(self, call: int) -> Any:
        """A spare: what the members' ``call`` returned."""
        ...

    def publish(self, call: int, result: Callable[[], Any]) -> None:
        """Records what ``result()`` gives as a call's result for the spares (where there are any; else
        ``result`` is not called)."""
        ...

    def sync_with_spares(self, everyone: bool, sync: Callable[[int], None]) -> bool:
        """End of fit: runs ``sync(rank)`` on a group that the spares join; whether it did."""
        ...

    def end_call(self, clean: bool) -> None:
        """A trainer call ended (its teardown): ``clean`` when no exception left it (then, under fail-stop, the
        process says goodbye at its exit)."""
        ...


class PlainMembership:
    """A job whose processes all stay: Lightning's ranks, with ``tensor_degree`` ranks per device.

    Args:
        rank: returns this process's global rank (the Lightning strategy's own).
        world_size: returns the number of processes.
        tensor_degree: processes per planning device (1: no tensor parallelism).
    """

    survives_failures = False

    def __init__(self, rank: Callable[[], int], world_size: Callable[[], int], tensor_degree: int = 1) -> None:
        self._rank = rank
        self._world_size = world_size
        self.tensor_degree = tensor_degree
        #: The tensor-parallel groups in force once they differ from the starting ones (a re-split).
        self.tensor_groups: TensorGroups | None = None

    @property
    def rank(self) -> int:
        return self._rank()

    @property
    def world_size(self) -> int:
        return self._world_size()

    @property
    def device_id(self) -> int:
        """The global rank; with ``tensor_degree`` t, the tensor-parallel group's (global rank // t, or its id
        among the groups in force after a re-split)."""
        if self.tensor_groups is not None:
            group = self.tensor_groups.group_of(self.rank)
            assert group is not None  # re-splits keep every rank in a group
            return group
        return self.rank // self.tensor_degree

    @property
    def process_id(self) -> int:
        """This process's id for the job's lifetime: its global rank."""
        return self.rank

    @property
    def devices_alive(self) -> tuple[int, ...]:
        if self.tensor_groups is not None:
            return tuple(range(self.tensor_groups.groups))
        return tuple(range(self.world_size // self.tensor_degree))

    is_spare = False
    collectives_interrupted = False

    def share_idle_probe(self, step: int, probe_ms: float) -> None:
        """Never called: a plain job has no idle process."""

    def idle_probes(self) -> dict[int, tuple[int, float]]:
        return {}
    last_recovery = None
    last_admission = None
    failure_detector = None
    commit = None

    @property
    def listeners(self) -> list[Callable[[str, dict[str, Any]], None]]:
        return []

    @property
    def recovery_listeners(self) -> list[Callable[[], None]]:
        return []

    def rank_map(self) -> dict[int, int] | None:
        return None

    def collective(self, run: Callable[[], Any]) -> tuple[bool, Any]:
        return True, run()

    def run_recovering(self, work: Callable[[], None]) -> None:
        work()

    def next_call(self) -> int:
        return 0

    def mirrored(self, call: int) -> Any:
        raise RuntimeError("a job without fail_stop has no hot spares to mirror calls")

    def publish(self, call: int, result: Callable[[], Any]) -> None:
        return None

    def sync_with_spares(self, everyone: bool, sync: Callable[[int], None]) -> bool:
        return False

    def end_call(self, clean: bool) -> None:
        return None
