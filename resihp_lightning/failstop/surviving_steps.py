"""``SurvivingSteps``: the training steps of a job that can lose ranks (the strategy's step runner under ``fail_stop``).

Each step runs inside :meth:`~resihp_lightning.failstop.survivors.SurvivingJob.run_step`: a step that
lost a peer before its commit point is redone on the survivors, under their plan. In an attempt a
member applies the requested plan (a reshape when the plan takes in or leaves out devices, which
every process of the job then joins) and runs its share; a hot spare runs nothing and returns what
the members' step returned (:class:`~resihp_lightning.failstop.spares.CallMirror`), or joins a
reshape. Each step's result is a :class:`CommittedStep`: the members' rank 0 publishes it for the
spares, and a recovery hands it to a spare it takes in after the members' update.

A training step also admits the newcomers the last commit counted (:mod:`~resihp_lightning.failstop.admission`):
the members admit them before anything else in the step, and once they have, plan for every live
process and request that plan for the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from resihp_lightning.plan import Plan
from resihp_lightning.failstop.spares import Reshape
from resihp_lightning.failstop.surviving_membership import SurvivingMembership
from resihp_lightning.runtime.batching import SplitBatch
from resihp_lightning.runtime.runtime_state import RuntimeState
from resihp_lightning.runtime.training_steps import LoggedValues, ReplicaShare, StepOutcome


@dataclass(frozen=True)
class CommittedStep:
    """A training step's result as the members committed it, for the processes that did not compute it.

    Attributes:
        loss: the global batch's loss.
        logs: what ``pipeline_loss`` logged (name -> (value, options)).
    """

    loss: float
    logs: LoggedValues = field(default_factory=dict)


class SurvivingSteps:
    """The step runner of a job with fail-stop recovery (see the module docstring).

    Args:
        membership: the job's membership (its recovery, reshapes, mirrored calls and the step's state).
        state: the strategy's runtime state.
        share: runs this process's replica share of a global batch under the plan in force.
    """

    def __init__(self, membership: SurvivingMembership, state: RuntimeState,
                 share: Callable[[SplitBatch], ReplicaShare]) -> None:
        self.membership = membership
        self.state = state
        self.share = share
        self._call = 0  # this step's number among the strategy's mirrored calls
        self._plan: Plan | None = None  # the requested plan, until an attempt puts it in force
        self._taken: CommittedStep | None = None  # the result an attempt took from the members
        self._plan_newcomers = False  # newcomers were admitted in this step: plan for them before its share

    def run(self, split: SplitBatch, plan: Plan | None, device: torch.device) -> StepOutcome:
        membership = self.membership
        membership.begin_step()
        self._call = membership.next_call()
        self._plan, self._taken, self._plan_newcomers = plan, None, False
        outcome = membership.job.run_step(lambda: self._attempt(split, device), self._recover)
        if outcome.share is not None:
            membership.step_result = CommittedStep(loss=float(outcome.loss))
        else:  # mirrored from the members (a spare), or committed before a recovery took this process in
            membership.step_result = self._taken
            membership.interrupted = not membership.is_spare  # taken in by a recovery after the members' update
        return outcome

    def record_logs(self, logs: LoggedValues) -> None:
        result = self.membership.step_result
        if result is not None:
            self.membership.step_result = replace(result, logs=logs)

    def finish(self, step: int) -> None:
        self.membership.publish(self._call, lambda: self.membership.step_result)
        self.membership.job.progress(step + 1)

    def _attempt(self, split: SplitBatch, device: torch.device) -> StepOutcome:
        """One attempt at the step: a member applies the requested plan and runs its share; a spare takes
        what the members' step returned, or joins a reshape."""
        membership, job, runtime = self.membership, self.membership.job, self.state.require()
        while True:
            finished = job.take_finished(self._call)
            if finished is not None:  # the members committed this step before a recovery took us in
                return self._take(finished, device)
            if job.is_spare:
                self._plan = None  # the members' rank 0 announces plan changes; a spare's own request is moot
                got = job.mirror.wait(self._call)
                if got.admitted is not None and membership.apply_admission(got.admitted):
                    self._plan_newcomers = True  # if the reshape below takes it in, it plans with the members
                if isinstance(got, Reshape):
                    if runtime.plan.layout_key() != got.old.layout_key():
                        runtime.follow(got.old)
                    membership.reshape(got.plan)
                    continue
                if got.plan is not None:
                    runtime.follow(got.plan)
                return self._take(got.value, device)
            if membership.admit_newcomers(self._call):  # due on every member alike (the last commit said so)
                self._plan_newcomers = True
            plan, self._plan = self._plan, None
            if plan is not None:
                if membership.uses_every_device(plan):
                    self.state.last_migration = runtime.switch(plan)
                else:
                    if job.rank == 0:
                        job.mirror.announce(self._call, runtime.plan, plan)
                    membership.reshape(plan)
                    continue
            if self._plan_newcomers:
                self._plan_newcomers = False
                membership.plan_with_newcomers()  # collective over the members; in force from the next step
            return StepOutcome.ran(self.share(split))

    def _recover(self, failure: Exception) -> None:
        # The survivors' plan covers every live process, newcomers included: no plan for them is due any
        # more (and a spare taken in may not know of one).
        self._plan_newcomers = False
        self.membership.recover(failure)

    def _take(self, result: CommittedStep, device: torch.device) -> StepOutcome:
        self._taken = result
        return StepOutcome.taken(result.loss, result.logs or {}, device)
