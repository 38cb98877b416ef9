"""The trained model in and out of :class:`~resihp_lightning.strategy.strategy.ResiHPStrategyMixin`.

Lightning's checkpoint hooks (the model and optimizer state saved under the LightningModule's own
keys, whole, whatever the plan; loaded into this process's layers) and the end-of-fit weights
(every layer's trained values into the LightningModule of the ranks ``gather_weights`` names). Under
tensor parallelism the runtime gathers shards whole first and member 0 of a group sends them.

The strategy declares the state used here in its ``__init__`` and ``setup`` (``_runtime``, ``_keys``,
``_specs``, ``_tensor``, ``_job``, ``_num_micro``, ``options``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import override

from resihp_lightning._logging import user_warn
from resihp_lightning.state import layer_checkpoint
from resihp_lightning.state.module_weights import restore_full_precision, sync_module_layers, write_trained


class ModelStateMixin:
    """Saves, loads and hands back the trained model of a pipeline whose layers are spread over ranks."""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Every tensor of the model under the LightningModule's own keys, on rank 0 (collective).

        Layers come from the ranks of the first replica, in full precision (fp32 masters under bf16);
        everything else from rank 0's module.
        """
        runtime = self._require_runtime()
        if self.is_spare:  # outside the members' group; rank 0 (a member) writes the checkpoint
            return {}
        layers = layer_checkpoint.gather_model_state(runtime.trained_tensors(), sends=self._sends_whole_layers())
        return layer_checkpoint.module_keyed(self.lightning_module, self._keys, layers) if self.global_rank == 0 else {}

    def export_weights(self, path: str | os.PathLike) -> None:
        """Writes the trained model's ``state_dict`` (the module's own keys) to ``path`` on rank 0 (collective).

        ``Model().load_state_dict(torch.load(path))`` restores it in a plain process.
        """
        state = self.lightning_module_state_dict()
        if self.global_rank == 0:
            torch.save(state, path)
        self.barrier()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        runtime = self._require_runtime()
        bound = runtime.optimizer
        if bound is None:
            raise RuntimeError("ResiHPStrategy has no optimizer outside trainer.fit")
        if self.is_spare:
            return {}
        # Collective under a DeepSpeed wrapper (each stage's data-parallel group): every rank is here.
        state = runtime.optimizer_checkpoint_state()
        return layer_checkpoint.gather_optimizer_state(bound.groups, bound.group_of, state, sends=self._sends_whole_layers())

    @override
    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        checkpoint_dict["resihp"] = {
            "format": layer_checkpoint.FORMAT,
            "state_dict_keys": "module",
            "plan": self.current_plan.to_dict(),
            "micro_batches": self._num_micro,
            "micro_batch_size": self.micro_batch_size,
            "num_layers": self.num_layers,
            "tensor_degree": self.options.tensor_degree,  # the plan names groups of this many processes
        }
        super().save_checkpoint(checkpoint_dict, filepath, storage_options=storage_options)

    @override
    def load_model_state_dict(self, checkpoint_dict: Mapping[str, Any], strict: bool = True) -> None:
        runtime = self._require_runtime()
        section = checkpoint_dict.get("resihp")
        # Our checkpoints before module keys had layer keys; a plain Lightning checkpoint has module keys.
        layer_keyed = section is not None and section.get("state_dict_keys") != "module"
        layer_checkpoint.load_module_state(
            self.lightning_module, self._keys, checkpoint_dict["state_dict"], runtime.local_tensors(), layer_keyed, strict,
            shard=runtime.saved_shards(),
        )
        runtime.weights_loaded()

    @override
    def load_optimizer_state_dict(self, checkpoint_dict: Mapping[str, Any]) -> None:
        runtime = self._require_runtime()
        states = checkpoint_dict.get("optimizer_states") or []
        if runtime.optimizer is not None and states:
            runtime.load_optimizer_checkpoint(states[0])

    def _gather_trained_weights(self) -> None:
        """Puts every layer's trained weights into the LightningModule of the ranks ``gather_weights`` names."""
        runtime = self._require_runtime()
        trained = runtime.trained_tensors()
        if self._tensor is None:
            restore_full_precision(runtime.local_layers(), trained)
        else:  # the split copies trained; the module's own layers take the gathered values
            write_trained({i: self._specs[i] for i in runtime.local_layers() if self._keys.is_attached(i)}, trained)
        if self._job is not None and self._sync_with_spares(trained):
            return
        if self.options.gather_weights == "none":
            pos = runtime.position
            user_warn(
                "ResiHPStrategy(gather_weights='none'): each rank's LightningModule holds trained weights only for "
                f"its own layers (rank 0: layers {pos.first}..{pos.stop - 1}); the others are stale. Use "
                "checkpoints or strategy.export_weights(path) for the whole model"
            )
            return
        receivers = None if self.options.gather_weights == "all" else {0}
        plan = runtime.plan_in_ranks() if self._tensor is None else self._tensor.groups.slice_plans(runtime.plan)[0]
        sync_module_layers(plan, self.global_rank, self._specs, self._keys, trained, receivers,
                           runtime.casts_model)

    def _sends_whole_layers(self) -> bool:
        """Whether this rank sends its layers' whole values to a gather: the first replica's ranks (with
        tensor parallelism, their groups' member 0; ``trained_tensors`` gathered the shards)."""
        runtime = self._require_runtime()
        return runtime.position.replica == 0 and runtime.shard_index == 0
