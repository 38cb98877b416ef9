"""Tensor-parallel degrees in the planning model (docs/planner.md, "Choosing tensor-parallel degrees").

The planning model of :mod:`resihp_lightning.plan` places stages on *devices*. With tensor
parallelism (TP) a device of that model is a TP *group*: k GPUs that split every layer of their
stages k ways and synchronise inside each layer. This module describes the GPUs, the domains groups
may be formed in, what a group of k GPUs is to the planner, and a plan over groups. It is plain
Python (no torch, no solver): :mod:`resihp_lightning.solver.tensor_search` searches it.

**Inputs are per GPU.** A :class:`TensorProblem` holds a :class:`~resihp_lightning.plan.Problem`
whose ``devices`` are the live GPUs (speed, ``memory_mb``, ``link_speed``; a dead GPU is simply
absent) and whose ``layers`` are costed for ONE healthy GPU: ``compute_ms`` is a layer's forward and
backward on one GPU at speed 1.0, ``static_mb`` / ``activation_mb`` the memory of the whole layer.
Its ``domains`` partition the GPUs, dead ones included, into TP domains (a node's NVLink domain,
e.g. consecutive ranks): a group is formed inside one domain only. Its :class:`TensorCost` names the
allowed degrees (the model tells: :func:`even_split_degrees` gives the degrees that split its heads,
key/value heads and vocabulary evenly) and, per degree k, ``comm_fraction[k]`` = f_k: the group's
TP all-reduces per layer as a fraction of the layer's one-GPU compute time (0 for k = 1).

**A group is one planner device.** k GPUs whose slowest member has speed s run a layer of one-GPU
compute c in ``c / (k s) + c f_k`` (the shards compute in parallel at the slowest member's pace, the
all-reduces run over NVLink whatever the members' compute speed), so the group is the device::

    speed      = 1 / (1 / (k s) + f_k)
    memory_mb  = k * min member memory_mb        (the shards split a layer's memory evenly)
    link_speed = min member link_speed           (each member sends its own copy of the
                                                  stage-boundary activations to the next stage)

f_k is a model-wide average: exact when every layer has the same ratio of all-reduce time to
compute (the decoder layers of one model, nearly), an approximation for the embedding and the head.
Stage-boundary activations are whole on every member, so the real memory is a little above the
shards' share; the model ignores that (it is one activation per micro-batch in flight, next to the
layers' state). A group's id in the plan is its first member's GPU id.

**Groupings.** A grouping of a domain is a set of disjoint groups of its live GPUs, each of an
allowed degree; GPUs in no group are spares (idle). A domain is *healthy* when all its GPUs are live
and identical in speed, memory and link speed, and *affected* otherwise. The search space of the
planner (:func:`~resihp_lightning.solver.tensor_search.solve_tensor`): one healthy degree t' among
the allowed degrees that divide every healthy domain's size, every healthy domain split into groups
of t' (consecutive GPUs), every affected domain any of its groupings (:func:`domain_groupings`);
then the stage bounds, placement, micro-batches and spares over the groups, as
:func:`resihp_lightning.solver.solve` plans any problem. Mixing degrees inside or across healthy
domains is outside this space. Without ``allow_exclude`` every live GPU must be in a group the plan
uses, so no grouping leaves a spare.

Two baselines are points of the space: ResiHP's rule (:func:`resihp_rule_groups`) and a fixed
degree everywhere (:func:`fixed_degree_groups`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from resihp_lightning.errors import PlanError, ProblemError
from resihp_lightning.plan import Device, Evaluation, Plan, Problem, evaluate, validate

#: The most GPUs a TP domain may hold (a node's NVLink domain): every grouping of it is enumerated.
MAX_DOMAIN_SIZE = 8


# --------------------------------------------------------------------------------------------- cost
@dataclass(frozen=True)
class TensorCost:
    """What tensor parallelism allows and costs for one model.

    Attributes:
        degrees: the allowed TP degrees, ascending (e.g. :func:`even_split_degrees`).
        comm_fraction: f_k per allowed degree k: the group's TP all-reduce time per layer as a
            fraction of the layer's one-GPU compute time (>= 0). Degree 1 has no all-reduce: its
            fraction is 0 and may be left out; every other allowed degree needs one.
    """

    degrees: tuple[int, ...] = (1,)
    comm_fraction: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        degrees = tuple(self.degrees) if isinstance(self.degrees, (list, tuple)) else self.degrees
        if not isinstance(degrees, tuple) or not degrees:
            raise ProblemError(f"tensor.degrees must be a non-empty list of integers >= 1, got {self.degrees!r}")
        for degree in degrees:
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ProblemError(f"tensor.degrees must hold integers >= 1, got {degree!r}")
        if len(set(degrees)) != len(degrees):
            raise ProblemError(f"tensor.degrees lists a degree twice: {list(degrees)}")
        degrees = tuple(sorted(degrees))
        if not isinstance(self.comm_fraction, Mapping):
            raise ProblemError(f"tensor.comm_fraction must map degrees to fractions, got {self.comm_fraction!r}")
        fractions: dict[int, float] = {}
        for degree, value in self.comm_fraction.items():
            if degree not in degrees:
                raise ProblemError(f"tensor.comm_fraction names degree {degree!r}, which is not among the allowed "
                                   f"degrees {list(degrees)}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ProblemError(f"tensor.comm_fraction[{degree}] must be a finite number >= 0, got {value!r}")
            if degree == 1 and value != 0:
                raise ProblemError(f"tensor.comm_fraction[1] must be 0 (one GPU has no TP all-reduce), got {value!r}")
            fractions[degree] = float(value)
        missing = [k for k in degrees if k != 1 and k not in fractions]
        if missing:
            raise ProblemError(f"tensor.comm_fraction has no fraction for degree {missing[0]}; every allowed degree "
                               f"above 1 needs one")
        if 1 in degrees:
            fractions[1] = 0.0
        object.__setattr__(self, "degrees", degrees)
        object.__setattr__(self, "comm_fraction", dict(sorted(fractions.items())))

    def fraction(self, degree: int) -> float:
        """f_k of an allowed degree."""
        if degree not in self.comm_fraction:
            raise PlanError(f"TP degree {degree} is not allowed; allowed degrees: {list(self.degrees)}")
        return self.comm_fraction[degree]

    def to_dict(self) -> dict[str, Any]:
        return {"degrees": list(self.degrees), "comm_fraction": {str(k): v for k, v in self.comm_fraction.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorCost:
        """Reads the JSON form (``comm_fraction`` keys are degrees written as strings)."""
        if not isinstance(data, Mapping):
            raise ProblemError(f"tensor must be a JSON object, got {type(data).__name__}")
        _refuse_unknown(data, {"degrees", "comm_fraction"}, "tensor")
        fractions = data.get("comm_fraction", {})
        if not isinstance(fractions, Mapping):
            raise ProblemError(f"tensor.comm_fraction must be an object, got {type(fractions).__name__}")
        parsed = {}
        for key, value in fractions.items():
            try:
                parsed[int(key)] = value
            except (TypeError, ValueError):
                raise ProblemError(f"tensor.comm_fraction keys must be degrees, got {key!r}") from None
        return cls(tuple(data.get("degrees", (1,))), parsed)


def even_split_degrees(*counts: int, max_degree: int = MAX_DOMAIN_SIZE) -> tuple[int, ...]:
    """The TP degrees up to ``max_degree`` that divide every count: what splits a model evenly.

    A Megatron-style split gives each member whole attention heads and key/value heads and an equal
    share of the vocabulary, so pass ``heads, kv_heads`` and, when the vocabulary is split too (no
    padding), ``vocab``.
    """
    if not counts or any(not isinstance(c, int) or c < 1 for c in counts):
        raise ProblemError(f"even_split_degrees needs positive integer counts, got {list(counts)}")
    return tuple(k for k in range(1, max_degree + 1) if all(c % k == 0 for c in counts))


def group_device(members: Sequence[Device], cost: TensorCost, device_id: int | None = None) -> Device:
    """The planner device of a TP group of these GPUs (module docstring).

    Args:
        members: the group's GPUs (their number is the degree k; it must be allowed).
        cost: the allowed degrees and all-reduce fractions.
        device_id: the device's id (default: the first member's id).
    """
    k = len(members)
    if k == 0:
        raise PlanError("a TP group needs at least one GPU")
    f = cost.fraction(k)
    slowest = min(m.speed for m in members)
    speed = 1.0 / (1.0 / (k * slowest) + f)
    memory = k * min(m.memory_mb for m in members)
    link = min(m.link_speed for m in members)
    return Device(members[0].id if device_id is None else device_id, speed, memory, link)


# ------------------------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class TensorGroup:
    """One TP group.

    Attributes:
        members: its GPU ids in member order (member i holds shard i of every layer); its id in a
            plan is ``members[0]``.
    """

    members: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))

    @property
    def degree(self) -> int:
        """k, the number of members."""
        return len(self.members)

    @property
    def id(self) -> int:
        """The group's device id in a plan: its first member's GPU id."""
        return self.members[0]


@dataclass(frozen=True)
class TensorProblem:
    """A planning problem over GPUs that may form TP groups (module docstring).

    Attributes:
        problem: the live GPUs as ``devices`` and the layers costed for one healthy GPU; its other
            fields (micro-batches, transfers, pipeline degrees, partition, exclusion, ...) apply to
            the plan over groups as they do to any plan.
        domains: every GPU of each TP domain, dead ones included (a GPU id missing from
            ``problem.devices`` is dead); at most :data:`MAX_DOMAIN_SIZE` GPUs each.
        cost: the allowed degrees and the TP all-reduce fractions.
    """

    problem: Problem
    domains: tuple[tuple[int, ...], ...]
    cost: TensorCost

    def __post_init__(self) -> None:
        if not isinstance(self.problem, Problem):
            raise ProblemError(f"problem must be a Problem, got {type(self.problem).__name__}")
        if not isinstance(self.cost, TensorCost):
            raise ProblemError(f"cost must be a TensorCost, got {type(self.cost).__name__}")
        if not isinstance(self.domains, (list, tuple)) or not self.domains:
            raise ProblemError("domains must be a non-empty list of lists of GPU ids")
        domains = []
        owner: dict[int, int] = {}
        for index, domain in enumerate(self.domains):
            if not isinstance(domain, (list, tuple)) or not domain:
                raise ProblemError(f"domains[{index}] must be a non-empty list of GPU ids, got {domain!r}")
            if len(domain) > MAX_DOMAIN_SIZE:
                raise ProblemError(f"domains[{index}] has {len(domain)} GPUs; a TP domain holds at most {MAX_DOMAIN_SIZE}")
            for gpu in domain:
                if not isinstance(gpu, int) or isinstance(gpu, bool):
                    raise ProblemError(f"domains[{index}] must hold integer GPU ids, got {gpu!r}")
                if gpu in owner:
                    where = "twice" if owner[gpu] == index else f"in domains[{owner[gpu]}] too"
                    raise ProblemError(f"GPU {gpu} of domains[{index}] is {where}; a GPU belongs to one TP domain")
                owner[gpu] = index
            domains.append(tuple(domain))
        for index, device in enumerate(self.problem.devices):
            if device.id not in owner:
                raise ProblemError(f"GPU {device.id} (problem.devices[{index}]) is in no domain; every live GPU "
                                   f"belongs to one TP domain")
        object.__setattr__(self, "domains", tuple(domains))
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_alive", {d.id: d for d in self.problem.devices})

    # ------------------------------------------------------------------------------- derived
    def gpu(self, gpu_id: int) -> Device:
        """The live GPU with this id (``KeyError`` when it is dead or unknown)."""
        return self._alive[gpu_id]

    def domain_of(self, gpu_id: int) -> int:
        """The index of the domain holding this GPU (``KeyError`` when none does)."""
        return self._owner[gpu_id]

    def live(self, domain: int) -> tuple[int, ...]:
        """The live GPUs of a domain, in domain order."""
        return tuple(g for g in self.domains[domain] if g in self._alive)

    def healthy(self, domain: int) -> bool:
        """All the domain's GPUs are live and identical in speed, memory and link speed."""
        live = self.live(domain)
        if len(live) != len(self.domains[domain]):
            return False
        kinds = {_kind(self.gpu(g)) for g in live}
        return len(kinds) == 1

    def healthy_degrees(self) -> tuple[int, ...]:
        """The allowed degrees t' that divide every healthy domain's size (all of them when none is healthy)."""
        sizes = {len(self.domains[d]) for d in range(len(self.domains)) if self.healthy(d)}
        return tuple(k for k in self.cost.degrees if all(size % k == 0 for size in sizes))

    def group_device(self, group: TensorGroup) -> Device:
        """The planner device of ``group`` (:func:`group_device`; id = its first member)."""
        return group_device([self.gpu(g) for g in group.members], self.cost, group.id)

    def group_problem(self, groups: Sequence[TensorGroup]) -> Problem:
        """The planning problem over these groups: one device per group (ids = first members, ascending),
        every other field of ``problem`` as it is. The groups are checked first (:meth:`check_groups`).

        Raises:
            PlanError: the groups break a rule (named), or there are none.
        """
        self.check_groups(groups)
        if not groups:
            raise PlanError("no TP group: every live GPU is a spare, and a plan needs at least one device")
        devices = sorted((self.group_device(g) for g in groups), key=lambda d: d.id)
        return replace(self.problem, devices=tuple(devices))

    def check_groups(self, groups: Sequence[TensorGroup]) -> None:
        """Checks that ``groups`` are disjoint groups of live GPUs, each inside one domain and of an
        allowed degree; without ``allow_exclude`` they must hold every live GPU.

        Raises:
            PlanError: naming the first group and rule it breaks.
        """
        alive = self._alive
        taken: dict[int, int] = {}
        for index, group in enumerate(groups):
            if not isinstance(group, TensorGroup):
                raise PlanError(f"groups[{index}] must be a TensorGroup, got {type(group).__name__}")
            if group.degree not in self.cost.degrees:
                raise PlanError(f"groups[{index}] has degree {group.degree}; allowed degrees: {list(self.cost.degrees)}")
            for gpu in group.members:
                if gpu not in alive:
                    state = "dead" if gpu in self._owner else "unknown"
                    raise PlanError(f"groups[{index}] names GPU {gpu!r}, which is {state}: a group holds live GPUs "
                                    f"of the problem")
                if gpu in taken:
                    where = "twice" if taken[gpu] == index else f"in groups[{taken[gpu]}] too"
                    raise PlanError(f"GPU {gpu} of groups[{index}] is {where}; a GPU belongs to one group")
                taken[gpu] = index
            homes = sorted({self._owner[g] for g in group.members})
            if len(homes) > 1:
                raise PlanError(f"groups[{index}] mixes GPUs of domains {homes}; a TP group stays inside one domain")
        if not self.problem.allow_exclude:
            idle = sorted(set(alive) - set(taken))
            if idle:
                raise PlanError(f"GPUs {idle} are in no group, but the problem does not allow_exclude (no spares)")

    # ---------------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {"problem": self.problem.to_dict(), "domains": [list(d) for d in self.domains],
                "tensor": self.cost.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorProblem:
        """Builds a TP problem from its JSON form: ``problem`` (as :meth:`Problem.from_dict
        <resihp_lightning.plan.Problem.from_dict>`), ``domains`` and ``tensor``."""
        if not isinstance(data, Mapping):
            raise ProblemError(f"a TP problem must be a JSON object, got {type(data).__name__}")
        _refuse_unknown(data, {"problem", "domains", "tensor"}, "TP problem")
        for required in ("problem", "domains", "tensor"):
            if required not in data:
                raise ProblemError(f"TP problem is missing the field '{required}'")
        domains = data["domains"]
        if not isinstance(domains, list):
            raise ProblemError(f"'domains' must be a list of lists of GPU ids, got {type(domains).__name__}")
        return cls(Problem.from_dict(data["problem"]), tuple(tuple(d) if isinstance(d, list) else d for d in domains),
                   TensorCost.from_dict(data["tensor"]))

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> TensorProblem:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ProblemError(f"TP problem is not valid JSON: {err}") from None
        return cls.from_dict(data)


