"""The layer-wise ZeRO-1 under tensor parallelism: re-splits re-cut the slices, a lost member's group goes on smaller.

Each member's shard of a layer is a parameter of its own, its Adam moments sliced over the processes holding
the same shard in the other replicas (:mod:`~resihp_lightning.state.zero_holders`). One 4-process job
(``bf16-mixed``, 2 layers of :func:`~resihp_lightning.testing.tensor_jobs.tensor_parallel_llama` plus embedding
and head, 4 micro-batches), run twice on real gloo processes, with ZeRO-1 and without:

* step 0 in two groups of two (two replicas: every shard kept by both holders, D = 2);
* step 1 after a planned re-split to four groups of one (four replicas, D = 4: each process keeps 2 of the 4
  slices of every layer, half the unsharded Adam bytes);
* step 2 after a plan change over the same groups: two replicas of two stages with their own bounds, layers
  moving with their moments;
* step 3 after a re-split back to two groups of two;
* step 4: rank 1 is SIGKILLed at the forward of its 2nd micro-batch: group 0 goes on as rank 0 alone
  (degree 1) beside group 1 at degree 2, its lost shard (and the shard's moments) cut from group 1, and the
  step is redone;
* step 5 under the survivors' plan.

Asserted: with and without ZeRO-1 the survivors' losses, final fp32 weights and whole Adam moments are equal to
1e-6 (bit for bit, in practice) under the same plans; inside the recovery, before the redo, every survivor's
whole weights and moments equal those it had when step 3 ended (the state is copied, never recomputed, and the
interrupted step left nothing); the losses match one process training the unsplit model within bf16's
tolerance.

Why no no-fault twin: a plan cannot leave a process idle under tensor parallelism (no spares there yet), and
any plan that keeps the lost process busy changes the arithmetic (another degree, another data-parallel
degree, or a stage count the other replicas do not share); the recovery without ZeRO-1 is the exact
comparison, and ``tests/tensor/test_tensor_fail_stop.py`` checks it against the unsplit model.
"""

from __future__ import annotations

import pytest
import torch

from resihp_lightning.testing.tensor_jobs import kill_inside_step, packed_batches, tensor_parallel_llama, unsplit_reference

STEPS = 6
VICTIM, AT_STEP = 1, 4
ZERO1 = {"zero_optimization": {"stage": 1}}
#: |bf16-mixed job - one-process bf16-autocast reference| on the losses (split matmuls round other bf16 sums).
BF16_LOSS_TOLERANCE = 3e-3
#: Step -> (groups or None: the same, plan over them) requested after that step.
SCHEDULE = {
    0: ([[0], [1], [2], [3]], {"replicas": [{"devices": [g], "bounds": [0, 4], "micro_batches": 1} for g in range(4)]}),
    1: (None, {"replicas": [{"devices": [3, 0], "bounds": [0, 2, 4], "micro_batches": 2},
                            {"devices": [1, 2], "bounds": [0, 3, 4], "micro_batches": 2}]}),
    2: ([[0, 1], [2, 3]], {"replicas": [{"devices": [g], "bounds": [0, 4], "micro_batches": 2} for g in range(2)]}),
}


def _whole(runtime) -> dict:
    """This process's whole (unsplit) weights and Adam state of its layers (collective over its groups)."""
    state = runtime.optimizer_checkpoint_state()
    return {
        "weights": {k: v.detach().float().clone() for k, v in runtime.trained_tensors().items()},
        "moments": {key: {n: v.detach().clone() if torch.is_tensor(v) else v for n, v in entry.items()}
                    for key, entry in state.items()},
    }


