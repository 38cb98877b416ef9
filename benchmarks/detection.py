"""Detection benchmark: many seeded fail-slow scenarios over variable-length traces.

For each scenario a synthetic trace (``resihp_lightning/testing/synthetic.py``) is generated: packed,
long-tailed documents; stages of unequal cost; noise and rare spikes; optionally one rank slowed by a
factor in 1.2-4x from a random step (sometimes healing later). Three detectors see the same trace:

* ``resihp``: the workload-normalised detector (``StragglerCore``) with its default options;
* ``step-time``: alarm when the step time exceeds 1.25x its warm-up median for ``patience`` steps
  (it cannot tell which rank; it gets credit for any alarm during a fault);
* ``nvrx-style``: per-rank raw busy time per step, relative score = fastest rank's time / this
  rank's, individual score = own best / own current, alarm when either is below 0.75 for
  ``patience`` steps (NVIDIA's defaults; its docs assume every rank does similar work).

Reported: detection rate by factor, false alarms per 1000 healthy steps, latency (steps from the
fault's start to the alarm), speed-estimate error, healing, and the detector's per-step cost on a
256-rank trace. Run: ``python benchmarks/detection.py [--scenarios N] [--seed S]``.

``--closed-loop`` instead runs the whole loop on 4 real gloo processes (``Trainer(strategy="resihp")``,
2 stages x 2 replicas, an MLP of 8 layers): ``FaultInjector`` slows rank 1 by 2x from step 16,
``StragglerDetector`` + ``ReplanController`` detect, plan and apply; the same job without the
controller is the baseline. It prints the events and the median step time per phase.

``--demo`` runs the README's fine-tuning example (``examples/configs/demo_cpu.yaml``, 4 processes,
2 x 2, re-planning off) once per factor of ``--factors`` (default 1.5, 2, 3) with rank 1 slowed from
step 14, and reports the speed estimate against 1/factor: at the first detection, and the settled
estimate (the median of the slowed rank's relative speed from its detection to the end). Rank 0's
per-step relative speeds go to ``<run_dir>/speeds.jsonl``. ``--heal`` runs the issue-17 healing case
instead (3x on rank 2 from step 10 to 26, re-planning on) and reports when the healed device read
>= 0.95 and was reported recovered.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resihp_lightning.callbacks.failslow.straggler_core import StragglerConfig, LocalTracker, StragglerCore, run_on_trace  # noqa: E402
from resihp_lightning.testing.synthetic import SyntheticFault, TraceSpec, generate_trace  # noqa: E402

FACTOR_BINS = ((1.2, 1.5), (1.5, 2.0), (2.0, 3.0), (3.0, 4.01))
LAYOUTS = {"4x4": dict(stages=4, replicas=4, micro_batches=16), "8x4": dict(stages=8, replicas=4, micro_batches=32),
           "8x1": dict(stages=8, replicas=1, micro_batches=8)}


@dataclass
class Scenario:
    layout: str
    spec: TraceSpec
    fault: SyntheticFault | None


@dataclass
class Outcome:
    detected: bool = False
    correct_rank: bool = False
    latency: int | None = None
    speed_error: float | None = None
    false_alarms: int = 0
    healthy_steps: int = 0
    healed: bool | None = None


@dataclass
class Tally:
    outcomes: list[tuple[Scenario, Outcome]] = field(default_factory=list)


def make_scenarios(count: int, seed: int, steps: int) -> list[Scenario]:
    rng = np.random.default_rng(seed)
    scenarios = []
    names = list(LAYOUTS)
    for i in range(count):
        layout = names[i % len(names)] if i % 5 else "4x4"
        shape = LAYOUTS[layout]
        heavy = rng.random() < 0.5
        spec_kwargs = dict(shape, steps=steps, seed=int(rng.integers(1 << 31)), spike_prob=0.01,
                           length_log_sigma=2.0 if heavy else 1.3, beta=(3 if heavy else 1) * 0.01 / 4096,
                           stage_cost=None if rng.random() < 0.5 else tuple(rng.uniform(0.4, 2.5, shape["stages"])))
        fault = None
        if rng.random() < 0.8:
            ranks = shape["stages"] * shape["replicas"]
            start = int(rng.integers(15, steps - 20))
            if shape["replicas"] > 1 and rng.random() < 0.1:
                start = 0  # slow from the start: only the cohort can tell
            end = start + 15 if rng.random() < 0.3 else None
            fault = SyntheticFault(int(rng.integers(ranks)), float(rng.uniform(1.2, 4.0)), start, end)
        faults = (fault,) if fault else ()
        scenarios.append(Scenario(layout, TraceSpec(faults=faults, **spec_kwargs), fault))
    return scenarios


def judge(scenario: Scenario, alarms: list[tuple[int, int | None, float | None]], first_step: int, steps: int,
          recovered: list[tuple[int, int]] | None = None) -> Outcome:
    """``alarms``: (step, rank or None, speed estimate or None) of each new alarm."""
    fault = scenario.fault
    out = Outcome()
    for t in range(first_step, steps):
        if fault is None or not fault.active(t):
            out.healthy_steps += 1
    for step, rank, speed in alarms:
        on_fault_rank = fault is not None and rank in (None, fault.rank)
        if on_fault_rank and fault.active(step):
            if not out.detected:
                out.detected = True
                out.correct_rank = rank == fault.rank
                out.latency = step - max(fault.start, first_step)  # counted from the end of the warm-up
                if speed is not None:
                    out.speed_error = abs(speed * fault.factor - 1.0)
        elif on_fault_rank and fault.end is not None and fault.end <= step < fault.end + 5:
            pass  # a lagging alarm right after the device healed
        else:
            out.false_alarms += 1  # a healthy rank flagged, or an alarm in healthy time
    if fault is not None and fault.end is not None and fault.end < steps - 5 and recovered is not None and out.detected:
        out.healed = any(r == fault.rank and fault.end <= s <= fault.end + 5 for s, r in recovered)
    return out


def run_resihp(scenario: Scenario, trace, config: StragglerConfig) -> Outcome:
    _, events = run_on_trace(trace, config)
    alarms = [(e["step"], e["rank"], e["speed"]) for e in events if e["event"] == "fail_slow_detected"]
    first = {}
    for step, rank, speed in alarms:  # re-reports of a speed change are not new alarms
        first.setdefault((rank, _episode(scenario, step)), (step, rank, speed))
    recovered = [(e["step"], e["rank"]) for e in events if e["event"] == "fail_slow_recovered"]
    return judge(scenario, sorted(first.values()), config.warmup_steps + config.fit_steps, scenario.spec.steps, recovered)


def _episode(scenario: Scenario, step: int) -> int:
    fault = scenario.fault
    return 1 if fault is not None and fault.active(step) else 0


def run_step_time(scenario: Scenario, trace, patience: int, warm: int, fit: int, ratio: float = 1.25) -> Outcome:
    step_ms = [step[0].step_ms for step in trace]
    base = statistics.median(step_ms[warm : warm + fit])
    alarms, streak, alarmed = [], 0, False
    for t in range(warm + fit, len(step_ms)):
        slow = step_ms[t] > ratio * base
        streak = streak + 1 if slow else 0
        if streak >= patience and not alarmed:
            alarms.append((t, None, base / statistics.median(step_ms[t - patience + 1 : t + 1])))
            alarmed = True
        if streak == 0:
            alarmed = False
    return judge(scenario, alarms, warm + fit, len(step_ms))


def run_nvrx_style(scenario: Scenario, trace, patience: int, warm: int, threshold: float = 0.75) -> Outcome:
    ranks = len(trace[0])
    best = [float("inf")] * ranks
    streak = [0] * ranks
    alarmed = [False] * ranks
    alarms = []
    for t, step in enumerate(trace):
        busy = [sum(mb.compute_ms for mb in s.micro_batches) / max(len(s.micro_batches), 1) for s in step]
        if t < warm:
            continue
        fastest = min(busy)
        for r in range(ranks):
            best[r] = min(best[r], busy[r])
            relative = fastest / busy[r]
            individual = best[r] / busy[r]
            slow = relative < threshold or individual < threshold
            streak[r] = streak[r] + 1 if slow else 0
            if streak[r] >= patience and not alarmed[r]:
                alarms.append((t, r, min(relative, individual)))
                alarmed[r] = True
            if streak[r] == 0:
                alarmed[r] = False
    return judge(scenario, alarms, warm, len(trace))


def summarise(name: str, outcomes: list[tuple[Scenario, Outcome]]) -> list[str]:
    faulty = [(s, o) for s, o in outcomes if s.fault is not None]
    rows = []
    for lo, hi in FACTOR_BINS:
        group = [o for s, o in faulty if lo <= s.fault.factor < hi]
        if group:
            rate = sum(o.detected and o.correct_rank for o in group) / len(group)
            rows.append(f"{rate * 100:.1f}% ({sum(o.detected and o.correct_rank for o in group)}/{len(group)})")
        else:
            rows.append("-")
    any_rate = sum(o.detected for _, o in faulty) / max(len(faulty), 1)
    healthy_steps = sum(o.healthy_steps for _, o in outcomes)
    false_alarms = sum(o.false_alarms for _, o in outcomes)
    healthy_runs = [o for s, o in outcomes if s.fault is None]
    runs_with_fa = sum(o.false_alarms > 0 for o in healthy_runs)
    latencies = [o.latency for _, o in faulty if o.detected and o.latency is not None]
    errors = [o.speed_error for _, o in faulty if o.detected and o.speed_error is not None]
    healed = [o.healed for _, o in faulty if o.healed is not None]
    lat = f"{statistics.median(latencies):.0f} / {max(latencies)}" if latencies else "-"
    err = f"{statistics.median(errors) * 100:.1f}% / {max(errors) * 100:.1f}%" if errors else "-"
    heal = f"{sum(healed)}/{len(healed)}" if healed else "n/a"
    return [f"| {name} | " + " | ".join(rows) + f" | {any_rate * 100:.1f}% | {1000 * false_alarms / max(healthy_steps, 1):.2f}"
            f" | {runs_with_fa}/{len(healthy_runs)} | {lat} | {err} | {heal} |"]


def overhead_256(steps: int = 20) -> tuple[float, float, float]:
    """Per-step cost (ms) of one rank's tracker and of the core over 256 ranks; median step time (ms)."""
    spec = TraceSpec(stages=16, replicas=16, micro_batches=64, steps=steps + 12, seed=99)
    trace = generate_trace(spec)
    config = StragglerConfig()
    trackers = [LocalTracker(config.warmup_steps, config.fit_steps) for _ in range(256)]
    core = StragglerCore(config)
    local_ms, core_ms = [], []
    for t, step in enumerate(trace):
        summaries = []
        for s in step:
            start = time.perf_counter()
            summaries.append(trackers[s.rank].summarize(s))
            local_ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        core.update(summaries)
        if t >= 12:
            core_ms.append((time.perf_counter() - start) * 1e3)
    step_ms = statistics.median(step[0].step_ms for step in trace)
    # Each rank runs only its own tracker; the fitted-model steps are what matter.
    return statistics.median(local_ms[-256 * steps :]), statistics.median(core_ms), step_ms


