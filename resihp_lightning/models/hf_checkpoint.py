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

Per-stage loading (:func:`load_pipeline_model` with ``load="per_stage"``): the layers are built on the
meta device (no weights read, no random initialisation; the rotary embedding's frequencies, which no
checkpoint stores, are computed on the CPU as ``from_pretrained`` computes them), and
:class:`HFLayerLoader` later reads the tensors of one layer at a time from the checkpoint's safetensors
files (one file, or shards listed in ``model.safetensors.index.json``). Under ResiHPStrategy each
process loads only the layers it holds (``CausalLMPipelineModule.pipeline_load_layer``).

Sharded save (:func:`save_sharded_hf_checkpoint`): each stage of the first replica writes its own
layers' tensors, under their Hugging Face names, to ``model-0000k-of-0000P.safetensors``; rank 0 writes
``model.safetensors.index.json``, ``config.json``, the generation config and the tokenizer. No process
holds more than its own layers. Tensors are written in float32, the trained values in full precision
(the fp32 master weights of a bf16 engine), and ``config.json`` says so (``dtype: float32``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from resihp_lightning.torch_utils import meta
from resihp_lightning.torch_utils.collectives import all_gather_objects, broadcast_from_zero
from resihp_lightning.errors import ConfigError, invalid_option
from resihp_lightning.models.attention import PACKED_ATTENTION
from resihp_lightning.models.layers import DecoderPipe, EmbeddingPipe, HeadPipe

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
"""Values of ``config.json``'s ``model_type`` that this package turns into pipeline layers."""

#: How :func:`load_pipeline_model` reads a checkpoint: ``"per_stage"`` builds the layers on the meta
#: device and :class:`HFLayerLoader` fills one layer at a time; ``"whole"`` loads the whole model
#: with ``AutoModelForCausalLM.from_pretrained``.
LOAD_MODES = ("per_stage", "whole")

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"


@dataclass
class PipelineCausalLM:
    """A causal LM as pipeline layers.

    Attributes:
        config: the model's Hugging Face config as it was loaded (attention implementation not
            touched); :func:`save_hf_checkpoint` writes it.
        layers: ``num_hidden_layers + 2`` modules in model order (embedding, decoders, head).
        source_dir: the checkpoint directory it came from, or ``None`` for a fresh model.
        loader: for a per-stage load, what fills a layer still on the meta device; else ``None``.
    """

    config: object
    layers: list[nn.Module]
    source_dir: Path | None = None
    loader: HFLayerLoader | None = None


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


def load_pipeline_model(
    path: str | Path, dtype: torch.dtype = torch.float32, load: str = "whole"
) -> PipelineCausalLM:
    """Loads a local HF Llama / Qwen2 checkpoint (``config.json`` + safetensors) as pipeline layers.

    Args:
        path: the checkpoint directory.
        dtype: parameter dtype.
        load: ``"whole"`` reads every weight now (``from_pretrained``); ``"per_stage"`` reads none:
            the layers are on the meta device and :attr:`PipelineCausalLM.loader` fills each one
            when it is needed (see the module docstring).

    Returns:
        The :class:`PipelineCausalLM`.

    Raises:
        ConfigError: missing directory / config / weights, an unsupported architecture, an unknown
            ``load``, or ``"per_stage"`` on a checkpoint without safetensors files.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if load not in LOAD_MODES:
        raise invalid_option("model.load", load, LOAD_MODES)
    directory = Path(path)
    read_model_type(directory)
    if not any(any(directory.glob(p)) for p in _WEIGHT_PATTERNS):
        raise ConfigError(f"model checkpoint directory {str(directory)!r} has no *.safetensors weights")
    if load == "whole":
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
        config = copy.deepcopy(model.config)
        return PipelineCausalLM(config=config, layers=_layers_from_hf(model), source_dir=directory)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    loader = HFLayerLoader(directory, config.num_hidden_layers, bool(getattr(config, "tie_word_embeddings", False)))
    model = _empty_model(config, dtype)
    config = copy.deepcopy(model.config)
    return PipelineCausalLM(config=config, layers=_layers_from_hf(model), source_dir=directory, loader=loader)


def _empty_model(config: object, dtype: torch.dtype) -> nn.Module:
    """An HF ``*ForCausalLM`` whose parameters are on the meta device; its rotary embedding (whose
    buffers no checkpoint holds) is built on the CPU, as ``from_pretrained`` builds it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)
    model.config.dtype = dtype
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config)
    return model


