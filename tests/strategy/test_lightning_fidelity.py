"""Trainer features under ResiHPStrategy as a Lightning user meets them (4 real gloo processes).

The trained model comes back (in the LightningModule after fit, and through a plain single-process
``load_from_checkpoint``), ``gradient_clip_val`` clips by the exact global norm, ``precision="bf16-true"``
is DeepSpeed's bf16 mode (``"bf16-mixed"``, the layer-wise engine's, is tested in ``tests/failstop/test_bf16_recovery.py``), ``self.log`` inside ``pipeline_loss`` reaches ``callback_metrics``, and a
short last batch is refused before the first step.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from resihp_lightning.testing.toy_jobs import (
    EPOCH_STEPS,
    M,
    MBS,
    ROWS,
    build_class,
    make_data,
    make_plan,
    make_recorder,
    reference_fit,
)

CLIP = 0.05
STEPS = EPOCH_STEPS  # one epoch: 48 rows in batches of M x MBS = 8
SWITCH_AT = 3  # a per-replica re-plan mid-run


def _fidelity_rank(rank: int, world: int, ckpt_dir: str) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.errors import ConfigError
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    Net = build_class()
    x, y = make_data()
    loader = DataLoader(TensorDataset(x, y), batch_size=M * MBS)
    common = dict(accelerator="cpu", devices=world, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0)
    out: dict = {}

    # 1. Clipped by the Trainer, re-planned to per-replica bounds mid-run, checkpointed at the end.
    recorder = make_recorder({SWITCH_AT: make_plan([([1, 0], (0, 3, 8), 1), ([3, 2], (0, 6, 8), 3)])})
    saver = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True)
    trainer = pl.Trainer(strategy=ResiHPStrategy(pipeline_degree=2, micro_batch_size=MBS), max_steps=STEPS,
                         gradient_clip_val=CLIP, callbacks=[recorder, saver], **common)
    model = Net()
    trainer.fit(model, loader)
    out["clipped_losses"] = recorder.losses
    out["logged"] = float(trainer.callback_metrics["mse_in_pipeline"])
    out["module_state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    # 2. Trainer(precision="bf16-true") is DeepSpeed's bf16: the same losses as deepspeed_config bf16.
    runs = {}
    for name, precision, config in (("trainer", "bf16-true", {}), ("deepspeed", "32-true", {"bf16": {"enabled": True}})):
        recorder = make_recorder()
        trainer = pl.Trainer(strategy=ResiHPStrategy(pipeline_degree=2, micro_batch_size=MBS, deepspeed_config=config),
                             max_steps=3, precision=precision, callbacks=[recorder], enable_checkpointing=False, **common)
        trainer.fit(Net(), loader)
        runs[name] = recorder.losses
    out["bf16"] = runs

    # DeepSpeed's ZeRO-1 wraps the optimizer; DeepSpeed's own wrapper then clips (by the norm over all stages).
    recorder = make_recorder()
    trainer = pl.Trainer(strategy=ResiHPStrategy(pipeline_degree=2, micro_batch_size=MBS,
                                                 deepspeed_config={"zero_optimization": {"stage": 1, "layerwise": False}}),
                         max_steps=3, gradient_clip_val=CLIP, callbacks=[recorder], enable_checkpointing=False, **common)
    trainer.fit(Net(), loader)
    out["zero1_clipped"] = recorder.losses

    # gather_weights="rank0": only rank 0's module receives every layer (point to point).
    trainer = pl.Trainer(strategy=ResiHPStrategy(pipeline_degree=2, micro_batch_size=MBS, gather_weights="rank0"),
                         max_steps=2, callbacks=[make_recorder()], enable_checkpointing=False, **common)
    model = Net()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer.fit(model, loader)
    out["rank0_state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["rank0_initial"] = initial
    out["local_layers"] = sorted(trainer.strategy.local_layers())

    # 3. A loader whose last batch is short is refused before the first step.
    short = DataLoader(TensorDataset(x[:ROWS - 3], y[:ROWS - 3]), batch_size=M * MBS)
    recorder = make_recorder()
    trainer = pl.Trainer(strategy=ResiHPStrategy(pipeline_degree=2, micro_batch_size=MBS), max_epochs=1,
                         callbacks=[recorder], enable_checkpointing=False, **common)
    try:
        trainer.fit(Net(), short)
        out["short"] = None
    except ConfigError as err:
        out["short"] = (str(err), len(recorder.losses))
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_trainer_features_and_the_trained_model_come_back(distributed, tmp_path):
    results = distributed(_fidelity_rank, 4, timeout=380, ckpt_dir=str(tmp_path))
    ref_losses, ref_micro, ref_params = reference_fit(STEPS, CLIP)
    unclipped, _, _ = reference_fit(STEPS, None)
    assert any(abs(a - b) > 1e-4 for a, b in zip(ref_losses[:3], unclipped[:3])), "the clip must bind in this test"
    for rank, result in enumerate(results):
        for step, (got, want) in enumerate(zip(result["clipped_losses"], ref_losses, strict=True)):
            assert abs(got - want) < 1e-6, f"rank {rank} step {step}: {got} vs clipped reference {want}"
        # self.log in pipeline_loss: the mean over the last global batch's micro-batches, on every rank.
        assert abs(result["logged"] - sum(ref_micro) / M) < 1e-6, rank
        # After fit every rank's module holds every layer's trained weights.
        assert sorted(result["module_state"]) == sorted(ref_params)
        for key, want in ref_params.items():
            assert torch.allclose(result["module_state"][key], want, atol=1e-6, rtol=0), (rank, key)
        assert result["bf16"]["trainer"] == result["bf16"]["deepspeed"], rank
        for step, (got, want) in enumerate(zip(result["zero1_clipped"], ref_losses[:3], strict=True)):
            assert abs(got - want) < 1e-6, f"ZeRO-1 rank {rank} step {step}: {got} vs clipped reference {want}"
        # gather_weights="rank0": rank 0 holds the trained model; elsewhere, layers of other stages keep
        # their initial values.
        _, _, two_steps = reference_fit(2, None)
        for key, want in two_steps.items():
            layer = int(key.split(".")[1])
            got = result["rank0_state"][key]
            if rank == 0 or layer in result["local_layers"]:
                assert torch.allclose(got, want, atol=1e-6, rtol=0), (rank, key)
            else:
                assert torch.equal(got, result["rank0_initial"][key]), (rank, key)
        message, steps_run = result["short"]
        assert "drop_last=True" in message and "45 rows" in message and steps_run == 0

    # A plain single process (no strategy) opens the checkpoint with the module's own keys.
    Net = build_class()
    (path,) = glob.glob(os.path.join(tmp_path, "last.ckpt"))
    loaded = Net.load_from_checkpoint(path, map_location="cpu")
    for key, want in ref_params.items():
        assert torch.allclose(loaded.state_dict()[key], want, atol=1e-6, rtol=0), key


def test_trainer_options_map_onto_deepspeed_or_are_refused():
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from resihp_lightning.strategy.trainer_options import effective_deepspeed_config

    def effective(config, precision="32-true", clip=None, algorithm=None):
        return effective_deepspeed_config(config, precision, clip, algorithm, MisconfigurationException)

    # bf16-mixed is the layer-wise engine's (nothing for DeepSpeed) unless deepspeed_config picks a wrapper.
    assert "bf16" not in effective({}, "bf16-mixed")
    assert effective({"bf16": {"enabled": True}}, "bf16-mixed")["bf16"] == {"enabled": True}
    assert effective({"zero_optimization": {"stage": 1, "layerwise": False}}, "bf16-mixed")["bf16"] == {"enabled": True}
    assert "bf16" not in effective({"zero_optimization": {"stage": 1}}, "bf16-mixed")  # the layer-wise ZeRO-1
    assert effective({}, "bf16-true")["bf16"] == {"enabled": True}
    for precision in ("16-mixed", "16-true"):
        with pytest.raises(MisconfigurationException, match=rf"precision='{precision}'.*no fp16 loss scaling.*bf16-mixed"):
            effective({}, precision)
    assert effective({"zero_optimization": {"stage": 1}}, clip=0.5)["gradient_clipping"] == 0.5
    assert "bf16" not in effective({}) and "gradient_clipping" not in effective({})
    with pytest.raises(MisconfigurationException, match=r"precision='64-true'.*allowed"):
        effective({}, "64-true")
    with pytest.raises(MisconfigurationException, match=r"gradient_clip_algorithm='value'.*'norm'"):
        effective({}, clip=1.0, algorithm="value")
    with pytest.raises(MisconfigurationException, match=r"contradicts deepspeed_config\['gradient_clipping'\]=2.0"):
        effective({"gradient_clipping": 2.0}, clip=1.0)
    with pytest.raises(MisconfigurationException, match="enables fp16"):
        effective({"fp16": {"enabled": True}}, "bf16-mixed")


def test_overriding_a_step_method_is_refused_with_the_reason():
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from resihp_lightning.strategy.module import check_contract

    Net = build_class()

    class Custom(Net):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx)

    check_contract(Net())
    with pytest.raises(MisconfigurationException, match=r"overrides training_step\(\).*pipeline_loss"):
        check_contract(Custom())


def test_manual_optimization_is_refused_with_the_reason(tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from resihp_lightning.strategy.trainer_options import refuse_unsupported

    Net = build_class()

    class Manual(Net):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=str(tmp_path))
    trainer.strategy.connect(Net())
    refuse_unsupported(trainer, trainer.strategy, MisconfigurationException)
    trainer.strategy.connect(Manual())
    with pytest.raises(MisconfigurationException, match=r"automatic_optimization = False.*configure_optimizers"):
        refuse_unsupported(trainer, trainer.strategy, MisconfigurationException)
