"""Step time while the controller's planner solves in the background, against none solving.

4 gloo processes train a small Linear + tanh stack under ``ResiHPStrategy`` (plain fp32, 2 x 2). In
the ``solving`` runs, rank 0 keeps the planner's worker process (``BackgroundPlanner``) busy with a
256-device CP-SAT problem (2 search workers, its default, a 20 s limit) for the whole measured window;
the ``idle`` runs start the same worker and leave it idle. Runs alternate; the table gives the median
step wall time of each kind and their ratio.

Run: ``python benchmarks/background_planning.py [--repeats 2] [--steps 40]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resihp_lightning.testing.harness import run_job  # noqa: E402


def _problem():
    from resihp_lightning.plan import Device, Layer, Problem

    devices = [Device(i, speed=0.5 if i in (3, 77) else 1.0, memory_mb=24_000.0) for i in range(256)]
    layers = [Layer(10.0, static_mb=700.0, activation_mb=50.0) for _ in range(96)]
    return Problem(layers=tuple(layers), devices=tuple(devices), micro_batches=1024)


def _job(rank: int, world: int, run_dir: str, solving: bool, steps: int) -> list[float]:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.callbacks.replan.background_planner import BackgroundPlanner
    from resihp_lightning.config import PlannerConfig
    from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.testing.toy_jobs import build_stack

    planner = BackgroundPlanner() if rank == 0 else None
    times: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            self.started = time.perf_counter()
            if planner is not None and solving and not planner.busy and trainer.global_step >= 3:
                planner.submit(_problem(), PlannerConfig(solver="cpsat", time_limit_s=20.0))

        def on_train_batch_end(self, trainer, *args):
            times.append(time.perf_counter() - self.started)

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8 * 8 * steps, 512, generator=gen), torch.randn(8 * 8 * steps, 512, generator=gen)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ResiHPStrategy(pipeline_degree=2, micro_batch_size=8),
                         max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[Clock()])
    trainer.fit(build_stack(512, 8)(), DataLoader(TensorDataset(x, y), batch_size=64))
    if planner is not None:
        planner.close()
    return times[5:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    medians: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for solving in (True, False):
            outcome = run_job(_job, 4, timeout=600, solving=solving, steps=args.steps)
            values = outcome.values()
            if len(values) != 4:
                raise SystemExit(outcome.describe())
            medians[solving].append(statistics.median(values[0]))
            print(f"{'solving' if solving else 'idle'}: median step {medians[solving][-1] * 1000:.1f} ms", flush=True)
    on, off = statistics.median(medians[True]), statistics.median(medians[False])
    print(f"\n| planner | median step | ratio |\n|---|---|---|\n| idle | {off * 1000:.1f} ms | 1.000 |\n"
          f"| solving (CP-SAT, 256 devices) | {on * 1000:.1f} ms | {on / off:.3f} |")


if __name__ == "__main__":
    main()