def _job(rank: int, world: int, run_dir: str, config: dict) -> dict:
    import warnings

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.plan import Plan
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    warnings.filterwarnings("ignore")
    killer = kill_inside_step(rank, VICTIM, AT_STEP, run_dir)

    class Watch(pl.Callback):
        """Requests the schedule, keeps the state at the end of step 1 and inside the recovery, and what ZeRO-1 kept."""

        def __init__(self) -> None:
            self.before: dict = {}
            self.restored: dict = {}
            self.kept: tuple[float, float] | None = None
            self.steppers: set[str] = set()
            self.requested = 0

        def on_train_start(self, trainer, pl_module):
            strategy = trainer.strategy
            strategy.recovery_listeners.append(lambda: self.restored.update(_whole(strategy._state.require())))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            strategy = trainer.strategy
            runtime = strategy._state.require()
            self.steppers.add(type(runtime.engine.optimizer).__name__)
            step = trainer.global_step - 1
            if step == AT_STEP - 1:
                self.before = _whole(runtime)
            shards = getattr(runtime._carrier, "shards", None)
            if step == 1 and shards is not None:  # D = 4: each process keeps slices i and i + 1 of its (whole) layers
                params = runtime.local_parameters().values()
                self.kept = (sum(shards.state_bytes(p) for p in params), 8 * sum(p.numel() for p in params))
            if step in SCHEDULE:
                groups, plan = SCHEDULE[step]
                strategy.request_plan(Plan.from_dict(plan), tensor_groups=groups)
                self.requested += 1

    watch = Watch()
    module = tensor_parallel_llama()
    strategy = ResiHPStrategy(tensor_degree=2, pipeline_degree=1, micro_batch_size=1, micro_batches=4,
                              gather_weights="all", deepspeed_config=config, fail_stop=FailStopConfig(min_data_degree=2))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         precision="bf16-mixed", enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, use_distributed_sampler=False, callbacks=[killer, watch],
                         default_root_dir=run_dir)
    trainer.fit(module, DataLoader(packed_batches(STEPS), batch_size=None))
    runtime = strategy._state.require()
    # A survivor may finish this gather (over its own groups) and exit while others are still in theirs: it says
    # goodbye first, so its exit aborts nobody's gather (docs/fail_stop.md, the end of training).
    return {
        "losses": killer.losses,
        "final": _whole(runtime),
        "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "before": watch.before,
        "restored": watch.restored,
        "kept": watch.kept,
        "steppers": watch.steppers,
        "requested": watch.requested,
        "recovery": strategy.last_recovery,
        "plan": strategy.current_plan.to_dict(),
        "groups": runtime.config.tensor.groups.members,
    }


def _assert_close(got: dict, want: dict, what: str, atol: float) -> None:
    assert sorted(got) == sorted(want) and want, (what, sorted(got), sorted(want))
    for key, value in want.items():
        if isinstance(value, dict):
            _assert_close(got[key], value, f"{what} {key}", atol)
        elif torch.is_tensor(value):
            assert got[key].dtype == value.dtype, (what, key)
            assert torch.allclose(got[key].float(), value.float(), atol=atol, rtol=0), (what, key, (got[key] - value).abs().max())
        else:
            assert abs(float(got[key]) - float(value)) <= atol, (what, key, got[key], value)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_zero1_under_tensor_parallelism_recovers_a_lost_member_exactly_like_the_unsharded_engine():
    from resihp_lightning.testing.harness import run_job

    runs = {}
    for name, config in (("zero", ZERO1), ("plain", {})):
        outcome = run_job(_job, 4, timeout=110, wait_for=[0, 2, 3], config=config)
        runs[name] = outcome.values()
        assert sorted(runs[name]) == [0, 2, 3], outcome.describe()
    zero, plain = runs["zero"], runs["plain"]
    ref_losses, _ = unsplit_reference(STEPS, autocast=torch.bfloat16)
    for rank in (0, 2, 3):
        got, want = zero[rank], plain[rank]
        record = got["recovery"]
        assert record.step == AT_STEP and VICTIM in record.failed, record
        assert got["groups"] == want["groups"] == ((0,), (2, 3)), rank
        # The comparison needs the same plans: the survivors' plan is the planner's in either run.
        assert got["plan"]["replicas"] == want["plan"]["replicas"], (got["plan"], want["plan"])
        assert got["requested"] == want["requested"] == len(SCHEDULE), rank
        assert got["steppers"] == {"ShardedStep"} and "ShardedStep" not in want["steppers"], (got["steppers"], want["steppers"])
        # Four groups of one (D = 4): each process kept 2 of the 4 slices of every layer.
        assert got["kept"] is not None and got["kept"][0] == got["kept"][1] / 2, got["kept"]
        # The recovery copied the state of step 3's end, bit for bit, before redoing step 4.
        for run in (got, want):
            assert sorted(run["restored"]["weights"]) == sorted(run["before"]["weights"]), rank
            for key, value in run["before"]["weights"].items():
                assert torch.equal(run["restored"]["weights"][key], value), (rank, key)
            assert run["restored"]["moments"] and sorted(run["restored"]["moments"]) == sorted(run["before"]["moments"]), rank
            for key, entry in run["before"]["moments"].items():
                for state_name, value in entry.items():
                    assert torch.equal(torch.as_tensor(run["restored"]["moments"][key][state_name]), torch.as_tensor(value)), (rank, key)
        # ZeRO-1 on and off: the same losses, fp32 weights and whole moments.
        assert len(got["losses"]) == STEPS and all(abs(a - b) <= 1e-6 for a, b in zip(got["losses"], want["losses"])), (
            got["losses"], want["losses"])
        _assert_close(got["final"], want["final"], f"rank {rank}", 1e-6)
        _assert_close(got["state"], want["state"], f"rank {rank} module", 1e-6)
        assert got["losses"] == pytest.approx(ref_losses, abs=BF16_LOSS_TOLERANCE, rel=0), (got["losses"], ref_losses)
