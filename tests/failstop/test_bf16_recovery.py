"""bf16 mixed precision recovers in-process: a rank SIGKILLed mid-step costs one step, not the job.

``Trainer(precision="bf16-mixed")`` runs on the layer-wise engine (bf16 autocast over fp32
parameters; :mod:`~resihp_lightning.runtime.mixed_precision`): the fp32 master weights are the
parameters and the Adam state is per parameter, so the survivors copy what a lost rank held from a
live holder instead of recomputing it. Each test runs the job twice on real gloo processes
(``harness.run_job``): once with the kill, once without it but with the same plan sequence forced
through ``request_plan`` (the no-fault run leaves the victim idle from the step it died in, under the
plan the survivors chose). The survivors' losses and final fp32 weights must match the no-fault run
to 1e-6, and a one-process bf16-autocast reference within :data:`BF16_LOSS_TOLERANCE` and
:data:`BF16_WEIGHT_TOLERANCE`.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from resihp_lightning.testing.toy_jobs import DEPTH, M, MBS, build_class, make_data, reference_fit
from resihp_lightning.testing.toy_jobs import EPOCH_STEPS as STEPS

#: |bf16-mixed run - one-process bf16-autocast reference| allowed on the losses and on the fp32 weights.
#: Both round the same products to bf16 (8 significant bits: a relative step of 2**-8 = 0.0039), but
#: not the same gradients: the pipeline scales a replica's micro-batch losses by m_r * D / M (here 0.75
#: or 1.5, not a power of two, against the reference's 1 / M), so activation gradients round to other
#: bf16 values, and the replicas' fp32 sums run in another order. Adam (lr 0.05) turns such one-ulp
#: differences of small gradients into differences of a sizeable part of a step. Measured on this job:
#: losses within 1.7e-4, weights within 4.3e-3 (the fp32 run is 5e-4 / 5.5e-3 away from the bf16 reference).
BF16_LOSS_TOLERANCE = 2e-3
BF16_WEIGHT_TOLERANCE = 2e-2


def _plan(replicas: list[tuple[list[int], list[int], int]]) -> dict:
    return {"replicas": [{"devices": d, "bounds": b, "micro_batches": m} for d, b, m in replicas]}


#: Two replicas of two stages with different bounds (per-replica partitions).
PER_REPLICA = _plan([([0, 1], [0, 3, DEPTH], 2), ([2, 3], [0, 5, DEPTH], 2)])
#: Rank 3 idle (a spare): three one-stage replicas on ranks 0, 1, 2 (rank 1 runs 2 micro-batches, so that
#: it dies at its 2nd forward of the step).
LEAVE_OUT = _plan([([0], [0, DEPTH], 1), ([1], [0, DEPTH], 2), ([2], [0, DEPTH], 1)])


def _job(rank: int, world: int, run_dir: str, schedule: dict, victims: dict, steps: int, **strategy_kwargs) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    import lightning.pytorch as pl

    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.plan import Plan
    from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.testing.harness import last_words

    class Schedule(pl.Callback):
        """Requests ``schedule[step]`` after step ``step`` (on every rank); the victim of a step dies at the
        forward of its 2nd micro-batch (a spare, which runs no schedule, at the step's start)."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.spare_at: list[int] = []
            self.engines: set[str] = set()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            strategy = trainer.strategy
            if victims.get(strategy.device_id) != trainer.global_step:
                return
            seen = [0]

            def die(module=None, args=None):
                seen[0] += 1
                if module is None or seen[0] == 2:
                    last_words(run_dir, rank, died_at=time.monotonic())
                    os.kill(os.getpid(), signal.SIGKILL)

            layers = strategy.local_layers()
            if not layers:
                die()
            next(iter(layers.values())).register_forward_pre_hook(die)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            strategy = trainer.strategy
            self.losses.append(float(outputs["loss"]))
            engine = strategy._state.runtime.engine
            if engine is not None:
                self.engines.add(type(engine).__name__)
            if strategy.is_spare:
                self.spare_at.append(trainer.global_step - 1)
            plan = schedule.get(trainer.global_step - 1)
            if plan is not None:
                strategy.request_plan(Plan.from_dict(plan))

    recorder = Schedule()
    x, y = make_data()
    strategy = ResiHPStrategy(micro_batch_size=MBS, fail_stop=FailStopConfig(), **strategy_kwargs)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, precision="bf16-mixed", logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[recorder],
    )
    model = build_class()()
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=M * MBS))
    return {
        "losses": recorder.losses,
        "spare_at": recorder.spare_at,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "recovery": strategy.last_recovery,
        "plan": strategy.current_plan.to_dict(),
        "engines": recorder.engines,
    }


