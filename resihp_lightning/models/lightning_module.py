"""A LightningModule that fine-tunes (or trains from scratch) a Llama / Qwen2 model with ResiHPStrategy.

It satisfies :class:`resihp_lightning.strategy.ResiHPModule`'s contract with the pieces of this
package: layers from :mod:`resihp_lightning.models.checkpoint`, the token-mean loss of
:func:`resihp_lightning.models.layers.causal_lm_loss`, and batches from
:func:`resihp_lightning.data.packed.collate_packed` (``pipeline_batch`` hands ``seq_lens`` to the
strategy, hence to the straggler detector).

Importing this module imports Lightning (~9 s); ``resihp_lightning.models`` loads it lazily.
"""

from __future__ import annotations

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
from resihp_lightning.models.checkpoint import (
    SUPPORTED_MODEL_TYPES,
    build_pipeline_model,
    load_pipeline_model,
    save_hf_checkpoint,
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
        scratch: the model shape when ``model_path`` is ``None``.
        seed: initialisation seed for a scratch model.
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay, applied to matrices only (not to norms and biases).
        betas: AdamW betas.
        warmup_steps: linear learning-rate warm-up over this many optimizer steps (0: none).

    Raises:
        ConfigError: missing / unsupported checkpoint, or bad optimizer options.
    """

    def __init__(
        self,
        model_path: str | None = None,
        scratch: ScratchModelConfig | None = None,
        seed: int = 0,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
    ) -> None:
        super().__init__()
        if learning_rate <= 0:
            raise invalid_option("model.learning_rate", learning_rate, "a positive number")
        if warmup_steps < 0:
            raise invalid_option("model.warmup_steps", warmup_steps, "a non-negative integer")
        scratch = scratch or ScratchModelConfig()
        self.save_hyperparameters({"model_path": model_path, "scratch": asdict(scratch), "seed": seed,
                                   "learning_rate": learning_rate, "weight_decay": weight_decay,
                                   "betas": tuple(betas), "warmup_steps": warmup_steps})
        if model_path is not None:
            model = load_pipeline_model(model_path)
        else:
            if scratch.model_type not in SUPPORTED_MODEL_TYPES:
                raise invalid_option("model.scratch.model_type", scratch.model_type, SUPPORTED_MODEL_TYPES)
            model = build_pipeline_model(tiny_config(**asdict(scratch)), seed=seed)
        self.model_path = model_path
        self.hf_config = model.config
        self.layers = nn.ModuleList(model.layers)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size."""
        return int(self.hf_config.vocab_size)

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Raises :class:`ConfigError` when the tokenizer has ids the model's embedding lacks."""
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

    def pipeline_loss(self, outputs: Tensor, labels: Tensor) -> Tensor:
        """Token-mean cross-entropy of one micro-batch (labels already shifted, -100 ignored)."""
        return causal_lm_loss(outputs, labels)

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
        """Writes this module's weights as a Hugging Face checkpoint directory.

        After ``trainer.fit`` under ResiHPStrategy (``gather_weights`` "all", or "rank0" on rank 0) the
        module holds every layer's trained weights, so this can run on any rank that has them.
        """
        return save_hf_checkpoint(_layer_keyed(self.state_dict()), self.hf_config, out_dir, tokenizer_dir=tokenizer_dir)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Stores the HF config so that :func:`export_hf_checkpoint` can write an HF model."""
        checkpoint[HF_CONFIG_KEY] = self.hf_config.to_dict()


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
