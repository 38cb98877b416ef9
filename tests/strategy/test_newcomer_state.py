"""``strategy.newcomer_state``: a second Trainer takes a running one's Lightning state at a step's start and
goes on exactly where it was (one process, no strategy: the transplant alone).

Trainer A records, at every training step, the global step, batch index, epoch, the batch's first row,
the LR and Lightning's count of batches that stepped, and validation runs; at step ``k`` it captures
its state (:func:`~resihp_lightning.strategy.newcomer_state.capture`). Trainer B, a fresh one, applies it
before its loop starts and reads its loader through
:class:`~resihp_lightning.strategy.newcomer_state.SkipFirstBatches`: from step ``k`` on, its record must
be A's, validation included, across an epoch boundary.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

ROWS, BATCH, STEPS = 48, 8, 10  # 6 batches an epoch: the runs cross into epoch 1


def _run(capture_at: int | None = None, state: dict | None = None, resumable: bool = False) -> tuple[list, dict]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from resihp_lightning.data.resumable import ResumableDataLoader
    from resihp_lightning.strategy import newcomer_state

    captured: dict = {}
    record: list = []

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            trainer = self.trainer
            if trainer.global_step == capture_at:
                captured.update(newcomer_state.capture(trainer))
            record.append((trainer.global_step, batch_idx, trainer.current_epoch, int(batch[0][0, 0]),
                           trainer.optimizers[0].param_groups[0]["lr"], trainer.fit_loop.epoch_loop._batches_that_stepped))
            return (self.layer(batch[0]) - batch[1]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            record.append(("val", self.trainer.global_step))

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    class Apply(pl.Callback):  # after the optimizers exist, before the fit loop (where the strategy applies it)
        def on_fit_start(self, trainer, pl_module):
            newcomer_state.apply(trainer, state)

    rows = torch.arange(ROWS, dtype=torch.float32).reshape(ROWS, 1).repeat(1, 2)
    data = TensorDataset(rows, torch.zeros(ROWS, 2))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)  # as Lightning injects it
    loader = (ResumableDataLoader if resumable else DataLoader)(data, batch_size=BATCH, sampler=sampler)
    if state is not None:
        loader = newcomer_state.SkipFirstBatches(loader, state["data"]["batches"])
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, val_check_interval=2,
                         num_sanity_val_steps=2, callbacks=[Apply()] if state is not None else [])
    val = DataLoader(TensorDataset(rows[:4], torch.zeros(4, 2)), batch_size=4)
    trainer.fit(Model(), loader, val)
    return record, captured


@pytest.mark.parametrize(("at", "resumable"), [(2, False), (3, False), (6, False), (7, True)])
def test_a_fresh_trainer_goes_on_from_the_captured_step_exactly(at, resumable):
    """Captured right after a validation (2), mid-validation interval (3), at an epoch's first batch (6),
    and in the next epoch through a resumable loader (7)."""
    record, captured = _run(capture_at=at, resumable=resumable)
    assert captured["global_step"] == at
    resumed, _ = _run(state=captured, resumable=resumable)
    first = record.index(next(r for r in record if r[0] == at))
    assert resumed == record[first:]
    assert resumed[-1] == record[-1]


def test_skip_first_batches_skips_when_drawn_and_forwards_the_loader():
    from torch.utils.data import DataLoader

    from resihp_lightning.strategy.newcomer_state import SkipFirstBatches

    inner = DataLoader(list(range(10)), batch_size=2)
    loader = SkipFirstBatches(inner, 3)
    unused = iter(loader)  # Lightning checks that a loader iterates: nothing is drawn, nothing skipped
    del unused
    assert len(loader) == 5 and loader.batch_size == 2 and loader.dataset is inner.dataset
    assert [b.tolist() for b in loader] == [[6, 7], [8, 9]]
    assert [b.tolist() for b in loader][:1] == [[0, 1]]  # the next epoch is whole
