"""The replica-count proof for TP groupings (solver/tensor_bounds.py) against exact optima.

A proof that ever closes a fleet below its own optimum is a bug: on random small fleets whose most
numerous device kind dominates the others (what a TP search sees: identical healthy groups and a few
odd ones), ``DominantKindBound.closes`` must never close a cutoff just above the exact optimum, and
it must close some at the optimum (it proves something).
"""

from __future__ import annotations

import itertools
import random

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import InfeasibleError
from resihp_lightning.plan import Device, Layer, Problem
from resihp_lightning.solver import solve
from resihp_lightning.solver.tensor_bounds import DominantKindBound, dominates_kind, rank_envelope
from resihp_lightning.tensor_plan import device_key

EXACT = PlannerConfig(solver="exact")


def _random_fleet(rng: random.Random) -> Problem:
    """3-6 identical top devices and 1-3 odd ones each dominated by them; memory binds often."""
    top_speed, top_memory = rng.choice([1.0, 2.0]), rng.choice([40.0, 60.0, 1e6])
    devices = [Device(i, top_speed, top_memory) for i in range(rng.randint(3, 6))]
    for _ in range(rng.randint(1, 3)):
        devices.append(Device(len(devices), top_speed * rng.choice([0.3, 0.5, 0.8, 1.0]),
                              top_memory * rng.choice([0.5, 1.0]), rng.choice([1.0, 1.0, 0.5])))
    layers = [Layer(rng.choice([2.0, 3.0, 5.0]), rng.choice([10.0, 20.0]), rng.choice([1.0, 4.0]))
              for _ in range(rng.randint(3, 6))]
    return Problem(layers, devices, rng.randint(2, 8), p2p_ms=rng.choice([0.0, 0.5]), allreduce_ms=rng.choice([0.0, 2.0]),
                   shared_partition=rng.random() < 0.3, allow_exclude=rng.random() < 0.8)


def test_the_count_proof_never_closes_a_fleet_that_beats_the_cutoff():
    rng = random.Random(29)
    checked = closed_at_optimum = 0
    while checked < 80:
        problem = _random_fleet(rng)
        try:
            optimum = solve(problem, EXACT).iteration_ms
        except InfeasibleError:
            continue
        key = device_key(problem.devices)
        proof = DominantKindBound(problem)
        degrees = range(1, len(problem.devices) + 1)
        assert not proof.closes(key, optimum * (1 + 1e-6), degrees), problem.to_json()
        closed_at_optimum += proof.closes(key, optimum, degrees)
        checked += 1
    assert closed_at_optimum > 0


def test_the_rank_envelope_holds_every_subset_rank_by_rank():
    rng = random.Random(31)
    for _ in range(200):
        odd = [(rng.choice([0.5, 1.0, 2.0]), rng.choice([72.0, 144.0]), rng.choice([0.5, 1.0])) for _ in range(rng.randint(1, 5))]
        envelope = rank_envelope(odd)
        assert all(dominates_kind(envelope[t], envelope[t + 1]) for t in range(len(envelope) - 1))
        for size in range(1, len(odd) + 1):
            for subset in itertools.combinations(odd, size):
                ranked = sorted(subset, reverse=True)
                # The j-th of any subset (fastest first) fits into W_j.
                assert all(dominates_kind(envelope[j], ranked[j]) for j in range(size))
