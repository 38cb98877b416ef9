"""Fail-stop recovery inside the strategy: the step's commit vote, the survivors' plan, the record.

With ``ResiHPStrategy(fail_stop=FailStopConfig(...))`` the job's process groups come from an
:class:`~resihp_lightning.resilience.world.ElasticWorld`. When a rank dies or hangs, the survivors'
in-flight collectives are aborted, they regroup into a new default group, plan for themselves
(:func:`survivor_plan`), restore the layers they now need from live holders
(:meth:`~resihp_lightning.strategy.runtime.PipelineRuntime.recover`) and redo the interrupted step
with the same batch. The step is redone exactly because of :class:`StepCommit`: the optimizer step
of the layer-wise engine applies only once every member has voted, so a failure before that point
leaves no rank with an updated model, and after it every survivor has stepped.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from resihp_lightning._logging import user_warn
from resihp_lightning.config import SOLVERS, PlannerConfig
from resihp_lightning.contract import DeviceConditions
from resihp_lightning.errors import PlanError, invalid_option
from resihp_lightning.plan import Device, Layer, Plan, Problem
from resihp_lightning.telemetry import LayerCost

#: Exit status when the job cannot recover in-process (a launcher's restart policy takes over).
UNRECOVERABLE_EXIT_CODE = 75


@dataclass(frozen=True, kw_only=True)
class FailStopConfig:
    """Options of in-process fail-stop recovery.

    Attributes:
        detect_timeout_s: a rank whose heartbeat is silent this long is dead (> 2 x ``interval_s``).
        interval_s: seconds between heartbeats and checks.
        progress_timeout_s: a rank whose training step has not advanced for this long is evicted as
            hung (``None``: only silent ranks; set it above the longest step, evaluation and
            checkpoint).
        join_timeout_s: how long the survivors wait for a member that neither joined the regroup nor
            was reported dead.
        regroup_timeout_s: bound of one regroup.
        solver: planner backend for the survivors' plan (``exact`` is instant at small scale).
        min_data_degree: the fewest replicas the survivors' plan should keep (>= 1; default 2), so that
            the next death also loses no layer. Where no such plan fits (too few survivors, memory),
            the survivors run the best plan with fewer replicas and a warning says so.
        exit_code: process exit status when recovery is impossible (a layer lost with every holder,
            the store lost, this rank evicted).
        kill_evicted: SIGKILL a hung or silent rank the survivors left out when it runs on the machine
            of the survivors' leader (pid and start time checked), so that it releases its device and
            its launcher can exit; ``false`` leaves it frozen (e.g. to attach a debugger to it).
        store_port: the rendezvous store host's port. ``None`` (one machine): a free port, found by the
            job's processes through a file in the temporary directory. Several machines need a fixed
            port; the host then runs on node 0 at ``$MASTER_ADDR`` (that machine is a single point of
            failure: losing it ends the job, for a restart).
    """

    detect_timeout_s: float = 1.0
    interval_s: float = 0.2
    progress_timeout_s: float | None = None
    join_timeout_s: float = 30.0
    regroup_timeout_s: float = 120.0
    solver: str = "exact"
    min_data_degree: int = 2
    exit_code: int = UNRECOVERABLE_EXIT_CODE
    kill_evicted: bool = True
    store_port: int | None = None

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise invalid_option("fail_stop.solver", self.solver, SOLVERS)
        for name in ("interval_s", "join_timeout_s", "regroup_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise invalid_option(f"fail_stop.{name}", value, "seconds > 0")
        if not isinstance(self.detect_timeout_s, (int, float)) or not self.detect_timeout_s >= 2 * self.interval_s:
            raise invalid_option("fail_stop.detect_timeout_s", self.detect_timeout_s, f"seconds >= 2 x interval_s ({2 * self.interval_s:g})")
        if self.progress_timeout_s is not None and not (
            isinstance(self.progress_timeout_s, (int, float)) and self.progress_timeout_s >= 2 * self.interval_s
        ):
            raise invalid_option("fail_stop.progress_timeout_s", self.progress_timeout_s, "null or seconds >= 2 x interval_s")
        if self.join_timeout_s >= self.regroup_timeout_s:
            raise invalid_option("fail_stop.join_timeout_s", self.join_timeout_s, f"< regroup_timeout_s ({self.regroup_timeout_s:g})")
        if not isinstance(self.min_data_degree, int) or isinstance(self.min_data_degree, bool) or self.min_data_degree < 1:
            raise invalid_option("fail_stop.min_data_degree", self.min_data_degree, "an integer >= 1")
        if not isinstance(self.kill_evicted, bool):
            raise invalid_option("fail_stop.kill_evicted", self.kill_evicted, "true or false")
        if not isinstance(self.exit_code, int) or not 1 <= self.exit_code <= 255:
            raise invalid_option("fail_stop.exit_code", self.exit_code, "an integer 1..255")
        if self.store_port is not None and (not isinstance(self.store_port, int) or not 1 <= self.store_port <= 65535):
            raise invalid_option("fail_stop.store_port", self.store_port, "null or a TCP port 1..65535")

    @classmethod
    def from_value(cls, value: Any) -> FailStopConfig | None:
        """``None``/``False``: off; ``True``: defaults; a dict or a config: as given."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - {f.name for f in fields(cls)}
            if unknown:
                raise invalid_option(f"fail_stop.{sorted(unknown)[0]}", value[sorted(unknown)[0]], [f.name for f in fields(cls)])
            return cls(**value)
        raise invalid_option("fail_stop", value, "null, true, false, a FailStopConfig or its dict")

    def world_config(self, backend: str, collective_timeout_s: float, node_rank: int = 0) -> Any:
        """The :class:`~resihp_lightning.resilience.world.WorldConfig` these options describe."""
        from resihp_lightning.resilience.detector import DetectorConfig
        from resihp_lightning.resilience.store import StoreConfig
        from resihp_lightning.resilience.world import WorldConfig

        store = StoreConfig() if self.store_port is None else StoreConfig(port=self.store_port, spawn=node_rank == 0)
        return WorldConfig(
            store=store,
            backend=backend,
            collective_timeout_s=collective_timeout_s,
            join_timeout_s=self.join_timeout_s,
            regroup_timeout_s=self.regroup_timeout_s,
            kill_evicted=self.kill_evicted,
            detector=DetectorConfig(
                interval_s=self.interval_s, timeout_s=self.detect_timeout_s, progress_timeout_s=self.progress_timeout_s
            ),
        )


