"""Placement: who holds which layer under a plan, and what a switch between two plans moves (no torch).

This is the one home of these facts. The controller prices a re-plan with :func:`plan_transfers`
(bytes of the layers that travel), the strategy's runtime runs exactly those transfers, and the
layer-wise gradient reducer builds one process group per :func:`holder_sets` entry.

Device ids are whatever the plan uses (in this project: the global rank a process started with).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from resihp_lightning.errors import PlanError
from resihp_lightning.plan import Plan


@dataclass(frozen=True)
class Position:
    """A device's place in a plan: its replica, its stage and the layers it holds (``first``..``stop``-1)."""

    replica: int
    stage: int
    first: int
    stop: int

    @property
    def layers(self) -> range:
        return range(self.first, self.stop)


@dataclass(frozen=True)
class Transfer:
    """Layer ``layer`` goes from old holder ``src`` to new holder ``dst``."""

    layer: int
    src: int
    dst: int


def position(plan: Plan, device: int) -> Position:
    """The position of ``device`` in ``plan`` (``KeyError`` when the plan does not use it)."""
    for r, replica in enumerate(plan.replicas):
        for j, member in enumerate(replica.devices):
            if member == device:
                return Position(r, j, replica.bounds[j], replica.bounds[j + 1])
    raise KeyError(f"device {device} is not in the plan")


def num_layers(plan: Plan) -> int:
    """L, the number of layers ``plan`` partitions (checked to be the same in every replica)."""
    if not plan.replicas:
        raise PlanError("plan has no replicas")
    stops = {r.bounds[-1] for r in plan.replicas}
    stages = {len(r.bounds) - 1 for r in plan.replicas}
    if len(stops) != 1 or len(stages) != 1:
        raise PlanError(
            f"every replica must have the same number of stages and layers; got stages {sorted(stages)}, "
            f"layers {sorted(stops)}"
        )
    return stops.pop()


def owners(plan: Plan, layer: int, alive: Collection[int] | None = None) -> list[int]:
    """The devices holding ``layer`` under ``plan`` (one per replica), in replica order.

    Args:
        alive: when given, only these devices count (a dead device's copy is lost).
    """
    found = []
    for replica in plan.replicas:
        for j, device in enumerate(replica.devices):
            if replica.bounds[j] <= layer < replica.bounds[j + 1] and (alive is None or device in alive):
                found.append(device)
    return found


def layer_holders(plan: Plan) -> list[tuple[int, ...]]:
    """For every layer, the devices holding it: one per replica, in replica order."""
    return [tuple(owners(plan, layer)) for layer in range(num_layers(plan))]


def holder_sets(plan: Plan) -> list[tuple[int, ...]]:
    """The distinct holder sets of ``plan``'s layers, in order of their first layer.

    Every process computes the same list from the same plan, so groups created from it in this
    order match everywhere. Sets of one device (D = 1) are included; they need no communication.
    """
    seen: dict[tuple[int, ...], None] = {}
    for holders in layer_holders(plan):
        seen.setdefault(holders, None)
    return list(seen)


def holdings(plan: Plan) -> set[tuple[int, int]]:
    """Every ``(device, layer)`` pair of ``plan``."""
    return {(device, layer) for device in plan.device_ids for layer in position(plan, device).layers}


def plan_transfers(
    old: Plan, new: Plan, layer_weights: Sequence[float], alive: Collection[int] | None = None
) -> list[Transfer]:
    """The transfers that turn ``old`` into ``new`` (deterministic: every process computes the same list).

    A device receives exactly the layers it holds under ``new`` and did not hold under ``old``; each
    such (layer, device) pair is served by one old holder, chosen to spread the weight over them.

    Args:
        old: the plan in force.
        new: the plan to apply.
        layer_weights: a size per layer (parameter count or bytes) used to balance the senders.
        alive: the devices still running; a dead device neither sends nor keeps its layers.

    Raises:
        PlanError: some layer that a device needs has no live holder under ``old`` (it is lost).
    """
    load: dict[int, float] = {}
    transfers = []
    held = holdings(old)
    for replica in new.replicas:
        for stage, device in enumerate(replica.devices):
            for layer in range(replica.bounds[stage], replica.bounds[stage + 1]):
                if (device, layer) in held:
                    continue
                sources = owners(old, layer, alive)
                if not sources:
                    raise PlanError(f"layer {layer} has no live holder under the plan in force; it cannot be restored")
                src = min(sources, key=lambda s: (load.get(s, 0.0), s))
                load[src] = load.get(src, 0.0) + layer_weights[layer]
                transfers.append(Transfer(layer, src, device))
    transfers.sort(key=lambda t: (t.layer, t.dst))
    return transfers


def lost_layers(plan: Plan, alive: Collection[int]) -> list[int]:
    """The layers of ``plan`` that no device in ``alive`` holds."""
    return [layer for layer in range(num_layers(plan)) if not owners(plan, layer, alive)]


def relabel(plan: Plan, mapping: Mapping[int, int]) -> Plan:
    """``plan`` with every device id ``d`` replaced by ``mapping[d]`` (e.g. device id -> process-group rank)."""
    return Plan(tuple(replace(r, devices=tuple(mapping[d] for d in r.devices)) for r in plan.replicas))


def row_offset(plan: Plan, replica: int, micro_batch_size: int) -> int:
    """First row of the global batch that ``replica`` trains on."""
    return sum(r.micro_batches for r in plan.replicas[:replica]) * micro_batch_size


def same_layout(a: Plan, b: Plan) -> bool:
    """Whether ``a`` and ``b`` place the same layers on the same devices (micro-batch counts may differ)."""
    return [(r.devices, r.bounds) for r in a.replicas] == [(r.devices, r.bounds) for r in b.replicas]
