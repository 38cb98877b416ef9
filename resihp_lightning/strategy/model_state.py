"""``ModelState``: the trained model in and out of a pipeline whose layers are spread over processes.

Lightning's checkpoint hooks (the model and optimizer state saved under the LightningModule's own
keys, whole, whatever the plan; loaded into this process's layers) and the end-of-fit weights
(every layer's trained values into the LightningModule of the processes ``gather_weights`` names).
Under tensor parallelism the runtime gathers shards whole first and member 0 of a group sends them.
The strategy holds one, rebuilt at each setup, and its Lightning hooks call it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from resihp_lightning._logging import user_warn
from resihp_lightning.runtime.runtime_state import RuntimeState
from resihp_lightning.state import layer_checkpoint
from resihp_lightning.state.module_weights import LayerKeys, sync_module_layers
from resihp_lightning.strategy.job_membership import Membership
from resihp_lightning.strategy.tensor_modes import TensorMode


class ModelState:
    """Saves, loads and hands back the trained model (see the module docstring).

    Args:
        state: the strategy's runtime state.
        membership: who is in the job (spares write nothing; rank 0 receives the checkpoint).
        tensor: the job's tensor parallelism.
        specs: the model's layers in order.
        keys: the LightningModule's own keys of the layers' tensors (``None`` before setup).
        gather_weights: ``"all"``, ``"rank0"`` or ``"none"``: who receives the trained weights at the end of fit.
        micro_batch_size: rows per micro-batch (recorded in checkpoints).
    """

    def __init__(
        self,
        state: RuntimeState,
        membership: Membership,
        tensor: TensorMode,
        specs: list[Any],
        keys: LayerKeys | None,
        gather_weights: str,
        micro_batch_size: int,
    ) -> None:
        self.state = state
        self.membership = membership
        self.tensor = tensor
        self.specs = specs
        self.keys = keys
        self.gather_weights = gather_weights
        self.micro_batch_size = micro_batch_size

    def module_state(self, module: Any) -> dict[str, Any]:
        """Every tensor of the model under the LightningModule's own keys, on rank 0 (collective).

        Layers come from the ranks of the first replica, in full precision (fp32 masters under bf16);
        everything else from rank 0's module.
        """
        runtime = self.state.require()
        if self.membership.is_spare:  # outside the members' group; rank 0 (a member) writes the checkpoint
            return {}
        layers = layer_checkpoint.gather_model_state(runtime.trained_tensors(), sends=self._sends_whole_layers())
        return layer_checkpoint.module_keyed(module, self.keys, layers) if self.membership.rank == 0 else {}

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state under the module's parameter order, on rank 0 (collective under a wrapper)."""
        runtime = self.state.require()
        bound = runtime.optimizer
        if bound is None:
            raise RuntimeError("ResiHPStrategy has no optimizer outside trainer.fit")
        if self.membership.is_spare:
            return {}
        # Collective under a DeepSpeed wrapper (each stage's data-parallel group): every rank is here.
        state = runtime.optimizer_checkpoint_state()
        return layer_checkpoint.gather_optimizer_state(bound.groups, bound.group_of, state, sends=self._sends_whole_layers())

    def checkpoint_section(self) -> dict[str, Any]:
        """The checkpoint's ``"resihp"`` entry: the format, the plan and the job's shape."""
        return {
            "format": layer_checkpoint.FORMAT,
            "state_dict_keys": "module",
            "plan": self.state.require().plan.to_dict(),
            "micro_batches": self.state.micro_batches,
            "micro_batch_size": self.micro_batch_size,
            "num_layers": len(self.specs),
            "tensor_degree": self.tensor.degree,  # the plan names groups of this many processes
        }

    def load_module_state(self, module: Any, checkpoint: Mapping[str, Any], strict: bool) -> None:
        """Loads a checkpoint's model state into this process's layers (and the rest of the module)."""
        runtime = self.state.require()
        section = checkpoint.get("resihp")
        # Our checkpoints before module keys had layer keys; a plain Lightning checkpoint has module keys.
        layer_keyed = section is not None and section.get("state_dict_keys") != "module"
        layer_checkpoint.load_module_state(
            module, self.keys, checkpoint["state_dict"], runtime.local_tensors(), layer_keyed, strict,
            shard=runtime.saved_shards(),
        )
        runtime.weights_loaded()

    def load_optimizer_state(self, checkpoint: Mapping[str, Any]) -> None:
        """Loads a checkpoint's optimizer state into this process's optimizer."""
        runtime = self.state.require()
        states = checkpoint.get("optimizer_states") or []
        if runtime.optimizer is not None and states:
            runtime.load_optimizer_checkpoint(states[0])

    def gather_trained_weights(self) -> None:
        """Puts every layer's trained weights into the LightningModule of the ranks ``gather_weights`` names."""
        runtime, specs, keys = self.state.require(), self.specs, self.keys
        trained = runtime.trained_tensors()
        self.tensor.keep_trained(runtime, specs, keys, trained)

        def sync_with_spares(rank: int) -> None:
            sync_module_layers(runtime.plan_in_ranks(), rank, specs, keys, trained, None, runtime.casts_model)

        if self.membership.sync_with_spares(self.gather_weights == "all", sync_with_spares):
            return
        if self.gather_weights == "none":
            pos = runtime.position
            user_warn(
                "ResiHPStrategy(gather_weights='none'): each rank's LightningModule holds trained weights only for "
                f"its own layers (rank 0: layers {pos.first}..{pos.stop - 1}); the others are stale. Use "
                "checkpoints or strategy.export_weights(path) for the whole model"
            )
            return
        receivers = None if self.gather_weights == "all" else {0}
        sync_module_layers(self.tensor.weights_plan(runtime), self.membership.rank, specs, keys, trained, receivers,
                           runtime.casts_model)

    def _sends_whole_layers(self) -> bool:
        """Whether this rank sends its layers' whole values to a gather: the first replica's ranks (with
        tensor parallelism, their groups' member 0; ``trained_tensors`` gathered the shards)."""
        runtime = self.state.require()
        return runtime.position.replica == 0 and runtime.shard_index == 0
