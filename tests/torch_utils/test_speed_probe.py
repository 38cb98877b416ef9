"""The speed probe: the same work on every process, timed without drawing random numbers, slowed with the rest
of a throttled rank's compute."""

from __future__ import annotations

import pytest
import torch

from resihp_lightning.callbacks.faults.slowdowns import Slowdown
from resihp_lightning.torch_utils.speed_probe import SpeedProbe, relative_speeds


def test_a_probe_draws_no_random_numbers_and_computes_the_same_every_time():
    probe = SpeedProbe(size=64, repeats=2)
    seen = []
    probe.wrap(lambda work: lambda x, w: seen.append(work(x, w)) or seen[-1])
    state = torch.get_rng_state()
    assert probe.measure_ms() > 0
    assert torch.equal(torch.get_rng_state(), state)  # the job's random streams do not move
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])
    assert not seen[0].requires_grad


def test_a_slowed_rank_s_probe_is_slowed_like_its_compute_and_restored():
    probe = SpeedProbe(size=128, repeats=3)
    slowdown = Slowdown(lambda: 3.0, cuda_sync=False)
    base = min(probe.measure_ms() for _ in range(3))
    restore = probe.wrap(slowdown.wrap_function)
    slowed = min(probe.measure_ms() for _ in range(3))
    assert slowdown.injected_s > 0
    assert slowed > 1.8 * base, (base, slowed)  # 3x, less the load's noise (a sleep only adds time)
    restore()
    injected = slowdown.injected_s
    probe.measure_ms()
    assert slowdown.injected_s == injected


def test_relative_speeds_divide_the_median_by_each():
    assert relative_speeds({0: 10.0, 1: 10.0, 2: 30.0, 3: 10.0}) == pytest.approx({0: 1.0, 1: 1.0, 2: 1 / 3, 3: 1.0})
    assert relative_speeds({0: 4.0, 1: 8.0}) == pytest.approx({0: 1.5, 1: 0.75})
    assert relative_speeds({}) == {}
