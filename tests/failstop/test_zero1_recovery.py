"""The layer-wise ZeRO-1 recovers in-process: a lost holder's slice of Adam's moments comes from its copy.

``deepspeed_config={"zero_optimization": {"stage": 1}}`` under ``Trainer(precision="bf16-mixed")``
runs the layer-wise engine with Adam's moments of every layer sharded over its 4 holders (P = 1 x D = 4),
each slice kept by its primary and by the previous holder (:mod:`~resihp_lightning.state.zero_shards`).
On real gloo processes (``harness.run_job``):

* rank 2, the only primary of slice 2 of every layer, is SIGKILLed inside step 2: the survivors rebuild
  that slice from rank 1's copy and go on over D = 3 (every slice kept twice again); rank 3 is SIGKILLed
  inside step 4 and the last two go on too; their losses, final fp32 masters and whole Adam moments equal
  a no-fault run of the same plan sequence (forced through ``request_plan``) to 1e-6;
* the same plan with ZeRO-1 on and off, in bf16-mixed and in fp32: weights and moments equal bit for bit;
* the no-fault run saves a checkpoint under ZeRO-1 (whole fp32 moments); in the same processes it resumes
  under another plan (P = 2 x D = 2, per-replica bounds, holders not in rank order) with ZeRO-1 and under
  the first plan with ZeRO-1 off: the restored masters and moments equal the saved ones exactly; the
  ZeRO-1 run then moves layers (with their moments) to other ranks by a live re-plan, and the next three
  steps' losses are the same in both;
* ranks 1 and 2 are SIGKILLed in the same step: slice 2's two keepers are gone, every survivor exits
  with status 75 (a restart from a checkpoint) instead of waiting.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from resihp_lightning.testing.toy_jobs import DEPTH, EPOCH_STEPS

STEPS = EPOCH_STEPS  # one epoch: the no-fault run's checkpoint is an end-of-epoch one
ZERO1 = {"zero_optimization": {"stage": 1}}
#: One row per micro-batch: 8 micro-batches, 2 per replica of the P = 1 x D = 4 plan (a victim dies at its 2nd).
MBS = 1
WIDE = {"replicas": [{"devices": [d], "bounds": [0, DEPTH], "micro_batches": 2} for d in range(4)]}
#: The resumed ZeRO-1 run's next plan (after one step): layers 3, 4 move from rank 3 to rank 2, layers 2..4
#: from rank 0 to rank 1, with their moments.
DEEP_MOVED = {"replicas": [{"devices": [2, 3], "bounds": [0, 5, DEPTH], "micro_batches": 4},
                           {"devices": [0, 1], "bounds": [0, 2, DEPTH], "micro_batches": 4}]}
#: The resumed run's other plan: 2 replicas of 2 stages with their own bounds, listed so that a layer's holders
#: in replica order are not in rank order (holder sets (2, 0), (2, 1), (3, 1)).
DEEP = {"replicas": [{"devices": [2, 3], "bounds": [0, 3, DEPTH], "micro_batches": 4},
                     {"devices": [0, 1], "bounds": [0, 5, DEPTH], "micro_batches": 4}]}


def _moments(strategy) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's whole Adam state of its layers (collective over the holder sets, as a checkpoint is)."""
    state = strategy._state.require().optimizer_checkpoint_state()
    return {key: {k: v.detach().cpu().clone() for k, v in entry.items()} for key, entry in state.items()}


def _fit(rank: int, run_dir: str, callbacks: list, steps: int, config: dict, plan: dict, fail_stop: bool,
         ckpt_path: str | None = None, precision: str = "bf16-mixed", **trainer_kwargs):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.plan import Plan
    from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.testing.toy_jobs import M, build_class, make_data
    from resihp_lightning.testing.toy_jobs import MBS as ROWS_PER_STEP

    x, y = make_data()
    strategy = ResiHPStrategy(micro_batch_size=MBS, plan=Plan.from_dict(plan), deepspeed_config=config,
                              fail_stop=FailStopConfig() if fail_stop else None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, precision=precision, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, default_root_dir=run_dir,
        **{"enable_checkpointing": False, **trainer_kwargs},
    )
    model = build_class()()
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=M * ROWS_PER_STEP), ckpt_path=ckpt_path)
    return trainer, strategy, model