# ----------------------------------------------------------------------------------- closed loop
CL_WIDTH, CL_DEPTH, CL_MBS, CL_M, CL_FAULT_STEP = 1024, 8, 16, 8, 16


def _closed_loop_rank(rank: int, world: int, log_dir: str, steps: int, control: bool) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.callbacks import EventLog, FaultInjector, ReplanController, StragglerDetector
    from resihp_lightning.callbacks.replan.replan_policy import ControllerConfig
    from resihp_lightning.config import PlannerConfig
    from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.testing.toy_jobs import build_stack

    Stack = build_stack(CL_WIDTH, CL_DEPTH)

    gen = torch.Generator().manual_seed(1)
    rows = CL_M * CL_MBS * steps
    data = DataLoader(TensorDataset(torch.randn(rows, CL_WIDTH, generator=gen), torch.randn(rows, CL_WIDTH, generator=gen)),
                      batch_size=CL_M * CL_MBS)
    events = EventLog(log_dir, rank=rank)
    step_ms: list[tuple[int, float]] = []

    class Timer(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            stats = trainer.strategy.last_step_stats
            step_ms.append((stats.step, stats.step_ms))

    # 4 processes on shared CPU cores: busy-time noise is large, so decisions pool 6 steps.
    detector = StragglerDetector(warmup_steps=2, fit_steps=8, window=6, significance=2.0, patience=3,
                                 gpu_individual_perf_threshold=0.75, gpu_relative_perf_threshold=0.75,
                                 recovery_threshold=0.85, events=events)
    callbacks = [FaultInjector([{"kind": "slow", "rank": 1, "factor": 2.0, "start_step": CL_FAULT_STEP}], events=events),
                 detector]
    if control:
        callbacks.append(ReplanController(ControllerConfig(migration_overhead_s=0.1), planner=PlannerConfig(solver="exact"),
                                          events=events))
    callbacks.append(Timer())
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ResiHPStrategy(pipeline_degree=2, micro_batch_size=CL_MBS),
                         max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=log_dir)
    trainer.fit(Stack(), data)
    return {"step_ms": step_ms, "events": events.events, "speeds": detector.speeds}


