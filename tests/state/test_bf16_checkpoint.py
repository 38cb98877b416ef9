"""bf16-mixed checkpoints hold the fp32 masters and resume under another plan exactly (4 gloo processes).

Under ``Trainer(precision="bf16-mixed")`` the layer-wise engine keeps fp32 parameters (the masters)
and per-parameter Adam state, so the per-layer checkpoint path saves them as it saves a plain fp32
run. One job, three fits of the exactness job: ``switched`` trains two epochs and re-plans from
2 x 2 to per-replica bounds after the first; ``first`` trains the first epoch under 2 x 2 and saves;
``resumed`` loads that checkpoint under the per-replica plan and trains the second epoch. The second
epoch's losses and the final weights of ``resumed`` must equal ``switched``'s to 1e-6: the
checkpoint carried the fp32 masters and the optimizer state, not bf16 copies. A fourth fit reduces the
gradients in bf16 (``deepspeed_config={"communication_data_type": "bf16"}``): its updates must differ.
"""

from __future__ import annotations

import os

import pytest
import torch

from resihp_lightning.testing.toy_jobs import DEPTH, EPOCH_STEPS, MBS, build_class, make_loader, make_plan, make_recorder, make_trainer

#: The plan of the second epoch: per-replica bounds, other ranks per stage.
PER_REPLICA = make_plan([([1, 0], (0, 3, DEPTH), 1), ([3, 2], (0, 6, DEPTH), 3)])


def _rank(rank: int, world: int, ckpt_dir: str, precision: str = "bf16-mixed") -> dict:
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    Net = build_class()
    path = os.path.join(ckpt_dir, "epoch1.ckpt")
    out: dict = {}

    def fit(name: str, epochs: int, schedule=None, ckpt_path=None, **strategy_kwargs) -> None:
        recorder = make_recorder(schedule)
        strategy = ResiHPStrategy(micro_batch_size=MBS, **strategy_kwargs)
        # By epochs: a fit that ends with its epoch saves a checkpoint that resumes at the next epoch.
        trainer = make_trainer(strategy, world, -1, callbacks=[recorder], precision=precision, max_epochs=epochs)
        model = Net()
        trainer.fit(model, make_loader(), ckpt_path=ckpt_path)
        if name == "first":
            trainer.save_checkpoint(path)
        out[name] = {"losses": recorder.losses, "plans": recorder.plans,
                     "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}

    fit("switched", 2, schedule={EPOCH_STEPS: PER_REPLICA}, pipeline_degree=2)
    fit("first", 1, pipeline_degree=2)
    fit("resumed", 2, ckpt_path=path, plan=PER_REPLICA)
    # The gradient all-reduce in bf16 (DeepSpeed's communication_data_type) instead of fp32.
    fit("bf16_reduce", 1, pipeline_degree=2, deepspeed_config={"communication_data_type": "bf16"})
    if rank == 0:
        saved = torch.load(path, weights_only=False, map_location="cpu")
        out["saved_dtypes"] = {k: v.dtype for k, v in saved["state_dict"].items()}
        state = saved["optimizer_states"][0]["state"]
        out["saved_optimizer"] = sorted({(k, v.dtype) for entry in state.values() for k, v in entry.items() if torch.is_tensor(v) and v.dim() > 0})
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bf16_mixed_checkpoint_holds_fp32_masters_and_resumes_under_another_plan_exactly(distributed, tmp_path):
    results = distributed(_rank, 4, timeout=280, ckpt_dir=str(tmp_path))
    saved = results[0]["saved_dtypes"]
    assert saved and set(saved.values()) == {torch.float32}, saved
    assert results[0]["saved_optimizer"] == [("exp_avg", torch.float32), ("exp_avg_sq", torch.float32)], results[0]["saved_optimizer"]
    for rank, result in enumerate(results):
        switched, first, resumed = result["switched"], result["first"], result["resumed"]
        # bf16 gradient sums: the same first loss (no update yet), then other (bf16-rounded) updates.
        reduced = result["bf16_reduce"]["losses"]
        assert reduced[0] == first["losses"][0]
        assert 1e-7 < max(abs(a - b) for a, b in zip(reduced, first["losses"], strict=True)) < 2e-3, (reduced, first["losses"])
        assert first["losses"] == pytest.approx(switched["losses"][:EPOCH_STEPS], abs=1e-6), rank
        # The resumed fit ran under the per-replica plan, the second epoch only.
        assert len(resumed["losses"]) == EPOCH_STEPS, resumed["losses"]
        assert all(p == PER_REPLICA.to_dict() for p in resumed["plans"]), resumed["plans"][0]
        assert switched["plans"][-1] == PER_REPLICA.to_dict()
        for step, (got, want) in enumerate(zip(resumed["losses"], switched["losses"][EPOCH_STEPS:], strict=True)):
            assert abs(got - want) <= 1e-6, f"rank {rank} step {EPOCH_STEPS + step}: resumed {got} vs {want}"
        for key, want in switched["state"].items():
            assert resumed["state"][key].dtype == torch.float32
            assert torch.allclose(resumed["state"][key], want, atol=1e-6, rtol=0), (rank, key)
