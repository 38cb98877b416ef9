"""End-to-end tests of ResiHPStrategy on 4 real gloo processes (Trainer.fit inside each rank).

One spawned job runs several checks, because starting 4 processes that import Lightning and
DeepSpeed costs ~15 s here. The reference for every loss and parameter is a single-process
plain-PyTorch run of the same model, data, optimizer and LR schedule (``resihp_lightning.testing.toy_jobs``).
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from resihp_lightning.testing.toy_jobs import (
    DEPTH,
    EPOCH_STEPS,
    M,
    MBS,
    MODULE_LAYERS,
    PREDICT_BATCH,
    VAL_ROWS,
    WIDTH,
    build_model,
    make_loader,
    make_plan,
    make_predict_loader,
    make_recorder,
    make_trainer,
    make_val_loader,
    reference_outputs,
    reference_run,
    reference_val_loss,
)

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


def _checkpoint_rank(rank: int, world: int, ckpt_dir: str) -> dict:
    import lightning.pytorch as pl

    from resihp_lightning.strategy.strategy import ResiHPStrategy

    per_epoch = EPOCH_STEPS
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
    per_epoch = EPOCH_STEPS
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
