"""ResiHPStrategy with DeepSpeed's optimizer wrappers (ZeRO-1, bf16): layer moves and checkpoints.

One job on 2 real gloo processes runs four fits:

* ZeRO-1 (fp32) through three re-plans that move every layer (2x1 -> swapped 2x1 with other bounds
  -> 1x2 with 3/1 micro-batches -> 2x1): every loss and the final parameters match the one-process
  plain-PyTorch reference of ``test_strategy`` to 1e-6;
* ZeRO-1 checkpoint written under 2x1, resumed under 1x2 into a module whose weights were zeroed:
  the resumed losses continue the reference (so the wrapper's fp32 masters and moments were restored);
* bf16 with re-plans that keep the arithmetic (ranks swap stages, a bound moves) and the same run
  without them: losses and parameters are bit-identical (so the fp32 masters and moments moved exactly).

fp16 is not run: DeepSpeed refuses it on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from resihp_lightning.testing.toy_jobs import WIDTH, M, MBS, ROWS, build_model, make_loader, make_plan, make_recorder, make_trainer, reference_run

ZERO1 = {"zero_optimization": {"stage": 1, "layerwise": False}}  # DeepSpeed's ZeRO-1 wrapper (the layer-wise one: tests/failstop/test_zero1_recovery.py)
BF16 = {"bf16": {"enabled": True}}
ZERO_SCHEDULE = {
    2: [([1, 0], (0, 3, 8), M)],
    4: [([0], (0, 8), 3), ([1], (0, 8), 1)],
    6: [([0, 1], (0, 5, 8), M)],
}
ZERO_STEPS = 8
BF16_SCHEDULE = {2: [([1, 0], (0, 4, 8), M)], 4: [([1, 0], (0, 3, 8), M)]}
BF16_STEPS = 6


def _fit(world: int, steps: int, config: dict, schedule: dict | None = None, **kwargs) -> tuple:
    import lightning.pytorch as pl

    from resihp_lightning.strategy.strategy import ResiHPStrategy

    class Profile(pl.Callback):
        """Keeps the last step's layer profile (collective; the engine is gone after fit)."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            recorder.static_mb = [c.static_mb for c in trainer.strategy.layer_profile()]

    recorder = make_recorder({step: make_plan(r) for step, r in (schedule or {}).items()})
    strategy = ResiHPStrategy(pipeline_degree=2, micro_batch_size=MBS, deepspeed_config=config)
    trainer = make_trainer(strategy, world, steps, callbacks=[recorder, Profile()], **kwargs)
    trainer.fit(build_model(), make_loader())
    return recorder, strategy


