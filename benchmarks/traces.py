"""Failure traces at 32-1024 GPUs replayed under every policy: the paper's comparisons (issue 15).

    OMP_NUM_THREADS=1 python benchmarks/traces.py [--scales 32,256,1024] [--hours 8] [--seed 0] [--png PATH]

Prints markdown tables (effective tokens/s per policy, scenario and scale; ours vs each baseline beside
the paper's figures; vs the oracle; a model table at 256 GPUs) and writes the throughput-over-time
PNG of the mixed trace at 256 GPUs (skipped with a note when matplotlib is missing). Deterministic:
the traces are seeded and the planner runs its exact search under a work budget.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from resihp_lightning.evaluation import SCENARIOS, TraceConfig, WorkloadSpec, build_profile, generate
from resihp_lightning.evaluation.cluster import Cluster
from resihp_lightning.evaluation.trace_policies import POLICY_NAMES
from resihp_lightning.evaluation.run import healthy_tokens_per_s, run_trace

OURS = "joint_per_replica"
BASELINES = ("none", "checkpoint_restart", "oobleck", "recycle", "greyhound", "resihp_rules")
#: The paper's reported ratios of ResiHP over each system (ResiHP, HPDC '26), where it gives one.
PAPER = {
    ("fail-stop", "recycle"): "1.22-1.82x",
    ("fail-stop", "oobleck"): "1.07-1.51x",
    ("fail-slow", "greyhound"): "1.22-1.46x",
}
PAPER_OVERALL = "1.04-4.39x over Greyhound, Adaptra, ReCycle, Oobleck"
MODELS_AT_256 = (("llama2-7b", 1, 16384), ("llama2-13b", 1, 16384), ("qwen2.5-7b", 1, 16384),
                 ("llama2-70b", 4, 8192), ("qwen2.5-72b", 4, 8192), ("llama2-7b", 1, 32768))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default="32,256,1024")
    parser.add_argument("--hours", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--png", default=str(Path(__file__).with_name("traces_mixed_256.png")))
    parser.add_argument("--no-models", action="store_true", help="skip the model table at 256 GPUs")
    args = parser.parse_args()
    scales = [int(s) for s in args.scales.split(",")]
    profile = build_profile("llama2-7b", WorkloadSpec(seq_len=16384))
    rows, timeline = {}, None
    for gpus in scales:
        for scenario in SCENARIOS:
            trace = generate(scenario, TraceConfig(gpus=gpus, hours=args.hours), seed=args.seed)
            start = time.perf_counter()
            cluster = Cluster(trace, profile)
            results = run_trace(trace, profile, cluster=cluster)
            healthy = healthy_tokens_per_s(trace, profile, cluster=cluster)
            rows[gpus, scenario] = (len(trace.events), healthy, results, time.perf_counter() - start)
            if gpus == 256 and scenario == "mixed":
                timeline = (trace, results, healthy)
    print(f"LLaMA2-7B, 16K tokens per micro-batch, TP 1, M = 4 per GPU, {args.hours:g} h traces, seed {args.seed}\n")
    print("| GPUs | scenario | events | healthy | " + " | ".join(POLICY_NAMES) + " | replay s |")
    print("|---|---|---|---|" + "---|" * (len(POLICY_NAMES) + 1))
    for (gpus, scenario), (events, healthy, results, seconds) in rows.items():
        cells = " | ".join(f"{results[n].tokens_per_s / 1000:,.1f}k" for n in POLICY_NAMES)
        print(f"| {gpus} | {scenario} | {events} | {healthy / 1000:,.1f}k | {cells} | {seconds:.0f} |")
    print("\nOurs (joint_per_replica) over each baseline; the paper's figure for ResiHP beside it where it gives one:\n")
    print("| GPUs | scenario | " + " | ".join(f"vs {b}" for b in BASELINES) + " | vs joint_shared | of oracle |")
    print("|---|---|" + "---|" * (len(BASELINES) + 2))
    for (gpus, scenario), (_, _, results, _) in rows.items():
        ours = results[OURS].tokens_per_s
        cells = []
        for b in BASELINES:
            cell = f"{ours / results[b].tokens_per_s:.2f}x"
            if (scenario, b) in PAPER:
                cell += f" (paper {PAPER[scenario, b]})"
            cells.append(cell)
        print(f"| {gpus} | {scenario} | " + " | ".join(cells)
              + f" | {ours / results['joint_shared'].tokens_per_s:.3f}x | {ours / results['oracle'].tokens_per_s:.3f} |")
    print(f"\nPaper overall: {PAPER_OVERALL}.")
    if not args.no_models:
        _models(args)
    if timeline is not None:
        _png(args.png, *timeline)


def _models(args) -> None:
    print("\nModels at 256 GPUs, mixed trace (tokens/s; ours = joint_per_replica):\n")
    names = ("none", "oobleck", "recycle", "greyhound", "resihp_rules", "joint_shared", OURS, "oracle")
    print("| model | TP | tokens | healthy | " + " | ".join(names) + " | ours / best baseline | ours / oracle |")
    print("|---|---|---|---|" + "---|" * (len(names) + 2))
    for model, tp, seq in MODELS_AT_256:
        profile = build_profile(model, WorkloadSpec(seq_len=seq, tp=tp))
        trace = generate("mixed", TraceConfig(gpus=256, hours=args.hours), seed=args.seed)
        cluster = Cluster(trace, profile)
        results = run_trace(trace, profile, names, cluster=cluster)
        healthy = healthy_tokens_per_s(trace, profile, cluster=cluster)
        best = max(results[b].tokens_per_s for b in names if b in BASELINES)
        ours = results[OURS].tokens_per_s
        cells = " | ".join(f"{results[n].tokens_per_s / 1000:,.1f}k" for n in names)
        print(f"| {model} | {tp} | {seq // 1024}K | {healthy / 1000:,.1f}k | {cells} | {ours / best:.3f} | "
              f"{ours / results['oracle'].tokens_per_s:.3f} |")


def _png(path: str, trace, results, healthy: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib is not installed: no PNG; pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(11, 5.5))
    shown = ("none", "checkpoint_restart", "oobleck", "recycle", "greyhound", "resihp_rules", OURS, "oracle")
    for name in shown:
        xs, ys = [], []
        for s in results[name].segments:
            xs += [s.start_s / 3600, s.end_s / 3600]
            ys += [s.tokens_per_s / 1000, s.tokens_per_s / 1000]
        ax.plot(xs, ys, label=f"{name} ({results[name].tokens_per_s / 1000:,.0f}k avg)", linewidth=1.6 if name in (OURS, "oracle") else 1.0)
    for e in trace.events:
        if e.kind == "fail_stop":
            ax.axvline(e.start_s / 3600, color="red", alpha=0.15, linewidth=0.8)
    ax.axhline(healthy / 1000, color="black", linestyle=":", linewidth=0.8, label="healthy")
    ax.set_xlabel("hours (red lines: fail-stops)")
    ax.set_ylabel("tokens/s (thousands), before lost work")
    ax.set_title(f"Mixed failure trace, {trace.gpus} GPUs, LLaMA2-7B at 16K tokens")
    ax.legend(fontsize=7, loc="lower left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\ntimeline: {path}")


if __name__ == "__main__":
    main()
