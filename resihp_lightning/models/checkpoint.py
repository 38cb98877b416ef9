"""Load Hugging Face Llama / Qwen2 checkpoints as pipeline layers, and save them back.

Everything is local: checkpoints are read with ``local_files_only=True`` and nothing is downloaded.

Layer ``i`` of the pipeline has the state-dict keys of its module; :func:`hf_state_dict` maps the
keys of a whole pipeline (``"{global_layer_index}.{name}"``, the names DeepSpeed's
``PipelineModule`` gives its layers' parameters) back to Hugging Face names:

=====================  ===============================================
pipeline key            Hugging Face key
=====================  ===============================================
``0.embed_tokens.*``    ``model.embed_tokens.*``
``{i+1}.layer.*``       ``model.layers.{i}.*``
``{L+1}.norm.*``        ``model.norm.*``
``{L+1}.lm_head.*``     ``lm_head.*``
=====================  ===============================================

Tied embeddings (``tie_word_embeddings: true``, e.g. small Qwen2 models): the embedding and the
head usually sit on different pipeline stages, so the head gets its own copy of the matrix;
``CausalLMPipelineModule.pipeline_tied_parameters`` names the pair, and the strategy sums their
gradients so that the copies stay equal (one shared parameter). :func:`save_hf_checkpoint` keeps the
checkpoint tied when the two copies are equal and otherwise (e.g. layers trained without the
strategy) writes both matrices with ``tie_word_embeddings: false``, so that the saved model gives
exactly the pipeline's logits.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from resihp_lightning.errors import ConfigError
from resihp_lightning.models.attention import PACKED_ATTENTION
from resihp_lightning.models.layers import DecoderPipe, EmbeddingPipe, HeadPipe

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
"""Values of ``config.json``'s ``model_type`` that this package turns into pipeline layers."""

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


@dataclass
class PipelineCausalLM:
    """A causal LM as pipeline layers.

    Attributes:
        config: the model's Hugging Face config as it was loaded (attention implementation not
            touched); :func:`save_hf_checkpoint` writes it.
        layers: ``num_hidden_layers + 2`` modules in model order (embedding, decoders, head).
        source_dir: the checkpoint directory it came from, or ``None`` for a fresh model.
    """

    config: object
    layers: list[nn.Module]
    source_dir: Path | None = None


def _check_model_type(model_type: object, where: str) -> str:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"unsupported architecture model_type={model_type!r} in {where}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return str(model_type)


