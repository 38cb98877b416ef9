"""End-to-end tests of ResiHPStrategy on 4 real gloo processes (Trainer.fit inside each rank).

One spawned job runs several checks, because starting 4 processes that import Lightning and
DeepSpeed costs ~15 s here. The reference for every loss and parameter is a single-process
plain-PyTorch run of the same model, data, optimizer and LR schedule.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F

WIDTH, DEPTH, MBS, M, ROWS = 6, 8, 2, 4, 48
LR = 0.05


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(ROWS, WIDTH, generator=gen)
    y = torch.sin(x @ torch.randn(WIDTH, WIDTH, generator=gen))
    return x, y


class Block(nn.Sequential):
    """Linear + tanh whose initial values depend only on its layer index (so a DeepSpeed ``LayerSpec``
    builds the same values on any rank, and the reference builds them too)."""

    def __init__(self, index: int) -> None:
        super().__init__(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        gen = torch.Generator().manual_seed(100 + index)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(WIDTH))


#: Layers 0..3 are nn.Modules held by the LightningModule; 4..7 are LayerSpecs, built only where held.
MODULE_LAYERS = 4


def make_layers() -> nn.ModuleList:
    return nn.ModuleList([Block(i) for i in range(DEPTH)])


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)


def make_optimizer(params):
    opt = torch.optim.Adam(params, lr=LR)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)


def epoch_order(epoch: int) -> list[int]:
    """Row order of one training epoch as Lightning feeds it under a distributed strategy.

    Lightning puts a shuffled ``DistributedSampler`` (seed ``PL_GLOBAL_SEED``, default 0) on training
    loaders; ResiHPStrategy asks for one replica, so every rank reads the whole epoch in this order.
    """
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(ROWS), num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def reference_run(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch, one process: loss = mean over the M micro-batches of the per-micro-batch mean."""
    torch.set_num_threads(1)
    layers = make_layers()
    opt, sched = make_optimizer(layers.parameters())
    x, y = make_data()
    losses = []
    batch = M * MBS
    per_epoch = ROWS // batch
    for step in range(steps):
        i = step % per_epoch
        rows = epoch_order(step // per_epoch)[i * batch : (i + 1) * batch]
        xb, yb = x[rows], y[rows]
        opt.zero_grad()
        total = 0.0
        for k in range(M):
            out = xb[k * MBS : (k + 1) * MBS]
            for layer in layers:
                out = layer(out)
            loss = F.mse_loss(out, yb[k * MBS : (k + 1) * MBS]) / M
            loss.backward()
            total += float(loss.detach())
        opt.step()
        sched.step()
        losses.append(total)
    params = {f"{i}.{name}": p.detach().clone() for i, layer in enumerate(layers) for name, p in layer.named_parameters()}
    return losses, params


def build_model(base: type | None = None):
    """The ResiHPModule used by these tests (defined lazily: importing Lightning costs seconds).

    Args:
        base: the module base class (default ``resihp_lightning.ResiHPModule``; the standalone
            ``pytorch_lightning`` test passes its own).
    """
    if base is None:
        from resihp_lightning.strategy.module import ResiHPModule as base

    class Stack(base):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block(i) for i in range(MODULE_LAYERS)])

        def pipeline_layers(self):
            from deepspeed.pipe import LayerSpec

            return list(self.layers) + [LayerSpec(Block, i) for i in range(MODULE_LAYERS, DEPTH)]

        def pipeline_loss(self, outputs, labels):
            return F.mse_loss(outputs, labels)

        def configure_optimizers(self):
            opt, sched = make_optimizer(self.parameters())
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Stack()


def make_loader(shuffle: bool = False):
    from torch.utils.data import DataLoader, TensorDataset

    x, y = make_data()
    return DataLoader(TensorDataset(x, y), batch_size=M * MBS, shuffle=shuffle)


def make_trainer(strategy, world: int, steps: int, callbacks=(), **kwargs):
    import lightning.pytorch as pl

    options = dict(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
    )
    options.update(kwargs)
    return pl.Trainer(**options)