def _assert_same_run(faulted: dict, clean: dict, survivors: list[int]) -> None:
    """The survivors of ``faulted`` and the same ranks of ``clean`` (``outcome.values()``): losses and
    final fp32 weights to 1e-6."""
    for rank in survivors:
        got, want = faulted[rank], clean[rank]
        assert len(got["losses"]) == len(want["losses"]) == STEPS, (rank, got["losses"], want["losses"])
        for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
            assert abs(a - b) <= 1e-6, f"rank {rank} step {step}: {a} after the kill vs {b} without it"
        assert sorted(got["state"]) == sorted(want["state"])
        for key, value in want["state"].items():
            assert got["state"][key].dtype == torch.float32, (rank, key, got["state"][key].dtype)
            assert torch.allclose(got["state"][key], value, atol=1e-6, rtol=0), (rank, key)


def _assert_bf16_reference(result: dict) -> None:
    """Within the stated bf16 tolerances of one process under bf16 autocast, and measurably not the fp32 run."""
    bf16_losses, _, bf16_params = reference_fit(STEPS, None, torch.bfloat16)
    fp32_losses, _, _ = reference_fit(STEPS, None)
    loss_gap = max(abs(got - want) for got, want in zip(result["losses"], bf16_losses, strict=True))
    weight_gap = max(float((result["state"][key] - want).abs().max()) for key, want in bf16_params.items())
    print(f"bf16-autocast reference gap: losses {loss_gap:.2e}, weights {weight_gap:.2e}")  # shown with pytest -s
    assert loss_gap < BF16_LOSS_TOLERANCE, (loss_gap, result["losses"], bf16_losses)
    assert weight_gap < BF16_WEIGHT_TOLERANCE, weight_gap
    # The compute really was bf16: the fp32 run's losses are further away than fp32 rounding.
    assert max(abs(a - b) for a, b in zip(result["losses"], fp32_losses)) > 1e-5, (result["losses"], fp32_losses)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_bf16_mixed_sigkill_mid_step_matches_the_no_fault_run_exactly():
    from resihp_lightning.testing.harness import run_job

    faulted = run_job(_job, 4, timeout=180, wait_for=[0, 1, 3], schedule={}, victims={2: 2}, steps=STEPS,
                      pipeline_degree=2)
    values = faulted.values()
    assert sorted(values) == [0, 1, 3], faulted.describe()
    record = values[0]["recovery"]
    assert record is not None and record.step == 2 and 2 in record.failed, record
    assert values[0]["engines"] == {"LayerwisePipelineEngine"}, values[0]["engines"]  # not DeepSpeed's bf16 wrapper
    # The same plan sequence without the kill: the survivors' plan from step 2 on, rank 2 idle.
    clean = run_job(_job, 4, timeout=180, wait_for=[0, 1, 2, 3], schedule={1: record.plan.to_dict()}, victims={},
                    steps=STEPS, pipeline_degree=2)
    clean_values = clean.values()
    assert sorted(clean_values) == [0, 1, 2, 3], clean.describe()
    assert clean_values[2]["spare_at"] == list(range(2, STEPS)), clean_values[2]["spare_at"]
    _assert_same_run(values, clean_values, [0, 1, 3])
    for rank in (0, 1, 3):
        _assert_bf16_reference(values[rank])


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_bf16_mixed_per_replica_bounds_and_a_spare_taken_back_match_the_no_fault_run_exactly():
    """Per-replica bounds from the start; rank 3 a spare from step 2; rank 1 killed inside step 3: the
    survivors take the spare back (their plan), and everything equals the same plans without the kill."""
    from resihp_lightning.testing.harness import run_job

    faulted = run_job(_job, 4, timeout=180, wait_for=[0, 2, 3], schedule={1: LEAVE_OUT}, victims={1: 3}, steps=STEPS,
                      plan=PER_REPLICA)
    values = faulted.values()
    assert sorted(values) == [0, 2, 3], faulted.describe()
    record = values[0]["recovery"]
    assert record is not None and record.step == 3 and 1 in record.failed, record
    assert 3 in record.plan.device_ids, record.plan  # the spare holds layers again
    assert values[3]["spare_at"] == [2], values[3]["spare_at"]
    clean = run_job(_job, 4, timeout=180, wait_for=[0, 1, 2, 3], schedule={1: LEAVE_OUT, 2: record.plan.to_dict()},
                    victims={}, steps=STEPS, plan=PER_REPLICA)
    assert sorted(clean.values()) == [0, 1, 2, 3], clean.describe()
    _assert_same_run(values, clean.values(), [0, 2, 3])
    _assert_bf16_reference(values[0])


