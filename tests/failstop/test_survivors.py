"""Fail-stop recovery end to end: a rank SIGKILLed inside a pipeline step, the survivors finish exactly.

Real gloo processes under ``harness.run_job`` (``resihp_lightning/testing/harness.py``) (a rank that dies is an outcome, not a
harness failure; the job is bounded and never hangs). The survivors' losses and final weights must
equal a one-process run of the same model and data over the whole run: the interrupted step is
redone once on the survivors, with the same global batch.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from resihp_lightning.testing.toy_jobs import EPOCH_STEPS as STEPS
from resihp_lightning.testing.toy_jobs import M, MBS, assert_survivors_match_reference, build_class, make_data


def _job(
    rank: int, world: int, run_dir: str, victims: dict, steps: int, how: str = "kill", between: bool = False,
    **strategy_kwargs,
) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.testing.harness import last_words
    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    class KillInsideStep(pl.Callback):
        """At its step, the victim dies (``how="kill"``: SIGKILL) or freezes (``"stop"``: SIGSTOP) inside the
        schedule: at the forward of its 2nd micro-batch."""

        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            strategy = trainer.strategy
            if between or victims.get(strategy.device_id) != trainer.global_step:
                return
            layer = next(iter(strategy.local_layers().values()))
            seen = [0]

            def die(module, args):
                seen[0] += 1
                if seen[0] == 2:
                    last_words(run_dir, rank, died_at=time.monotonic())
                    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)

            layer.register_forward_pre_hook(die)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))
            # ``between``: the victim dies after its step, before the callbacks' collectives of that step.
            if between and victims.get(trainer.strategy.device_id) == trainer.global_step - 1:
                last_words(run_dir, rank, died_at=time.monotonic())
                os.kill(os.getpid(), signal.SIGKILL)

    recorder = KillInsideStep()
    x, y = make_data()
    strategy = ResiHPStrategy(micro_batch_size=MBS, fail_stop=FailStopConfig(), **strategy_kwargs)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[recorder, *_callbacks(between)], default_root_dir=run_dir,  # the callbacks' events.jsonl
    )
    model = build_class()()
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=M * MBS))
    return {
        "losses": recorder.losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "recovery": strategy.last_recovery,
        "plan": strategy.current_plan.to_dict(),
        "conditions": strategy.device_conditions,
    }


def _callbacks(with_controller: bool) -> list:
    """The detector and the controller, whose own collectives a lost rank can interrupt."""
    if not with_controller:
        return []
    from resihp_lightning.callbacks import ReplanController, StragglerDetector

    return [StragglerDetector(warmup_steps=1, fit_steps=2), ReplanController(planner={"solver": "exact"})]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_sigkill_inside_a_step_costs_one_step_not_the_job():
    from resihp_lightning.testing.harness import run_job

    outcome = run_job(_job, 4, timeout=180, wait_for=[0, 1, 3], victims={2: 2}, steps=STEPS, pipeline_degree=2)
    assert_survivors_match_reference(outcome, [0, 1, 3], STEPS)
    record = outcome.values()[0]["recovery"]
    assert record.step == 2 and record.members == (0, 1, 3) and 2 in record.failed
    assert sorted(record.plan.device_ids) == [0, 1, 3]
    died_at = outcome.ranks[2].last_words["died_at"]
    assert record.detected_at - died_at < 2.0, "a killed rank is detected within about a second"


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_losing_rank_0_then_another_rank_goes_on_exactly():
    """Rank 0 (whose process hosted the store in a plain Lightning job) dies, then rank 3: 4 -> 3 -> 2."""
    from resihp_lightning.testing.harness import run_job

    outcome = run_job(_job, 4, timeout=180, wait_for=[1, 2], victims={0: 1, 3: 3}, steps=STEPS, pipeline_degree=2)
    assert_survivors_match_reference(outcome, [1, 2], STEPS)
    record = outcome.values()[1]["recovery"]
    assert record.step == 3 and record.members == (1, 2) and 3 in record.failed and record.generation == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_frozen_rank_is_evicted_and_the_job_goes_on_exactly():
    """SIGSTOP: the process is alive but silent; it is evicted after the heartbeat timeout, and the
    survivors' leader SIGKILLs it (``fail_stop.kill_evicted``): a frozen process would otherwise hold its
    device and, when it is Lightning's launching process, keep the job's command from ever ending."""
    import signal

    from resihp_lightning.testing.harness import run_job

    outcome = run_job(_job, 4, timeout=180, wait_for=[0, 2, 3], victims={1: 2}, steps=STEPS, how="stop", pipeline_degree=2)
    assert_survivors_match_reference(outcome, [0, 2, 3], STEPS)
    record = outcome.values()[0]["recovery"]
    assert record.members == (0, 2, 3) and 1 in record.failed
    assert record.detected_at - outcome.ranks[1].last_words["died_at"] < 3.0
    frozen = outcome.ranks[1]
    assert frozen.status == "died" and frozen.exitcode == -signal.SIGKILL, outcome.describe()  # not the harness


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_lost_layer_ends_the_job_with_the_restart_status_and_no_hang():
    """D = 1: the dead rank's layers have no other holder; every survivor exits with fail_stop.exit_code."""
    from resihp_lightning.testing.harness import run_job
    from resihp_lightning.failstop.fail_stop_config import UNRECOVERABLE_EXIT_CODE

    outcome = run_job(_job, 4, timeout=120, wait_for=[0, 1, 3], victims={2: 1}, steps=STEPS, pipeline_degree=4)
    assert outcome.wall_s < 100, outcome.describe()
    codes = {r.rank: r.exitcode for r in outcome.ranks}
    assert codes == {0: UNRECOVERABLE_EXIT_CODE, 1: UNRECOVERABLE_EXIT_CODE, 2: -9, 3: UNRECOVERABLE_EXIT_CODE}, outcome.describe()


