"""Resuming mid-fault on 4 real gloo processes: the detector and the controller keep their state.

Run 1: ``Trainer(strategy=ResiHPStrategy(...))`` (P = 1 x D = 4) with ``FaultInjector`` (rank 2 slowed
from ``FAULT_STEP``), ``StragglerDetector`` and ``ReplanController``; as soon as the detector flags
rank 2 and the controller has chosen a plan for it, every rank saves a checkpoint (``trainer.save_checkpoint``) and training stops. Run 2: a new
``Trainer`` with new callbacks and the fault still in force resumes from that checkpoint.

Right after the resume the detector must still flag rank 2 with the same speeds (a fresh detector
would need ``warmup_steps + fit_steps + patience`` steps), measure the first resumed step against the
saved workload models (no refit), and the controller must hold its cooldown step, cost model, profile
and chosen plan, and put that plan back in force (the strategy starts under its initial plan).

Kept short (a few steps per run, two small layers). Busy-time noise of four processes on shared
cores is large and a sleeping rank frees CPU for the others, so the fault is strong (20x), the fit
short and the detector's significance low: the stage cohort's median (every rank holds every layer
here) keeps the noisy healthy ranks from being flagged, and rank 2 is found two steps into the fault.
"""

from __future__ import annotations

import os

import pytest
import torch

from resihp_lightning.testing.toy_jobs import build_stack

WORLD, WIDTH, DEPTH, MBS, M = 4, 512, 2, 32, 32
SLOW_RANK, FACTOR, FAULT_STEP = 2, 20.0, 6
MAX_STEPS = 24  # run 1 stops at the detection, long before this unless detection fails
AFTER = 4  # steps of run 2