def make_recorder(schedule: dict[int, object] | None = None):
    """A Lightning callback (built lazily) that records losses, stats and plans, and requests plans."""
    import lightning.pytorch as pl

    class _Recorder(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.migrations: list[dict] = []
            self.stats = []
            self.refused: list[str] = []
            self.plans: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            strategy = trainer.strategy
            self.losses.append(float(outputs["loss"]))
            self.stats.append(strategy.last_step_stats)
            self.plans.append(strategy.current_plan.to_dict())
            if strategy.last_migration is not None and (not self.migrations or self.migrations[-1] is not strategy.last_migration):
                self.migrations.append(strategy.last_migration)
            request = (schedule or {}).get(trainer.global_step)
            if request is not None:
                try:
                    strategy.request_plan(request)
                except Exception as err:  # noqa: BLE001 - recorded and checked by the test
                    self.refused.append(f"{type(err).__name__}: {err}")

    return _Recorder()


def make_plan(replicas):
    from resihp_lightning.plan import Plan, Replica

    return Plan(tuple(Replica(tuple(devices), tuple(bounds), m) for devices, bounds, m in replicas))


# Re-plans requested after the given step (they apply at the next step): moving bounds with uneven
# micro-batches, moving placement, 2x2 -> 4x1 -> 1x4 -> 2x2, then a micro-batch-only change.
SCHEDULE = {
    2: [([0, 1], (0, 3, 8), 3), ([2, 3], (0, 3, 8), 1)],
    4: [([3, 0], (0, 5, 8), 1), ([1, 2], (0, 5, 8), 3)],
    6: [([2, 0, 3, 1], (0, 1, 4, 6, 8), 4)],
    8: [([1], (0, 8), 1), ([3], (0, 8), 1), ([0], (0, 8), 1), ([2], (0, 8), 1)],
    10: [([1, 3], (0, 6, 8), 1), ([2, 0], (0, 2, 8), 3)],  # per-replica bounds
    11: [([1, 3], (0, 6, 8), 2), ([2, 0], (0, 2, 8), 2)],
}
# Bad plans, each requested after the given step; each must be refused and change nothing.
BAD = {
    3: [([0, 1], (0, 3, 7), 3), ([2, 3], (0, 3, 7), 1)],  # bounds miss layer 7
    5: [([0, 1, 2], (0, 2, 4, 8), 4)],  # P x D = 3 on 4 ranks
    7: [([0, 1], (0, 4, 8), 3), ([2, 3], (0, 4, 8), 3)],  # 6 micro-batches, the batch has 4
}
STEPS = 13


def _reconfigure_rank(rank: int, world: int) -> dict:
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    schedule = {step: make_plan(replicas) for step, replicas in SCHEDULE.items()}
    schedule.update({step: make_plan(replicas) for step, replicas in BAD.items()})
    recorder = make_recorder(schedule)
    strategy = ResiHPStrategy(pipeline_degree=2, micro_batch_size=MBS)
    trainer = make_trainer(strategy, world, STEPS, callbacks=[recorder])
    trainer.fit(build_model(), make_loader())
    # After fit every rank's LightningModule holds every attached layer's trained weights.
    module_state = {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}
    # Validation after fit runs under the plan in force (2x2, permuted, bounds (0, 6, 8) and (0, 2, 8)).
    val_loss = float(trainer.validate(trainer.lightning_module, make_val_loader(), verbose=False)[0]["val_loss"])
    predictions = trainer.predict(trainer.lightning_module, make_predict_loader())
    return {
        "val_loss": val_loss,
        "predictions": [p.clone() for p in predictions],
        "losses": recorder.losses,
        "plans": recorder.plans,
        "migrations": [{**dataclasses.asdict(m), "plan": m.plan.to_dict()} for m in recorder.migrations],
        "refused": recorder.refused,
        "stats": recorder.stats,
        "state": strategy.lightning_module_state_dict(),
        "module_state": module_state,
        "profile": strategy.layer_profile(),
        "micro_batches": strategy.micro_batches,
    }


def _moved_bytes(old, new) -> int:
    """Bytes that must cross the wire between two plans, derived from who holds which layer.

    A rank needs every layer it holds under ``new`` and did not hold under ``old``; per Linear layer
    that is the weight and bias plus Adam's two moments (same shapes) and its two scalar steps.
    """
    layer_params = WIDTH * WIDTH + WIDTH

    def held(plan):
        out = {}
        for replica in plan.replicas:
            for j, device in enumerate(replica.devices):
                out[device] = set(range(replica.bounds[j], replica.bounds[j + 1]))
        return out

    before, after = held(old), held(new)
    layers = sum(len(after[d] - before[d]) for d in after)
    return layers * (3 * layer_params * 4 + 2 * 4)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_fit_through_reconfigurations_matches_single_process(distributed):
    from resihp_lightning.plan import Plan

    results = distributed(_reconfigure_rank, 4, timeout=380)
    ref_losses, ref_params = reference_run(STEPS)
    for rank, result in enumerate(results):
        assert len(result["losses"]) == STEPS
        for step, (got, want) in enumerate(zip(result["losses"], ref_losses)):
            assert abs(got - want) < 1e-6, f"rank {rank} step {step}: loss {got} vs reference {want}"
    # Checkpoint keys are the module's own ("layers.3.0.weight"; LayerSpec layers "pipeline_layers.5.0.weight").
    state = {key.split(".", 1)[1]: value for key, value in results[0]["state"].items()}
    assert sorted(state) == sorted(ref_params)
    assert all(key.startswith("layers." if int(key.split(".")[1]) < MODULE_LAYERS else "pipeline_layers.")
               for key in results[0]["state"])
    for rank, result in enumerate(results):
        assert sorted(result["module_state"]) == sorted(f"layers.{k}" for k in ref_params if int(k.split(".")[0]) < MODULE_LAYERS)
        for key, value in result["module_state"].items():
            assert torch.allclose(value, ref_params[key.split(".", 1)[1]], atol=1e-6, rtol=0), (rank, key)
    assert all(abs(r["val_loss"] - reference_val_loss(ref_params)) < 1e-6 for r in results)
    # Predictions: the whole batch's outputs on every rank, in row order, batch by batch.
    want = reference_outputs(ref_params, make_val_loader().dataset.tensors[0])
    for result in results:
        got = torch.cat(result["predictions"])
        assert [len(p) for p in result["predictions"]] == [PREDICT_BATCH, VAL_ROWS - PREDICT_BATCH]
        assert torch.allclose(got, want, atol=1e-6, rtol=0)
    for key, want in ref_params.items():
        assert torch.allclose(state[key], want, atol=1e-6, rtol=0), key

    # plans[i] is the plan batch i ran under. A request made when global_step == s (after batch
    # s - 1) applies from batch s on; bad plans were refused by name and changed nothing.
    plans = [Plan.from_dict(p) for p in results[0]["plans"]]
    for step, replicas in SCHEDULE.items():
        assert plans[step].layout_key() == make_plan(replicas).layout_key()
    for step in BAD:
        assert plans[step].layout_key() == plans[step - 1].layout_key()
    refused = results[0]["refused"]
    assert len(refused) == 3 and all(r.startswith("PlanError") for r in refused)
    assert "must start at 0 and end at 8" in refused[0]
    assert "P x D = 3 x 1 = 3 ranks but the job has 4" in refused[1]
    assert "6 micro-batches in all" in refused[2] and "global batch is 4" in refused[2]

    # Only the layers a rank did not hold crossed the wire.
    migrations = results[0]["migrations"]
    assert len(migrations) == len(SCHEDULE)
    previous = make_plan([([0, 1], (0, 4, 8), 2), ([2, 3], (0, 4, 8), 2)])
    for migration in migrations:
        new = Plan.from_dict(migration["plan"])
        assert migration["bytes_moved"] == _moved_bytes(previous, new)
        assert migration["seconds"] > 0
        previous = new
    assert migrations[-2]["bytes_moved"] == 0  # 1x4 -> 2x2: every rank already held every layer

    # Telemetry: this rank's micro-batches of each step, with busy time and workload.
    assert results[0]["micro_batches"] == M
    for rank, result in enumerate(results):
        for step, stats in enumerate(result["stats"]):
            plan = plans[step]
            where = [(r, j) for r, rep in enumerate(plan.replicas) for j, d in enumerate(rep.devices) if d == rank][0]
            assert (stats.rank, stats.replica, stats.stage) == (rank, *where)
            assert stats.layers == plan.replicas[where[0]].bounds[where[1] : where[1] + 2]
            assert len(stats.micro_batches) == plan.replicas[where[0]].micro_batches
            assert all(mb.compute_ms > 0 and mb.tokens == MBS * WIDTH for mb in stats.micro_batches)
    profile = results[0]["profile"]
    assert [c.index for c in profile] == list(range(DEPTH))
    layer_bytes = (WIDTH * WIDTH + WIDTH) * 4
    for cost in profile:
        assert cost.compute_ms > 0
        assert math.isclose(cost.static_mb, (4 * layer_bytes + 2 * 4) / 2**20, rel_tol=1e-9)
        assert math.isclose(cost.activation_mb, MBS * WIDTH * 4 / 2**20, rel_tol=1e-9)


VAL_ROWS = 10


def make_val_loader():
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(VAL_ROWS, WIDTH, generator=gen)
    return DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=VAL_ROWS)


