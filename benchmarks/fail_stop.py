"""Fail-stop benchmark: the demo model loses a rank mid-step; in-process recovery vs. a restart.

**In-process** (``--repeats`` runs): ``examples/finetune.py`` with the demo config (4 processes,
Lightning's own launcher, 2 x 2 plan) and ``fault.kind: kill`` on ``--victim`` at the forward of its
2nd micro-batch of step ``--kill-step``. The events log gives, on the clock all processes of a
machine share: kill -> detected (the first process that named the dead rank), and per survivor rank
0's breakdown: abort, regroup (new default group), plan (layer profile + the survivors' plan), restore
(engine rebuilt + layers new to each survivor received), redo (the interrupted step run again), and
the bytes moved, checked against the layers each survivor did not hold (``placement.plan_transfers``
with the dead rank's copies lost).

**Restart** (what a checkpoint-restart would cost instead, measured once): a fresh 3-process job of
the same script from ``exec`` to the end of its first step (process start, imports, rendezvous,
data, model build, first step), plus loading a checkpoint of the demo model into it (``torch.load``
+ ``load_state_dict``). Lost work since the last checkpoint comes on top and is not counted.

**Overhead** (``--overhead N``): healthy step time of the demo with ``fail_stop`` on (heartbeat
threads, the store host, the commit vote of every step) and off, N runs of each, interleaved.

Run: ``python benchmarks/fail_stop.py [--repeats 3] [--overhead 0]`` (about a minute per run on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "finetune.py"
CONFIG = ROOT / "examples" / "configs" / "demo_cpu.yaml"


def _run(run_dir: Path, *args: str) -> float:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", str(CONFIG), "--run_dir", str(run_dir), "--trainer.progress_bar", "false",
         "--fault", "null", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    if result.returncode != 0:
        raise SystemExit(f"the example failed:\n{result.stderr[-3000:]}")
    return started


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def in_process(repeats: int, victim: int, kill_step: int, steps: int) -> list[dict]:
    from resihp_lightning.placement import plan_transfers
    from resihp_lightning.plan import Plan

    rows = []
    for i in range(repeats):
        run_dir = Path(tempfile.mkdtemp(prefix="resihp-failstop-"))
        _run(run_dir, "--trainer.max_steps", str(steps), "--fault.kind", "kill", "--fault.rank", str(victim),
             "--fault.start_step", str(kill_step), "--fault.micro_batch", "2")
        events = _events(run_dir)
        struck = next(e for e in events if e["event"] == "fault_struck")
        detected = next(e for e in events if e["event"] == "fail_stop_detected")
        done = next(e for e in events if e["event"] == "recovery_finished")
        applied = next(e for e in events if e["event"] == "plan_applied" and e["step"] == kill_step)
        steps_log = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
        before = Plan.uniform([0, 1, 2, 3], 8, 2, 8)
        after = Plan.from_dict(applied["plan"])
        numel = _layer_bytes(run_dir)
        expected = sum(numel[t.layer] for t in plan_transfers(before, after, numel, alive=set(done["members"])))
        healthy = statistics.median(s["wall_ms"] for s in steps_log[3:kill_step]) / 1000.0
        rows.append({
            "detect": detected["at"] - struck["at"], "abort": done["abort_s"], "regroup": done["regroup_s"],
            "plan": done["plan_s"], "restore": done["restore_s"], "redo": done["redo_s"],
            "kill_to_first_step": detected["at"] - struck["at"] + done["total_s"],
            "bytes": done["bytes_moved"], "expected_bytes": expected, "healthy_step": healthy,
            "plan_label": f"{after.pipeline_degree}x{after.data_degree}",
        })
        print(f"run {i + 1}: {rows[-1]}", flush=True)
    return rows


def _layer_bytes(run_dir: Path) -> list[int]:
    """Bytes each layer of the demo model moves: fp32 parameters, AdamW's two moments and its 4-byte ``step``."""
    sys.path.insert(0, str(ROOT))
    import yaml

    from resihp_lightning.config import ScratchModelConfig
    from resihp_lightning.models.hf_checkpoint import build_pipeline_model, tiny_config

    scratch = yaml.safe_load(CONFIG.read_text())["model"]["scratch"]
    model = build_pipeline_model(tiny_config(**{**vars(ScratchModelConfig()), **scratch}), seed=0)
    return [sum(p.numel() * 4 * 3 + 4 for p in layer.parameters()) for layer in model.layers]


