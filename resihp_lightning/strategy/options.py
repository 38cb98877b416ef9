"""Options of :class:`~resihp_lightning.strategy.strategy.ResiHPStrategy` (plain, YAML friendly)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from resihp_lightning.errors import invalid_option
from resihp_lightning.plan import Plan
from resihp_lightning.failstop.fail_stop_config import FailStopConfig
from resihp_lightning.state.zero_config import deepspeed_runs_zero, layerwise_zero

#: DeepSpeed config keys the strategy owns; an override of them is refused.
RESERVED_DEEPSPEED_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
BACKENDS = ("gloo", "nccl")
#: Who gets every layer's trained weights in the LightningModule at the end of ``fit``.
GATHER_WEIGHTS = ("auto", "all", "rank0", "none")


@dataclass
class StrategyOptions:
    """What a :class:`~resihp_lightning.strategy.strategy.ResiHPStrategy` is built from.

    Attributes:
        pipeline_degree: P of the initial (uniform) plan; ``None`` takes 2 when the world size is even
            and more than 2, else 1. Ignored when ``plan`` is given.
        plan: a full initial :class:`~resihp_lightning.plan.Plan` (device ids are global ranks).
        micro_batch_size: rows of one micro-batch (>= 1).
        micro_batches: M, micro-batches per global batch; ``None`` infers it from the first training
            batch (rows / micro_batch_size).
        deepspeed_config: DeepSpeed config entries written over the strategy's defaults (``bf16``,
            activation checkpointing pass through). ``gradient_clipping`` defaults to 0.0 (off) rather
            than DeepSpeed's 1.0. ``zero_optimization.stage`` 1 runs the layer-wise engine's ZeRO-1
            (:mod:`~resihp_lightning.state.zero_config`); ``"layerwise": False`` in that section runs
            DeepSpeed's ZeRO wrapper instead.
        process_group_backend: ``"gloo"`` or ``"nccl"``; ``None`` picks nccl on CUDA, gloo otherwise.
        timeout: collective timeout.
        gather_weights: at the end of ``trainer.fit``, which ranks' LightningModule receives the
            trained weights of every layer that is an attribute of it: ``"all"`` (each rank already
            holds a full-size copy of those layers), ``"rank0"``, ``"none"`` (each rank keeps current
            values only for its own layers, and a warning says so), or ``"auto"`` (default): what the
            module's ``pipeline_gather_weights()`` asks for, ``"all"`` when it has no preference (a
            module that loads its layers per stage asks for ``"none"``). The strategy replaces
            ``"auto"`` with the resolved value at setup.
        fail_stop: in-process recovery from dead or hung ranks (:class:`~resihp_lightning.failstop.fail_stop_config.FailStopConfig`); ``None`` /
            ``False`` (default): off, a lost rank ends the job; ``True``: on with the defaults.
        tensor_degree: t, processes that split each layer (tensor parallelism; consecutive ranks form a
            group, and plans, ``pipeline_degree`` and ``plan`` count groups). 1 (default): none. With
            t > 1 the optimizer runs in the layer-wise engine (plain, or its ZeRO-1 with each member's shard
            sliced over the same shard's holders; no DeepSpeed ZeRO / bf16 / fp16 wrapper), and the module must
            define ``pipeline_split_layer`` and
            ``pipeline_tensor_parallel_loss`` (``CausalLMPipelineModule`` does); see docs/tensor_parallel.md.
    """

    pipeline_degree: int | None = None
    plan: Plan | None = None
    micro_batch_size: int = 1
    micro_batches: int | None = None
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    process_group_backend: str | None = None
    timeout: timedelta = timedelta(minutes=30)
    gather_weights: str = "auto"
    fail_stop: FailStopConfig | None = None
    tensor_degree: int = 1

    def __post_init__(self) -> None:
        if self.pipeline_degree is not None and (not isinstance(self.pipeline_degree, int) or self.pipeline_degree < 1):
            raise invalid_option("pipeline_degree", self.pipeline_degree, "an integer >= 1")
        if self.plan is not None and not isinstance(self.plan, Plan):
            if isinstance(self.plan, dict):
                self.plan = Plan.from_dict(self.plan)
            else:
                raise invalid_option("plan", self.plan, "a resihp_lightning.plan.Plan or its JSON dict")
        if not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1:
            raise invalid_option("micro_batch_size", self.micro_batch_size, "an integer >= 1")
        if self.micro_batches is not None and (not isinstance(self.micro_batches, int) or self.micro_batches < 1):
            raise invalid_option("micro_batches", self.micro_batches, "an integer >= 1 or None")
        if not isinstance(self.deepspeed_config, dict):
            raise invalid_option("deepspeed_config", self.deepspeed_config, "a dict of DeepSpeed config entries")
        for key in RESERVED_DEEPSPEED_KEYS:
            if key in self.deepspeed_config:
                raise invalid_option(
                    f"deepspeed_config.{key}", self.deepspeed_config[key],
                    "nothing: the strategy sets it from micro_batch_size and the plan",
                )
        stage = (self.deepspeed_config.get("zero_optimization") or {}).get("stage", 0)
        if stage not in (0, 1):
            raise invalid_option("deepspeed_config.zero_optimization.stage", stage, (0, 1))
        layerwise_zero(self.deepspeed_config)  # refuses a bad zero_optimization.layerwise combination now
        if self.process_group_backend is not None and self.process_group_backend not in BACKENDS:
            raise invalid_option("process_group_backend", self.process_group_backend, BACKENDS)
        if self.gather_weights not in GATHER_WEIGHTS:
            raise invalid_option("gather_weights", self.gather_weights, GATHER_WEIGHTS)
        self.fail_stop = FailStopConfig.from_value(self.fail_stop)
        if not isinstance(self.tensor_degree, int) or isinstance(self.tensor_degree, bool) or self.tensor_degree < 1:
            raise invalid_option("tensor_degree", self.tensor_degree, "an integer >= 1")
        if self.tensor_degree > 1 and (deepspeed_runs_zero(self.deepspeed_config)
                                       or any((self.deepspeed_config.get(k) or {}).get("enabled") for k in ("bf16", "fp16"))):
            raise invalid_option("tensor_degree", self.tensor_degree, "1 with DeepSpeed's ZeRO / bf16 / fp16 wrappers in "
                                 "deepspeed_config (tensor parallelism needs the layer-wise engine: the plain optimizer "
                                 "or its ZeRO-1, zero_optimization.stage=1 without layerwise=False)")
        if isinstance(self.timeout, (int, float)):
            self.timeout = timedelta(seconds=self.timeout)
