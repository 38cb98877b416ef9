"""The search over tensor-parallel groupings: which GPUs form each TP group, of which degree, jointly with the plan.

The model is :mod:`resihp_lightning.tensor_plan` (docs/planner.md, "Choosing tensor-parallel
degrees"): GPUs in TP domains, a group of k GPUs is one planner device, and the space is one
healthy degree t' for every healthy domain times any grouping of each affected domain, planned by
:func:`resihp_lightning.solver.solve`. :func:`solve_tensor` returns the best plan of that space,
proven, in these steps:

1. **Groupings** (:func:`combinations`). Every t' (the allowed degrees dividing every healthy
   domain's size) with every choice of one grouping per affected domain
   (:func:`~resihp_lightning.tensor_plan.domain_groupings`). Two groupings whose multisets of group
   devices are equal have the same optimum (devices of equal speed, memory and link speed are
   interchangeable), so one per multiset is kept. With ``allow_exclude`` a domain's grouping whose
   devices each fit into a distinct device of another of its groupings, at least as fast, large
   and well linked (:func:`dominates`), is dropped: any plan on it runs as fast on the other,
   whose extra devices idle.
2. **Bounds** (:class:`GroupingBound`). Each grouping left to step 6 gets a proven lower bound on
   its optimum: the least :func:`~resihp_lightning.solver.bounds.shape_lower_bound` over the
   shapes it allows, a shape needing at least as many stages as the model takes on the largest
   device's memory.
3. **Incumbent.** ResiHP's rule and the fixed degree at the largest healthy degree are solved
   first (``_seeds``: few large groups, quick to plan and usually close to the best). With the
   joint proof (step 4) only their heuristic plans (``_heuristic_plan``) are the first incumbent,
   and they are solved only when it leaves groupings open.
4. **The joint proof** (with ``allow_exclude`` and per-replica partitions, :data:`JOINT_PROOF`).
   Each healthy degree's groupings are decided together by one replica knapsack
   (:class:`~resihp_lightning.solver.tensor_joint.JointProof`, largest degree first): closed all at
   once, or a witness (a mix of exact replica counts below the incumbent on some grouping) that
   becomes the incumbent (``_witness_plan``; after :data:`WITNESS_PLANS` of them the named
   grouping is solved too) and the question is asked again, or open (the groupings go on to
   steps 5 and 6).
5. **Relaxations** (with ``allow_exclude``: the degrees step 4 leaves open, or all without it).
   For each t', a fleet that every grouping of that t' fits into device by device (the healthy
   groups and, per affected domain, the :func:`envelope` of its groupings) is asked once whether
   any plan on it beats the incumbent (:func:`~resihp_lightning.solver.exact.solve_exact` with
   the incumbent as ``cutoff``, stopping at the first faster plan). When none does, every
   grouping of that t' is closed.
6. **Best first.** The other groupings are solved in increasing order of their bound, each with the
   incumbent as ``cutoff`` (a grouping that cannot beat it is closed at once,
   :class:`~resihp_lightning.solver.exact.NoBetterPlan`), until a bound is not below the incumbent:
   that one and all after it are pruned. Bounds are computed only for these groupings.

With :data:`COUNT_PROOF` (off: measured slower), a grouping is first tried against the incumbent
by the replica-count proof of :mod:`resihp_lightning.solver.tensor_bounds`.

The result is ``"optimal"`` only when every grouping was solved to a proof, closed or pruned;
otherwise ``"feasible"`` with the gap to the least bound left open.

Two baselines plan one point of the space each, with the same solver, so the search is never worse
than either: :func:`resihp_rule` (ResiHP's rule) and :func:`fixed_degree` (one degree everywhere);
:func:`best_fixed_degree` takes the best degree.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from resihp_lightning.config import PlannerConfig
from resihp_lightning.errors import InfeasibleError, PlanError
from resihp_lightning.plan import Device, Plan, Problem, Replica, evaluate, link_slowdown
from resihp_lightning.solver.bounds import Fleet, fleet_bound
from resihp_lightning.solver.exact import NoBetterPlan, relative_gap, solve_exact
from resihp_lightning.solver.exact_model import Best, Model, build_plan
from resihp_lightning.solver.heuristic import heuristic_search
from resihp_lightning.solver.microbatch_split import split
from resihp_lightning.solver.tensor_bounds import DominantKindBound
from resihp_lightning.solver.tensor_joint import JointProof
from resihp_lightning.tensor_plan import (
    SearchStats,
    TensorGroup,
    TensorPlan,
    TensorProblem,
    device_key,
    domain_groupings,
    fixed_degree_groups,
    healthy_groups,
    resihp_rule_groups,
)

#: With ``solver="exact"``, how many groupings the first pass solves per second of ``time_limit_s``
#: (a deterministic stand-in for the MILP's shared wall time; a first-pass solve takes about
#: 0.01-0.2 s at 256 GPUs).
EXACT_FIRST_PER_S = 100
#: With ``solver="exact"``, how many of the groupings the first pass left open get a full solve, per
#: second of ``time_limit_s``.
EXACT_RETRIES_PER_S = 4

#: Work units (about 5 us each) of a relaxation's probe (``_Search.closes``): a probe that cannot close
#: its groupings this fast leaves them to be solved one by one.
PROBE_BUDGET = 20_000

#: Whether the best-first loop also tries the replica-count proof of
#: :class:`~resihp_lightning.solver.tensor_bounds.DominantKindBound` before solving a grouping. Off:
#: the proof is tight (at 256 GPUs with 3 slow GPUs it closes 61 of the 81 groupings solved today,
#: asked at the optimum) but its exact replica counts cost 2-45 ms each at P = 5-14, so the search
#: was measured slower with it than with the solves it saves (benchmarks/README.md). It runs only
#: while the search has time (with ``"exact"``: first-pass solves or retries) left.
COUNT_PROOF = False

#: Whether the groupings of each healthy degree are first decided together by one replica
#: knapsack over all of them (:class:`~resihp_lightning.solver.tensor_joint.JointProof`): it
#: closes them at once or names groupings that beat the incumbent.
JOINT_PROOF = True
#: The most questions to the joint proof per healthy degree before the rest of that degree is left
#: to the best-first loop.
JOINT_ROUNDS = 16
#: The first witnesses of a degree only become the incumbent (their plan, no solve); later ones have
#: their grouping solved too, which jumps to its optimum.
WITNESS_PLANS = 2

#: The search refuses spaces with more distinct combinations than this (many affected domains with
#: many kinds of GPU); the error names the count.
MAX_COMBINATIONS = 200_000


@dataclass(frozen=True)
class Combination:
    """One point of the search space: a healthy degree and the groups it gives.

    Attributes:
        healthy_degree: t', the degree of every healthy domain (``None`` when no domain is healthy).
        groups: every group, domain by domain.
        key: the sorted multiset of the groups' devices (speed, memory, link speed).
    """

    healthy_degree: int | None
    groups: tuple[TensorGroup, ...]
    key: tuple


def combinations(problem: TensorProblem) -> list[Combination]:
    """The points of the space the search must look at (module docstring, step 1).

    One per distinct multiset of group devices: among combinations with equal devices the first met
    is kept (the smallest t', then the groupings in
    :func:`~resihp_lightning.tensor_plan.domain_groupings` order, fewest GPUs first). A domain's
    grouping that another of its groupings :func:`dominates` is left out (with ``allow_exclude``;
    without it only by one of as many devices): no plan on it is faster.

    Raises:
        PlanError: more than :data:`MAX_COMBINATIONS` combinations.
    """
    domains = range(len(problem.domains))
    healthy = [d for d in domains if problem.healthy(d)]
    affected = [d for d in domains if d not in set(healthy)]
    # Per affected domain: its groupings that no other one dominates, with their device keys.
    options = []
    for d in affected:
        listed = [(device_key(problem.group_device(g) for g in groups), groups) for groups in domain_groupings(problem, d)]
        options.append(undominated(listed, same_count=not problem.problem.allow_exclude))
    # Affected domains merged one by one, deduplicated by the merged multiset as we go.
    partial: dict[tuple, tuple[TensorGroup, ...]] = {(): ()}
    for choices in options:
        merged: dict[tuple, tuple[TensorGroup, ...]] = {}
        for key, groups in partial.items():
            for option_key, option in choices:
                new_key = tuple(sorted(key + option_key))
                if new_key not in merged:
                    merged[new_key] = groups + option
        partial = merged
        if len(partial) > MAX_COMBINATIONS:
            raise PlanError(f"the TP search space has more than {MAX_COMBINATIONS} groupings of its "
                            f"{len(affected)} affected domains; plan fewer at once")
    degrees: list[int | None] = list(problem.healthy_degrees()) if healthy else [None]
    out: dict[tuple, Combination] = {}
    for degree in degrees:
        base = tuple(g for d in healthy for g in healthy_groups(problem, d, degree)) if degree else ()
        base_key = device_key(problem.group_device(g) for g in base)
        for key, groups in partial.items():
            total = tuple(sorted(base_key + key))
            if total and total not in out:
                out[total] = Combination(degree, base + groups, total)
    return list(out.values())


def dominates(better: Sequence[tuple[float, float, float]], worse: Sequence[tuple[float, float, float]],
              *, same_count: bool) -> bool:
    """Whether every device of ``worse`` can be matched to its own device of ``better`` that is at least
    as fast, holds at least as much memory and has at least as fast a link (``same_count``: and
    ``better`` has no device left over).

    Then every plan on ``worse`` runs on ``better`` with each device replaced by its match: no stage
    is slower (speed, and link slowdown for transfers), none holds less memory, the all-reduce's
    slowest link is no slower, so the optimum over ``better`` is at most the one over ``worse``. A
    device left over is idle, which needs ``allow_exclude`` (else ``same_count``).
    Devices are (speed, memory_mb, link_speed); the match is a bipartite matching.
    """
    if len(worse) > len(better) or (same_count and len(worse) != len(better)):
        return False
    link = [min(d[2], 1.0) for d in better]  # links at least as fast as the reference are priced alike
    match: dict[int, int] = {}

    def place(i: int, seen: set[int]) -> bool:
        speed, memory, link_i = worse[i]
        for j, dev in enumerate(better):
            if j in seen or dev[0] < speed or dev[1] < memory or link[j] < min(link_i, 1.0):
                continue
            seen.add(j)
            if j not in match or place(match[j], seen):
                match[j] = i
                return True
        return False

    return all(place(i, set()) for i in range(len(worse)))


def undominated(options: Sequence[tuple[tuple, tuple[TensorGroup, ...]]], *, same_count: bool
                ) -> list[tuple[tuple, tuple[TensorGroup, ...]]]:
    """The (device key, groups) options that no other option :func:`dominates` (the first of equals kept)."""
    kept = []
    for index, (key, groups) in enumerate(options):
        if any(other_key != key and dominates(other_key, key, same_count=same_count)
               for other, (other_key, _) in enumerate(options) if other != index):
            continue
        kept.append((key, groups))
    return kept


class GroupingBound:
    """Proven lower bounds on the optimum of a problem over any set of devices, for one problem's layers.

    For a fleet of devices (speed, memory, link speed), :meth:`bound` takes the least, over the
    shapes (P, D) that :meth:`Problem.candidate_shapes <resihp_lightning.plan.Problem.candidate_shapes>`
    allows, of

    * :func:`~resihp_lightning.solver.bounds.shape_lower_bound` (work, fill-and-drain and whole layers
      over the fastest P * D speeds), skipping shapes with fewer stages than the model needs on the largest
      memory (each stage holds one micro-batch's activations besides its state, so greedy packing
      gives the fewest stages any plan has);
    * with ``replicas=True`` also the *replica bound*: some replica runs at least ceil(M / D)
      micro-batches, so ``T >= S + (ceil(M / D) - 1) X + (P - 1) p2p`` for its stage-time sum S and
      slowest stage X. A device holds at most the most compute of a run of layers that fits its
      memory (with one micro-batch in flight), so S is at least the compute spread over the fastest
      devices up to what each holds, and X at least the least x with ``sum_j min(x s_j, held_j) >= C``
      over the P best devices (pairing the i-th fastest with the i-th largest holder, which only
      helps). This is what makes groupings of many small-memory devices (deep pipelines) lose.

    With healthy links the bounds fall as D grows for a fixed P, so only D = 1 and the largest D
    are priced per P. Computed from sorted speeds without building a problem.
    """

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self._layers = Fleet.of(problem, [1.0], [1.0])  # the layers' part, shared by every fleet
        self.compute = self._layers.compute
        self._stages: dict[float, float] = {}
        self._held: dict[float, float] = {}

    def fewest_stages(self, memory_mb: float) -> float:
        """The fewest stages of contiguous layers that each fit ``memory_mb`` (state and one micro-batch); inf: none."""
        if memory_mb not in self._stages:
            capacity = memory_mb * (1 + 1e-9) + 1e-9
            stages, used = 1, 0.0
            for layer in self.problem.layers:
                need = layer.static_mb + layer.activation_mb
                if need > capacity:
                    stages = math.inf
                    break
                if used + need > capacity:
                    stages, used = stages + 1, 0.0
                used += need
            self._stages[memory_mb] = stages
        return self._stages[memory_mb]

    def held(self, memory_mb: float) -> float:
        """The most compute of contiguous layers whose state and one micro-batch fit ``memory_mb`` (two pointers)."""
        if memory_mb not in self._held:
            capacity = memory_mb * (1 + 1e-9) + 1e-9
            layers = self.problem.layers
            best = used = run = 0.0
            a = 0
            for layer in layers:
                used += layer.static_mb + layer.activation_mb
                run += layer.compute_ms
                while used > capacity and a < len(layers):
                    used -= layers[a].static_mb + layers[a].activation_mb
                    run -= layers[a].compute_ms
                    a += 1
                best = max(best, run)
            self._held[memory_mb] = best
        return self._held[memory_mb]

    def bound(self, devices: Sequence[tuple[float, float, float]], *, replicas: bool = False) -> float:
        """The bound for devices given as (speed, memory_mb, link_speed) (inf: no shape can fit)."""
        return min((value for _, _, value in self.shape_bounds(devices, replicas=replicas)), default=math.inf)

    def shape_bounds(self, devices: Sequence[tuple[float, float, float]], *, replicas: bool = False):
        """``(P, D, bound)`` for every shape the devices allow (see the class docstring), lazily."""
        problem = self.problem
        n, m, layers = len(devices), problem.micro_batches, problem.num_layers
        if n == 0:
            return
        speeds = sorted((d[0] for d in devices), reverse=True)
        slowdowns = sorted(link_slowdown(link) for _, _, link in devices)
        fleet = Fleet(self.compute, speeds, slowdowns, self._layers.layers, self._layers.cheap_sums)
        slow_links = slowdowns[-1] > 1.0
        least_p = self.fewest_stages(max(d[1] for d in devices))
        spread = _Spread(speeds, sorted((self.held(d[1]) for d in devices), reverse=True), self.compute) if replicas else None
        if spread is not None and spread.least_sum is None:
            return  # all devices together hold less than the model
        allowed = problem.pipeline_degrees if problem.pipeline_degrees is not None else range(1, n + 1)
        for p in sorted(set(allowed)):
            if p > n or p > layers // problem.min_layers_per_stage or p < least_p:
                continue
            if spread is not None and p < spread.devices_needed:
                continue  # P devices cannot hold the model
            if problem.allow_exclude:
                lowest, top = problem.min_data_degree, min(n // p, m)
                if top < lowest:
                    continue
                if slow_links:  # the all-reduce grows with D (slower links join): every D
                    candidates = range(lowest, top + 1)
                else:  # D = 1 has no all-reduce; above it the bound falls with D
                    candidates = {1, top} if lowest == 1 else {top}
            else:
                if n % p or not problem.min_data_degree <= n // p <= m:
                    continue
                candidates = (n // p,)
            slowest_stage = spread.least_worst(p) if spread is not None else 0.0
            for d in candidates:
                value = fleet_bound(problem, fleet, p, d, with_allreduce=False)
                if spread is not None:
                    value = max(value, spread.least_sum + (p - 1) * problem.p2p_ms + (-(-m // d) - 1) * slowest_stage)
                if d > 1:
                    least = slowdowns[min(p * d, n) - 1] if problem.allow_exclude else slowdowns[-1]
                    value += problem.allreduce_ms * least
                yield p, d, value

    def can_beat(self, devices: Sequence[tuple[float, float, float]], cutoff: float) -> bool:
        """False when no plan on these devices is faster than ``cutoff`` (a proof); True: maybe.

        Per shape (P, D) the replicas' micro-batches are bounded below ``cutoff`` (minus the
        all-reduce): a replica with S and X runs at most ``1 + (limit - S) / X``. A replica made
        only of the most numerous kind of device has S and X of its own (all compute at its speed,
        X at least what P of its memory-limited stages allow); at most k replicas hold one of the k
        other devices, each at most what the replica bound of :meth:`bound` allows. When no shape
        reaches M micro-batches, nothing beats the cutoff.
        """
        from resihp_lightning.solver.microbatch_split import count

        problem = self.problem
        n, m, layers = len(devices), problem.micro_batches, problem.num_layers
        kinds: dict[tuple[float, float], int] = {}
        for speed, memory, _ in devices:
            kinds[(speed, memory)] = kinds.get((speed, memory), 0) + 1
        (speed_f, memory_f), n_free = max(kinds.items(), key=lambda item: (item[1], item[0]))
        others = n - n_free
        spread = _Spread(sorted((d[0] for d in devices), reverse=True),
                         sorted((self.held(d[1]) for d in devices), reverse=True), self.compute)
        if spread.least_sum is None:
            return False
        held_f = self.held(memory_f)
        least_p = self.fewest_stages(max(d[1] for d in devices))
        slowdowns = sorted(link_slowdown(link) for _, _, link in devices)
        allowed = problem.pipeline_degrees if problem.pipeline_degrees is not None else range(1, n + 1)
        for p in sorted(set(allowed)):
            if p > n or p > layers // problem.min_layers_per_stage or p < least_p or p < spread.devices_needed:
                continue
            d_low = problem.min_data_degree
            d_high = min(n // p, m) if problem.allow_exclude else (n // p if n % p == 0 else 0)
            if not problem.allow_exclude and not d_low <= d_high <= m:
                continue
            worst_any = spread.least_worst(p)
            sum_any = spread.least_sum + (p - 1) * problem.p2p_ms
            sum_f = self.compute / speed_f + (p - 1) * problem.p2p_ms
            # A pure replica of the free kind: P stages of at most held_f compute each.
            worst_f = self.compute / (p * speed_f) if p * held_f >= self.compute * (1 - 1e-12) else math.inf
            for d in range(max(1, d_low), d_high + 1):
                if not problem.allow_exclude and d != d_high:
                    continue
                limit = cutoff * (1 - 1e-12)
                if d > 1:
                    least = slowdowns[min(p * d, n) - 1] if problem.allow_exclude else slowdowns[-1]
                    limit -= problem.allreduce_ms * least
                most = m - d + 1
                mixed = min(d, others)
                reach = mixed * count(limit, sum_any, worst_any, most)
                if d - mixed > 0:
                    pure = count(limit, sum_f, worst_f, most) if math.isfinite(worst_f) else 0
                    if min(n_free // p, d - mixed) < d - mixed:
                        continue  # not enough free devices for the rest of the replicas
                    reach += (d - mixed) * pure
                if reach >= m:
                    return True
        return False


class _Spread:
    """Compute spread over devices of speeds ``s_i`` (descending) that hold at most ``h_i`` each (descending).

    ``least_sum``: the least ``sum c_i / s_i`` holding all the compute C (fastest first), ``None``
    when they cannot; ``devices_needed``: how many of the first devices that takes;
    :meth:`least_worst`: over the first P, the least x with ``sum min(x s_i, h_i) >= C``.
    """

    def __init__(self, speeds: list[float], held: list[float], compute: float) -> None:
        self.compute = compute
        # Runs of equal (speed, held) pairs, in order: few, since devices come in few kinds.
        self.runs: list[tuple[float, float, int]] = []
        for pair in zip(speeds, held):
            if self.runs and self.runs[-1][:2] == pair:
                self.runs[-1] = (*pair, self.runs[-1][2] + 1)
            else:
                self.runs.append((*pair, 1))
        left, total, used = compute, 0.0, 0
        self.least_sum: float | None = None
        for speed, hold, count in self.runs:
            if hold <= 0:
                used += count
                continue
            full = min(count, math.floor(left / hold))
            total += full * hold / speed
            left -= full * hold
            used += full
            if left <= 1e-12 * max(1.0, compute):
                self.least_sum, self.devices_needed = total, used
                break
            if full < count:  # one more device of this run takes the rest
                self.least_sum, self.devices_needed = total + left / speed, used + 1
                break
        self._worst: dict[int, float] = {}

    def least_worst(self, p: int) -> float:
        if p not in self._worst:
            items, taken = [], 0
            for speed, hold, count in self.runs:
                k = min(count, p - taken)
                if k <= 0:
                    break
                items.append((hold / speed, speed * k, hold * k))
                taken += k
            items.sort()
            rate = sum(item[1] for item in items)  # sum of s_i over devices not yet full at x
            full = 0.0  # sum of h_i over devices full at x
            x = math.inf
            for breakpoint, speed_sum, held_sum in items:
                if rate > 0 and (self.compute - full) / rate <= breakpoint:
                    x = (self.compute - full) / rate
                    break
                full += held_sum
                rate -= speed_sum
            else:
                x = items[-1][0] if items and full >= self.compute else math.inf
            self._worst[p] = max(0.0, x) * (1 - 1e-12)
        return self._worst[p]


def envelope(options: Sequence[tuple]) -> tuple:
    """A small multiset of devices that every option's devices fit into (a relaxation of a domain).

    Each option's devices, fastest first, are matched position by position: entry j is the largest
    speed, memory and link speed among the options' j-th devices, so every option injects into it
    device by device, each into one at least as good (:func:`dominates`).
    """
    width = max((len(key) for key in options), default=0)
    out = []
    for j in range(width):
        column = [sorted(key, reverse=True)[j] for key in options if len(key) > j]
        out.append((max(d[0] for d in column), max(d[1] for d in column), max(d[2] for d in column)))
    return tuple(sorted(out))


@dataclass
class _Search:
    """The state of one :func:`solve_tensor` call: incumbent, open bound and counts."""

    problem: TensorProblem
    bounder: GroupingBound
    counter: DominantKindBound
    best_plan: object = None
    best_groups: tuple = ()
    best_value: float = math.inf
    open_bound: float = math.inf
    solved: int = 0
    relaxations: int = 0
    unproven: int = 0
    joint_proofs: int = 0

    def solve_leaf(self, groups: tuple[TensorGroup, ...], bound: float, config: PlannerConfig | None) -> float | None:
        """Solves one grouping below the incumbent and keeps a better plan (``config`` None: the exact
        search alone, a warm start's budgets, no bisected bounds).

        Returns:
            ``None`` when the grouping is settled (its optimum found, or proven not to beat the
            incumbent, or nothing fits), else a proven lower bound on its optimum.
        """
        from resihp_lightning.solver import solve

        self.solved += 1
        cutoff = None if self.best_plan is None else self.best_value
        problem = self.problem.group_problem(groups)
        try:
            if config is None:
                plan = solve_exact(problem, cutoff=cutoff, bounds=False)
            else:
                plan = solve(problem, config, cutoff=cutoff)
        except NoBetterPlan as nothing:
            return None if nothing.proven else max(bound, nothing.bound_ms)
        except InfeasibleError as error:
            return None if getattr(error, "proven", True) else bound  # only the heuristic ran: not a proof
        if plan.iteration_ms < self.best_value:
            self.best_plan, self.best_groups, self.best_value = plan, groups, plan.iteration_ms
        if plan.status == "optimal":
            return None
        return max(bound, plan.iteration_ms * (1 - plan.gap) if plan.gap is not None else bound)

    def can_beat(self, key: tuple, counts: bool = True) -> bool:
        """False when these devices are proven not to beat the incumbent without a solve: by the
        counting proof of :class:`GroupingBound` and, with :data:`COUNT_PROOF` and ``counts`` (the
        search has time or work left), the replica counts of
        :class:`~resihp_lightning.solver.tensor_bounds.DominantKindBound` on the shapes its cheap
        bounds leave open."""
        if not self.bounder.can_beat(key, self.best_value):
            return False
        if not (COUNT_PROOF and counts):
            return True
        limit = self.best_value * (1 - 1e-12)
        open_degrees = {p for p, _, value in self.bounder.shape_bounds(key, replicas=True) if value < limit}
        return bool(open_degrees) and not self.counter.closes(key, self.best_value, open_degrees)

    def closes(self, key: tuple) -> bool:
        """Whether no plan on these devices (a relaxation: a fleet every grouping it stands for fits
        into) beats the incumbent, proven by one exact solve with the incumbent as cutoff that stops
        at the first faster plan."""
        self.relaxations += 1
        fleet = tuple(Device(i, speed, memory, link) for i, (speed, memory, link) in enumerate(key))
        try:
            solve_exact(replace(self.problem.problem, devices=fleet), cutoff=self.best_value, first=True,
                        decomposition_budget=PROBE_BUDGET)
        except NoBetterPlan as nothing:
            return nothing.proven
        return False  # a plan faster than the incumbent: the relaxation proves nothing


def solve_tensor(problem: TensorProblem, config: PlannerConfig | None = None) -> TensorPlan:
    """The best plan over every grouping of the space, proven (module docstring).

    1. The seeds (``_seeds``) are the first incumbent (solved, or with the joint proof planned by
       the heuristic phase and solved only when it leaves groupings open).
    2. With ``allow_exclude`` and per-replica partitions, each healthy degree's groupings are
       decided together by the joint proof (module docstring, step 4): closed at once, or a
       witness that becomes the incumbent and the question asked again.
    3. With ``allow_exclude`` and affected domains, each healthy degree still open is tried all at
       once through a *relaxation*: the healthy groups plus, per affected domain, the
       :func:`envelope` of its groupings, a fleet every grouping of that degree fits into device by
       device (so none is faster than the relaxation's optimum). One exact solve with the
       incumbent as ``cutoff`` that stops at the first faster plan either proves that nothing of
       that degree beats the incumbent (all its groupings are closed) or does not (they are
       solved one by one). Without ``allow_exclude`` the devices a relaxation adds would have to
       be used, so there is none.
    4. The groupings left are solved in increasing order of their bound, each with the incumbent
       as ``cutoff``, until a bound is not below the incumbent.

    Args:
        problem: GPUs, domains and TP costs.
        config: the planner's options for every solve (default ``PlannerConfig()``); its model
            options are written over ``problem.problem`` first. Every grouping is first solved by
            the exact search with a warm start's budgets; with a MILP backend ``time_limit_s`` is
            then wall time for the groupings left open (each solve gets what is left; one reached
            after it counts as unproven, with its bound); with ``"exact"`` (deterministic) the first
            pass solves at most ``time_limit_s x`` :data:`EXACT_FIRST_PER_S` groupings and at most
            ``time_limit_s x`` :data:`EXACT_RETRIES_PER_S` of those left open get a full solve of the
            config's budgets.

    Returns:
        The groups and the plan over them; ``status`` ``"optimal"`` when every grouping was solved
        to a proof, pruned or closed, ``gap`` the proven relative gap otherwise; ``search`` counts
        the work.

    Raises:
        InfeasibleError: no grouping has a plan that fits.
    """
    start = time.perf_counter()
    config = config or PlannerConfig()
    problem = _with_config(problem, config)
    search = _Search(problem, GroupingBound(problem.problem), DominantKindBound(problem.problem))
    distinct = combinations(problem)
    joint = JointProof(problem.problem, search.bounder, search.counter)

    def rank(rows) -> list:
        return sorted(((search.bounder.bound(c.key, replicas=True), c.key, c) for c in rows), key=lambda row: row[:2])

    # Every grouping's bound is only needed when the joint proof leaves groupings to solve one by one.
    ranked = rank(distinct) if not problem.problem.allow_exclude else []
    closed_degrees: set[int | None] | None = None
    deadline = start + config.time_limit_s

    # Every grouping is first solved by the exact search alone, with a warm start's work budgets and
    # no bisected bounds (quick, deterministic). Those it leaves open are solved again with the config,
    # best bound first: with a MILP backend in the wall time left of ``time_limit_s`` (which also
    # stops the first pass once there is an incumbent), with "exact" (deterministic) at most
    # ``time_limit_s * EXACT_RETRIES_PER_S`` of them after at most ``time_limit_s * EXACT_FIRST_PER_S``
    # first-pass solves.
    milp = config.solver != "exact"
    retries = math.ceil(config.time_limit_s * EXACT_RETRIES_PER_S)  # exact: full solves of the open groupings
    first_solves = math.ceil(config.time_limit_s * EXACT_FIRST_PER_S)  # exact: first-pass solves
    solved: set[tuple] = set()
    pending: list[tuple[float, tuple, tuple[TensorGroup, ...]]] = []

    def settle(groups: tuple[TensorGroup, ...], key: tuple, bound: float, force: bool = False) -> None:
        nonlocal first_solves
        solved.add(key)
        spent = time.perf_counter() >= deadline if milp else first_solves <= 0
        if spent and search.best_plan is not None and not force:
            pending.append((bound, key, groups))  # out of time (or work): only its bound is known
            return
        first_solves -= 1
        left_open = search.solve_leaf(groups, bound, None)
        if left_open is not None:
            pending.append((left_open, key, groups))

    seeds = _seeds(problem, ranked)
    joint_first = JOINT_PROOF and JointProof.applies(problem.problem)
    if joint_first:
        # The seeds' heuristic plans are the first incumbent; they are solved only when the joint
        # proof leaves something open (a proven optimum is never worse than them).
        seen: set[tuple] = set()
        for groups in seeds:
            key = device_key(problem.group_device(g) for g in groups)
            if key in seen:
                continue
            seen.add(key)
            plan = _heuristic_plan(problem, groups)
            if plan is not None and plan.iteration_ms < search.best_value:
                search.best_plan, search.best_groups, search.best_value = plan, groups, plan.iteration_ms
    if not joint_first or search.best_plan is None:
        joint_first = False
        for groups in seeds:
            key = device_key(problem.group_device(g) for g in groups)
            if key not in solved:
                settle(groups, key, search.bounder.bound(key, replicas=True))
    if joint_first:
        # The joint proof first; the seeds' solves and the relaxations only where it leaves
        # groupings open.
        in_time = (lambda: time.perf_counter() < deadline) if milp else (lambda: first_solves > 0)
        left = _joint_phase(search, joint, distinct, solved, settle, in_time)
        if left:  # the seeds are solved, out of time too: an unfinished search is never worse than them
            for groups in seeds:
                key = device_key(problem.group_device(g) for g in groups)
                if key not in solved:
                    settle(groups, key, search.bounder.bound(key, replicas=True), force=True)
        closed_degrees = _closed_degrees(problem, search, {c.healthy_degree for c in left}) if left else set()
        ranked = rank(c for c in left if c.key not in solved and c.healthy_degree not in closed_degrees)
    else:
        closed_degrees = _closed_degrees(problem, search) if search.best_plan is not None else None
        if problem.problem.allow_exclude:
            left = [c for c in distinct if closed_degrees is None or c.healthy_degree not in closed_degrees]
            ranked = rank(c for c in left if c.key not in solved)
    for bound, key, combination in ranked:
        if bound >= search.best_value * (1 - 1e-12) or math.isinf(bound):
            break  # sorted: every later bound is at least as high
        if key in solved or (closed_degrees is not None and combination.healthy_degree in closed_degrees):
            continue
        if not search.can_beat(key, time.perf_counter() < deadline if milp else first_solves > 0):
            continue  # proven: no plan on these devices beats the incumbent
        settle(combination.groups, key, bound)
        if closed_degrees is None and search.best_plan is not None:
            closed_degrees = _closed_degrees(problem, search)
    for bound, key, groups in sorted(pending, key=lambda row: row[:2]):
        counts = time.perf_counter() < deadline if milp else retries > 0
        if bound >= search.best_value * (1 - 1e-12) or not search.can_beat(key, counts):
            continue  # the incumbent found since settles it
        left = deadline - time.perf_counter()
        if (milp and left > 0) or (not milp and retries > 0):
            retries -= 1
            bound = search.solve_leaf(groups, bound, dataclasses.replace(config, time_limit_s=left) if milp else config)
            if bound is None:
                continue
        search.unproven += 1
        search.open_bound = min(search.open_bound, bound)
    if search.best_plan is None:
        raise InfeasibleError(
            "no grouping of the GPUs into TP groups has a plan that fits"
            + ("" if search.unproven == 0 else " (some groupings were not proven infeasible)"))
    proven = search.unproven == 0
    value = search.best_value
    gap = 0.0 if proven else relative_gap(value, min(search.open_bound, value))
    searched = {c.key for c in distinct}
    stats = SearchStats(combinations=len(distinct), solved=search.solved, pruned=len(searched - solved),
                        unproven=search.unproven, relaxations=search.relaxations,
                        joint_proofs=search.joint_proofs)
    plan = search.best_plan.with_result(status="optimal" if proven else "feasible", gap=gap,
                                        solve_seconds=time.perf_counter() - start)
    return TensorPlan(search.best_groups, plan, stats)


def _joint_phase(search: _Search, joint: JointProof, rows: list[Combination], solved: set[tuple], settle,
                 in_time) -> list[Combination]:
    """The groupings the joint proof leaves to be solved one by one (step 4 of the module docstring).

    Per healthy degree, :meth:`~resihp_lightning.solver.tensor_joint.JointProof.decide` is asked
    whether any grouping beats the incumbent: ``"closed"`` settles them all; a witness's plan
    becomes the incumbent (after :data:`WITNESS_PLANS` of them the grouping it names is solved
    too) and the question is asked again; ``"open"`` (or :data:`JOINT_ROUNDS` witnesses) leaves
    the rest to the best-first loop. Out of time (``in_time()`` false) a degree is still asked
    once, like a bound, but no grouping is solved.
    """
    left: list[Combination] = []
    # The largest degree first: the seeds' own, where the incumbent usually improves.
    for degree in sorted(dict.fromkeys(c.healthy_degree for c in rows), key=lambda k: -(k or 0)):
        # Groupings solved already stay in the question (none beats the incumbent, so the verdict
        # is the same), which keeps the knapsack's states, and their moves, the same every round.
        members = [c for c in rows if c.healthy_degree == degree]
        for round_ in range(JOINT_ROUNDS):
            late = not in_time()
            if late and round_ > 0:
                break  # out of time (or work): one question per degree, then the rest by their bounds
            if all(c.key in solved for c in members):
                members = []
                break
            verdict = joint.decide([c.key for c in members], search.best_value)
            search.joint_proofs += 1
            if verdict.outcome == "closed":
                members = []
                break
            if verdict.outcome != "witness":
                break
            named = [members[i] for i in verdict.fleets]
            chosen = min(named, key=lambda c: (len(c.key), c.key))
            plan = _witness_plan(search.problem, chosen.groups, verdict.replicas)
            if plan is not None and plan.iteration_ms < search.best_value * (1 - 1e-12):
                # The mix found is a better plan: the new incumbent (its grouping may hold better).
                search.best_plan, search.best_groups, search.best_value = plan, chosen.groups, plan.iteration_ms
                if round_ < WITNESS_PLANS:
                    continue
            # Witnesses that keep coming improve the incumbent a little each: solve the grouping.
            named = [c for c in named if c.key not in solved]
            if not named or late:
                break
            chosen = min(named, key=lambda c: (len(c.key), c.key))
            settle(chosen.groups, chosen.key, search.bounder.bound(chosen.key, replicas=True))
        left.extend(c for c in members if c.key not in solved)
    return left


def _heuristic_plan(problem: TensorProblem, groups: tuple[TensorGroup, ...]) -> Plan | None:
    """The exact planner's heuristic phase alone on these groups (``None``: it found nothing)."""
    if not groups:
        return None
    group_problem = problem.group_problem(groups)
    model = Model(group_problem)
    best = Best()
    heuristic_search(model, best)
    if math.isinf(best.value):
        return None
    plan = build_plan(model, best.grid, best.bounds, best.counts)
    return plan.with_result(iteration_ms=evaluate(group_problem, plan).iteration_ms, status="feasible", solver="exact")


def _witness_plan(problem: TensorProblem, groups: tuple[TensorGroup, ...], replicas) -> Plan | None:
    """The plan the joint proof's witness describes, on these groups (``None``: it does not fit them).

    Each replica takes unused groups whose device has its stages' (speed, memory, link slowdown),
    lowest ids first; the micro-batches are split exactly (:func:`~.microbatch_split.split`) and
    the plan is priced by :func:`~resihp_lightning.plan.evaluate`, so a witness that rounding makes
    slower than its count said is only as good as its price.
    """
    if not replicas:
        return None
    group_problem = problem.group_problem(groups)
    model = Model(group_problem)
    pools: dict[tuple[float, float, float], list[int]] = {}
    for cls, found in enumerate(model.classes):
        pools[(found.speed, found.memory_mb, found.link_slowdown)] = [cls] + list(found.ids)
    taken: dict[tuple[float, float, float], int] = {}
    rows = []
    for stages, bounds, count in replicas:
        for _ in range(count):
            ids, types = [], []
            for signature in stages:
                pool = pools.get(signature)
                at = taken.get(signature, 0) + 1
                if pool is None or at >= len(pool):
                    return None
                taken[signature] = at
                ids.append(pool[at])
                types.append(pool[0])
            rows.append((tuple(ids), tuple(bounds), model.profile(types, bounds)))
    result = split([(*profile, 1) for _, _, profile in rows], group_problem.micro_batches)
    if result is None:
        return None
    plan = Plan(tuple(Replica(ids, bounds, counts[0]) for (ids, bounds, _), counts in zip(rows, result[1])))
    try:
        priced = evaluate(group_problem, plan)
    except PlanError:
        return None
    if not priced.fits_memory:
        return None
    return plan.with_result(iteration_ms=priced.iteration_ms, status="feasible", solver="exact")


def _seeds(problem: TensorProblem, ranked: list) -> list[tuple[TensorGroup, ...]]:
    """The groupings solved first, for the first incumbent: ResiHP's rule and the fixed degree at the
    largest healthy degree (the job's own, usually; points of the space with ``allow_exclude``), else
    the grouping of that degree with the fewest devices. Few large groups are quick to plan and
    rarely far from the best, while the least bound often belongs to many small groups whose deep
    pipelines are slow to solve; and the search is never worse than its seeds."""
    degrees = problem.healthy_degrees()
    if not degrees:
        return []
    top = max(degrees)
    if problem.problem.allow_exclude:
        seeds = [resihp_rule_groups(problem, top), fixed_degree_groups(problem, top)]
        return [groups for groups in seeds if groups]
    own = [row for row in ranked if (row[2].healthy_degree or top) == top and not math.isinf(row[0])]
    if not own:
        return []
    return [min(own, key=lambda row: (len(row[1]), row[0]))[2].groups]


def _closed_degrees(problem: TensorProblem, search: _Search, degrees: set | None = None) -> set[int | None]:
    """The healthy degrees (of ``degrees``, default all) whose relaxation cannot beat the incumbent
    (step 2 of :func:`solve_tensor`)."""
    if not problem.problem.allow_exclude:
        return set()
    domains = range(len(problem.domains))
    healthy = [d for d in domains if problem.healthy(d)]
    affected = [d for d in domains if d not in set(healthy)]
    if not affected:
        return set()
    relaxed_domains: tuple = ()
    for d in affected:
        keys = [device_key(problem.group_device(g) for g in groups) for groups in domain_groupings(problem, d)]
        relaxed_domains += envelope(keys)
    closed = set()
    for degree in (list(problem.healthy_degrees()) if healthy else [None]):
        if degrees is not None and degree not in degrees:
            continue
        base = tuple(g for d in healthy for g in healthy_groups(problem, d, degree)) if degree else ()
        fleet = tuple(sorted(device_key(problem.group_device(g) for g in base) + relaxed_domains))
        bound = search.bounder.bound(fleet, replicas=True)
        if bound >= search.best_value * (1 - 1e-12) or search.closes(fleet):
            closed.add(degree)
    return closed


def plan_groups(problem: TensorProblem, groups: Sequence[TensorGroup], config: PlannerConfig | None = None) -> TensorPlan:
    """The best plan over fixed groups (:func:`resihp_lightning.solver.solve` on the group problem).

    Raises:
        PlanError: the groups break a rule (named).
        InfeasibleError: nothing fits on these groups.
    """
    from resihp_lightning.solver import solve

    config = config or PlannerConfig()
    problem = _with_config(problem, config)
    start = time.perf_counter()
    plan = solve(problem.group_problem(groups), config)
    return TensorPlan(tuple(groups), plan.with_result(solve_seconds=time.perf_counter() - start))


def resihp_rule(problem: TensorProblem, degree: int, config: PlannerConfig | None = None) -> TensorPlan:
    """ResiHP's rule (:func:`~resihp_lightning.tensor_plan.resihp_rule_groups`: healthy domains keep the
    job's ``degree``, each affected domain one group maximising k times its slowest member's speed),
    planned by the same solver."""
    return plan_groups(problem, resihp_rule_groups(problem, degree), config)


def fixed_degree(problem: TensorProblem, degree: int, config: PlannerConfig | None = None) -> TensorPlan:
    """One degree everywhere (:func:`~resihp_lightning.tensor_plan.fixed_degree_groups`), planned by the same solver."""
    return plan_groups(problem, fixed_degree_groups(problem, degree), config)


def best_fixed_degree(problem: TensorProblem, config: PlannerConfig | None = None) -> TensorPlan:
    """The fastest of :func:`fixed_degree` over the degrees that split every healthy domain.

    Raises:
        InfeasibleError: no degree has a plan that fits.
    """
    best = None
    for degree in problem.healthy_degrees():
        try:
            candidate = fixed_degree(problem, degree, config)
        except (InfeasibleError, PlanError):
            continue
        if best is None or candidate.iteration_ms < best.iteration_ms:
            best = candidate
    if best is None:
        raise InfeasibleError(f"no fixed TP degree among {list(problem.healthy_degrees())} has a plan that fits")
    return best


def _with_config(problem: TensorProblem, config: PlannerConfig) -> TensorProblem:
    """The TP problem with the config's model options written over its GPU problem."""
    applied = config.apply_to(problem.problem)
    if applied is problem.problem:
        return problem
    return TensorProblem(applied, problem.domains, problem.cost)
