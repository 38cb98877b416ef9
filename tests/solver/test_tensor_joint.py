"""The joint replica-count proof over many TP groupings (solver/tensor_joint.py) against exact optima.

A proof that ever closes a set of groupings one of which beats the cutoff is a bug. On random small
TP problems every healthy degree's groupings are each planned by the exact backend; the proof must
never close a cutoff just above their best, its witnesses must name groupings that do beat the
cutoff (healthy links: the counts are exact there), and it must close
some sets at their optimum (it proves something). Its vectorised cheap bound must equal the scalar
one and never fall below an exact replica count, its knapsack moves must be every pair of states
adding up to a state, and the search with it finds the same optimum as without it, with a valid plan.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import InfeasibleError
from resihp_lightning.plan import Device, Layer, Problem
from resihp_lightning.solver import solve
from resihp_lightning.solver import tensor_search
from resihp_lightning.solver.tensor_bounds import DominantKindBound
from resihp_lightning.solver.tensor_joint import JointProof, Verdict, _closure, _Levels, _table
from resihp_lightning.solver.tensor_search import GroupingBound, combinations
from resihp_lightning.tensor_plan import TensorCost, TensorProblem, evaluate_tensor_plan, validate_tensor_plan

EXACT = PlannerConfig(solver="exact")


def _random_tp(rng: random.Random, *, exact_counts: bool) -> TensorProblem:
    """3-4 domains of 4 GPUs, 1-3 of them slow or dead: identical healthy groups and a few odd ones.

    ``exact_counts``: healthy links (where a witness is a real plan); else slow links too (where
    the proof is a relaxation). Partitions are per replica (the proof is not asked for shared ones).
    """
    domains = tuple(tuple(range(4 * i, 4 * i + 4)) for i in range(rng.randint(3, 4)))
    affected = rng.sample(range(4 * len(domains)), rng.randint(1, 3))
    memory = rng.choice([25.0, 40.0, 1e6])
    gpus = []
    for g in range(4 * len(domains)):
        if g in affected and rng.random() < 0.3:
            continue  # dead
        link = 1.0 if exact_counts or g not in affected or rng.random() < 0.6 else 0.5
        gpus.append(Device(g, rng.choice([0.5, 0.7, 0.85]) if g in affected else 1.0, memory, link))
    layers = [Layer(rng.choice([2.0, 3.0]), rng.choice([10.0, 20.0]), rng.choice([1.0, 3.0]))
              for _ in range(rng.randint(4, 8))]
    problem = Problem(layers, gpus, rng.randint(4, 12), p2p_ms=rng.choice([0.0, 0.3]),
                      allreduce_ms=rng.choice([0.0, 2.0]), allow_exclude=True, shared_partition=False)
    return TensorProblem(problem, domains, TensorCost((1, 2, 4), {2: 0.02, 4: 0.05}))


def _optima(tp: TensorProblem) -> dict:
    """Healthy degree -> [(device key, exact optimum)] of its groupings."""
    out: dict = {}
    for combination in combinations(tp):
        problem = tp.group_problem(combination.groups)
        try:
            value = solve(problem, EXACT).iteration_ms
        except InfeasibleError:
            value = float("inf")
        out.setdefault(combination.healthy_degree, []).append((combination.key, value))
    return out


@pytest.mark.parametrize("exact_counts", [True, False])
def test_the_joint_proof_never_closes_a_set_that_beats_the_cutoff(exact_counts):
    rng = random.Random(41 if exact_counts else 43)
    checked = closed_at_optimum = witnesses = 0
    while checked < 8:
        tp = _random_tp(rng, exact_counts=exact_counts)
        proof = JointProof(tp.problem, GroupingBound(tp.problem), DominantKindBound(tp.problem))
        for rows in _optima(tp).values():
            best = min(value for _, value in rows)
            if best == float("inf"):
                continue
            keys = [key for key, _ in rows]
            above = proof.decide(keys, best * (1 + 1e-6))
            assert above.outcome != "closed", tp.to_json()
            at = proof.decide(keys, best)
            closed_at_optimum += at.outcome == "closed"
            for verdict, cutoff in ((above, best * (1 + 1e-6)), (at, best)):
                if verdict.outcome == "witness" and exact_counts:
                    witnesses += 1
                    assert verdict.fleets
                    assert all(rows[i][1] < cutoff for i in verdict.fleets), tp.to_json()
            checked += 1
    assert closed_at_optimum > 0
    if exact_counts:
        assert witnesses > 0


def test_the_vectorised_cheap_bound_is_the_scalar_one_and_above_exact_counts():
    rng = random.Random(47)
    compared = 0
    while compared < 300:
        tp = _random_tp(rng, exact_counts=True)
        counter = DominantKindBound(tp.problem)
        proof = JointProof(tp.problem, GroupingBound(tp.problem), counter)
        kinds = sorted({kind for c in combinations(tp) for kind in c.key}, reverse=True)
        free = max(kinds, key=lambda kind: kinds.count(kind))
        odd = [kind for kind in kinds if kind != free]
        if not odd:
            continue
        p = rng.randint(1, 4)
        parts = np.array([[rng.randint(0, 1) for _ in odd] for _ in range(12)], dtype=np.int64)
        parts = parts[parts.sum(axis=1) <= p]
        limit = rng.uniform(5.0, 80.0)
        vectorised = proof._cheap_all(p, parts, odd, free, limit)
        for row, value in zip(parts.tolist(), vectorised.tolist()):
            composition = [free] * (p - sum(row)) + [kind for j, kind in enumerate(odd) for _ in range(row[j])]
            assert value == proof._cheap(composition, limit)
            assert value >= counter.count(composition, limit, tp.problem.micro_batches)[0]
            compared += 1


def test_the_search_with_the_joint_proof_finds_the_same_optimum(monkeypatch):
    rng = random.Random(53)
    saved = asked = 0
    for index in range(10):
        tp = _random_tp(rng, exact_counts=index % 2 == 0)
        monkeypatch.setattr(tensor_search, "JOINT_PROOF", False)
        try:
            plain = tensor_search.solve_tensor(tp, EXACT)
        except InfeasibleError:
            continue
        monkeypatch.setattr(tensor_search, "JOINT_PROOF", True)
        joint = tensor_search.solve_tensor(tp, EXACT)
        assert plain.status == joint.status == "optimal"
        assert joint.iteration_ms == pytest.approx(plain.iteration_ms, rel=1e-9), tp.to_json()
        # The plan may be a witness's, placed and split by the search: it must be valid and price alike.
        validate_tensor_plan(tp, joint)
        assert evaluate_tensor_plan(tp, joint).iteration_ms == pytest.approx(joint.iteration_ms, rel=1e-12)
        saved += plain.search.solved - joint.search.solved
        asked += joint.search.joint_proofs
    assert saved > 0  # the proof closed groupings the plain search solved
    assert asked > 0


def test_the_moves_are_every_pair_of_states_that_adds_up_to_a_state():
    rng = random.Random(59)
    for _ in range(30):
        width = rng.randint(1, 4)
        avails = [tuple(rng.randint(0, 3) for _ in range(width)) for _ in range(rng.randint(1, 4))]
        states, _ = _closure(avails, [0] * len(avails))
        vectors = np.asarray(states, dtype=np.int64).reshape(len(states), width)
        index = {u: i for i, u in enumerate(states)}
        problem = Problem([Layer(1.0, 1.0, 1.0)], [Device(0, 1.0, 10.0)], 1)
        proof = JointProof(problem, GroupingBound(problem), DominantKindBound(problem))
        sizes = vectors.sum(axis=1)
        src, owner, dst = proof._all_moves(states, vectors, sizes)
        assert [(sizes[w], w) for w in dst] == sorted((sizes[w], w) for w in dst)
        found = set(zip(src.tolist(), owner.tolist(), dst.tolist()))
        expected = {(index[u], index[o], index[tuple(a + b for a, b in zip(u, o))])
                    for u in states for o in states
                    if any(o) and tuple(a + b for a, b in zip(u, o)) in index}
        assert found == expected


def test_the_knapsack_without_item_counts_is_a_relaxation_and_exact_with_enough_replicas():
    rng = random.Random(61)
    for _ in range(40):
        width = rng.randint(1, 3)
        avails = [tuple(rng.randint(0, 3) for _ in range(width)) for _ in range(rng.randint(1, 3))]
        states, _ = _closure(avails, [0] * len(avails))
        vectors = np.asarray(states, dtype=np.int64).reshape(len(states), width)
        sizes = vectors.sum(axis=1)
        problem = Problem([Layer(1.0, 1.0, 1.0)], [Device(0, 1.0, 10.0)], 1)
        proof = JointProof(problem, GroupingBound(problem), DominantKindBound(problem))
        src, owner, dst = proof._all_moves(states, vectors, sizes)
        values = np.asarray([0] + [rng.randint(0, 9) for _ in states[1:]], dtype=np.int64)
        free_value, p = rng.randint(1, 9), 3
        most_free = np.full(len(states), rng.randint(0, 12), dtype=np.int64)
        levels = _Levels(sizes, src, owner, dst)
        starts = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]]) if dst.size else np.zeros(0, dtype=np.int64)
        for d in range(1, 6):
            rmax = min(d, int(sizes.max()))
            best = _table(len(states), rmax, src, owner, starts, dst[starts], values)
            layered = max((int(best[r, s]) + (d - r) * free_value for r in range(rmax + 1) for s in range(len(states))
                           if best[r, s] >= 0 and d * p - sizes[s] <= most_free[s]), default=-1)
            # The most a mix reaches is found by asking for M = that most (and nothing above it).
            found = levels.best_mix(values, free_value, [d], p, most_free, max(layered, 0))
            above = levels.best_mix(values, free_value, [d], p, most_free, layered + 1)
            if layered >= 0:  # a relaxation: at least what the layered programme finds
                assert found is not None
            if d >= int(sizes.max()):  # never more items than replicas: exact
                assert above is None
                assert (found is None) == (layered < 0)


def test_out_of_time_the_search_is_still_never_worse_than_resihp_rule(monkeypatch):
    """Past the time limit, when the joint proof leaves groupings open, the seeds (ResiHP's rule
    first) are still solved: the plan is never worse than the rule's optimum. The proof is made to
    answer "open" and the seeds' heuristic plans to look 10% slower than they are, so that only
    the seeds' solves can reach the rule's optimum."""
    heuristic = tensor_search._heuristic_plan

    def slower(problem, groups):
        plan = heuristic(problem, groups)
        return None if plan is None else plan.with_result(iteration_ms=plan.iteration_ms * 1.1)

    monkeypatch.setattr(tensor_search, "_heuristic_plan", slower)
    monkeypatch.setattr(JointProof, "decide", lambda self, fleets, cutoff: Verdict("open"))
    rng = random.Random(67)
    checked = 0
    while checked < 6:
        tp = _random_tp(rng, exact_counts=True)
        degree = max(tp.healthy_degrees())
        try:
            rule = tensor_search.resihp_rule(tp, degree, EXACT).iteration_ms
        except InfeasibleError:
            continue
        hurried = tensor_search.solve_tensor(tp, PlannerConfig(time_limit_s=1e-6))
        assert hurried.iteration_ms <= rule * (1 + 1e-9), tp.to_json()
        validate_tensor_plan(tp, hurried)
        checked += 1