def restart() -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="resihp-restart-"))
    started = time.time()
    _run(run_dir, "--trainer.max_steps", "1", "--trainer.devices", "3", "--strategy.pipeline_degree", "1",
         "--strategy.micro_batches", "9")
    steps_log = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    first_step_end = steps_log[0]["time"] if "time" in steps_log[0] else None
    start_to_first = (first_step_end - started) if first_step_end is not None else float("nan")
    load = _checkpoint_load_s(run_dir)
    return {"start_to_first_step": start_to_first, "checkpoint_load": load}


def _checkpoint_load_s(run_dir: Path) -> float:
    import torch
    import yaml

    from resihp_lightning.config import ScratchModelConfig
    from resihp_lightning.models.hf_checkpoint import build_pipeline_model, tiny_config

    scratch = yaml.safe_load(CONFIG.read_text())["model"]["scratch"]
    model = build_pipeline_model(tiny_config(**{**vars(ScratchModelConfig()), **scratch}), seed=0)
    params = [p for layer in model.layers for p in layer.parameters()]
    optimizer = torch.optim.AdamW(params)
    for p in params:
        optimizer.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p), "step": torch.tensor(1.0)}
    path = run_dir / "demo.ckpt"
    state = {"state_dict": {f"layers.{i}.{k}": v for i, layer in enumerate(model.layers) for k, v in layer.state_dict().items()},
             "optimizer": optimizer.state_dict()}
    torch.save(state, path)
    started = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    for i, layer in enumerate(model.layers):
        layer.load_state_dict({k.split(".", 2)[2]: v for k, v in loaded["state_dict"].items() if k.startswith(f"layers.{i}.")})
    optimizer.load_state_dict(loaded["optimizer"])
    return time.perf_counter() - started


def overhead(repeats: int, steps: int = 14) -> dict[str, list[float]]:
    """Median healthy step wall time (steps 3..) with fail_stop on and off, interleaved runs."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(repeats):
        for mode in ("on", "off"):
            run_dir = Path(tempfile.mkdtemp(prefix=f"resihp-overhead-{mode}-"))
            extra = () if mode == "on" else ("--strategy.fail_stop", "null")
            _run(run_dir, "--trainer.max_steps", str(steps), *extra)
            walls = [json.loads(line)["wall_ms"] for line in (run_dir / "steps.jsonl").read_text().splitlines()][3:]
            times[mode].append(statistics.median(walls) / 1000.0)
            print(f"fail_stop {mode}: median step {times[mode][-1]:.3f} s", flush=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--overhead", type=int, default=0, help="runs of each (on / off) for the overhead table")
    args = parser.parse_args()
    if args.overhead:
        times = overhead(args.overhead)
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"\nhealthy step: fail_stop on {on:.3f} s, off {off:.3f} s, ratio {on / off:.3f}")
        return
    rows = in_process(args.repeats, args.victim, args.kill_step, args.steps)
    keys = ("detect", "abort", "regroup", "plan", "restore", "redo", "kill_to_first_step", "healthy_step")
    print("\n| in-process (median of %d) | " % len(rows) + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    print("| seconds | " + " | ".join(f"{statistics.median(r[k] for r in rows):.3f}" for k in keys) + " |")
    print(f"bytes moved = layers new to each survivor: {all(r['bytes'] == r['expected_bytes'] for r in rows)} "
          f"({rows[0]['bytes'] / 2**20:.1f} MiB); survivors' plan {rows[0]['plan_label']}")
    r = restart()
    print(f"\nrestart instead: exec -> end of first step {r['start_to_first_step']:.2f} s, "
          f"checkpoint load {r['checkpoint_load']:.3f} s")


if __name__ == "__main__":
    main()