def _job(rank: int, world: int, run_dir: str, schedule: dict, victims: dict, resume: bool) -> dict:
    import lightning.pytorch as pl

    from resihp_lightning.plan import Plan
    from resihp_lightning.testing.harness import last_words

    class Schedule(pl.Callback):
        """Requests ``schedule[step]`` after step ``step``; a victim dies at the forward of its 2nd
        micro-batch of its step; keeps the losses and, at the end, this rank's whole moments."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.moments: dict = {}
            self.engines: set[str] = set()
            self.recoveries: list = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            strategy = trainer.strategy
            if victims.get(strategy.device_id) != trainer.global_step:
                return
            seen = [0]

            def die(module, args):
                seen[0] += 1
                if seen[0] == 2:
                    last_words(run_dir, rank, died_at=time.monotonic())
                    os.kill(os.getpid(), signal.SIGKILL)

            next(iter(strategy.local_layers().values())).register_forward_pre_hook(die)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            strategy = trainer.strategy
            self.losses.append(float(outputs["loss"]))
            if strategy._state.runtime.engine is not None:
                self.engines.add(type(strategy._state.runtime.engine.optimizer).__name__)
            record = strategy.last_recovery
            if record is not None and all(r.step != record.step for r in self.recoveries):
                self.recoveries.append(record)
            plan = schedule.get(trainer.global_step - 1)
            if plan is not None:
                strategy.request_plan(Plan.from_dict(plan))

        def on_train_end(self, trainer, pl_module):
            self.moments = _moments(trainer.strategy)

    out: dict = {"resumed": _checkpoint_and_resume(rank, run_dir)} if resume else {}
    recorder = Schedule()
    _, strategy, model = _fit(rank, run_dir, [recorder], STEPS, ZERO1, WIDE, True)
    out |= {
        "losses": recorder.losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "moments": recorder.moments,
        "recoveries": recorder.recoveries,
        "steppers": recorder.engines,
        "sharded": strategy._state.require().optimizer is not None and not strategy._state.require().optimizer.optimizer.state,
    }
    return out


def _checkpoint_and_resume(rank: int, run_dir: str) -> dict:
    """Trains one epoch unsharded, then under ZeRO-1 (P = 1 x D = 4) and checkpoints it, then resumes the
    checkpoint under two other set-ups for two steps: the saved state, the trained one, what each resumed run restored, its loss."""
    import lightning.pytorch as pl

    from resihp_lightning.state import zero_shards

    zero_shards.GATHER_BUCKET_NUMEL = 50  # two 42-element layers per all-gather: the buckets are exercised too

    class Trained(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            self.moments = _moments(trainer.strategy)

    class Kept(pl.Callback):
        """Which slices of each layer this rank keeps, and its Adam state bytes against the unsharded 8 per element."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            runtime = trainer.strategy._state.require()
            shards = runtime._carrier.shards
            self.slices = {i: sorted(shard.pieces) for i, shard in shards.layers.items()}
            params = runtime.local_parameters().values()
            self.state_bytes = sum(shards.state_bytes(p) for p in params), 8 * sum(p.numel() for p in params)

    fp32 = {}
    for name, config in (("unsharded", {}), ("zero", ZERO1)):
        done = Trained()
        _, _, fp32_model = _fit(rank, run_dir, [done], STEPS, config, WIDE, False, precision="32-true")
        fp32[name] = (done.moments, {k: v.detach().clone() for k, v in fp32_model.state_dict().items()})
    unsharded, trained, kept = Trained(), Trained(), Kept()
    _, _, plain_model = _fit(rank, run_dir, [unsharded], STEPS, {}, WIDE, False)
    saver = pl.callbacks.ModelCheckpoint(dirpath=run_dir, save_top_k=-1, every_n_epochs=1)
    _, _, model = _fit(rank, run_dir, [trained, kept, saver], STEPS, ZERO1, WIDE, False, enable_checkpointing=True)
    path = os.path.join(run_dir, f"epoch=0-step={STEPS}.ckpt")
    saved = torch.load(path, map_location="cpu", weights_only=False)

    class Restored(pl.Callback):
        """What the resumed run restored; after its first step it may move layers (``then``), with their moments."""

        def __init__(self, then: dict | None) -> None:
            self.then = then
            self.moments: dict = {}
            self.params: dict = {}
            self.losses: list[float] = []
            self.moved = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            strategy = trainer.strategy
            if not self.params:
                self.moments = _moments(strategy)
                self.params = {k: p.detach().clone() for k, p in strategy._state.require().local_parameters().items()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            from resihp_lightning.plan import Plan

            self.losses.append(float(outputs["loss"]))
            if self.then is not None and len(self.losses) == 1:
                trainer.strategy.request_plan(Plan.from_dict(self.then))
            elif len(self.losses) == 2 and trainer.strategy.last_migration is not None:
                self.moved = trainer.strategy.last_migration.bytes_moved

    out = {
        "saved": saved["optimizer_states"][0]["state"],
        "trained_moments": trained.moments,
        "trained_state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "unsharded_moments": unsharded.moments,
        "unsharded_state": {k: v.detach().clone() for k, v in plain_model.state_dict().items()},
        "fp32": fp32,
        "slices": kept.slices,
        "state_bytes": kept.state_bytes,
    }
    for name, config, plan, then in (("zero_deep", ZERO1, DEEP, DEEP_MOVED), ("plain_wide", {}, WIDE, None)):
        restored = Restored(then)
        _fit(rank, run_dir, [restored], STEPS + 3, config, plan, False, ckpt_path=path)
        out[name] = {"moments": restored.moments, "params": restored.params, "losses": restored.losses,
                     "moved": restored.moved}
    return out


def _assert_same_run(faulted: dict, clean: dict, survivors: list[int]) -> None:
    """Losses, final fp32 masters and whole Adam moments of the survivors equal the no-fault run's to 1e-6."""
    for rank in survivors:
        got, want = faulted[rank], clean[rank]
        assert len(got["losses"]) == len(want["losses"]) == STEPS, (rank, got["losses"], want["losses"])
        for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
            assert abs(a - b) <= 1e-6, f"rank {rank} step {step}: {a} after the kill vs {b} without it"
        for key, value in want["state"].items():
            assert got["state"][key].dtype == torch.float32, (rank, key)
            assert torch.allclose(got["state"][key], value, atol=1e-6, rtol=0), (rank, key)
        assert sorted(got["moments"]) == sorted(want["moments"]), rank
        for key, entry in want["moments"].items():
            assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}, entry.keys()
            for name, value in entry.items():
                assert torch.allclose(got["moments"][key][name].float(), value.float(), atol=1e-6, rtol=0), (rank, key, name)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_zero1_sigkill_of_a_slice_s_only_primary_matches_the_no_fault_run_and_a_checkpoint_resumes_anywhere():
    from resihp_lightning.testing.harness import run_job

    faulted = run_job(_job, 4, timeout=150, wait_for=[0, 1], schedule={}, victims={2: 2, 3: 4}, resume=False)
    values = faulted.values()
    assert sorted(values) == [0, 1], faulted.describe()
    first, second = values[0]["recoveries"]
    assert first.step == 2 and 2 in first.failed and sorted(first.plan.device_ids) == [0, 1, 3], first
    # The survivors re-sharded over D = 3 with two copies of every slice again: rank 3's slice 2 (D = 3)
    # lived on rank 1 too, so a second single kill recovers as well.
    assert second.step == 4 and 3 in second.failed, second
    assert values[0]["steppers"] == {"ShardedStep"}, values[0]["steppers"]  # the layer-wise ZeRO-1 stepped
    assert all(v["sharded"] for v in values.values())  # the user's optimizer kept no state itself
    assert all(v["moments"] for v in values.values()), "no whole moments gathered"
    clean = run_job(_job, 4, timeout=150, wait_for=[0, 1, 2, 3], schedule={1: first.plan.to_dict(), 3: second.plan.to_dict()},
                    victims={}, resume=True)
    clean_values = clean.values()
    assert sorted(clean_values) == [0, 1, 2, 3], clean.describe()
    _assert_same_run(values, clean_values, [0, 1])
    # Sharded: rank i keeps slices i and i + 1 of every layer, half the unsharded Adam bytes at D = 4 (2 / D).
    for rank, result in clean_values.items():
        assert result["resumed"]["slices"] == {i: sorted({rank, (rank + 1) % 4}) for i in range(DEPTH)}, result["resumed"]["slices"]
        kept, unsharded = result["resumed"]["state_bytes"]
        assert kept == unsharded / 2, (kept, unsharded)
    # The sharded step is the unsharded one, bit for bit: same plan, ZeRO-1 on and off, bf16-mixed and fp32.
    resumed = clean_values[0]["resumed"]
    runs = {"bf16-mixed": ((resumed["unsharded_moments"], resumed["unsharded_state"]),
                           (resumed["trained_moments"], resumed["trained_state"])),
            "32-true": (resumed["fp32"]["unsharded"], resumed["fp32"]["zero"])}
    for precision, ((plain_moments, plain_state), (zero_moments, zero_state)) in runs.items():
        for key, value in plain_state.items():
            assert torch.equal(zero_state[key], value), (precision, key)
        assert sorted(plain_moments) == sorted(zero_moments) and plain_moments, precision
        for key, entry in plain_moments.items():
            for name, value in entry.items():
                assert torch.equal(zero_moments[key][name], value), (precision, key, name)
    assert not torch.equal(resumed["fp32"]["zero"][1]["layers.0.0.weight"], resumed["trained_state"]["layers.0.0.weight"])
    # The checkpoint holds whole fp32 moments; both resumed set-ups restored them and the masters exactly.
    saved = resumed["saved"]
    assert sorted(saved) == sorted(resumed["trained_moments"]) and len(saved) == 2 * DEPTH, sorted(saved)
    for key, entry in resumed["trained_moments"].items():
        for name, value in entry.items():
            assert torch.equal(saved[key][name], value), (key, name)
    for name in ("zero_deep", "plain_wide"):
        for rank, result in clean_values.items():
            got = result["resumed"][name]
            assert got["moments"], (name, rank)
            for key, entry in got["moments"].items():
                for state_name, value in entry.items():
                    assert torch.equal(value, saved[key][state_name]), (name, rank, key, state_name)
            for key, value in got["params"].items():
                assert torch.equal(value, resumed["trained_state"][f"layers.{key}"]), (name, rank, key)
    deep, wide = resumed["zero_deep"]["losses"], resumed["plain_wide"]["losses"]
    # The 2nd loss reads the first update (made with the restored moments), the 3rd the update after the
    # ZeRO-1 run moved layers with their moments to other ranks.
    assert len(deep) == len(wide) == 3 and all(abs(a - b) <= 1e-6 for a, b in zip(deep, wide)), (deep, wide)
    assert resumed["zero_deep"]["moved"] > 0, resumed["zero_deep"]["moved"]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_zero1_two_kills_that_take_both_copies_of_a_slice_exit_75_on_the_survivors(tmp_path):
    from resihp_lightning.failstop.fail_stop_config import UNRECOVERABLE_EXIT_CODE
    from resihp_lightning.testing.harness import run_job

    outcome = run_job(_job, 4, timeout=120, run_dir=str(tmp_path), schedule={}, victims={1: 2, 2: 2}, resume=False)
    codes = {r.rank: r.exitcode for r in outcome.ranks}
    assert codes[1] == codes[2] == -signal.SIGKILL, outcome.describe()
    assert codes[0] == codes[3] == UNRECOVERABLE_EXIT_CODE, outcome.describe()
    assert not any(r.status == "killed" for r in outcome.ranks), outcome.describe()  # nobody hung
