"""Fault -> first step after the in-process recovery, under one ``torchrun --standalone`` agent per process.

On :class:`~resihp_lightning.testing.machines.Machines` (3 namespace machines x 2 processes, 2 stages x 3
replicas, or ``--machines``, the exactness job ``resihp_lightning/testing/machines_job.py``, each step ~1.6 s), launched as
``examples/torchrun_per_process.sh`` launches it (:class:`~resihp_lightning.testing.torchrun_machines.TorchrunJob`
with ``per_process``), one fault ``--delay-s`` into step 3:

* ``process``: one worker of machine 1 SIGKILLed (its agent and the machine's other worker live);
* ``machine``: every process of machine 1 SIGKILLed;
* ``machine0``: machine 0's link cut, the store on an etcd cluster of one member per machine
  (:class:`~resihp_lightning.testing.machines_etcd.MachinesEtcd`, the recipe's ``ETCD_MEMBERS``). With the
  TCP store host on machine 0 this fault is a split brain (``docs/machines.md``), so it always runs on etcd.
* ``replace``: every process of machine 1 SIGKILLed, and at once a replacement started on it as
  ``JOIN=1 examples/torchrun_per_process.sh`` starts one (:meth:`~resihp_lightning.testing.torchrun_machines.TorchrunJob.join`:
  two newcomers with ``RESIHP_JOIN=1``); the job trains ``--replace-steps`` steps in all, so that the
  newcomers' start-up ends before it does. Measured besides: ``found job`` (the newcomers' strategy
  claimed its rank from the job's store: its start-up), ``admitted`` (a newcomer's first step, mirrored as
  a hot spare) and ``newcomer computed`` (a newcomer's first step as a member of the plan), the last of
  the two newcomers each time. On 3 machines the survivors' 2 x 2 plan is as fast as one with the
  newcomers (M = 4 micro-batches do not split over 3 replicas), so the newcomers stay hot spares; with
  ``--machines 2`` machine 0's two processes go on as 1 x 2 and the next plan takes the newcomers in (2 x 2).

``--store etcd`` puts ``process`` and ``machine`` on the etcd members too (default: the TCP store host on
machine 0, ``store_port``).

``--launcher srun`` runs the same job as ``examples/slurm_in_process.sbatch`` starts it instead, the recipe
itself with srun emulated (:class:`~resihp_lightning.testing.slurm_machines.SbatchJob`: ``sbatch --nodes 3
--ntasks-per-node 2``, ``SCRIPT`` the exactness job, ``ETCD_NODES=3`` for the etcd store); there the
"agents" are the batch script alone, and ``cut off ended`` is when machine 0's tasks exited. Times are seconds after the fault on the host's one monotonic clock:
``detected`` (the survivors' first verdict), ``first step`` (the first step finished after the fault: the
step the survivors redid), ``done`` (the last step), ``all ended`` (every agent's exit; for ``machine0``
also ``cut off ended``, when machine 0's agents exited, the link still down). Each fault runs ``--runs``
times; the table gives median, min and max. Needs root (namespaces).

Run: ``python benchmarks/machines_recovery.py [--runs 3] [--scenarios process machine machine0 replace] [--store tcp]
[--launcher torchrun|srun]`` (``replace`` under torchrun only).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resihp_lightning.testing.machines import Machines, unavailable_reason  # noqa: E402
from resihp_lightning.testing.machines_etcd import MachinesEtcd  # noqa: E402
from resihp_lightning.testing.slurm_machines import SbatchJob  # noqa: E402
from resihp_lightning.testing.torchrun_machines import TorchrunJob, TorchrunJobConfig  # noqa: E402

SCENARIOS = ("process", "machine", "machine0", "replace")
MEASURES = ("detected_s", "first_step_s", "done_s", "cut_off_ended_s", "all_ended_s")
JOIN_MEASURES = ("found_job_s", "admitted_s", "newcomer_computed_s")


def _kill_one_worker(machines: Machines, job: TorchrunJob) -> None:
    start = next(s for s in job.starts() if s["host"] == machines[1].hostname and s["local_rank"] == 0)
    os.kill(machines[1].host_pid(start["pid"]), signal.SIGKILL)


def _sbatch(machines: Machines, run_dir: Path, etcd: bool, args: argparse.Namespace) -> SbatchJob:
    """``[ETCD_NODES=3] sbatch --nodes 3 --ntasks-per-node 2 examples/slurm_in_process.sbatch`` with the exactness job."""
    env = {"SCRIPT": "resihp_lightning/testing/machines_job.py", "RUN_DIR": str(run_dir), **({"ETCD_NODES": "3"} if etcd else {})}
    argv = ["--nodes", "3", "--ntasks-per-node", "2", "examples/slurm_in_process.sbatch", "--steps", "6", "--step-s", "2.0",
            "--detect-timeout-s", str(args.detect_timeout_s), "--join-timeout-s", str(args.join_timeout_s)]
    return SbatchJob(machines, run_dir, argv, env=env)


def run(scenario: str, run_dir: Path, args: argparse.Namespace) -> dict:
    """One job with one fault; the measured times (seconds after the fault)."""
    etcd = scenario == "machine0" or args.store == "etcd"
    with ExitStack() as stack:
        machines = stack.enter_context(Machines(args.machines))
        if args.launcher == "srun":
            job = stack.enter_context(_sbatch(machines, run_dir, etcd, args))
        else:
            store = stack.enter_context(MachinesEtcd(machines, run_dir)).store_options() if etcd else None
            config = TorchrunJobConfig(per_process=True, max_restarts=0, detect_timeout_s=args.detect_timeout_s,
                                       join_timeout_s=args.join_timeout_s, store=store,
                                       steps=args.replace_steps if scenario == "replace" else 6)
            job = stack.enter_context(TorchrunJob(machines, run_dir, config))
        job.wait_for(lambda: job.max_step() >= 2, 300, "step 2")
        time.sleep(args.delay_s)
        fault_at, fault_wall = time.monotonic(), time.time()
        if scenario == "process":
            _kill_one_worker(machines, job)
        elif scenario in ("machine", "replace"):
            machines[1].kill()
            if scenario == "replace":
                job.join(1)
        else:
            machines[0].cut_link()
        ended: dict[int, float] = {}
        deadline = fault_at + args.watch_s
        while time.monotonic() < deadline and len(ended) < len(job.agents):
            for i, agent in enumerate(job.agents):
                if i not in ended and agent.poll() is not None:
                    ended[i] = time.monotonic() - fault_at
            time.sleep(0.1)
        steps = [r for rows in job.steps().values() for r in rows]
        after = [r["monotonic"] - fault_at for r in steps if r["monotonic"] > fault_at]
        detected = [e["at"] - fault_at for e in job.events() if e["event"] == "fail_stop_detected" and "at" in e]
        cut_off = [ended.get(i) for i in (0, 1)] if scenario == "machine0" else []
        if scenario == "machine0" and isinstance(job, SbatchJob):  # machine 0's tasks, not its (one) batch script
            step = job.step_of("machines_job.py")
            exits = job.task_exits(step) if step is not None else {}
            cut_off = [exits[t]["time"] - fault_wall if t in exits else None for t in (0, 1)]
        joined = {s["tag"]: s["monotonic"] - fault_at for s in job.starts() if s.get("joined")}
        newcomer_rows = {tag: job.steps().get(tag, []) for tag in joined}

        def last_newcomer(times: list[float | None]) -> float | None:
            return max(times) if len(times) == 2 and None not in times else None

        join_times = {
            "found_job_s": last_newcomer(list(joined.values())),
            "admitted_s": last_newcomer([rows[0]["monotonic"] - fault_at if rows else None
                                         for rows in newcomer_rows.values()]),
            "newcomer_computed_s": last_newcomer([min((r["monotonic"] - fault_at for r in rows if not r["spare"]),
                                                      default=None) for rows in newcomer_rows.values()]),
        } if scenario == "replace" else {}
        return {
            **join_times,
            "scenario": scenario, "store": "etcd" if etcd else "tcp", "launcher": args.launcher,
            "detected_s": min(detected, default=None),
            "first_step_s": min(after, default=None),
            "done_s": max(after, default=None),
            "cut_off_ended_s": max(cut_off) if cut_off and None not in cut_off else None,
            "all_ended_s": max(ended.values()) if len(ended) == len(job.agents) else None,
            "results": len(job.results()),
            "worlds_after": sorted({r["world"] for r in steps if r["monotonic"] > fault_at}),
        }


def _summary(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    missing = f" ({len(values) - len(got)} none)" if len(got) < len(values) else ""
    return f"{statistics.median(got):.2f} ({min(got):.2f}-{max(got):.2f}){missing}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--runs", type=int, default=3, help="repetitions of each fault")
    parser.add_argument("--store", choices=("tcp", "etcd"), default="tcp", help="the store of `process` and `machine`")
    parser.add_argument("--launcher", choices=("torchrun", "srun"), default="torchrun",
                        help="one torchrun --standalone agent per process, or examples/slurm_in_process.sbatch (srun emulated)")
    parser.add_argument("--detect-timeout-s", type=float, default=3.0,
                        help="fail_stop.detect_timeout_s (the tests' 3 s: the default 1 s evicts healthy ranks at "
                             "start-up on this shared 2-core host now and then)")
    parser.add_argument("--join-timeout-s", type=float, default=30.0, help="fail_stop.join_timeout_s (the default)")
    parser.add_argument("--delay-s", type=float, default=0.7, help="into step 3 when the fault strikes")
    parser.add_argument("--watch-s", type=float, default=150.0, help="how long to wait for every agent to end")
    parser.add_argument("--machines", type=int, default=3,
                        help="machines of 2 processes each (2 for `replace` to end on a plan that needs the newcomers)")
    parser.add_argument("--replace-steps", type=int, default=120,
                        help="training steps of `replace` (the newcomers' start-up must end before the job does)")
    parser.add_argument("--keep", default=None, help="keep each run's directory under this directory")
    args = parser.parse_args()
    if args.machines < 2 or (args.machines < 3 and (args.store == "etcd" or "machine0" in args.scenarios)):
        parser.error("--machines: at least 2, and 3 with an etcd store (its quorum must survive a lost machine)")
    if args.launcher == "srun" and ("replace" in args.scenarios or args.machines != 3):
        parser.error("--launcher srun: the scenarios process, machine and machine0 on 3 machines (no replacement under srun yet)")
    reason = unavailable_reason()
    if reason:
        sys.exit(f"machines unavailable: {reason}")
    rows = []
    for scenario in args.scenarios:
        for _ in range(args.runs):
            if args.keep:
                row = run(scenario, Path(tempfile.mkdtemp(prefix=f"{scenario}-", dir=Path(args.keep).resolve())), args)
            else:
                with tempfile.TemporaryDirectory(prefix=f"recovery-{scenario}-") as tmp:
                    row = run(scenario, Path(tmp), args)
            print(row, flush=True)
            rows.append(row)
    print("\nseconds after the fault, median (min-max) of", args.runs, "runs, under", args.launcher)
    print("| fault | store | detected | first step after | training done | cut-off machine's agents ended | every agent ended |")
    print("|---|---|---|---|---|---|---|")
    for scenario in args.scenarios:
        mine = [r for r in rows if r["scenario"] == scenario]
        cells = [_summary([r[m] for r in mine]) for m in MEASURES]
        print(f"| {scenario} | {mine[0]['store']} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {cells[4]} |")
    joins = [r for r in rows if r["scenario"] == "replace"]
    if joins:
        print("\nthe replacement (machine 1 killed, two newcomers started on it at once): seconds after the kill")
        print("| store | found the job | admitted (first step as a spare) | first step computed as a member |")
        print("|---|---|---|---|")
        cells = [_summary([r[m] for r in joins]) for m in JOIN_MEASURES]
        print(f"| {joins[0]['store']} | {cells[0]} | {cells[1]} | {cells[2]} |")


if __name__ == "__main__":
    main()
