"""Per-micro-batch workload model: predicted healthy time = alpha*tokens + beta*sum(len^2) + gamma.

A micro-batch's busy compute time on one rank grows linearly with its tokens (the dense layers) and
with the sum over its documents of length squared (attention), plus a fixed cost (kernel launches,
norms). The detector divides a prediction from this model by the observed time to get a speed that
does not move when the data does.

Fitting is robust: Huber M-estimation by iteratively reweighted least squares on numpy, with the
residual scale re-estimated from the median absolute deviation each round, so a few micro-batches hit
by a page fault or a GC pause do not bend the fit.

Refit policy (implemented by :class:`OnlineWorkloadFit`):

* a model belongs to one rank *and* one set of layers; the first ``warmup_steps`` steps under that
  set are skipped (allocator, autotuning, the first step after a migration), the next ``fit_steps``
  steps are collected and fitted once;
* when the rank's layers change (a new plan was applied) the model is dropped and the cycle starts
  again; the detector carries the rank's last speed estimate across the refit, so a slow device
  does not look healthy to itself after a re-plan;
* there is deliberately no periodic refit on later data: refitting on a slowly degrading device
  would absorb the slowdown it should expose.

:meth:`OnlineWorkloadFit.state_dict` holds the fitted model, or the warm-up / fit progress, as plain
data, so that a job resumed from a checkpoint needs no new warm-up and fit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from resihp_lightning.errors import invalid_option

#: 1.4826 * MAD estimates the standard deviation of normally distributed residuals.
_MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class WorkloadModel:
    """A fitted model ``alpha*tokens + beta*sum_len_sq + gamma`` (milliseconds).

    Attributes:
        alpha: ms per token.
        beta: ms per unit of sum(len^2).
        gamma: ms per micro-batch.
        rel_scale: robust standard deviation of observed/predicted - 1 on the fit data.
        samples: how many micro-batches the fit used.
        ref_tokens, ref_sum_len_sq: the median workload of the fit data (a typical micro-batch, where
            models of different ranks can be compared).
    """

    alpha: float
    beta: float
    gamma: float
    rel_scale: float
    samples: int
    ref_tokens: float = 0.0
    ref_sum_len_sq: float = 0.0

    def predict(self, tokens: np.ndarray | float, sum_len_sq: np.ndarray | float) -> np.ndarray:
        """Predicted healthy time (ms), floored at a small positive value."""
        pred = self.alpha * np.asarray(tokens, dtype=float) + self.beta * np.asarray(sum_len_sq, dtype=float) + self.gamma
        return np.maximum(pred, 1e-9)

    @property
    def coefficients(self) -> tuple[float, float, float]:
        return (self.alpha, self.beta, self.gamma)

    def to_dict(self) -> dict[str, float | int]:
        """The model as plain numbers (for checkpoints)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkloadModel:
        return cls(**data)


