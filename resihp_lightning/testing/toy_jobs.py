"""The small models, data and one-process references that several tests and benchmarks train.

Two toy jobs:

* the **exactness job**: ``DEPTH`` Linear + tanh :class:`Block` layers whose initial values depend only on
  their index, ``ROWS`` fixed regression rows, Adam with a step-wise LR schedule, M micro-batches of
  MBS rows per step. :func:`reference_run` and :func:`reference_fit` train it in one plain-PyTorch
  process; the multi-process tests compare every loss and weight against them. :func:`build_model`
  holds half its layers as ``LayerSpec``\\ s, :func:`build_class` holds all of them as attributes;
* the **control job**: :func:`build_stack`, wide Linear + tanh layers under SGD, the model of the
  fail-slow tests and benchmarks.

Lightning and DeepSpeed are imported inside the builders (they cost seconds to import); the functions
that spawned ranks run stay in the test modules, importable by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

WIDTH, DEPTH, MBS, M, ROWS = 6, 8, 2, 4, 48
LR = 0.05
#: Steps of one epoch of the exactness job (48 rows in global batches of M x MBS = 8).
EPOCH_STEPS = ROWS // (M * MBS)
#: Layers 0..3 are nn.Modules held by :func:`build_model`'s module; 4..7 are LayerSpecs, built only where held.
MODULE_LAYERS = 4
#: Rows of the validation set; the predict loader's second batch is short (3 rows) and leaves a replica without work.
VAL_ROWS, PREDICT_BATCH = 10, 7


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The exactness job's ``ROWS`` training rows (inputs, targets)."""
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


def make_layers() -> nn.ModuleList:
    return nn.ModuleList([Block(i) for i in range(DEPTH)])


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)


def make_optimizer(params) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
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
    """Plain PyTorch, one process: loss = mean over the M micro-batches of the per-micro-batch mean.

    Returns:
        The loss of every step, and the final parameters keyed ``"<layer>.<name>"``.
    """
    torch.set_num_threads(1)
    layers = make_layers()
    opt, sched = make_optimizer(layers.parameters())
    x, y = make_data()
    losses = []
    batch = M * MBS
    for step in range(steps):
        i = step % EPOCH_STEPS
        rows = epoch_order(step // EPOCH_STEPS)[i * batch : (i + 1) * batch]
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


def reference_fit(
    steps: int, clip: float | None, autocast: torch.dtype | None = None
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, within the first epoch, optionally clipping the gradients' global norm to ``clip``.

    ``autocast``: run each micro-batch's forward and loss under ``torch.autocast`` of that dtype (fp32
    parameters and optimizer, as Lightning's ``precision="bf16-mixed"``).

    Returns:
        The loss of every step, the last step's per-micro-batch losses, and the final parameters keyed
        as :func:`build_class`'s module names them (``"layers.<layer>.<name>"``).
    """
    torch.set_num_threads(1)
    layers = make_layers()
    opt, sched = make_optimizer(layers.parameters())
    x, y = make_data()
    batch = M * MBS
    losses, micro = [], []
    for step in range(steps):
        rows = epoch_order(0)[step * batch : (step + 1) * batch]
        xb, yb = x[rows], y[rows]
        opt.zero_grad()
        micro = []
        for k in range(M):
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                out = xb[k * MBS : (k + 1) * MBS]
                for layer in layers:
                    out = layer(out)
                loss = F.mse_loss(out, yb[k * MBS : (k + 1) * MBS])
            (loss / M).backward()
            micro.append(float(loss.detach()))
        if clip:
            torch.nn.utils.clip_grad_norm_(layers.parameters(), clip)
        opt.step()
        sched.step()
        losses.append(sum(micro) / M)
    params = {f"layers.{i}.{name}": p.detach().clone() for i, layer in enumerate(layers) for name, p in layer.named_parameters()}
    return losses, micro, params


def reference_outputs(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The exactness job's outputs for ``x`` under ``params`` (keyed as :func:`reference_run` returns them)."""
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
    """The mean squared error on :func:`make_val_loader`'s batch under ``params``."""
    x, y = next(iter(make_val_loader()))
    return float(F.mse_loss(reference_outputs(params, x), y))


def build_model(base: type | None = None) -> Any:
    """A ResiHPModule instance of the exactness job: layers 0..3 attributes, 4..7 ``LayerSpec``\\ s.

    Args:
        base: the module base class (default ``resihp_lightning.strategy.module.ResiHPModule``; the
            standalone ``pytorch_lightning`` test passes its own).
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


def build_class() -> type:
    """A user's model class of the exactness job: every layer an attribute of the module (so
    ``load_from_checkpoint`` sees them all), ``lr`` a hyperparameter, and ``pipeline_loss`` logs
    ``mse_in_pipeline``."""
    from resihp_lightning.strategy.module import ResiHPModule

    class Net(ResiHPModule):
        def __init__(self, lr: float = LR) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layers = nn.ModuleList([Block(i) for i in range(DEPTH)])

        def pipeline_layers(self):
            return list(self.layers)

        def pipeline_loss(self, outputs, labels):
            loss = F.mse_loss(outputs, labels)
            self.log("mse_in_pipeline", loss, on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), "interval": "step"}}

    return Net


def build_stack(width: int, depth: int, optimizer: Callable[[Any], torch.optim.Optimizer] | None = None) -> type:
    """The control job's model class: ``depth`` Linear(``width``) + tanh layers (seed 0), MSE loss.

    Args:
        width: features of every layer.
        depth: layers.
        optimizer: builds the optimizer from the parameters (default: SGD, lr 0.01).
    """
    from resihp_lightning.strategy.module import ResiHPModule

    class Stack(ResiHPModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])

        def pipeline_layers(self):
            return list(self.layers)

        def pipeline_loss(self, outputs, labels):
            return F.mse_loss(outputs, labels)

        def configure_optimizers(self):
            if optimizer is not None:
                return optimizer(self.parameters())
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Stack


def make_loader(shuffle: bool = False):
    """The exactness job's training loader (global batches of M x MBS rows)."""
    from torch.utils.data import DataLoader, TensorDataset

    x, y = make_data()
    return DataLoader(TensorDataset(x, y), batch_size=M * MBS, shuffle=shuffle)


def make_val_loader():
    """``VAL_ROWS`` validation rows in one batch (targets ``tanh(x)``)."""
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(VAL_ROWS, WIDTH, generator=gen)
    return DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=VAL_ROWS)


