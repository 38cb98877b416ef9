"""A training step on this process: the step runners' interface, its typed outcome, the plain job's runner.

The strategy runs each training step through the :class:`StepRunner` of its mode: :class:`PlainSteps`
for a job whose processes all stay (here), ``SurvivingSteps`` for one that can lose them
(:mod:`resihp_lightning.failstop.surviving_steps`). A runner puts a requested plan in force, has this
process run its replica's share of the global batch (or, on a process that runs none, takes the
members' result) and returns a :class:`StepOutcome`; logging and the rest of Lightning's side stay in
the strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from resihp_lightning.placement import Position
from resihp_lightning.plan import Plan
from resihp_lightning.runtime.batching import MicroBatch, SplitBatch
from resihp_lightning.runtime.runtime_state import RuntimeState
from resihp_lightning.telemetry import MicroBatchStats, StepStats

#: What ``pipeline_loss`` logged in a step: name -> (the mean over the global batch, the caller's options).
LoggedValues = Mapping[str, tuple[float, dict[str, Any]]]


@dataclass(frozen=True)
class ReplicaShare:
    """This process's part of a training step: its replica's micro-batches through its stage.

    Attributes:
        loss: what the engine returned (the global batch's loss).
        busy: this process's busy time per micro-batch (ms; shorter than ``items`` when the engine
            measured fewer).
        items: the replica's micro-batches.
        position: this process's replica, stage and layers under the plan it ran.
        tensor_wait_ms: its time in tensor-parallel all-reduces during the step.
        tensor_degree: its tensor-parallel group's degree (1: none).
    """

    loss: Tensor
    busy: Sequence[float]
    items: Sequence[MicroBatch]
    position: Position
    tensor_wait_ms: float = 0.0
    tensor_degree: int = 1

    def stats(self, step: int, device: int, step_ms: float) -> StepStats:
        """The step's statistics as this process reports them (``device``: its id in plans)."""
        pos, busy = self.position, self.busy
        return StepStats(
            step=step,
            rank=device,
            replica=pos.replica,
            stage=pos.stage,
            layers=(pos.first, pos.stop),
            micro_batches=tuple(
                MicroBatchStats(busy[i] if i < len(busy) else 0.0, mb.tokens, mb.sum_len_sq) for i, mb in enumerate(self.items)
            ),
            step_ms=step_ms,
            tensor_wait_ms=self.tensor_wait_ms,
            tensor_degree=self.tensor_degree,
        )


@dataclass(frozen=True)
class StepOutcome:
    """What a training step left on this process.

    Attributes:
        loss: the global batch's loss, a scalar on this process's device.
        share: what this process ran; ``None`` when it ran nothing (a hot spare, or a process that a
            recovery took in after the members had committed the step).
        logs: with no ``share``: what the members' ``pipeline_loss`` logged, to log the same. With a
            share it is ``None``: the values are still spread over the last stages (the strategy
            gathers them).
    """

    loss: Tensor
    share: ReplicaShare | None = None
    logs: LoggedValues | None = None

    @classmethod
    def ran(cls, share: ReplicaShare) -> StepOutcome:
        """The outcome of a step this process ran its share of."""
        return cls(loss=share.loss.detach().float().reshape(()), share=share)

    @classmethod
    def taken(cls, loss: float, logs: LoggedValues, device: torch.device) -> StepOutcome:
        """The outcome of a step another process computed: its loss and logged values."""
        return cls(loss=torch.tensor(loss, device=device), logs=dict(logs))


class StepRunner(Protocol):
    """Runs the training steps of one kind of job (see the module docstring)."""

    def run(self, split: SplitBatch, plan: Plan | None, device: torch.device) -> StepOutcome:
        """Puts ``plan`` (a checked requested plan, or ``None``) in force and runs this process's part of
        the step on the global batch ``split``; ``device`` is where the loss goes."""
        ...

    def record_logs(self, logs: LoggedValues) -> None:
        """What this step's ``pipeline_loss`` calls logged (a step this process ran its share of)."""
        ...

    def finish(self, step: int) -> None:
        """The strategy is done with training step ``step`` (the trainer's global step)."""
        ...


class PlainSteps:
    """The steps of a job whose processes all stay: apply the requested plan, run this replica's share.

    Args:
        state: the strategy's runtime state (the switch is recorded in ``last_migration``).
        share: runs this process's replica share of a global batch under the plan in force.
    """

    def __init__(self, state: RuntimeState, share: Callable[[SplitBatch], ReplicaShare]) -> None:
        self.state = state
        self.share = share

    def run(self, split: SplitBatch, plan: Plan | None, device: torch.device) -> StepOutcome:
        if plan is not None:
            self.state.last_migration = self.state.require().switch(plan)
        return StepOutcome.ran(self.share(split))

    def record_logs(self, logs: LoggedValues) -> None:
        return None

    def finish(self, step: int) -> None:
        return None
