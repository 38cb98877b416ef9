"""Admitting newcomers: processes started after the job began join it at a step boundary, as hot spares.

The store side (ranks, registration, the admission record's key) is
:mod:`resihp_lightning.resilience.joining`. The job's side, here:

1. **Noticing.** Every training step's commit decision carries how many newcomers have registered as
   ready (:class:`~.step_commit.StepCommit`: one store read per step, by the member whose vote completes
   the count), so every member learns the same number at the same step.
2. **Admitting.** At the start of the next training step every member admits the newcomers it has not
   admitted yet (:meth:`Admissions.admit`): all of them at once, recorded in the job
   (:meth:`~resihp_lightning.resilience.world.ElasticWorld.admit`), no process group re-formed, nothing
   recomputed. The members' rank 0 writes each newcomer's :class:`AdmissionRecord`: the generation and
   the job's processes, the plan in force, M, the layer sizes and the optimizer's parameter groups,
   the strategy call the newcomer mirrors first, and the Lightning side's state (loop counters, data
   position, LR schedulers and the optimizer's settings, callbacks). The same step's records for the spares carry the admission too
   (:class:`Admitted`), so spares, and spares taken in at that step, know of it.
3. **Using them.** The newcomer mirrors that step like any spare; the members plan for every live
   process at that step (the survivors' planner, with one more healthy device) and request that plan
   for the next step, whose reshape takes the newcomer in: its layers, their optimizer state, and
   everything else arrives as for any spare taken back.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from resihp_lightning.resilience.joining import read_info, ready_count, ready_ranks, write_admission


@dataclass(frozen=True)
class Admitted:
    """Newcomers admitted at one step boundary, as the members' records tell the spares.

    Attributes:
        ranks: the newcomers' original ranks.
        considered: entries of the job's ready list handled so far (this admission's included).
    """

    ranks: tuple[int, ...]
    considered: int


@dataclass(frozen=True)
class AdmissionNote:
    """An admission as the members saw it, for the event log (``FailStopReporter``: ``newcomers_admitted``).

    Attributes:
        step: the training step at whose start the newcomers were admitted (they mirror it as hot spares).
        ranks: the newcomers' original ranks.
        live: every live process of the job from then on (members and spares, the newcomers included).
    """

    step: int
    ranks: tuple[int, ...]
    live: tuple[int, ...]


@dataclass(frozen=True)
class AdmissionRecord:
    """What a newcomer takes from the members when they admit it.

    Attributes:
        generation: the generation in force (the newcomer enters it as a spare).
        members: its members (original ranks).
        job: every live process of the job, members and spares, the newcomers included.
        call: the strategy call the newcomer mirrors first (the training step of the admission).
        considered: entries of the job's ready list handled with this admission.
        newcomers_ready: the newcomer count of the last commit decision (what the members hold).
        plan: the plan in force (:meth:`~resihp_lightning.plan.Plan.to_dict`).
        micro_batches: M.
        layer_sizes: every layer's parameter count (what balances the senders of a migration).
        group_of: parameter key -> the optimizer's parameter group, over every layer (``None``: no optimizer).
        lightning: the Lightning side's state (:mod:`resihp_lightning.strategy.newcomer_state`).
    """

    generation: int
    members: tuple[int, ...]
    job: tuple[int, ...]
    call: int
    considered: int
    newcomers_ready: int
    plan: dict[str, Any]
    micro_batches: int | None
    layer_sizes: list[int]
    group_of: dict[str, int] | None
    lightning: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(self, buffer)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, payload: bytes) -> AdmissionRecord:
        record = torch.load(io.BytesIO(payload), weights_only=False)
        if not isinstance(record, cls):
            raise TypeError(f"not an admission record: {type(record).__name__}")
        return record


class Admissions:
    """Which ready newcomers this process knows to be admitted, and the admitting itself.

    Every process of the job holds the same numbers: members update them at the same step boundary,
    spares from the members' records, a recovery hands a surviving member's to everyone, and a
    newcomer takes them from its admission record.

    Args:
        world: the job's :class:`~resihp_lightning.resilience.world.ElasticWorld`.
        commit: the step's commit vote (its decisions carry the newcomer count).
    """

    def __init__(self, world: Any, commit: Any) -> None:
        self.world = world
        self.commit = commit
        #: Entries of the ready list already admitted.
        self.considered = 0

    def due(self) -> bool:
        """Whether the last commit counted newcomers not admitted yet (no store access)."""
        return self.commit.newcomers_ready > self.considered

    def admit(self, record: Callable[[Admitted], AdmissionRecord] | None) -> Admitted:
        """A member, at the step boundary where :meth:`due` holds on every member: admits the newcomers.

        Args:
            record: on the members' rank 0, builds the newcomers' admission record (``None`` elsewhere).
        """
        store = self.world.store.control
        upto = self.commit.newcomers_ready
        admitted = Admitted(tuple(ready_ranks(store, self.considered, upto)), upto)
        self.apply(admitted)
        if record is not None and admitted.ranks:
            payload = record(admitted).to_bytes()
            for rank in admitted.ranks:
                write_admission(store, rank, payload)
        return admitted

    def apply(self, admitted: Admitted) -> bool:
        """Records an admission (a spare reading the members' record); whether it was new here."""
        new = admitted.considered > self.considered
        self.world.admit(admitted.ranks)
        self.considered = max(self.considered, admitted.considered)
        return new

    def budgets(self, ranks: tuple[int, ...]) -> dict[int, float]:
        """The memory budgets (MB) the newcomers among ``ranks`` registered with (store reads)."""
        store = self.world.store.control
        out: dict[int, float] = {}
        for rank in ranks:
            memory = read_info(store, rank).get("memory_mb")
            if memory is not None:
                out[rank] = float(memory)
        return out

    def state(self) -> tuple[int, int]:
        """``(considered, newcomer count)``: what a recovery hands from a surviving member to everyone."""
        return self.considered, self.commit.newcomers_ready

    def adopt(self, state: tuple[int, int] | list[int]) -> None:
        """Takes a surviving member's (or an admission record's) numbers."""
        self.considered, self.commit.newcomers_ready = int(state[0]), int(state[1])


def newcomer_counter(world: Any) -> Callable[[], int]:
    """What the commit vote reads: how many newcomers have registered as ready (one store read)."""
    return lambda: ready_count(world.store.control)


def newcomer_info(memory_mb: float | None) -> Mapping[str, Any]:
    """What a newcomer registers about itself."""
    return {"memory_mb": memory_mb}