# --------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class SearchStats:
    """How :func:`~resihp_lightning.solver.tensor_search.solve_tensor` covered its space.

    Attributes:
        combinations: groupings searched: one per multiset of group devices, a domain's dominated
            groupings left out (:func:`~resihp_lightning.solver.tensor_search.combinations`).
        solved: groupings handed to the planner.
        pruned: groupings never solved: closed by a lower bound, a relaxation's solve or the joint proof.
        unproven: groupings whose solve stopped without a proof.
        relaxations: solves of relaxations (a fleet standing for several groupings).
        joint_proofs: questions to the joint proof over a healthy degree's groupings
            (:class:`~resihp_lightning.solver.tensor_joint.JointProof`).
    """

    combinations: int = 0
    solved: int = 0
    pruned: int = 0
    unproven: int = 0
    relaxations: int = 0
    joint_proofs: int = 0


@dataclass(frozen=True)
class TensorPlan:
    """TP groups and a plan over them.

    Attributes:
        groups: the groups formed (a group the plan does not use idles, like a GPU in no group).
        plan: the plan over group ids; its ``iteration_ms``, ``status``, ``gap`` and
            ``solve_seconds`` are the whole search's.
        search: how the search covered its space (``None`` for a given or baseline plan).
    """

    groups: tuple[TensorGroup, ...]
    plan: Plan
    search: SearchStats | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))

    @property
    def iteration_ms(self) -> float | None:
        return self.plan.iteration_ms

    @property
    def status(self) -> str:
        return self.plan.status

    @property
    def gap(self) -> float | None:
        return self.plan.gap

    @property
    def solve_seconds(self) -> float:
        return self.plan.solve_seconds

    @property
    def used_groups(self) -> tuple[TensorGroup, ...]:
        """The groups that hold a stage, in group order."""
        used = set(self.plan.device_ids)
        return tuple(g for g in self.groups if g.id in used)

    def degrees(self) -> dict[int, int]:
        """Group id -> degree of every group that holds a stage."""
        return {g.id: g.degree for g in self.used_groups}

    def idle_gpus(self, problem: TensorProblem) -> tuple[int, ...]:
        """The live GPUs holding no stage (in no group, or in a group the plan does not use), ascending."""
        busy = {gpu for g in self.used_groups for gpu in g.members}
        return tuple(sorted(d.id for d in problem.problem.devices if d.id not in busy))

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"groups": [{"members": list(g.members), "degree": g.degree} for g in self.groups],
                                "plan": self.plan.to_dict()}
        data["search"] = None if self.search is None else asdict(self.search)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorPlan:
        """Reads the JSON form (a group's ``degree`` is checked against its members, not trusted)."""
        if not isinstance(data, Mapping):
            raise PlanError(f"a TP plan must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {"groups", "plan", "search"})
        if unknown:
            raise PlanError(f"unknown field '{unknown[0]}' in TP plan; allowed: groups, plan, search")
        if not isinstance(data.get("groups"), list) or "plan" not in data:
            raise PlanError("a TP plan needs a list 'groups' and a 'plan'")
        groups = []
        for index, item in enumerate(data["groups"]):
            if not isinstance(item, Mapping) or not set(item) <= {"members", "degree"} or "members" not in item:
                raise PlanError(f"groups[{index}] must have the field members (and optionally degree)")
            members = item["members"]
            if not isinstance(members, list) or not members:
                raise PlanError(f"groups[{index}].members must be a non-empty list of GPU ids")
            if "degree" in item and item["degree"] != len(members):
                raise PlanError(f"groups[{index}] says degree {item['degree']} but has {len(members)} members")
            groups.append(TensorGroup(tuple(members)))
        search = data.get("search")
        stats = None
        if search is not None:
            allowed = {f.name for f in fields(SearchStats)}
            if not isinstance(search, Mapping) or set(search) - allowed:
                raise PlanError(f"search must have only the fields {', '.join(sorted(allowed))}")
            stats = SearchStats(**search)
        return cls(tuple(groups), Plan.from_dict(data["plan"]), stats)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> TensorPlan:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as err:
            raise PlanError(f"TP plan is not valid JSON: {err}") from None


def validate_tensor_plan(problem: TensorProblem, tensor_plan: TensorPlan) -> None:
    """Checks the groups (:meth:`TensorProblem.check_groups`) and the plan over them
    (:func:`~resihp_lightning.plan.validate` on the group problem, memory included).

    Raises:
        PlanError: naming the first rule broken.
    """
    validate(problem.group_problem(tensor_plan.groups), tensor_plan.plan)


def evaluate_tensor_plan(problem: TensorProblem, tensor_plan: TensorPlan) -> Evaluation:
    """Prices the plan over groups with :func:`~resihp_lightning.plan.evaluate` on the group problem."""
    return evaluate(problem.group_problem(tensor_plan.groups), tensor_plan.plan)


# ---------------------------------------------------------------------------------------- groupings
def healthy_groups(problem: TensorProblem, domain: int, degree: int) -> tuple[TensorGroup, ...]:
    """A healthy domain split into groups of ``degree`` consecutive GPUs (domain order)."""
    gpus = problem.domains[domain]
    if degree not in problem.cost.degrees or len(gpus) % degree:
        raise PlanError(f"degree {degree} does not split domains[{domain}] of {len(gpus)} GPUs (allowed degrees: "
                        f"{list(problem.cost.degrees)})")
    return tuple(TensorGroup(gpus[i:i + degree]) for i in range(0, len(gpus), degree))


def domain_groupings(problem: TensorProblem, domain: int) -> list[tuple[TensorGroup, ...]]:
    """Every grouping of a domain's live GPUs, one per distinct multiset of group devices.

    Groups take allowed degrees; GPUs in no group are spares, so without ``allow_exclude`` only
    groupings that hold every live GPU are listed. GPUs of equal (speed, memory, link speed) are
    interchangeable, so the partitions are enumerated over kinds of GPU (a multiset partition),
    each group's members taken by ascending id among its kinds. Among groupings with equal devices
    the one with the fewest GPUs (more spares) is kept. Members are listed by ascending id.
    """
    live = problem.live(domain)
    by_kind: dict[tuple, list[int]] = {}
    for gpu in sorted(live):
        by_kind.setdefault(_kind(problem.gpu(gpu)), []).append(gpu)
    kinds = sorted(by_kind, key=lambda k: (-k[0], -k[1], -k[2]))
    counts = tuple(len(by_kind[k]) for k in kinds)
    cover = not problem.problem.allow_exclude
    degrees = problem.cost.degrees
    partitions = _multiset_partitions(counts, degrees, cover)
    chosen: dict[tuple, tuple[int, tuple[TensorGroup, ...]]] = {}
    for blocks in partitions:
        taken = [0] * len(kinds)
        groups = []
        for block in blocks:
            members = []
            for kind_index, n in enumerate(block):
                members += by_kind[kinds[kind_index]][taken[kind_index]:taken[kind_index] + n]
                taken[kind_index] += n
            groups.append(TensorGroup(tuple(sorted(members))))
        groups.sort(key=lambda g: g.members)
        key = device_key(problem.group_device(g) for g in groups)
        used = sum(g.degree for g in groups)
        if key not in chosen or (used, _order(groups)) < (chosen[key][0], _order(chosen[key][1])):
            chosen[key] = (used, tuple(groups))
    return [groups for _, groups in sorted(chosen.values(), key=lambda item: (item[0], _order(item[1])))]


def resihp_rule_groups(problem: TensorProblem, degree: int) -> tuple[TensorGroup, ...]:
    """ResiHP's rule: healthy domains keep the job's degree; each affected domain forms ONE group.

    The affected domain's group is of the allowed degree k (at most its live GPUs) that maximises
    ``k * (the slowest speed among its k fastest live GPUs)`` (ties: the larger k), made of those k
    GPUs (ties in speed: lower ids first); its other GPUs are spares.

    Args:
        problem: the TP problem.
        degree: the job's TP degree t (allowed, dividing every healthy domain's size).
    """
    groups: list[TensorGroup] = []
    for d in range(len(problem.domains)):
        if problem.healthy(d):
            groups.extend(healthy_groups(problem, d, degree))
            continue
        fastest = _fastest_first(problem, d)
        options = [k for k in problem.cost.degrees if k <= len(fastest)]
        if not options:
            continue
        k = max(options, key=lambda k: (k * problem.gpu(fastest[k - 1]).speed, k))
        groups.append(TensorGroup(tuple(sorted(fastest[:k]))))
    return tuple(groups)


def fixed_degree_groups(problem: TensorProblem, degree: int) -> tuple[TensorGroup, ...]:
    """Every domain split into groups of ``degree`` from its fastest live GPUs in order (the rest spares).

    A healthy domain is split as in the search space (consecutive GPUs), so ``degree`` must divide
    every healthy domain's size (:meth:`TensorProblem.healthy_degrees`).
    """
    if degree not in problem.healthy_degrees():
        raise PlanError(f"degree {degree} does not split every healthy domain; degrees that do: "
                        f"{list(problem.healthy_degrees())}")
    groups: list[TensorGroup] = []
    for d in range(len(problem.domains)):
        if problem.healthy(d):
            groups.extend(healthy_groups(problem, d, degree))
            continue
        fastest = _fastest_first(problem, d)
        for start in range(0, len(fastest) - degree + 1, degree):
            groups.append(TensorGroup(tuple(sorted(fastest[start:start + degree]))))
    return tuple(groups)


def device_key(devices) -> tuple:
    """The multiset of planner devices (speed, memory, link speed), sorted: what makes two groupings alike."""
    return tuple(sorted((d.speed, d.memory_mb, d.link_speed) for d in devices))


# ----------------------------------------------------------------------------------------- internals
def _kind(device: Device) -> tuple[float, float, float]:
    return (device.speed, device.memory_mb, device.link_speed)


def _order(groups: Sequence[TensorGroup]) -> tuple:
    return tuple(g.members for g in groups)


def _fastest_first(problem: TensorProblem, domain: int) -> list[int]:
    """The domain's live GPUs, fastest first (ties: lower id first)."""
    return sorted(problem.live(domain), key=lambda g: (-problem.gpu(g).speed, g))


def _multiset_partitions(counts: tuple[int, ...], degrees: tuple[int, ...], cover: bool) -> list[tuple[tuple[int, ...], ...]]:
    """Every way to take disjoint blocks (per-kind counts) of allowed sizes from ``counts``, the rest spare.

    The first kind with a GPU left anchors the next decision: that GPU is a spare (unless ``cover``)
    or joins a block with any sub-multiset of the rest. Results are sorted tuples of blocks (so a
    partition reached in two orders is listed once).
    """
    memo: dict[tuple[int, ...], set[tuple[tuple[int, ...], ...]]] = {}

    def sub_multisets(left: tuple[int, ...], size: int, start: int = 0):
        if size == 0:
            yield (0,) * len(left)
            return
        for i in range(start, len(left)):
            if left[i]:
                reduced = left[:i] + (left[i] - 1,) + left[i + 1:]
                for rest in sub_multisets(reduced, size - 1, i):
                    yield rest[:i] + (rest[i] + 1,) + rest[i + 1:]

    def rec(left: tuple[int, ...]) -> set[tuple[tuple[int, ...], ...]]:
        if left in memo:
            return memo[left]
        anchor = next((i for i, n in enumerate(left) if n), None)
        if anchor is None:
            return {()}
        out: set[tuple[tuple[int, ...], ...]] = set()
        without = left[:anchor] + (left[anchor] - 1,) + left[anchor + 1:]
        if not cover:
            out |= rec(without)  # the anchor GPU is a spare
        for k in degrees:
            if k > sum(left):
                continue
            for others in set(sub_multisets(without, k - 1)):
                block = others[:anchor] + (others[anchor] + 1,) + others[anchor + 1:]
                rest = tuple(n - b for n, b in zip(left, block))
                for tail in rec(rest):
                    out.add(tuple(sorted((block, *tail))))
        memo[left] = out
        return out

    return sorted(rec(tuple(counts)))


def _refuse_unknown(data: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ProblemError(f"unknown field '{unknown[0]}' in {where}; allowed: {', '.join(sorted(allowed))}")


__all__ = [
    "MAX_DOMAIN_SIZE", "SearchStats", "TensorCost", "TensorGroup", "TensorPlan", "TensorProblem", "device_key",
    "domain_groupings", "evaluate_tensor_plan", "even_split_degrees", "fixed_degree_groups", "group_device",
    "healthy_groups", "resihp_rule_groups", "validate_tensor_plan",
]
