"""What the strategy measures each step and hands to the detector and the controller.

The strategy fills these on every rank; callbacks read ``strategy.last_step_stats`` (this rank's
:class:`StepStats`) in ``on_train_batch_end`` and ``strategy.layer_profile()`` (per-layer costs for
the planner). Plain dataclasses so they pickle cheaply through ``all_gather_object``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MicroBatchStats:
    """One micro-batch as one rank saw it.

    Attributes:
        compute_ms: this rank's busy compute time for the micro-batch (its stage's forward + backward,
            measured by hooks on its own layers; waiting for peers is excluded).
        tokens: tokens in the micro-batch (padding excluded).
        sum_len_sq: sum over the micro-batch's documents of length**2 (attention work).
    """

    compute_ms: float
    tokens: int
    sum_len_sq: int


@dataclass(frozen=True)
class StepStats:
    """One training step on one rank.

    Attributes:
        step: the trainer's global step this describes.
        rank: global rank.
        replica: data-parallel replica index of the rank under the current plan.
        stage: pipeline stage index of the rank under the current plan.
        layers: (first, last + 1) global layer indices held by the rank.
        micro_batches: per micro-batch statistics, in execution order.
        step_ms: wall time of the whole step on this rank (the same on every rank in a synchronous job).
        tensor_wait_ms: time inside its tensor-parallel group's all-reduces during the step (0 without
            tensor parallelism): the micro-batches' compute minus it is the process's own compute.
        tensor_degree: its tensor-parallel group's degree (1 without tensor parallelism): the same layers
            cost another time at another degree.
    """

    step: int
    rank: int
    replica: int
    stage: int
    layers: tuple[int, int]
    micro_batches: tuple[MicroBatchStats, ...] = field(default=())
    step_ms: float = 0.0
    tensor_wait_ms: float = 0.0
    tensor_degree: int = 1


@dataclass(frozen=True)
class LayerCost:
    """Measured cost of one layer, the planner's ``Layer`` before it is built.

    Attributes:
        index: global layer index.
        compute_ms: forward + backward time of one micro-batch on a healthy device.
        static_mb: parameters + gradients + optimizer state.
        activation_mb: memory kept per in-flight micro-batch.
    """

    index: int
    compute_ms: float
    static_mb: float
    activation_mb: float


@dataclass(frozen=True)
class LinkSample:
    """One link probe (``strategy.measure_links()``), the same on every rank that took part.

    Attributes:
        step: the trainer's global step after which the probe ran.
        probe_bytes: bytes sent each way per round trip: the activation crossing a stage boundary per
            micro-batch (so a round trip prices ``p2p_ms``: the activation forward, its gradient back).
        round_trips_ms: device id -> its measured round trips this probe, one per partner.
        partners: device id -> the partner of each of those round trips, in the same order.
        allreduce_ms: a gradient all-reduce over the job's ranks, scaled to the largest per-rank
            gradient (``allreduce_bytes``): the iteration's data-parallel synchronisation.
        allreduce_bytes: the gradient bytes ``allreduce_ms`` is priced for.
    """

    step: int
    probe_bytes: int
    round_trips_ms: dict[int, list[float]]
    partners: dict[int, list[int]]
    allreduce_ms: float
    allreduce_bytes: int
