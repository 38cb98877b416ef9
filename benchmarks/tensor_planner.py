"""Planner benchmark for tensor-parallel degrees (issue 24): the search over TP groupings, and deep pipelines.

Not a test (CI does not run it). Two tables, each printed as markdown:

* ``--deep`` (plain :func:`resihp_lightning.solver.solve`, no TP): 32 devices, 80 layers of 700 MB
  static state and 50 MB per micro-batch, one device at half speed, M = 128, on 5-12 GB devices, so
  that a few layers fit per device and the pipeline is deep (P = 16-32); shared and per-replica
  partitions. Run it against another checkout (``PYTHONPATH=../other``) for a before / after.
* the default: :func:`resihp_lightning.solver.tensor_search.solve_tensor` on 64 / 256 / 1024 GPUs in
  TP-4 domains (LLaMA2-70B per GPU, 8K tokens) with 1-4 slow or dead GPUs, against ResiHP's rule and
  the best fixed degree (:mod:`resihp_lightning.solver.tensor_search`). ``solve s`` is wall time,
  ``cpu s`` the process's CPU time (what a shared, loaded machine distorts less), ``joint`` the
  questions to the joint proof. Rows run in one process in order, so later rows find the solver's
  memos (per layer list and M) warm; ``--only 256 --kinds slow --failures 3`` runs one row alone.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/tensor_planner.py [--only 256] [--kinds slow,dead,mixed] [--failures 1,2,3,4]
        [--shared] [--count-proof]
    OMP_NUM_THREADS=1 python benchmarks/tensor_planner.py --deep
"""

from __future__ import annotations

import argparse
import sys
import time

from resihp_lightning.config import PlannerConfig
from resihp_lightning.plan import Device, Layer, Problem


def deep_problem(memory_mb: float, shared: bool) -> Problem:
    """32 devices, one at half speed, 80 layers of 10 ms / 700 MB + 50 MB per micro-batch, M = 128."""
    speeds = [1.0] * 32
    speeds[3] = 0.5
    return Problem([Layer(10.0, 700.0, 50.0)] * 80, [Device(i, speeds[i], memory_mb) for i in range(32)], 128,
                   p2p_ms=0.05, allreduce_ms=5.0, shared_partition=shared)


def run_deep(config: PlannerConfig) -> list[dict[str, str]]:
    from resihp_lightning.solver import solve

    rows = []
    for memory in (5_000.0, 6_000.0, 8_000.0, 12_000.0):
        for shared in (True, False):
            problem = deep_problem(memory, shared)
            start = time.perf_counter()
            plan = solve(problem, config)
            seconds = time.perf_counter() - start
            rows.append({
                "memory GB": f"{memory / 1000:g}",
                "partition": "shared" if shared else "per-replica",
                "solve s": f"{seconds:.2f}",
                "status": plan.status,
                "gap": f"{100 * (plan.gap or 0.0):.2f}%",
                "P x D": f"{plan.pipeline_degree}x{plan.data_degree}",
                "T ms": f"{plan.iteration_ms:.1f}",
            })
    return rows


#: Speeds of the slow GPUs, in turn: ResiHP's strong, medium and weak slowdowns (2.0x, 1.5x, 1.2x).
SLOW_SPEEDS = (0.5, 0.67, 0.83, 0.5)


