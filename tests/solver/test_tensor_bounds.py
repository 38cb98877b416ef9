"""The replica-count proof for TP groupings (solver/tensor_bounds.py) against exact optima.

A proof that ever closes a fleet below its own optimum is a bug: on random small fleets whose most
numerous device kind dominates the others (what a TP search sees: identical healthy groups and a few
odd ones), ``DominantKindBound.closes`` must never close a cutoff just above the exact optimum, and
it must close some at the optimum (it proves something). The search with the proof on finds the
same optimum as without it.
"""

from __future__ import annotations

import itertools
import random

import pytest

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import InfeasibleError
from resihp_lightning.plan import Device, Layer, Problem
from resihp_lightning.solver import solve
from resihp_lightning.solver import tensor_search
from resihp_lightning.solver.tensor_bounds import DominantKindBound, dominates_kind, rank_envelope
from resihp_lightning.tensor_plan import TensorCost, TensorProblem, device_key

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
    return Problem(layers, devices, rng.randint(2, 8), p2p_ms=rng.choice([0.0, 0.5]),
                   allreduce_ms=rng.choice([0.0, 2.0]),
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
        odd = [(rng.choice([0.5, 1.0, 2.0]), rng.choice([72.0, 144.0]), rng.choice([0.5, 1.0]))
               for _ in range(rng.randint(1, 5))]
        envelope = rank_envelope(odd)
        assert all(dominates_kind(envelope[t], envelope[t + 1]) for t in range(len(envelope) - 1))
        for size in range(1, len(odd) + 1):
            for subset in itertools.combinations(odd, size):
                ranked = sorted(subset, reverse=True)
                # The j-th of any subset (fastest first) fits into W_j.
                assert all(dominates_kind(envelope[j], ranked[j]) for j in range(size))


def _random_tp(rng: random.Random) -> TensorProblem:
    """3-4 domains of 4 GPUs, 1-2 of them slow or dead: identical healthy groups and a few odd ones."""
    domains = tuple(tuple(range(4 * i, 4 * i + 4)) for i in range(rng.randint(3, 4)))
    affected = rng.sample(range(4 * len(domains)), rng.randint(1, 2))
    memory = rng.choice([25.0, 40.0, 1e6])
    gpus = [Device(g, rng.choice([0.5, 0.7]) if g in affected else 1.0, memory)
            for g in range(4 * len(domains)) if g not in affected or rng.random() < 0.7]
    layers = [Layer(rng.choice([2.0, 3.0]), rng.choice([10.0, 20.0]), rng.choice([1.0, 3.0]))
              for _ in range(rng.randint(4, 8))]
    problem = Problem(layers, gpus, rng.randint(4, 12), p2p_ms=rng.choice([0.0, 0.3]),
                      allreduce_ms=rng.choice([0.0, 2.0]), allow_exclude=True)
    return TensorProblem(problem, domains, TensorCost((1, 2, 4), {2: 0.02, 4: 0.05}))


def test_the_search_with_the_count_proof_finds_the_same_optimum(monkeypatch):
    rng = random.Random(37)
    saved = 0
    for _ in range(12):
        tp = _random_tp(rng)
        monkeypatch.setattr(tensor_search, "COUNT_PROOF", False)
        plain = tensor_search.solve_tensor(tp, EXACT)
        monkeypatch.setattr(tensor_search, "COUNT_PROOF", True)
        proved = tensor_search.solve_tensor(tp, EXACT)
        assert plain.status == proved.status == "optimal"
        assert proved.iteration_ms == pytest.approx(plain.iteration_ms, rel=1e-9), tp.to_json()
        assert proved.search.solved <= plain.search.solved
        saved += plain.search.solved - proved.search.solved
    assert saved > 0  # the proof closed groupings the plain search solved