def _wrapped_rank(rank: int, world: int, ckpt_dir: str) -> dict:
    import lightning.pytorch as pl

    from resihp_lightning.strategy.strategy import ResiHPStrategy

    out: dict = {}
    recorder, strategy = _fit(world, ZERO_STEPS, ZERO1, ZERO_SCHEDULE)
    out["zero_losses"], out["zero_plans"], out["zero_refused"] = recorder.losses, recorder.plans, recorder.refused
    out["zero_migrations"] = [m.bytes_moved for m in recorder.migrations]
    out["zero_state"] = strategy.lightning_module_state_dict()
    out["zero_profile"] = recorder.static_mb

    # Checkpoint under 2x1 (end of epoch 0), resume under 1x2 into zeroed weights.
    per_epoch = ROWS // (M * MBS)
    saver = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)
    first = make_recorder()
    trainer = make_trainer(
        ResiHPStrategy(pipeline_degree=2, micro_batch_size=MBS, deepspeed_config=ZERO1), world, -1,
        callbacks=[first, saver], enable_checkpointing=True, max_epochs=1,
    )
    trainer.fit(build_model(), make_loader())
    model = build_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    second = make_recorder()
    plan = make_plan([([1], (0, 8), M // 2), ([0], (0, 8), M // 2)])
    trainer = make_trainer(
        ResiHPStrategy(plan=plan, micro_batch_size=MBS, deepspeed_config=ZERO1), world, -1,
        callbacks=[second], max_epochs=2,
    )
    trainer.fit(model, make_loader(), ckpt_path=os.path.join(ckpt_dir, f"epoch=0-step={per_epoch}.ckpt"))
    out["resumed"] = first.losses + second.losses

    moved, moved_strategy = _fit(world, BF16_STEPS, BF16, BF16_SCHEDULE)
    still, still_strategy = _fit(world, BF16_STEPS, BF16)
    out["bf16_moved"], out["bf16_still"] = moved.losses, still.losses
    out["bf16_plans"] = moved.plans
    out["bf16_state_moved"] = moved_strategy.lightning_module_state_dict()
    out["bf16_state_still"] = still_strategy.lightning_module_state_dict()
    out["bf16_profile"] = moved.static_mb
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_zero1_and_bf16_move_layers_and_resume_exactly(distributed, tmp_path):
    results = distributed(_wrapped_rank, 2, timeout=380, ckpt_dir=str(tmp_path))
    ref_losses, ref_params = reference_run(ZERO_STEPS)
    per_epoch = ROWS // (M * MBS)
    resumed_ref, _ = reference_run(2 * per_epoch)
    for rank, result in enumerate(results):
        assert result["zero_refused"] == []
        for step, (got, want) in enumerate(zip(result["zero_losses"], ref_losses, strict=True)):
            assert abs(got - want) < 1e-6, f"ZeRO-1 rank {rank} step {step}: {got} vs reference {want}"
        for step, replicas in ZERO_SCHEDULE.items():
            assert result["zero_plans"][step]["replicas"] == make_plan(replicas).to_dict()["replicas"]
        assert len(result["resumed"]) == 2 * per_epoch
        for step, (got, want) in enumerate(zip(result["resumed"], resumed_ref, strict=True)):
            assert abs(got - want) < 1e-6, f"ZeRO-1 resume rank {rank} step {step}: {got} vs uninterrupted {want}"
        assert result["bf16_moved"] == result["bf16_still"], rank
        assert result["bf16_plans"][4]["replicas"][0]["bounds"] == [0, 3, 8]
    # Module keys ("layers.0.0.weight", LayerSpec layers "pipeline_layers.4.0.weight"), as in the e2e test.
    state = {key.split(".", 1)[1]: value for key, value in results[0]["zero_state"].items()}
    assert sorted(state) == sorted(ref_params)
    for key, want in ref_params.items():
        assert torch.allclose(state[key], want, atol=1e-6, rtol=0), key
    # Every layer moves twice; the way back to 2x1 needs nothing (each rank held the whole model).
    moved_bytes = results[0]["zero_migrations"]
    assert len(moved_bytes) == 3 and moved_bytes[0] > 0 and moved_bytes[1] > 0 and moved_bytes[2] == 0, moved_bytes
    # Static memory per layer counts the wrapper's fp32 master and two moments (12 B per element; both
    # runs end with D = 1, so the partition is everything; ZeRO may pad it slightly) on top of the
    # weight and its gradient (fp32: 8 B, bf16: 4 B).
    elements = WIDTH * WIDTH + WIDTH
    for profile, weight_and_grad in ((results[0]["zero_profile"], 8), (results[0]["bf16_profile"], 4)):
        for static_mb in profile:
            assert 1.0 <= static_mb * 2**20 / (elements * (weight_and_grad + 12)) < 1.05, profile
    # bf16 runs hand back the fp32 master weights (the module ends in float32 after fit).
    moved, still = results[0]["bf16_state_moved"], results[0]["bf16_state_still"]
    assert sorted(moved) == sorted(still) and all(moved[k].dtype == torch.float32 for k in moved)
    for key in still:
        assert torch.equal(moved[key], still[key]), key
