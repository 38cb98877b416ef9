"""After a regroup, DeepSpeed works on the new world: its comm layer and a fresh pipeline engine.

4 gloo processes train a DeepSpeed ``PipelineModule`` (2 stages x 2 replicas, so the engine creates
its own groups with ``new_group`` and talks p2p between stages). Rank 1 is SIGKILLed between two
batches (so that survivors 2 and 3 change rank: 2 -> 1, 3 -> 2); the survivors are released (the
engine's groups were tracked, so their connections are cut too), regroup into 3, and -- after
:func:`reset_deepspeed` (done by the regroup) and ``deepspeed.init_distributed`` --
``deepspeed.comm`` reduces exactly over the new world and a new 3-stage pipeline engine trains a
batch. (Without the reset this simple case works too: ``deepspeed.comm`` wraps whatever default
group exists and a new engine overwrites the p2p grid; the reset is for DeepSpeed's cached groups,
e.g. ZeRO's and MoE's, which would point at destroyed groups.)
"""

from __future__ import annotations

import importlib
import os
import signal
import time

import pytest

from resihp_lightning.testing.harness import last_words, run_job

pytestmark = pytest.mark.multiprocess


def _init_deepspeed() -> None:
    # DeepSpeed's torch backend JIT-compiles a shared-memory op (~30 s of g++) only inference uses.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def _engine(stages: int, replicas: int):
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(6)]
    pipe = PipelineModule(layers=layers, num_stages=stages, loss_fn=torch.nn.functional.mse_loss,
                          partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "train_batch_size": 4 * replicas, "steps_per_print": 2**62}
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=optimizer, config=config)
    return engine


def _batches():
    import torch

    generator = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(2, 8, generator=generator), torch.randn(2, 8, generator=generator)


def _deepspeed_job(rank, world_size, run_dir):
    import logging

    import torch

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    from resihp_lightning.resilience import ElasticWorld, PeerFailure, StoreConfig, WorldConfig

    world = ElasticWorld(WorldConfig(store=StoreConfig(run_dir=run_dir), join_timeout_s=10, regroup_timeout_s=30,
                                     collective_timeout_s=60)).start()
    default_group_only = len(world.current.sockets.inodes)
    _init_deepspeed()
    engine = _engine(stages=2, replicas=2)
    data = _batches()
    before = float(engine.train_batch(data))
    tracked = len(world.current.sockets.inodes) - default_group_only
    if rank == 1:
        last_words(run_dir, rank, at=time.monotonic())
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        with world.guard():
            for _ in range(50):  # the victim is gone: this cannot complete
                engine.train_batch(data)
        raise AssertionError("training went on without rank 1")
    except PeerFailure:
        released = time.monotonic()
    world.regroup()
    regrouped = time.monotonic()

    import deepspeed.comm as ds_comm
    from deepspeed.runtime.pipe import p2p

    stale = (p2p._grid, p2p._groups)
    _init_deepspeed()
    value = torch.tensor([float(rank + 1)])  # original rank + 1
    ds_comm.all_reduce(value)
    engine = _engine(stages=3, replicas=1)
    after = float(engine.train_batch(data))
    return {"before": before, "after": after, "released": released, "regrouped": regrouped, "tracked": tracked,
            "stale": stale, "ds_world": ds_comm.get_world_size(), "ds_rank": ds_comm.get_rank(),
            "sum": value.item(), "members": list(world.members), "grid": p2p._grid.pipe_parallel_size}


def test_deepspeed_comm_and_a_new_pipeline_engine_work_after_a_regroup():
    outcome = run_job(_deepspeed_job, 4, timeout=90, wait_for=[0, 2, 3])
    values = outcome.values()
    assert sorted(values) == [0, 2, 3], outcome.describe()
    died = outcome.ranks[1].last_words["at"]
    for original, value in values.items():
        assert value["members"] == [0, 2, 3]
        assert value["tracked"] > 0  # the engine's own groups' connections were tracked too
        assert value["stale"] == (None, None)  # the regroup forgot the old engine's p2p grid
        assert (value["ds_world"], value["ds_rank"], value["sum"]) == (3, [0, 2, 3].index(original), 1.0 + 3.0 + 4.0)
        assert value["grid"] == 3
        assert value["released"] - died < 2.0 and value["regrouped"] - died < 5.0
        assert value["before"] == value["before"] and value["after"] == value["after"]  # finite, not NaN
