"""False-eviction benchmark: healthy README demo runs with ``fail_stop`` on, beside a CPU hog.

Each run is ``examples/finetune.py --config examples/configs/demo_cpu.yaml --fault null`` (4 processes,
``fail_stop`` on by default there) while ``--hogs`` busy loops (``python -c 'while 1: pass'``) compete
for the machine's cores. Nothing is injected, so every ``fail_stop_detected`` event in the run's
``events.jsonl`` (written by ``FailStopReporter``) is a false eviction of a healthy rank, and so is a
run that does not end with status 0 after all its steps.

Run: ``python benchmarks/false_evictions.py --runs 5 [--steps 20] [--hogs 2] [--out DIR]``. Prints one
line per run and a summary (runs with a false eviction / runs), and appends the runs to
``<out>/runs.jsonl``. With ``RESIHP_DETECTOR_TRACE`` unset nothing else is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _hogs(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(count)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


def _detections(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in events if e.get("event") == "fail_stop_detected"]


def run_once(index: int, out: Path, steps: int, hogs: int, timeout_s: float) -> dict:
    """One healthy demo run beside ``hogs`` busy loops; returns its outcome."""
    run_dir = out / f"run{index:02d}-{int(time.time())}"
    command = [
        sys.executable, str(ROOT / "examples" / "finetune.py"), "--config", str(ROOT / "examples/configs/demo_cpu.yaml"),
        "--fault", "null", "--trainer.max_steps", str(steps), "--run_dir", str(run_dir),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    hog_procs = _hogs(hogs)
    started = time.monotonic()
    try:
        with open(out / f"{run_dir.name}.log", "wb") as log_file:
            try:
                status = subprocess.run(command, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                        timeout=timeout_s, check=False).returncode
            except subprocess.TimeoutExpired:
                status = "timeout"
    finally:
        _stop(hog_procs)
    detections = _detections(run_dir)
    lost = sorted({d["rank"] for d in detections})
    return {
        "run": run_dir.name, "status": status, "seconds": round(time.monotonic() - started, 1), "steps": steps,
        "hogs": hogs, "false_evictions": len(lost), "lost_ranks": lost,
        "detections": [{k: d.get(k) for k in ("step", "rank", "how", "reason", "reporter")} for d in detections],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="trainer.max_steps of each run (the README's: 40)")
    parser.add_argument("--hogs", type=int, default=2, help="busy loops beside each run")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it counts as hung")
    parser.add_argument("--out", type=Path, default=Path("/tmp/resihp-false-evictions"))
    parser.add_argument("--label", default="", help="recorded with each run (e.g. the commit)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    bad = 0
    for index in range(args.runs):
        outcome = run_once(index, args.out, args.steps, args.hogs, args.timeout)
        outcome["label"] = args.label
        failed = outcome["false_evictions"] > 0 or outcome["status"] != 0
        bad += failed
        print(json.dumps(outcome), flush=True)
        with open(args.out / "runs.jsonl", "a") as handle:
            handle.write(json.dumps(outcome) + "\n")
    print(f"runs with a false eviction or a failed exit: {bad} of {args.runs} "
          f"({args.steps} steps each, {args.hogs} busy loops beside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