def fit_workload(
    tokens: Sequence[float] | np.ndarray,
    sum_len_sq: Sequence[float] | np.ndarray,
    times_ms: Sequence[float] | np.ndarray,
    *,
    huber_k: float = 1.345,
    max_iter: int = 50,
    tol: float = 1e-7,
) -> WorkloadModel:
    """Fits the workload model robustly (Huber IRLS, relative residuals).

    Residuals are taken relative to the prediction (weights 1/time^2): timing noise is
    multiplicative, and a 1 ms error matters more on a 5 ms micro-batch than on a 500 ms one.
    Collinear features (every micro-batch packed to the same token count) are handled by a
    minimum-norm least-squares solve, which still predicts correctly within the data's range.

    Args:
        tokens: tokens per micro-batch.
        sum_len_sq: sum of squared document lengths per micro-batch.
        times_ms: observed busy time per micro-batch.
        huber_k: Huber threshold in units of the residual scale (1.345: 95% efficiency).
        max_iter: IRLS iterations at most.
        tol: stop when coefficients change less than this (relative).

    Raises:
        ConfigError: fewer than 3 samples, mismatched lengths or non-positive times.
    """
    x_tok = np.asarray(tokens, dtype=float)
    x_sq = np.asarray(sum_len_sq, dtype=float)
    y = np.asarray(times_ms, dtype=float)
    if not (x_tok.shape == x_sq.shape == y.shape) or y.ndim != 1:
        raise invalid_option("times_ms", f"{y.shape}", "three 1-d arrays of the same length")
    if y.size < 3:
        raise invalid_option("samples", int(y.size), "at least 3 micro-batches to fit 3 coefficients")
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise invalid_option("times_ms", "non-positive or non-finite value", "finite times > 0")
    # Column scaling keeps the normal equations well conditioned (sum_len_sq reaches 1e8 and more).
    scale = np.array([max(np.abs(x_tok).max(), 1.0), max(np.abs(x_sq).max(), 1.0), 1.0])
    design = np.column_stack([x_tok / scale[0], x_sq / scale[1], np.ones_like(y)])
    base_w = 1.0 / y  # relative residuals: (y - Xb) / y
    weights = np.ones_like(y)
    coef = np.zeros(3)
    rel = np.zeros_like(y)
    sigma = 0.0
    for _ in range(max_iter):
        w = base_w * np.sqrt(weights)
        new, *_ = np.linalg.lstsq(design * w[:, None], y * w, rcond=None)
        rel = (y - design @ new) / y
        sigma = _MAD_TO_SIGMA * float(np.median(np.abs(rel - np.median(rel))))
        cutoff = huber_k * max(sigma, 1e-6)
        abs_rel = np.abs(rel)
        weights = np.where(abs_rel <= cutoff, 1.0, cutoff / np.maximum(abs_rel, 1e-300))
        done = np.all(np.abs(new - coef) <= tol * np.maximum(np.abs(new), 1e-12))
        coef = new
        if done:
            break
    alpha, beta, gamma = coef / scale
    pred = np.maximum(design @ coef, 1e-9)
    ratio = y / pred - 1.0
    rel_scale = _MAD_TO_SIGMA * float(np.median(np.abs(ratio - np.median(ratio))))
    return WorkloadModel(float(alpha), float(beta), float(gamma), rel_scale, int(y.size),
                         float(np.median(x_tok)), float(np.median(x_sq)))