@dataclass(frozen=True)
class RecoveryRecord:
    """One in-process recovery, as this rank measured it.

    Times are ``time.monotonic()`` marks (comparable across the processes of one machine) or
    durations in seconds.

    Attributes:
        step: the training step that was interrupted and redone.
        generation: the new generation's number.
        failed: original rank -> how it failed (``exited``, ``silent``, ``hung``, ``left out``, ...).
        members: the survivors the plan uses (original ranks).
        plan: the plan the survivors run.
        detected_at: when the first of the failures was detected (by any process).
        aborted_at: when this rank aborted the old generation's collectives.
        regroup_s: abort to the new default group formed.
        plan_s: layer profile gathered and the survivors' plan agreed.
        restore_s: engine rebuilt and the layers new to each survivor received (``bytes_moved``).
        redo_s: the interrupted step run again on the survivors.
        spares: live processes the plan leaves idle (original ranks).
        conditions: the known slow devices and links the survivors' plan was made with.
    """

    step: int
    generation: int
    failed: dict[int, str]
    members: tuple[int, ...]
    plan: Plan
    detected_at: float
    aborted_at: float
    regroup_s: float
    plan_s: float
    restore_s: float
    bytes_moved: int
    redo_s: float = 0.0
    spares: tuple[int, ...] = ()
    conditions: DeviceConditions = field(default_factory=DeviceConditions)

    @property
    def abort_s(self) -> float:
        """Detection to this rank's abort."""
        return max(0.0, self.aborted_at - self.detected_at)

    @property
    def total_s(self) -> float:
        """Detection to the redone step's end on this rank."""
        return self.abort_s + self.regroup_s + self.plan_s + self.restore_s + self.redo_s


class StepCommit:
    """The commit vote of each optimizer step, over the rendezvous store (called by the engine).

    Every member adds its vote once its gradients are final; the first member that sees all votes
    writes ``commit``, the first that sees the generation aborted first writes ``abort``, and every
    member follows whichever was written first. So either every survivor steps or none does.
    """

    def __init__(self, world: Any) -> None:
        self.world = world
        self._count = 0
        self._generation = -1

    def __call__(self) -> None:
        world = self.world
        gen = world.current
        if gen.number != self._generation:
            self._generation, self._count = gen.number, 0
        self._count += 1
        store = world.store.control
        base = f"commit/gen{gen.number}/{self._count}"
        votes = int(store.add(f"{base}/votes", 1))
        while True:
            if votes >= gen.world_size:
                verdict = "commit"
            elif world.aborted:
                verdict = "abort"
            else:
                time.sleep(0.0005)
                votes = int(store.add(f"{base}/votes", 0))
                continue
            final = store.compare_set(f"{base}/decision", "", verdict)
            final = final.decode() if isinstance(final, bytes) else str(final)
            if final == "commit":
                return
            world.abort(f"step {self._count} of generation {gen.number} was not committed", generation=gen)
            world.check()  # raises PeerFailure