def make_predict_loader():
    """The validation inputs in batches of ``PREDICT_BATCH`` (the second batch is short)."""
    from torch.utils.data import DataLoader

    return DataLoader(make_val_loader().dataset.tensors[0], batch_size=PREDICT_BATCH)


def make_trainer(strategy, world: int, steps: int, callbacks=(), **kwargs):
    """A quiet CPU ``Trainer`` for ``steps`` steps on ``world`` devices; ``kwargs`` override its options."""
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
    """A Lightning callback that records every step's loss, step statistics, plan and migration, and
    requests ``schedule[global_step]`` after that step (a refused request is recorded by its error).

    Args:
        schedule: global step -> plan to request after the batch that ends at that step.
    """
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
    """A :class:`~resihp_lightning.plan.Plan` from ``[(devices, bounds, micro_batches), ...]``."""
    from resihp_lightning.plan import Plan, Replica

    return Plan(tuple(Replica(tuple(devices), tuple(bounds), m) for devices, bounds, m in replicas))


def assert_survivors_match_reference(outcome, survivors: list[int], steps: int) -> None:
    """Exactly ``survivors`` returned from a ``harness.run_job`` of :func:`build_class`'s model, each with
    :func:`reference_fit`'s losses at every step and its final weights in the module."""
    ref_losses, _, ref_params = reference_fit(steps, None)
    values = outcome.values()
    assert sorted(values) == sorted(survivors), outcome.describe()
    for rank in survivors:
        result = values[rank]
        for step, (got, want) in enumerate(zip(result["losses"], ref_losses, strict=True)):
            assert abs(got - want) < 1e-6, f"rank {rank} step {step}: {got} vs reference {want}"
        for key, want in ref_params.items():
            assert torch.allclose(result["state"][key], want, atol=1e-6, rtol=0), (rank, key)
