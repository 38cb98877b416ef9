"""Validation, test and predict steps of :class:`~resihp_lightning.strategy.strategy.ResiHPStrategyMixin`.

Lightning calls them per batch; each deals the batch out to the replicas and joins the results
(:mod:`~resihp_lightning.runtime.eval_passes`), so that every rank sees what one device would: the
mean loss over rows (logged as ``val_loss`` / ``test_loss``) or the last layer's outputs for every
row. With fail-stop recovery a hot spare returns what the members computed; under tensor parallelism
the last stage's members join their split outputs first.

The strategy declares the state used here in its ``__init__`` and ``setup`` (``_runtime``, ``_job``,
``_tensor``, ``_loss_log``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from resihp_lightning.runtime import batching, eval_passes
from resihp_lightning.strategy.loss_logging import LossLogRecorder


class EvaluationStepsMixin:
    """Runs Lightning's evaluation and prediction steps through the pipeline of the plan in force."""

    @override
    def validation_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Tensor:
        loss, rows = self._evaluate(batch)
        self.lightning_module.log("val_loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=rows, sync_dist=True)
        return loss

    @override
    def test_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Tensor:
        loss, rows = self._evaluate(batch)
        self.lightning_module.log("test_loss", loss, on_step=False, on_epoch=True, batch_size=rows, sync_dist=True)
        return loss

    @override
    def predict_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        runtime = self._require_runtime()
        call = self._job.mirror.next_call() if self._job is not None else 0
        if self.is_spare:
            return batching.to_device(self._job.mirror.wait(call).value, self.root_device)
        _, _, outputs = eval_passes.run_share(runtime, self.lightning_module, batch, self.micro_batch_size, compute_loss=False)
        if self._tensor is not None and outputs is not None:  # the last stage's members join their shards
            outputs = self._whole_outputs(outputs)
        joined = eval_passes.joined_outputs(runtime.position.replica, outputs, self.root_device)
        if self._job is not None:
            self._publish(call, batching.to_cpu(joined))
        return joined

    def _evaluate(self, batch: Any) -> tuple[Tensor, int]:
        """The batch's mean loss over rows (``self.log`` in ``pipeline_loss`` works here too) and its rows.

        A spare returns (and logs) what the members computed. A failure during evaluation is not
        recovered: it ends the job (for a restart).
        """
        module = self.lightning_module
        call = self._job.mirror.next_call() if self._job is not None else 0
        if self.is_spare:
            result = self._job.mirror.wait(call).value
            LossLogRecorder.log_values(module, result["logs"], self.root_device)
            return torch.tensor(result["loss"], device=self.root_device), result["rows"]
        with self._loss_log.recording(module):
            split, items, losses = eval_passes.run_share(self._require_runtime(), module, batch, self.micro_batch_size, True)
        logs = self._loss_log.replay(module, self.root_device)
        loss = eval_passes.mean_loss(items, losses, self.root_device)
        if self._job is not None:
            self._publish(call, {"loss": float(loss), "rows": split.rows, "logs": logs})
        return loss, split.rows

    def _whole_outputs(self, outputs: list[Any]) -> list[Any] | None:
        """Each micro-batch's whole outputs on member 0 of a last-stage group (``None`` on the other
        members, which then add nothing to the join); collective over the group."""
        module, tensor = self.lightning_module, self._tensor
        whole = [module.pipeline_tensor_parallel_outputs(out, tensor.group) for out in outputs]
        return whole if tensor.member == 0 else None
