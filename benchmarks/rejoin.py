"""Replacement benchmark: what a process that joins the running job costs, from its registration to its first step.

Four gloo processes (``resihp_lightning/testing/harness.py``) train a stack of 8 ``Linear(1024) + tanh`` layers with
Adam (M = 8 micro-batches of 64 rows) under ``ResiHPStrategy(fail_stop=True)``, starting 2 x 2. Rank 1 is
SIGKILLed inside step 3 (the survivors recover on 3 processes); then a fifth process starts the same script with
``RESIHP_JOIN=1`` and rank 1's ``LOCAL_RANK``. The members wait at the start of step 4 until it has registered (so
that every run admits it at the same step: step 4's commit counts it, step 5 admits it, step 6 takes it in).

Printed, median over the runs (the newcomer's clock and the members' rank 0's records, one machine's clock):

* **registration -> admitted**: the newcomer waits for the members' next commit and admission;
* **admitted -> end of its first computed step**: it mirrors the admission step as a spare, then the next
  step's reshape takes it in (its layers and Adam state arrive) and it computes;
* the members' steps: a typical one, the admission step (records written, the plan for every live process
  computed: a layer-profile collective and a solve), and the take-in step (the reshape: engine stopped,
  group re-formed with the newcomer, layers moved, engine rebuilt), with the MiB moved to it.

Run: ``python benchmarks/rejoin.py [--repeats 3]``.
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

WIDTH, DEPTH, MBS, M, STEPS = 1024, 8, 64, 8, 10
WORLD, VICTIM, KILL_STEP = 4, 1, 3
GATE_STEP = KILL_STEP + 1  # the newcomer starts at its start; its commit counts it
ADMIT_STEP, TAKE_IN_STEP = GATE_STEP + 1, GATE_STEP + 2


def _job(rank: int, world: int, run_dir: str) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.testing.toy_jobs import build_stack

    torch.set_num_threads(1)
    Stack = build_stack(WIDTH, DEPTH, optimizer=lambda params: torch.optim.Adam(params, lr=1e-4))
    start_file = Path(run_dir) / "start-newcomer"
    if rank >= world:  # the replacement, started once the survivors recovered
        deadline = time.monotonic() + 300
        while not start_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    rows: list[dict] = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            strategy = trainer.strategy
            if strategy.device_id == VICTIM and trainer.global_step == KILL_STEP:
                def die(module, args):
                    last_words(run_dir, rank, died_at=time.monotonic())
                    os.kill(os.getpid(), signal.SIGKILL)

                next(iter(strategy.local_layers().values())).register_forward_pre_hook(die)
            if trainer.global_step == GATE_STEP and strategy.device_id < world:
                deadline = time.monotonic() + 300
                while strategy.newcomers_waiting() < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
            self.started = time.monotonic()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            strategy = trainer.strategy
            migration = strategy.last_migration
            rows.append({"step": trainer.global_step - 1, "spare": strategy.is_spare, "at": time.monotonic(),
                         "s": time.monotonic() - self.started,
                         "migration": None if migration is None else (migration.seconds, migration.bytes_moved)})
            if strategy.device_id == 0 and trainer.global_step == KILL_STEP + 1:
                start_file.touch()

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M * MBS * STEPS, WIDTH, generator=gen)
    strategy = ResiHPStrategy(micro_batch_size=MBS, pipeline_degree=2, fail_stop=True)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0, callbacks=[Probe()])
    trainer.fit(Stack(), DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=M * MBS))
    return {"rows": rows, "clock": dict(strategy._membership.job.admission_clock), "plan": str(strategy.current_plan.layout_key())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    waits, firsts, typical, admit, take_in, moved, plans = [], [], [], [], [], [], set()
    for _ in range(args.repeats):
        outcome = run_job(_job, WORLD, timeout=900, wait_for=[0, 2, 3, WORLD],
                          joiners=[{"RESIHP_JOIN": "1", "LOCAL_RANK": str(VICTIM)}])
        values = outcome.values()
        if WORLD not in values or 0 not in values:
            raise SystemExit(outcome.describe())
        newcomer, member = values[WORLD], values[0]
        first = next(r for r in newcomer["rows"] if not r["spare"])
        assert newcomer["rows"][0]["step"] == ADMIT_STEP and first["step"] == TAKE_IN_STEP, newcomer["rows"]
        clock = newcomer["clock"]
        waits.append(clock["admitted"] - clock["registered"])
        firsts.append(first["at"] - clock["admitted"])
        by_step = {r["step"]: r for r in member["rows"]}
        typical.append(statistics.median(by_step[s]["s"] for s in (1, 2, 8, 9) if s not in (KILL_STEP, ADMIT_STEP, TAKE_IN_STEP)))
        admit.append(by_step[ADMIT_STEP]["s"])
        take_in.append(by_step[TAKE_IN_STEP]["s"])
        moved.append(by_step[TAKE_IN_STEP]["migration"][1] / 2**20)
        plans.add(member["plan"])
    med = statistics.median
    print(f"newcomer: registration -> admitted {med(waits):.3f} s, admitted -> end of its first computed step "
          f"{med(firsts):.3f} s (runs: {[round(w + f, 3) for w, f in zip(waits, firsts)]})")
    print(f"members' rank 0: typical step {med(typical):.3f} s, admission step {med(admit):.3f} s, "
          f"take-in step {med(take_in):.3f} s ({med(moved):.1f} MiB moved); final plans {sorted(plans)}")


if __name__ == "__main__":
    main()