# --------------------------------------------------------------------------- tensor parallelism
#: Loss tolerance of the tensor-parallel job against the unsplit one-process bf16 reference: split matrix
#: products round to bf16 in other pieces (measured: 9.6e-4 to 1.1e-3 over 4 steps; the fp32 run is 6.7e-3 away
#: at step 2). Its weights are not compared: Adam (lr 1e-2) moves near-zero-gradient elements by a whole
#: step on a one-ulp bf16 difference (measured 0.03 against the reference, the same as the fp32 run's gap).
TP_BF16_LOSS_TOLERANCE = 3e-3
TP_STEPS, TP_VICTIM, TP_AT_STEP = 4, 1, 2


def _tensor_job(rank: int, world: int, run_dir: str) -> dict:
    import warnings

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.testing.tensor_jobs import kill_inside_step, packed_batches, tensor_parallel_llama

    warnings.filterwarnings("ignore")

    module = tensor_parallel_llama()
    recorder = kill_inside_step(rank, TP_VICTIM, TP_AT_STEP, run_dir)
    strategy = ResiHPStrategy(tensor_degree=2, pipeline_degree=1, micro_batch_size=1, micro_batches=4,
                              gather_weights="all", fail_stop=FailStopConfig())
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=TP_STEPS, precision="bf16-mixed",
                         logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         use_distributed_sampler=False, callbacks=[recorder], default_root_dir=run_dir)
    trainer.fit(module, DataLoader(packed_batches(TP_STEPS), batch_size=None))
    return {
        "losses": recorder.losses,
        "dtypes": {v.dtype for v in module.state_dict().values()},
        "recovery": strategy.last_recovery,
        "groups": strategy._state.require().config.tensor.groups.members,
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_bf16_mixed_under_tensor_parallelism_a_lost_member_s_group_goes_on_at_a_smaller_degree():
    """2 groups of 2 under bf16-mixed; member 1 killed mid-step: group 0 goes on as rank 0 alone, its lost
    shards (fp32 masters and Adam state) cut from group 1's copy. No exact no-fault twin exists (a plan
    cannot leave a process idle under tensor parallelism), so the check is the bf16 reference."""
    from resihp_lightning.testing.harness import run_job
    from resihp_lightning.testing.tensor_jobs import unsplit_reference

    outcome = run_job(_tensor_job, 4, timeout=180, wait_for=[0, 2, 3])
    values = outcome.values()
    assert sorted(values) == [0, 2, 3], outcome.describe()
    bf16_losses, _ = unsplit_reference(TP_STEPS, autocast=torch.bfloat16)
    fp32_losses, _ = unsplit_reference(TP_STEPS)
    for rank, got in values.items():
        assert got["groups"] == ((0,), (2, 3)), rank
        record = got["recovery"]
        assert record.step == TP_AT_STEP and TP_VICTIM in record.failed and record.bytes_moved > 0, record
        assert got["dtypes"] == {torch.float32}, got["dtypes"]
        gap = max(abs(a - b) for a, b in zip(got["losses"], bf16_losses, strict=True))
        print(f"rank {rank}: tensor-parallel bf16 loss gap {gap:.2e}")  # shown with pytest -s
        assert gap < TP_BF16_LOSS_TOLERANCE, (rank, got["losses"], bf16_losses)
        assert max(abs(a - b) for a, b in zip(got["losses"], fp32_losses)) > gap, "closer to fp32 than to bf16"
