"""How much memory this rank's device can give the model: the planner's per-device ``memory_mb``.

* **CUDA**: what the process could hold without touching other processes' memory: the device's free
  memory plus what this process's caching allocator already reserves (the model's current layout
  lives there and is given up by a re-plan), times :data:`CUDA_USABLE_FRACTION` (the CUDA context,
  NCCL buffers and allocator fragmentation are not in the planner's model).
* **CPU**: a process's share of the machine: ``MemTotal`` of ``/proc/meminfo`` divided by the
  processes of the job on this machine (``LOCAL_WORLD_SIZE``), times :data:`CPU_USABLE_FRACTION`.
  Where ``/proc/meminfo`` cannot be read the budget is unlimited.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

#: Share of (free + reserved-by-this-process) CUDA memory the planner may fill.
CUDA_USABLE_FRACTION = 0.9
#: Share of a process's slice of host memory the planner may fill on CPU.
CPU_USABLE_FRACTION = 0.8

_MB = 2**20


def memory_budget_mb(device: torch.device, local_world_size: int | None = None) -> float:
    """This process's memory budget for the model's state and activations on ``device``, in MB.

    Args:
        device: the rank's device.
        local_world_size: processes of the job on this machine (default: ``LOCAL_WORLD_SIZE`` or 1).
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        return (free + reserved) * CUDA_USABLE_FRACTION / _MB
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    total = _host_memory_bytes()
    if total is None:
        return math.inf
    return total / max(local, 1) * CPU_USABLE_FRACTION / _MB


def _host_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
