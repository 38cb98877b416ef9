"""First-principles model profiles: per-layer FLOPs, time, memory and communication of a decoder LLM.

A profile turns a model (:class:`ModelSpec`), the hardware (:class:`HardwareSpec`) and the workload
(:class:`WorkloadSpec`) into the planner's :class:`~resihp_lightning.plan.Layer` list plus the
problem's ``p2p_ms`` and ``allreduce_ms``. Everything is arithmetic; nothing is measured.

FLOPs of one decoder layer, forward, for one packed micro-batch of s tokens made of documents of
lengths len_i (sum len_i = s), hidden size h, key/value width h_kv = kv_heads * head_dim, MLP width f
(SwiGLU, three matrices)::

    linear    = 2 * s * (h * (h + 2 h_kv) + h * h + 3 * h * f)     # QKV, output, MLP matmuls
    attention = 2 * h * sum(len_i ** 2)                           # QK^T and AV, causal (half of 4 h len^2)

Backward costs twice the forward; full activation recomputation adds one more forward, so a
micro-batch costs ``3 x`` (``4 x`` with recomputation) the forward FLOPs. Time is FLOPs divided by
``peak_tflops * utilisation`` of the device. The LM head adds ``2 s h V`` forward; the embedding
lookup costs no FLOPs.

Memory per layer: ``bytes_per_param`` (16 for bf16 weights and gradients with fp32 master and two
Adam moments) times its parameters; activations per in-flight micro-batch are the layer input
(``2 s h`` bytes in bf16) under full recomputation, else ``34 s h`` bytes (Korthikanti et al., 2022,
"Reducing Activation Recomputation in Large Transformer Models", with the ``5 a s / h`` term removed
by flash attention).

Tensor parallelism: the project has none yet, so a TP group of ``tp`` GPUs is one planner device.
Its compute is the layer's FLOPs over ``tp`` GPUs plus the group's activation all-reduces over
NVLink (four per layer per micro-batch: two forward, two backward, each ``2 s h`` bytes in a ring),
its memory is ``tp`` GPUs' memory, and its point-to-point traffic uses ``tp`` network links.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from resihp_lightning.errors import ConfigError, invalid_option
from resihp_lightning.plan import Layer
from resihp_lightning.tensor_plan import TensorCost, even_split_degrees

MB = 1e6
GB = 1e9


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (LLaMA-style: RMSNorm, GQA attention, SwiGLU MLP).

    Attributes:
        name: how tables name it.
        layers: decoder layers.
        hidden: model width h.
        ffn: MLP width f.
        heads: attention heads.
        kv_heads: key/value heads (GQA); equal to ``heads`` for multi-head attention.
        vocab: vocabulary size V.
        qkv_bias: the QKV projections have biases (Qwen2.5).
        tied_embeddings: the LM head shares the embedding matrix.
    """

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    qkv_bias: bool = False
    tied_embeddings: bool = False

    @property
    def kv_width(self) -> int:
        """h_kv = kv_heads * head_dim."""
        return self.kv_heads * (self.hidden // self.heads)

    def layer_params(self) -> int:
        """Parameters of one decoder layer (matmuls, biases, two RMSNorm weights)."""
        h, kv = self.hidden, self.kv_width
        params = h * (h + 2 * kv) + h * h + 3 * h * self.ffn + 2 * h
        if self.qkv_bias:
            params += h + 2 * kv
        return params

    def total_params(self) -> int:
        """All parameters (embedding, layers, final norm, LM head unless tied)."""
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * self.layer_params() + self.hidden + head


#: The paper's models (public configs: Llama 2, Touvron et al. 2023; Qwen2.5 technical report, 2024).
MODELS: dict[str, ModelSpec] = {
    "llama2-7b": ModelSpec("llama2-7b", 32, 4096, 11008, 32, 32, 32000),
    "llama2-13b": ModelSpec("llama2-13b", 40, 5120, 13824, 40, 40, 32000),
    "llama2-70b": ModelSpec("llama2-70b", 80, 8192, 28672, 64, 8, 32000),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, qkv_bias=True),
    "qwen2.5-72b": ModelSpec("qwen2.5-72b", 80, 8192, 29568, 64, 8, 152064, qkv_bias=True),
}


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU and its links.

    Attributes:
        peak_tflops: dense bf16 peak (A100: 312).
        utilisation: fraction of the peak a layer's matmuls reach (0.43: Llama 2 was trained at about
            41-44 % model FLOPs utilisation on A100s, derived from its reported GPU-hours).
        memory_gb: memory per GPU the planner may fill (A100-80GB less 8 GB for the framework,
            NCCL buffers and fragmentation).
        nvlink_gbps: NVLink bandwidth per direction per GPU, GB/s (A100: 300).
        network_gbps: network bandwidth per GPU, GB/s (one 200 Gb/s HDR InfiniBand NIC per GPU: 25).
        link_efficiency: the fraction of a link's bandwidth a transfer reaches.
    """

    peak_tflops: float = 312.0
    utilisation: float = 0.43
    memory_gb: float = 72.0
    nvlink_gbps: float = 300.0
    network_gbps: float = 25.0
    link_efficiency: float = 0.8

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "memory_gb", "nvlink_gbps", "network_gbps"):
            if not getattr(self, name) > 0:
                raise invalid_option(f"hardware.{name}", getattr(self, name), "a number > 0")
        for name in ("utilisation", "link_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise invalid_option(f"hardware.{name}", getattr(self, name), "a number in (0, 1]")


@dataclass(frozen=True)
class WorkloadSpec:
    """What one micro-batch holds and how it is trained.

    Attributes:
        seq_len: tokens per micro-batch s (one packed sequence).
        doc_lengths: the packed documents' lengths (summing to ``seq_len``); ``()`` means one document
            of ``seq_len`` tokens, the most attention a micro-batch of s tokens can cost.
        tp: tensor-parallel degree: GPUs per planner device.
        recompute: full activation recomputation (keeps only each layer's input).
        micro_batches_per_device: M / N, the global batch in micro-batches per planner device.
        bytes_per_param: static bytes per parameter (16: bf16 weights and gradients, fp32 master, Adam).
    """

    seq_len: int = 16384
    doc_lengths: tuple[int, ...] = ()
    tp: int = 1
    recompute: bool = True
    micro_batches_per_device: int = 4
    bytes_per_param: float = 16.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "doc_lengths", tuple(self.doc_lengths))
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise invalid_option("workload.seq_len", self.seq_len, "an integer >= 1")
        if self.doc_lengths and (sum(self.doc_lengths) != self.seq_len or min(self.doc_lengths) < 1):
            raise invalid_option("workload.doc_lengths", self.doc_lengths, f"positive lengths summing to seq_len={self.seq_len}")
        if not isinstance(self.tp, int) or self.tp < 1:
            raise invalid_option("workload.tp", self.tp, "an integer >= 1")
        if not isinstance(self.micro_batches_per_device, int) or self.micro_batches_per_device < 1:
            raise invalid_option("workload.micro_batches_per_device", self.micro_batches_per_device, "an integer >= 1")

    @property
    def sum_len_sq(self) -> int:
        """sum len_i^2 over the packed documents."""
        return sum(n * n for n in (self.doc_lengths or (self.seq_len,)))


@dataclass(frozen=True)
class ModelProfile:
    """A model priced on a device (a TP group): what the planner needs, plus what costs are scaled by.

    Attributes:
        model: the model.
        hardware: the GPU.
        workload: the workload.
        layers: planner layers: embedding, the decoder layers, final norm + LM head.
        p2p_ms: activation + gradient between adjacent stages, per micro-batch.
        allreduce_ms: data-parallel gradient all-reduce for a stage of 1 / ``reference_stages`` of
            the parameters (the planner's model has one all-reduce time for every layout).
        reference_stages: the pipeline degree ``allreduce_ms`` assumes.
    """

    model: ModelSpec
    hardware: HardwareSpec
    workload: WorkloadSpec
    layers: tuple[Layer, ...]
    p2p_ms: float
    allreduce_ms: float
    reference_stages: int

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.workload.seq_len

    @property
    def device_memory_mb(self) -> float:
        """Memory of one planner device (``tp`` GPUs)."""
        return self.hardware.memory_gb * GB / MB * self.workload.tp

    def micro_batches(self, num_devices: int) -> int:
        """M for a job of ``num_devices`` planner devices."""
        return self.workload.micro_batches_per_device * num_devices



def layer_forward_flops(model: ModelSpec, workload: WorkloadSpec) -> tuple[float, float]:
    """Forward FLOPs of one decoder layer for one micro-batch: (linear, attention)."""
    h, kv, s = model.hidden, model.kv_width, workload.seq_len
    linear = 2.0 * s * (h * (h + 2 * kv) + h * h + 3 * h * model.ffn)
    attention = 2.0 * h * workload.sum_len_sq
    return linear, attention


def layer_compute_ms(model: ModelSpec, workload: WorkloadSpec, hardware: HardwareSpec) -> float:
    """One decoder layer's forward + backward (and recomputed forward) on ONE GPU, ms."""
    passes = 4.0 if workload.recompute else 3.0  # forward + backward (2x) [+ recomputed forward]
    linear, attention = layer_forward_flops(model, workload)
    return (linear + attention) * passes / (hardware.peak_tflops * 1e12 * hardware.utilisation) * 1000.0


def tp_allreduce_ms(model: ModelSpec, workload: WorkloadSpec, hardware: HardwareSpec, degree: int) -> float:
    """A decoder layer's TP all-reduces in a group of ``degree`` GPUs, per micro-batch, ms: four ring
    all-reduces of the ``2 s h`` byte activation over NVLink (two forward, two backward)."""
    if degree <= 1:
        return 0.0
    nvlink = hardware.nvlink_gbps * GB * hardware.link_efficiency
    return 4 * 2 * (degree - 1) / degree * (2.0 * workload.seq_len * model.hidden) / nvlink * 1000.0


def tensor_cost(model: ModelSpec | str, workload: WorkloadSpec | None = None, hardware: HardwareSpec | None = None,
                max_degree: int = 8, uneven: bool = False) -> TensorCost:
    """The TP degrees a model splits into evenly and their all-reduce fractions, for the per-GPU planning model.

    Degrees divide the heads, the key/value heads and the vocabulary (:func:`~resihp_lightning.tensor_plan.even_split_degrees`),
    or, with ``uneven``, are every degree up to ``max_degree`` (a runtime that splits unevenly).
    f_k is the decoder layer's TP all-reduce time in a group of k (:func:`tp_allreduce_ms`) over its
    compute on one GPU (:func:`layer_compute_ms`): the ratio is the same for every decoder layer,
    and the embedding and head (no recomputation, vocabulary-split loss) are priced at it too.
    """
    model = MODELS[model] if isinstance(model, str) else model
    workload = workload or WorkloadSpec()
    hardware = hardware or HardwareSpec()
    degrees = (tuple(range(1, max_degree + 1)) if uneven
               else even_split_degrees(model.heads, model.kv_heads, model.vocab, max_degree=max_degree))
    compute = layer_compute_ms(model, workload, hardware)
    return TensorCost(degrees, {k: tp_allreduce_ms(model, workload, hardware, k) / compute for k in degrees if k > 1})


def build_profile(
    model: ModelSpec | str,
    workload: WorkloadSpec | None = None,
    hardware: HardwareSpec | None = None,
    reference_stages: int | None = None,
) -> ModelProfile:
    """Prices ``model`` layer by layer on one planner device (a TP group of ``workload.tp`` GPUs).

    Args:
        model: a :class:`ModelSpec` or a key of :data:`MODELS`.
        workload: sequence length, packing, TP degree, recomputation (default :class:`WorkloadSpec`).
        hardware: the GPU (default :class:`HardwareSpec`, an A100-80GB).
        reference_stages: pipeline degree for the all-reduce estimate (default: the fewest stages
            whose static memory fits a device, rounded up to a power of two).

    Raises:
        ConfigError: an unknown model name.
    """
    if isinstance(model, str):
        if model not in MODELS:
            raise invalid_option("model", model, sorted(MODELS))
        model = MODELS[model]
    workload = workload or WorkloadSpec()
    hardware = hardware or HardwareSpec()
    tp, s, h = workload.tp, workload.seq_len, model.hidden
    rate = hardware.peak_tflops * 1e12 * hardware.utilisation * tp  # FLOP/s of one TP group
    network = hardware.network_gbps * GB * hardware.link_efficiency * tp
    act_bytes = 2.0 * s * h  # one bf16 activation tensor of the micro-batch
    layer_ms = layer_compute_ms(model, workload, hardware) / tp + tp_allreduce_ms(model, workload, hardware, tp)
    layer_static = model.layer_params() * workload.bytes_per_param / MB
    layer_act = (act_bytes if workload.recompute else 34.0 * s * h / tp) / MB
    embed_static = model.vocab * h * workload.bytes_per_param / MB
    head_flops = 2.0 * s * h * model.vocab
    head_ms = head_flops * 3.0 / rate * 1000.0  # the head is not recomputed
    # The head keeps its logits' gradient in flight: s * V bf16 values.
    head_act = 2.0 * s * model.vocab / tp / MB
    layers = (
        (Layer(0.0, embed_static, act_bytes / MB),)
        + tuple(Layer(layer_ms, layer_static, layer_act) for _ in range(model.layers))
        + (Layer(head_ms, 0.0 if model.tied_embeddings else embed_static, head_act),)
    )
    total_static_mb = sum(layer.static_mb for layer in layers)
    if reference_stages is None:
        need = total_static_mb / (hardware.memory_gb * GB / MB * tp * 0.8)
        reference_stages = 1 << max(0, math.ceil(math.log2(max(need, 1.0))))
    if reference_stages < 1:
        raise ConfigError(f"reference_stages must be >= 1, got {reference_stages}")
    p2p_ms = 2.0 * act_bytes / network * 1000.0  # activation forward, its gradient backward
    grad_bytes = 2.0 * model.total_params() / reference_stages  # bf16 gradients of one stage
    # Ring all-reduce, bandwidth term 2 (D-1)/D ~ 2, over the group's tp links.
    allreduce_ms = 2.0 * grad_bytes / network * 1000.0
    return ModelProfile(model, hardware, workload, layers, p2p_ms, allreduce_ms, reference_stages)
