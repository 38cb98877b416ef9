"""Reconfiguration cost vs model size: time and bytes moved per re-plan (not a test).

Runs ``Trainer(strategy=ResiHPStrategy(...))`` on 4 gloo processes (this machine's CPU) for each
model size, a stack of 8 ``Linear + tanh`` layers given as DeepSpeed ``LayerSpec``s (built only on
the ranks that hold them), trained with Adam, and applies five re-plans at step boundaries:

1. ``swap replicas``: the two 2-stage replicas trade devices; every rank keeps its layers
   (0 bytes: the cost of tearing down and rebuilding the engine alone);
2. ``move 1 layer``: bounds (0,4,8) -> (0,3,8): the two second-stage ranks fetch layer 3;
3. ``swap stages``: each replica's two ranks trade stages: every rank fetches a whole stage;
4. ``2x2 -> 4x1``: one 4-stage pipeline;
5. ``4x1 -> per-replica 2x2``: two 2-stage replicas with different bounds, (0,3,8) and (0,5,8).

For each it prints the strategy's ``last_migration`` (rank 0's wall time from request to ready
engine, split into the point-to-point exchange and the rest) with the bytes moved, checked against
the bytes the layers new to each rank hold (weights + Adam's two moments + its step counters).

    python benchmarks/reconfigure.py [--sizes tiny,1M,10M,100M] [--optimizer plain|zero1|bf16]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from _spawn import rank_environment, run_ranks  # benchmarks/_spawn.py, next to this script

LAYERS = 8
WORLD = 4
SIZES = {"tiny": 64, "1M": 352, "10M": 1120, "100M": 3536}
TRANSITIONS = [
    ("swap replicas", [([2, 3], (0, 4, 8), 2), ([0, 1], (0, 4, 8), 2)]),
    ("move 1 layer", [([2, 3], (0, 3, 8), 2), ([0, 1], (0, 3, 8), 2)]),
    ("swap stages", [([3, 2], (0, 3, 8), 2), ([1, 0], (0, 3, 8), 2)]),
    ("2x2 -> 4x1", [([0, 1, 2, 3], (0, 2, 4, 6, 8), 4)]),
    ("4x1 -> per-replica 2x2", [([0, 1], (0, 3, 8), 2), ([2, 3], (0, 5, 8), 2)]),
]
INITIAL = [([0, 1], (0, 4, 8), 2), ([2, 3], (0, 4, 8), 2)]


def transitions(optimizer: str) -> list:
    """The re-plans run with ``optimizer`` (per-replica bounds need the plain fp32 optimizer)."""
    return TRANSITIONS if optimizer == "plain" else [t for t in TRANSITIONS if "per-replica" not in t[0]]


def _plan(replicas):
    from resihp_lightning.plan import Plan, Replica

    return Plan(tuple(Replica(tuple(d), tuple(b), m) for d, b, m in replicas))


#: DeepSpeed config of each ``--optimizer`` choice, and the bytes a moved parameter element costs:
#: the weight (4 B in fp32, 2 B in bf16), Adam's two fp32 moments, and under a wrapper its fp32 master.
OPTIMIZERS = {
    "plain": ({}, 4 + 8),
    "zero1": ({"zero_optimization": {"stage": 1, "layerwise": False}}, 4 + 4 + 8),  # DeepSpeed's ZeRO-1 wrapper
    "bf16": ({"bf16": {"enabled": True}}, 2 + 4 + 8),
}


def _expected_bytes(old, new, hidden: int, per_element: int) -> int:
    held = lambda plan: {  # noqa: E731
        d: set(range(r.bounds[j], r.bounds[j + 1])) for r in plan.replicas for j, d in enumerate(r.devices)
    }
    before, after = held(old), held(new)
    per_layer = (hidden * hidden + hidden) * per_element + 2 * 4  # weight and bias; their 2 Adam steps
    return sum(len(after[d] - before[d]) for d in after) * per_layer


def _rank(rank: int, port: int, hidden: int, optimizer: str, queue) -> None:
    rank_environment(rank, port, WORLD)
    import lightning.pytorch as pl
    import torch
    from deepspeed.pipe import LayerSpec
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import resihp_lightning  # noqa: F401 - registers the strategy
    from resihp_lightning.strategy.module import ResiHPModule
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    torch.set_num_threads(1)

    class Model(ResiHPModule):
        def pipeline_layers(self):
            return [LayerSpec(Block, hidden) for _ in range(LAYERS)]

        def pipeline_loss(self, outputs, labels):
            return F.mse_loss(outputs, labels)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    schedule = {step + 1: _plan(replicas) for step, (_, replicas) in enumerate(transitions(optimizer))}
    records = []

    class Replanner(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            migration = trainer.strategy.last_migration
            if migration is not None and (not records or records[-1].plan is not migration.plan):
                records.append(migration)
            if trainer.global_step in schedule:
                trainer.strategy.request_plan(schedule[trainer.global_step])

    data = TensorDataset(torch.randn(4, hidden), torch.randn(4, hidden))
    trainer = pl.Trainer(
        strategy=ResiHPStrategy(plan=_plan(INITIAL), micro_batch_size=1, deepspeed_config=OPTIMIZERS[optimizer][0]),
        accelerator="cpu", devices=WORLD,
        num_nodes=1, max_steps=len(transitions(optimizer)) + 1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[Replanner()],
        use_distributed_sampler=False,
    )
    trainer.fit(Model(), DataLoader(data, batch_size=4))
    if rank == 0:
        queue.put([{k: v for k, v in dataclasses.asdict(r).items() if k != "plan"} for r in records])


class Block:  # replaced below by the nn.Module (kept import-light for the parent process)
    pass


def _block_class():
    from torch import nn

    class _Block(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.linear = nn.Linear(hidden, hidden)

        def forward(self, x):
            return self.linear(x).tanh()

    return _Block


def run_size(hidden: int, optimizer: str = "plain", timeout: float = 600.0) -> list[dict]:
    (records,) = run_ranks(_rank, (hidden, optimizer), WORLD, 1, timeout)  # rank 0 reports
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,1M,10M,100M", help=f"comma-separated, from {list(SIZES)}")
    parser.add_argument("--optimizer", default="plain", choices=list(OPTIMIZERS),
                        help="plain fp32 Adam, or Adam under DeepSpeed's ZeRO-1 / bf16 wrapper")
    args = parser.parse_args(argv)
    per_element = OPTIMIZERS[args.optimizer][1]
    print(f"optimizer: {args.optimizer}\n")
    print("| model | params | re-plan | bytes moved | = layers new to ranks | total s | p2p s | rebuild s | of which state s | p2p GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.sizes.split(","):
        hidden = SIZES[name]
        params = LAYERS * (hidden * hidden + hidden)
        start = time.perf_counter()
        records = run_size(hidden, args.optimizer)
        old = _plan(INITIAL)
        for (label, replicas), rec in zip(transitions(args.optimizer), records):
            new = _plan(replicas)
            expected = _expected_bytes(old, new, hidden, per_element)
            rate = rec["bytes_moved"] / rec["transfer_seconds"] / 1e9 if rec["bytes_moved"] else 0.0
            print(
                f"| {name} | {params / 1e6:.2f} M | {label} | {rec['bytes_moved'] / 2**20:.1f} MiB | "
                f"{'yes' if rec['bytes_moved'] == expected else f'NO ({expected / 2**20:.1f} MiB)'} | "
                f"{rec['seconds']:.3f} | {rec['transfer_seconds']:.3f} | {rec['rebuild_seconds']:.3f} | "
                f"{rec['state_seconds']:.3f} | {rate:.2f} |"
            )
            old = new
        print(f"<!-- {name}: job {time.perf_counter() - start:.0f} s -->", file=sys.stderr)


if __name__ == "__main__" or __name__ == "__mp_main__":
    Block = _block_class()  # noqa: F811 - LayerSpec needs a real nn.Module class in every rank

if __name__ == "__main__":
    main()
