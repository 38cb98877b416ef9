"""Iteration time: the planner's prediction against the measured time, plan by plan (issue 17, item 4).

Six plans of the README demo's model (``examples/configs/demo_cpu.yaml``: 8 layers, 8 micro-batches
of one 1024-token row) on 2 processes, one per core of the project's 2-core machine (the issue asks
for at most two per core; one per core keeps the processes from taking each other's cores): three
2-stage pipelines with different stage bounds and three 2-replica layouts with different
micro-batch splits. Every plan runs ``--steps`` steps of the example (no fault, no re-planning),
``--rounds`` times, the plans interleaved (A B C ... A B C ...), so that a change in the machine's
other load spreads over all of them.

Prediction: :func:`resihp_lightning.plan.evaluate` (the planning model the planner optimises) on a
problem built by the controller's own :func:`~resihp_lightning.callbacks.replan.replan_policy.build_problem`
from one *reference* run's measured layer profile (``strategy.layer_profile()``, the controller's
input), with ``p2p_ms`` / ``allreduce_ms`` and a per-iteration ``overhead`` (optimizer step, loss
logging, the callbacks' collectives: what the planning model leaves out) calibrated on two
reference plans (the first pipeline and the first replica layout) of the same round. The other
four plans are predicted out of sample; the reference rows are marked. A second table puts the 1F1B
event simulator (:func:`~resihp_lightning.solver.simulator.simulate`) in place of the formula,
calibrated the same way (it differs only where a replica's stages are unequal). Measured: the median of the
strategy's step time (``step_ms`` in ``steps.jsonl``, rank 0) from step 3 on.

Packed sequence lengths (issue 17, item 5): the planning model prices every micro-batch at the
profiled per-layer averages, so it predicts the same time for every step. Each step's batch is
known before it runs, though: :func:`~resihp_lightning.callbacks.failslow.workload_model.predict_batch_ms`
scales each micro-batch's stage times by its workload (``alpha*tokens + beta*sum(len^2) + gamma``,
fitted on the reference replica layout's micro-batches) relative to the profiled average and prices
the 1F1B schedule with the micro-batches each replica really runs. The second table compares the
per-step error of both predictions (the same calibration) on the example's packed rows of Python
sources, whose document lengths are skewed (a row is one long file or many short ones).

``--skewed`` trains on length-skewed data instead: the same Python sources cut into documents that
are either long (about 1000 tokens, one per row) or short (25 tokens, about 40 per row), so that a
row's attention work varies about fortyfold while its token count does not.

Run: ``python benchmarks/prediction.py [--rounds 2] [--steps 10] [--skewed]`` (about 40 s per run).
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
sys.path.insert(0, str(ROOT))

from resihp_lightning.plan import Plan  # noqa: E402

DEMO_CONFIG = ROOT / "examples" / "configs" / "demo_cpu.yaml"
LAYERS, MICRO = 8, 8


def _pipeline(cut: int) -> dict:
    return {"replicas": [{"devices": [0, 1], "bounds": [0, cut, LAYERS], "micro_batches": MICRO}]}


def _replicas(first: int) -> dict:
    return {"replicas": [{"devices": [0], "bounds": [0, LAYERS], "micro_batches": first},
                         {"devices": [1], "bounds": [0, LAYERS], "micro_batches": MICRO - first}]}


#: name -> plan; the first pipeline and the first replica layout are the calibration references.
PLANS = {"2x1 [0,4,8]": _pipeline(4), "1x2 [4,4]": _replicas(4), "2x1 [0,3,8]": _pipeline(3),
         "2x1 [0,6,8]": _pipeline(6), "1x2 [5,3]": _replicas(5), "1x2 [6,2]": _replicas(6)}
REFERENCES = ("2x1 [0,4,8]", "1x2 [4,4]")


def _profile_callback(path: Path, at_step: int):
    """A callback that records every rank's micro-batches per step (``mbs-<rank>.jsonl`` next to
    ``path``: tokens, sum of squared lengths, busy ms) and, at ``at_step`` on every rank, takes
    ``strategy.layer_profile()`` (a collective), which rank 0 writes to ``path``."""
    import lightning.pytorch as pl

    class Profile(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            stats = trainer.strategy.last_step_stats
            if stats is not None:
                record = {"step": stats.step, "replica": stats.replica, "stage": stats.stage,
                          "mbs": [[mb.tokens, mb.sum_len_sq, mb.compute_ms] for mb in stats.micro_batches]}
                with open(path.parent / f"mbs-{trainer.global_rank}.jsonl", "a", encoding="utf-8") as out:
                    out.write(json.dumps(record) + "\n")
            if trainer.global_step != at_step:
                return
            profile = trainer.strategy.layer_profile()
            if trainer.global_rank == 0:
                path.write_text(json.dumps([vars(c) for c in profile]))

    return Profile()


def job(argv: list[str]) -> None:
    """One run (every rank runs this: Lightning's launcher re-runs the script)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import finetune

    cfg = finetune.build_parser().parse_args(argv)
    run_dir = finetune.resolve_run_dir(cfg)
    finetune.run(cfg, extra_callbacks=[_profile_callback(run_dir / "profile.json", cfg.trainer.max_steps)])


def skewed_corpus(path: Path, seed: int = 0) -> Path:
    """Writes a JSONL of long (1000-character) and short (25-character) documents cut from the Python
    standard library's sources (byte tokenizer: characters are tokens), long and short at random."""
    import random
    import sysconfig

    rng = random.Random(seed)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:300]
    with open(path, "w", encoding="utf-8") as out:
        for file in files:
            text = file.read_text(encoding="utf-8", errors="replace")
            if len(text) < 1000:
                continue
            if rng.random() < 0.5:
                out.write(json.dumps({"text": text[:1000]}) + "\n")
            else:
                for start in range(0, 1000, 25):
                    out.write(json.dumps({"text": text[start:start + 25]}) + "\n")
    return path