def read_model_type(path: str | Path) -> str:
    """Returns the checkpoint's ``model_type`` after checking that the directory is usable.

    Raises:
        ConfigError: the directory or its ``config.json`` is missing, unreadable, or names an
            architecture other than :data:`SUPPORTED_MODEL_TYPES`.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"model checkpoint directory {str(directory)!r} does not exist")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model checkpoint directory {str(directory)!r} has no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {str(config_file)!r}: {exc}") from None
    return _check_model_type(raw.get("model_type"), str(config_file))


def _layers_from_hf(model: nn.Module) -> list[nn.Module]:
    """Splits an HF ``*ForCausalLM`` into pipeline layers (switching it to packed attention).

    The layers come back in training mode (``from_pretrained`` leaves models in eval mode).
    """
    model.config._attn_implementation = PACKED_ATTENTION
    model.train()
    body = model.model
    head_weight = model.lm_head.weight
    if head_weight is body.embed_tokens.weight:
        model.lm_head.weight = nn.Parameter(head_weight.detach().clone())
    layers: list[nn.Module] = [EmbeddingPipe(body.embed_tokens)]
    for layer in body.layers:
        layers.append(DecoderPipe(layer, copy.deepcopy(body.rotary_emb)))
    layers.append(HeadPipe(body.norm, model.lm_head))
    return layers


def load_pipeline_model(path: str | Path, dtype: torch.dtype = torch.float32) -> PipelineCausalLM:
    """Loads a local HF Llama / Qwen2 checkpoint (``config.json`` + safetensors) as pipeline layers.

    Args:
        path: the checkpoint directory.
        dtype: parameter dtype.

    Returns:
        The :class:`PipelineCausalLM`.

    Raises:
        ConfigError: missing directory / config / weights, or an unsupported architecture.
    """
    from transformers import AutoModelForCausalLM

    directory = Path(path)
    read_model_type(directory)
    if not any(any(directory.glob(p)) for p in _WEIGHT_PATTERNS):
        raise ConfigError(f"model checkpoint directory {str(directory)!r} has no *.safetensors weights")
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    config = copy.deepcopy(model.config)
    return PipelineCausalLM(config=config, layers=_layers_from_hf(model), source_dir=directory)


def build_pipeline_model(config: object, seed: int = 0, dtype: torch.dtype = torch.float32) -> PipelineCausalLM:
    """Builds randomly initialised pipeline layers from an HF config (training from scratch).

    Args:
        config: a ``LlamaConfig`` or ``Qwen2Config``.
        seed: torch seed for the initialisation.
        dtype: parameter dtype.
    """
    from transformers import AutoModelForCausalLM

    _check_model_type(getattr(config, "model_type", None), "the model config")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)
    return PipelineCausalLM(config=copy.deepcopy(config), layers=_layers_from_hf(model), source_dir=None)


def tiny_config(
    model_type: str = "llama",
    vocab_size: int = 260,
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
) -> object:
    """A small Llama / Qwen2 config for tests and for training from scratch.

    The default vocabulary (260) covers the byte-level fallback tokenizer
    (:class:`resihp_lightning.data.tokenizer.ByteTokenizer`: 256 bytes + specials).
    """
    from transformers import LlamaConfig, Qwen2Config

    _check_model_type(model_type, "tiny_config")
    cls = LlamaConfig if model_type == "llama" else Qwen2Config
    return cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )


def pipeline_state_dict(layers: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """State of all pipeline layers keyed ``"{global_layer_index}.{name}"`` (DeepSpeed's naming)."""
    return {f"{i}.{k}": v for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}


_KEY = re.compile(r"^(\d+)\.(.+)$")


def hf_state_dict(state: Mapping[str, torch.Tensor], num_hidden_layers: int) -> dict[str, torch.Tensor]:
    """Maps pipeline keys (``"{global_layer_index}.{name}"``) to Hugging Face ``*ForCausalLM`` keys.

    Raises:
        ConfigError: a key does not belong to a layer of a ``num_hidden_layers``-layer model.
    """
    head = num_hidden_layers + 1
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        match = _KEY.match(key)
        idx = int(match.group(1)) if match else -1
        name = match.group(2) if match else key
        if idx == 0 and name.startswith("embed_tokens."):
            out[f"model.{name}"] = value
        elif 1 <= idx <= num_hidden_layers and name.startswith("layer."):
            out[f"model.layers.{idx - 1}.{name[len('layer.'):]}"] = value
        elif idx == head and name.startswith("norm."):
            out[f"model.{name}"] = value
        elif idx == head and name.startswith("lm_head."):
            out[name] = value
        else:
            raise ConfigError(f"pipeline state key {key!r} does not map to a {num_hidden_layers}-layer HF model")
    return out


def save_hf_checkpoint(
    layers_or_state: Sequence[nn.Module] | Mapping[str, torch.Tensor],
    config: object,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Writes pipeline weights as a Hugging Face checkpoint (config.json + safetensors).

    The result opens with ``AutoModelForCausalLM.from_pretrained(out_dir)`` and gives the pipeline's
    logits. With ``tie_word_embeddings`` set and head ≠ embedding (after training), the saved config
    says ``tie_word_embeddings: false`` and both matrices are written.

    Args:
        layers_or_state: the pipeline layers in model order, or their merged state keyed
            ``"{global_layer_index}.{name}"`` (e.g. gathered from every stage).
        config: the HF config (``PipelineCausalLM.config``).
        out_dir: output directory (created).
        tokenizer_dir: if given and it holds a Hugging Face tokenizer, that tokenizer is saved next
            to the weights (the byte-level fallback has no files).

    Returns:
        The output directory.
    """
    from transformers import AutoModelForCausalLM

    if isinstance(layers_or_state, Mapping):
        state = dict(layers_or_state)
    else:
        state = pipeline_state_dict(layers_or_state)
    cfg = copy.deepcopy(config)
    cfg._attn_implementation = None
    weights = hf_state_dict(state, cfg.num_hidden_layers)
    if getattr(cfg, "tie_word_embeddings", False):
        embed, head = weights["model.embed_tokens.weight"], weights.get("lm_head.weight")
        if head is None or torch.equal(embed, head):
            weights.pop("lm_head.weight", None)
        else:
            cfg.tie_word_embeddings = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    weights = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ConfigError(f"pipeline state does not match the model config: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer_dir is not None:
        from resihp_lightning.data.tokenizer import has_hf_tokenizer, load_tokenizer

        if has_hf_tokenizer(tokenizer_dir):
            load_tokenizer(tokenizer_dir).save_pretrained(out)  # type: ignore[attr-defined]
    return out
