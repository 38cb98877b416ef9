"""A LightningModule that fine-tunes (or trains from scratch) a Llama / Qwen2 model with ResiHPStrategy.

It satisfies :class:`resihp_lightning.strategy.module.ResiHPModule`'s contract with the pieces of this
package: layers from :mod:`resihp_lightning.models.hf_checkpoint`, the token-mean loss of
:func:`resihp_lightning.models.layers.causal_lm_loss`, and batches from
:func:`resihp_lightning.data.packed.collate_packed` (``pipeline_batch`` hands ``seq_lens`` to the
strategy, hence to the straggler detector).

Importing this module imports Lightning (~9 s); ``resihp_lightning.models`` loads it lazily.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch  # noqa: F401  (first: see the note above ResiHPModule's import)
import torch
from torch import Tensor, nn

from resihp_lightning.data.packed import to_pipeline_batch
from resihp_lightning.data.tokenizer import Tokenizer
from resihp_lightning.config import ScratchModelConfig
from resihp_lightning.errors import ConfigError, invalid_option
from resihp_lightning.torch_utils import meta
from resihp_lightning.models.hf_checkpoint import (
    LOAD_MODES,
    SUPPORTED_MODEL_TYPES,
    HFLayerLoader,
    build_pipeline_model,
    load_pipeline_model,
    save_hf_checkpoint,
    save_sharded_hf_checkpoint,
    tiny_config,
)
from resihp_lightning.models.layers import causal_lm_loss
# Lightning must be imported before strategy.module: importing Lightning runs the package's strategy
# registration, which imports strategy.strategy, which imports strategy.module; if strategy.module is
# the one importing Lightning, that chain finds it half-initialised (ImportError: check_contract).
from resihp_lightning.strategy.module import ResiHPModule

HF_CONFIG_KEY = "hf_config"
"""Key under which :meth:`CausalLMPipelineModule.on_save_checkpoint` stores the HF config dict."""


class CausalLMPipelineModule(ResiHPModule):
    """Causal-LM fine-tuning as pipeline layers: embedding → decoder layers → norm + LM head.

    Args:
        model_path: a local Hugging Face Llama / Qwen2 checkpoint directory; ``None`` trains the
            model described by ``scratch`` from a random initialisation.
        scratch: the model shape when ``model_path`` is ``None`` (a ``ScratchModelConfig`` or its fields as
            a mapping, as the hyper-parameters of a checkpoint hold it).
        seed: initialisation seed for a scratch model.
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay, applied to matrices only (not to norms and biases).
        betas: AdamW betas.
        warmup_steps: linear learning-rate warm-up over this many optimizer steps (0: none).
        load: how ``model_path`` is read. ``"per_stage"`` (default): the layers are built on the meta
            device without reading any weight; under ResiHPStrategy each process then reads only the
            tensors of the layers it holds (:meth:`pipeline_load_layer`), layers a re-plan moves come
            from their previous holders. Before the strategy has loaded any layer, a layer run outside
            it is read on its first forward (or all at once with :meth:`load_layers`). ``"whole"``: every process loads the
            whole model with ``from_pretrained``. Ignored for a scratch model.

    Per-stage loading and the end of ``fit``: such a module tells the strategy it prefers
    ``gather_weights="none"`` (:meth:`pipeline_gather_weights`), so that no process assembles the
    whole model; save the trained model with :meth:`save_hf_checkpoint` (called on every rank: each
    stage writes its own shard) or Lightning checkpoints. Pass ``ResiHPStrategy(gather_weights="all")``
    to get every layer into every rank's module anyway.

    Raises:
        ConfigError: missing / unsupported checkpoint, bad optimizer options or an unknown ``load``.
    """

    def __init__(
        self,
        model_path: str | None = None,
        scratch: ScratchModelConfig | Mapping[str, Any] | None = None,
        seed: int = 0,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        load: str = "per_stage",
    ) -> None:
        super().__init__()
        if load not in LOAD_MODES:
            raise invalid_option("model.load", load, LOAD_MODES)
        if learning_rate <= 0:
            raise invalid_option("model.learning_rate", learning_rate, "a positive number")
        if warmup_steps < 0:
            raise invalid_option("model.warmup_steps", warmup_steps, "a non-negative integer")
        if isinstance(scratch, Mapping):  # from saved hyper-parameters (load_from_checkpoint)
            scratch = ScratchModelConfig(**scratch)
        scratch = scratch or ScratchModelConfig()
        self.save_hyperparameters({"model_path": model_path, "scratch": asdict(scratch), "seed": seed,
                                   "learning_rate": learning_rate, "weight_decay": weight_decay,
                                   "betas": tuple(betas), "warmup_steps": warmup_steps, "load": load})
        if model_path is not None:
            model = load_pipeline_model(model_path, load=load)
        else:
            if scratch.model_type not in SUPPORTED_MODEL_TYPES:
                raise invalid_option("model.scratch.model_type", scratch.model_type, SUPPORTED_MODEL_TYPES)
            model = build_pipeline_model(tiny_config(**asdict(scratch)), seed=seed)
        self.model_path = model_path
        self.hf_config = model.config
        self.layers = nn.ModuleList(model.layers)
        self._loader: HFLayerLoader | None = model.loader
        # Outside the strategy a layer still on meta is read on its first forward; once the strategy has
        # loaded a process's layers the others belong to other processes (and get trained there), so
        # the hooks go (no cost per forward) and nothing reads them from model_path behind its back.
        self._strategy_loaded = False
        self._lazy_hooks = [
            _LoadOnFirstUse(self._loader, index, layer).handle for index, layer in enumerate(self.layers)
        ] if self._loader is not None else []

    @property
    def per_stage(self) -> bool:
        """Whether the layers are read from ``model_path`` one at a time, where they are needed."""
        return self._loader is not None

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size."""
        return int(self.hf_config.vocab_size)

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Raises :class:`~resihp_lightning.errors.ConfigError` when the tokenizer has ids the model's embedding lacks."""
        if tokenizer.vocab_size > self.vocab_size:
            raise ConfigError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {self.vocab_size}; "
                "use the checkpoint's own tokenizer or a model with a larger vocabulary"
            )

    # ----------------------------------------------------------------- ResiHPModule contract
    def pipeline_layers(self) -> Sequence[nn.Module]:
        """``num_hidden_layers + 2`` layers: embedding, one per decoder layer, norm + head."""
        return list(self.layers)

    def pipeline_tied_parameters(self) -> Sequence[Sequence[str]]:
        """With ``tie_word_embeddings`` the LM head's matrix is the input embedding's (one parameter)."""
        if not getattr(self.hf_config, "tie_word_embeddings", False):
            return ()
        return [("0.embed_tokens.weight", f"{len(self.layers) - 1}.lm_head.weight")]

    def pipeline_load_layer(self, index: int, layer: nn.Module, device: torch.device | str) -> None:
        """Reads layer ``index``'s tensors that are still on the meta device from ``model_path`` (only
        that layer's), on ``device``; the strategy calls it for each layer a process holds."""
        if self._loader is None:
            super().pipeline_load_layer(index, layer, device)
            return
        if not self._strategy_loaded:
            self._strategy_loaded = True
            for handle in self._lazy_hooks:
                handle.remove()
            self._lazy_hooks = []
        self._loader.load_layer(index, layer, device)

    def pipeline_gather_weights(self) -> str | None:
        """``"none"`` for a per-stage model (no rank assembles it at the end of ``fit``), else no preference."""
        return "none" if self.per_stage else None

    def load_layers(self, device: torch.device | str = "cpu") -> None:
        """Reads every layer still on the meta device (a per-stage model used as a whole, outside the strategy).

        Raises:
            ConfigError: the strategy has loaded this process's layers: the ones still on meta are held
                (and trained) by other processes, and reading them from ``model_path`` would mix
                untrained layers into the model.
        """
        if self._loader is None:
            return
        on_meta = [i for i, layer in enumerate(self.layers) if meta.has_meta(layer)]
        if on_meta and self._strategy_loaded:
            raise ConfigError(
                f"layers {on_meta} of this per-stage model are held by other processes of the ResiHPStrategy job; "
                "save the trained model with save_hf_checkpoint() on every rank (under the strategy) or gather it "
                "with ResiHPStrategy(gather_weights='all' / 'rank0')"
            )
        for index, layer in enumerate(self.layers):
            if meta.has_meta(layer):
                self._loader.load_layer(index, layer, device)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """As ``nn.Module.load_state_dict``; a layer still on the meta device whose tensors are all in
        ``state_dict`` first gets storage, so that it takes those values (``Model.load_from_checkpoint``,
        ``load_state_dict(torch.load(exported))``) instead of the copy being a silent no-op."""
        if self._loader is not None and not assign:
            for index, layer in enumerate(self.layers):
                slots = meta.meta_slots(layer)
                keys = [f"layers.{index}.{slot.name}" for slot in slots if slot.persistent]
                if slots and keys and all(key in state_dict for key in keys):
                    meta.allocate(layer, state_dict[keys[0]].device)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def pipeline_loss(self, outputs: Tensor, labels: Tensor) -> Tensor:
        """Token-mean cross-entropy of one micro-batch (labels already shifted, -100 ignored)."""
        return causal_lm_loss(outputs, labels)

    def pipeline_split_layer(self, index: int, layer: nn.Module, group: Any) -> nn.Module:
        """Layer ``index`` split over the tensor-parallel ``group`` (attention by heads, MLP by intermediate
        columns, embedding and head by vocabulary rows; :mod:`resihp_lightning.models.tensor_parallel`)."""
        from resihp_lightning.models.tensor_parallel import split_pipeline_layers

        return split_pipeline_layers([layer], group)[0]

    def pipeline_tensor_parallel_degrees(self) -> list[int]:
        """The degrees that split every layer evenly: divisors of the query heads, the key-value heads, the
        MLP's intermediate size and the vocabulary (``split_pipeline_layers`` needs whole heads and equal parts)."""
        config = self.hf_config
        sizes = [config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                 config.intermediate_size, config.vocab_size]
        common = math.gcd(*sizes)
        return [d for d in range(1, common + 1) if common % d == 0]

    def pipeline_tensor_parallel_loss(self, outputs: Tensor, labels: Tensor, group: Any) -> Tensor:
        """:meth:`pipeline_loss` on vocabulary-split logits."""
        from resihp_lightning.models.tensor_parallel import vocab_parallel_causal_lm_loss

        return vocab_parallel_causal_lm_loss(outputs, labels, group)

    def pipeline_tensor_parallel_outputs(self, outputs: Tensor, group: Any) -> Tensor:
        """The whole logits from the members' vocabulary shards."""
        from resihp_lightning.torch_utils.shards import gather_along

        return gather_along(outputs, -1, group)

    def pipeline_batch(self, batch: Mapping[str, Tensor]) -> tuple[Any, Tensor, Tensor]:
        """``((input_ids, position_ids, seq_lens), labels, seq_lens)`` from a collated packed batch."""
        if not isinstance(batch, Mapping) or not {"input_ids", "position_ids", "labels", "seq_lens"} <= set(batch):
            raise ConfigError(
                "CausalLMPipelineModule expects batches from resihp_lightning.data.collate_packed "
                "(a dict with input_ids, position_ids, labels and seq_lens)"
            )
        return to_pipeline_batch(batch)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas))
        if not hp.warmup_steps:
            return optimizer
        warmup = int(hp.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ----------------------------------------------------------------- checkpoints
    def save_hf_checkpoint(self, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
        """Writes the model as a Hugging Face checkpoint directory (``from_pretrained`` opens it).

        Under ResiHPStrategy (during or after ``trainer.fit`` / ``validate``, while the module is
        attached to the trainer) this is collective: call it on every rank. Each stage of the first
        replica writes its own layers' trained values (float32; the fp32 masters of a bf16 engine) to
        one shard, and rank 0 writes the index, config, generation config and tokenizer
        (:func:`~resihp_lightning.models.hf_checkpoint.save_sharded_hf_checkpoint`); no rank assembles the
        model. Outside the strategy it writes this module's own weights (reading any layer still on
        the meta device from ``model_path`` first).

        Args:
            out_dir: output directory (created; weight files of an earlier save there are replaced).
            tokenizer_dir: save this directory's HF tokenizer with the model; default ``model_path``.
        """
        tokenizer_dir = tokenizer_dir if tokenizer_dir is not None else self.model_path
        runtime = self._resihp_runtime()
        if runtime is None:
            self.load_layers()
            return save_hf_checkpoint(_layer_keyed(self.state_dict()), self.hf_config, out_dir, tokenizer_dir=tokenizer_dir)
        if runtime.idle:  # a hot spare is outside the members' group; they write the model
            return Path(out_dir)
        # Collective over each stage's replicas under a DeepSpeed wrapper, and over a tensor-parallel group
        # (whose member 0 writes the whole layers).
        trained = runtime.trained_tensors()
        position = runtime.position
        writes = position.replica == 0 and runtime.shard_index == 0
        return save_sharded_hf_checkpoint(
            trained if writes else {}, position.stage if writes else None, runtime.plan.pipeline_degree,
            self.hf_config, out_dir, tokenizer_dir=tokenizer_dir, source_dir=self.model_path,
        )

    def _resihp_runtime(self) -> Any:
        """The pipeline runtime of the ResiHPStrategy this module is attached to, or ``None``."""
        trainer = getattr(self, "_trainer", None)
        strategy = getattr(trainer, "strategy", None) if trainer is not None else None
        return getattr(strategy, "runtime", None)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Stores the HF config so that :func:`export_hf_checkpoint` can write an HF model."""
        checkpoint[HF_CONFIG_KEY] = self.hf_config.to_dict()


class _LoadOnFirstUse:
    """Forward pre-hook of a per-stage layer: reads it from the checkpoint when it runs while still on
    the meta device (a module used outside ResiHPStrategy), then removes itself (no check per forward)."""

    def __init__(self, loader: HFLayerLoader, index: int, layer: nn.Module) -> None:
        self.loader = loader
        self.index = index
        self.handle = layer.register_forward_pre_hook(self)

    def __call__(self, layer: nn.Module, args: tuple[Any, ...]) -> None:
        if meta.has_meta(layer):
            self.loader.load_layer(self.index, layer, _device_of(args))
        self.handle.remove()


def _device_of(value: Any) -> torch.device:
    """The device of the first tensor in ``value`` (nested tuples / lists), else the CPU."""
    if isinstance(value, Tensor):
        return value.device
    if isinstance(value, (tuple, list)):
        for item in value:
            device = _device_of(item)
            if device.type != "cpu":
                return device
    return torch.device("cpu")


def _layer_keyed(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Accepts ResiHPStrategy's ``"{layer}.{name}"`` keys or a plain module's ``"layers.{layer}.{name}"``."""
    return {key.removeprefix("layers."): value for key, value in state.items()}


def export_hf_checkpoint(
    checkpoint: str | Path | Mapping[str, Any], out_dir: str | Path, tokenizer_dir: str | Path | None = None
) -> Path:
    """Writes the model of a Lightning checkpoint of :class:`CausalLMPipelineModule` as an HF checkpoint.

    Args:
        checkpoint: a ``.ckpt`` path written by ``Trainer`` (under ResiHPStrategy or any other), or
            the loaded checkpoint dict.
        out_dir: output directory; ``AutoModelForCausalLM.from_pretrained(out_dir)`` opens it.
        tokenizer_dir: copy this directory's HF tokenizer next to the weights (e.g. the source
            checkpoint directory).

    Raises:
        ConfigError: the checkpoint lacks the HF config (not written by this module) or weights.
    """
    from transformers import AutoConfig

    if not isinstance(checkpoint, Mapping):
        path = Path(checkpoint)
        if not path.is_file():
            raise ConfigError(f"checkpoint file {str(path)!r} does not exist")
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if HF_CONFIG_KEY not in checkpoint or "state_dict" not in checkpoint:
        raise ConfigError("the checkpoint was not written by CausalLMPipelineModule: no hf_config / state_dict")
    config_dict = dict(checkpoint[HF_CONFIG_KEY])
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    return save_hf_checkpoint(_layer_keyed(checkpoint["state_dict"]), config, out_dir, tokenizer_dir=tokenizer_dir)
