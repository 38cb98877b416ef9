"""What reacting to a failure costs: constants measured by this project's benchmarks, scaled to a cluster.

Every number here comes from ``benchmarks/README.md`` (measured on the project's CPU machine) or from
a named public source; what depends on the model is scaled by bytes and link bandwidth. The
defaults and where each comes from are listed in docs/evaluation.md ("Costs").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from resihp_lightning.errors import invalid_option


@dataclass(frozen=True)
class CostModel:
    """Costs a policy pays, in seconds unless named otherwise.

    Attributes:
        stop_detect_s: a dead process seen by its peers (``benchmarks/fail_stop.py``: kill -> detected).
        regroup_s: survivors agree and form new groups, at 4 processes (``fail_stop.py``: regroup);
            scaled by ``log2(gpus) / 2`` (a tree of agreements; NVRx reports about 0.5 s per phase at
            scale).
        rebuild_shared_s: engine rebuild of a re-plan with one partition (``reconfigure.py``, 100M
            plain fp32: 0.1-0.2 s).
        rebuild_per_replica_s: the same with per-replica partitions (``reconfigure.py``: 0.86 s).
        slow_detect_iters: iterations of a slowdown before the detector flags it (``detection.py``:
            flagged on the third slow step, every time).
        heal_detect_iters: iterations before a healed device is seen (``detection.py``: within 5).
        plan_s: background solve time by planner devices (``planner.py --scale``: proven optima in
            0.05-0.43 s at 32, 0.29-0.41 s at 256, 0.19-1.39 s at 1024); training goes on meanwhile.
        plan_unproven_s: the solve time when the solver stops at its limit (its ``time_limit_s``).
        restart_fixed_s: rendezvous 5.9 s + process start, imports and set-up 12.0 s
            (``benchmarks/restart.py``).
        comm_init_s_per_gpu: communicator initialisation on a restart, per GPU (MegaScale, NSDI '24:
            1,047 s for 2,048 GPUs with stock initialisation).
        checkpoint_read_gbps: checkpoint read bandwidth per GPU, GB/s (assumed parallel file system).
        checkpoint_every_s: checkpoint interval (the project's SLURM recipe: every 15 minutes); a
            restart loses the work since the last one.
        greyhound_detect_iters: iterations a change-point detector on iteration time needs (assumed).
        greyhound_resplit_s: Greyhound's micro-batch re-split (about 2 s, its paper).
        greyhound_topology_s: Greyhound's topology change (about 60 s, its paper).
        min_relative_gain: the project's controller applies a plan only if it is this much faster
            (``ControllerConfig.min_relative_gain``, 0.05 by default; 0.01 here, as a job at 256+ GPUs
            would set it, where one slow GPU costs only a few percent).
        payback_factor: and only if its saving over ``horizon_s`` is this many times the migration.
        horizon_s: the remaining time the controller assumes when it weighs a migration.
    """

    stop_detect_s: float = 0.154
    regroup_s: float = 0.170
    rebuild_shared_s: float = 0.2
    rebuild_per_replica_s: float = 0.86
    slow_detect_iters: float = 3.0
    heal_detect_iters: float = 5.0
    plan_s: tuple[tuple[int, float], ...] = ((64, 0.43), (512, 0.41), (1 << 30, 1.39))
    plan_unproven_s: float = 10.0
    restart_fixed_s: float = 17.9
    comm_init_s_per_gpu: float = 1047.0 / 2048.0
    checkpoint_read_gbps: float = 1.0
    checkpoint_every_s: float = 900.0
    greyhound_detect_iters: float = 5.0
    greyhound_resplit_s: float = 2.0
    greyhound_topology_s: float = 60.0
    min_relative_gain: float = 0.01
    payback_factor: float = 2.0
    horizon_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("stop_detect_s", "regroup_s", "rebuild_shared_s", "rebuild_per_replica_s", "slow_detect_iters",
                     "heal_detect_iters", "plan_unproven_s", "restart_fixed_s", "comm_init_s_per_gpu",
                     "greyhound_detect_iters", "greyhound_resplit_s", "greyhound_topology_s", "min_relative_gain",
                     "payback_factor", "horizon_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
                raise invalid_option(f"costs.{name}", value, "a finite number >= 0")
        for name in ("checkpoint_read_gbps", "checkpoint_every_s"):
            if not getattr(self, name) > 0:
                raise invalid_option(f"costs.{name}", getattr(self, name), "a number > 0")

    def regroup(self, gpus: int) -> float:
        """Regroup seconds for a job of ``gpus`` GPUs."""
        return self.regroup_s * max(1.0, math.log2(max(gpus, 2)) / 2.0)

    def planning(self, devices: int, proven: bool) -> float:
        """Background solve seconds for ``devices`` planner devices."""
        if not proven:
            return self.plan_unproven_s
        return next(seconds for limit, seconds in self.plan_s if devices <= limit)

    def restart(self, gpus: int, checkpoint_gb_per_gpu: float) -> float:
        """Seconds from a fail-stop to training again after a restart (lost work not included)."""
        return (self.stop_detect_s + self.restart_fixed_s + self.comm_init_s_per_gpu * gpus
                + checkpoint_gb_per_gpu / self.checkpoint_read_gbps)