def fill_missing_costs(profile: Sequence[LayerCost]) -> list[LayerCost]:
    """Layer costs with unmeasured compute (0) replaced by the mean of the measured ones (or 1 ms)."""
    measured = [c.compute_ms for c in profile if c.compute_ms > 0]
    default = sum(measured) / len(measured) if measured else 1.0
    return [c if c.compute_ms > 0 else LayerCost(c.index, default, c.static_mb, c.activation_mb) for c in profile]


def survivor_plan(
    profile: Sequence[LayerCost],
    members: Sequence[int],
    micro_batches: int,
    per_replica_bounds: bool,
    solver: str,
    memory_mb: float | Mapping[int, float] | None = None,
    min_data_degree: int = 1,
    conditions: DeviceConditions | None = None,
) -> Plan:
    """The best plan for the survivors.

    ``conditions``: the slow devices and links known before the failure, and the measured transfer
    costs (``strategy.device_conditions``, which the controller keeps current); ``None``: every
    survivor healthy and transfers free.
    ``memory_mb``: every survivor's budget (one number for all, or per device id; ``None``: unlimited).
    The survivors take over the lost ranks' layers, so a plan that does not fit a device's memory is
    never chosen (``InfeasibleError`` when none fits). ``min_data_degree``: the plan keeps at least this
    many replicas where one fits (else the best plan with fewer, and a warning).

    The plan may leave survivors idle (``allow_exclude``) when that is faster, e.g. seven survivors
    whose memory needs two stages run 2 x 3 with one spare instead of a 7 x 1 pipeline.

    Raises:
        PlanError / InfeasibleError: no plan fits (too few micro-batches for the survivors, ...).
    """
    from resihp_lightning.errors import ResiHPError
    from resihp_lightning.solver import solve

    costs = fill_missing_costs(profile)
    if isinstance(memory_mb, Mapping):
        memory = {int(d): float(mb) for d, mb in memory_mb.items()}
    else:
        fixed = math.inf if memory_mb is None else float(memory_mb)
        memory = {int(d): fixed for d in members}
    known = conditions or DeviceConditions()
    problem = Problem(
        layers=tuple(Layer(c.compute_ms, c.static_mb, c.activation_mb) for c in costs),
        devices=tuple(Device(d, known.speeds.get(d, 1.0), memory.get(int(d), math.inf),
                             link_speed=known.link_speeds.get(d, 1.0)) for d in members),
        micro_batches=micro_batches,
        p2p_ms=known.p2p_ms,
        allreduce_ms=known.allreduce_ms,
        shared_partition=not per_replica_bounds,
        allow_exclude=True,
    )
    config = PlannerConfig(solver=solver)
    wanted = dataclasses.replace(problem, min_data_degree=min_data_degree)
    try:
        plan, problem = solve(wanted, config), wanted
    except ResiHPError:
        if min_data_degree <= 1:
            raise
        user_warn(f"ResiHPStrategy: no plan with {min_data_degree} replicas fits the {len(members)} survivors; "
                  "they run with fewer, so a further death may lose layers (recovery then needs a restart)")
        plan = solve(problem, config)
    if len(plan.device_ids) < len(members):
        # Idle survivors only where that is strictly faster: on a tie, every device keeps working.
        try:
            everyone = solve(dataclasses.replace(problem, allow_exclude=False), config)
        except ResiHPError:
            everyone = None
        if everyone is not None and everyone.iteration_ms <= plan.iteration_ms * (1 + 1e-9):
            plan = everyone
    if not set(plan.device_ids) <= set(members):
        raise PlanError(f"the survivors' plan uses devices {sorted(plan.device_ids)} outside {sorted(members)}")
    return plan


@dataclass
class RecoveryClock:
    """Marks of one recovery on this rank's monotonic clock."""

    started: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> float:
        now = time.monotonic()
        self.marks[name] = now - self.started - sum(self.marks.values())
        return self.marks[name]