def test_fail_stop_options_are_checked_by_name():
    from resihp_lightning.errors import ConfigError
    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.strategy.options import StrategyOptions

    assert StrategyOptions(fail_stop=True).fail_stop == FailStopConfig()
    assert StrategyOptions(fail_stop={"detect_timeout_s": 2.0}).fail_stop.detect_timeout_s == 2.0
    assert StrategyOptions().fail_stop is None and StrategyOptions(fail_stop=False).fail_stop is None
    for bad, pattern in (
        ({"detect_timeout_s": 0.1}, r"`fail_stop.detect_timeout_s`; allowed: seconds >= 2 x interval_s"),
        ({"solver": "magic"}, r"`fail_stop.solver`; allowed: 'cpsat', 'pulp', 'exact'"),
        ({"exit_code": 0}, r"`fail_stop.exit_code`"),
        ({"store_port": 70000}, r"`fail_stop.store_port`"),
        ({"kill_evicted": "yes"}, r"`fail_stop.kill_evicted`; allowed: true or false"),
        ({"join_timeout_s": 200.0}, r"`fail_stop.join_timeout_s`; allowed: < regroup_timeout_s"),
        ({"detect_s": 1.0}, r"`fail_stop.detect_s`"),
    ):
        with pytest.raises(ConfigError, match=pattern):
            StrategyOptions(fail_stop=bad)
    with pytest.raises(ConfigError, match="`fail_stop`"):
        StrategyOptions(fail_stop="yes")


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_rank_lost_between_steps_interrupts_the_callbacks_collectives_not_the_job():
    """Rank 1 dies after step 2 and before the detector's all-gather: the survivors regroup there, skip the
    rest of that step's collectives, re-synchronise the detector and controller, and go on exactly."""
    from resihp_lightning.testing.harness import run_job

    outcome = run_job(_job, 4, timeout=180, wait_for=[0, 2, 3], victims={1: 2}, steps=STEPS, between=True,
                      pipeline_degree=2)
    assert_survivors_match_reference(outcome, [0, 2, 3], STEPS)
    record = outcome.values()[0]["recovery"]
    assert record.members == (0, 2, 3) and 1 in record.failed and record.redo_s == 0.0  # nothing to redo
    # The controller hands its planner options to the strategy with the device conditions: a recovery plans
    # the survivors under them (tests/test_problem_builder.py shows an option changing the survivors' plan).
    from resihp_lightning.config import PlannerConfig

    assert all(result["conditions"].planner == PlannerConfig(solver="exact") for result in outcome.values().values())
