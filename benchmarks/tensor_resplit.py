"""Tensor-parallel re-split (drop) cost: 4 -> 2 -> 1 and a 4 -> 3 request on the demo's Llama (not a test).

Runs ``Trainer(strategy=ResiHPStrategy(tensor_degree=4, pipeline_degree=1, micro_batch_size=1,
micro_batches=4))`` on 4 gloo processes (this machine's CPU) with a ``CausalLMPipelineModule`` of the
README demo's shape (``examples/configs/demo_cpu.yaml``: Llama, hidden 192, 6 decoder layers, 4
query heads, intermediate 512, rows of 1024 tokens; 8 pipeline layers with the embedding and the
head), EXCEPT that it has 4 key-value heads where the demo has 2: 2 KV heads cannot split 4 ways,
so the demo's model cannot run at TP-4 at all. The data are synthetic: random byte-token documents of
1000-3000 tokens packed into 1024-token rows (``resihp_lightning.data.PackedDataset``; most rows are
one document, as in the demo), nothing downloaded. Adam, plain fp32.

Each layout below is ONE 4-process job, so the ratios in a row come from one run:

* ``mixed`` (the headline: what "a group drops to degree k" means here): after the TP-4 steps,
  ``request_plan`` over the groups ``[[0, 1], [2], [3]]``: the TP-4 group goes on as a group of degree
  2 (ranks 0, 1), and the two ranks it dropped each form a group of degree 1 (tensor-parallel spares
  are not supported yet, so they must hold a group of their own). The plan is three data-parallel
  replicas of the whole model with 2, 1, 1 of the 4 micro-batches (each group's share of the work
  matches its degree). Then 2 -> 1: every rank alone, ``[[0], [1], [2], [3]]``, four replicas of 1;
  then back to one TP-4 group, so that the TP-4 reference is measured at both ends of the run.
* ``even``: the same with ``[[0, 1], [2, 3]]`` (the group splits into two groups of degree 2, 2
  micro-batches each), then 2 -> 1 as above. Both groups change degree, so this is a re-layout of the
  whole job rather than one group dropping members; it is run for comparison (other bytes moved),
  and also ends back at TP-4.
* ``4to3``: after the TP-4 steps, a request for ``[[0, 1, 2], [3]]`` (neither the 4 query / KV heads
  nor the 260-token vocabulary split 3 ways, and the module has no uneven splits); records whether ``request_plan`` refuses it, the step boundary drops it with a warning, or
  the job fails, and the message.

Measured per layout:

* step ms: median over the measured steps (after warm-up) of rank 0's ``last_step_stats.step_ms``
  (the re-split itself runs before the step's timer starts);
* busy ms / micro-batch: a group's member 0's busy compute per micro-batch (``StepStats``'s
  ``compute_ms``: the hooks around its own layers, the tensor-parallel all-reduces inside them
  included, waits for other stages excluded), median over the measured steps. ``b_t`` is the mean of
  the TP-4 group's at the start and at the end of the run; for a group of degree k, ``b_t / b_k`` is
  its speed as a fraction of the TP-4 group's, and ``(b_t / b_k) / (k / t)`` how it
  compares with the ideal k/t (1.0: the work scales exactly with the members; above 1: the dropped
  group saves the all-reduces it no longer runs);
* the re-split: ``strategy.last_migration`` on rank 0 (``seconds`` from the request being taken to
  the new engine ready, ``transfer_seconds`` of it the point-to-point exchange of the pieces, and
  ``bytes_moved`` summed over all ranks), and the largest ``seconds`` over the ranks; ``bytes_moved`` is
  checked against the pieces of the split tensors (weights + Adam's two moments) that each new member
  did not hold before.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/tensor_resplit.py [--layouts mixed,even,4to3]
        [--warmup 2] [--steps 6]

About 1-2 min per layout on a 2-core machine (35 s for ``4to3``), depending on its load. Prints one
markdown table, then the 4 -> 3 outcome.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

from _spawn import rank_environment, run_ranks  # benchmarks/_spawn.py, next to this script

WORLD = 4
TENSOR_DEGREE = 4
MICRO_BATCHES = 4
SEQ_LEN = 1024
#: The demo's Llama (examples/configs/demo_cpu.yaml) with 4 key-value heads instead of 2.
SHAPE = dict(model_type="llama", hidden_size=192, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=512)
LAYERS = SHAPE["num_hidden_layers"] + 2  # + embedding and head

#: layout -> the phases after TP-4: (label, tensor groups, replicas as (group, micro-batches)).
#: Both measuring layouts end back at TP-4, so that the TP-4 reference is measured at both ends of the run
#: (the machine's load drifts; the ratios use the mean of the two).
BACK = ("1 -> 4 (back)", [[0, 1, 2, 3]], [(0, MICRO_BATCHES)])
LAYOUTS = {
    "mixed": [
        ("4 -> 2", [[0, 1], [2], [3]], [(0, 2), (1, 1), (2, 1)]),
        ("2 -> 1", [[0], [1], [2], [3]], [(0, 1), (1, 1), (2, 1), (3, 1)]),
        BACK,
    ],
    "even": [
        ("4 -> 2", [[0, 1], [2, 3]], [(0, 2), (1, 2)]),
        ("2 -> 1", [[0], [1], [2], [3]], [(0, 1), (1, 1), (2, 1), (3, 1)]),
        BACK,
    ],
    "4to3": [
        ("4 -> 3", [[0, 1, 2], [3]], [(0, 3), (1, 1)]),
    ],
}


def _plan_dict(replicas) -> dict:
    return {"replicas": [{"devices": [g], "bounds": [0, LAYERS], "micro_batches": m} for g, m in replicas]}


def _shard(member: int, degree: int) -> tuple[float, float]:
    return member / degree, (member + 1) / degree


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def lacking_fraction(old: list[list[int]], new: list[list[int]]) -> float:
    """Sum over the ranks of the share of a split tensor a rank needs under ``new`` and did not hold under
    ``old`` (every group holds every layer in these layouts)."""
    def ranges(groups):
        return {r: _shard(i, len(g)) for g in groups for i, r in enumerate(g)}

    before, after = ranges(old), ranges(new)
    return sum((after[r][1] - after[r][0]) - _overlap(before[r], after[r]) for r in after)


def _batches(count: int, seed: int) -> list[dict]:
    import torch

    from resihp_lightning.data import ByteTokenizer, PackedDataset, collate_packed

    rng = torch.Generator().manual_seed(seed)
    eos = ByteTokenizer.eos_token_id
    docs = []
    while sum(len(d) for d in docs) < count * MICRO_BATCHES * SEQ_LEN:
        n = int(torch.randint(1000, 3000, (1,), generator=rng))
        docs.append(torch.randint(0, 256, (n,), generator=rng).tolist() + [eos])
    ds = PackedDataset(docs, seq_len=SEQ_LEN, pad_token_id=ByteTokenizer.pad_token_id)
    rows = [ds[i] for i in range(count * MICRO_BATCHES)]
    return [collate_packed(rows[i * MICRO_BATCHES:(i + 1) * MICRO_BATCHES]) for i in range(count)]


def _rank(rank: int, port: int, layout: str, warmup: int, steps: int, queue) -> None:
    rank_environment(rank, port, WORLD)
    import warnings

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    import resihp_lightning  # noqa: F401 - registers the strategy
    from resihp_lightning.config import ScratchModelConfig
    from resihp_lightning.models import CausalLMPipelineModule
    from resihp_lightning.plan import Plan
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    torch.set_num_threads(1)
    caught: list[str] = []

    def note(message, category, filename, lineno, file=None, line=None):  # keep the warnings, print none
        caught.append(f"{category.__name__}: {message}")

    warnings.showwarning = note
    phases = LAYOUTS[layout]
    # Phase p runs from step starts[p] + 1 (1-based); its first `warmup` steps (1 after a re-split) are not measured.
    per_phase = [warmup + steps] + [1 + steps] * len(phases)
    if layout == "4to3":
        per_phase = [warmup, 2]
    starts = [sum(per_phase[:p]) for p in range(len(per_phase))]
    total = sum(per_phase)
    records: dict = {"rank": rank, "steps": [], "migrations": [], "requests": [], "warnings": caught, "error": None}

    class Driver(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            strategy = trainer.strategy
            stats = strategy.last_step_stats
            step = trainer.global_step
            phase = max(p for p in range(len(starts)) if starts[p] < step)
            if stats is not None:
                records["steps"].append({
                    "step": step, "phase": phase, "device": stats.rank, "step_ms": stats.step_ms,
                    "busy_ms": [mb.compute_ms for mb in stats.micro_batches],
                    "measured": step > starts[phase] + (warmup if phase == 0 else 1),
                })
            migration = strategy.last_migration
            if migration is not None and (not records["migrations"] or records["migrations"][-1]["id"] != id(migration)):
                records["migrations"].append({"id": id(migration), "step": step, "seconds": migration.seconds,
                                              "bytes_moved": migration.bytes_moved,
                                              "transfer_seconds": migration.transfer_seconds,
                                              "rebuild_seconds": migration.rebuild_seconds})
            nxt = phase + 1
            if nxt < len(starts) and step == starts[nxt]:
                label, groups, replicas = phases[nxt - 1]
                try:
                    strategy.request_plan(Plan.from_dict(_plan_dict(replicas)), tensor_groups=groups)
                    records["requests"].append({"label": label, "step": step, "accepted": True, "error": None})
                except Exception as err:  # noqa: BLE001 - the benchmark records what the library does
                    records["requests"].append({"label": label, "step": step, "accepted": False,
                                                "error": f"{type(err).__name__}: {err}"})

    module = CausalLMPipelineModule(scratch=ScratchModelConfig(**SHAPE), seed=0, learning_rate=1e-3)
    strategy = ResiHPStrategy(tensor_degree=TENSOR_DEGREE, pipeline_degree=1, micro_batch_size=1,
                              micro_batches=MICRO_BATCHES)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=total, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False, callbacks=[Driver()],
    )
    try:
        trainer.fit(module, DataLoader(_batches(total, seed=2026), batch_size=None))
    except Exception as err:  # noqa: BLE001
        records["error"] = f"{type(err).__name__}: {err}"
        records["traceback"] = traceback.format_exc()
    records["steps_run"] = trainer.global_step
    queue.put(records)
    if records["error"] is not None:
        queue.close()
        queue.join_thread()  # the record must leave before the process does
        os._exit(0)  # the job's groups are in an unknown state: do not wait in their teardown


def run_layout(layout: str, warmup: int, steps: int, timeout: float = 900.0) -> list[dict]:
    got = run_ranks(_rank, (layout, warmup, steps), WORLD, WORLD, timeout)
    return sorted(got, key=lambda r: r["rank"])


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _busy_per_mb(ranks: list[dict], rank: int, phase: int) -> float:
    """Median over the measured steps of ``rank``'s busy ms per micro-batch in ``phase``."""
    per_step = [sum(s["busy_ms"]) / len(s["busy_ms"]) for s in ranks[rank]["steps"]
                if s["phase"] == phase and s["measured"] and s["busy_ms"]]
    return _median(per_step)