def _hf_key(index: int, name: str, num_hidden_layers: int) -> str:
    """The Hugging Face key of tensor ``name`` of pipeline layer ``index`` (see the module docstring)."""
    if index == 0 and name.startswith("embed_tokens."):
        return f"model.{name}"
    if 1 <= index <= num_hidden_layers and name.startswith("layer."):
        return f"model.layers.{index - 1}.{name[len('layer.'):]}"
    if index == num_hidden_layers + 1 and name.startswith("norm."):
        return f"model.{name}"
    if index == num_hidden_layers + 1 and name.startswith("lm_head."):
        return name
    raise ConfigError(f"pipeline state key '{index}.{name}' does not map to a {num_hidden_layers}-layer HF model")


class HFLayerLoader:
    """Reads the tensors of one pipeline layer from a local HF checkpoint's safetensors files.

    Only the tensors of the layer asked for are read (``safetensors.safe_open`` maps the file and
    reads those entries), so a process that holds a quarter of the layers reads a quarter of the
    weights. Sharded checkpoints are found through ``model.safetensors.index.json``; a single
    ``model.safetensors`` works too. With ``tie_word_embeddings`` and no ``lm_head.weight`` in the
    checkpoint, the head's matrix is read from ``model.embed_tokens.weight``.

    Args:
        directory: the checkpoint directory.
        num_hidden_layers: the model's decoder layer count (layer ``L + 1`` is the head).
        tie_word_embeddings: whether the checkpoint ties the head to the embedding.

    Raises:
        ConfigError: the directory has no safetensors weights (``pytorch_model.bin`` checkpoints
            need ``load="whole"``), or its index is unreadable.
    """

    def __init__(self, directory: str | Path, num_hidden_layers: int, tie_word_embeddings: bool) -> None:
        self.directory = Path(directory)
        self.num_hidden_layers = int(num_hidden_layers)
        self.tie_word_embeddings = bool(tie_word_embeddings)
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        index_file = self.directory / SAFE_INDEX_NAME
        single = self.directory / SAFE_WEIGHTS_NAME
        if single.is_file():  # what from_pretrained reads first as well
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as handle:
                return {key: SAFE_WEIGHTS_NAME for key in handle.keys()}
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ConfigError(f"cannot read {str(index_file)!r}: {exc}") from None
            return {str(k): str(v) for k, v in weight_map.items()}
        raise ConfigError(
            f"model checkpoint directory {str(self.directory)!r} has no {SAFE_WEIGHTS_NAME} or {SAFE_INDEX_NAME}; "
            "per-stage loading reads safetensors files: convert the checkpoint or load it with load='whole'"
        )

    def source_key(self, index: int, name: str) -> str:
        """The checkpoint key that holds tensor ``name`` of pipeline layer ``index``."""
        key = _hf_key(index, name, self.num_hidden_layers)
        if key == "lm_head.weight" and key not in self.weight_map and self.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return key

    def load_layer(self, index: int, layer: nn.Module, device: torch.device | str = "cpu") -> list[str]:
        """Fills the tensors of ``layer`` that are on the meta device from the checkpoint, on ``device``.

        Tensors already on a real device are left as they are (e.g. the rotary frequencies, or a
        head matrix tied by hand to a loaded embedding); the ``Parameter`` objects stay the same
        objects (see :mod:`resihp_lightning.torch_utils.meta`). Values are cast to the layer's dtypes.

        Returns:
            The checkpoint keys read.

        Raises:
            ConfigError: a tensor is missing from the checkpoint or has another shape.
        """
        from safetensors import safe_open

        slots = meta.meta_slots(layer)
        by_file: dict[str, list[tuple[meta.TensorSlot, str]]] = {}
        for slot in slots:
            if not slot.persistent:
                raise ConfigError(
                    f"pipeline layer {index}: buffer {slot.name!r} is on the meta device and in no checkpoint"
                )
            key = self.source_key(index, slot.name)
            if key not in self.weight_map:
                raise ConfigError(f"checkpoint {str(self.directory)!r} has no tensor {key!r} (pipeline layer {index})")
            by_file.setdefault(self.weight_map[key], []).append((slot, key))
        read = []
        for filename, wanted in by_file.items():
            with safe_open(str(self.directory / filename), framework="pt", device="cpu") as handle:
                for slot, key in wanted:
                    value = handle.get_tensor(key)
                    try:
                        meta.fill(slot, value.to(device=device, dtype=slot.tensor.dtype))
                    except ValueError as exc:
                        raise ConfigError(f"checkpoint tensor {key!r} does not fit pipeline layer {index}: {exc}") from None
                    del value
                    read.append(key)
        layer.to(device)
        return read


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
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        match = _KEY.match(key)
        if match is None:
            raise ConfigError(f"pipeline state key {key!r} does not map to a {num_hidden_layers}-layer HF model")
        out[_hf_key(int(match.group(1)), match.group(2), num_hidden_layers)] = value
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
    weights = hf_state_dict(state, config.num_hidden_layers)  # type: ignore[attr-defined]
    keep_tied = False
    if getattr(config, "tie_word_embeddings", False):
        embed, head = weights["model.embed_tokens.weight"], weights.get("lm_head.weight")
        keep_tied = head is None or torch.equal(embed, head)
        if keep_tied:
            weights.pop("lm_head.weight", None)
    cfg = _config_to_save(config, keep_tied)
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
    _save_tokenizer(tokenizer_dir, out)
    return out


