"""A replacement joins the running job in-process: admitted at a step boundary, used by the next plan, exact.

Real gloo processes under ``harness.run_job``: the exactness job on 4 processes (2 x 2); rank 1 is
SIGKILLed inside step 1 and the survivors recover on 3; then a fifth process, started with
``RESIHP_JOIN=1`` and the dead rank's ``LOCAL_RANK`` (the user's script unchanged), joins. The members
wait at the start of step 2 until it has registered, so that the steps are fixed: step 2's commit
counts it, step 3 admits it (it mirrors step 3 as a hot spare, and the members plan for 4 devices),
step 4's reshape takes it in. Every process, the newcomer included, must report the one-process
reference's loss at every step it saw and end ``fit`` with the reference's trained weights, and the
newcomer's Lightning counters (global step, LR schedule) and its straggler detector's state must be the
members'.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from resihp_lightning.testing.toy_jobs import EPOCH_STEPS as STEPS
from resihp_lightning.testing.toy_jobs import assert_survivors_match_reference, reference_fit

WORLD, VICTIM, KILL_STEP, GATE_STEP = 4, 1, 1, 2
NEWCOMER = WORLD  # the harness's index of the extra process; its claimed rank is the same (4)


def _job(rank: int, world: int, run_dir: str) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    import lightning.pytorch as pl

    from resihp_lightning.callbacks import FailStopReporter, StragglerDetector
    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.testing.harness import last_words
    from resihp_lightning.testing.toy_jobs import M, MBS, build_class, make_data

    start_file = Path(run_dir) / "start-newcomer"
    if rank == NEWCOMER:  # started "later": once the survivors have recovered
        deadline = time.monotonic() + 60
        while not start_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    started_fit = time.monotonic()

    class Story(pl.Callback):
        def __init__(self) -> None:
            self.steps: list[dict] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            strategy = trainer.strategy
            if strategy.device_id == VICTIM and trainer.global_step == KILL_STEP:
                def die(module=None, args=None):
                    last_words(run_dir, rank, died_at=time.monotonic())
                    os.kill(os.getpid(), signal.SIGKILL)

                next(iter(strategy.local_layers().values())).register_forward_pre_hook(die)
            if trainer.global_step == GATE_STEP and strategy.device_id != NEWCOMER:
                deadline = time.monotonic() + 60  # the members wait here until the newcomer has registered
                while strategy.newcomers_waiting() < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            strategy = trainer.strategy
            self.steps.append({
                "step": trainer.global_step - 1, "loss": float(outputs["loss"]), "spare": strategy.is_spare,
                "devices": sorted(strategy.current_plan.device_ids), "alive": list(strategy.devices_alive),
                "lr": trainer.optimizers[0].param_groups[0]["lr"], "batch_idx": batch_idx, "at": time.monotonic(),
            })
            if strategy.device_id == 0 and trainer.global_step == KILL_STEP + 1:
                start_file.touch()  # the survivors recovered: start the replacement

    story = Story()
    # A callback whose state_dict is collective (the admission reads every member's) and that resyncs at take-in.
    detector = StragglerDetector(warmup_steps=1, fit_steps=2)
    x, y = make_data()
    strategy = ResiHPStrategy(micro_batch_size=MBS, pipeline_degree=2, fail_stop=FailStopConfig())
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[story, detector, FailStopReporter(log_dir=run_dir)], limit_val_batches=0)
    model = build_class()()
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=M * MBS))
    job = strategy._membership.job
    return {
        "device": strategy.device_id,
        "steps": story.steps,
        "losses": [s["loss"] for s in story.steps],
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "global_step": trainer.global_step,
        "scheduler_epoch": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
        "clock": dict(job.admission_clock),
        "detector": detector.core.state_dict(),
        "started_fit": started_fit,
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_replacement_joins_is_admitted_at_a_step_boundary_and_the_next_plan_uses_it_exactly(tmp_path):
    from resihp_lightning.testing.harness import run_job

    from resihp_lightning.callbacks import read_events

    outcome = run_job(_job, WORLD, timeout=180, wait_for=[0, 2, 3, NEWCOMER], run_dir=str(tmp_path),
                      joiners=[{"RESIHP_JOIN": "1", "LOCAL_RANK": str(VICTIM)}])
    values = outcome.values()
    assert sorted(values) == [0, 2, 3, NEWCOMER], outcome.describe()
    newcomer = values.pop(NEWCOMER)
    assert_survivors_match_reference(outcome_without(outcome, NEWCOMER), [0, 2, 3], STEPS)

    # A rank above every rank the job had; admitted at the start of step 3 (it mirrors step 3 as a spare),
    # taken in by the plan of step 4.
    assert newcomer["device"] == WORLD
    story = newcomer["steps"]
    assert [s["step"] for s in story] == [3, 4, 5], story
    assert [s["spare"] for s in story] == [True, False, False], story
    assert [s["batch_idx"] for s in story] == [3, 4, 5]
    members = values[0]["steps"]
    assert [s["alive"] for s in members] == [[0, 1, 2, 3]] + [[0, 2, 3]] * 2 + [[0, 2, 3, 4]] * 3, members
    assert WORLD not in members[3]["devices"] and WORLD in members[4]["devices"], members  # the next plan uses it
    assert all(s["devices"] == members[i + 3]["devices"] for i, s in enumerate(story))

    # Exact: the newcomer's losses at the steps it saw and its trained weights are the reference's.
    ref_losses, _, ref_params = reference_fit(STEPS, None)
    assert newcomer["losses"] == pytest.approx(ref_losses[3:], abs=1e-6)
    for key, want in ref_params.items():
        assert (newcomer["state"][key] - want).abs().max() <= 1e-6, key
    # Lightning's counters and LR schedule went on from the members'.
    assert newcomer["global_step"] == STEPS and newcomer["scheduler_epoch"] == STEPS
    assert [s["lr"] for s in story] == [s["lr"] for s in members[3:]]
    assert newcomer["detector"] == values[0]["detector"]  # its detector took the members' state at take-in
    clock = newcomer["clock"]
    assert clock["registered"] <= clock["admitted"] < story[1]["at"]
    # The event log (and with it the report) has the admission: who joined, at which step, the world after.
    admitted = [(e["step"], e["ranks"], e["world"]) for e in read_events(tmp_path)
                if e["event"] == "newcomers_admitted"]
    assert admitted == [(3, [WORLD], 4)], admitted


def outcome_without(outcome, index):
    """``outcome`` without the process ``index`` (the reference check counts exactly the survivors)."""
    from dataclasses import replace

    return replace(outcome, ranks=[r for r in outcome.ranks if r.rank != index])
