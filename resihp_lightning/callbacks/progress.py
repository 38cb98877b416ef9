"""Per-step run record (``steps.jsonl``) and a progress bar that shows tokens/s and the plan in force.

:class:`StepRecorder` writes one JSON line per training step on rank 0 into ``<run_dir>/steps.jsonl``
(the file :mod:`resihp_lightning.report` reads next to ``events.jsonl``):

============ ==================================================================================
key          meaning
============ ==================================================================================
step         index of the step that ran (0 for the first; ``trainer.global_step`` during it, the
             numbering the fault injector and the detector use)
time         Unix seconds at the end of the step
wall_ms      wall time since the previous step's end (the first: since training started) —
             everything the job spent on the step, callbacks and re-plans included
step_ms      rank 0's ``engine.train_batch`` time (the strategy's ``last_step_stats``)
tokens       real tokens of the global batch (padding excluded; 0 when the batch carries no
             ``seq_lens``, i.e. the count is not known)
loss         the step's training loss
P, D         pipeline and data degree of the plan the step ran under
micro        micro-batches per replica under that plan
world        processes in the job (tensor-parallel members and hot spares included)
migrated     whether a re-plan was applied at the start of this step
============ ==================================================================================

:class:`ResiHPProgressBar` is Lightning's TQDM bar plus ``tok/s`` (over the last few steps, shown
only when the batches carry sequence lengths) and ``plan`` (P×D, with the per-replica micro-batch
counts when they differ).

Both read the plan in force and the last migration, so they need the re-planning strategy
(:class:`~resihp_lightning.contract.Replannable`, checked at ``setup``; ``Trainer(strategy="resihp")``).
With another strategy use Lightning's own ``TQDMProgressBar``. Neither saves state in checkpoints:
they only report (``tok/s`` restarts its window after a resume).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from typing_extensions import override

from resihp_lightning.contract import MigrationRecord, Replannable, require
from resihp_lightning.errors import ConfigError
from resihp_lightning.plan import Plan, layout_label

STEPS_FILE = "steps.jsonl"


def _plan_fields(plan: Plan) -> dict[str, Any]:
    return {"P": plan.pipeline_degree, "D": plan.data_degree, "micro": [r.micro_batches for r in plan.replicas]}


def plan_label(record: dict[str, Any]) -> str:
    """``"2x2"``, or ``"2x2 [3,5]"`` when the replicas run different micro-batch counts."""
    return layout_label(record["P"], record["D"], record.get("micro") or [])


class StepRecorder(Callback):
    """Records every training step (rank 0 writes ``<run_dir>/steps.jsonl``).

    Args:
        run_dir: the run directory (``None``: keep the records in memory only).
        window: steps averaged for :attr:`tokens_per_s`.
    """

    def __init__(self, run_dir: str | Path | None = None, window: int = 5) -> None:
        self.path = None if run_dir is None else Path(run_dir) / STEPS_FILE
        self.records: list[dict[str, Any]] = []
        self.rank = 0
        self._recent: deque[tuple[int, float]] = deque(maxlen=max(window, 1))  # steps with known tokens
        self._last_end: float | None = None
        self._last_migration: MigrationRecord | None = None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second over the last ``window`` steps whose token count is known (``None`` when
        there is none: before the first step, or for batches without ``seq_lens``)."""
        if not self._recent:
            return None
        seconds = sum(ms for _, ms in self._recent) / 1000.0
        return sum(t for t, _ in self._recent) / seconds if seconds > 0 else None

    @property
    def last(self) -> dict[str, Any] | None:
        return self.records[-1] if self.records else None

    def _keep_steps_before(self, step: int) -> None:
        """Keeps the file's records of steps before ``step`` (a run resumed from a checkpoint at ``step``
        keeps its history; steps it will redo, and everything of a fresh run, are dropped)."""
        assert self.path is not None
        kept = []
        if step > 0 and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if (_step_of(line) or 0) < step and line.strip()]
        self.path.write_text("".join(line + "\n" for line in kept))

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        require(trainer.strategy, Replannable, "StepRecorder")
        self.rank = trainer.global_rank
        if self.path is not None and self.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        strategy: Replannable = trainer.strategy
        if self.path is not None and self.rank == 0:
            self._keep_steps_before(int(trainer.global_step))
        self._last_end = time.perf_counter()
        self._last_migration = strategy.last_migration

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy: Replannable = trainer.strategy
        self.rank = trainer.global_rank  # it changes when lost ranks' survivors regroup
        now = time.perf_counter()
        wall_ms = (now - (self._last_end or now)) * 1000.0
        self._last_end = now
        stats = strategy.last_step_stats
        migration = strategy.last_migration
        migrated = migration is not None and migration is not self._last_migration
        self._last_migration = migration
        tokens = _tokens(batch)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        record = {
            "step": int(trainer.global_step) - 1,
            "time": time.time(),
            "wall_ms": wall_ms,
            "step_ms": None if stats is None else float(stats.step_ms),
            "tokens": 0 if tokens is None else tokens,
            "loss": None if loss is None else float(loss.detach().float()) if torch.is_tensor(loss) else float(loss),
            **_plan_fields(strategy.current_plan),
            "world": int(trainer.world_size),  # processes (TP members and spares included)
            "migrated": migrated,
        }
        self.records.append(record)
        if tokens is not None:
            self._recent.append((tokens, wall_ms))
        if self.path is not None and self.rank == 0:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _tokens(batch: Any) -> int | None:
    """Real tokens of a packed batch (its ``seq_lens``); ``None`` when the batch does not say."""
    if isinstance(batch, Mapping) and "seq_lens" in batch:
        return int(batch["seq_lens"].to(torch.long).sum())
    return None


class ResiHPProgressBar(TQDMProgressBar):
    """Lightning's progress bar plus ``tok/s`` and the current ``plan`` (P×D).

    Args:
        recorder: the job's :class:`StepRecorder` (put it before the bar in ``callbacks``).
        refresh_rate: as for ``TQDMProgressBar``.
    """

    def __init__(self, recorder: StepRecorder, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.recorder = recorder

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        callbacks = list(trainer.callbacks)
        if not any(cb is self.recorder for cb in callbacks):
            raise ConfigError("ResiHPProgressBar(recorder) needs that StepRecorder in Trainer(callbacks=[...]) too")
        if callbacks.index(self.recorder) > callbacks.index(self):
            raise ConfigError("put the StepRecorder before the ResiHPProgressBar in Trainer(callbacks=[...])")

    @override
    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        rate = self.recorder.tokens_per_s
        if rate is not None:
            metrics["tok/s"] = f"{rate:.0f}"
        last = self.recorder.last
        if last is not None:
            metrics["plan"] = plan_label(last)
        return metrics
