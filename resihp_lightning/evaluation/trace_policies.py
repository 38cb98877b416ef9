"""How each system reacts to a failure, as phases of a replay (docs/evaluation.md, "Policies").

Every policy starts from the same healthy plan (the planner's best shared plan on all devices) and
pays its own detection, planning, migration or restart costs (:class:`~.costs.CostModel`):

* ``none``: never adapts; a fail-stop kills the job, which restarts on the live GPUs with the same
  pipeline degree from its last checkpoint.
* ``checkpoint_restart``: restarts from the last checkpoint without the failed devices: at a
  fail-stop, and when a step-time alarm (1.25 x the healthy iteration) fires, without the slow ones
  too. Devices come back only with the next restart.
* ``oobleck``: pre-computed templates per node count: a failed GPU takes its node out, the layout is
  the best one for the whole nodes left (speed-blind), state is copied from surviving replicas; a
  repaired node is taken back. Fail-slow is not its concern.
* ``recycle``: keeps the layout; a dead device's micro-batches go to its stage's peers in the other
  replicas, free while they fit in that stage's 1F1B bubbles (P - 1 slots per iteration). A stage
  lost in every replica means a restart.
* ``greyhound``: fail-stop by checkpoint-restart; fail-slow by ski-rental escalation after a
  change-point detector: re-split the micro-batches over the replicas, then change the topology
  (drop the slow devices), each level once the time lost waiting equals its cost.
* ``resihp_rules``: ResiHP's rules: drop a bad GPU from its TP group, replace a dead device with a
  spare or dissolve its replica, then one uniform repartition for every replica and micro-batch
  migration between replicas (:func:`~resihp_lightning.solver.baseline_policies.repartition_only`, then
  :func:`~resihp_lightning.solver.baseline_policies.microbatch_only`).
* ``joint_shared`` / ``joint_per_replica``: this project: in-process recovery from fail-stops, the
  detector for fail-slow, the planner's joint plan (spares allowed) with one partition or one per
  replica, applied when the controller's rule says it pays. With TP (``tp > 1``) the plan is over
  GPUs: the planner also chooses which GPUs of each TP group form groups of which degree
  (:meth:`~.cluster.Cluster.solve_tensor`: TP-drop, and any grouping ResiHP's rule can form).
* ``oracle``: instant detection, free migration, no lost work; at each change the best layout any
  mechanism above can reach (both joint plans, ReCycle's re-routing on the healthy plan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from resihp_lightning.errors import InfeasibleError
from resihp_lightning.evaluation.cluster import Cluster, View
from resihp_lightning.evaluation.replay import Layout, Phase, PlanLayout
from resihp_lightning.evaluation.traces import GpuState
from resihp_lightning.plan import Plan, Problem, Replica, even_split, evaluate
from resihp_lightning.solver import baseline_policies as one_moment
from resihp_lightning.tensor_plan import TensorGroup, TensorPlan

INF = math.inf
BLIND = View(speed_aware=False, tp_drop=False)
AWARE = View(speed_aware=True, tp_drop=False)
AWARE_TP = View(speed_aware=True, tp_drop=True)


def healthy_state(cluster: Cluster) -> GpuState:
    trace = cluster.trace
    return GpuState((1.0,) * trace.gpus, (True,) * trace.gpus, (1.0,) * trace.nodes, trace.gpus_per_node)


def _keep(layout: Layout) -> list[Phase]:
    return [Phase(INF, layout)]


class _Base:
    """Shared start: the planner's best shared plan on the healthy cluster."""

    name = ""
    view = AWARE

    def start(self, cluster: Cluster) -> Layout:
        state = healthy_state(cluster)
        plan = cluster.solve(cluster.devices(state, BLIND), state, BLIND)
        if plan is None:
            raise InfeasibleError(f"{cluster.profile.model.name} does not fit on {cluster.num_devices} devices")
        self.healthy = plan
        self.healthy_ms = cluster.iteration_ms(plan, state, self.view)
        self.last_state = state
        return PlanLayout(plan, self.view)

    def _restart_plan(self, cluster: Cluster, state: GpuState, exclude: frozenset[int] = frozenset()) -> Plan | None:
        """A stock relaunch: speed-blind, the healthy pipeline degree if it still fits, else any."""
        devices = cluster.devices(state, BLIND, exclude)
        plan = cluster.solve(devices, state, BLIND, pipeline_degrees=(self.healthy.pipeline_degree,))
        return plan or cluster.solve(devices, state, BLIND)

    def _restart(self, cluster: Cluster, state: GpuState, exclude: frozenset[int] = frozenset(),
                 before: list[Phase] | None = None) -> list[Phase]:
        plan = self._restart_plan(cluster, state, exclude)
        if plan is None:
            raise InfeasibleError(f"{self.name}: nothing fits on the devices left")
        layout = PlanLayout(plan, self.view)
        return (before or []) + [Phase(cluster.restart_s(plan), layout, running=False, label="restart", restart=True),
                                 Phase(INF, layout)]


