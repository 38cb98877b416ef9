"""``ElasticRestart``: a job restarted on another world size plans for it before it loads its checkpoint.

Saved with every checkpoint (``state_dict``, a collective like the detector's): the world size, each
rank's device identity (host and local rank, :func:`~resihp_lightning.launcher_env.device_identity`), the
measured per-layer costs (``strategy.layer_profile()``), the detector's speeds keyed by identity, and
the plan in force.

On a resumed ``fit`` (``ckpt_path`` given), ``setup`` runs after the process group exists and before
the strategy builds its pipeline. It reads that state from the checkpoint, and:

* same devices as at the save: the strategy starts under the saved plan;
* another world (a lost machine, a different ``--nnodes``): rank 0 plans for the devices there are
  now from the saved layer costs and the speeds of the devices it recognises (others count as
  healthy), with the exact planner, and broadcasts the plan; the strategy starts under it, so the
  checkpoint's layers load straight into the new layout. The detector's rank-keyed state is dropped
  (the ranks were dealt anew; it warms up again) and the controller forgets its chosen plan (it named
  the old ranks), keeping its cost model and layer profile.

A checkpoint written without this callback still has the strategy's plan: when that plan does not fit
the new world, the layers are taken as equal and every device as healthy.

Under tensor parallelism (``tensor_degree`` t) a planning device is a group: the restarted job starts
with groups of t consecutive ranks, so its world must be a multiple of t (else the restart is refused
by name); a device's identity is its group's first member's, and groups re-split before the save
(another degree, a dropped member) count as another world: the plan is made afresh for the groups of t.

Resume with Lightning's stateful form, ``trainer.ckpt_path = path`` before ``trainer.fit(...)``:
``fit(ckpt_path=path)`` makes the path known only after the strategy is set up (a warning says so).
An explicit ``ResiHPStrategy(plan=...)`` always wins. Events (rank 0 unless noted), written once the
checkpoint is loaded (``on_train_start``): ``job_restarted`` (restart count, checkpoint and its step,
world before and after, devices lost and new, and the start-up's timeline: ``process_started_at``,
``setup_at`` (imports, Trainer and process group done), ``read_s`` and ``plan_s``, ``loaded_at`` (the
strategy built its pipeline and the file is read), ``resumed_at`` (every state restored)) and
``plan_applied`` (``reason: "restart"``) for the plan the job starts under; ``worker_failed`` from every rank whose ``fit`` raised (a lost peer's
collective error, torchrun's SIGTERM), so the log keeps the failure that led to a restart.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from resihp_lightning._logging import user_info, user_warn
from resihp_lightning.callbacks.replan.replan_controller import ReplanController
from resihp_lightning.callbacks.failslow.straggler_detector import StragglerDetector
from resihp_lightning.callbacks.events import EventLog
from resihp_lightning.callbacks.replan.replan_policy import ControllerConfig, build_problem
from resihp_lightning.torch_utils.collectives import all_gather_objects, broadcast_from_zero
from resihp_lightning.config import PlannerConfig, config_from_dict
from resihp_lightning.contract import Replannable, require
from resihp_lightning.launcher_env import (
    agent_store_warning,
    device_identity,
    process_started_at,
    restart_count,
    speeds_by_identity,
    speeds_for_ranks,
)
from resihp_lightning.errors import ConfigError
from resihp_lightning.plan import Plan
from resihp_lightning.solver import solve
from resihp_lightning.telemetry import LayerCost


class ElasticRestart(Callback):
    """Plans a restarted job for the world it restarted on, from the state saved with its checkpoint.

    Args:
        planner: planner options for the restart plan (default: the exact solver, which proves the
            optimum for a few devices in well under a second).
        controller: the cost model's options (p2p, all-reduce, memory, speed quantum) for the problem.
        log_dir: where ``events.jsonl`` goes (default: the trainer's log directory).
        events: an event log to share with other callbacks instead.
    """

    def __init__(
        self,
        *,
        planner: PlannerConfig | Mapping[str, Any] | None = None,
        controller: ControllerConfig | Mapping[str, Any] | None = None,
        log_dir: str | None = None,
        events: EventLog | None = None,
    ) -> None:
        self.planner = PlannerConfig(solver="exact") if planner is None else config_from_dict(PlannerConfig, planner, "planner")
        self.controller = ControllerConfig() if controller is None else ControllerConfig.from_dict(controller)
        self.log_dir = log_dir
        self.events = events
        self.rank = 0
        self.world_changed = False
        #: what the last resume did: checkpoint, worlds, seconds (also logged as ``job_restarted``).
        self.last_restart: dict[str, Any] | None = None
        self._trainer: Any = None

    # ------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        require(trainer.strategy, Replannable, "ElasticRestart")
        self.rank = trainer.global_rank
        self._trainer = trainer
        if self.events is None:
            self.events = EventLog(Path(self.log_dir or trainer.log_dir or trainer.default_root_dir), rank=self.rank)
        self.events.rank = self.rank
        warning = agent_store_warning()
        if warning:
            user_warn(warning)
        if stage != "fit" or trainer.ckpt_path is None:
            return
        setup_at = time.time()
        start = time.perf_counter()
        saved, resihp, step = _read_saved_state(trainer.ckpt_path)
        read_s = time.perf_counter() - start
        identities = all_gather_objects(device_identity())
        strategy = trainer.strategy
        world = trainer.world_size
        degree = strategy.options.tensor_degree
        if world % degree:
            raise ConfigError(f"ElasticRestart: the {world} processes of this restart do not form groups of "
                              f"tensor_degree {degree}; restart on a multiple of {degree} processes")
        if saved is None:
            saved = _without_elastic_state(resihp, world // degree)
        before = saved.get("identities") if saved else None
        starting = _consecutive(degree, world)
        # Without identities (a checkpoint written without this callback) the world differs by construction;
        # under tensor parallelism, so does a save under other groups than the ones this job starts with.
        self.world_changed = saved is not None and (before is None or list(before) != list(identities) or (
            degree > 1 and saved.get("tensor_groups", starting) != starting))
        plan, plan_s = None, 0.0
        explicit = strategy.options.plan is not None
        if saved is not None and not explicit:
            start = time.perf_counter()
            answer: tuple[dict | None, str | None] = (None, None)
            if self.rank == 0:
                try:
                    answer = (self._restart_plan(saved, resihp, identities, strategy, starting).to_dict(), None)
                except Exception as err:  # noqa: BLE001 - every rank must hear of it, not wait for a plan
                    answer = (None, f"{type(err).__name__}: {err}")
            plan_dict, error = broadcast_from_zero(answer)
            if error is not None:
                raise ConfigError(f"ElasticRestart could not plan for the {world} processes of this restart: {error}")
            plan = Plan.from_dict(plan_dict)
            plan_s = time.perf_counter() - start
            strategy.options.plan = plan
        lost = sorted(set(before or ()) - set(identities)) if before is not None else []
        new = sorted(set(identities) - set(before or ())) if before is not None else []
        self.last_restart = {
            "restart_count": restart_count(), "checkpoint": str(trainer.ckpt_path), "checkpoint_step": step,
            "world_before": None if saved is None else saved.get("world_size"), "world_after": world,
            "lost": lost, "new": new, "process_started_at": process_started_at(), "setup_at": setup_at,
            "read_s": read_s, "plan_s": plan_s, "plan": None if plan is None else plan.to_dict(),
        }
        if plan is not None:
            user_info(f"restart: {world} processes (before: {self.last_restart['world_before']}) go on from "
                      f"{trainer.ckpt_path} under {plan.pipeline_degree}x{plan.data_degree}")

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Logged once the checkpoint is in: the event carries the whole start-up's timeline.
        if self.last_restart is None or "resumed_at" in self.last_restart:
            return
        self.last_restart["resumed_at"] = time.time()
        info = self.last_restart
        self._log("job_restarted", info["checkpoint_step"], **{k: v for k, v in info.items() if k != "plan"})
        if info["plan"] is not None:
            self._log("plan_applied", info["checkpoint_step"], plan=info["plan"], reason="restart",
                      migration_seconds=0.0, bytes_moved=0)

    @override
    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.last_restart is not None:
            self.last_restart["loaded_at"] = time.time()  # the file is read; the states are restored next
        else:
            user_warn("ElasticRestart did not see the checkpoint before the strategy was set up, so the job did not "
                      "plan for its world: set `trainer.ckpt_path = path` before `trainer.fit(...)` instead of passing "
                      "`fit(ckpt_path=path)`")
        if not self.world_changed:
            return
        # Runs before any callback's load_state_dict: rank-keyed state of the old world is let go here.
        states = checkpoint.get("callbacks") or {}
        for callback in trainer.callbacks:
            if isinstance(callback, StragglerDetector):
                states.pop(callback.state_key, None)
            elif isinstance(callback, ReplanController) and callback.state_key in states:
                state = dict(states[callback.state_key])
                state.update(chosen=None, awaiting=False, seen_version=0)
                states[callback.state_key] = state

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.events is None:
            return
        text = f"{type(exception).__name__}: {exception}".splitlines()[0][:300]
        self.events.log("worker_failed", trainer.global_step, force=True, rank=self.rank, error=text, at=time.time())

    # -------------------------------------------------------------------------- checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        """World, device identities, layer costs, identity-keyed speeds and plan (collective: every rank)."""
        trainer = self._trainer
        strategy = trainer.strategy
        _, identities = strategy.collective(lambda: all_gather_objects(device_identity()))
        identities = identities or [device_identity()]
        done, profile = strategy.collective(strategy.layer_profile)
        speeds: dict[int, float] = {}
        for callback in trainer.callbacks:
            if isinstance(callback, StragglerDetector):
                speeds = dict(callback.speeds)
        groups = getattr(strategy, "tensor_groups", None)
        state = {
            "world_size": len(identities),
            "identities": identities,
            "profile": [dataclasses.asdict(c) for c in profile] if done and profile else None,
            "speeds": speeds_by_identity(speeds, _device_identities(identities, groups)),
            "plan": strategy.current_plan.to_dict(),
            "micro_batches": strategy.micro_batches,
        }
        if groups is not None:
            state["tensor_groups"] = [list(g) for g in groups.members]
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: ``setup`` used the saved state already."""

    # ---------------------------------------------------------------------------- internals
    def _restart_plan(self, saved: Mapping[str, Any], resihp: Mapping[str, Any], identities: list[str], strategy: Any,
                      groups: list[list[int]]) -> Plan:
        """Rank 0: the saved plan when the devices are the same, else the planner's plan for the devices now
        (``groups``: the tensor-parallel groups the job starts with, one rank each without TP)."""
        micro = strategy.options.micro_batches or saved.get("micro_batches") or resihp.get("micro_batches")
        previous = Plan.from_dict(saved["plan"])
        devices = _device_identities(identities, groups if len(groups[0]) > 1 else None)
        same_devices = saved["identities"] is not None and list(saved["identities"]) == identities and set(
            previous.device_ids) == set(range(len(devices))) and saved.get("tensor_groups", groups) == groups
        if same_devices and sum(r.micro_batches for r in previous.replicas) == micro:
            return previous
        profile = saved.get("profile")
        num_layers = int(resihp.get("num_layers") or len(profile or []))
        costs = [LayerCost(**c) for c in profile] if profile else [LayerCost(i, 1.0, 0.0, 0.0) for i in range(num_layers)]
        speeds = speeds_for_ranks(saved.get("speeds") or {}, devices)
        problem = build_problem(costs, speeds, range(len(devices)), int(micro), self.controller, self.planner,
                                per_replica_bounds=strategy.supports_per_replica_bounds)
        return solve(problem, self.planner)

    def _log(self, event: str, step: int | None, **fields: Any) -> None:
        if self.rank == 0 and self.events is not None:
            self.events.log(event, step, **fields)


def _consecutive(degree: int, world: int) -> list[list[int]]:
    """The groups of ``degree`` consecutive ranks a job of ``world`` processes starts with."""
    return [list(range(g, g + degree)) for g in range(0, world, degree)]


def _device_identities(identities: list[str], groups: Any) -> list[str]:
    """One identity per planning device: each rank's, or under tensor parallelism each group's first member's
    (``groups``: a ``TensorGroups``, a list of rank lists, or ``None``)."""
    if groups is None:
        return list(identities)
    members = groups.members if hasattr(groups, "members") else groups
    return [identities[group[0]] for group in members]


def _read_saved_state(path: Any) -> tuple[dict[str, Any] | None, dict[str, Any], int | None]:
    """This callback's saved state and the strategy's ``resihp`` section of a checkpoint (tensors memory-mapped, not read)."""
    checkpoint = torch.load(str(path), map_location="cpu", weights_only=False, mmap=True)
    states = checkpoint.get("callbacks") or {}
    saved = next((v for k, v in states.items() if k == "ElasticRestart" or str(k).startswith("ElasticRestart")), None)
    return saved, dict(checkpoint.get("resihp") or {}), checkpoint.get("global_step")


def _without_elastic_state(resihp: Mapping[str, Any], world: int) -> dict[str, Any] | None:
    """For a checkpoint written without ``ElasticRestart``: enough to plan when its plan no longer fits.

    Its plan says which devices there were (not which machines, nor the layers' costs: the planner then
    takes the layers as equal); with as many devices as before, the strategy's own options apply.
    """
    if not resihp.get("plan"):
        return None
    saved_plan = Plan.from_dict(resihp["plan"])
    if len(saved_plan.device_ids) == world and set(saved_plan.device_ids) == set(range(world)):
        return None
    return {"world_size": len(saved_plan.device_ids), "identities": None, "plan": resihp["plan"],
            "micro_batches": resihp.get("micro_batches"), "profile": None, "speeds": {}}
