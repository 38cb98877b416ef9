"""Fail-stop recovery under tensor parallelism: a group that loses a member goes on at a smaller degree.

A 2 x 2 job (two groups of two, each holding the whole model) loses member 1 of group 0 to a SIGKILL
inside a step. The survivors regroup; group 0 goes on as rank 0 alone (degree 1), its lost shards cut
from group 1's copy, next to group 1 at degree 2: groups of different degrees, which reduce their
gradients whole. The interrupted step is redone, and the survivors' losses and final weights match one
process training the unsplit model. With a single group of two (no other copy of the shards) the same
loss ends the job with the restart status, no hang.
"""

from __future__ import annotations

import pytest
import torch

from resihp_lightning.testing.tensor_jobs import (
    LOSS_ATOL,
    WEIGHT_ATOL,
    kill_inside_step,
    packed_batches,
    tensor_parallel_llama,
    unsplit_reference,
)

STEPS = 4
VICTIM, AT_STEP = 1, 2


def _job(rank: int, world: int, run_dir: str, data_degree: int) -> dict:
    import warnings

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    warnings.filterwarnings("ignore")

    module = tensor_parallel_llama()
    recorder = kill_inside_step(rank, VICTIM, AT_STEP, run_dir)
    strategy = ResiHPStrategy(tensor_degree=2, pipeline_degree=1, micro_batch_size=1, micro_batches=4,
                              gather_weights="all", fail_stop=FailStopConfig(min_data_degree=data_degree))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         use_distributed_sampler=False, callbacks=[recorder], default_root_dir=run_dir)
    trainer.fit(module, DataLoader(packed_batches(STEPS), batch_size=None))
    return {
        "losses": recorder.losses,
        "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "recovery": strategy.last_recovery,
        "plan": strategy.current_plan.to_dict(),
        "groups": strategy._state.require().config.tensor.groups.members,
        "device_id": strategy.device_id,
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_lost_member_s_group_goes_on_at_a_smaller_degree_exactly():
    from resihp_lightning.testing.harness import run_job

    outcome = run_job(_job, 4, timeout=180, wait_for=[0, 2, 3], data_degree=2)
    values = outcome.values()
    assert sorted(values) == [0, 2, 3], outcome.describe()
    ref_losses, ref_state = unsplit_reference(STEPS)
    for rank, got in values.items():
        # Group 0 is rank 0 alone now, group 1 keeps both members.
        assert got["groups"] == ((0,), (2, 3)), rank
        assert got["device_id"] == (0 if rank == 0 else 1)
        record = got["recovery"]
        assert record.step == AT_STEP and VICTIM in record.failed and record.bytes_moved > 0
        assert sorted(got["plan"]["replicas"][r]["devices"][0] for r in range(2)) == [0, 1]  # both groups hold all
        assert got["losses"] == pytest.approx(ref_losses, abs=LOSS_ATOL, rel=0), rank
        for key, want in ref_state.items():
            torch.testing.assert_close(got["state"][key], want, atol=WEIGHT_ATOL, rtol=0, msg=f"rank {rank} {key}")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_lost_member_of_the_only_group_ends_the_job_with_the_restart_status():
    from resihp_lightning.failstop.fail_stop_config import UNRECOVERABLE_EXIT_CODE
    from resihp_lightning.testing.harness import run_job

    outcome = run_job(_job, 2, timeout=100, wait_for=[0], data_degree=1)
    assert outcome.wall_s < 80, outcome.describe()
    assert {r.rank: r.exitcode for r in outcome.ranks} == {0: UNRECOVERABLE_EXIT_CODE, 1: -9}, outcome.describe()
