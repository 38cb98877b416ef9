"""The search over TP groupings (solver/tensor_search.py) against the test's own brute force.

The brute force enumerates ALL groupings of ALL domains (healthy ones included, degrees mixed within
and across domains), prices each grouping's devices with its own copy of the group formula and plans
it with the exact backend (proven optimal on these small problems). The search must equal the best
grouping of the stated space (one healthy degree for every healthy domain, any grouping of an affected
one), never be worse than ResiHP's rule or the best fixed degree, and its plan must re-price to what
it reports.
"""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import InfeasibleError
from resihp_lightning.plan import Device, Layer, Problem
from resihp_lightning.solver import solve
from resihp_lightning.solver.bounds import shape_lower_bound
from resihp_lightning.solver.tensor_search import (
    GroupingBound,
    best_fixed_degree,
    combinations,
    dominates,
    envelope,
    resihp_rule,
    solve_tensor,
)
from resihp_lightning.tensor_plan import (
    TensorCost,
    TensorPlan,
    TensorProblem,
    device_key,
    domain_groupings,
    evaluate_tensor_plan,
    validate_tensor_plan,
)

REL = 1e-9
EXACT = PlannerConfig(solver="exact")


def _random_tp(rng: random.Random) -> TensorProblem:
    """2-3 domains of 2-4 GPUs, a few slow or dead, degrees from {1, 2, 3, 4}, memory that often binds."""
    domains, gpus, at = [], [], 0
    for _ in range(rng.randint(2, 3)):
        size = rng.choice([2, 2, 3, 4, 4])
        domains.append(tuple(range(at, at + size)))
        at += size
    affected = rng.sample(range(at), rng.randint(1, 2))
    tight = rng.random() < 0.5
    for g in range(at):
        if g in affected and rng.random() < 0.4:
            continue  # dead
        speed = rng.choice([0.5, 0.7]) if g in affected else 1.0
        gpus.append(Device(g, speed, 45.0 if tight else 1e6, rng.choice([1.0, 0.5]) if g in affected and rng.random() < 0.2 else 1.0))
    degrees = tuple(sorted({1, 2} | set(rng.sample([3, 4], rng.randint(0, 2)))))
    if rng.random() < 0.3:
        degrees = tuple(k for k in degrees if k != 1)
    cost = TensorCost(degrees, {k: rng.choice([0.0, 0.02, 0.1]) for k in degrees if k > 1})
    layers = [Layer(rng.choice([2.0, 3.0, 5.0]), rng.choice([20.0, 30.0]), rng.choice([2.0, 5.0]))
              for _ in range(rng.randint(2, 4))]
    problem = Problem(layers, gpus, rng.randint(1, 5), p2p_ms=rng.choice([0.0, 0.5]), allreduce_ms=rng.choice([0.0, 2.0]),
                      shared_partition=rng.random() < 0.5, allow_exclude=rng.random() < 0.8)
    return TensorProblem(problem, tuple(domains), cost)


def _groupings(gpus: list[int], degrees, spares: bool):
    """Every set of disjoint groups of allowed sizes over ``gpus`` (the rest spares, when allowed)."""
    if not gpus:
        yield ()
        return
    first, rest = gpus[0], gpus[1:]
    if spares:
        yield from _groupings(rest, degrees, spares)
    for k in degrees:
        for others in itertools.combinations(rest, k - 1):
            left = [g for g in rest if g not in others]
            for tail in _groupings(left, degrees, spares):
                yield ((first, *others), *tail)


def _device(tp: TensorProblem, members) -> Device:
    """The group formula, written again: c / (k s) + c f_k per layer, k times the least memory, the slowest link."""
    gpus = [tp.problem.device(g) for g in members]
    k = len(gpus)
    f = dict(tp.cost.comm_fraction)[k]
    return Device(members[0], 1.0 / (1.0 / (k * min(g.speed for g in gpus)) + f), k * min(g.memory_mb for g in gpus),
                  min(g.link_speed for g in gpus))