def _rank(rank: int, world: int, log_dir: str) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.callbacks import FaultInjector, ReplanController, StragglerDetector
    from resihp_lightning.callbacks.progress import ResiHPProgressBar, StepRecorder
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    Stack = build_stack(WIDTH, DEPTH)

    gen = torch.Generator().manual_seed(1)
    rows = M * MBS * 8
    data = DataLoader(TensorDataset(torch.randn(rows, WIDTH, generator=gen), torch.randn(rows, WIDTH, generator=gen)),
                      batch_size=M * MBS, drop_last=True)
    path = os.path.join(log_dir, "mid_fault.ckpt")

    def callbacks(run: str) -> tuple[StragglerDetector, ReplanController, list]:
        detector = StragglerDetector(warmup_steps=2, fit_steps=4, patience=2, significance=0.5,
                                     gpu_individual_perf_threshold=0.6, gpu_relative_perf_threshold=0.5,
                                     recovery_threshold=0.8, log_dir=os.path.join(log_dir, run))
        controller = ReplanController({"migration_overhead_s": 0.1}, planner={"solver": "exact", "pipeline_degrees": (1,)})
        fault = FaultInjector([{"kind": "slow", "rank": SLOW_RANK, "factor": FACTOR, "start_step": FAULT_STEP}],
                              log_dir=os.path.join(log_dir, run))
        return detector, controller, [fault, detector, controller]

    def trainer(max_steps: int, extra: list, progress_bar: bool = False) -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", devices=world, strategy=ResiHPStrategy(pipeline_degree=1, micro_batch_size=MBS),
                          max_steps=max_steps, logger=False, enable_progress_bar=progress_bar,
                          enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                          callbacks=extra, default_root_dir=log_dir)

    # ---- run 1: train until rank 2 is flagged, save, stop
    detector, controller, first = callbacks("run1")
    saved: dict = {}
    trace: list = []  # for the failure message: (step, busy ms, raw speeds)

    class SaveOnDetection(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            stats = trainer.strategy.last_step_stats
            trace.append((stats.step, round(sum(mb.compute_ms for mb in stats.micro_batches), 1),
                          {r: round(v, 2) for r, v in detector.core.raw_speeds.items()}))
            # Saved once rank 2 is flagged and the controller's verdict is in (the background solve can
            # outlast a step on loaded cores); both are the same on every rank at every step.
            if saved or SLOW_RANK not in detector.flagged or controller.state_dict()["chosen"] is None:
                return
            saved.update(step=trainer.global_step, flagged=detector.flagged, speeds=detector.speeds,
                         version=detector.version, fits=detector.tracker.fit.fits, controller=controller.state_dict())
            trainer.save_checkpoint(path)
            trainer.should_stop = True

    trainer(MAX_STEPS, [*first, SaveOnDetection()]).fit(Stack(), data)
    if not saved:
        model = detector.tracker.fit.model
        return {"saved": None, "trace": trace, "rel_scale": None if model is None else model.rel_scale}

    # ---- run 2: resume with the fault still in force
    detector, controller, second = callbacks("run2")
    recorder = StepRecorder()
    bar = ResiHPProgressBar(recorder)
    resumed: dict = {"steps": []}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            resumed.update(global_step=trainer.global_step, flagged=detector.flagged, speeds=detector.speeds,
                           version=detector.version, fits=detector.tracker.fit.fits,
                           fitted=detector.tracker.fit.model is not None, controller=controller.state_dict())

        def on_train_batch_end(self, trainer, pl_module, *args):
            plan = trainer.strategy.current_plan
            resumed["steps"].append({"step": trainer.global_step - 1, "core_step": detector.core.last_step,
                                     "flagged": detector.flagged, "raw": detector.core.raw_speeds,
                                     "micro_batches": {r.devices[0]: r.micro_batches for r in plan.replicas}})
            resumed["metrics"] = bar.get_metrics(trainer, pl_module) if trainer.is_global_zero else None

    trainer(saved["step"] + AFTER, [recorder, *second, Probe(), bar], progress_bar=True).fit(Stack(), data, ckpt_path=path)
    resumed.update(fits_after=detector.tracker.fit.fits, events=controller.events.events,
                   tokens_per_s=recorder.tokens_per_s, tokens=[r["tokens"] for r in recorder.records])
    callback_keys = sorted(torch.load(path, weights_only=True)["callbacks"]) if rank == 0 else None
    return {"saved": saved, "resumed": resumed, "callback_keys": callback_keys}


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_resumed_job_still_knows_the_slow_rank_and_keeps_the_controllers_state(distributed, tmp_path):
    results = distributed(_rank, WORLD, timeout=140, log_dir=str(tmp_path))
    assert results[0]["saved"] is not None, (
        f"rank {SLOW_RANK} never flagged or no plan chosen for it; per rank: (step, busy ms, raw speeds) and fit noise: "
        f"{[(r['trace'], r['rel_scale']) for r in results]}")
    assert results[0]["callback_keys"] == ["ReplanController", "StragglerDetector"]
    saved0 = results[0]["saved"]
    assert saved0["step"] >= FAULT_STEP + 1 and SLOW_RANK in saved0["flagged"]
    for result in results:
        saved, resumed = result["saved"], result["resumed"]
        # Right after the resume: the same flags, speeds and version as at the save, the models fitted.
        assert resumed["global_step"] == saved["step"]
        assert (resumed["flagged"], resumed["speeds"], resumed["version"]) == (
            saved0["flagged"], saved0["speeds"], saved0["version"])
        assert resumed["fitted"] and resumed["fits"] == saved["fits"] == 1
        # The controller's state is rank 0's (the rank that plans), cooldown step included.
        assert resumed["controller"] == saved0["controller"]
        # The first resumed step is measured and decided on at once: no warm-up, no refit.
        first = resumed["steps"][0]
        assert first["step"] == saved["step"] and first["core_step"] == saved["step"]
        assert SLOW_RANK in first["flagged"] and first["raw"][SLOW_RANK] < 0.75, first
        assert resumed["fits_after"] == saved["fits"]
    controller = saved0["controller"]
    assert controller["last_change_step"] is not None and controller["chosen"] is not None, controller
    # The chosen plan is put back in force: requested at the end of the first resumed step, applied in
    # the next (events carry the trainer's global step at a batch's end: the resumed step's index + 1).
    chosen = {r["devices"][0]: r["micro_batches"] for r in controller["chosen"]["replicas"]}
    steps = results[0]["resumed"]["steps"]
    assert steps[0]["micro_batches"] == {r: M // WORLD for r in range(WORLD)}  # the strategy's initial plan
    assert len(steps) > 1 and all(s["micro_batches"] == chosen for s in steps[1:]), steps
    applied = [e for e in results[0]["resumed"]["events"] if e["event"] == "plan_applied"]
    assert applied and applied[0]["step"] == saved0["step"] + 2
    # Batches without sequence lengths: tokens are unknown, so the bar shows no tok/s (and the plan).
    resumed0 = results[0]["resumed"]
    assert resumed0["tokens_per_s"] is None and set(resumed0["tokens"]) == {0}
    assert "tok/s" not in resumed0["metrics"] and resumed0["metrics"]["plan"].startswith("1x4")
