"""Brute-force oracle for tiny problems: the reference the planner tests compare against.

Enumerates every shape (P, D), every ordered choice of devices for the P x D grid (replica order
fixed by sorting, the only symmetry used), every bounds vector (one shared, or one per replica),
every micro-batch split, and prices each candidate with :func:`resihp_lightning.plan.evaluate`.
Device positions are enumerated too, so a device's place in its pipeline (which transfers its link
carries) is searched like everything else. It shares no code with the solver package. Tests import
it as ``resihp_lightning.testing.brute_oracle``.

:func:`price` prices a plan a second way, transfer by transfer, as a check of ``evaluate``'s link
terms; :func:`random_problem` and :func:`random_link_problem` (:func:`link_problem` by seed) draw the
small problems (without and with slow links) that the solver tests share.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Iterator

from resihp_lightning.errors import InfeasibleError, ProblemError
from resihp_lightning.plan import Device, Layer, Plan, Problem, Replica, evaluate

#: Refuse problems whose candidate count exceeds this.
MAX_CANDIDATES = 400_000


def _bounds(num_layers: int, stages: int, min_layers: int) -> list[tuple[int, ...]]:
    out = []
    for cuts in itertools.combinations(range(1, num_layers), stages - 1):
        b = (0, *cuts, num_layers)
        if all(b[j + 1] - b[j] >= min_layers for j in range(stages)):
            out.append(b)
    return out


def _splits(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        yield tuple(edges[i + 1] - edges[i] for i in range(parts))


def _grids(ids: list[int], p: int, d: int, exclude: bool) -> Iterator[tuple[tuple[int, ...], ...]]:
    for chosen in itertools.permutations(ids, p * d) if exclude else itertools.permutations(ids):
        grid = tuple(tuple(chosen[r * p : (r + 1) * p]) for r in range(d))
        if list(grid) == sorted(grid):
            yield grid


def count_candidates(problem: Problem) -> int:
    """How many plans :func:`solve_brute` would price."""
    n, total = problem.num_devices, 0
    for p, d in problem.candidate_shapes():
        grids = math.perm(n, p * d) // math.factorial(d)
        nb = len(_bounds(problem.num_layers, p, problem.min_layers_per_stage))
        bounds = nb if problem.shared_partition else nb**d
        total += grids * bounds * math.comb(problem.micro_batches - 1, d - 1)
    return total


def solve_brute(problem: Problem) -> Plan:
    """The true optimum of a tiny problem by exhaustive enumeration.

    Raises:
        ProblemError: the problem has more than :data:`MAX_CANDIDATES` candidates.
        InfeasibleError: no candidate fits in memory.
    """
    count = count_candidates(problem)
    if count > MAX_CANDIDATES:
        raise ProblemError(
            f"brute force would price {count} plans (limit {MAX_CANDIDATES}); use a smaller problem"
        )
    start = time.perf_counter()
    ids = [dv.id for dv in problem.devices]
    best, best_value = None, math.inf
    for p, d in problem.candidate_shapes():
        bound_list = _bounds(problem.num_layers, p, problem.min_layers_per_stage)
        per_replica = [(b,) * d for b in bound_list] if problem.shared_partition else itertools.product(bound_list, repeat=d)
        per_replica = list(per_replica)
        for grid in _grids(ids, p, d, problem.allow_exclude):
            for bounds in per_replica:
                for counts in _splits(problem.micro_batches, d):
                    plan = Plan(tuple(Replica(g, b, m) for g, b, m in zip(grid, bounds, counts)))
                    ev = evaluate(problem, plan, check=False)
                    if ev.fits_memory and ev.iteration_ms < best_value:
                        best, best_value = plan, ev.iteration_ms
    if best is None:
        raise InfeasibleError("no plan fits in memory")
    return best.with_result(
        iteration_ms=best_value, status="optimal", solver="brute", solve_seconds=time.perf_counter() - start
    )


def price(problem: Problem, plan: Plan) -> float:
    """T of ``plan`` computed transfer by transfer (independently of ``evaluate``'s stage formula).

    Each device's link slowdown is ``u = 1 / min(link_speed, 1)``. The transfer between stages j and
    j+1 of a replica costs ``p2p_ms * u_j`` on stage j (the sender's side, both directions) plus
    ``p2p_ms * (u_{j+1} - 1)`` on stage j+1 (what the receiver's slow link adds); a stage's time is
    its compute at its speed plus what it pays for the transfers it takes part in. The all-reduce
    runs at the slowest link of every device the plan uses.
    """
    devices = {d.id: d for d in problem.devices}

    def slowdown(device_id: int) -> float:
        link = devices[device_id].link_speed
        return 1.0 / link if link < 1.0 else 1.0

    worst = 0.0
    for replica in plan.replicas:
        p = replica.num_stages
        times = []
        for j, device_id in enumerate(replica.devices):
            compute = sum(problem.layers[l].compute_ms for l in replica.stage_layers(j))
            times.append(compute / devices[device_id].speed)
        for j in range(p - 1):  # the link between stage j and stage j + 1
            times[j] += problem.p2p_ms * slowdown(replica.devices[j])
            times[j + 1] += problem.p2p_ms * (slowdown(replica.devices[j + 1]) - 1.0)
        worst = max(worst, sum(times) + (replica.micro_batches - 1) * max(times))
    if plan.data_degree > 1:
        worst += problem.allreduce_ms * max(slowdown(i) for i in plan.device_ids)
    return worst


def random_link_problem(rng: random.Random, max_devices: int = 5, max_layers: int = 5,
                        max_candidates: int = 60_000) -> Problem:
    """A small problem with slow links (u up to 10), often on healthy-speed devices, every option.

    Transfers are made expensive (p2p up to 2 ms against 0.5-3 ms layers) so that where a slow link
    sits matters; some devices get link speeds above 1.0 (priced as 1.0).
    """
    while True:
        n = rng.randint(1, max_devices)
        num_layers = rng.randint(1, max_layers)
        tight = rng.random() < 0.4
        layers = [
            Layer(rng.choice([0.5, 1.0, 2.0, 3.0]), rng.choice([10.0, 20.0, 30.0]), rng.choice([0.0, 5.0, 10.0]))
            for _ in range(num_layers)
        ]
        devices = [
            Device(
                i,
                rng.choice([1.0, 1.0, 0.5, 0.8]),
                rng.choice([40.0, 60.0, 80.0, 200.0]) if tight else 1e6,
                rng.choice([1.0, 1.0, 1.0, 0.5, 0.25, 0.1, 2.0]),
            )
            for i in range(n)
        ]
        problem = Problem(
            layers,
            devices,
            rng.randint(1, 6),
            p2p_ms=rng.choice([0.0, 0.5, 1.0, 2.0]),
            allreduce_ms=rng.choice([0.0, 1.0, 3.0]),
            shared_partition=rng.random() < 0.5,
            allow_exclude=rng.random() < 0.5,
            min_layers_per_stage=rng.choice([1, 1, 2]),
        )
        if problem.candidate_shapes() and count_candidates(problem) <= max_candidates:
            return problem


def link_problem(seed: int) -> Problem:
    """A small problem with slow links (:func:`random_link_problem`), one per seed."""
    return random_link_problem(random.Random(10_000 + seed))


def random_problem(seed: int) -> Problem:
    """A small random problem; options drawn so that every one of them is exercised."""
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    num_layers = rng.randint(1, 5)
    speeds = [rng.choice([1.0, 1.0, 0.5, 0.8, 0.3]) for _ in range(n)]
    tight = rng.random() < 0.4
    layers = [
        Layer(rng.choice([0.5, 1.0, 2.0, 3.0]), rng.choice([10.0, 20.0, 30.0]), rng.choice([0.0, 5.0, 10.0]))
        for _ in range(num_layers)
    ]
    devices = [Device(i, speeds[i], rng.choice([40.0, 60.0, 80.0, 200.0]) if tight else 1e6) for i in range(n)]
    degrees = tuple(sorted(rng.sample([1, 2, 3, 4], rng.randint(1, 3)))) if rng.random() < 0.3 else None
    return Problem(
        tuple(layers),
        tuple(devices),
        rng.randint(1, 6),
        p2p_ms=rng.choice([0.0, 0.1, 0.5]),
        allreduce_ms=rng.choice([0.0, 1.0, 3.0]),
        pipeline_degrees=degrees,
        shared_partition=rng.random() < 0.5,
        allow_exclude=rng.random() < 0.4,
        min_layers_per_stage=rng.choice([1, 1, 1, 2]),
    )


def random_plan(rng: random.Random, problem: Problem) -> Plan | None:
    """A random plan of one of ``problem``'s candidate shapes (random devices, cuts and micro-batch counts),
    or ``None`` when the cuts drawn leave a stage below ``min_layers_per_stage``; not checked for memory."""
    p, d = rng.choice(problem.candidate_shapes())
    ids = [dv.id for dv in problem.devices]
    chosen = rng.sample(ids, p * d) if problem.allow_exclude else rng.sample(ids, len(ids))
    cuts = sorted(rng.sample(range(1, problem.num_layers), p - 1)) if p > 1 else []
    bounds = (0, *cuts, problem.num_layers)
    if any(bounds[j + 1] - bounds[j] < problem.min_layers_per_stage for j in range(p)):
        return None
    counts = [1] * d
    for _ in range(problem.micro_batches - d):
        counts[rng.randrange(d)] += 1
    return Plan(tuple(Replica(tuple(chosen[r * p:(r + 1) * p]), bounds, counts[r]) for r in range(d)))
