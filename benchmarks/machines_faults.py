"""What a lost machine does to a torchrun job today: 3 namespace machines x 2 workers, ``fail_stop`` on.

On :class:`~resihp_lightning.testing.machines.Machines` (3 machines, each its own network namespace,
address and hostname), one torchrun agent per machine runs ``resihp_lightning/testing/machines_job.py``
(2 stages x 3 replicas, 6 steps, each ~1.6 s) as a user would (:class:`~resihp_lightning.testing.torchrun_machines.TorchrunJob`:
``--nnodes 3 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint node0:29400 --max-restarts 2``).
Once step 2 is done (plus ``--delay-s``, so the fault lands inside step 3) one fault:

* ``kill1``: every process of machine 1 (agent and workers) SIGKILLed;
* ``cut0``: machine 0's link cut (it hosts the c10d rendezvous, node rank 0 and the fail-stop store);
* ``stop1``: every process of machine 1 SIGSTOPped;
* ``kill1w``: one worker of machine 1 SIGKILLed (its agent and the machine's other worker live);
* ``none``: no fault (start-up and step times).

``--per-process`` launches torchft's way instead: one ``torchrun --standalone --nproc-per-node 1
--max-restarts 0`` agent per process, the ranks from the job's own store on machine 0.

Times are seconds after the fault (one host, one monotonic clock): detection (first
``fail_stop_detected``), the first step finished after it, the last step, and each agent's exit (its
status, or ``running`` when ``--watch-s`` ran out). Needs root (namespaces).

Run: ``python benchmarks/machines_faults.py [--scenarios kill1 cut0 stop1] [--watch-s 400]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resihp_lightning.testing.machines import Machines, unavailable_reason  # noqa: E402
from resihp_lightning.testing.torchrun_machines import TorchrunJob, TorchrunJobConfig  # noqa: E402

FAULTS = {
    "none": lambda machines: None,
    "kill1": lambda machines: machines[1].kill(),
    "cut0": lambda machines: machines[0].cut_link(),
    "stop1": lambda machines: machines[1].stop(),
    "kill1w": None,  # one worker of machine 1 (its local rank 0) SIGKILLed, its agent and the other worker live
}


def _kill_one_worker(machines: Machines, job: TorchrunJob) -> None:
    start = next(s for s in job.starts() if s["host"] == machines[1].hostname and s["local_rank"] == 0)
    os.kill(machines[1].host_pid(start["pid"]), signal.SIGKILL)


def run(scenario: str, run_dir: Path, watch_s: float, delay_s: float, timeout_s: float, per_process: bool = False) -> dict:
    """One job with one fault; returns the measured times (seconds after the fault)."""
    config = TorchrunJobConfig(job_args=("--timeout-s", str(timeout_s)), per_process=per_process,
                               max_restarts=0 if per_process else 2)
    with Machines(3) as machines, TorchrunJob(machines, run_dir, config) as job:
        job.wait_for(lambda: job.max_step() >= 2, 300, "step 2")
        time.sleep(delay_s)
        fault_at = time.monotonic()
        if scenario == "kill1w":
            _kill_one_worker(machines, job)
        else:
            FAULTS[scenario](machines)
        exits: dict[int, tuple[float, int]] = {}
        deadline = fault_at + watch_s
        while time.monotonic() < deadline and len(exits) < len(job.agents):
            for i, agent in enumerate(job.agents):
                if i not in exits and agent.poll() is not None:
                    exits[i] = (time.monotonic() - fault_at, agent.returncode)
            time.sleep(0.2)
        steps = [r for rows in job.steps().values() for r in rows]
        detected = [e["at"] for e in job.events() if e["event"] == "fail_stop_detected"]
        after = [r for r in steps if r["monotonic"] > fault_at]
        starts = job.starts()
        first_step = min((r["monotonic"] for r in steps), default=None)
        return {
            "scenario": scenario + (" (agent per process)" if per_process else ""),
            "startup_s": None if first_step is None else first_step - job.started_at,
            "step_s": _median_step(steps),
            "detected_s": min(detected) - fault_at if detected else None,
            "first_step_after_s": min((r["monotonic"] for r in after), default=fault_at) - fault_at if after else None,
            "worlds_after": sorted({r["world"] for r in after}),
            "last_step": max((r["step"] for r in steps), default=None),
            "finished_s": max((r["monotonic"] for r in after), default=fault_at) - fault_at if after else None,
            "results": sorted(job.results()),
            "restarts": sorted({s["tag"].split("-")[0] for s in starts}),
            "exits": {f"agent{i}": (f"{exits[i][1]} at {exits[i][0]:.0f} s" if i in exits else "running")
                      for i in range(len(job.agents))},
        }


def _median_step(steps: list[dict]) -> float | None:
    rank0 = sorted((r for r in steps if r["world"] == 6), key=lambda r: (r["step"], r["monotonic"]))
    times = sorted({r["step"]: r["monotonic"] for r in rank0}.items())
    gaps = sorted(b[1] - a[1] for a, b in zip(times, times[1:]))
    return gaps[len(gaps) // 2] if gaps else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=["kill1", "cut0", "stop1"], choices=sorted(FAULTS))
    parser.add_argument("--watch-s", type=float, default=400.0, help="how long to watch after the fault")
    parser.add_argument("--delay-s", type=float, default=0.7, help="into step 3 when the fault strikes")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="the workers' collective timeout")
    parser.add_argument("--per-process", action="store_true",
                        help="one torchrun --standalone agent per process (ranks from the job's own store), --max-restarts 0")
    parser.add_argument("--keep", default=None, help="keep each run's directory (logs, records) under this directory")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"machines unavailable: {reason}")
    rows = []
    for scenario in args.scenarios:
        if args.keep:
            run_dir = Path(tempfile.mkdtemp(prefix=f"{scenario}-", dir=Path(args.keep).resolve()))
            row = run(scenario, run_dir, args.watch_s, args.delay_s, args.timeout_s, args.per_process)
        else:
            with tempfile.TemporaryDirectory(prefix=f"machines-{scenario}-") as tmp:
                row = run(scenario, Path(tmp), args.watch_s, args.delay_s, args.timeout_s, args.per_process)
        print(row, flush=True)
        rows.append(row)
    print("\n| fault | start-up s | step s | detected s | first step after s | world after | last step | finished s | results | agents |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        print(f"| {r['scenario']} | {fmt(r['startup_s'])} | {fmt(r['step_s'])} | {fmt(r['detected_s'])} | "
              f"{fmt(r['first_step_after_s'])} | {r['worlds_after']} | {r['last_step']} | {fmt(r['finished_s'])} | "
              f"{len(r['results'])} ({', '.join(r['restarts'])}) | {'; '.join(f'{k}: {v}' for k, v in r['exits'].items())} |")


if __name__ == "__main__":
    main()
