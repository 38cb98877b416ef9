"""The tensor-parallel toy job that the re-split and fail-stop tests train, and its one-process reference.

A scratch Llama of 4 pipeline layers (embedding, 2 decoder layers, head) whose heads, key-value heads,
MLP width and vocabulary split 1, 2 or 4 ways, trained with Adam on packed byte-level rows; the
reference trains the unsplit model in one plain process, one micro-batch per row, as the job runs them.
"""

from __future__ import annotations

from typing import Any

import torch

LR = 1e-2
#: Split matmuls sum in another order, and Adam divides each gradient by its own running scale, so an
#: element with a near-zero gradient moves by round-off times the learning rate: weights agree to 1% of
#: one step's update (a wrong shard or a missing sum is off by whole updates, 1e-2).
WEIGHT_ATOL = 1e-4
#: Losses agree to this (the same round-off, before Adam amplifies it).
LOSS_ATOL = 2e-5


def tensor_parallel_llama() -> Any:
    """A ``CausalLMPipelineModule`` that splits over 1, 2 or 4 processes (4 heads, 4 key-value heads, MLP 64,
    vocabulary 260), initialised from its own seed."""
    from resihp_lightning.config import ScratchModelConfig
    from resihp_lightning.models import CausalLMPipelineModule

    shape = ScratchModelConfig(model_type="llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=4, intermediate_size=64)
    return CausalLMPipelineModule(scratch=shape, seed=11, learning_rate=LR, weight_decay=0.1)


def packed_batches(steps: int, rows: int = 4, seq_len: int = 20) -> list[dict]:
    """``steps`` global batches of ``rows`` packed rows of random lowercase documents (fixed seeds)."""
    from resihp_lightning.data import ByteTokenizer, PackedDataset, collate_packed, tokenize_documents

    out = []
    for step in range(steps):
        rng = torch.Generator().manual_seed(300 + step)
        texts = ["".join(chr(97 + int(c)) for c in torch.randint(0, 26, (n,), generator=rng)) for n in (7, 19, 33, 4, 50)]
        ds = PackedDataset(tokenize_documents(texts, ByteTokenizer()), seq_len=seq_len, pad_token_id=256)
        out.append(collate_packed([ds[i] for i in range(rows)]))
    return out


def document_batches(steps: int, rows: int = 4, seq_len: int = 24) -> list[dict]:
    """``steps`` global batches of ``rows`` packed rows (``seq_len`` tokens each) of random lowercase
    documents of mixed lengths, enough of them for any ``rows x seq_len`` (fixed seeds)."""
    from resihp_lightning.data import ByteTokenizer, PackedDataset, collate_packed, tokenize_documents

    out = []
    for step in range(steps):
        rng = torch.Generator().manual_seed(100 + step)
        lengths = (5, 17, 3, 30, 9, 44, 2, 12, 21, 6) * max(1, rows * seq_len // 100)
        texts = ["".join(chr(97 + int(c)) for c in torch.randint(0, 26, (n,), generator=rng)) for n in lengths]
        ds = PackedDataset(tokenize_documents(texts, ByteTokenizer()), seq_len=seq_len, pad_token_id=256)
        out.append(collate_packed([ds[i] for i in range(rows)]))
    return out


def unsplit_reference(
    steps: int, clip: float | None = None, autocast: torch.dtype | None = None, rows: int = 4, seq_len: int = 20
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process trains the unsplit :func:`tensor_parallel_llama` on :func:`packed_batches` (of ``rows`` x
    ``seq_len``): the loss of every step and the final weights (with ``clip``: global-norm clipping, which
    must bind every step; with ``autocast``: each row's forward and loss under ``torch.autocast`` of that
    dtype, as ``bf16-mixed``)."""
    module = tensor_parallel_llama()
    layers = module.pipeline_layers()
    optimizer = module.configure_optimizers()
    losses = []
    for batch in packed_batches(steps, rows, seq_len):
        count = batch["input_ids"].shape[0]
        loss = torch.zeros(())
        for row in range(count):
            outputs, labels, _ = module.pipeline_batch({k: v[row:row + 1] for k, v in batch.items()})
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                for layer in layers:
                    outputs = layer(outputs)
                loss = loss + module.pipeline_loss(outputs, labels) / count
        optimizer.zero_grad()
        loss.backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            assert norm > clip, "the clipping must change the step"
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


def kill_inside_step(rank: int, victim: int, at_step: int, run_dir: str) -> Any:
    """A callback that records every step's loss (``.losses``) and SIGKILLs rank ``victim`` at the forward of
    its 2nd micro-batch of step ``at_step`` (its last words go to ``run_dir`` first)."""
    import os
    import signal
    import time

    import lightning.pytorch as pl

    from resihp_lightning.testing.harness import last_words

    class KillInsideStep(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if rank != victim or trainer.global_step != at_step:
                return
            seen = [0]

            def die(module: Any, args: Any) -> None:
                seen[0] += 1
                if seen[0] == 2:
                    last_words(run_dir, rank, died_at=time.monotonic())
                    os.kill(os.getpid(), signal.SIGKILL)

            next(iter(trainer.strategy.local_layers().values())).register_forward_pre_hook(die)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.losses.append(float(outputs["loss"]))

    return KillInsideStep()