class _Brute:
    """Every grouping of every domain, each planned by the exact backend (cached by its devices)."""

    def __init__(self, tp: TensorProblem) -> None:
        self.tp = tp
        self.values: dict[tuple, float] = {}

    def value(self, groups) -> float:
        if not groups:
            return math.inf
        devices = sorted((_device(self.tp, members) for members in groups), key=lambda d: d.id)
        key = tuple(sorted((d.speed, d.memory_mb, d.link_speed) for d in devices))
        if key not in self.values:
            problem = Problem(self.tp.problem.layers, devices, self.tp.problem.micro_batches, self.tp.problem.p2p_ms,
                              self.tp.problem.allreduce_ms, shared_partition=self.tp.problem.shared_partition,
                              allow_exclude=self.tp.problem.allow_exclude)
            try:
                plan = solve(problem, EXACT)
                assert plan.status == "optimal"
                self.values[key] = plan.iteration_ms
            except InfeasibleError:
                self.values[key] = math.inf
        return self.values[key]

    def optima(self) -> tuple[float, float]:
        """(best of the stated space, best of every grouping of every domain)."""
        tp = self.tp
        alive = {d.id for d in tp.problem.devices}
        spares = tp.problem.allow_exclude
        per_domain = [list(_groupings([g for g in domain if g in alive], tp.cost.degrees, spares)) for domain in tp.domains]
        healthy = [all(g in alive for g in domain) and len({(tp.problem.device(g).speed, tp.problem.device(g).memory_mb,
                                                              tp.problem.device(g).link_speed) for g in domain}) == 1
                   for domain in tp.domains]
        space = everything = math.inf
        for choice in itertools.product(*per_domain):
            value = self.value(tuple(group for groups in choice for group in groups))
            everything = min(everything, value)
            # The stated space: every healthy domain fully split into groups of one common degree.
            sizes = {len(group) for groups, h in zip(choice, healthy) if h for group in groups}
            full = all(sum(len(g) for g in groups) == len(domain) for groups, domain, h in zip(choice, tp.domains, healthy) if h)
            if len(sizes) <= 1 and full:
                space = min(space, value)
        return space, everything


def test_the_search_is_the_optimum_of_its_space_and_never_worse_than_the_baselines():
    rng = random.Random(2024)
    checked = beats_rule = 0
    start = time.perf_counter()
    while checked < 14:
        tp = _random_tp(rng)
        brute = _Brute(tp)
        space, everything = brute.optima()
        try:
            found = solve_tensor(tp, EXACT)
        except InfeasibleError:
            assert space == math.inf, tp.to_json()
            continue
        assert found.status == "optimal" and found.gap == 0.0
        assert found.iteration_ms == pytest.approx(space, rel=REL), tp.to_json()
        assert everything <= found.iteration_ms * (1 + REL)  # mixing degrees in healthy domains is outside the space
        validate_tensor_plan(tp, found)
        assert evaluate_tensor_plan(tp, found).iteration_ms == pytest.approx(found.iteration_ms, rel=REL)
        assert found.search.solved + found.search.pruned >= found.search.combinations >= found.search.pruned
        if tp.problem.allow_exclude:  # the baselines leave GPUs idle: points of the space only with exclusion
            healthy_degrees = tp.healthy_degrees()
            try:
                fixed = best_fixed_degree(tp, EXACT).iteration_ms
            except InfeasibleError:
                fixed = math.inf
            assert found.iteration_ms <= fixed * (1 + REL)
            for degree in healthy_degrees:
                try:
                    rule = resihp_rule(tp, degree, EXACT).iteration_ms
                except InfeasibleError:
                    continue
                assert found.iteration_ms <= rule * (1 + REL)
                beats_rule += found.iteration_ms < rule * (1 - 1e-6)
        checked += 1
    assert beats_rule >= 2  # the space is larger than the rule's point, and it shows
    assert time.perf_counter() - start < 60


def test_combinations_are_valid_distinct_and_cover_every_healthy_degree():
    rng = random.Random(7)
    for _ in range(20):
        tp = _random_tp(rng)
        found = combinations(tp)
        keys = [c.key for c in found]
        assert len(keys) == len(set(keys))
        for combination in found:
            tp.check_groups(combination.groups)
            assert combination.key == device_key(tp.group_device(g) for g in combination.groups)
            healthy = [d for d in range(len(tp.domains)) if tp.healthy(d)]
            for d in healthy:
                degrees = {g.degree for g in combination.groups if tp.domain_of(g.id) == d}
                assert degrees == {combination.healthy_degree}


def test_grouping_bounds_are_lower_bounds_and_the_shape_bound_without_memory():
    rng = random.Random(11)
    checked = 0
    while checked < 120:
        tp = _random_tp(rng)
        bounder = GroupingBound(tp.problem)
        for combination in combinations(tp)[:6]:
            problem = tp.group_problem(combination.groups)
            bound = bounder.bound(combination.key)
            strong = bounder.bound(combination.key, replicas=True)
            try:
                optimum = solve(problem, EXACT).iteration_ms
            except InfeasibleError:
                optimum = math.inf
            assert bound <= strong * (1 + REL) and strong <= optimum * (1 + REL)
            if all(math.isinf(d.memory_mb) or d.memory_mb >= 1e6 for d in problem.devices):
                shapes = problem.candidate_shapes()
                least = min((shape_lower_bound(problem, p, d) for p, d in shapes), default=math.inf)
                assert bound == pytest.approx(least, rel=REL)
            checked += 1