def _digest(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    """Identifies a tensor's value (dtype, shape, SHA-256 of its bytes): equal digests, equal tensors."""
    data = tensor.detach().cpu().contiguous()
    return (str(data.dtype), tuple(data.shape), hashlib.sha256(data.view(torch.uint8).numpy()).hexdigest())


def _agree(error: str | None, any_rank: bool = False) -> None:
    """Collective: raises the same :class:`~resihp_lightning.errors.ConfigError` on every rank when ``error`` (rank 0's, or any
    rank's with ``any_rank``) is set, so that no rank waits for a peer that gave up."""
    if any_rank:
        first = next((e for e in all_gather_objects(error) if e is not None), None)
    else:
        first = broadcast_from_zero(error)
    if first is not None:
        raise ConfigError(first)


def _config_to_save(config: object, keep_tied: bool) -> Any:
    """A copy of the HF config as saved: attention implementation reset, untied when the head's matrix
    differs from the embedding's (``keep_tied`` False)."""
    cfg = copy.deepcopy(config)
    cfg._attn_implementation = None
    if getattr(cfg, "tie_word_embeddings", False) and not keep_tied:
        cfg.tie_word_embeddings = False
    return cfg


def _save_tokenizer(tokenizer_dir: str | Path | None, out: Path) -> None:
    """Saves ``tokenizer_dir``'s Hugging Face tokenizer into ``out`` (nothing when it has none: the
    byte-level fallback has no files)."""
    if tokenizer_dir is None:
        return
    from resihp_lightning.data.tokenizer import has_hf_tokenizer, load_tokenizer

    if has_hf_tokenizer(tokenizer_dir):
        load_tokenizer(tokenizer_dir).save_pretrained(out)  # type: ignore[attr-defined]


def _prepare_output(out: Path, source_dir: str | Path | None) -> None:
    """Creates ``out`` and removes weight files an earlier save left there (``from_pretrained`` would
    read a stale ``model.safetensors`` before the new index)."""
    out.mkdir(parents=True, exist_ok=True)
    if source_dir is not None and out.resolve() == Path(source_dir).resolve():
        raise ConfigError(
            f"refusing to save over {str(out)!r}: it is the checkpoint the model was loaded from; choose another directory"
        )
    for pattern in ("model*.safetensors", SAFE_INDEX_NAME, "pytorch_model*.bin", "pytorch_model.bin.index.json"):
        for stale in out.glob(pattern):
            stale.unlink()


def shard_name(stage: int, num_stages: int) -> str:
    """File of stage ``stage`` (0-based) of ``num_stages``: ``model-0000k-of-0000P.safetensors``."""
    return f"model-{stage + 1:05d}-of-{num_stages:05d}.safetensors"


def save_sharded_hf_checkpoint(
    tensors: Mapping[str, torch.Tensor],
    stage: int | None,
    num_stages: int,
    config: object,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    source_dir: str | Path | None = None,
) -> Path:
    """Writes a Hugging Face checkpoint from the pipeline's stages; collective over the default group.

    Every rank of the default process group calls it. The ranks of one full copy of the model (the
    first replica's stages) pass their layers' tensors and their stage; each writes
    :func:`shard_name` ``(stage, num_stages)`` with those tensors under their Hugging Face names, in
    float32. Rank 0 then writes ``model.safetensors.index.json``, ``config.json`` (attention
    implementation reset, ``dtype: float32``), ``generation_config.json`` (the source checkpoint's, if
    it has one) and the tokenizer. No rank assembles the model. Tied embeddings: when the head's copy
    equals the embedding (compared by digest between the two holders), the head's matrix is left out
    and the checkpoint stays tied; otherwise both are written with ``tie_word_embeddings: false``, as
    :func:`save_hf_checkpoint` does. ``out_dir`` must be visible to every writer (a shared file
    system on several machines). Weight files an earlier save left in ``out_dir`` are removed.

    Args:
        tensors: this rank's trained tensors keyed ``"{global_layer_index}.{name}"`` (``{}`` on
            ranks that do not write).
        stage: this rank's stage in the replica that writes, or ``None``.
        num_stages: that replica's stage count (the number of files).
        config: the HF config (``PipelineCausalLM.config``).
        out_dir: output directory (created).
        tokenizer_dir: copy this directory's HF tokenizer next to the weights, if it has one.
        source_dir: the checkpoint the model was loaded from (its generation config is copied;
            saving over it is refused).

    Returns:
        The output directory.

    Raises:
        ConfigError: on every rank, when ``out_dir`` is ``source_dir`` or cannot be written, or the stages'
            tensors do not make up the model ``config`` describes.
    """
    import torch.distributed as dist
    from safetensors.torch import save_file

    rank = dist.get_rank()
    out = Path(out_dir)
    error = None
    if rank == 0:
        try:
            _prepare_output(out, source_dir)
        except (OSError, ConfigError) as exc:
            error = str(exc)
    _agree(error)

    num_hidden = int(config.num_hidden_layers)  # type: ignore[attr-defined]
    weights = hf_state_dict(tensors, num_hidden) if stage is not None else {}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    digests: dict[str, Any] = {}
    if tied:
        digests = {k: _digest(weights[k]) for k in ("model.embed_tokens.weight", "lm_head.weight") if k in weights}
    merged = {k: v for part in all_gather_objects(digests) for k, v in part.items()}
    keep_tied = tied and merged.get("lm_head.weight", merged.get("model.embed_tokens.weight")) == merged.get(
        "model.embed_tokens.weight"
    )
    if keep_tied:
        weights.pop("lm_head.weight", None)

    written: dict[str, dict[str, int]] = {}
    error = None
    if stage is not None:
        name = shard_name(stage, num_stages)
        try:
            data = {
                key: value.detach().to("cpu", torch.float32 if value.is_floating_point() else value.dtype).contiguous()
                for key, value in sorted(weights.items())
            }
            out.mkdir(parents=True, exist_ok=True)
            save_file(data, str(out / name), metadata={"format": "pt"})
            written[name] = {key: value.numel() * value.element_size() for key, value in data.items()}
            del data
        except OSError as exc:
            error = f"cannot write {str(out / name)!r}: {exc}"
    _agree(error, any_rank=True)
    parts: list[Any] = [None] * dist.get_world_size() if rank == 0 else None  # type: ignore[assignment]
    dist.gather_object(written, parts, dst=0)

    error = None
    if rank == 0:
        try:
            files = {name: keys for part in parts for name, keys in part.items()}
            _write_index_and_config(out, files, config, keep_tied, tokenizer_dir, source_dir)
        except (OSError, ConfigError) as exc:
            error = str(exc)
    _agree(error)
    return out


def _write_index_and_config(
    out: Path,
    files: Mapping[str, Mapping[str, int]],
    config: object,
    keep_tied: bool,
    tokenizer_dir: str | Path | None,
    source_dir: str | Path | None,
) -> None:
    """Rank 0's part of :func:`save_sharded_hf_checkpoint`: the index (checked against the model's keys),
    the config, the generation config and the tokenizer."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    weight_map = {key: name for name, keys in sorted(files.items()) for key in keys}
    cfg = _config_to_save(config, keep_tied)
    cfg.dtype = torch.float32
    with torch.device("meta"):
        expected = set(AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).state_dict())
    if keep_tied:
        expected.discard("lm_head.weight")
    missing, unexpected = sorted(expected - set(weight_map)), sorted(set(weight_map) - expected)
    if missing or unexpected:
        raise ConfigError(
            f"the stages' tensors do not match the model config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    total = sum(size for keys in files.values() for size in keys.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / SAFE_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    cfg.save_pretrained(out)
    if source_dir is not None and (Path(source_dir) / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(source_dir, local_files_only=True)
    else:
        generation = GenerationConfig.from_model_config(cfg)
    generation.save_pretrained(out)
    _save_tokenizer(tokenizer_dir, out)
