"""bf16 and ZeRO-1: the layer-wise engine's (sharded moments, every slice kept twice) vs DeepSpeed's wrappers.

Not a test, not run by CI. The README demo's model (Llama-style, hidden 192, 6 decoder layers, 4 query /
2 key-value heads, intermediate 512, byte vocabulary; embedding and head as pipeline layers) with synthetic
byte-token rows of ``--seq-len`` tokens, AdamW (lr 1e-3), ``Trainer(precision="bf16-mixed")``, 4 spawned
gloo processes with one thread each. Three parts:

1. ``--part engine``: step time and memory, same model and plan (``--plans``: P = 1 x D = 4 and / or
   P = 2 x D = 2, shared bounds, which DeepSpeed's wrappers need), four variants:

   * ``layer-wise bf16``: no ``deepspeed_config`` (autocast over fp32 parameters, Adam's moments whole on
     every holder);
   * ``layer-wise bf16 + ZeRO-1``: ``{"zero_optimization": {"stage": 1}}`` (the default: layer-wise);
   * ``DeepSpeed bf16``: ``{"bf16": {"enabled": True}}`` (``BF16_Optimizer``: bf16 parameters, fp32 masters
     and moments in flat partitions of each stage's data-parallel group);
   * ``DeepSpeed bf16 + ZeRO-1``: ``{"zero_optimization": {"stage": 1, "layerwise": False}}``
     (``DeepSpeedZeroOptimizer`` with bf16 parameters).

   The variants run interleaved (A B C D A B C D ..., ``--repeats`` rounds) in one set of 4 processes, so
   that a load change on a shared machine hits every variant alike; per variant the median and the
   minimum over the rounds are reported. Per run: the slowest rank's
   ``StepStats.step_ms``, median over ``--steps`` timed steps after ``--warmup`` untimed ones; the CPU
   time of all 4 processes per timed step (``time.process_time``; less exposed to other jobs than
   wall time); the optimizer state the largest rank keeps (what its state carrier counts: Adam's
   moments, and DeepSpeed's fp32 masters, which the layer-wise engine does not keep apart because its
   parameters are fp32), in MiB. Memory comes from one more run of each variant in fresh processes: the
   peak resident set of the largest rank over its resident set before the first step (``VmHWM`` after a
   reset through ``/proc/self/clear_refs``), in MiB. The load average before and after is printed.

2. ``--part comm``: the two choices inside the layer-wise step, on 4 gloo processes, for a buffer the
   size of the demo model's parameters: the gradient reduction as one all-reduce vs a reduce-scatter
   (plus the second slice the neighbour copy needs), and keeping the neighbour copy by stepping it
   (Adam on 1/D of the parameters, local) vs sending it (the copy's two moments, 8 bytes per element,
   to the neighbour).

3. ``--part recovery``: bf16 + layer-wise ZeRO-1 on the demo model, P = 1 x D = 4, ``fail_stop`` on,
   rank 2 (the only primary of slice 2 of every layer) SIGKILLed at the forward of its 2nd
   micro-batch of step 2; the survivors' :class:`~resihp_lightning.failstop.recovery_record.RecoveryRecord`
   (the kill to the survivors' abort, regroup, plan, restore with the slice rebuild, the redone step, the
   moment slices sent), interleaved with the same run unsharded, ``--repeats`` rounds.

Run (timings on a shared machine move by tens of percent between runs, hence the interleaving)::

    OMP_NUM_THREADS=1 python benchmarks/zero1_engine.py [--part engine|comm|recovery|all] [--steps 4] [--warmup 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _spawn import rank_environment, run_ranks  # noqa: E402  benchmarks/_spawn.py, next to this script
from bf16_engine import SHAPE, WORLD, _batches, _reset_peak, _rss_kib  # noqa: E402

ZERO1 = {"zero_optimization": {"stage": 1}}
ENGINE_VARIANTS = {
    "layer-wise bf16": {},
    "layer-wise bf16 + ZeRO-1": ZERO1,
    "DeepSpeed bf16": {"bf16": {"enabled": True}},
    "DeepSpeed bf16 + ZeRO-1": {"zero_optimization": {"stage": 1, "layerwise": False}},
}
PLANS = {"P=1 x D=4": 1, "P=2 x D=2": 2}


# ------------------------------------------------------------------------------------ part 1
def _fit_variant(rank: int, variant: str, pipeline_degree: int, micro_batches: int, seq_len: int, warmup: int,
                 steps: int) -> dict:
    """One ``trainer.fit`` of ``variant`` on this process (its group exists); what it measured."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from resihp_lightning.config import ScratchModelConfig
    from resihp_lightning.models import CausalLMPipelineModule
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    record: dict = {"rank": rank, "variant": variant, "step_ms": [], "losses": [], "stepper": None}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, module):
            record["before_kib"] = _rss_kib("VmRSS")

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == warmup:
                _reset_peak()
                record["cpu_start"] = time.process_time()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            stats = trainer.strategy.last_step_stats
            record["losses"].append(float(outputs["loss"]))
            if trainer.global_step > warmup and stats is not None:
                record["step_ms"].append(stats.step_ms)
            record["cpu_s"] = time.process_time() - record.get("cpu_start", 0.0)
            runtime = trainer.strategy._state.runtime
            record["stepper"] = type(runtime.engine.optimizer).__name__
            record["state_mib"] = sum(runtime._carrier.state_bytes(runtime.engine, p)
                                      for p in runtime.local_parameters().values()) / 2**20

    torch.manual_seed(0)
    module = CausalLMPipelineModule(scratch=ScratchModelConfig(**SHAPE), seed=0, learning_rate=1e-3)
    strategy = ResiHPStrategy(pipeline_degree=pipeline_degree, micro_batch_size=1, micro_batches=micro_batches,
                              deepspeed_config=ENGINE_VARIANTS[variant])
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, precision="bf16-mixed",
                         max_steps=warmup + steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, use_distributed_sampler=False, callbacks=[Probe()])
    trainer.fit(module, DataLoader(_batches(warmup + steps, micro_batches, seq_len), batch_size=None))
    record["peak_mib"] = (_rss_kib("VmHWM") - record["before_kib"]) / 1024
    return record


