"""The workload model: robust fit of alpha*tokens + beta*sum_len_sq + gamma, and its online refit policy."""

from __future__ import annotations

import numpy as np
import pytest

from resihp_lightning.callbacks.failslow.workload_model import OnlineWorkloadFit, fit_workload
from resihp_lightning.errors import ConfigError

from resihp_lightning.testing.synthetic import TraceSpec, pack_micro_batch

ALPHA, BETA, GAMMA = 0.01, 0.01 / 4096, 2.0


def _samples(n: int, seed: int, noise: float = 0.02) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    spec = TraceSpec()
    work = np.array([pack_micro_batch(rng, spec) for _ in range(n)], dtype=float)
    tokens, sq = work[:, 0], work[:, 1]
    times = (ALPHA * tokens + BETA * sq + GAMMA) * np.exp(rng.normal(0, noise, n))
    return tokens, sq, times


def test_fit_recovers_true_coefficients_and_noise_scale():
    tokens, sq, times = _samples(400, seed=0, noise=0.02)
    model = fit_workload(tokens, sq, times)
    truth = ALPHA * tokens + BETA * sq + GAMMA
    err = np.abs(model.predict(tokens, sq) / truth - 1)
    assert np.median(err) < 0.005 and np.max(err) < 0.03
    assert model.beta == pytest.approx(BETA, rel=0.1)
    assert model.rel_scale == pytest.approx(0.02, rel=0.25)
    assert model.samples == 400


def test_fit_is_robust_to_spikes_where_least_squares_is_not():
    tokens, sq, times = _samples(200, seed=1, noise=0.02)
    rng = np.random.default_rng(7)
    spiked = times.copy()
    hit = rng.choice(times.size, size=20, replace=False)
    spiked[hit] *= 4.0  # 10% of micro-batches hit by a GC pause
    truth = ALPHA * tokens + BETA * sq + GAMMA
    robust = fit_workload(tokens, sq, spiked)
    robust_err = np.median(np.abs(robust.predict(tokens, sq) / truth - 1))
    design = np.column_stack([tokens, sq, np.ones_like(tokens)])
    ols, *_ = np.linalg.lstsq(design, spiked, rcond=None)
    ols_err = np.median(np.abs(design @ ols / truth - 1))
    assert robust_err < 0.02
    assert ols_err > 3 * robust_err


def test_constant_token_count_still_predicts():
    rng = np.random.default_rng(3)
    sq = rng.uniform(1e5, 1.6e7, 100)
    tokens = np.full(100, 4096.0)  # collinear with the intercept
    times = ALPHA * tokens + BETA * sq + GAMMA
    model = fit_workload(tokens, sq, times)
    assert np.allclose(model.predict(tokens, sq), times, rtol=1e-6)


def test_fit_refuses_bad_input():
    with pytest.raises(ConfigError, match="samples"):
        fit_workload([1, 2], [1, 2], [1.0, 2.0])
    with pytest.raises(ConfigError, match="times_ms"):
        fit_workload([1, 2, 3], [1, 2, 3], [1.0, -2.0, 3.0])


def test_online_fit_skips_warmup_fits_once_and_refits_on_new_layers():
    fit = OnlineWorkloadFit(warmup_steps=2, fit_steps=3)
    tokens, sq, times = _samples(40, seed=4)
    step_samples = [list(zip(tokens[i * 4 : i * 4 + 4], sq[i * 4 : i * 4 + 4], times[i * 4 : i * 4 + 4])) for i in range(10)]
    # Warm-up steps are poison: if they were used the fit would be 10x off.
    poison = [(t, s, 10 * y) for t, s, y in step_samples[0]]
    completed = [fit.add_step((0, 4), samples) for samples in [poison, poison] + step_samples[:3]]
    assert completed == [False, False, False, False, True]
    assert fit.model is not None and fit.fits == 1
    assert np.median(np.abs(fit.model.predict(tokens, sq) / times - 1)) < 0.05
    assert fit.add_step((0, 4), step_samples[3]) is False and fit.fits == 1  # no periodic refit
    fit.add_step((0, 6), step_samples[4])  # layers changed: model dropped, warm-up again
    assert fit.model is None
    for samples in step_samples[5:9]:
        fit.add_step((0, 6), samples)
    assert fit.model is not None and fit.fits == 2


def test_online_fit_validates_options():
    with pytest.raises(ConfigError, match="warmup_steps"):
        OnlineWorkloadFit(warmup_steps=-1)
    with pytest.raises(ConfigError, match="fit_steps"):
        OnlineWorkloadFit(fit_steps=0)


def test_batch_prediction_prices_long_documents_above_the_average():
    from resihp_lightning.callbacks.failslow.workload_model import WorkloadModel, predict_batch_ms

    model = WorkloadModel(alpha=0.01, beta=1e-5, gamma=2.0, rel_scale=0.0, samples=10)
    reference = (1024.0, 200_000.0)  # the profiled average micro-batch: 12.24 + 2 = 14.24 ms of model time
    stages = [[10.0, 20.0]]  # one replica, two stages, at the average micro-batch
    average = [[reference] * 4]
    # The average batch: 1F1B with equal micro-batches is sum + (m - 1) * max.
    assert predict_batch_ms(stages, average, model, reference) == pytest.approx(30.0 + 3 * 20.0)
    long_docs = [[(1024.0, 1024.0**2)] * 4]  # one document per row: 10.24 + 10.49 + 2 = 22.73 ms
    scale = (10.24 + 1024.0**2 * 1e-5 + 2.0) / (10.24 + 2.0 + 2.0)
    assert predict_batch_ms(stages, long_docs, model, reference) == pytest.approx((30.0 + 3 * 20.0) * scale)
    # Two replicas: the slower one and one all-reduce decide; p2p on every stage but the last.
    two = predict_batch_ms([[10.0, 20.0], [10.0, 20.0]], [average[0], long_docs[0][:2]], model, reference,
                           p2p_ms=1.0, allreduce_ms=5.0)
    assert two == pytest.approx(max(31.0 + 3 * 20.0, 50.0 * scale + 1.0) + 5.0)
