"""``Trainer(strategy="resihp")`` in the standalone ``pytorch_lightning`` package, on 2 gloo processes.

The run goes through two re-plans (1x2 -> 2x1 with moved bounds -> 1x2 with uneven micro-batches)
and must match the single-process plain-PyTorch reference of ``test_strategy`` step by step.
"""

from __future__ import annotations

import pytest
import torch

from resihp_lightning.testing.toy_jobs import build_model, make_loader, make_plan, reference_run

pytest.importorskip("pytorch_lightning")

# Trainer(strategy="resihp") takes the default micro_batch_size=1: the reference's batch of
# M x MBS = 8 rows is 8 micro-batches here (the same mean loss).
SCHEDULE = {
    2: [([1, 0], (0, 3, 8), 8)],
    4: [([0], (0, 8), 6), ([1], (0, 8), 2)],
}
STEPS = 6


def _standalone_rank(rank: int, world: int) -> dict:
    import pytorch_lightning as pl

    import resihp_lightning  # noqa: F401 - registers "resihp" in pytorch_lightning's registry
    from resihp_lightning.strategy.standalone import ResiHPModule, ResiHPStrategy

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.layouts: list[str] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))
            self.layouts.append(trainer.strategy.current_plan.layout_key())
            if trainer.global_step in SCHEDULE:
                trainer.strategy.request_plan(make_plan(SCHEDULE[trainer.global_step]))

    recorder = Recorder()
    trainer = pl.Trainer(
        strategy="resihp",
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[recorder],
    )
    misconfigured = ""
    try:
        pl.Trainer(strategy=ResiHPStrategy(), accelerator="cpu", devices=world, accumulate_grad_batches=2).fit(
            build_model(ResiHPModule), make_loader()
        )
    except pl.utilities.exceptions.MisconfigurationException as err:
        misconfigured = str(err)
    trainer.fit(build_model(ResiHPModule), make_loader())
    return {
        "strategy": f"{type(trainer.strategy).__module__}.{type(trainer.strategy).__name__}",
        "is_pl_strategy": isinstance(trainer.strategy, pl.strategies.Strategy),
        "misconfigured": misconfigured,
        "losses": recorder.losses,
        "layouts": recorder.layouts,
        "state": trainer.strategy.lightning_module_state_dict(),
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_pytorch_lightning_trainer_runs_resihp_and_replans(distributed):
    results = distributed(_standalone_rank, 2, timeout=280)
    ref_losses, ref_params = reference_run(STEPS)
    for rank, result in enumerate(results):
        assert result["strategy"] == "resihp_lightning.strategy.standalone.ResiHPStrategy"
        assert result["is_pl_strategy"]
        assert "accumulate_grad_batches" in result["misconfigured"], result["misconfigured"]
        for step, (got, want) in enumerate(zip(result["losses"], ref_losses, strict=True)):
            assert abs(got - want) < 1e-6, f"rank {rank} step {step}: loss {got} vs reference {want}"
        assert result["layouts"][2] == make_plan(SCHEDULE[2]).layout_key()
        assert result["layouts"][4] == make_plan(SCHEDULE[4]).layout_key()
    state = {key.split(".", 1)[1]: value for key, value in results[0]["state"].items()}  # module keys
    assert sorted(state) == sorted(ref_params)
    for key, want in ref_params.items():
        assert torch.allclose(state[key], want, atol=1e-6, rtol=0), key
