"""Slow-link benchmark: what a link probe costs, how fast and how well a slow link is named, and what
planning around it wins.

Four gloo processes train 8 ``Linear(WIDTH) + tanh`` layers (the control tests' model, ``resihp_lightning.testing.toy_jobs.build_stack``; M = 8 micro-batches of 32 rows, SGD)
under a 2 x 2 plan with ``StragglerDetector(link_probe_interval_steps=2)`` and ``ReplanController``.
From step ``FAULT_STEP`` the injector delays every send and all-reduce of rank 2 by ``delay_ms``
(``FaultInjector`` ``slow_link``). Per delay it reports:

* the probe's own time on rank 0 (``strategy.measure_links()``, wall ms; healthy, and with the slow
  link: each of its round trips waits the delay) against the median healthy step;
* the step at which ``slow_link_detected`` named the rank (latency in steps after the fault) and the
  link speed it estimated, against the speed the delay implies for the probe (healthy round trip /
  (healthy round trip + delay));
* the median step time under the 2 x 2 plan with the fault, and under the plan the controller
  applied (the replica with the slow link gets fewer micro-batches), as a ratio (one run, adjacent
  phases).

Run: ``python benchmarks/links.py [--delays 5 20 50] [--steps 24]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIDTH, DEPTH, MBS, M = 256, 8, 32, 8
FAULT_STEP = 6


def _rank(rank: int, world: int, log_dir: str, delay_ms: float, steps: int) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.callbacks import FaultInjector, ReplanController, StragglerDetector
    from resihp_lightning.callbacks.replan.replan_policy import ControllerConfig
    from resihp_lightning.config import PlannerConfig
    from resihp_lightning.plan import Plan
    from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.testing.toy_jobs import build_stack

    torch.set_num_threads(1)
    Stack = build_stack(WIDTH, DEPTH)  # Linear + tanh layers, SGD: the control tests' model

    probe_ms: list[float] = []
    steps_seen: list[dict] = []

    class Recorder(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            stats = trainer.strategy.last_step_stats
            plan = trainer.strategy.current_plan
            steps_seen.append({"step": stats.step, "ms": stats.step_ms, "plan": plan.layout_key()})

    class TimedDetector(StragglerDetector):
        def probe_links(self, trainer) -> None:
            start = time.perf_counter()
            super().probe_links(trainer)
            probe_ms.append((trainer.global_step, (time.perf_counter() - start) * 1000.0))

    detector = TimedDetector(warmup_steps=1, fit_steps=3, link_probe_interval_steps=2, link_patience=2, link_window=1)
    callbacks = [
        FaultInjector([{"kind": "slow_link", "rank": 2, "delay_ms": delay_ms, "start_step": FAULT_STEP}]),
        detector,
        ReplanController(ControllerConfig(migration_overhead_s=0.1, cooldown_steps=0),
                         planner=PlannerConfig(solver="exact", pipeline_degrees=(2,))),
        Recorder(),
    ]
    plan = Plan.from_dict({"replicas": [{"devices": [0, 1], "bounds": [0, 4, 8], "micro_batches": 4},
                                        {"devices": [2, 3], "bounds": [0, 4, 8], "micro_batches": 4}]})
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ResiHPStrategy(plan=plan, micro_batch_size=MBS),
                         max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=log_dir)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M * MBS * steps, WIDTH, generator=gen)
    trainer.fit(Stack(), DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=M * MBS, drop_last=True))
    return {"probe_ms": probe_ms, "steps": steps_seen, "p2p_ms": detector.p2p_ms}


def run(delay_ms: float, steps: int) -> dict:
    from resihp_lightning.testing.multiproc import run_distributed

    from resihp_lightning.callbacks import read_events

    with tempfile.TemporaryDirectory() as log_dir:
        results = run_distributed(_rank, 4, timeout=900, log_dir=log_dir, delay_ms=delay_ms, steps=steps)
        events = read_events(log_dir)
    rank0 = results[0]
    detected = [e for e in events if e["event"] == "slow_link_detected"]
    applied = [e for e in events if e["event"] == "plan_applied"]
    first_plan = rank0["steps"][0]["plan"]
    faulty = [s["ms"] for s in rank0["steps"] if s["step"] >= FAULT_STEP and s["plan"] == first_plan][1:]
    changed = [s for s in rank0["steps"] if s["plan"] != first_plan]
    after = [s["ms"] for s in changed[1:]]
    healthy = [s["ms"] for s in rank0["steps"] if 2 <= s["step"] < FAULT_STEP]
    p2p = rank0["p2p_ms"] or 0.0
    return {
        "delay_ms": delay_ms,
        "probe_ms": statistics.median(ms for step, ms in rank0["probe_ms"] if step < FAULT_STEP),
        "probe_faulty_ms": statistics.median(ms for step, ms in rank0["probe_ms"] if step >= FAULT_STEP),
        "healthy_step_ms": statistics.median(healthy) if healthy else None,
        "detected_step": detected[0]["step"] if detected else None,
        "named": sorted({e["rank"] for e in detected}),
        "link_speed": detected[0]["link_speed"] if detected else None,
        "implied_speed": p2p / (p2p + delay_ms) if p2p else None,
        "p2p_ms": p2p,
        "faulty_ms": statistics.median(faulty) if faulty else None,
        "after_ms": statistics.median(after) if after else None,
        "applied": [(e["step"], [(r["devices"], r["bounds"], r["micro_batches"]) for r in e["plan"]["replicas"]])
                    for e in applied],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays", type=float, nargs="+", default=[5.0, 20.0, 50.0])
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    print("| delay ms | probe ms healthy / slow link | healthy step ms | named (step) | link speed est. / implied | step ms 2x2 faulty -> re-planned | plan applied |")
    print("|---|---|---|---|---|---|---|")
    for delay in args.delays:
        r = run(delay, args.steps)
        ratio = f" ({r['after_ms'] / r['faulty_ms']:.2f}x)" if r["after_ms"] and r["faulty_ms"] else ""
        implied = f"{r['implied_speed']:.3f}" if r["implied_speed"] else "-"
        print(f"| {delay:g} | {r['probe_ms']:.1f} / {r['probe_faulty_ms']:.1f} | {r['healthy_step_ms']:.0f} | {r['named']} ({r['detected_step']}) | "
              f"{r['link_speed']} / {implied} | {r['faulty_ms']:.0f} -> {r['after_ms'] or 0:.0f}{ratio} | {r['applied']} |",
              flush=True)


if __name__ == "__main__":
    main()
