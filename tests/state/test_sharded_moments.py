"""The layer-wise ZeRO-1's moments across the strategy's setups (:mod:`resihp_lightning.state.sharded_moments`).

The moments live in :class:`~resihp_lightning.state.zero_shards.ZeroShards` slices, not in the user's
optimizer; every setup of the strategy (``trainer.validate`` between two fits, the second fit) builds a new
runtime, which must take them over as the plain optimizer keeps its own ``state``. On 4 gloo processes
(P = 1 x D = 4, each process keeping 2 of every layer's 4 slices), with a module whose
``configure_optimizers`` returns the same optimizer every time: fit 2 steps, validate, fit 2 more equals one
fit of 4 steps bit for bit (losses, weights, moments), with ZeRO-1 and without.
"""

from __future__ import annotations

import itertools

import pytest
import torch

STEPS = 4
ZERO1 = {"zero_optimization": {"stage": 1}}


def _job(rank: int, world: int) -> dict:
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.testing.toy_jobs import M, MBS, build_class, make_data, make_recorder, make_trainer, make_val_loader

    warnings.filterwarnings("ignore")
    x, y = make_data()

    def loader(first: int, last: int) -> DataLoader:
        rows = slice(first * M * MBS, last * M * MBS)
        return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=M * MBS)

    class Kept(build_class()):
        """The same optimizer (and schedule) for every fit: its state carries over, as for a plain optimizer."""

        def configure_optimizers(self):
            if not hasattr(self, "_kept"):
                self._kept = super().configure_optimizers()
            return self._kept

    out: dict = {}
    for (label, config), (name, fits) in itertools.product(
        (("zero1", ZERO1), ("plain", {})), (("split", ((0, 2), (2, STEPS))), ("whole", ((0, STEPS),)))
    ):
        model, recorder = Kept(), make_recorder()
        strategy = ResiHPStrategy(pipeline_degree=1, micro_batch_size=MBS, deepspeed_config=config)
        trainer = make_trainer(strategy, world, fits[0][1], callbacks=[recorder], use_distributed_sampler=False)
        for i, (first, last) in enumerate(fits):
            if i:
                trainer.validate(model, make_val_loader(), verbose=False)
                trainer.fit_loop.epoch_loop.max_steps = last
            trainer.fit(model, loader(first, last))
        runtime = strategy._state.require()
        shards = getattr(runtime._carrier, "shards", None)
        out.setdefault(label, {})[name] = {
            "losses": recorder.losses,
            "weights": {k: v.detach().clone() for k, v in runtime.local_parameters().items()},
            "moments": {k: {n: v.clone() for n, v in e.items()} for k, e in runtime.optimizer_checkpoint_state().items()},
            "kept": None if shards is None else sorted({s for shard in shards.layers.values() for s in shard.pieces}),
        }
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_fit_validate_fit_equals_one_fit_of_all_the_steps(distributed):
    results = distributed(_job, 4, timeout=100)
    for (rank, result), label in itertools.product(enumerate(results), ("zero1", "plain")):
        split, whole = result[label]["split"], result[label]["whole"]
        if label == "zero1":
            assert split["kept"] == sorted({rank, (rank + 1) % 4}), split["kept"]  # sharded: 2 of the 4 slices
        assert len(split["losses"]) == STEPS and split["losses"] == whole["losses"], (split["losses"], whole["losses"])
        for key, value in whole["weights"].items():
            assert torch.equal(split["weights"][key], value), (label, rank, key)
        assert sorted(split["moments"]) == sorted(whole["moments"]) and whole["moments"], (label, rank)
        for key, entry in whole["moments"].items():
            for name, value in entry.items():
                assert torch.equal(split["moments"][key][name], value), (label, rank, key, name)
