"""Hot-spare benchmark: what leaving a rank idle, taking it back, and recovering onto a spare cost.

Four gloo processes (``resihp_lightning/testing/harness.py``) train a stack of 8 ``Linear(1024) + tanh`` layers with
Adam (M = 8 micro-batches of 64 rows) under ``ResiHPStrategy(fail_stop=True)``, starting 2 x 2:

* **leave out** (after step 4): 1 x 3 on ranks 0-2, rank 3 idle. The members' migration record
  gives the reshape's time (engine stopped, group re-formed twice: grown for the move, shrunk to the
  plan) and the bytes moved;
* **take back** (after step 8): 2 x 2 again, the spare receives its layers and Adam state;
* **kill onto a spare** (second run): rank 3 idle from step 5, rank 1 SIGKILLed inside step 8; the
  survivors' recovery breakdown (regroup with the spare, plan, restore, redo).

Run: ``python benchmarks/spares.py [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resihp_lightning.testing.harness import last_words, run_job  # noqa: E402

WIDTH, DEPTH, MBS, M, STEPS = 1024, 8, 64, 8, 14


def _plan(replicas):
    return {"replicas": [{"devices": d, "bounds": b, "micro_batches": m} for d, b, m in replicas]}


LEAVE_OUT = _plan([([0], [0, DEPTH], 3), ([1], [0, DEPTH], 3), ([2], [0, DEPTH], 2)])
TAKE_BACK = _plan([([0, 1], [0, 4, DEPTH], 4), ([2, 3], [0, 4, DEPTH], 4)])


def _job(rank: int, world: int, run_dir: str, schedule: dict, victims: dict) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.plan import Plan
    from resihp_lightning.testing.toy_jobs import build_stack
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    torch.set_num_threads(1)

    Stack = build_stack(WIDTH, DEPTH, optimizer=lambda params: torch.optim.Adam(params, lr=1e-4))

    rows: list[dict] = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            strategy = trainer.strategy
            if victims.get(strategy.device_id) != trainer.global_step:
                return
            layer = next(iter(strategy.local_layers().values()))

            def die(module, args):
                last_words(run_dir, rank, died_at=time.monotonic())
                os.kill(os.getpid(), signal.SIGKILL)

            layer.register_forward_pre_hook(die)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            strategy = trainer.strategy
            stats = strategy.last_step_stats
            migration = strategy.last_migration
            rows.append({"step": trainer.global_step - 1, "spare": strategy.is_spare, "spares": list(strategy._membership.job.spares),
                         "ms": stats.step_ms if stats is not None else None,
                         "migration": None if migration is None else (migration.seconds, migration.bytes_moved)})
            plan = schedule.get(trainer.global_step - 1)
            if plan is not None:
                strategy.request_plan(Plan.from_dict(plan))

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M * MBS * STEPS, WIDTH, generator=gen)
    strategy = ResiHPStrategy(micro_batch_size=MBS, pipeline_degree=2, fail_stop=True)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0, callbacks=[Probe()])
    trainer.fit(Stack(), DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=M * MBS))
    return {"rows": rows, "recovery": strategy.last_recovery}


def _reshapes(rows: list[dict]) -> list[tuple[int, float, int]]:
    seen, out = None, []
    for row in rows:
        if row["migration"] is not None and row["migration"] != seen:
            seen = row["migration"]
            out.append((row["step"], *row["migration"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    leave, back, recoveries = [], [], []
    for _ in range(args.repeats):
        outcome = run_job(_job, 4, timeout=600, wait_for=[0, 1, 2, 3], schedule={4: LEAVE_OUT, 8: TAKE_BACK}, victims={})
        rows = outcome.values()[0]["rows"]
        moves = _reshapes(rows)
        leave.append(moves[0][1:])
        back.append(moves[1][1:])
        kill = run_job(_job, 4, timeout=600, wait_for=[0, 2, 3], schedule={4: LEAVE_OUT}, victims={1: 8})
        recoveries.append(kill.values()[0]["recovery"])
    mib = 2**20
    print(f"leave out (2x2 -> 1x3 + spare): {statistics.median(s for s, _ in leave):.3f} s, "
          f"{statistics.median(b for _, b in leave) / mib:.1f} MiB")
    print(f"take back (1x3 + spare -> 2x2): {statistics.median(s for s, _ in back):.3f} s, "
          f"{statistics.median(b for _, b in back) / mib:.1f} MiB")
    fields = ("regroup_s", "plan_s", "restore_s", "redo_s")
    print("kill rank 1 with rank 3 idle: " + ", ".join(
        f"{f} {statistics.median(getattr(r, f) for r in recoveries):.3f}" for f in fields)
        + f", {statistics.median(r.bytes_moved for r in recoveries) / mib:.1f} MiB; plans "
        + str(sorted({str(r.plan.layout_key()) for r in recoveries})))


if __name__ == "__main__":
    main()
