"""Seeded synthetic timing traces for the detector's tests and ``benchmarks/detection.py``.

Test-only code: tests and the benchmark import it as ``resihp_lightning.testing.synthetic``.

A trace is what a P-stage x D-replica pipeline job would hand the detector: per step and per rank a
:class:`~resihp_lightning.telemetry.StepStats` whose micro-batches carry packed, long-tailed document
lengths and the rank's busy compute time::

    time = stage_cost[j] * (alpha*tokens + beta*sum_len_sq + gamma) / speed(rank, step) * noise

with log-normal noise and rare spikes (GC pauses, page faults). All stages of a replica see the same
micro-batches; replicas see different ones. Ranks are numbered replica-major (rank = r*P + j).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from resihp_lightning.plan import even_bounds, even_split
from resihp_lightning.telemetry import MicroBatchStats, StepStats


@dataclass(frozen=True)
class SyntheticFault:
    """A fail-slow episode: ``rank`` runs at 1/``factor`` speed for steps ``start`` <= step < ``end``."""

    rank: int
    factor: float
    start: int
    end: int | None = None

    def active(self, step: int) -> bool:
        return step >= self.start and (self.end is None or step < self.end)


@dataclass(frozen=True)
class TraceSpec:
    """What to generate.

    Attributes:
        stages: P.
        replicas: D.
        micro_batches: M per step over all replicas.
        steps: how many steps.
        layers: model layers (split evenly over stages, for ``StepStats.layers``).
        token_budget: tokens a packed micro-batch holds at most.
        length_log_mean / length_log_sigma: log-normal document lengths (long-tailed).
        alpha, beta, gamma: true workload coefficients (ms/token, ms/len^2, ms).
        stage_cost: relative cost of each stage (len P; embedding and LM head stages cost more).
        noise: log-normal sigma of per-micro-batch timing noise.
        spike_prob / spike_factor: probability and size of a rare slow micro-batch.
        faults: fail-slow episodes.
        seed: RNG seed.
    """

    stages: int = 4
    replicas: int = 4
    micro_batches: int = 16
    steps: int = 60
    layers: int = 32
    token_budget: int = 4096
    length_log_mean: float = 5.5
    length_log_sigma: float = 1.3
    alpha: float = 0.01
    beta: float = 0.01 / 4096
    gamma: float = 2.0
    stage_cost: tuple[float, ...] | None = None
    noise: float = 0.03
    spike_prob: float = 0.005
    spike_factor: float = 3.0
    faults: tuple[SyntheticFault, ...] = field(default=())
    seed: int = 0

    def costs(self) -> tuple[float, ...]:
        if self.stage_cost is not None:
            return tuple(self.stage_cost)
        base = [1.0] * self.stages
        base[0] += 0.3
        base[-1] += 0.5
        return tuple(base)

    def speed(self, rank: int, step: int) -> float:
        speed = 1.0
        for fault in self.faults:
            if fault.rank == rank and fault.active(step):
                speed /= fault.factor
        return speed


def pack_micro_batch(rng: np.random.Generator, spec: TraceSpec) -> tuple[int, int]:
    """Packs documents up to the token budget; returns (tokens, sum of squared lengths)."""
    draws = np.clip(rng.lognormal(spec.length_log_mean, spec.length_log_sigma, 64), 8, spec.token_budget)
    truncate = rng.random() < 0.5
    lengths: list[int] = []
    used = 0
    for value in draws.astype(np.int64).tolist():
        if used + value > spec.token_budget:
            if truncate and used < spec.token_budget:  # cut the last document to fill the budget
                lengths.append(spec.token_budget - used)
            break
        lengths.append(value)
        used += value
    if not lengths:
        lengths = [spec.token_budget]
    return sum(lengths), sum(n * n for n in lengths)


def generate_trace(spec: TraceSpec) -> list[list[StepStats]]:
    """Generates ``spec.steps`` steps; element [t][rank] is that rank's StepStats of step t."""
    rng = np.random.default_rng(spec.seed)
    p, d = spec.stages, spec.replicas
    costs = spec.costs()
    bounds = even_bounds(spec.layers, p)
    counts = even_split(spec.micro_batches, d)
    trace: list[list[StepStats]] = []
    for step in range(spec.steps):
        per_rank: list[StepStats | None] = [None] * (p * d)
        replica_ms = []
        for r in range(d):
            work = [pack_micro_batch(rng, spec) for _ in range(counts[r])]
            stage_times: list[list[float]] = []
            for j in range(p):
                rank = r * p + j
                speed = spec.speed(rank, step)
                noise = np.exp(rng.normal(0.0, spec.noise, len(work)))
                spikes = np.where(rng.random(len(work)) < spec.spike_prob, spec.spike_factor, 1.0)
                mbs = []
                for k, (tokens, sq) in enumerate(work):
                    t = costs[j] * (spec.alpha * tokens + spec.beta * sq + spec.gamma) / speed
                    t *= float(noise[k] * spikes[k])
                    mbs.append(MicroBatchStats(compute_ms=t, tokens=tokens, sum_len_sq=sq))
                stage_times.append([mb.compute_ms for mb in mbs])
                per_rank[rank] = StepStats(step, rank, r, j, (bounds[j], bounds[j + 1]), tuple(mbs))
            replica_ms.append(_one_f_one_b_ms(stage_times))
        step_ms = max(replica_ms)
        trace.append([_with_step_ms(s, step_ms) for s in per_rank if s is not None])
    return trace


def _one_f_one_b_ms(stage_times: Sequence[Sequence[float]]) -> float:
    """Fill + drain of the first micro-batch, then the slowest stage for each further micro-batch."""
    first = sum(times[0] for times in stage_times)
    rest = sum(max(times[k] for times in stage_times) for k in range(1, len(stage_times[0])))
    return first + rest


def _with_step_ms(stats: StepStats, step_ms: float) -> StepStats:
    return StepStats(stats.step, stats.rank, stats.replica, stats.stage, stats.layers, stats.micro_batches, step_ms)
