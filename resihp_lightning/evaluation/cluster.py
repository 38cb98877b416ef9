"""The cluster as a policy sees it: planner devices from GPU states, cached solves, plan prices and moves.

A planner device is a TP group of ``tp`` consecutive GPUs. Without ``tp_drop`` a group is atomic: it
runs at its slowest GPU's speed and is lost with any of its GPUs (the profile prices one group).
With ``tp_drop`` and ``tp > 1`` groups are priced by the per-GPU TP model
(:mod:`resihp_lightning.tensor_plan`): layers costed for one GPU, a group of k GPUs of slowest speed s
one device of speed ``1 / (1 / (k s) + f_k)`` and k GPUs' memory, the degrees the model splits into
evenly (:func:`~resihp_lightning.evaluation.profiles.tensor_cost`). ResiHP's rule keeps each TP group's
k fastest live GPUs for the allowed k maximising ``k x`` the k-th fastest speed
(:meth:`Cluster.devices`); the project's planner chooses the groups jointly with the plan
(:meth:`Cluster.solve_tensor`, :func:`~resihp_lightning.solver.tensor_search.solve_tensor`), each
TP group's GPUs one TP domain.

A network slowdown f on a node is folded into its devices' speed: their stage's point-to-point
transfers take f times longer, priced at the reference stage size (the layers' compute over
``reference_stages``); the data-parallel all-reduce runs at the slowest live node's links.
Speeds are quantized to ``speed_quantum`` as the project's controller does, so that planner devices
fall into few classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from resihp_lightning.config import PlannerConfig
from resihp_lightning.contract import DeviceConditions
from resihp_lightning.errors import InfeasibleError
from resihp_lightning.evaluation.costs import CostModel
from resihp_lightning.evaluation.profiles import GB, MB, ModelProfile, build_profile, tensor_cost
from resihp_lightning.evaluation.traces import GpuState, Trace
from resihp_lightning.plan import Device, Evaluation, Plan, Problem, Replica, evaluate
from resihp_lightning.problem_builder import problem_from_costs
from resihp_lightning.tensor_plan import TensorGroup, TensorPlan, TensorProblem, resihp_rule_groups


@dataclass(frozen=True)
class View:
    """What a policy knows and can do about devices.

    Attributes:
        speed_aware: sees fail-slow speeds (``False``: every live device is 1.0 to it).
        tp_drop: may drop a bad GPU from its TP group.
    """

    speed_aware: bool = True
    tp_drop: bool = False


class Cluster:
    """One trace, one model profile: devices, solves (cached), plan prices and migration costs.

    Args:
        trace: the trace (its GPU count must be a multiple of ``profile.workload.tp``).
        profile: the model on one planner device.
        costs: reaction costs.
        planner: the solver's options (default: the exact search, 1 s work budget: deterministic).
        speed_quantum: speeds are rounded to multiples of this.
        uneven_tp: TP groups of any degree up to ``tp`` (a runtime that splits heads unevenly, as
            ResiHP's executor does for 4 -> 3); by default only the degrees the model splits into
            evenly (:func:`~resihp_lightning.evaluation.profiles.tensor_cost`).
    """

    def __init__(self, trace: Trace, profile: ModelProfile, costs: CostModel | None = None,
                 planner: PlannerConfig | None = None, speed_quantum: float = 0.05, uneven_tp: bool = False) -> None:
        tp = profile.workload.tp
        if trace.gpus % tp:
            raise InfeasibleError(f"the trace's {trace.gpus} GPUs do not split into TP groups of {tp}")
        self.trace, self.profile = trace, profile
        self.costs = costs or CostModel()
        self.planner = planner or PlannerConfig(solver="exact", time_limit_s=1.0)
        self.quantum = speed_quantum
        self.tp = tp
        self.num_devices = trace.gpus // tp
        self.micro_batches = profile.micro_batches(self.num_devices)
        self.tokens_per_iteration = self.micro_batches * profile.tokens_per_micro_batch
        compute = sum(layer.compute_ms for layer in profile.layers)
        self._stage_ms = compute / profile.reference_stages
        self._layer_mb = [layer.static_mb for layer in profile.layers]
        self._solves: dict[tuple, Plan | None] = {}
        self._tensor_solves: dict[tuple, TensorPlan | None] = {}
        self.solve_count = 0
        if tp > 1:
            # The per-GPU TP model: one-GPU layers, the degrees the model splits into (up to tp).
            one_gpu = replace(profile.workload, tp=1)
            self.gpu_layers = build_profile(profile.model, one_gpu, profile.hardware, profile.reference_stages * tp).layers
            self.tensor_cost = tensor_cost(profile.model, one_gpu, profile.hardware, max_degree=tp, uneven=uneven_tp)

    # --------------------------------------------------------------------------------- devices
    def devices(self, state: GpuState, view: View, exclude: frozenset[int] = frozenset()) -> tuple[Device, ...]:
        """The live planner devices under ``view``, minus ``exclude``, ascending ids."""
        if view.tp_drop and self.tp > 1:
            return self._rule_devices(state, view, exclude)
        cap = self.profile.device_memory_mb
        out = []
        for d in range(self.num_devices):
            if d in exclude:
                continue
            gpus = range(d * self.tp, (d + 1) * self.tp)
            live = sorted((state.speed[g] if view.speed_aware else 1.0 for g in gpus if state.alive[g]), reverse=True)
            if len(live) < self.tp:
                continue
            speed, memory = live[-1], cap
            if view.speed_aware:
                f = state.comm[state.node_of(d * self.tp)]
                speed *= self._stage_ms / (self._stage_ms + (f - 1.0) * self.profile.p2p_ms)
                speed = max(self.quantum, round(speed / self.quantum) * self.quantum)
            out.append(Device(d, round(speed, 6), memory))
        return tuple(out)

    def _rule_devices(self, state: GpuState, view: View, exclude: frozenset[int]) -> tuple[Device, ...]:
        """TP groups under ResiHP's rule, priced by the per-GPU TP model (ids: group indices).

        Each TP group keeps the group :func:`~resihp_lightning.tensor_plan.resihp_rule_groups` forms in
        its domain: its k fastest live GPUs for the allowed k maximising k times the k-th fastest
        speed; the device is that group's (:meth:`TensorProblem.group_device
        <resihp_lightning.tensor_plan.TensorProblem.group_device>`).
        """
        problem = self.tensor_problem(state, view)
        kept = self.rule_groups(state, view)
        out = []
        for d in range(self.num_devices):
            if d in exclude or d not in kept:
                continue
            device = problem.group_device(kept[d])
            out.append(Device(d, device.speed, device.memory_mb))
        return tuple(out)

    def gpu_speeds(self, state: GpuState, view: View) -> dict[int, float]:
        """Live GPUs' speeds as ``view`` sees them: the node's network slowdown folded in (its stage's
        transfers at the reference stage size), quantized to the controller's ``speed_quantum``."""
        out = {}
        for g in range(self.trace.gpus):
            if not state.alive[g]:
                continue
            speed = state.speed[g] if view.speed_aware else 1.0
            if view.speed_aware:
                f = state.comm[state.node_of(g)]
                speed *= self._stage_ms / (self._stage_ms + (f - 1.0) * self.profile.p2p_ms)
                speed = max(self.quantum, round(speed / self.quantum) * self.quantum)
            out[g] = round(speed, 6)
        return out

    def tensor_problem(self, state: GpuState, view: View, *, shared: bool = True) -> TensorProblem:
        """The per-GPU TP problem of the live GPUs (tp > 1): one-GPU layers, every TP group's GPUs one
        domain, the group profile's transfers (so that a whole group costs what the profile says)."""
        memory = self.profile.hardware.memory_gb * GB / MB
        speeds = self.gpu_speeds(state, view)
        problem = Problem(self.gpu_layers, tuple(Device(g, s, memory) for g, s in speeds.items()), self.micro_batches,
                          p2p_ms=self.profile.p2p_ms, allreduce_ms=self.allreduce_ms(state),
                          shared_partition=shared, allow_exclude=True)
        domains = tuple(tuple(range(d * self.tp, (d + 1) * self.tp)) for d in range(self.num_devices))
        return TensorProblem(problem, domains, self.tensor_cost)

    def solve_tensor(self, state: GpuState, view: View, *, shared: bool = True) -> TensorPlan | None:
        """The planner's best groups and plan for the GPUs now (``None`` when nothing fits), cached.

        TP domains of equal live GPUs (speeds in domain order) are interchangeable, so the cache is
        keyed by their sorted multiset; a cached plan is relabelled onto the actual GPUs.
        """
        from resihp_lightning.solver.tensor_search import solve_tensor

        speeds = self.gpu_speeds(state, view)
        signature = [tuple(speeds.get(g) for g in range(d * self.tp, (d + 1) * self.tp)) for d in range(self.num_devices)]
        order = sorted(range(self.num_devices), key=lambda d: (tuple(-1.0 if s is None else -s for s in signature[d]), d))
        key = (tuple(signature[d] for d in order), shared, self.allreduce_ms(state))
        if key not in self._tensor_solves:
            # The canonical problem: the domains in sorted order, the i-th on GPUs i * tp .. i * tp + tp - 1.
            gpus = tuple(Device(i * self.tp + j, s, self.profile.hardware.memory_gb * GB / MB)
                         for i, d in enumerate(order) for j, s in enumerate(signature[d]) if s is not None)
            actual = self.tensor_problem(state, view, shared=shared)
            canonical = TensorProblem(replace(actual.problem, devices=gpus), actual.domains, actual.cost)
            self.solve_count += 1
            try:
                self._tensor_solves[key] = solve_tensor(canonical, self.planner)
            except InfeasibleError:
                self._tensor_solves[key] = None
        found = self._tensor_solves[key]
        if found is None:
            return None
        rename = {i * self.tp + j: d * self.tp + j for i, d in enumerate(order) for j in range(self.tp)}
        groups = tuple(TensorGroup(tuple(sorted(rename[g] for g in group.members))) for group in found.groups)
        ids = {group.id: new.id for group, new in zip(found.groups, groups)}
        plan = Plan(tuple(Replica(tuple(ids[i] for i in r.devices), r.bounds, r.micro_batches) for r in found.plan.replicas),
                    iteration_ms=found.plan.iteration_ms, status=found.plan.status, solver=found.plan.solver,
                    solve_seconds=found.plan.solve_seconds, gap=found.plan.gap)
        return TensorPlan(groups, plan, found.search)

    def tensor_iteration_ms(self, tensor_plan: TensorPlan, state: GpuState) -> float:
        """T of a plan over TP groups on the cluster now, at the real speeds (``inf`` when a member of a
        group it uses is lost)."""
        problem = self.tensor_problem(state, View(speed_aware=True, tp_drop=True), shared=False)
        alive = {d.id for d in problem.problem.devices}
        used = tensor_plan.used_groups
        if any(g not in alive for group in used for g in group.members):
            return math.inf
        devices = tuple(sorted((problem.group_device(g) for g in used), key=lambda d: d.id))
        return evaluate(replace(problem.problem, devices=devices), tensor_plan.plan, check=False).iteration_ms

    def holdings(self, plan: Plan, groups: tuple[TensorGroup, ...] | None = None) -> list[tuple[tuple[int, ...], range]]:
        """(GPUs, layers) of every stage of a plan: its devices are TP ``groups`` (by id), or, without
        them, group indices standing for all ``tp`` GPUs of the group."""
        members = {g.id: g.members for g in groups} if groups is not None else None
        out = []
        for r in plan.replicas:
            for j, d in enumerate(r.devices):
                gpus = members[d] if members is not None else tuple(range(d * self.tp, (d + 1) * self.tp))
                out.append((gpus, range(r.bounds[j], r.bounds[j + 1])))
        return out

    def gpu_migration_s(self, old: list[tuple[tuple[int, ...], range]], new: list[tuple[tuple[int, ...], range]],
                        shared: bool) -> float:
        """Pause to switch between plans over TP groups (:meth:`holdings`): engine rebuild plus the
        busiest GPU's receiving time.

        A GPU of a new group of k holds 1/k of each of its layers' state. When its old group (of k')
        held the layer, it has 1/k' already and the rest of its share comes from that group's GPUs,
        in its own TP domain, over NVLink (a re-cut to another degree); otherwise the whole share
        comes over its own network link.
        """
        had: dict[int, dict[int, float]] = {}
        for gpus, layers in old:
            for g in gpus:
                for layer in layers:
                    had.setdefault(g, {})[layer] = 1.0 / len(gpus)
        hw = self.profile.hardware
        nvlink = hw.nvlink_gbps * GB * hw.link_efficiency
        network = hw.network_gbps * GB * hw.link_efficiency
        busiest = 0.0
        for gpus, layers in new:
            share = 1.0 / len(gpus)
            for g in gpus:
                mine = had.get(g, {})
                local = sum(self._layer_mb[layer] * max(0.0, share - mine[layer]) for layer in layers if layer in mine)
                remote = sum(self._layer_mb[layer] * share for layer in layers if layer not in mine)
                busiest = max(busiest, local * MB / nvlink + remote * MB / network)
        rebuild = self.costs.rebuild_shared_s if shared else self.costs.rebuild_per_replica_s
        return rebuild + busiest

    def rule_groups(self, state: GpuState, view: View) -> dict[int, TensorGroup]:
        """The group ResiHP's rule keeps in each TP group (by group index), as :meth:`devices` prices them."""
        problem = self.tensor_problem(state, view)
        return {problem.domain_of(g.id): g for g in resihp_rule_groups(problem, self.tp)}

    def alive(self, state: GpuState, device: int) -> bool:
        """All of the device's GPUs are alive."""
        return all(state.alive[g] for g in range(device * self.tp, (device + 1) * self.tp))

    def allreduce_ms(self, state: GpuState) -> float:
        """The all-reduce at the slowest network link among nodes with a live GPU (physics, not view)."""
        per_node = state.gpus_per_node
        factor = max((f for n, f in enumerate(state.comm) if any(state.alive[n * per_node:(n + 1) * per_node])), default=1.0)
        return self.profile.allreduce_ms * factor

    def problem(self, devices: tuple[Device, ...], state: GpuState, view: View, *, shared: bool = True,
                pipeline_degrees: tuple[int, ...] | None = None) -> Problem:
        """The planning problem on ``devices`` (from :meth:`devices`), built as the live job builds its own
        (:func:`~resihp_lightning.problem_builder.problem_from_costs`) from the model profile's layers."""
        conditions = DeviceConditions(speeds={d.id: d.speed for d in devices}, p2p_ms=self.profile.p2p_ms,
                                      allreduce_ms=self.allreduce_ms(state))
        rules = None if pipeline_degrees is None else PlannerConfig(pipeline_degrees=pipeline_degrees)
        layers = self.gpu_layers if view.tp_drop and self.tp > 1 else self.profile.layers  # devices priced per GPU
        return problem_from_costs(layers, [d.id for d in devices], self.micro_batches,
                                  conditions=conditions, memory_mb={d.id: d.memory_mb for d in devices},
                                  per_replica_bounds=not shared, allow_exclude=True, planner=rules)

    # ---------------------------------------------------------------------------------- solves
    def solve(self, devices: tuple[Device, ...], state: GpuState, view: View, *, shared: bool = True,
              pipeline_degrees: tuple[int, ...] | None = None) -> Plan | None:
        """The planner's best plan on ``devices`` (``None`` when nothing fits), cached per device state.

        Devices of equal (speed, memory) are interchangeable for the planner, so the cache is keyed
        by the sorted multiset of classes and the plan is relabelled onto the actual ids.
        """
        from resihp_lightning.solver import solve

        if not devices:
            return None
        order = sorted(devices, key=lambda d: (-d.speed, -d.memory_mb, d.id))
        allreduce = self.allreduce_ms(state)
        key = (tuple((d.speed, d.memory_mb) for d in order), shared, pipeline_degrees, allreduce)
        if key not in self._solves:
            canonical = tuple(replace(d, id=i) for i, d in enumerate(order))
            problem = self.problem(canonical, state, view, shared=shared, pipeline_degrees=pipeline_degrees)
            self.solve_count += 1
            try:
                self._solves[key] = solve(problem, self.planner)
            except InfeasibleError:
                self._solves[key] = None
        plan = self._solves[key]
        if plan is None:
            return None
        ids = [d.id for d in order]
        return Plan(tuple(Replica(tuple(ids[i] for i in r.devices), r.bounds, r.micro_batches) for r in plan.replicas),
                    status=plan.status, solver=plan.solver, gap=plan.gap)

    # ---------------------------------------------------------------------------------- prices
    def evaluate(self, plan: Plan, state: GpuState, view: View) -> Evaluation | None:
        """``plan`` priced at the real speeds (``None`` when one of its devices is lost)."""
        view = View(speed_aware=True, tp_drop=view.tp_drop)
        index = {d.id: d for d in self.devices(state, view)}
        try:
            devices = tuple(index[d] for d in plan.device_ids)
        except KeyError:
            return None
        return evaluate(self.problem(devices, state, view, shared=False), plan, check=False)

    def iteration_ms(self, plan: Plan, state: GpuState, view: View) -> float:
        """T of ``plan`` on the cluster now at the real speeds (``inf`` when one of its devices is lost)."""
        evaluation = self.evaluate(plan, state, view)
        return math.inf if evaluation is None else evaluation.iteration_ms

    @property
    def model_mb(self) -> float:
        """Static state of the whole model, MB."""
        return sum(self._layer_mb)

    def moved_mb(self, old: Plan | None, new: Plan) -> tuple[float, float]:
        """(total MB, most MB any one device receives) to turn ``old`` into ``new``."""
        held: dict[int, range] = {}
        if old is not None:
            for r in old.replicas:
                for j, d in enumerate(r.devices):
                    held[d] = range(r.bounds[j], r.bounds[j + 1])
        total, worst = 0.0, 0.0
        for r in new.replicas:
            for j, d in enumerate(r.devices):
                have = held.get(d, range(0))
                mb = sum(self._layer_mb[layer] for layer in range(r.bounds[j], r.bounds[j + 1]) if layer not in have)
                total += mb
                worst = max(worst, mb)
        return total, worst

    def transfer_s(self, megabytes: float) -> float:
        """Seconds to receive ``megabytes`` on one device (its ``tp`` network links)."""
        hw = self.profile.hardware
        return megabytes * MB / (hw.network_gbps * GB * hw.link_efficiency * self.tp)

    def migration_s(self, old: Plan | None, new: Plan) -> float:
        """Pause to switch plans: engine rebuild plus the busiest receiver's bytes over its links."""
        shared = new.shared_bounds and (old is None or old.shared_bounds)
        rebuild = self.costs.rebuild_shared_s if shared else self.costs.rebuild_per_replica_s
        return rebuild + self.transfer_s(self.moved_mb(old, new)[1])

    def restart_s(self, plan: Plan) -> float:
        """Restart cost of a job that will run ``plan`` (its biggest stage's state is read per GPU)."""
        _, worst = self.moved_mb(None, plan)
        return self.costs.restart(self.trace.gpus, worst / self.tp * MB / GB)

    def planning_s(self, plan: Plan | None) -> float:
        return self.costs.planning(self.num_devices, plan is not None and plan.status == "optimal")
