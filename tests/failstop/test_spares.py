"""Hot spares end to end: plans that leave live ranks idle run exactly, and later plans take them back.

Real gloo processes under ``harness.run_job``. Every rank, spares included, must report the one-process
reference's losses at every step and end ``fit`` with the reference's trained weights in its
LightningModule (``gather_weights="all"``): a spare mirrors the members' steps and receives the
weights at the end.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from resihp_lightning.testing.toy_jobs import EPOCH_STEPS as STEPS
from resihp_lightning.testing.toy_jobs import (
    DEPTH,
    M,
    MBS,
    assert_survivors_match_reference,
    build_class,
    make_data,
    make_val_loader,
)


def _plan(replicas: list[tuple[list[int], list[int], int]]) -> dict:
    return {"replicas": [{"devices": d, "bounds": b, "micro_batches": m} for d, b, m in replicas]}


# After step 1: a 3-stage pipeline on ranks 2, 0, 1 (rank 3 idle). After step 3: 2 x 2 with per-replica
# bounds that takes rank 3 back.
LEAVE_OUT = _plan([([2, 0, 1], [0, 2, 5, DEPTH], M)])
TAKE_BACK = _plan([([3, 1], [0, 3, DEPTH], 2), ([0, 2], [0, 5, DEPTH], 2)])
# After step 1: 1 x 3 on ranks 0, 1, 2 (rank 3 idle), for the kill below.
DATA_PARALLEL_3 = _plan([([0], [0, DEPTH], 2), ([1], [0, DEPTH], 1), ([2], [0, DEPTH], 1)])


def _job(
    rank: int, world: int, run_dir: str, schedule: dict, victims: dict, steps: int, validate: bool = False,
    after_fit: bool = False,
) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.testing.harness import last_words
    from resihp_lightning.plan import Plan
    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    class Schedule(pl.Callback):
        """Requests the scheduled plans (on every rank) and records what each rank saw."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.spare_at: list[int] = []
            self.logged: list[float] = []
            self.val_losses: list[tuple[int, bool, float]] = []  # (step, was a spare, val_loss)

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self.val_losses.append((trainer.global_step, trainer.strategy.is_spare,
                                        float(trainer.callback_metrics["val_loss"])))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            strategy = trainer.strategy
            if victims.get(strategy.device_id) != trainer.global_step:
                return
            def die(module=None, args=None):
                last_words(run_dir, rank, died_at=time.monotonic())
                os.kill(os.getpid(), signal.SIGKILL)

            layers = strategy.local_layers()
            if not layers:  # a spare runs no schedule: it dies at the step's start
                die()
            next(iter(layers.values())).register_forward_pre_hook(die)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            strategy = trainer.strategy
            self.losses.append(float(outputs["loss"]))
            self.logged.append(float(trainer.callback_metrics["mse_in_pipeline"]))
            if strategy.is_spare:
                self.spare_at.append(trainer.global_step - 1)
            plan = schedule.get(trainer.global_step - 1)
            if plan is not None:
                strategy.request_plan(Plan.from_dict(plan))

    recorder = Schedule()
    x, y = make_data()
    strategy = ResiHPStrategy(micro_batch_size=MBS, pipeline_degree=2, fail_stop=FailStopConfig())
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[recorder],
        val_check_interval=2 if validate else None, limit_val_batches=1.0 if validate or after_fit else 0,
    )
    model = build_class()()
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=M * MBS), make_val_loader() if validate else None)
    later = {}
    if after_fit:  # set up again, a spare included: it mirrors validate and predict too
        later["spare"] = strategy.is_spare
        later["val"] = trainer.validate(model, make_val_loader(), verbose=False)[0]["val_loss"]
        if strategy.is_spare:
            # The spare polls slowly, so the members publish predict's last result, return and exit before
            # it looks: it must take the published result, not fail on the members' exits.
            strategy._membership.job.mirror.poll_s = 1.0
        later["pred"] = torch.cat(trainer.predict(model, DataLoader(TensorDataset(x[:10], y[:10]), batch_size=5)))
    return {
        "after_fit": later,
        "losses": recorder.losses,
        "logged": recorder.logged,
        "spare_at": recorder.spare_at,
        "val_losses": recorder.val_losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "recovery": strategy.last_recovery,
        "plan": strategy.current_plan.to_dict(),
        "spares": list(strategy._membership.job.spares),
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_plan_leaves_a_rank_idle_and_a_later_plan_takes_it_back_exactly():
    from resihp_lightning.testing.harness import run_job

    outcome = run_job(_job, 4, timeout=180, wait_for=[0, 1, 2, 3], schedule={1: LEAVE_OUT, 3: TAKE_BACK}, victims={},
                      steps=STEPS, validate=True)
    assert_survivors_match_reference(outcome, [0, 1, 2, 3], STEPS)
    values = outcome.values()
    assert values[3]["spare_at"] == [2, 3], values[3]["spare_at"]  # idle for the steps under LEAVE_OUT
    assert all(not values[r]["spare_at"] for r in (0, 1, 2))
    assert values[0]["plan"]["replicas"] == TAKE_BACK["replicas"] and values[0]["spares"] == []
    # What pipeline_loss logged reaches the spare too (the same number as on the members).
    for rank in (1, 2, 3):
        assert values[rank]["logged"] == pytest.approx(values[0]["logged"], abs=1e-6), rank
    # Validation every 2 steps; the one after step 4 (global step 4) runs while rank 3 is a spare: it reports
    # the members' val_loss.
    steps_validated = [step for step, _, _ in values[0]["val_losses"]]
    assert steps_validated == [2, 4, 6], values[0]["val_losses"]
    assert [spare for _, spare, _ in values[3]["val_losses"]] == [False, True, False]
    for rank in (1, 2, 3):
        assert [v for *_, v in values[rank]["val_losses"]] == pytest.approx([v for *_, v in values[0]["val_losses"]], abs=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_spare_replaces_a_killed_rank_and_the_job_goes_on_exactly():
    """Rank 3 idle from step 2; rank 1 killed inside step 3: the survivors take the spare back."""
    from resihp_lightning.testing.harness import run_job

    outcome = run_job(_job, 4, timeout=180, wait_for=[0, 2, 3], schedule={1: DATA_PARALLEL_3}, victims={1: 3},
                      steps=STEPS)
    assert_survivors_match_reference(outcome, [0, 2, 3], STEPS)
    values = outcome.values()
    record = values[0]["recovery"]
    assert record.step == 3 and 1 in record.failed and 3 not in record.failed
    assert 3 in record.plan.device_ids, record.plan  # the spare holds layers again
    assert values[3]["spare_at"] == [2], values[3]["spare_at"]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_spare_that_dies_costs_the_members_nothing():
    """Rank 3 idle from step 2 and killed at step 3: no recovery, the members finish exactly."""
    from resihp_lightning.testing.harness import run_job

    outcome = run_job(_job, 4, timeout=180, wait_for=[0, 1, 2], schedule={1: LEAVE_OUT}, victims={3: 3}, steps=STEPS)
    assert_survivors_match_reference(outcome, [0, 1, 2], STEPS)
    values = outcome.values()
    # No training step was redone. The members learn of the spare's death from their detectors (about
    # 0.2 s), or, when the run ends sooner, from the end-of-fit weight sync it would have joined: then
    # they regroup there, without it, and sync again.
    for rank in (0, 1, 2):
        record = values[rank]["recovery"]
        assert record is None or (record.step == STEPS and set(record.failed) == {3} and record.redo_s == 0.0), record
    assert values[0]["spares"] == []
    if values[0]["recovery"] is None:
        assert values[0]["plan"]["replicas"] == LEAVE_OUT["replicas"]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_spare_at_the_end_of_fit_gets_the_trained_weights_and_mirrors_validate_and_predict():
    """Rank 3 idle from step 2 to the end: it joins the end-of-fit weight sync, and a later
    ``trainer.validate`` / ``trainer.predict`` (set up again) gives it the members' results."""
    from resihp_lightning.testing.harness import run_job

    outcome = run_job(_job, 4, timeout=180, wait_for=[0, 1, 2, 3], schedule={1: LEAVE_OUT}, victims={}, steps=STEPS,
                      after_fit=True)
    assert_survivors_match_reference(outcome, [0, 1, 2, 3], STEPS)  # the spare's module holds the trained weights too
    values = outcome.values()
    assert [values[r]["after_fit"]["spare"] for r in range(4)] == [False, False, False, True]
    for rank in (1, 2, 3):
        assert values[rank]["after_fit"]["val"] == pytest.approx(values[0]["after_fit"]["val"], abs=1e-7)
        assert torch.equal(values[rank]["after_fit"]["pred"], values[0]["after_fit"]["pred"])
