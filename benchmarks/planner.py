"""Planner benchmark: solve time per backend, proven gap, and E = T_ideal / T_plan per policy.

Not a test (CI does not run it). Scenarios: 8, 32, 256 and 1024 devices; 80-128 layers; 1 or 2 devices
at 0.5x, or 8 devices at 0.3-0.9x; shared and per-replica partitions. For each scenario:

* ``exact``: :func:`resihp_lightning.solver.exact.solve_exact` (the warm start), its time and status;
* ``cpsat`` / ``pulp-cbc``: the MILP with the exact plan as hint, its time, status and proven gap
  (``(T - bound) / T``; 0 = proven optimal);
* E for the policies ``none``, ``microbatch_only``, ``repartition_only`` (from
  :mod:`resihp_lightning.solver.baseline_policies`) and ``joint`` (the best of exact and CP-SAT, which is what
  :func:`resihp_lightning.solver.solve` returns).

Usage::

    python benchmarks/planner.py [--quick] [--time-limit 10] [--workers 2] [--no-cbc]

``--scale`` runs the other table instead: what :func:`resihp_lightning.solver.solve` (the default
config: the exact phase with its decomposition by shape, then CP-SAT only when a shape is left open)
takes when memory binds (96 layers of 700 MB static state on 24 GB devices), at 32, 256 and 1024
devices, with two slow devices, eight in four speeds (five classes), or detector-like continuous
speeds (every device near 1.0 with noise, a few slow ones), quantized as the controller does
(``speed_quantum`` 0.05) or left raw (one class per distinct speed; 32 devices only)::

    python benchmarks/planner.py --scale [--only 256] [--time-limit 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

from resihp_lightning.config import PlannerConfig
from resihp_lightning.plan import Device, Layer, Problem, efficiency, evaluate
from resihp_lightning.solver import baseline_policies
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
    healthy = baseline_policies.healthy_plan(problem, config)
    e = {
        "none": efficiency(problem, healthy, baseline_policies.none(problem, healthy, config)),
        "microbatch_only": efficiency(problem, healthy, baseline_policies.microbatch_only(problem, healthy, config)),
        "repartition_only": efficiency(problem, healthy, baseline_policies.repartition_only(problem, healthy, config)),
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


@dataclass(frozen=True)
class ScaleScenario:
    devices: int
    speeds: str  # "2x0.5", "8x0.3-0.9", "detector" (quantized) or "detector-raw"
    shared: bool


def detector_speeds(n: int, seed: int) -> list[float]:
    """Speed estimates as the detector reports them: 1.0 with 1% noise (capped at 1.0), plus one slow
    device per 128 (at least two) at 0.3-0.9."""
    import random

    rng = random.Random(seed)
    speeds = [min(1.0, rng.gauss(1.0, 0.01)) for _ in range(n)]
    for i in rng.sample(range(n), max(2, n // 128)):
        speeds[i] = rng.uniform(0.3, 0.9)
    return speeds


def scale_problem(s: ScaleScenario) -> Problem:
    """The scenario of issue 14: 96 layers, 10 ms, 700 MB static + 50 MB per micro-batch, 24 GB devices
    (P >= 4; stage 0 of P = 4 cannot take 27 layers), M = 4 N, p2p 0.05 ms, all-reduce 5 ms."""
    n = s.devices
    if s.speeds.startswith("detector"):
        speeds = detector_speeds(n, seed=n)
        if s.speeds == "detector":
            from resihp_lightning.callbacks.replan.replan_policy import quantize_speeds

            speeds = [quantize_speeds({0: v}, 0.05)[0] for v in speeds]
    else:
        speeds = [1.0] * n
        slow = SLOW_PATTERNS[s.speeds]
        for k, speed in enumerate(slow):
            speeds[(k * max(1, n // len(slow)) + 3) % n] = speed
    devices = [Device(i, speeds[i], 24_000.0) for i in range(n)]
    layers = [Layer(10.0, 700.0, 50.0)] * 96
    return Problem(layers, devices, 4 * n, p2p_ms=0.05, allreduce_ms=5.0, shared_partition=s.shared)


def scale_scenarios(only: int | None) -> list[ScaleScenario]:
    out = []
    for n in (32, 256, 1024):
        if only is not None and n != only:
            continue
        for speeds in ("2x0.5", "8x0.3-0.9", "detector", "detector-raw"):
            if speeds == "detector-raw" and n > 32:
                continue  # a class per distinct speed: the MILP alone, whose model building dominates
            for shared in (True, False):
                out.append(ScaleScenario(n, speeds, shared))
    return out


def run_scale(s: ScaleScenario, config: PlannerConfig) -> dict[str, str]:
    from resihp_lightning.solver import solve

    problem = scale_problem(s)
    t0 = time.perf_counter()
    plan = solve(problem, config)
    seconds = time.perf_counter() - t0
    return {
        "N": str(s.devices),
        "speeds": s.speeds,
        "partition": "shared" if s.shared else "per-replica",
        "classes": str(len(device_classes(problem))),
        "solve s": f"{seconds:.2f}",
        "status": plan.status,
        "gap": f"{100 * (plan.gap or 0.0):.2f}%",
        "P x D": f"{plan.pipeline_degree}x{plan.data_degree}",
        "T ms": f"{plan.iteration_ms:.1f}",
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
    parser.add_argument("--scale", action="store_true", help="binding memory and detector-like speeds at 32-1024 devices")
    args = parser.parse_args(argv)
    config = PlannerConfig(time_limit_s=args.time_limit, num_workers=args.workers)
    print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)", file=sys.stderr)
    rows = []
    if args.scale:
        for s in scale_scenarios(args.only):
            rows.append(run_scale(s, config))
            print(" | ".join(rows[-1].values()), file=sys.stderr, flush=True)
        print(markdown(rows))
        print(f"load average after: {os.getloadavg()[0]:.2f}", file=sys.stderr)
        return 0
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