def run_plan(plan: dict, steps: int, out: Path, data: Path | None = None) -> dict:
    """Runs the example under ``plan``; returns measured step times and the layer profile."""
    run_dir = Path(tempfile.mkdtemp(prefix="plan-", dir=out))
    plan_obj = Plan.from_dict({**plan, "pipeline_degree": len(plan["replicas"][0]["devices"]),
                               "data_degree": len(plan["replicas"])})
    (run_dir / "initial_plan.json").write_text(json.dumps({"plan": plan_obj.to_dict()}))  # start: planned reads it
    argv = [sys.executable, str(Path(__file__).resolve()), "--job", "--config", str(DEMO_CONFIG),
            "--run_dir", str(run_dir), "--checkpoint", "null", "--fault", "null", "--replan", "false",
            "--trainer.progress_bar", "false", "--trainer.devices", "2", "--trainer.max_steps", str(steps),
            "--strategy.start", "planned", "--strategy.fail_stop", "null",
            *(["--data.source", str(data), "--data.max_files", "null"] if data is not None else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RESIHP_RUN_DIR", None)
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    records = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    per_step = {r["step"]: r["step_ms"] for r in records if r["step"] >= 3 and r.get("step_ms")}
    profile = json.loads((run_dir / "profile.json").read_text())
    mbs: dict[int, dict[int, list]] = {}  # step -> replica -> micro-batches (from the replica's stage 0)
    for path in run_dir.glob("mbs-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["stage"] == 0:
                mbs.setdefault(record["step"], {})[record["replica"]] = record["mbs"]
    return {"step_ms": statistics.median(per_step.values()), "per_step": per_step, "mbs": mbs, "profile": profile,
            "plan": plan_obj, "dir": str(run_dir)}


def predict(profile: list[dict], plan: Plan, p2p_ms: float, allreduce_ms: float, overhead_ms: float,
            simulated: bool = False) -> float:
    """The planning model's time (``simulated``: the 1F1B event simulator's) plus the overhead."""
    from resihp_lightning.callbacks.replan.replan_policy import ControllerConfig, build_problem
    from resihp_lightning.plan import evaluate
    from resihp_lightning.solver.simulator import simulate
    from resihp_lightning.telemetry import LayerCost

    problem = build_problem([LayerCost(**c) for c in profile], {}, [0, 1], MICRO,
                            ControllerConfig(p2p_ms=p2p_ms, allreduce_ms=allreduce_ms, memory_mb=None))
    model_ms = simulate(problem, plan).makespan_ms if simulated else evaluate(problem, plan).iteration_ms
    return model_ms + overhead_ms


def predict_steps(result: dict, profile: list[dict], model, reference, allreduce_ms: float, overhead_ms: float) -> dict:
    """Per step: the prediction from the step's packed sequence lengths (``predict_batch_ms``)."""
    from resihp_lightning.callbacks.failslow.workload_model import predict_batch_ms

    layer = [c["compute_ms"] for c in sorted(profile, key=lambda c: c["index"])]
    plan = result["plan"]
    stage_ms = [[sum(layer[b0:b1]) for b0, b1 in zip(r.bounds, r.bounds[1:])] for r in plan.replicas]
    out = {}
    for step, measured in result["per_step"].items():
        by_replica = result["mbs"].get(step, {})
        if len(by_replica) != plan.data_degree:
            continue
        workloads = [[(t, sq) for t, sq, _ in by_replica[r]] for r in range(plan.data_degree)]
        out[step] = predict_batch_ms(stage_ms, workloads, model, reference, allreduce_ms=allreduce_ms) + overhead_ms
    return out


def workload_model(result: dict):
    """The whole model's workload model, fitted on a replica layout's micro-batches (every rank holds
    every layer there), and the average micro-batch of those steps."""
    from resihp_lightning.callbacks.failslow.workload_model import fit_workload

    samples = [mb for replicas in result["mbs"].values() for mbs in replicas.values() for mb in mbs]
    model = fit_workload([m[0] for m in samples], [m[1] for m in samples], [m[2] for m in samples])
    reference = (statistics.fmean(m[0] for m in samples), statistics.fmean(m[1] for m in samples))
    return model, reference


def calibrate(profile: list[dict], pipe: dict, reps: dict, simulated: bool = False) -> tuple[float, float, float]:
    """(p2p_ms, allreduce_ms, overhead_ms) from the two reference runs.

    The overhead (per iteration, the same under every plan) and the all-reduce cannot be told apart
    from one replica layout, so the overhead is taken from the pipeline reference (which has no
    all-reduce) after its p2p share, and the p2p cost per micro-batch is taken as zero there
    (activation transfers overlap the other stage's compute on gloo); the all-reduce is what the
    replica reference adds beyond compute and overhead.
    """
    overhead = pipe["step_ms"] - predict(profile, pipe["plan"], 0.0, 0.0, 0.0, simulated)
    allreduce = max(reps["step_ms"] - predict(profile, reps["plan"], 0.0, 0.0, overhead, simulated), 0.0)
    return 0.0, allreduce, overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=str, default=str(ROOT / "runs"))
    parser.add_argument("--skewed", action="store_true", help="length-skewed documents (see the docstring)")
    if len(sys.argv) > 1 and sys.argv[1] == "--job":
        job(sys.argv[2:])
        return
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = skewed_corpus(out / "skewed.jsonl") if args.skewed else None
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    started = time.perf_counter()
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in PLANS}
    simulated_rows: dict[str, list[tuple[float, float]]] = {name: [] for name in PLANS}
    per_step: dict[str, list[tuple[float, float, float]]] = {name: [] for name in PLANS}  # (flat, lengths, measured)
    for round_ in range(args.rounds):
        results = {name: run_plan(plan, args.steps, out, data) for name, plan in PLANS.items()}
        profile = results[REFERENCES[0]]["profile"]
        p2p, allreduce, overhead = calibrate(profile, results[REFERENCES[0]], results[REFERENCES[1]])
        print(f"round {round_ + 1}: calibrated p2p {p2p:.1f} ms, all-reduce {allreduce:.1f} ms, overhead "
              f"{overhead:.1f} ms; layer ms {[round(c['compute_ms'], 1) for c in profile]}", flush=True)
        model, reference = workload_model(results[REFERENCES[1]])
        sim_p2p, sim_allreduce, sim_overhead = calibrate(profile, results[REFERENCES[0]], results[REFERENCES[1]], True)
        for name, result in results.items():
            flat = predict(profile, result["plan"], p2p, allreduce, overhead)
            rows[name].append((flat, result["step_ms"]))
            sim = predict(profile, result["plan"], sim_p2p, sim_allreduce, sim_overhead, simulated=True)
            simulated_rows[name].append((sim, result["step_ms"]))
            for step, with_lengths in predict_steps(result, profile, model, reference, allreduce, overhead).items():
                per_step[name].append((flat, with_lengths, result["per_step"][step]))
    print(f"\n{args.rounds} rounds x {len(PLANS)} plans, {args.steps} steps each, 2 processes, "
          f"{'length-skewed data' if data else 'the demo data'}; load before "
          f"{load}, after {' '.join(f'{v:.1f}' for v in os.getloadavg())}; {time.perf_counter() - started:.0f} s\n")
    errors, pooled = _print_rows(rows, "predicted ms")
    if errors:
        print(f"\nout-of-sample error: median {statistics.median(errors):.1f}%, max {max(errors):.1f}% "
              f"({len(errors)} predictions); over rounds: median {statistics.median(pooled):.1f}%, "
              f"max {max(pooled):.1f}% ({len(pooled)} plans)")
    print("\nthe same with the 1F1B event simulator (solver/simulator.py, forward 1/3 of a layer's time) in place "
          "of the formula, calibrated the same way:\n")
    sim_errors, sim_pooled = _print_rows(simulated_rows, "simulated ms")
    if sim_errors:
        print(f"\nsimulator out-of-sample error: median {statistics.median(sim_errors):.1f}%, max {max(sim_errors):.1f}% "
              f"({len(sim_errors)} predictions); over rounds: median {statistics.median(sim_pooled):.1f}%, "
              f"max {max(sim_pooled):.1f}% ({len(sim_pooled)} plans)")
    print("\nper-step error (|predicted - measured| / measured, median over steps 3.., all rounds); 'level removed':"
          " each run's predictions scaled so that their median is the run's measured median, which leaves"
          " only how well they follow the steps' differences:\n")
    print("| plan | steps | per-layer averages | packed sequence lengths | averages, level removed | lengths, level removed |")
    print("|---|---|---|---|---|---|")
    columns: list[list[float]] = [[], [], [], []]
    for name, values in per_step.items():
        if not values:
            continue
        row = _step_errors(values, args.rounds)
        for column, errs in zip(columns, row):
            column.extend(errs)
        print(f"| {name} | {len(values)} | " + " | ".join(f"{statistics.median(e):.1f}%" for e in row) + " |")
    if columns[0]:
        print(f"| all | {len(columns[0])} | " + " | ".join(f"{statistics.median(e):.1f}%" for e in columns) + " |")


def _print_rows(rows: dict[str, list[tuple[float, float]]], predicted: str) -> tuple[list[float], list[float]]:
    """Prints one table row per plan: predicted and measured per round, and the error of the median
    prediction against the median measurement over the rounds (a plan's time moves between rounds
    with the machine's other load; the median over rounds damps that for both sides alike).

    Returns:
        the out-of-sample |errors| in %, per round and over rounds.
    """
    print(f"| plan | {predicted} | measured ms (median step, per round) | error (per round) | error over rounds | |")
    print("|---|---|---|---|---|---|")
    errors, pooled = [], []
    for name, values in rows.items():
        errs = [(p - m) / m * 100 for p, m in values]
        measured = statistics.median(m for _, m in values)
        over_rounds = (statistics.median(p for p, _ in values) - measured) / measured * 100
        if name not in REFERENCES:
            errors.extend(abs(e) for e in errs)
            pooled.append(abs(over_rounds))
        print(f"| {name} | {', '.join(f'{p:.0f}' for p, _ in values)} | {', '.join(f'{m:.0f}' for _, m in values)} | "
              f"{', '.join(f'{e:+.1f}%' for e in errs)} | {over_rounds:+.1f}% | {'calibration' if name in REFERENCES else ''} |")
    return errors, pooled


def _step_errors(values: list[tuple[float, float, float]], rounds: int) -> list[list[float]]:
    """Per-step errors of both predictions, as they are and with each run's level removed."""
    flat = [abs(f - m) / m * 100 for f, _, m in values]
    lens = [abs(w - m) / m * 100 for _, w, m in values]
    per_round = max(len(values) // max(rounds, 1), 1)
    flat_lr, lens_lr = [], []
    for start in range(0, len(values), per_round):
        chunk = values[start:start + per_round]
        measured = statistics.median(m for _, _, m in chunk)
        scale_f = measured / statistics.median(f for f, _, _ in chunk)
        scale_w = measured / statistics.median(w for _, w, _ in chunk)
        flat_lr += [abs(f * scale_f - m) / m * 100 for f, _, m in chunk]
        lens_lr += [abs(w * scale_w - m) / m * 100 for _, w, m in chunk]
    return [flat, lens, flat_lr, lens_lr]


if __name__ == "__main__":
    main()
