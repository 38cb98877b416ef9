"""Planner benchmark: solve time per backend, proven gap, and E = T_ideal / T_plan per policy.

Not a test (CI does not run it). Scenarios: 8, 32, 256 and 1024 devices; 80-128 layers; 1 or 2 devices
at 0.5x, or 8 devices at 0.3-0.9x; shared and per-replica partitions. For each scenario:

* ``exact``: :func:`resihp_lightning.solver.exact.solve_exact` (the warm start), its time and status;
* ``cpsat`` / ``pulp-cbc``: the MILP with the exact plan as hint, its time, status and proven gap
  (``(T - bound) / T``; 0 = proven optimal);
* E for the policies ``none``, ``microbatch_only``, ``repartition_only`` (from
  :mod:`resihp_lightning.solver.policies`) and ``joint`` (the best of exact and CP-SAT, which is what
  :func:`resihp_lightning.solver.solve` returns).

Usage::

    python benchmarks/planner.py [--quick] [--time-limit 10] [--workers 2] [--no-cbc]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

from resihp_lightning.config import PlannerConfig
from resihp_lightning.plan import Device, Layer, Problem, efficiency, evaluate
from resihp_lightning.solver import policies
from resihp_lightning.solver.cpsat import solve_cpsat_detailed
from resihp_lightning.solver.exact import solve_exact
from resihp_lightning.plan import device_classes
from resihp_lightning.solver.milp_driver import MilpResult
from resihp_lightning.solver.pulp_backend import solve_pulp_detailed

SLOW_PATTERNS = {
    "1x0.5": [0.5],
    "2x0.5": [0.5, 0.5],
    "8x0.3-0.9": [0.3, 0.5, 0.7, 0.9, 0.3, 0.5, 0.7, 0.9],
}


@dataclass(frozen=True)
class Scenario:
    devices: int
    layers: int
    slow: str
    shared: bool

    @property
    def micro_batches(self) -> int:
        """M = 8 N: 32 micro-batches per replica at P = 4, as large-batch training runs."""
        return 8 * self.devices

    @property
    def degrees(self) -> tuple[int, ...]:
        return (2, 4, 8) if self.devices == 8 else (4, 8, 16)


def make_problem(s: Scenario) -> Problem:
    """A decoder-only model: heavier embedding and LM head, 80 GB devices, slow ones spread out."""
    layers = [Layer(2.0 if i == 0 else 2.5 if i == s.layers - 1 else 1.0, 500.0, 60.0) for i in range(s.layers)]
    speeds = [1.0] * s.devices
    slow = SLOW_PATTERNS[s.slow]
    stride = max(1, s.devices // len(slow))
    for k, speed in enumerate(slow):
        speeds[(k * stride + 1) % s.devices] = speed
    devices = [Device(i, speeds[i], 80_000.0) for i in range(s.devices)]
    return Problem(layers, devices, s.micro_batches, p2p_ms=0.05, allreduce_ms=5.0,
                   pipeline_degrees=s.degrees, shared_partition=s.shared)


def scenarios(quick: bool) -> list[Scenario]:
    sizes = [(8, 80), (32, 96)] if quick else [(8, 80), (32, 96), (256, 96), (1024, 128)]
    return [
        Scenario(n, layers, slow, shared)
        for n, layers in sizes
        for slow in SLOW_PATTERNS
        for shared in (True, False)
    ]


def _milp_cell(result: MilpResult | None, seconds: float) -> str:
    if result is None:
        return "-"
    mark = "opt" if result.plan.status == "optimal" else f"gap {100 * result.gap:.2f}%"
    return f"{seconds:.2f} ({mark})"


def run(s: Scenario, config: PlannerConfig, cbc: bool) -> dict[str, str]:
    problem = make_problem(s)
    t0 = time.perf_counter()
    exact_plan = solve_exact(problem)
    exact_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    cp = solve_cpsat_detailed(problem, config, exact_plan)
    cp_s = time.perf_counter() - t0

    cbc_result, cbc_s = None, 0.0
    if cbc:
        t0 = time.perf_counter()
        cbc_result = solve_pulp_detailed(problem, PlannerConfig(solver="pulp", time_limit_s=config.time_limit_s,
                                                                num_workers=config.num_workers), exact_plan)
        cbc_s = time.perf_counter() - t0

    joint = min((cp.plan, exact_plan), key=lambda p: evaluate(problem, p).iteration_ms)
    healthy = policies.healthy_plan(problem, config)
    e = {
        "none": efficiency(problem, healthy, policies.none(problem, healthy, config)),
        "microbatch_only": efficiency(problem, healthy, policies.microbatch_only(problem, healthy, config)),
        "repartition_only": efficiency(problem, healthy, policies.repartition_only(problem, healthy, config)),
        "joint": efficiency(problem, healthy, joint),
    }
    t_exact = evaluate(problem, exact_plan).iteration_ms
    t_cp = evaluate(problem, cp.plan).iteration_ms
    best_baseline = max(e["microbatch_only"], e["repartition_only"])
    beats = "yes" if e["joint"] > best_baseline + 1e-9 else "tie" if e["joint"] >= best_baseline - 1e-9 else "NO"
    return {
        "N": str(s.devices),
        "L": str(s.layers),
        "slow": s.slow,
        "partition": "shared" if s.shared else "per-replica",
        "classes": str(len(device_classes(problem))),
        "exact s": f"{exact_s:.2f} ({'opt' if exact_plan.status == 'optimal' else exact_plan.status})",
        "cpsat s": _milp_cell(cp, cp_s),
        "pulp-cbc s": _milp_cell(cbc_result, cbc_s) if cbc else "-",
        "cpsat<=exact": "yes" if t_cp <= t_exact * (1 + 1e-12) else "NO",
        "P x D": f"{joint.pipeline_degree}x{joint.data_degree}",
        "E none": f"{e['none']:.3f}",
        "E mb-only": f"{e['microbatch_only']:.3f}",
        "E repart-only": f"{e['repartition_only']:.3f}",
        "E joint": f"{e['joint']:.3f}",
        "joint beats both": beats,
    }


def markdown(rows: list[dict[str, str]]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r[h] for h in head) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only 8 and 32 devices")
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per MILP solve (default 10)")
    parser.add_argument("--workers", type=int, default=2, help="CP-SAT workers (default 2)")
    parser.add_argument("--no-cbc", action="store_true", help="skip the PuLP+CBC backend")
    parser.add_argument("--only", type=int, default=None, help="only scenarios with this many devices")
    args = parser.parse_args(argv)
    config = PlannerConfig(time_limit_s=args.time_limit, num_workers=args.workers)
    print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)", file=sys.stderr)
    rows = []
    for s in scenarios(args.quick):
        if args.only is not None and s.devices != args.only:
            continue
        rows.append(run(s, config, not args.no_cbc))
        print(" | ".join(rows[-1].values()), file=sys.stderr, flush=True)
    print(markdown(rows))
    print(f"load average after: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