def tp_job(gpus: int, failures: int, kind: str, shared: bool = False, model: str = "llama2-70b"):
    """``gpus`` GPUs in TP-4 NVLink domains, ``failures`` of them slow or dead in different domains.

    LLaMA2-70B per GPU at 8K tokens (evaluation/profiles.py: one-GPU layers, the degrees its heads
    and vocabulary split into and their all-reduce fractions), A100s filled to 72 GB, M = 4 per
    healthy TP-4 group. ``kind``: ``slow`` (speeds from :data:`SLOW_SPEEDS`), ``dead``, or ``mixed``
    (slow and dead in turn).
    """
    from resihp_lightning.evaluation.profiles import WorkloadSpec, build_profile, tensor_cost
    from resihp_lightning.tensor_plan import TensorProblem

    workload = WorkloadSpec(seq_len=8192)
    profile = build_profile(model, workload)
    cost = tensor_cost(model, workload, max_degree=4)
    stride = gpus // 4 + 5  # one failure per domain, spread over the job
    chosen = [(k * stride + 1) % gpus for k in range(failures)]
    slow = {}
    dead = set()
    for k, gpu in enumerate(chosen):
        if kind == "dead" or (kind == "mixed" and k % 2):
            dead.add(gpu)
        else:
            slow[gpu] = SLOW_SPEEDS[k % len(SLOW_SPEEDS)]
    memory = profile.hardware.memory_gb * 1000.0
    devices = [Device(g, slow.get(g, 1.0), memory) for g in range(gpus) if g not in dead]
    problem = Problem(profile.layers, devices, 4 * gpus // 4, p2p_ms=profile.p2p_ms,
                      allreduce_ms=build_profile(model, WorkloadSpec(seq_len=8192, tp=4)).allreduce_ms,
                      shared_partition=shared, allow_exclude=True)
    return TensorProblem(problem, tuple(tuple(range(i, i + 4)) for i in range(0, gpus, 4)), cost)


def run_tp(gpus: int, failures: int, kind: str, shared: bool, config: PlannerConfig) -> dict[str, str]:
    from resihp_lightning.errors import InfeasibleError
    from resihp_lightning.solver.tensor_search import best_fixed_degree, resihp_rule, solve_tensor

    problem = tp_job(gpus, failures, kind, shared)
    start, cpu = time.perf_counter(), time.process_time()
    found = solve_tensor(problem, config)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    try:
        rule = resihp_rule(problem, 4, config).iteration_ms
    except InfeasibleError:
        rule = float("inf")
    fixed = best_fixed_degree(problem, config)
    degrees = sorted(found.degrees().values())
    used = ", ".join(f"{degrees.count(k)}x{k}" for k in sorted(set(degrees), reverse=True))
    return {
        "GPUs": str(gpus),
        "failures": f"{failures} {kind}",
        "partition": "shared" if shared else "per-replica",
        "groupings": str(found.search.combinations),
        "solved": str(found.search.solved),
        "relaxations": str(found.search.relaxations),
        "joint": str(found.search.joint_proofs),
        "solve s": f"{seconds:.2f}",
        "cpu s": f"{cpu:.2f}",
        "status": found.status,
        "gap": f"{100 * (found.gap or 0.0):.2f}%",
        "P x D": f"{found.plan.pipeline_degree}x{found.plan.data_degree}",
        "groups used": used,
        "T ms": f"{found.iteration_ms:.0f}",
        "rule / T": f"{rule / found.iteration_ms:.4f}",
        "best fixed / T": f"{fixed.iteration_ms / found.iteration_ms:.4f} (TP{fixed.groups[0].degree})",
    }


def markdown(rows: list[dict[str, str]]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r[h] for h in head) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deep", action="store_true", help="the 32-device deep-pipeline table (no TP)")
    parser.add_argument("--only", type=int, default=None, help="only this GPU count (64, 256 or 1024)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per search (default 10)")
    parser.add_argument("--kinds", default="slow,dead,mixed", help="failure kinds (default slow,dead,mixed)")
    parser.add_argument("--failures", default="1,2,3,4", help="failure counts (default 1,2,3,4)")
    parser.add_argument("--shared", action="store_true", help="one stage partition for every replica")
    parser.add_argument("--count-proof", action="store_true",
                        help="turn on the replica-count proof (tensor_search.COUNT_PROOF) for a comparison")
    args = parser.parse_args(argv)
    config = PlannerConfig(time_limit_s=args.time_limit)
    if args.count_proof:
        from resihp_lightning.solver import tensor_search

        tensor_search.COUNT_PROOF = True
    if args.deep:
        print(markdown(run_deep(config)))
        return 0
    rows = []
    for gpus in (64, 256, 1024):
        if args.only is not None and gpus != args.only:
            continue
        for kind in args.kinds.split(","):
            for failures in (int(f) for f in args.failures.split(",")):
                rows.append(run_tp(gpus, failures, kind, args.shared, config))
                print(" | ".join(rows[-1].values()), file=sys.stderr, flush=True)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
