"""ZeRO-1: the layer-wise engine's (sharded moments, every slice kept twice) vs unsharded vs DeepSpeed's wrapper.

Not a test, not run by CI. The README demo's model (Llama-style, hidden 192, 6 decoder layers, 4 query /
2 key-value heads, intermediate 512, byte vocabulary; embedding and head as pipeline layers) with synthetic
byte-token rows of ``--seq-len`` tokens, AdamW (lr 1e-3), ``Trainer(precision="bf16-mixed")``, 4 spawned
gloo processes with one thread each. Three parts:

1. ``--part engine``: step time and memory, same model and plan (P = 1 x D = 4 and P = 2 x D = 2):

   * ``layer-wise ZeRO-1``: ``deepspeed_config={"zero_optimization": {"stage": 1}}`` (the default: layer-wise);
   * ``layer-wise unsharded``: no ``zero_optimization`` (Adam's moments whole on every holder);
   * ``DeepSpeed ZeRO-1``: ``{"zero_optimization": {"stage": 1, "layerwise": False}}`` (with bf16-mixed that
     is DeepSpeed's bf16 + ZeRO-1: ``DeepSpeedZeroOptimizer`` with bf16 parameters, fp32 masters and moments
     in flat partitions of each stage's data-parallel group).

   Measured: the median over ``--steps`` steps (after ``--warmup``) of the slowest rank's
   ``StepStats.step_ms``; the optimizer state the largest rank keeps (what its state carrier counts:
   Adam's moments, and DeepSpeed's fp32 masters, which the layer-wise engine does not need because
   its parameters are fp32), in MiB; and the peak resident set of the largest rank over its resident
   set before the first step (``VmHWM`` after a reset through ``/proc/self/clear_refs``), in MiB.

2. ``--part comm``: the two choices inside the layer-wise step, on 4 gloo processes, for a buffer the
   size of the demo model's parameters: the gradient reduction as one all-reduce vs a reduce-scatter
   (plus the second slice the neighbour copy needs), and keeping the neighbour copy by stepping it
   (Adam on 1/D of the parameters, local) vs sending it (the copy's two moments, 8 bytes per element,
   to the neighbour).

3. ``--part recovery``: bf16 + layer-wise ZeRO-1 on the demo model, P = 1 x D = 4, ``fail_stop`` on,
   rank 2 (the only primary of slice 2 of every layer) SIGKILLed at the forward of its 2nd
   micro-batch of step 2; the survivors' :class:`~resihp_lightning.failstop.recovery_record.RecoveryRecord`
   (the kill to the survivors' abort, regroup, plan, restore with the slice rebuild, the redone step, the
   moment slices sent), against the same run unsharded.

Run (an idle machine; timings on a shared one move by tens of percent between runs)::

    OMP_NUM_THREADS=1 python benchmarks/zero1_engine.py [--part engine|comm|recovery|all] [--steps 4] [--warmup 2] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _spawn import run_ranks  # noqa: E402  benchmarks/_spawn.py, next to this script
from bf16_engine import SHAPE, WORLD, _batches, _reset_peak, _rss_kib  # noqa: E402

ZERO1 = {"zero_optimization": {"stage": 1}}
ENGINE_VARIANTS = {
    "layer-wise ZeRO-1": ZERO1,
    "layer-wise unsharded": {},
    "DeepSpeed ZeRO-1": {"zero_optimization": {"stage": 1, "layerwise": False}},
}
PLANS = {"P=1 x D=4": 1, "P=2 x D=2": 2}


# ------------------------------------------------------------------------------------ part 1
def _engine_rank(rank: int, port: int, variant: str, pipeline_degree: int, micro_batches: int, seq_len: int,
                 warmup: int, steps: int, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1",
    )
    sys.stdout = sys.stderr
    import warnings

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from resihp_lightning.config import ScratchModelConfig
    from resihp_lightning.models import CausalLMPipelineModule
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    record: dict = {"rank": rank, "step_ms": [], "losses": [], "stepper": None}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, module):
            record["before_kib"] = _rss_kib("VmRSS")

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == warmup:
                _reset_peak()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            stats = trainer.strategy.last_step_stats
            record["losses"].append(float(outputs["loss"]))
            if trainer.global_step > warmup and stats is not None:
                record["step_ms"].append(stats.step_ms)
            runtime = trainer.strategy._state.runtime
            record["stepper"] = type(runtime.engine.optimizer).__name__
            record["state_mib"] = sum(runtime._carrier.state_bytes(runtime.engine, p)
                                      for p in runtime.local_parameters().values()) / 2**20

    module = CausalLMPipelineModule(scratch=ScratchModelConfig(**SHAPE), seed=0, learning_rate=1e-3)
    strategy = ResiHPStrategy(pipeline_degree=pipeline_degree, micro_batch_size=1, micro_batches=micro_batches,
                              deepspeed_config=ENGINE_VARIANTS[variant])
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, precision="bf16-mixed",
                         max_steps=warmup + steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, use_distributed_sampler=False, callbacks=[Probe()])
    trainer.fit(module, DataLoader(_batches(warmup + steps, micro_batches, seq_len), batch_size=None))
    record["peak_mib"] = (_rss_kib("VmHWM") - record["before_kib"]) / 1024
    queue.put(record)


def run_engine(micro_batches: int, seq_len: int, warmup: int, steps: int, repeats: int, variants: list[str]) -> None:
    print("4 processes, bf16-mixed | plan | optimizer step | step ms, slowest rank (median over runs) | "
          "optimizer state MiB, largest rank | peak MiB of the largest rank | last loss")
    print("---|---|---|---|---|---|---")
    for plan, degree in PLANS.items():
        for variant in variants:
            runs = []
            for _ in range(repeats):
                got = run_ranks(_engine_rank, (variant, degree, micro_batches, seq_len, warmup, steps), WORLD, WORLD,
                                timeout=1800)
                runs.append(sorted(got, key=lambda r: r["rank"]))
            step_ms = [statistics.median(max(r["step_ms"][i] for r in ranks) for i in range(len(ranks[0]["step_ms"])))
                       for ranks in runs]
            state = max(r["state_mib"] for r in runs[0])
            peak = [max(r["peak_mib"] for r in ranks) for ranks in runs]
            print(f"{variant} | {plan} | {runs[0][0]['stepper']} | {_spread(step_ms)} | {state:.1f} | {_spread(peak)} | "
                  f"{runs[0][-1]['losses'][-1]:.4f}", flush=True)


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

    print("bf16-mixed, P=1 x D=4, rank 2 SIGKILLed mid-step | kill to abort s | regroup s | plan s | restore s | redo s | "
          "MiB of moment slices sent (all survivors) | survivors' plan")
    print("---|---|---|---|---|---|---|---")
    for name, config in (("layer-wise ZeRO-1", ZERO1), ("layer-wise unsharded", {})):
        for _ in range(repeats):
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
            print(f"{name} | {detect:.2f} | {worst.regroup_s:.2f} | {worst.plan_s:.2f} | {worst.restore_s:.2f} | "
                  f"{worst.redo_s:.2f} | {sent:.1f} | {worst.plan.layout_key()}", flush=True)


def _spread(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:.0f}" if len(values) == 1 else f"{med:.0f} ({min(values):.0f}-{max(values):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("engine", "comm", "recovery", "all"), default="all")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--variants", nargs="*", default=list(ENGINE_VARIANTS), choices=list(ENGINE_VARIANTS),
                        help="part 1: which variants to run")
    args = parser.parse_args()
    print(f"demo model {SHAPE}; M = {args.micro_batches} rows of {args.seq_len} tokens; "
          f"{args.warmup} warm-up + {args.steps} timed steps; {args.repeats} run(s)\n", flush=True)
    if args.part in ("comm", "all"):
        run_comm(max(args.repeats, 5))
        print(flush=True)
    if args.part in ("engine", "all"):
        run_engine(args.micro_batches, args.seq_len, args.warmup, args.steps, args.repeats, args.variants)
        print(flush=True)
    if args.part in ("recovery", "all"):
        run_recovery(args.micro_batches, args.seq_len, args.repeats)


if __name__ == "__main__":
    main()