def _split_elements() -> int:
    """Elements of the split parameters (everything but the norms, which every member holds whole)."""
    from resihp_lightning.config import ScratchModelConfig
    from resihp_lightning.models import CausalLMPipelineModule

    module = CausalLMPipelineModule(scratch=ScratchModelConfig(**SHAPE), seed=0)
    return sum(p.numel() for name, p in module.named_parameters() if "norm" not in name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default="mixed,even,4to3", help=f"comma-separated, from {list(LAYOUTS)}")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured TP-4 steps at the start (1 after each re-split)")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per phase")
    args = parser.parse_args(argv)
    split = _split_elements()
    per_element = 4 + 8  # fp32 weight + Adam's two moments
    print(f"model: demo Llama with 4 KV heads, {split / 1e6:.2f} M split parameters; "
          f"TP-4 state of one whole copy {split * per_element / 2**20:.1f} MiB; M = {MICRO_BATCHES} rows of {SEQ_LEN}\n")
    rows, notes = [], []
    print(f"<!-- load average at start: {os.getloadavg()[0]:.1f} -->", file=sys.stderr)
    for layout in args.layouts.split(","):
        start = time.perf_counter()
        ranks = run_layout(layout, args.warmup, args.steps)
        wall = time.perf_counter() - start
        print(f"<!-- {layout}: job {wall:.0f} s, load average {os.getloadavg()[0]:.1f} -->", file=sys.stderr)
        failed = [r for r in ranks if r["error"]]
        if layout == "4to3":
            req = ranks[0]["requests"]
            outcome = (f"request_plan: {'accepted' if req and req[0]['accepted'] else 'refused: ' + (req[0]['error'] if req else '?')}; "
                       f"job: {'FAILED at step ' + str(ranks[0]['steps_run'] + 1) + ': ' + failed[0]['error'] if failed else 'went on'}")
            warned = sorted({w for r in ranks for w in r["warnings"] if "plan" in w or "tensor" in w.lower()})
            notes.append((layout, outcome, warned, failed[0].get("traceback") if failed else None))
            continue
        if failed:
            raise RuntimeError(f"{layout}: {failed[0]['error']}\n{failed[0].get('traceback')}")
        r0 = ranks[0]
        step_ms = [_median([s["step_ms"] for s in r0["steps"] if s["phase"] == p and s["measured"]])
                   for p in range(len(LAYOUTS[layout]) + 1)]
        first_ms = [next((s["step_ms"] for s in r0["steps"] if s["phase"] == p), float("nan"))
                    for p in range(len(LAYOUTS[layout]) + 1)]
        last = len(LAYOUTS[layout])
        b4_ends = (_busy_per_mb(ranks, 0, 0), _busy_per_mb(ranks, 0, last))
        b4 = statistics.mean(b4_ends)
        old = [[0, 1, 2, 3]]
        for p, (label, groups, replicas) in enumerate(LAYOUTS[layout], start=1):
            mig = [r["migrations"][p - 1] for r in ranks]  # one re-split per phase, in order
            expected = round(lacking_fraction(old, groups) * split * per_element)
            # groups by degree: member 0 of each group reports its busy time
            by_degree: dict[int, list[float]] = {}
            for g in groups:
                by_degree.setdefault(len(g), []).append(_busy_per_mb(ranks, g[0], p))
            if p == last:  # back at TP-4: the reference's second end
                by_degree = {}
            speed = "; ".join(
                f"k={k}: {statistics.mean(v):.0f} ms, {b4 / statistics.mean(v):.2f} of TP-4, {b4 / statistics.mean(v) / (k / TENSOR_DEGREE):.2f} x k/t"
                for k, v in sorted(by_degree.items(), reverse=True)
            )
            rows.append(
                f"| {layout} | {label} | {[list(g) for g in groups]} | {[m for _, m in replicas]} | "
                f"{mig[0]['bytes_moved'] / 2**20:.2f} MiB | "
                f"{'yes' if mig[0]['bytes_moved'] == expected else f'NO ({expected / 2**20:.2f} MiB)'} | "
                f"{mig[0]['seconds']:.3f} | {mig[0]['transfer_seconds']:.3f} | {max(m['seconds'] for m in mig):.3f} | "
                f"{step_ms[p - 1]:.0f} -> {step_ms[p]:.0f} ({step_ms[p] / step_ms[p - 1]:.2f}x) | {first_ms[p]:.0f} | "
                f"{b4_ends[0]:.0f}, {b4_ends[1]:.0f} | {speed or '-'} |"
            )
            old = groups
    print("| layout | re-split | groups after | micro-batches | bytes moved | = pieces members lacked | "
          "seconds (rank 0) | p2p s | max seconds over ranks | step ms before -> after | first step after ms | "
          "TP-4 busy ms / mb (start, end) | after, per degree k: busy ms / mb, speed as a fraction of TP-4, that over k/t |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    for layout, outcome, warned, tb in notes:
        print(f"\n{layout}: {outcome}")
        for w in warned:
            print(f"  warning: {w}")
        if tb:
            print("  traceback (rank 0):\n" + "\n".join("    " + line for line in tb.rstrip().splitlines()[-24:]))


if __name__ == "__main__":
    main()
