"""The controller drops a slow member from its TP group and takes it back: a real run (not a test).

One 4-process job (gloo, this machine's CPU) of the demo's Llama with 4 key-value heads (the shape of
``tensor_resplit.py``, rows of 1024 tokens, 4 micro-batches of 1 row), ``ResiHPStrategy(tensor_degree=4,
pipeline_degree=1)``, with ``StragglerDetector`` and ``ReplanController`` as a user would add them.
Rank 2 computes ``--factor`` times slower (``FaultInjector`` ``slow``) from ``--fault`` to ``--heal``.
The controller's costs are pinned as in ``tests/tensor/test_tensor_regroup.py`` (``tensor_comm_fraction=0``,
``allreduce_ms=0.01``, data parallelism only): on 2 oversubscribed cores the measured all-reduce share
makes smaller groups look best even when healthy, which is this CPU's contention, not TP's cost on GPUs.

Printed: the groups in force at every step, the controller's re-splits (step, seconds, bytes) and the
median step time (rank 0's ``last_step_stats.step_ms``) per phase: healthy TP-4, slowed before the
drop, slowed after it, healed before the take-back, and after it. The ratios come from one run.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/tensor_drop.py [--steps 40] [--fault 8] [--heal 24]
        [--factor 3]

About 3-5 min on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import traceback

from _spawn import rank_environment, run_ranks  # benchmarks/_spawn.py, next to this script
from tensor_resplit import MICRO_BATCHES, SHAPE, WORLD, _batches

SLOW_RANK = 2


def _rank(rank: int, port: int, steps: int, fault: int, heal: int, factor: float, queue) -> None:
    rank_environment(rank, port, WORLD)
    import warnings

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    import resihp_lightning  # noqa: F401 - registers the strategy
    from resihp_lightning.callbacks import FaultInjector, ReplanController, StragglerDetector
    from resihp_lightning.callbacks.replan.replan_policy import ControllerConfig
    from resihp_lightning.config import PlannerConfig, ScratchModelConfig
    from resihp_lightning.models import CausalLMPipelineModule
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    records: dict = {"rank": rank, "steps": [], "migrations": [], "error": None}

    class Recorder(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            strategy = trainer.strategy
            groups = strategy._membership.tensor_groups
            stats = strategy.last_step_stats
            records["steps"].append({"step": trainer.global_step, "step_ms": stats.step_ms if stats else None,
                                     "groups": [list(g) for g in groups.members] if groups else [[0, 1, 2, 3]]})
            migration = strategy.last_migration
            if migration is not None and (not records["migrations"] or records["migrations"][-1]["id"] != id(migration)):
                records["migrations"].append({"id": id(migration), "step": trainer.global_step,
                                              "seconds": migration.seconds, "bytes_moved": migration.bytes_moved})

    callbacks = [
        FaultInjector([{"kind": "slow", "rank": SLOW_RANK, "factor": factor, "start_step": fault, "end_step": heal}]),
        StragglerDetector(warmup_steps=2, fit_steps=4, window=3, patience=3, member_patience=3),
        ReplanController(ControllerConfig(min_relative_gain=0.0, payback_factor=0.0, cooldown_steps=2,
                                          migration_overhead_s=0.01, allreduce_ms=0.01, p2p_ms=0.0, memory_mb=None,
                                          tensor_comm_fraction=0.0, plan_wait_s=5.0),
                         planner=PlannerConfig(solver="exact", pipeline_degrees=(1,))),
        Recorder(),
    ]
    module = CausalLMPipelineModule(scratch=ScratchModelConfig(**SHAPE), seed=0, learning_rate=1e-3)
    strategy = ResiHPStrategy(tensor_degree=WORLD, pipeline_degree=1, micro_batch_size=1, micro_batches=MICRO_BATCHES)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         use_distributed_sampler=False, callbacks=callbacks,
                         default_root_dir=f"/tmp/resihp-tensor-drop-{os.getppid()}")
    try:
        trainer.fit(module, DataLoader(_batches(steps, seed=2026), batch_size=None))
    except Exception as err:  # noqa: BLE001 - the benchmark reports what the library does
        records["error"] = f"{type(err).__name__}: {err}"
        records["traceback"] = traceback.format_exc()
    queue.put(records)


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.0f}" if values else "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fault", type=int, default=8)
    parser.add_argument("--heal", type=int, default=24)
    parser.add_argument("--factor", type=float, default=3.0)
    args = parser.parse_args(argv)
    ranks = sorted(run_ranks(_rank, (args.steps, args.fault, args.heal, args.factor), WORLD, WORLD, 1800.0),
                   key=lambda r: r["rank"])
    for got in ranks:
        if got["error"]:
            raise SystemExit(f"rank {got['rank']} failed: {got['error']}\n{got.get('traceback', '')}")
    steps = ranks[0]["steps"]
    whole = [[0, 1, 2, 3]]
    changes = [s["step"] for prev, s in zip(steps, steps[1:]) if s["groups"] != prev["groups"]]
    drop = next((c for c in changes if args.fault <= c), None)
    back = next((c for c in changes if drop is not None and c > drop and steps[c - 1]["groups"] == whole), None)
    print("| step | groups |\n|---|---|")
    last = None
    for s in steps:
        if s["groups"] != last:
            print(f"| {s['step']} | {s['groups']} |")
            last = s["groups"]
    migrations = {m["step"]: m for m in ranks[0]["migrations"]}
    moved = {m["step"]: sum(r["migrations"][i]["bytes_moved"] for r in ranks)
             for i, m in enumerate(ranks[0]["migrations"])}
    for step, m in migrations.items():
        print(f"re-split applied by step {step}: {m['seconds']:.2f} s on rank 0, {moved[step] / 2**20:.1f} MiB moved")

    def phase(lo: int, hi: int | None) -> list[float]:
        hi = args.steps if hi is None else hi
        return [s["step_ms"] for s in steps if lo <= s["step"] < hi and s["step_ms"] and s["step"] not in changes
                and s["step"] - 1 not in changes]

    healthy = phase(3, args.fault)
    rows = [("healthy, TP-4", healthy), ("slowed, before the drop", phase(args.fault + 1, drop)),
            ("slowed, after the drop", phase((drop or args.heal) + 1, args.heal)),
            ("healed, before the take-back", phase(args.heal + 1, back)),
            ("after the take-back", phase((back or args.steps) + 1, None))]
    base = statistics.median(healthy)
    print("\n| phase | steps measured | step ms (median) | of healthy speed |\n|---|---|---|---|")
    for label, values in rows:
        share = f"{base / statistics.median(values):.2f}" if values else "-"
        print(f"| {label} | {len(values)} | {_median(values)} | {share} |")


if __name__ == "__main__":
    main()