def closed_loop(steps: int) -> None:
    import tempfile

    from resihp_lightning.testing.multiproc import run_distributed

    for control in (False, True):
        with tempfile.TemporaryDirectory() as log_dir:
            started = time.perf_counter()
            results = run_distributed(_closed_loop_rank, 4, timeout=900, log_dir=log_dir, steps=steps, control=control)
            wall = time.perf_counter() - started
        times = dict(results[0]["step_ms"])
        events = results[0]["events"]
        applied = [e["step"] for e in events if e["event"] == "plan_applied"]
        cut = applied[0] if applied else None

        def median(lo: int, hi: int) -> str:
            values = [times[t] for t in range(lo, hi) if t in times]
            return f"{statistics.median(values):.0f}" if values else "-"

        print(f"\n{'with' if control else 'without'} controller ({wall:.0f} s wall)")
        for event in events:
            brief = {k: v for k, v in event.items() if k not in ("time", "plan")}
            if isinstance(event.get("plan"), dict):
                brief["plan"] = [(r["devices"], r["bounds"], r["micro_batches"]) for r in event["plan"]["replicas"]]
            print("  ", brief)
        print(f"  median step ms: healthy (steps 4-{CL_FAULT_STEP - 1}) {median(4, CL_FAULT_STEP)}; "
              f"slowed before any re-plan {median(CL_FAULT_STEP, cut or steps)}; "
              f"after the re-plan {median(cut + 2, steps) if cut else '-'}")


