"""A small training job for torchrun, run by ``tests/callbacks/restart/test_elastic_restart.py`` (and usable by hand).

Every process of every restart runs this script: it builds a ``Trainer(strategy=ResiHPStrategy(...))``
for the world torchrun formed (``launcher_shape``), with periodic checkpoints every
``--every-n-steps`` steps, ``ElasticRestart``, a ``ResumableDataLoader`` over rows that carry their
own index, and resumes from the newest checkpoint in ``<run_dir>/checkpoints`` (or ``--ckpt``).
Rank 0 appends one line per step to ``<run_dir>/steps.jsonl`` (step, loss, the rows' indices,
world size, restart count, plan). Each process writes its timings (exec, imports done, first step
done) to ``<run_dir>/timing-<restart>-<rank>.json``, and its pid to ``<run_dir>/pids/<agent pid>``
so that a test can kill a machine: the agent and its worker.

    torchrun --nnodes 3:4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        --max-restarts 2 resihp_lightning/testing/elastic_job.py --run-dir RUN --max-steps 30
"""

from __future__ import annotations

import time

EXEC_AT = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from resihp_lightning.callbacks.restart.elastic_restart import ElasticRestart  # noqa: E402
from resihp_lightning.callbacks.restart.periodic_checkpoint import CheckpointConfig, newest_checkpoint, periodic_checkpoint  # noqa: E402
from resihp_lightning.data.resumable import ResumableDataLoader  # noqa: E402
from resihp_lightning.launcher_env import launcher_shape, restart_count  # noqa: E402
from resihp_lightning.strategy.checkpoint_io import make_checkpoint_io  # noqa: E402
from resihp_lightning.strategy.module import ResiHPModule  # noqa: E402
from resihp_lightning.strategy.strategy import ResiHPStrategy  # noqa: E402

IMPORTED_AT = time.time()
WIDTH, DEPTH, MBS, M, ROWS = 32, 6, 2, 12, 24 * 40


class Rows(torch.utils.data.Dataset):
    """Fixed random regression rows; each row carries its index so the log shows which rows trained."""

    def __init__(self, length: int = ROWS) -> None:
        gen = torch.Generator().manual_seed(3)
        self.x = torch.randn(length, WIDTH, generator=gen)
        self.y = torch.tanh(self.x @ torch.randn(WIDTH, WIDTH, generator=gen))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Stack(ResiHPModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH)])

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_batch(self, batch):
        x, y, _ = batch
        return x, y, None

    def pipeline_loss(self, outputs, labels):
        return F.mse_loss(outputs, labels)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class StepLog(pl.Callback):
    """Rank 0: one line per step; every rank: its timings once the first step is done."""

    def __init__(self, run_dir: Path, slow_s: float) -> None:
        self.run_dir, self.slow_s, self.first_done = run_dir, slow_s, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            plan = trainer.strategy.current_plan
            record = {"step": trainer.global_step - 1, "loss": float(outputs["loss"] if isinstance(outputs, dict) else outputs),
                      "rows": batch[2].tolist(), "world": trainer.world_size, "restart": restart_count(),
                      "plan": plan.layout_key() if hasattr(plan, "layout_key") else None,
                      "shape": [plan.pipeline_degree, plan.data_degree], "time": time.time()}
            with open(self.run_dir / "steps.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
        if not self.first_done:
            self.first_done = True
            timing = {"exec": EXEC_AT, "imported": IMPORTED_AT, "first_step_done": time.time(),
                      "world": trainer.world_size, "rank": trainer.global_rank}
            (self.run_dir / f"timing-{restart_count()}-{trainer.global_rank}.json").write_text(json.dumps(timing))
        if self.slow_s:
            time.sleep(self.slow_s)  # leaves a test time to kill a machine mid-run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--every-n-steps", type=int, default=5)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--sync", action="store_true", help="write checkpoints in the step (default: async)")
    parser.add_argument("--ckpt", default=None, help="resume from this checkpoint instead of the newest")
    parser.add_argument("--plan", default=None, help="an explicit plan (JSON file) instead of the planner's")
    parser.add_argument("--slow-s", type=float, default=0.0, help="sleep after each step")
    parser.add_argument("--pipeline-degree", type=int, default=2)
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    (run_dir / "pids").mkdir(parents=True, exist_ok=True)
    (run_dir / "pids" / str(os.getppid())).write_text(str(os.getpid()))
    torch.set_num_threads(1)

    config = CheckpointConfig(dirpath=str(run_dir / "checkpoints"), every_n_steps=args.every_n_steps, keep_last=args.keep_last,
                              asynchronous=not args.sync)
    ckpt = args.ckpt or (newest_checkpoint(config.dirpath) if config.resume else None)
    plan = json.loads(Path(args.plan).read_text()) if args.plan else None
    num_nodes, devices = launcher_shape(devices=1, num_nodes=1)
    strategy = ResiHPStrategy(pipeline_degree=args.pipeline_degree, plan=plan, micro_batch_size=MBS, micro_batches=M)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, max_steps=args.max_steps,
        plugins=[make_checkpoint_io(config.asynchronous)], logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(run_dir),
        callbacks=[periodic_checkpoint(config), ElasticRestart(log_dir=str(run_dir)), StepLog(run_dir, args.slow_s)],
    )
    loader = ResumableDataLoader(Rows(), batch_size=M * MBS, shuffle=True, drop_last=True)
    pl.seed_everything(0, verbose=False)
    trainer.ckpt_path = str(ckpt) if ckpt else None  # before fit: ElasticRestart reads it at setup
    trainer.fit(Stack(), loader)


if __name__ == "__main__":
    main()