#: Rows per predict batch: the second batch is short (3 rows) and leaves a replica without work.
PREDICT_BATCH = 7


def make_predict_loader():
    from torch.utils.data import DataLoader

    return DataLoader(make_val_loader().dataset.tensors[0], batch_size=PREDICT_BATCH)


def reference_outputs(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    layers = make_layers()
    with torch.no_grad():
        for i, layer in enumerate(layers):
            for name, p in layer.named_parameters():
                p.copy_(params[f"{i}.{name}"])
        out = x
        for layer in layers:
            out = layer(out)
        return out


def reference_val_loss(params: dict[str, torch.Tensor]) -> float:
    x, y = next(iter(make_val_loader()))
    return float(F.mse_loss(reference_outputs(params, x), y))


def _checkpoint_rank(rank: int, world: int, ckpt_dir: str) -> dict:
    import lightning.pytorch as pl

    from resihp_lightning.strategy.strategy import ResiHPStrategy

    per_epoch = ROWS // (M * MBS)
    # Run A: 2x2, one epoch, ModelCheckpoint writes at the epoch's end; then validation.
    saver = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)
    first = make_recorder()
    # Epoch-based (max_epochs): with max_steps Lightning resumes an end-of-epoch checkpoint as if it
    # were mid-epoch and re-creates the training iterator, whatever the strategy.
    trainer = make_trainer(
        ResiHPStrategy(pipeline_degree=2, micro_batch_size=MBS), world, -1,
        callbacks=[first, saver], enable_checkpointing=True, max_epochs=1,
    )
    trainer.fit(build_model(), make_loader())
    val_loss = float(trainer.validate(trainer.lightning_module, make_val_loader(), verbose=False)[0]["val_loss"])
    path = os.path.join(ckpt_dir, f"epoch=0-step={per_epoch}.ckpt")

    # Run B: 4x1 with permuted placement, a fresh module whose weights are wrong until the resume.
    model = build_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    second = make_recorder()
    plan = make_plan([([3, 1, 0, 2], (0, 2, 4, 6, 8), M)])
    trainer = make_trainer(ResiHPStrategy(plan=plan, micro_batch_size=MBS), world, -1, callbacks=[second], max_epochs=2)
    trainer.fit(model, make_loader(), ckpt_path=path)
    test_loss = float(trainer.test(trainer.lightning_module, make_val_loader(), verbose=False)[0]["test_loss"])
    saved = torch.load(path, weights_only=True) if rank == 0 else None
    return {
        "first": first.losses,
        "second": second.losses,
        "val_loss": val_loss,
        "test_loss": test_loss,
        "saved_keys": sorted(saved["state_dict"]) if saved else None,
        "saved_plan": saved["resihp"]["plan"] if saved else None,
        "saved_step": saved["global_step"] if saved else None,
        "second_plans": second.plans,
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_checkpoint_under_2x2_resumes_under_4x1(distributed, tmp_path):
    results = distributed(_checkpoint_rank, 4, timeout=380, ckpt_dir=str(tmp_path))
    per_epoch = ROWS // (M * MBS)
    ref_losses, _ = reference_run(2 * per_epoch)
    _, ref_params_a = reference_run(per_epoch)
    _, ref_params_b = reference_run(2 * per_epoch)
    for rank, result in enumerate(results):
        assert len(result["first"]) == per_epoch and len(result["second"]) == per_epoch
        for step, (got, want) in enumerate(zip(result["first"] + result["second"], ref_losses)):
            assert abs(got - want) < 1e-6, f"rank {rank} step {step}: loss {got} vs uninterrupted {want}"
        assert abs(result["val_loss"] - reference_val_loss(ref_params_a)) < 1e-6
        assert abs(result["test_loss"] - reference_val_loss(ref_params_b)) < 1e-6
        assert result["second_plans"][0]["replicas"][0]["devices"] == [3, 1, 0, 2]
    zero = results[0]
    # The LightningModule's own keys; LayerSpec layers (not attributes of the module) under pipeline_layers.
    assert zero["saved_keys"] == sorted(
        f"{'layers' if i < MODULE_LAYERS else 'pipeline_layers'}.{i}.0.{n}" for i in range(DEPTH) for n in ("weight", "bias")
    )
    assert zero["saved_plan"]["pipeline_degree"] == 2 and zero["saved_plan"]["data_degree"] == 2
    assert zero["saved_step"] == per_epoch