def _engine_rank(rank: int, port: int, order: list[str], pipeline_degree: int, micro_batches: int, seq_len: int,
                 warmup: int, steps: int, queue) -> None:
    """Fits every variant of ``order`` in turn in the same 4 processes (one fit each)."""
    rank_environment(rank, port, WORLD)
    sys.stdout = sys.stderr
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    records = []
    for i, variant in enumerate(order):
        record = _fit_variant(rank, variant, pipeline_degree, micro_batches, seq_len, warmup, steps)
        record["load"] = os.getloadavg()[0]
        records.append(record)
        if rank == 0:
            print(f"# run {i + 1}/{len(order)}: {variant}: {max(record['step_ms']):.0f} ms (rank 0's slowest step), "
                  f"load {record['load']:.1f}", file=sys.__stdout__, flush=True)
    queue.put(records)


def _summary(ranks: list[dict], steps: int) -> dict:
    """One run's numbers: the slowest rank per timed step (median), all ranks' CPU per step, the largest rank."""
    return {
        "step_ms": statistics.median(max(r["step_ms"][i] for r in ranks) for i in range(len(ranks[0]["step_ms"]))),
        "cpu_s": sum(r["cpu_s"] for r in ranks) / steps,
        "state_mib": max(r["state_mib"] for r in ranks),
        "peak_mib": max(r["peak_mib"] for r in ranks),
        "stepper": ranks[0]["stepper"],
        "loss": ranks[-1]["losses"][-1],
    }


