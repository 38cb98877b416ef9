"""``RuntimeState``: the pipeline runtime in force and what changes it between steps.

One object per strategy, shared with the parts it composes (the step runners, the fail-stop
membership, the checkpoint and evaluation objects): they read the runtime from it and record in it
what they change (a plan switch's :class:`~resihp_lightning.contract.MigrationRecord`; a recovery
drops a requested plan).
"""

from __future__ import annotations

from dataclasses import dataclass

from resihp_lightning.contract import MigrationRecord
from resihp_lightning.plan import Plan
from resihp_lightning.runtime.pipeline_runtime import PipelineRuntime
from resihp_lightning.tensor.tensor_groups import TensorGroups


@dataclass
class RuntimeState:
    """What the strategy's parts share about the runtime.

    Attributes:
        runtime: this process's pipeline runtime (``None`` before the Trainer's setup builds it).
        pending: a requested plan, applied at the start of the next training step.
        pending_groups: the tensor-parallel groups ``pending`` names (a re-split); ``None``: the groups in force.
        micro_batches: M, micro-batches per global batch (``None`` until known).
        last_migration: the last plan switch, reshape or recovery.
    """

    runtime: PipelineRuntime | None = None
    pending: Plan | None = None
    pending_groups: TensorGroups | None = None
    micro_batches: int | None = None
    last_migration: MigrationRecord | None = None

    def require(self) -> PipelineRuntime:
        """The runtime; raises ``RuntimeError`` before the Trainer's setup."""
        if self.runtime is None:
            raise RuntimeError("ResiHPStrategy is not set up yet (its runtime is built in Trainer setup)")
        return self.runtime