class NoAdaptation(_Base):
    name = "none"

    def react(self, cluster, t, state, in_force):
        if math.isfinite(in_force.iteration_ms(cluster, state)):
            return _keep(in_force)
        return self._restart(cluster, state)


class CheckpointRestart(_Base):
    name = "checkpoint_restart"
    alarm = 1.25  # step-time alarm: iteration time over this multiple of the healthy one

    def react(self, cluster, t, state, in_force):
        ms = in_force.iteration_ms(cluster, state)
        slow = frozenset(d.id for d in cluster.devices(state, AWARE) if d.speed < 1.0)
        if not math.isfinite(ms):
            return self._restart(cluster, state, slow)
        # The alarm compares with the same plan at full speed (the job's own normal step time).
        if slow and ms > self.alarm * in_force.iteration_ms(cluster, healthy_state(cluster)):
            detect = Phase(cluster.costs.slow_detect_iters * ms / 1000.0, in_force, label="detect")
            return self._restart(cluster, state, slow, before=[detect])
        return _keep(in_force)


class Oobleck(_Base):
    name = "oobleck"
    view = AWARE

    def react(self, cluster, t, state, in_force):
        per_node = max(1, state.gpus_per_node // cluster.tp)
        dead_nodes = {d // per_node for d in range(cluster.num_devices) if not cluster.alive(state, d)}
        exclude = frozenset(d for d in range(cluster.num_devices) if d // per_node in dead_nodes)
        devices = cluster.devices(state, BLIND, exclude)
        target = cluster.solve(devices, state, BLIND)
        lost = not math.isfinite(in_force.iteration_ms(cluster, state))
        if target is None:  # no template fits the whole nodes left: restart on the live GPUs instead of stopping
            return self._restart(cluster, state) if lost else _keep(in_force)
        if target.layout_key() == in_force.plan.layout_key() or (not lost and len(target.device_ids) <= len(in_force.plan.device_ids)):
            return _keep(in_force)
        layout = PlanLayout(target, self.view)
        costs = cluster.costs
        pause = cluster.migration_s(in_force.plan, target) + costs.regroup(cluster.trace.gpus)
        if lost:
            pause += costs.stop_detect_s
        return [Phase(pause, layout, running=False, label="reconfigure", lose_partial=lost), Phase(INF, layout)]


@dataclass(frozen=True)
class RecycleLayout:
    """A plan whose dead devices' micro-batches are re-routed to their stage's peers.

    Attributes:
        plan: the plan the job was started with.
        view: how devices are priced.
    """

    plan: Plan
    view: View = AWARE

    def iteration_ms(self, cluster: Cluster, state: GpuState) -> float:
        dead = {d for d in self.plan.device_ids if not cluster.alive(state, d)}
        if not dead:
            return cluster.iteration_ms(self.plan, state, self.view)
        p, d_count = self.plan.pipeline_degree, self.plan.data_degree
        # Price the plan with the dead devices' own work done (at healthy speed) by someone else...
        gpus = {g for d in dead for g in range(d * cluster.tp, (d + 1) * cluster.tp)}
        revived = GpuState(tuple(1.0 if g in gpus else s for g, s in enumerate(state.speed)),
                           tuple(True if g in gpus else a for g, a in enumerate(state.alive)), state.comm, state.gpus_per_node)
        evaluation = cluster.evaluate(self.plan, revived, self.view)
        # ...then charge each stage's peers the extra micro-batches beyond their P - 1 bubble slots.
        extra_ms = 0.0
        for j in range(p):
            lost = [r for r, rep in enumerate(self.plan.replicas) if rep.devices[j] in dead]
            if len(lost) == d_count:
                return INF
            if not lost:
                continue
            moved = sum(self.plan.replicas[r].micro_batches for r in lost)
            per_peer = math.ceil(moved / (d_count - len(lost)))
            stage_ms = max(evaluation.stage_ms[r][j] for r in range(d_count) if r not in lost)
            extra_ms = max(extra_ms, max(0, per_peer - (p - 1)) * stage_ms)
        return evaluation.iteration_ms + extra_ms


class ReCycle(_Base):
    name = "recycle"

    def start(self, cluster):
        layout = super().start(cluster)
        return RecycleLayout(layout.plan, self.view)

    def react(self, cluster, t, state, in_force):
        if not isinstance(in_force, RecycleLayout):
            in_force = RecycleLayout(in_force.plan, self.view)
        if not math.isfinite(in_force.iteration_ms(cluster, state)):
            phases = self._restart(cluster, state)
            self.last_state = state
            return [Phase(p.seconds, RecycleLayout(p.layout.plan, self.view), p.running, p.label, p.lose_partial, p.restart)
                    for p in phases]
        before = {d for d in in_force.plan.device_ids if not cluster.alive(self.last_state, d)}
        now = {d for d in in_force.plan.device_ids if not cluster.alive(state, d)}
        self.last_state = state
        costs = cluster.costs
        if now - before:  # re-route: detect, regroup; no state moves
            return [Phase(costs.stop_detect_s + costs.regroup(cluster.trace.gpus), in_force, running=False,
                          label="reroute", lose_partial=True), Phase(INF, in_force)]
        if before - now:  # a repaired device takes its stage back from a peer
            mb = cluster.model_mb / in_force.plan.pipeline_degree
            return [Phase(costs.regroup(cluster.trace.gpus) + cluster.transfer_s(mb), in_force, running=False, label="rejoin"),
                    Phase(INF, in_force)]
        return _keep(in_force)


class Greyhound(_Base):
    name = "greyhound"

    def react(self, cluster, t, state, in_force):
        costs = cluster.costs
        ms = in_force.iteration_ms(cluster, state)
        slow = frozenset(d.id for d in cluster.devices(state, AWARE) if d.speed < 1.0)
        if not math.isfinite(ms):
            phases = self._restart(cluster, state, slow)
            self.topology = phases[-1].layout.plan
            return phases
        topology = getattr(self, "topology", self.healthy)
        # Level 0/1: the topology's own split, or the best re-split of it; level 2: drop the slow devices.
        options: list[tuple[float, float, Plan]] = []
        problem = self._problem(cluster, state, topology)
        if problem is not None:
            options.append((costs.greyhound_resplit_s, evaluate(problem, Plan(topology.replicas)).iteration_ms, topology))
            try:
                split = one_moment.microbatch_only(problem, topology)
                options.append((costs.greyhound_resplit_s, split.iteration_ms, Plan(split.replicas)))
            except InfeasibleError:
                pass
        dropped = cluster.solve(cluster.devices(state, BLIND, slow), state, BLIND)
        if dropped is not None:
            options.append((costs.greyhound_topology_s, cluster.iteration_ms(dropped, state, self.view), dropped))
        phases: list[Phase] = []
        current, current_ms, at = in_force, ms, costs.greyhound_detect_iters * ms / 1000.0
        # Escalate: cheapest level first; each when the time lost (vs that level) reaches its cost.
        for cost, option_ms, plan in sorted(options, key=lambda o: (o[0], o[1])):
            if plan.layout_key() == current.plan.layout_key() or option_ms >= current_ms * (1 - 1e-9):
                continue
            wait = max(at, cost / (1.0 - option_ms / current_ms))
            target = PlanLayout(plan, self.view)
            phases += [Phase(wait, current, label="detect" if not phases else "run"),
                       Phase(cost, target, running=False, label="resplit" if cost == costs.greyhound_resplit_s else "topology")]
            current, current_ms, at = target, option_ms, 0.0
            if plan is dropped:
                self.topology = dropped
        return phases + [Phase(INF, current)]

    def _problem(self, cluster: Cluster, state: GpuState, plan: Plan) -> Problem | None:
        index = {d.id: d for d in cluster.devices(state, AWARE)}
        if any(d not in index for d in plan.device_ids):
            return None
        return cluster.problem(tuple(index[d] for d in plan.device_ids), state, AWARE, shared=True)


class ResiHPRules(_Base):
    name = "resihp_rules"
    view = AWARE_TP

    def react(self, cluster, t, state, in_force):
        costs = cluster.costs
        ms = in_force.iteration_ms(cluster, state)
        lost = not math.isfinite(ms)
        index = {d.id: d for d in cluster.devices(state, self.view)}
        plan = in_force.plan
        p = plan.pipeline_degree
        spares = sorted((d for d in index if d not in plan.device_ids), key=lambda d: (-index[d].speed, d))
        replicas = []
        for r in plan.replicas:
            devices = list(r.devices)
            for j, d in enumerate(devices):
                if d not in index and spares:
                    devices[j] = spares.pop(0)
            if all(d in index for d in devices):
                replicas.append(devices)
            else:
                spares += [d for d in devices if d in index]
        spares.sort(key=lambda d: (-index[d].speed, d))
        while len(spares) >= p:
            replicas.append(spares[:p])
            spares = spares[p:]
        if not replicas:
            return self._restart(cluster, state)
        bounds = plan.replicas[0].bounds
        counts = even_split(cluster.micro_batches, len(replicas))
        candidate = Plan(tuple(Replica(tuple(devs), bounds, m) for devs, m in zip(replicas, counts)))
        problem = cluster.problem(tuple(index[d] for d in candidate.device_ids), state, self.view, shared=True)
        for rule in (one_moment.repartition_only, one_moment.microbatch_only):
            try:
                candidate = Plan(rule(problem, candidate).replicas)
            except InfeasibleError:
                pass
        new_ms = evaluate(problem, candidate, check=False).iteration_ms
        target = PlanLayout(candidate, self.view)
        if cluster.tp > 1:  # the members each TP group keeps, before and now: re-cuts and moves per GPU
            before, now = cluster.rule_groups(self.last_state, self.view), cluster.rule_groups(state, self.view)
            old_groups = tuple(before[d] if d in before else TensorGroup(tuple(range(d * cluster.tp, (d + 1) * cluster.tp)))
                               for d in plan.device_ids)
            migrate = cluster.gpu_migration_s(_by_index(cluster, plan, old_groups), _by_index(cluster, candidate, tuple(
                now[d] for d in candidate.device_ids)), candidate.shared_bounds and plan.shared_bounds)
        else:
            migrate = cluster.migration_s(plan, candidate)
        detect = _detect_s(costs, self.last_state, state, ms, cluster)
        self.last_state = state
        if lost:
            pause = costs.stop_detect_s + costs.regroup(cluster.trace.gpus) + migrate
            return [Phase(pause, target, running=False, label="recover", lose_partial=True), Phase(INF, target)]
        if candidate.layout_key() == plan.layout_key() or not _pays(costs, ms, new_ms, migrate):
            return _keep(in_force)
        return [Phase(detect, in_force, label="detect"), Phase(migrate, target, running=False, label="migrate"), Phase(INF, target)]


@dataclass(frozen=True)
class TensorLayout:
    """A plan over TP groups the planner chose (:meth:`~.cluster.Cluster.solve_tensor`), priced per GPU.

    Attributes:
        tensor_plan: the groups and the plan over their ids.
    """

    tensor_plan: TensorPlan

    @property
    def plan(self) -> Plan:
        return self.tensor_plan.plan

    def iteration_ms(self, cluster: Cluster, state: GpuState) -> float:
        return cluster.tensor_iteration_ms(self.tensor_plan, state)


def healthy_tensor_layout(cluster: Cluster, plan: Plan) -> TensorLayout:
    """A plan over whole TP groups (ids: group indices) as a plan over groups of GPUs (ids: first members)."""
    tp = cluster.tp
    groups = tuple(TensorGroup(tuple(range(d * tp, (d + 1) * tp))) for d in range(cluster.num_devices))
    replicas = tuple(Replica(tuple(d * tp for d in r.devices), r.bounds, r.micro_batches) for r in plan.replicas)
    return TensorLayout(TensorPlan(groups, Plan(replicas, status=plan.status, solver=plan.solver, gap=plan.gap)))


def _holdings(cluster: Cluster, layout) -> list:
    """(GPUs, layers) of every stage of a layout (:meth:`~.cluster.Cluster.holdings`)."""
    if isinstance(layout, TensorLayout):
        return cluster.holdings(layout.plan, layout.tensor_plan.groups)
    return cluster.holdings(layout.plan)


def _by_index(cluster: Cluster, plan: Plan, groups: tuple[TensorGroup, ...]) -> list:
    """(GPUs, layers) of a plan over TP group indices whose devices are these groups, in plan order."""
    members = dict(zip(plan.device_ids, (g.members for g in groups)))
    return [(members[d], range(r.bounds[j], r.bounds[j + 1])) for r in plan.replicas for j, d in enumerate(r.devices)]


def _same_layout(a, b) -> bool:
    groups = (lambda layout: layout.tensor_plan.groups if isinstance(layout, TensorLayout) else None)
    return a.plan.layout_key() == b.plan.layout_key() and groups(a) == groups(b)


class Joint(_Base):
    """This project: detector + planner (shared or per-replica partitions) + live migration; with TP,
    the planner chooses the TP groups too."""

    view = AWARE_TP

    def __init__(self, shared: bool) -> None:
        self.shared = shared
        self.name = "joint_shared" if shared else "joint_per_replica"

    def start(self, cluster):
        layout = super().start(cluster)
        return healthy_tensor_layout(cluster, layout.plan) if cluster.tp > 1 else layout

    def _plan(self, cluster: Cluster, state: GpuState):
        """The planner's layout for the cluster now (None when nothing fits)."""
        if cluster.tp > 1:
            found = cluster.solve_tensor(state, self.view, shared=self.shared)
            return None if found is None else TensorLayout(found)
        plan = cluster.solve(cluster.devices(state, self.view), state, self.view, shared=self.shared)
        return None if plan is None else PlanLayout(plan, self.view)

    def _migration_s(self, cluster: Cluster, old, new) -> float:
        if isinstance(new, TensorLayout):
            shared = new.plan.shared_bounds and old.plan.shared_bounds
            return cluster.gpu_migration_s(_holdings(cluster, old), _holdings(cluster, new), shared)
        return cluster.migration_s(old.plan, new.plan)

    def react(self, cluster, t, state, in_force):
        costs = cluster.costs
        ms = in_force.iteration_ms(cluster, state)
        target = self._plan(cluster, state)
        detect = _detect_s(costs, self.last_state, state, ms, cluster)
        self.last_state = state
        if target is None:
            return _keep(in_force) if math.isfinite(ms) else self._restart(cluster, state)
        new = target.plan
        migrate = self._migration_s(cluster, in_force, target)
        if not math.isfinite(ms):  # in-process recovery: the survivors plan and restore at once
            pause = costs.stop_detect_s + costs.regroup(cluster.trace.gpus) + cluster.planning_s(new) + migrate
            return [Phase(pause, target, running=False, label="recover", lose_partial=True), Phase(INF, target)]
        new_ms = target.iteration_ms(cluster, state)
        if _same_layout(target, in_force) or not _pays(costs, ms, new_ms, migrate):
            return _keep(in_force)
        # Training goes on while the detector confirms and the planner solves in the background.
        wait = detect + cluster.planning_s(new)
        return [Phase(wait, in_force, label="detect"), Phase(migrate, target, running=False, label="migrate"),
                Phase(INF, target)]


class Oracle(_Base):
    name = "oracle"
    view = AWARE_TP

    def start(self, cluster):
        layout = super().start(cluster)
        self.recycle = (RecycleLayout(layout.plan, self.view), RecycleLayout(layout.plan, AWARE))
        return layout

    def react(self, cluster, t, state, in_force):
        candidates: list[Layout] = [*self.recycle, in_force]
        for shared in (True, False):
            planned = Joint(shared)._plan(cluster, state)
            if planned is not None:
                candidates.append(planned)
        best = min(candidates, key=lambda c: c.iteration_ms(cluster, state))
        return _keep(best)


def _pays(costs, current_ms: float, new_ms: float, migrate_s: float) -> bool:
    """The controller's rule: a relative gain of at least ``min_relative_gain`` that repays the migration."""
    gain = current_ms - new_ms
    if gain <= 0 or gain / current_ms < costs.min_relative_gain:
        return False
    steps = costs.horizon_s / (current_ms / 1000.0)
    return gain / 1000.0 * steps > costs.payback_factor * migrate_s


def _detect_s(costs, before: GpuState, now: GpuState, ms: float, cluster: Cluster) -> float:
    """Detector latency: a slower device after ``slow_detect_iters`` iterations, a healed one after
    ``heal_detect_iters``; a device that comes back is seen at once (it joins)."""
    slower = any(a < b for a, b in zip(now.speed, before.speed)) or any(a > b for a, b in zip(now.comm, before.comm))
    if slower:
        return costs.slow_detect_iters * ms / 1000.0
    healed = any(a > b for a, b in zip(now.speed, before.speed)) or any(a < b for a, b in zip(now.comm, before.comm))
    return costs.heal_detect_iters * ms / 1000.0 if healed else 0.0


#: The policies a trace is replayed under, by name (:func:`make_policy`).
POLICY_NAMES = ("none", "checkpoint_restart", "oobleck", "recycle", "greyhound", "resihp_rules",
                "joint_shared", "joint_per_replica", "oracle")


def make_policy(name: str):
    """A fresh policy by name (policies keep state: one per replay)."""
    from resihp_lightning.errors import invalid_option

    factories = {
        "none": NoAdaptation, "checkpoint_restart": CheckpointRestart, "oobleck": Oobleck, "recycle": ReCycle,
        "greyhound": Greyhound, "resihp_rules": ResiHPRules, "joint_shared": lambda: Joint(True),
        "joint_per_replica": lambda: Joint(False), "oracle": Oracle,
    }
    if name not in factories:
        raise invalid_option("policy", name, POLICY_NAMES)
    return factories[name]()