def run_engine(micro_batches: int, seq_len: int, warmup: int, steps: int, repeats: int, variants: list[str],
               plans: list[str]) -> None:
    """Timing: every variant ``repeats`` times, interleaved (A B C D A B C D ...) in one set of 4 processes
    (fresh processes per run would spend minutes on imports per run on a loaded machine, and spread the
    variants' runs over a longer stretch of changing load). Memory: one run of each variant in fresh
    processes (an allocator that ran other variants before keeps their pages, and the peak over the
    resident set before the first step would understate a later variant's)."""
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    memory: dict[tuple[str, str], dict] = {}
    for plan in plans:
        order = [variant for _ in range(repeats) for variant in variants]
        got = run_ranks(_engine_rank, (order, PLANS[plan], micro_batches, seq_len, warmup, steps), WORLD, WORLD,
                        timeout=3600)
        for i, variant in enumerate(order):
            runs.setdefault((plan, variant), []).append(_summary([ranks[i] for ranks in sorted(got, key=lambda r: r[0]["rank"])], steps))
        for variant in variants:
            fresh = run_ranks(_engine_rank, ([variant], PLANS[plan], micro_batches, seq_len, warmup, steps), WORLD, WORLD,
                              timeout=1800)
            memory[(plan, variant)] = _summary([ranks[0] for ranks in fresh], steps)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print(f"4 processes, bf16-mixed | plan | optimizer step | step ms, slowest rank: median (min) of {repeats} | "
          "CPU s per step, 4 processes: median (min) | optimizer state MiB, largest rank | "
          "peak MiB, largest rank (fresh processes) | last loss")
    print("---|---|---|---|---|---|---|---")
    for (plan, variant), got in runs.items():
        print(f"{variant} | {plan} | {got[0]['stepper']} | {_med_min(got, 'step_ms', 0)} | {_med_min(got, 'cpu_s', 2)} | "
              f"{got[0]['state_mib']:.1f} | {memory[(plan, variant)]['peak_mib']:.0f} | {got[0]['loss']:.4f}", flush=True)
    print("\nper run, in the order run: " + "; ".join(
        f"{variant} {runs[(plan, variant)][i]['step_ms']:.0f}" for plan in plans for i in range(repeats) for variant in variants))


def _med_min(runs: list[dict], key: str, digits: int) -> str:
    values = [r[key] for r in runs]
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f})"


