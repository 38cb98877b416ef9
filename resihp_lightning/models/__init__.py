"""Adapters that turn Hugging Face Llama / Qwen2 checkpoints into pipeline layers.

* :mod:`.attention` — per-document causal attention (work ∝ Σ len²) for packed rows, registered in
  ``transformers``' attention interface;
* :mod:`.layers` — embedding / decoder / head pipeline layers around HF's own modules, and the loss;
* :mod:`.hf_checkpoint` — load a local HF checkpoint as layers, build a fresh model from a config, save
  layers back as an HF checkpoint;
* :mod:`.lightning_module` — ``CausalLMPipelineModule`` (a ``ResiHPModule``) and
  ``export_hf_checkpoint`` (Lightning checkpoint → HF directory); loaded lazily because it imports
  Lightning.

Importing this package imports ``transformers`` (a few seconds); the planner and CLI do not.
"""

from resihp_lightning._lazy import lazy_getattr
from resihp_lightning.models.attention import (
    PACKED_ATTENTION,
    packed_attention_forward,
    positions_from_seq_lens,
)
from resihp_lightning.models.hf_checkpoint import (
    SUPPORTED_MODEL_TYPES,
    PipelineCausalLM,
    build_pipeline_model,
    hf_state_dict,
    load_pipeline_model,
    pipeline_state_dict,
    read_model_type,
    save_hf_checkpoint,
    tiny_config,
)
from resihp_lightning.models.layers import (
    IGNORE_INDEX,
    DecoderPipe,
    EmbeddingPipe,
    HeadPipe,
    causal_lm_loss,
)

_LAZY = {
    "CausalLMPipelineModule": "resihp_lightning.models.lightning_module",
    "ScratchModelConfig": "resihp_lightning.config",
    "export_hf_checkpoint": "resihp_lightning.models.lightning_module",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


__all__ = [
    "CausalLMPipelineModule",
    "ScratchModelConfig",
    "export_hf_checkpoint",
    "IGNORE_INDEX",
    "PACKED_ATTENTION",
    "SUPPORTED_MODEL_TYPES",
    "DecoderPipe",
    "EmbeddingPipe",
    "HeadPipe",
    "PipelineCausalLM",
    "build_pipeline_model",
    "causal_lm_loss",
    "hf_state_dict",
    "load_pipeline_model",
    "packed_attention_forward",
    "pipeline_state_dict",
    "positions_from_seq_lens",
    "read_model_type",
    "save_hf_checkpoint",
    "tiny_config",
]