class OnlineWorkloadFit:
    """Collects one rank's micro-batches after a warm-up and fits a :class:`WorkloadModel` once.

    See the module docstring for the refit policy. Call :meth:`add_step` once per training step with
    that step's micro-batches; :attr:`model` becomes available after ``warmup_steps + fit_steps``
    steps under the same layers.

    Args:
        warmup_steps: steps skipped after start or after the layers change (>= 0).
        fit_steps: steps collected for the fit (>= 1; the fit also needs >= 3 micro-batches).
    """

    def __init__(self, warmup_steps: int = 2, fit_steps: int = 10) -> None:
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise invalid_option("warmup_steps", warmup_steps, "an integer >= 0")
        if not isinstance(fit_steps, int) or fit_steps < 1:
            raise invalid_option("fit_steps", fit_steps, "an integer >= 1")
        self.warmup_steps = warmup_steps
        self.fit_steps = fit_steps
        self.layers: tuple[int, int] | None = None
        #: The fitted workload model; ``None`` until the warm-up and the first fit are done.
        self.model: WorkloadModel | None = None
        self.fits = 0  # how many models have been fitted so far (a new one per layer set)
        self._seen = 0
        self._buffer: list[tuple[float, float, float]] = []

    def reset(self, layers: tuple[int, int] | None) -> None:
        """Drops the model and starts a new warm-up for ``layers``."""
        self.layers = layers
        self.model = None
        self._seen = 0
        self._buffer = []

    def state_dict(self) -> dict[str, Any]:
        """The fit's progress and model as plain data (``warmup_steps`` / ``fit_steps`` are options, not state)."""
        return {
            "layers": self.layers,
            "model": None if self.model is None else self.model.to_dict(),
            "fits": self.fits,
            "seen": self._seen,
            "buffer": [tuple(float(v) for v in sample) for sample in self._buffer],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned."""
        layers = state["layers"]
        self.layers = None if layers is None else (int(layers[0]), int(layers[1]))
        self.model = None if state["model"] is None else WorkloadModel.from_dict(state["model"])
        self.fits = int(state["fits"])
        self._seen = int(state["seen"])
        self._buffer = [tuple(sample) for sample in state["buffer"]]

    def add_step(self, layers: tuple[int, int], samples: Sequence[tuple[float, float, float]]) -> bool:
        """Feeds one step's ``(tokens, sum_len_sq, compute_ms)`` samples.

        Returns:
            True when this call completed a fit (a new model is in :attr:`model`).
        """
        if layers != self.layers:
            self.reset(layers)
        self._seen += 1
        if self.model is not None or self._seen <= self.warmup_steps:
            return False
        self._buffer.extend(s for s in samples if s[2] > 0)
        if self._seen < self.warmup_steps + self.fit_steps or len(self._buffer) < 3:
            return False
        data = np.asarray(self._buffer, dtype=float)
        self.model = fit_workload(data[:, 0], data[:, 1], data[:, 2])
        self._buffer = []
        self.fits += 1
        return True


def predict_batch_ms(
    stage_ms: Sequence[Sequence[float]],
    workloads: Sequence[Sequence[tuple[float, float]]],
    model: WorkloadModel,
    reference: tuple[float, float],
    *,
    p2p_ms: float = 0.0,
    allreduce_ms: float = 0.0,
) -> float:
    """Iteration time of one batch under a plan, from its micro-batches' packed sequence lengths.

    The planning model (:func:`resihp_lightning.plan.evaluate`) prices every micro-batch at the
    per-layer averages it was profiled at. A batch of long documents costs more than that (attention
    grows with the sum of squared document lengths), one of short documents less. Here each
    micro-batch's stage times are the averages scaled by its workload relative to the profiled
    average, ``model(tokens, sum_len_sq) / model(*reference)``, and each replica's 1F1B time uses
    the micro-batches it really runs: the first fills and drains the pipeline (the sum over its
    stages), each later one adds its slowest stage.

    Args:
        stage_ms: per replica, the average forward + backward ms of each stage (at the devices'
            speeds), e.g. ``plan.evaluate(...).stage_ms`` without ``p2p_ms``.
        workloads: per replica, the ``(tokens, sum_len_sq)`` of each micro-batch it runs, in order.
        model: a workload model of the whole model (or any fixed share of it): only its ratios are used.
        reference: the ``(tokens, sum_len_sq)`` of the average micro-batch ``stage_ms`` was measured at.
        p2p_ms: transfer per micro-batch between adjacent stages (as in the planning model).
        allreduce_ms: gradient synchronisation per iteration when there is more than one replica.

    Raises:
        ConfigError: ``stage_ms`` and ``workloads`` name different numbers of replicas.
    """
    if len(stage_ms) != len(workloads):
        raise invalid_option("workloads", len(workloads), f"one list per replica ({len(stage_ms)})")
    base = float(model.predict(*reference))
    times = []
    for stages, items in zip(stage_ms, workloads):
        if not items:
            continue
        scales = [float(model.predict(tokens, sq)) / base for tokens, sq in items]
        per = [[t * s + (p2p_ms if j < len(stages) - 1 else 0.0) for j, t in enumerate(stages)] for s in scales]
        times.append(sum(per[0]) + sum(max(row) for row in per[1:]))
    return max(times, default=0.0) + (allreduce_ms if len(stage_ms) > 1 else 0.0)
