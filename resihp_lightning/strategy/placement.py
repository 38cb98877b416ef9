"""Where a rank sits in a plan (pure Python; no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from resihp_lightning.plan import Plan


@dataclass(frozen=True)
class Position:
    """A rank's place in a plan: its replica, its stage and the layers it holds (``first``..``stop``-1)."""

    replica: int
    stage: int
    first: int
    stop: int

    @property
    def layers(self) -> range:
        return range(self.first, self.stop)


def position(plan: Plan, rank: int) -> Position:
    """The position of ``rank`` in ``plan`` (``KeyError`` when the plan does not use it)."""
    for r, replica in enumerate(plan.replicas):
        for j, device in enumerate(replica.devices):
            if device == rank:
                return Position(r, j, replica.bounds[j], replica.bounds[j + 1])
    raise KeyError(f"rank {rank} is not in the plan")


def owners(plan: Plan, layer: int) -> list[int]:
    """The ranks holding ``layer`` under ``plan`` (one per replica), in replica order."""
    found = []
    for replica in plan.replicas:
        for j, device in enumerate(replica.devices):
            if replica.bounds[j] <= layer < replica.bounds[j + 1]:
                found.append(device)
    return found


def row_offset(plan: Plan, replica: int, micro_batch_size: int) -> int:
    """First row of the global batch that ``replica`` trains on."""
    return sum(r.micro_batches for r in plan.replicas[:replica]) * micro_batch_size
