"""The ``resihp`` command line: ``resihp plan``, ``resihp simulate``, ``resihp report``, ``resihp trace``.

Sub-commands import their heavy dependencies lazily so that ``resihp --help`` answers at once.
Errors the user can fix exit with status 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from resihp_lightning.__about__ import __version__
from resihp_lightning.errors import ResiHPError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resihp",
        description="Resilient hybrid-parallel training: plan layouts, simulate them, report runs.",
    )
    parser.add_argument("--version", action="version", version=f"resihp-lightning {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_plan(commands)
    _add_simulate(commands)
    _add_report(commands)
    _add_trace(commands)
    return parser


def _add_plan(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan",
        help="compute the best layout for a planning problem (JSON)",
        description="Reads a Problem (docs/architecture.md, 'The planning model') and prints the best Plan.",
    )
    plan.add_argument("problem", metavar="PROBLEM.json", help="the planning problem")
    plan.add_argument("--solver", choices=("cpsat", "pulp", "exact"), default="cpsat", help="planner backend (default: cpsat)")
    plan.add_argument("--time-limit", type=float, default=10.0, metavar="S", help="solver time limit in seconds (default: 10)")
    plan.add_argument("--workers", type=int, default=2, metavar="N", help="CP-SAT search workers (default: 2)")
    plan.add_argument("--seed", type=int, default=0, metavar="N", help="solver random seed (default: 0)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON only")
    plan.set_defaults(handler=_run_plan)


def _add_simulate(commands: argparse._SubParsersAction) -> None:
    sim = commands.add_parser(
        "simulate",
        help="replay a plan with the 1F1B event simulator and compare with the formula",
        description="Prints the formula's and the 1F1B simulator's iteration time for a plan.",
    )
    sim.add_argument("problem", metavar="PROBLEM.json", help="the planning problem")
    sim.add_argument("plan", metavar="PLAN.json", help="a plan, as printed by `resihp plan --json`")
    sim.add_argument(
        "--forward-fraction", type=float, default=1.0 / 3.0, metavar="F", help="share of compute in the forward pass (default: 1/3)"
    )
    sim.add_argument("--json", action="store_true", help="print the comparison as JSON")
    sim.set_defaults(handler=_run_simulate)


def _add_report(commands: argparse._SubParsersAction) -> None:
    report = commands.add_parser(
        "report",
        help="redraw a training run's throughput table and timeline PNG from its logs",
        description="Reads RUN_DIR/steps.jsonl and RUN_DIR/events.jsonl (written by examples/finetune.py), prints "
        "tokens/s healthy / slowed / after the re-plan / ideal, detection latency and migration time, and writes "
        "RUN_DIR/report.txt and the timeline PNG.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    report.add_argument("--png", metavar="PATH", default=None, help="where to write the PNG (default RUN_DIR/timeline.png)")
    report.set_defaults(handler=_run_report)


def _add_trace(commands: argparse._SubParsersAction) -> None:
    trace = commands.add_parser(
        "trace",
        help="replay a failure trace under resilience policies (docs/evaluation.md)",
        description="Replays a cluster's failure trace (JSON or YAML, docs/evaluation.md) under resilience policies "
        "and prints each one's effective tokens/s; or draws a trace from published statistics.",
    )
    actions = trace.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    run = actions.add_parser("run", help="replay a trace file", description="Replays TRACE under each policy.")
    run.add_argument("trace", metavar="TRACE", help="the trace file (.json, .yaml or .yml)")
    run.add_argument("--model", default="llama2-7b", metavar="NAME",
                     help="llama2-7b, llama2-13b, llama2-70b, qwen2.5-7b or qwen2.5-72b (default: llama2-7b)")
    run.add_argument("--seq-len", type=int, default=16384, metavar="TOKENS", help="tokens per micro-batch (default: 16384)")
    run.add_argument("--tp", type=int, default=1, metavar="N", help="GPUs per TP group, one planner device (default: 1)")
    run.add_argument("--micro-batches-per-device", type=int, default=4, metavar="N", help="M / devices (default: 4)")
    run.add_argument("--utilisation", type=float, default=0.43, metavar="U", help="fraction of A100 bf16 peak (default: 0.43)")
    run.add_argument("--policies", default=None, metavar="A,B", help="comma-separated policies (default: all)")
    run.add_argument("--json", action="store_true", help="print the results as JSON")
    run.set_defaults(handler=_run_trace)
    gen = actions.add_parser("generate", help="draw a trace from published statistics",
                             description="Writes a seeded trace of SCENARIO (docs/evaluation.md, 'Traces').")
    gen.add_argument("scenario", metavar="SCENARIO", help="fail-slow, fail-stop, comm-slow or mixed")
    gen.add_argument("--gpus", type=int, default=256, metavar="N", help="GPUs (default: 256)")
    gen.add_argument("--hours", type=float, default=8.0, metavar="H", help="trace length (default: 8)")
    gen.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default: 0)")
    gen.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the trace (JSON)")
    gen.set_defaults(handler=_run_trace_generate)


def _run_trace(args: argparse.Namespace) -> int:
    import json

    from resihp_lightning.errors import invalid_option
    from resihp_lightning.evaluation import HardwareSpec, Trace, WorkloadSpec, build_profile
    from resihp_lightning.evaluation.trace_policies import POLICY_NAMES
    from resihp_lightning.evaluation.cluster import Cluster
    from resihp_lightning.evaluation.run import healthy_tokens_per_s, run_trace

    trace = Trace.load(args.trace)
    names = POLICY_NAMES if args.policies is None else tuple(p.strip() for p in args.policies.split(",") if p.strip())
    for name in names:
        if name not in POLICY_NAMES:
            raise invalid_option("--policies", name, POLICY_NAMES)
    workload = WorkloadSpec(seq_len=args.seq_len, tp=args.tp, micro_batches_per_device=args.micro_batches_per_device)
    profile = build_profile(args.model, workload, HardwareSpec(utilisation=args.utilisation))
    cluster = Cluster(trace, profile)  # one solve cache for the policies and the healthy ceiling
    results = run_trace(trace, profile, names, cluster=cluster)
    healthy = healthy_tokens_per_s(trace, profile, cluster=cluster)
    if args.json:
        print(json.dumps({"trace": trace.name, "gpus": trace.gpus, "duration_s": trace.duration_s,
                          "healthy_tokens_per_s": healthy, "policies": {
                              n: {"tokens_per_s": r.tokens_per_s, "tokens": r.tokens, "lost_tokens": r.lost_tokens,
                                  "paused_s": r.paused_s, "phases": r.counts} for n, r in results.items()}}, indent=2))
        return 0
    print(f"{trace.name or args.trace}: {trace.gpus} GPUs, {trace.duration_s / 3600:.2f} h, {len(trace.events)} events; "
          f"{profile.model.name} at {args.seq_len} tokens, TP {args.tp}; healthy {healthy:,.0f} tokens/s")
    header = f"{'policy':<18} {'tokens/s':>12} {'of healthy':>10} {'paused s':>9} {'lost Mtok':>10}"
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(f"{name:<18} {r.tokens_per_s:>12,.0f} {r.tokens_per_s / healthy:>10.3f} {r.paused_s:>9.0f} {r.lost_tokens / 1e6:>10.1f}")
    return 0


def _run_trace_generate(args: argparse.Namespace) -> int:
    from resihp_lightning.evaluation import TraceConfig, generate

    trace = generate(args.scenario, TraceConfig(gpus=args.gpus, hours=args.hours), seed=args.seed)
    trace.save(args.output)
    print(f"wrote {args.output}: {len(trace.events)} events over {args.hours:g} h on {args.gpus} GPUs")
    return 0


def _run_report(args: argparse.Namespace) -> int:
    from resihp_lightning.report import render

    text, png = render(args.run_dir, png=args.png)
    print(text)
    print(f"timeline: {png}")
    return 0


def _run_plan(args: argparse.Namespace) -> int:

    from resihp_lightning.config import PlannerConfig
    from resihp_lightning.plan import Problem, evaluate, ideal_ms
    from resihp_lightning.solver import solve
    from resihp_lightning.solver.baseline_policies import healthy_plan

    problem = Problem.load(args.problem)
    config = PlannerConfig(
        solver=args.solver, time_limit_s=args.time_limit, num_workers=args.workers, random_seed=args.seed
    )
    plan = solve(problem, config)
    if args.json:
        print(_plan_json(plan.to_dict()))
        return 0
    problem = config.apply_to(problem)
    healthy = healthy_plan(problem, config)
    healthy_ms = evaluate(problem.healthy(), healthy).iteration_ms
    ideal = ideal_ms(problem, healthy)
    ev = evaluate(problem, plan)
    # A link column only when some device's link is not at the default (the table stays as it was).
    links = any(d.link_speed != 1.0 for d in problem.devices)
    print(f"plan: P={plan.pipeline_degree} stages x D={plan.data_degree} replicas on {len(plan.device_ids)} of {problem.num_devices} devices")
    link_header = f"{'link':>6} " if links else ""
    header = f"{'replica':>7} {'stage':>5} {'device':>6} {'speed':>6} {link_header}{'layers':>9} {'stage ms':>10} {'mem MB':>10}"
    print(header)
    print("-" * len(header))
    for r, replica in enumerate(plan.replicas):
        for j, device_id in enumerate(replica.devices):
            lo, hi = replica.bounds[j], replica.bounds[j + 1]
            layers = f"{lo}-{hi - 1}" if hi - lo > 1 else f"{lo}"
            device = problem.device(device_id)
            link = f"{device.link_speed:>6.2f} " if links else ""
            print(
                f"{r if j == 0 else '':>7} {j:>5} {device_id:>6} {device.speed:>6.2f} {link}{layers:>9} "
                f"{ev.stage_ms[r][j]:>10.3f} {ev.memory_mb[r][j]:>10.1f}"
            )
        print(f"{'':>7} micro-batches {replica.micro_batches}, replica time {ev.replica_ms[r]:.3f} ms")
    excluded = sorted(set(d.id for d in problem.devices) - set(plan.device_ids))
    if excluded:
        print(f"left out: devices {excluded}")
    print(f"predicted iteration time: {plan.iteration_ms:.3f} ms  ({plan.status}, {plan.solver}, {plan.solve_seconds:.3f} s)")
    print(f"healthy time:             {healthy_ms:.3f} ms  (all devices{' and links' if links else ''} at speed 1.0)")
    print(f"ideal time:               {ideal:.3f} ms  (healthy scaled by N/S = {problem.num_devices}/{problem.total_speed:g})")
    print(f"efficiency E = T_ideal / T_plan = {ideal / plan.iteration_ms:.4f}")
    return 0


def _plan_json(data: dict) -> str:
    """The plan as JSON, one line per replica (readable for a thousand devices too)."""
    import json

    lines = ["{"]
    for key, value in data.items():
        if key == "replicas":
            rows = ",\n".join(f"    {json.dumps(r)}" for r in value)
            lines.append(f'  "replicas": [\n{rows}\n  ],')
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)},")
    lines[-1] = lines[-1].rstrip(",")
    lines.append("}")
    return "\n".join(lines)


def _run_simulate(args: argparse.Namespace) -> int:
    import json

    from resihp_lightning.errors import PlanError
    from resihp_lightning.plan import Plan, Problem, evaluate
    from resihp_lightning.solver.simulator import simulate

    problem = Problem.load(args.problem)
    try:
        with open(args.plan) as handle:
            text = handle.read()
    except OSError as err:
        raise PlanError(f"cannot read plan file {args.plan!r}: {err.strerror}") from None
    plan = Plan.from_json(text)
    ev = evaluate(problem, plan)
    sim = simulate(problem, plan, forward_fraction=args.forward_fraction)
    if args.json:
        print(json.dumps({
            "formula_ms": ev.iteration_ms,
            "simulated_ms": sim.makespan_ms,
            "replicas": [
                {"formula_ms": f, "simulated_ms": s, "busy_ms": list(b), "idle_ms": list(i)}
                for f, s, b, i in zip(ev.replica_ms, sim.replica_ms, sim.busy_ms, sim.idle_ms)
            ],
        }, indent=2))
        return 0
    print(f"{'replica':>7} {'formula ms':>11} {'simulated ms':>13} {'ratio':>7}")
    for r, (f, s) in enumerate(zip(ev.replica_ms, sim.replica_ms)):
        print(f"{r:>7} {f:>11.3f} {s:>13.3f} {s / f if f else 1.0:>7.4f}")
    print(f"iteration (with all-reduce): formula {ev.iteration_ms:.3f} ms, simulated {sim.makespan_ms:.3f} ms")
    if ev.over_memory:
        r, j, device_id, used, cap = ev.over_memory[0]
        print(f"warning: device {device_id} (replica {r}, stage {j}) needs {used:.1f} MB but has {cap:.1f} MB")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``resihp`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.handler(args)
    except ResiHPError as err:
        print(f"resihp {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
