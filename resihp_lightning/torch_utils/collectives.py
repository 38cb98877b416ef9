"""Two object collectives over the default group (the callbacks' state sync, the sharded save's agreement);
a single process (no process group) answers for itself. And the release of process groups a part of the
runtime created."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def _distributed() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (collective)."""
    dist = _distributed()
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_from_zero(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (collective)."""
    dist = _distributed()
    if dist is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def release_process_groups(groups: Iterable[Any]) -> None:
    """Destroys this process's handles of ``groups`` (local; entries that are no process group here, or are
    gone already with their world, are skipped)."""
    import torch.distributed as dist

    for group in groups:
        if isinstance(group, dist.ProcessGroup):
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):  # already gone with the world group
                pass