# ------------------------------------------------------------------------------- the demo job
DEMO_CONFIG = ROOT / "examples" / "configs" / "demo_cpu.yaml"


def _speed_trace(path: Path):
    """A callback (rank 0) appending each step's per-rank speeds, as the detector holds them, to ``path``."""
    import json

    import lightning.pytorch as pl

    from resihp_lightning.callbacks.failslow.straggler_detector import StragglerDetector

    class SpeedTrace(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_rank != 0:
                return
            detector = next(cb for cb in trainer.callbacks if isinstance(cb, StragglerDetector))
            core = detector.core
            record = {"step": trainer.global_step - 1, "raw": core.raw_speeds,
                      "relative": {r: st.history[-1] for r, st in core._states.items() if st.history},
                      "speeds": core.speeds, "flagged": core.flagged,
                      "plan": [r.micro_batches for r in trainer.strategy.current_plan.replicas]}
            with open(path, "a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")

    return SpeedTrace()


def demo_job(argv: list[str]) -> None:
    """One run of the example (every rank runs this: Lightning's launcher re-runs the script)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import finetune

    cfg = finetune.build_parser().parse_args(argv)
    run_dir = finetune.resolve_run_dir(cfg)
    finetune.run(cfg, extra_callbacks=[_speed_trace(run_dir / "speeds.jsonl")])


def _launch(run_dir: Path, extra: list[str]) -> tuple[list[dict], list[dict], float]:
    import json
    import os
    import subprocess

    from resihp_lightning.callbacks.events import read_events

    argv = [sys.executable, str(Path(__file__).resolve()), "--demo-job", "--config", str(DEMO_CONFIG),
            "--run_dir", str(run_dir), "--checkpoint", "null", "--trainer.progress_bar", "false", *extra]
    started = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RESIHP_RUN_DIR", None)
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    wall = time.perf_counter() - started
    lines = (run_dir / "speeds.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], read_events(run_dir), wall


def _load() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


def demo_estimates(factors: list[float], steps: int, out_dir: Path, layout: list[str]) -> None:
    import tempfile

    rank, start = 1, 14
    print("| factor | truth 1/factor | detected at step (latency) | estimate at detection | error | settled estimate "
          f"(median from detection) | error | reported at the end | error | load before / after | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for factor in factors:
        run_dir = Path(tempfile.mkdtemp(prefix=f"demo-{factor:g}x-", dir=out_dir))
        before = _load()
        trace, events, wall = _launch(run_dir, ["--replan", "false", "--trainer.max_steps", str(steps),
                                                "--fault.factor", str(factor), "--fault.rank", str(rank),
                                                "--fault.start_step", str(start), *layout])
        truth = 1.0 / factor
        found = [e for e in events if e["event"] == "fail_slow_detected" and e["rank"] == rank]
        if not found:
            print(f"| {factor:g}x | {truth:.3f} | none | - | - | - | - | - | - | {before} / {_load()} | {wall:.0f} |")
            continue
        first = found[0]
        settled = statistics.median(r["relative"][str(rank)] for r in trace
                                    if r["step"] >= first["step"] and str(rank) in r["relative"])
        final = trace[-1]["speeds"][str(rank)]
        print(f"| {factor:g}x | {truth:.3f} | {first['step']} ({first['step'] - start}) | {first['speed']:.3f} | "
              f"{(first['speed'] - truth) / truth * 100:+.1f}% | {settled:.3f} | {(settled - truth) / truth * 100:+.1f}% | "
              f"{final:.3f} | {(final - truth) / truth * 100:+.1f}% | {before} / {_load()} | {wall:.0f} |", flush=True)


def demo_heal(steps: int, out_dir: Path) -> None:
    import tempfile

    rank, start, end = 2, 10, 26
    run_dir = Path(tempfile.mkdtemp(prefix="demo-heal-", dir=out_dir))
    before = _load()
    trace, events, wall = _launch(run_dir, ["--trainer.max_steps", str(steps), "--fault.factor", "3",
                                            "--fault.rank", str(rank), "--fault.start_step", str(start),
                                            "--fault.end_step", str(end)])
    print(f"3x on rank {rank}, steps {start}-{end - 1}, re-planning on; load {before} / {_load()}; {wall:.0f} s; run {run_dir}")
    for event in events:
        if event["event"] in ("fail_slow_detected", "fail_slow_recovered", "plan_applied"):
            plan = event.get("plan")
            extra = f" micro-batches {[r['micro_batches'] for r in plan['replicas']]}" if plan else ""
            print(f"  step {event['step']}: {event['event']} rank {event.get('rank', '-')} speed {event.get('speed', '-')}{extra}")
    for record in trace:
        if record["step"] >= end - 2:
            rel = record["relative"].get(str(rank))
            print(f"  step {record['step']}: rank {rank} relative speed {rel if rel is None else round(rel, 3)}, "
                  f"reported {record['speeds'].get(str(rank))}, plan micro-batches {record['plan']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", type=int, default=300)
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--closed-loop", action="store_true", help="run the 4-process loop instead")
    parser.add_argument("--demo", action="store_true", help="speed estimates on the fine-tuning example")
    parser.add_argument("--heal", action="store_true", help="with --demo: the healing case")
    parser.add_argument("--factors", type=str, default="1.5,2,3")
    parser.add_argument("--out", type=str, default=str(ROOT / "runs"))
    parser.add_argument("--devices", type=int, default=None,
                        help="with --demo: processes (default: the example's 4; 2 = one per core here)")
    parser.add_argument("--pipeline-degree", type=int, default=None,
                        help="with --demo: stages per replica (default: the example's 2)")
    if len(sys.argv) > 1 and sys.argv[1] == "--demo-job":
        demo_job(sys.argv[2:])
        return
    args = parser.parse_args()
    if args.demo:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if args.heal:
            demo_heal(args.steps if args.steps != 70 else 44, out)
        else:
            layout = [] if args.devices is None else ["--trainer.devices", str(args.devices)]
            layout += [] if args.pipeline_degree is None else ["--strategy.pipeline_degree", str(args.pipeline_degree)]
            demo_estimates([float(f) for f in args.factors.split(",")], args.steps if args.steps != 70 else 34, out,
                           layout)
        return
    if args.closed_loop:
        closed_loop(args.steps if args.steps != 70 else 40)
        return
    config = StragglerConfig()
    scenarios = make_scenarios(args.scenarios, args.seed, args.steps)
    results: dict[str, list] = {"resihp": [], "step-time 1.25x": [], "nvrx-style 0.75": []}
    started = time.perf_counter()
    for scenario in scenarios:
        trace = generate_trace(scenario.spec)
        results["resihp"].append((scenario, run_resihp(scenario, trace, config)))
        results["step-time 1.25x"].append(
            (scenario, run_step_time(scenario, trace, config.patience, config.warmup_steps, config.fit_steps)))
        results["nvrx-style 0.75"].append((scenario, run_nvrx_style(scenario, trace, config.patience, config.warmup_steps)))
    elapsed = time.perf_counter() - started
    n_fault = sum(s.fault is not None for s in scenarios)
    print(f"{len(scenarios)} scenarios ({n_fault} with a fault, {len(scenarios) - n_fault} healthy), "
          f"layouts {', '.join(LAYOUTS)}, {args.steps} steps each, seed {args.seed}; {elapsed:.0f} s\n")
    print("| detector | found, right rank: 1.2-1.5x | 1.5-2x | 2-3x | 3-4x | any alarm during fault | false alarms / 1000 healthy steps"
          " | healthy runs with an alarm | latency, steps (median / max) | speed error (median / max) | healing seen |")
    print("|---" * 11 + "|")
    for name, outcomes in results.items():
        for row in summarise(name, outcomes):
            print(row)
    for name, outcomes in results.items():
        early = [o for s, o in outcomes if s.fault is not None and s.fault.start == 0]
        if early:
            print(f"{name}: faults present from the start (before the model fit): "
                  f"{sum(o.detected and o.correct_rank for o in early)}/{len(early)} found with the right rank")
    misses = [(s, o) for s, o in results["resihp"] if s.fault is not None and not (o.detected and o.correct_rank)]
    if misses:
        print("\nresihp misses:")
        for s, o in misses:
            print(f"  layout {s.layout} rank {s.fault.rank} factor {s.fault.factor:.2f} start {s.fault.start}"
                  f" end {s.fault.end} seed {s.spec.seed}: detected={o.detected} correct_rank={o.correct_rank}")
    local_ms, core_ms, step_ms = overhead_256()
    print(f"\noverhead on a 256-rank trace (16 stages x 16 replicas, 4 micro-batches per replica): "
          f"tracker {local_ms:.3f} ms per rank-step, core {core_ms:.2f} ms per step over 256 ranks; "
          f"synthetic step time {step_ms:.0f} ms -> {(local_ms + core_ms) / step_ms * 100:.2f}% of a step")


if __name__ == "__main__":
    main()