def test_a_dominated_fleet_is_never_faster_and_the_envelope_holds_every_option():
    rng = random.Random(5)
    checked = 0
    for _ in range(40):
        tp = _random_tp(rng)
        if not tp.problem.allow_exclude:
            continue
        for d in range(len(tp.domains)):
            keys = [device_key(tp.group_device(g) for g in groups) for groups in domain_groupings(tp, d)]
            relaxed = envelope(keys)
            assert all(dominates(relaxed, key, same_count=False) for key in keys)
            for better, worse in itertools.permutations(keys[:6], 2):
                if not worse or not dominates(better, worse, same_count=False):
                    continue
                values = []
                for key in (better, worse):
                    devices = tuple(Device(i, *device) for i, device in enumerate(key))
                    try:
                        values.append(solve(Problem(tp.problem.layers, devices, tp.problem.micro_batches,
                                                    tp.problem.p2p_ms, tp.problem.allreduce_ms,
                                                    shared_partition=tp.problem.shared_partition,
                                                    allow_exclude=True), EXACT).iteration_ms)
                    except InfeasibleError:
                        values.append(math.inf)
                assert values[0] <= values[1] * (1 + REL)
                checked += 1
    assert checked >= 20


def _tp4_job(gpus: int, slow: dict[int, float], dead: tuple[int, ...], shared: bool = False) -> TensorProblem:
    """A 70B-like job per GPU: 80 layers of 400 ms, 13.7 GB of state each, 72 GB GPUs, TP-4 NVLink domains."""
    layers = [Layer(400.0, 13_700.0, 134.0)] * 80
    devices = [Device(g, slow.get(g, 1.0), 72_000.0) for g in range(gpus) if g not in dead]
    problem = Problem(layers, devices, gpus, p2p_ms=13.0, allreduce_ms=900.0, shared_partition=shared, allow_exclude=True)
    return TensorProblem(problem, tuple(tuple(range(i, i + 4)) for i in range(0, gpus, 4)),
                         TensorCost((1, 2, 4), {2: 0.004, 4: 0.008}))


def test_a_domain_with_a_slow_member_is_regrouped_better_than_by_resihp_rule():
    """One GPU of a TP-4 domain at 0.45 of 64: ResiHP's rule forms one pair of its fastest GPUs
    (2 x 1.0 > 4 x 0.45) and idles the other two; the search also weighs the pair of the others, singles
    and the four together, so it is strictly faster here, and proven."""
    tp = _tp4_job(64, {6: 0.45}, ())
    found = solve_tensor(tp, EXACT)
    rule = resihp_rule(tp, 4, EXACT)
    assert found.status == "optimal" and rule.status == "optimal"
    assert found.iteration_ms < rule.iteration_ms * (1 - 1e-6)
    assert found.iteration_ms <= best_fixed_degree(tp, EXACT).iteration_ms * (1 + REL)
    affected = [g for g in found.groups if tp.domain_of(g.id) == 1]
    assert sum(g.degree for g in affected) > 2  # more of the domain works than under the rule
    validate_tensor_plan(tp, found)
    again = TensorPlan.from_json(found.to_json())
    assert again == found and evaluate_tensor_plan(tp, again).iteration_ms == pytest.approx(found.iteration_ms, rel=REL)


def test_256_gpus_with_a_dead_gpu_are_proven_quickly():
    tp = _tp4_job(256, {}, (9,))
    start = time.perf_counter()
    found = solve_tensor(tp)
    assert found.status == "optimal" and found.gap == 0.0
    assert time.perf_counter() - start < 10.0  # about 0.3 s on an idle core
    assert found.search.solved < found.search.combinations


def test_without_exclusion_every_gpu_is_in_a_used_group():
    rng = random.Random(21)
    checked = 0
    while checked < 6:
        tp = _random_tp(rng)
        if tp.problem.allow_exclude:
            continue
        try:
            found = solve_tensor(tp, EXACT)
        except InfeasibleError:
            continue
        assert found.idle_gpus(tp) == ()
        checked += 1


def test_can_beat_never_refuses_a_fleet_that_beats_the_cutoff():
    """GroupingBound.can_beat is a proof: for a cutoff just above a grouping's optimum it must say True,
    and the replica bound must stay below the optimum."""
    rng = random.Random(13)
    checked = refused = 0
    while checked < 60:
        tp = _random_tp(rng)
        bounder = GroupingBound(tp.problem)
        for combination in combinations(tp)[:5]:
            try:
                optimum = solve(tp.group_problem(combination.groups), EXACT).iteration_ms
            except InfeasibleError:
                continue
            assert bounder.can_beat(combination.key, optimum * (1 + 1e-6)), tp.to_json()
            refused += not bounder.can_beat(combination.key, optimum * 0.9)
            checked += 1
    assert refused > 0  # it proves something
