"""``EvaluationSteps``: the strategy's validation, test and predict steps.

Lightning calls them per batch; each deals the batch out to the replicas and joins the results
(:mod:`~resihp_lightning.runtime.eval_passes`), so that every rank sees what one device would: the
mean loss over rows (logged as ``val_loss`` / ``test_loss`` by the strategy) or the last layer's
outputs for every row. With fail-stop recovery a hot spare returns what the members computed; under
tensor parallelism the last stage's members join their split outputs first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from resihp_lightning.runtime import batching, eval_passes
from resihp_lightning.runtime.runtime_state import RuntimeState
from resihp_lightning.strategy.job_membership import Membership
from resihp_lightning.strategy.loss_logging import LossLogRecorder
from resihp_lightning.strategy.tensor_modes import TensorMode


class EvaluationSteps:
    """Runs evaluation and prediction batches through the pipeline of the plan in force.

    Args:
        state: the strategy's runtime state.
        membership: who is in the job (a spare returns the members' results, which rank 0 publishes).
        tensor: the job's tensor parallelism.
        micro_batch_size: rows per micro-batch.
        loss_log: records what ``pipeline_loss`` logs and logs it on every rank.
    """

    def __init__(self, state: RuntimeState, membership: Membership, tensor: TensorMode, micro_batch_size: int,
                 loss_log: LossLogRecorder) -> None:
        self.state = state
        self.membership = membership
        self.tensor = tensor
        self.micro_batch_size = micro_batch_size
        self.loss_log = loss_log

    def loss(self, module: Any, batch: Any, device: torch.device) -> tuple[Tensor, int]:
        """The batch's mean loss over rows (``self.log`` in ``pipeline_loss`` works here too) and its rows.

        A spare returns (and logs) what the members computed. A failure during evaluation is not
        recovered: it ends the job (for a restart).
        """
        membership = self.membership
        call = membership.next_call()
        if membership.is_spare:
            result = membership.mirrored(call)
            LossLogRecorder.log_values(module, result["logs"], device)
            return torch.tensor(result["loss"], device=device), result["rows"]
        with self.loss_log.recording(module):
            split, items, losses = eval_passes.run_share(self.state.require(), module, batch, self.micro_batch_size, True)
        logs = self.loss_log.replay(module, device)
        loss = eval_passes.mean_loss(items, losses, device)
        membership.publish(call, lambda: {"loss": float(loss), "rows": split.rows, "logs": logs})
        return loss, split.rows

    def predict(self, module: Any, batch: Any, device: torch.device) -> Any:
        """The last layer's outputs for every row of the batch, in row order, on every rank."""
        runtime, membership = self.state.require(), self.membership
        call = membership.next_call()
        if membership.is_spare:
            return batching.to_device(membership.mirrored(call), device)
        _, _, outputs = eval_passes.run_share(runtime, module, batch, self.micro_batch_size, compute_loss=False)
        if outputs is not None:  # under tensor parallelism the last stage's members join their shards
            outputs = self.tensor.whole_outputs(module, outputs)
        joined = eval_passes.joined_outputs(runtime.position.replica, outputs, device)
        membership.publish(call, lambda: batching.to_cpu(joined))
        return joined
