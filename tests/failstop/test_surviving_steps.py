"""The fail-stop step runner on a fake job (one process, no groups): what a member, a spare and a process
taken in after the members' update return, and what they leave for the spares and the recovery."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from resihp_lightning.failstop.spares import Mirrored
from resihp_lightning.failstop.surviving_membership import SurvivingMembership
from resihp_lightning.failstop.surviving_steps import CommittedStep, SurvivingSteps
from resihp_lightning.runtime.runtime_state import RuntimeState
from resihp_lightning.runtime.training_steps import PlainSteps, ReplicaShare, StepOutcome

CPU = torch.device("cpu")


class FakeMirror:
    def __init__(self, waiting=None):
        self.calls, self.waiting, self.published = 0, waiting, []

    def next_call(self):
        self.calls += 1
        return self.calls

    def wait(self, call):
        return self.waiting

    def publish(self, call, value, plan):
        self.published.append((call, value))


class FakeJob:
    def __init__(self, spare=False, finished=None, waiting=None):
        self.is_spare, self.rank, self.spares, self.members = spare, 0, (3,), (0, 1)
        self.mirror = FakeMirror(waiting)
        self.finished, self.progressed = finished, []

    def run_step(self, attempt, recover):
        return attempt()

    def take_finished(self, call):
        result, self.finished = self.finished, None
        return result

    def progress(self, step):
        self.progressed.append(step)


class FakeRuntime:
    def __init__(self):
        self.plan = SimpleNamespace(device_ids=(0, 1))
        self.switched = []

    def switch(self, plan):
        self.switched.append(plan)
        return "record"


def share(split):
    return ReplicaShare(loss=torch.tensor([1.25]), busy=[3.0], items=[SimpleNamespace(tokens=4, sum_len_sq=16)],
                        position=SimpleNamespace(replica=0, stage=1, first=2, stop=4))


def runner(job):
    state = RuntimeState(runtime=FakeRuntime(), micro_batches=2)
    membership = SurvivingMembership(job, state, global_step=lambda: 0, conditions=lambda: None, on_regrouped=lambda: None)
    return SurvivingSteps(membership, state, share), membership, state


def test_a_member_runs_its_share_and_publishes_the_committed_step_with_its_logs():
    job = FakeJob()
    steps, membership, _ = runner(job)
    outcome = steps.run(split=None, plan=None, device=CPU)
    assert outcome.share is not None and outcome.logs is None and float(outcome.loss) == 1.25
    assert outcome.share.stats(7, 1, 9.0).layers == (2, 4)
    assert membership.step_result == CommittedStep(loss=1.25) and not membership.collectives_interrupted
    steps.record_logs({"acc": (0.5, {})})
    steps.finish(7)
    assert job.mirror.published == [(1, CommittedStep(loss=1.25, logs={"acc": (0.5, {})}))]
    assert job.progressed == [8]


def test_a_spare_takes_the_members_result_and_skips_the_collectives():
    result = CommittedStep(loss=2.5, logs={"acc": (1.0, {"prog_bar": True})})
    job = FakeJob(spare=True, waiting=Mirrored(result, None))
    steps, membership, _ = runner(job)
    outcome = steps.run(split=None, plan=None, device=CPU)
    assert outcome.share is None and float(outcome.loss) == 2.5 and outcome.logs == dict(result.logs)
    assert membership.step_result is result and membership.collectives_interrupted
    assert membership.collective(lambda: 1 / 0) == (False, None)  # a spare has no group: skipped


def test_a_process_taken_in_after_the_members_update_returns_their_result_and_skips_the_step_collectives():
    result = CommittedStep(loss=0.75)
    job = FakeJob(finished=result)
    steps, membership, _ = runner(job)
    outcome = steps.run(split=None, plan=None, device=CPU)
    assert outcome.share is None and float(outcome.loss) == 0.75
    assert membership.interrupted and membership.collectives_interrupted
    steps.finish(3)
    assert job.mirror.published == [(1, result)] and job.progressed == [4]


def test_a_plan_on_the_same_devices_switches_once():
    job = FakeJob()
    steps, _, state = runner(job)
    plan = SimpleNamespace(device_ids=(1, 0))
    steps.run(split=None, plan=plan, device=CPU)
    assert state.runtime.switched == [plan] and state.last_migration == "record"


def test_plain_steps_switch_then_run_the_share():
    state = RuntimeState(runtime=FakeRuntime())
    plan = SimpleNamespace(device_ids=(0, 1))
    outcome = PlainSteps(state, share).run(split=None, plan=plan, device=CPU)
    assert isinstance(outcome, StepOutcome) and outcome.loss.shape == () and state.last_migration == "record"