# ------------------------------------------------------------------------------------ part 2
def _comm_rank(rank: int, port: int, numel: int, repeats: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    grads = torch.randn(numel)
    share = numel // WORLD
    timings: dict[str, list[float]] = {k: [] for k in ("all_reduce", "reduce_scatter x2", "step slice", "send copy")}
    param = torch.nn.Parameter(torch.randn(share))
    adam = torch.optim.AdamW([param], lr=1e-3)
    param.grad = torch.randn(share)
    adam.step()
    moments = torch.randn(2 * share)
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(grads.clone())
        timings["all_reduce"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        out = torch.empty(share)
        for _ in range(2):  # own slice and the neighbour's: the copy needs its reduced gradient too
            dist.reduce_scatter_tensor(out, grads[: share * WORLD].clone())
        timings["reduce_scatter x2"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        adam.step()
        timings["step slice"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        ops = [dist.P2POp(dist.isend, moments, (rank - 1) % WORLD), dist.P2POp(dist.irecv, torch.empty_like(moments), (rank + 1) % WORLD)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        timings["send copy"].append(time.perf_counter() - t)
    queue.put({"rank": rank, **{k: statistics.median(v) * 1000 for k, v in timings.items()}})
    dist.destroy_process_group()


def run_comm(repeats: int) -> None:
    import torch

    from resihp_lightning.config import ScratchModelConfig
    from resihp_lightning.models import CausalLMPipelineModule

    module = CausalLMPipelineModule(scratch=ScratchModelConfig(**SHAPE), seed=0, learning_rate=1e-3)
    numel = sum(p.numel() for layer in module.pipeline_layers() for p in torch.nn.Module.parameters(layer))
    got = run_ranks(_comm_rank, (numel, repeats), WORLD, WORLD, timeout=900)
    print(f"4 processes, {numel} fp32 elements (the demo model), median of {repeats} | slowest rank ms")
    print("---|---")
    for key in ("all_reduce", "reduce_scatter x2", "step slice", "send copy"):
        print(f"{key} | {max(r[key] for r in got):.1f}")


# ------------------------------------------------------------------------------------ part 3
VICTIM, KILL_STEP, RECOVERY_STEPS = 2, 2, 4


def _recovery_rank(rank: int, world: int, run_dir: str, config: dict, micro_batches: int, seq_len: int) -> dict:
    import warnings

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from resihp_lightning.config import ScratchModelConfig
    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.models import CausalLMPipelineModule
    from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.testing.tensor_jobs import kill_inside_step

    warnings.filterwarnings("ignore")
    recorder = kill_inside_step(rank, VICTIM, KILL_STEP, run_dir)
    module = CausalLMPipelineModule(scratch=ScratchModelConfig(**SHAPE), seed=0, learning_rate=1e-3)
    strategy = ResiHPStrategy(pipeline_degree=1, micro_batch_size=1, micro_batches=micro_batches, deepspeed_config=config,
                              fail_stop=FailStopConfig())
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision="bf16-mixed",
                         max_steps=RECOVERY_STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, use_distributed_sampler=False, callbacks=[recorder],
                         default_root_dir=run_dir)
    trainer.fit(module, DataLoader(_batches(RECOVERY_STEPS, micro_batches, seq_len), batch_size=None))
    carrier = strategy._state.require()._carrier
    return {"record": strategy.last_recovery, "losses": recorder.losses,
            "assembled": getattr(carrier, "assembled_bytes", 0)}


def run_recovery(micro_batches: int, seq_len: int, repeats: int) -> None:
    from resihp_lightning.testing.harness import run_job

    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    print("bf16-mixed, P=1 x D=4, rank 2 SIGKILLed mid-step | kill to abort s | regroup s | plan s | restore s | redo s | "
          "MiB of moment slices sent (all survivors) | survivors' plan")
    print("---|---|---|---|---|---|---|---")
    totals: dict[str, list[tuple[float, ...]]] = {}
    for _ in range(repeats):
        for name, config in (("layer-wise ZeRO-1", ZERO1), ("layer-wise unsharded", {})):  # interleaved
            outcome = run_job(_recovery_rank, WORLD, timeout=900, wait_for=[0, 1, 3], config=config,
                              micro_batches=micro_batches, seq_len=seq_len)
            values = outcome.values()
            if sorted(values) != [0, 1, 3]:
                raise RuntimeError(outcome.describe())
            records = [v["record"] for v in values.values()]
            died_at = outcome.ranks[VICTIM].last_words["died_at"]  # time.monotonic(): one clock on one machine
            detect = statistics.median(r.aborted_at - died_at for r in records)
            worst = max(records, key=lambda r: r.regroup_s + r.plan_s + r.restore_s)
            sent = sum(v["assembled"] for v in values.values()) / 2**20
            totals.setdefault(name, []).append((detect, worst.regroup_s, worst.plan_s, worst.restore_s, worst.redo_s))
            print(f"{name} | {detect:.2f} | {worst.regroup_s:.2f} | {worst.plan_s:.2f} | {worst.restore_s:.2f} | "
                  f"{worst.redo_s:.2f} | {sent:.1f} | {worst.plan.layout_key()}", flush=True)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print(f"median (min) of {repeats} | kill to abort s | regroup s | plan s | restore s | redo s")
    print("---|---|---|---|---|---")
    for name, rows in totals.items():
        cells = [f"{statistics.median(col):.2f} ({min(col):.2f})" for col in zip(*rows)]
        print(f"{name} | {' | '.join(cells)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("engine", "comm", "recovery", "all"), default="all")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", nargs="*", default=list(ENGINE_VARIANTS), choices=list(ENGINE_VARIANTS),
                        help="part 1: which variants to run")
    parser.add_argument("--plans", nargs="*", default=["P=1 x D=4"], choices=list(PLANS), help="part 1: which plans")
    args = parser.parse_args()
    print(f"demo model {SHAPE}; M = {args.micro_batches} rows of {args.seq_len} tokens; "
          f"{args.warmup} warm-up + {args.steps} timed steps; {args.repeats} run(s)\n", flush=True)
    if args.part in ("comm", "all"):
        run_comm(max(args.repeats, 5))
        print(flush=True)
    if args.part in ("engine", "all"):
        run_engine(args.micro_batches, args.seq_len, args.warmup, args.steps, args.repeats, args.variants, args.plans)
        print(flush=True)
    if args.part in ("recovery", "all"):
        run_recovery(args.micro_batches, args.seq_len, args.repeats)


if __name__ == "__main__":
    main()
