"""bf16 mixed precision: autocast vs bf16 working copies, and the layer-wise engine vs DeepSpeed's wrapper.

Not a test, not run by CI. Two measurements on the README demo's model (Llama-style, hidden 192, 6
decoder layers, 4 query / 2 key-value heads, intermediate 512, byte vocabulary; embedding and head as
pipeline layers) with synthetic byte-token rows of ``--seq-len`` tokens, AdamW (lr 1e-3):

1. ``--part compute`` (the design choice, one process, one thread): one step = ``--micro-batches``
   forward + backward passes of one row each, then the optimizer step, under

   * ``fp32``: fp32 parameters, no autocast (the baseline);
   * ``autocast``: fp32 parameters (they are the masters), forward and loss under
     ``torch.autocast(dtype=torch.bfloat16)``, AdamW on the parameters: what the layer-wise engine runs;
   * ``working copies``: the model's parameters in bf16, fp32 master copies kept beside them; forward
     and backward in bf16 (the logits cast to fp32 for the loss), each bf16 gradient copied into its
     master's fp32 ``.grad``, AdamW on the masters, the masters copied back into the bf16 parameters.

2. ``--part engine`` (4 spawned gloo processes, one thread each, P = 2 x D = 2 with shared bounds,
   ``ResiHPStrategy(pipeline_degree=2, micro_batch_size=1, micro_batches=M)``, Lightning's Trainer):

   * ``layer-wise bf16``: ``Trainer(precision="bf16-mixed")``, the strategy's default bf16 path;
   * ``DeepSpeed bf16``: the same plus ``deepspeed_config={"bf16": {"enabled": True}}`` (DeepSpeed's
     ``BF16_Optimizer``: bf16 parameters, fp32 masters and moments in flat partitions);
   * ``fp32``: ``Trainer(precision="32-true")``.

What is measured: the median step time over ``--steps`` steps after ``--warmup`` untimed ones (part 2:
the slowest rank's ``StepStats.step_ms``), and the peak memory of the training steps. This machine has
no accelerator, so memory is the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` after the warm-up) minus its resident set before the model was built (part 1)
or before the first step (part 2): weights, gradients, optimizer state, activations and allocator
slack together, in MiB; part 2 gives the largest rank. Each variant runs in fresh processes, one
after the other, so variants do not share an allocator; ``--repeats N`` runs every variant N times in
rotated order and reports the median and range of the per-run numbers. Run it on an idle machine:
timings on a shared one move by tens of percent between runs.

Run::

    OMP_NUM_THREADS=1 python benchmarks/bf16_engine.py [--part compute|engine|both] [--steps 5] [--warmup 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import statistics
import sys
import time

from _spawn import rank_environment, run_ranks  # benchmarks/_spawn.py, next to this script

SHAPE = dict(model_type="llama", hidden_size=192, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512)
WORLD = 4
COMPUTE_VARIANTS = ("fp32", "autocast", "working copies")
ENGINE_VARIANTS = {
    "layer-wise bf16": ("bf16-mixed", {}),
    "DeepSpeed bf16": ("bf16-mixed", {"bf16": {"enabled": True}}),
    "fp32": ("32-true", {}),
}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+)", status.read()).group(1))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _batches(count: int, micro_batches: int, seq_len: int, seed: int = 2026) -> list[dict]:
    import torch

    from resihp_lightning.data import ByteTokenizer, PackedDataset, collate_packed

    rng = torch.Generator().manual_seed(seed)
    eos = ByteTokenizer.eos_token_id
    docs: list[list[int]] = []
    while sum(len(d) for d in docs) < count * micro_batches * seq_len:
        n = int(torch.randint(200, 3000, (1,), generator=rng))
        docs.append(torch.randint(0, 256, (n,), generator=rng).tolist() + [eos])
    ds = PackedDataset(docs, seq_len=seq_len, pad_token_id=ByteTokenizer.pad_token_id)
    rows = [ds[i] for i in range(count * micro_batches)]
    return [collate_packed(rows[i * micro_batches:(i + 1) * micro_batches]) for i in range(count)]


# ------------------------------------------------------------------------------------ part 1
def _compute_variant(variant: str, micro_batches: int, seq_len: int, warmup: int, steps: int, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    from resihp_lightning.config import ScratchModelConfig
    from resihp_lightning.data import collate_packed  # noqa: F401 - imported before the baseline RSS
    from resihp_lightning.models import CausalLMPipelineModule

    torch.set_num_threads(1)
    singles = _batches((warmup + steps) * micro_batches, 1, seq_len)  # one row per micro-batch
    rows = [singles[i * micro_batches:(i + 1) * micro_batches] for i in range(warmup + steps)]
    before = _rss_kib("VmRSS")
    module = CausalLMPipelineModule(scratch=ScratchModelConfig(**SHAPE), seed=0, learning_rate=1e-3)
    layers = torch.nn.ModuleList(module.pipeline_layers())
    if variant == "working copies":
        layers.to(torch.bfloat16)
        params = [p for p in layers.parameters() if p.requires_grad]
        masters = [p.detach().float().clone().requires_grad_(True) for p in params]
        optimizer = torch.optim.AdamW(masters, lr=1e-3)
    else:
        optimizer = torch.optim.AdamW(layers.parameters(), lr=1e-3)
    autocast = variant == "autocast"

    def step(batch: list[dict]) -> float:
        total = 0.0
        for row in batch:
            inputs, labels, _ = module.pipeline_batch(row)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = inputs
                for layer in layers:
                    out = layer(out)
                loss = module.pipeline_loss(out.float() if variant == "working copies" else out, labels)
            (loss / micro_batches).backward()
            total += float(loss.detach()) / micro_batches
        if variant == "working copies":
            for master, param in zip(masters, params):
                master.grad = param.grad.float()
                param.grad = None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if variant == "working copies":
            with torch.no_grad():
                for master, param in zip(masters, params):
                    param.copy_(master)
        return total

    times, losses = [], []
    for i, batch in enumerate(rows):
        if i == warmup:
            _reset_peak()
        start = time.perf_counter()
        losses.append(step(batch))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    queue.put({"variant": variant, "step_ms": [t * 1000 for t in times], "peak_mib": (_rss_kib("VmHWM") - before) / 1024,
               "losses": losses})


def _rotations(names: list[str], repeats: int) -> list[str]:
    """``names`` ``repeats`` times, each round starting one further (load drift hits every variant alike)."""
    return [name for r in range(repeats) for name in names[r % len(names):] + names[:r % len(names)]]


def run_compute(micro_batches: int, seq_len: int, warmup: int, steps: int, repeats: int) -> dict[str, list[dict]]:
    ctx = multiprocessing.get_context("spawn")
    out: dict[str, list[dict]] = {name: [] for name in COMPUTE_VARIANTS}
    for variant in _rotations(list(COMPUTE_VARIANTS), repeats):
        queue = ctx.Queue()
        proc = ctx.Process(target=_compute_variant, args=(variant, micro_batches, seq_len, warmup, steps, queue))
        proc.start()
        out[variant].append(queue.get(timeout=1800))
        proc.join(60)
    return out


# ------------------------------------------------------------------------------------ part 2
def _engine_rank(rank: int, port: int, variant: str, micro_batches: int, seq_len: int, warmup: int, steps: int,
                 queue) -> None:
    rank_environment(rank, port, WORLD)
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
    precision, config = ENGINE_VARIANTS[variant]
    record: dict = {"rank": rank, "variant": variant, "step_ms": [], "losses": [], "engine": None}

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
            record["engine"] = type(trainer.strategy._state.runtime.engine).__name__

    module = CausalLMPipelineModule(scratch=ScratchModelConfig(**SHAPE), seed=0, learning_rate=1e-3)
    strategy = ResiHPStrategy(pipeline_degree=2, micro_batch_size=1, micro_batches=micro_batches, deepspeed_config=config)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, precision=precision,
                         max_steps=warmup + steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, use_distributed_sampler=False, callbacks=[Probe()])
    trainer.fit(module, DataLoader(_batches(warmup + steps, micro_batches, seq_len), batch_size=None))
    record["peak_mib"] = (_rss_kib("VmHWM") - record["before_kib"]) / 1024
    queue.put(record)


def run_engine(micro_batches: int, seq_len: int, warmup: int, steps: int, repeats: int) -> dict[str, list[list[dict]]]:
    """variant -> one list of rank records per repeat."""
    out: dict[str, list[list[dict]]] = {name: [] for name in ENGINE_VARIANTS}
    for variant in _rotations(list(ENGINE_VARIANTS), repeats):
        got = run_ranks(_engine_rank, (variant, micro_batches, seq_len, warmup, steps), WORLD, WORLD, timeout=1800)
        out[variant].append(sorted(got, key=lambda r: r["rank"]))
    return out


def _spread(values: list[float]) -> str:
    """``median (min-max)`` of per-run values."""
    med = statistics.median(values)
    return f"{med:.0f}" if len(values) == 1 else f"{med:.0f} ({min(values):.0f}-{max(values):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("compute", "engine", "both"), default="both")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs of every variant, in rotated order")
    args = parser.parse_args()
    print(f"demo model {SHAPE}; M = {args.micro_batches} rows of {args.seq_len} tokens; "
          f"{args.warmup} warm-up + {args.steps} timed steps; {args.repeats} run(s) per variant, median (min-max) over runs\n")
    if args.part in ("compute", "both"):
        results = run_compute(args.micro_batches, args.seq_len, args.warmup, args.steps, args.repeats)
        medians = {name: [statistics.median(run["step_ms"]) for run in runs] for name, runs in results.items()}
        base = statistics.median(medians["fp32"])
        print("one process, one thread | step ms | x fp32 | peak MiB over the pre-model RSS | last loss")
        print("---|---|---|---|---")
        for name, runs in results.items():
            print(f"{name} | {_spread(medians[name])} | {statistics.median(medians[name]) / base:.2f} | "
                  f"{_spread([run['peak_mib'] for run in runs])} | {runs[0]['losses'][-1]:.4f}")
        print()
    if args.part in ("engine", "both"):
        results = run_engine(args.micro_batches, args.seq_len, args.warmup, args.steps, args.repeats)
        step_ms, peak = {}, {}
        for name, runs in results.items():
            step_ms[name] = [statistics.median(max(r["step_ms"][i] for r in ranks) for i in range(len(ranks[0]["step_ms"])))
                             for ranks in runs]
            peak[name] = [max(r["peak_mib"] for r in ranks) for ranks in runs]
        base = statistics.median(step_ms["layer-wise bf16"])
        print("4 processes, P=2 x D=2 | engine class | step ms (slowest rank) | x layer-wise | "
              "peak MiB of the largest rank | last loss")
        print("---|---|---|---|---|---")
        for name, runs in results.items():
            print(f"{name} | {runs[0][0]['engine']} | {_spread(step_ms[name])} | {statistics.median(step_ms[name]) / base:.2f} | "
                  f"{_spread(peak[name])} | {runs[0][-1]['losses'][-1]:.4f}")


if __name__ == "__main__":
    main()
