"""Host memory of loading a Hugging Face checkpoint: per-stage vs whole-model load (not a test; issue 16).

Writes a local Llama-style checkpoint whose decoder layers dominate its size (default: 12 layers,
hidden 1024, intermediate 2816, vocabulary 4096; bf16 safetensors in 100 MB shards with an index, as
models ship), then, for each loading mode, runs ``Trainer(strategy=ResiHPStrategy(pipeline_degree=4))``
on 4 gloo processes (4 stages, one replica) with ``CausalLMPipelineModule(model_path=..., load=mode)``
(float32 parameters) and one training step. Each rank measures its resident set (``/proc/self/status``):

* after the imports it resets its peak (``echo 5 > /proc/self/clear_refs``) and notes its RSS (the
  baseline);
* ``load peak``: the peak RSS above the baseline from the module's construction through the strategy's
  setup (pipeline, engine and optimizer built, ``on_train_start``): what loading the weights cost;
* ``held``: the RSS above the baseline at ``on_train_start`` (what stays);
* ``step peak``: the peak RSS above the baseline at the end of ``fit`` (one step: gradients, Adam
  state and activations of the rank's own layers on top).

The per-stage / whole ratio of ``load peak`` is the figure of merit (target <= 40 %).

    python benchmarks/hf_loading.py [--layers 12] [--hidden 1024] [--intermediate 2816] [--vocab 4096]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

from _spawn import rank_environment, run_ranks  # benchmarks/_spawn.py, next to this script

WORLD = 4
MODES = ("whole", "per_stage")


def _status() -> dict[str, float]:
    """VmRSS and VmHWM of this process in MiB."""
    text = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+)", text).group(1)) / 1024 for key in ("VmRSS", "VmHWM")}


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def write_checkpoint(path: Path, layers: int, hidden: int, intermediate: int, vocab: int) -> float:
    """Writes the model (bf16, sharded, index) and returns its float32 size in MiB."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="100MB")
    return sum(p.numel() for p in model.parameters()) * 4 / 2**20


def _rank(rank: int, port: int, path: str, mode: str, queue) -> None:
    rank_environment(rank, port, WORLD)
    import warnings

    import lightning.pytorch as pl
    import torch
    import transformers
    from torch.utils.data import DataLoader

    from resihp_lightning.data import ByteTokenizer, PackedDataset, collate_packed, tokenize_documents
    from resihp_lightning.models.lightning_module import CausalLMPipelineModule
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    warnings.filterwarnings("ignore")
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    texts = [("abcdefghij" * 40)[: 37 + 11 * i] for i in range(16)]
    ds = PackedDataset(tokenize_documents(texts, ByteTokenizer()), seq_len=64, pad_token_id=256)
    batches = [collate_packed([ds[i] for i in range(4)])]
    numbers: dict[str, float] = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            now = _status()
            numbers["load_peak"] = now["VmHWM"] - numbers["baseline"]
            numbers["held"] = now["VmRSS"] - numbers["baseline"]
            numbers["layers"] = len(trainer.strategy.local_layers())

    torch.distributed.init_process_group("gloo")  # before the baseline: its buffers are no part of loading
    torch.distributed.barrier()
    numbers["reset"] = float(_reset_peak())
    numbers["baseline"] = _status()["VmRSS"] if numbers["reset"] else _status()["VmHWM"]
    started = time.perf_counter()
    module = CausalLMPipelineModule(model_path=path, load=mode)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=ResiHPStrategy(pipeline_degree=WORLD, micro_batch_size=1),
        max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, use_distributed_sampler=False, callbacks=[Probe()],
    )
    trainer.fit(module, DataLoader(batches, batch_size=None))
    numbers["step_peak"] = _status()["VmHWM"] - numbers["baseline"]
    numbers["seconds"] = time.perf_counter() - started
    queue.put((rank, numbers))


def run_mode(path: str, mode: str, timeout: float = 900.0) -> dict[int, dict[str, float]]:
    return dict(run_ranks(_rank, (path, mode), WORLD, WORLD, timeout))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        size = write_checkpoint(path, args.layers, args.hidden, args.intermediate, args.vocab)
        shards = len(list(path.glob("*.safetensors")))
        print(f"model: {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, vocab "
              f"{args.vocab}: {size:.0f} MiB in float32 ({shards} bf16 shards); {WORLD} processes, {WORLD} stages\n")
        results = {mode: run_mode(str(path), mode) for mode in MODES}
    print("| rank | layers held | whole: load peak | per stage: load peak | per stage / whole | whole: held | "
          "per stage: held | whole: step peak | per stage: step peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rank in range(WORLD):
        w, s = results["whole"][rank], results["per_stage"][rank]
        print(f"| {rank} | {int(s['layers'])} | {w['load_peak']:.0f} MiB | {s['load_peak']:.0f} MiB | "
              f"{100 * s['load_peak'] / w['load_peak']:.0f} % | {w['held']:.0f} MiB | {s['held']:.0f} MiB | "
              f"{w['step_peak']:.0f} MiB | {s['step_peak']:.0f} MiB |")
    worst = max(results["per_stage"][r]["load_peak"] / results["whole"][r]["load_peak"] for r in range(WORLD))
    print(f"\nworst rank: per-stage load peak = {100 * worst:.0f} % of a whole-model load (target <= 40 %)")
    if not all(results[m][r]["reset"] for m in MODES for r in range(WORLD)):
        print("note: /proc/self/clear_refs was not writable; peaks are above the post-import high-water mark",
              file=sys.stderr)


if __name__ == "__main__":
    main()
