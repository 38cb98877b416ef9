"""``ElasticRestart`` under tensor parallelism: a TP job restarts from its checkpoint onto another world.

A 4-process job with ``tensor_degree=2`` re-splits its groups to ``[[0, 1], [2], [3]]`` after step 1
(as a dropped member leaves them), trains to step 3 and saves a checkpoint. A 2-process job restarts
from it: one group of two, so the restart plans afresh for one device, and the losses of steps 4-6 and
the final weights match one process training the unsplit model throughout. A 3-process restart is
refused by name (3 processes do not form groups of 2).
"""

from __future__ import annotations

import pytest
import torch

from resihp_lightning.testing.tensor_jobs import LOSS_ATOL, WEIGHT_ATOL, packed_batches, tensor_parallel_llama, unsplit_reference

SAVE_STEP, END_STEP = 3, 6
MIXED = {"replicas": [{"devices": [0], "bounds": [0, 4], "micro_batches": 2},
                      {"devices": [1], "bounds": [0, 4], "micro_batches": 1},
                      {"devices": [2], "bounds": [0, 4], "micro_batches": 1}]}


def _job(rank: int, world: int, path: str, log_dir: str, resume: bool, end_step: int = END_STEP,
         regroup: bool = True) -> dict:
    import warnings

    import lightning.pytorch as pl
    from resihp_lightning.callbacks import StragglerDetector
    from resihp_lightning.callbacks.restart.elastic_restart import ElasticRestart
    from resihp_lightning.data.resumable import ResumableDataLoader
    from resihp_lightning.errors import ConfigError
    from resihp_lightning.plan import Plan
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    warnings.filterwarnings("ignore")

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))
            if not resume and trainer.global_step == 1 and regroup:
                trainer.strategy.request_plan(Plan.from_dict(MIXED), tensor_groups=[[0, 1], [2], [3]])

    recorder, restart = Recorder(), ElasticRestart(log_dir=log_dir)
    strategy = ResiHPStrategy(tensor_degree=2, pipeline_degree=1, micro_batch_size=1, micro_batches=4,
                              gather_weights="all")
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=end_step if resume else SAVE_STEP,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         use_distributed_sampler=False, default_root_dir=log_dir,
                         callbacks=[StragglerDetector(), restart, recorder])
    # The loader's position is in the checkpoint: the resumed job skips the batches the first one trained on.
    loader = ResumableDataLoader(packed_batches(end_step), batch_size=None)
    if resume:
        trainer.ckpt_path = path
    try:
        trainer.fit(tensor_parallel_llama(), loader)
    except ConfigError as err:
        return {"error": str(err)}
    if not resume:
        trainer.save_checkpoint(path)
    return {"error": None, "losses": recorder.losses, "plan": strategy.current_plan.to_dict(),
            "groups": [list(g) for g in strategy.tensor_groups.members], "restart": restart.last_restart,
            "state": {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_tensor_parallel_job_restarts_onto_another_world_exactly(distributed, tmp_path):
    path, logs = str(tmp_path / "tp.ckpt"), str(tmp_path / "logs")
    saved = distributed(_job, 4, timeout=140, path=path, log_dir=logs, resume=False)
    assert all(r["error"] is None for r in saved), saved[0]
    refused = distributed(_job, 3, timeout=100, path=path, log_dir=logs, resume=True)
    assert all("3 processes of this restart do not form groups of tensor_degree 2" in r["error"] for r in refused)

    resumed = distributed(_job, 2, timeout=140, path=path, log_dir=logs, resume=True)
    ref_losses, ref_state = unsplit_reference(END_STEP)
    for rank, got in enumerate(resumed):
        assert got["error"] is None, got["error"]
        assert got["groups"] == [[0, 1]]
        assert got["restart"]["world_before"] == 4 and got["restart"]["world_after"] == 2
        assert got["plan"] == {"replicas": [{"devices": [0], "bounds": [0, 4], "micro_batches": 4}]} | {
            k: got["plan"][k] for k in got["plan"] if k != "replicas"}
        assert saved[rank]["losses"] == pytest.approx(ref_losses[:SAVE_STEP], abs=LOSS_ATOL, rel=0)
        assert got["losses"] == pytest.approx(ref_losses[SAVE_STEP:], abs=LOSS_ATOL, rel=0), rank
        for key, want in ref_state.items():
            torch.testing.assert_close(got["state"][key], want, atol=WEIGHT_ATOL, rtol=0, msg=f"rank {rank} {key}")
