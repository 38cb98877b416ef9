"""Periodic checkpoints (ModelCheckpoint every N steps / minutes, the last K kept, sync or async writes)
and the data position a resumed job continues from."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch.utils.data import DistributedSampler, IterableDataset, TensorDataset

from resihp_lightning.callbacks.restart.periodic_checkpoint import CheckpointConfig, checkpoint_step, newest_checkpoint
from resihp_lightning.data.resumable import ResumableDataLoader
from resihp_lightning.errors import ConfigError


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"every_n_steps": 10, "every_n_minutes": 5.0}, "at most one of checkpoint.every_n_steps"),
        ({"every_n_steps": 0}, "checkpoint.every_n_steps"),
        ({"every_n_steps": None, "every_n_minutes": -1.0}, "checkpoint.every_n_minutes"),
        ({"keep_last": 0}, "checkpoint.keep_last"),
    ],
)
def test_bad_checkpoint_options_are_refused_by_name(options, named):
    with pytest.raises(ConfigError, match=named):
        CheckpointConfig(**options)


def test_steps_are_the_default_and_minutes_replace_them():
    assert CheckpointConfig().every_n_steps == 50
    by_time = CheckpointConfig.from_dict({"every_n_minutes": 15})
    assert by_time.every_n_steps is None and by_time.every_n_minutes == 15


def test_unknown_checkpoint_key_is_refused_by_name():
    with pytest.raises(ConfigError, match="every_n_step"):
        CheckpointConfig.from_dict({"every_n_step": 5})


def test_newest_checkpoint_is_the_highest_step(tmp_path):
    assert newest_checkpoint(tmp_path / "missing") is None
    for name in ("step00000008.ckpt", "step00000012.ckpt", "step00000004.ckpt", "last.ckpt", "step00000016.ckpt.tmp"):
        (tmp_path / name).write_bytes(b"")
    assert newest_checkpoint(tmp_path) == tmp_path / "step00000012.ckpt"
    assert checkpoint_step("step00000012.ckpt") == 12 and checkpoint_step("last.ckpt") is None


# ------------------------------------------------------------------------------ data position
def _loader(rows: int = 40, batch: int = 4) -> ResumableDataLoader:
    data = TensorDataset(torch.arange(rows))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5)
    return ResumableDataLoader(data, batch_size=batch, sampler=sampler, drop_last=True)


def _ids(batches) -> list[list[int]]:
    return [b[0].tolist() for b in batches]


def test_a_loader_resumes_mid_epoch_without_repeating_or_skipping_rows():
    first = _loader()
    first.sampler.set_epoch(3)
    it = iter(first)
    seen = _ids(next(it) for _ in range(4))
    state = first.state_dict()
    assert state == {"epoch": 3, "batches": 4}
    rest_uninterrupted = _ids(it)

    second = _loader()  # a new process: epoch 0 until the state says otherwise
    second.load_state_dict(state)
    assert len(second) == 10  # Lightning counts the resumed epoch from the saved position
    resumed = _ids(iter(second))
    assert resumed == rest_uninterrupted
    assert sorted(i for b in seen + resumed for i in b) == list(range(40))
    assert second.state_dict() == {"epoch": 3, "batches": 10}
    assert len(_ids(iter(second))) == 10  # only the first iterator after a load skips


def test_a_loader_saved_at_the_end_of_an_epoch_starts_the_next_one():
    loader = _loader()
    loader.load_state_dict({"epoch": 2, "batches": 10})
    assert loader.sampler.epoch == 3 and len(_ids(iter(loader))) == 10


def test_an_iterable_dataset_is_refused():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(ConfigError, match="map-style"):
        ResumableDataLoader(Stream())


# ---------------------------------------------------------------- periodic checkpoints, 2 gloo ranks
def _checkpoint_rank(rank: int, world: int, root: str) -> dict:
    import lightning.pytorch as pl

    from resihp_lightning.testing import elastic_job as job
    from resihp_lightning.callbacks.restart.elastic_restart import ElasticRestart
    from resihp_lightning.callbacks.restart.periodic_checkpoint import periodic_checkpoint
    from resihp_lightning.strategy.checkpoint_io import make_checkpoint_io, timed_io
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    class Record(pl.Callback):
        def __init__(self, delay_s: float = 0.0) -> None:
            self.steps: dict[int, tuple[float, list[int]]] = {}
            self.delay_s = delay_s

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.steps[trainer.global_step - 1] = (float(outputs["loss"]), batch[2].tolist())
            time.sleep(self.delay_s)

    def fit(name: str, config: CheckpointConfig, steps: int, ckpt: str | None = None, delay_s: float = 0.0):
        io = make_checkpoint_io(config.asynchronous)
        record = Record(delay_s)
        trainer = pl.Trainer(
            accelerator="cpu", devices=world, strategy=ResiHPStrategy(pipeline_degree=2, micro_batch_size=job.MBS,
                                                                      micro_batches=job.M),
            max_steps=steps, plugins=[io], logger=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, default_root_dir=os.path.join(root, name),
            callbacks=[periodic_checkpoint(config), ElasticRestart(log_dir=os.path.join(root, name)), record],
        )
        pl.seed_everything(0, verbose=False)
        loader = job.ResumableDataLoader(job.Rows(), batch_size=job.M * job.MBS, shuffle=True, drop_last=True)
        trainer.ckpt_path = ckpt
        trainer.fit(job.Stack(), loader)
        writes = timed_io(io).writes
        return record.steps, [(os.path.basename(w.path), w.bytes) for w in writes]

    out = {}
    for mode in ("async", "sync"):
        config = CheckpointConfig(dirpath=os.path.join(root, mode), every_n_steps=2, keep_last=2,
                                  asynchronous=mode == "async")
        out[mode] = fit(mode, config, steps=7)
        out[f"{mode}_files"] = sorted(os.listdir(config.dirpath))
    resume = CheckpointConfig(dirpath=os.path.join(root, "resumed"), every_n_steps=100)
    out["resumed"] = fit("resumed", resume, steps=7, ckpt=os.path.join(root, "async", "step00000006.ckpt"))
    timed = CheckpointConfig(dirpath=os.path.join(root, "timed"), every_n_minutes=0.25 / 60, keep_last=10)
    out["timed"] = fit("timed", timed, steps=4, delay_s=0.3)
    out["timed_files"] = sorted(os.listdir(timed.dirpath))
    if rank == 0:
        ckpt = torch.load(os.path.join(root, "sync", "step00000006.ckpt"), weights_only=False)
        out["callbacks"] = sorted(ckpt["callbacks"])
        out["loader_state"] = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        out["elastic"] = ckpt["callbacks"][next(k for k in ckpt["callbacks"] if k.startswith("ElasticRestart"))]
        other = torch.load(os.path.join(root, "async", "step00000006.ckpt"), weights_only=False)
        out["same_weights"] = all(torch.equal(v, other["state_dict"][k]) for k, v in ckpt["state_dict"].items())
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_periodic_checkpoints_keep_the_last_k_and_resume_exactly(distributed, tmp_path):
    results = distributed(_checkpoint_rank, 2, timeout=220, root=str(tmp_path))
    out = results[0]
    # Every 2 steps, the last 2 kept; async and sync write the same files, and the same weights.
    assert out["async_files"] == out["sync_files"] == ["step00000004.ckpt", "step00000006.ckpt"]
    assert [name for name, _ in out["async"][1]] == [name for name, _ in out["sync"][1]] == [
        "step00000002.ckpt", "step00000004.ckpt", "step00000006.ckpt"]
    assert out["same_weights"]
    assert results[1]["sync"][1] == []  # only rank 0 writes
    # What a restart needs is in the checkpoint: callbacks' state, the data position, layer costs.
    assert any(k.startswith("ModelCheckpoint") for k in out["callbacks"]) and any(
        k.startswith("ElasticRestart") for k in out["callbacks"])
    assert out["loader_state"] == [{"epoch": 0, "batches": 6}]
    elastic = out["elastic"]
    assert elastic["world_size"] == 2 and len(elastic["profile"]) == 6 and elastic["plan"]["pipeline_degree"] == 2
    # Async and sync train identically; the resumed run continues with the same rows and losses.
    sync_steps, async_steps, resumed = out["sync"][0], out["async"][0], out["resumed"][0]
    assert sync_steps == async_steps
    assert sorted(resumed) == [6]
    assert resumed[6] == async_steps[6]
    # Time-based: a write whenever 0.25 s have passed (rank 0's clock), with 0.3 s steps: every step.
    assert len(out["timed_files"]) >= 3, out["timed_files"]


def _fit_rank(rank: int, world: int, root: str, steps: int, elastic: bool, ckpt: str | None) -> dict:
    import lightning.pytorch as pl

    from resihp_lightning.testing import elastic_job as job
    from resihp_lightning.callbacks.restart.elastic_restart import ElasticRestart
    from resihp_lightning.callbacks.restart.periodic_checkpoint import periodic_checkpoint
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    callbacks = [periodic_checkpoint(CheckpointConfig(dirpath=os.path.join(root, "ckpts"), every_n_steps=2))]
    elastic_cb = ElasticRestart(log_dir=root) if elastic else None
    trainer = pl.Trainer(accelerator="cpu", devices=world, max_steps=steps, logger=False, enable_progress_bar=False,
                         strategy=ResiHPStrategy(pipeline_degree=2, micro_batch_size=job.MBS, micro_batches=job.M),
                         enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
                         callbacks=callbacks + ([elastic_cb] if elastic_cb else []))
    trainer.ckpt_path = ckpt
    pl.seed_everything(0, verbose=False)
    trainer.fit(job.Stack(), job.ResumableDataLoader(job.Rows(), batch_size=job.M * job.MBS, shuffle=True, drop_last=True))
    plan = trainer.strategy.current_plan
    return {"shape": (plan.pipeline_degree, plan.data_degree), "step": trainer.global_step,
            "restart": None if elastic_cb is None else elastic_cb.last_restart}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_checkpoint_without_elastic_state_still_restarts_on_fewer_processes(distributed, tmp_path):
    # Written by 2 processes (2 x 1) without ElasticRestart; resumed on 1, where pipeline_degree=2 cannot run.
    distributed(_fit_rank, 2, timeout=120, root=str(tmp_path), steps=2, elastic=False, ckpt=None)
    ckpt = str(tmp_path / "ckpts" / "step00000002.ckpt")
    out = distributed(_fit_rank, 1, timeout=120, root=str(tmp_path), steps=3, elastic=True, ckpt=ckpt)[0]
    assert out["shape"] == (1, 1) and out["step"] == 3
    assert out["restart"]["world_before"] == 2 and out["restart"]["world_after"] == 1
