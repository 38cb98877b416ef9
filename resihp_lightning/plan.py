"""The planning model: what a layout costs and whether it fits (docs/architecture.md, "The planning model").

A :class:`Problem` describes the model's layers, the devices as they are now (speed, network link
speed, memory) and the global batch in micro-batches. A :class:`Plan` places P pipeline stages times
D data-parallel replicas on P*D distinct devices, gives each replica contiguous stage bounds and a
micro-batch count. :func:`evaluate` prices a plan with the 1F1B formula every backend optimises::

    u(d)    = 1 / min(link_speed(d), 1)                   (link slowdown, >= 1; 1 on a healthy link)
    t[r][j] = sum(compute_ms of stage j) / speed(d)
              + p2p_ms * ( [j < P-1] * u(d) + [j > 0] * (u(d) - 1) )      with d = device (r, j)
    T_r     = sum_j t[r][j] + (m_r - 1) * max_j t[r][j]
    T       = max_r T_r + (allreduce_ms * max_{d used} u(d) if D > 1 else 0)
    memory(r, j) = sum(static_mb of stage j) + min(P - j, m_r) * sum(activation_mb of stage j)

A device pays its own sends at its link speed and the extra of its incoming transfers
(:func:`stage_p2p_ms`); a ring all-reduce runs at its slowest member's link. With every
``link_speed`` at 1.0 this is exactly the model without link speeds.

Everything here is plain Python (no torch), so the planner CLI starts fast.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from resihp_lightning.errors import PlanError, ProblemError

#: Tolerance used when comparing memory use with capacity (MB) and times (ms).
EPS = 1e-9


@dataclass(frozen=True)
class Layer:
    """One layer of the model, in model order.

    Attributes:
        compute_ms: forward + backward time of one micro-batch on a device of speed 1.0.
        static_mb: weights + gradients + optimizer state held by the owning device.
        activation_mb: memory held per in-flight micro-batch.
    """

    compute_ms: float
    static_mb: float = 0.0
    activation_mb: float = 0.0


@dataclass(frozen=True)
class Device:
    """One device as it is now.

    Attributes:
        id: the device's identity (a global rank at run time).
        speed: relative speed, > 0 (1.0 healthy, 0.5 twice as slow).
        memory_mb: memory available for the model's state and activations.
        link_speed: relative bandwidth of the device's network links, > 0 (1.0 healthy, 0.25 four
            times slower). Transfers are priced at ``1 / min(link_speed, 1)`` times their healthy
            cost: a link faster than the healthy reference is priced as healthy, since the other end
            of a transfer (or the rest of the ring) runs at the reference.
    """

    id: int
    speed: float = 1.0
    memory_mb: float = math.inf
    link_speed: float = 1.0

    @property
    def link_slowdown(self) -> float:
        """u = 1 / min(link_speed, 1): how many times longer this device's transfers take (>= 1)."""
        return link_slowdown(self.link_speed)


@dataclass(frozen=True)
class Problem:
    """A planning problem (see module docstring for the cost model).

    Attributes:
        layers: the model's layers in order.
        devices: the devices that may be used.
        micro_batches: M, micro-batches per iteration over all replicas together.
        p2p_ms: activation + gradient transfer between adjacent stages, per micro-batch.
        allreduce_ms: data-parallel gradient synchronisation, paid once per iteration when D > 1.
        pipeline_degrees: allowed pipeline degrees P; ``None`` means every P that can work
            (divisors of the device count, or every P up to it when ``allow_exclude``).
        shared_partition: all replicas use the same stage bounds (stock DeepSpeed requires it).
        allow_exclude: the plan may leave devices unused.
        min_layers_per_stage: the fewest layers a stage may hold.
        min_data_degree: the fewest replicas D a plan may have. With fail-stop recovery in process, 2
            keeps every layer on two devices, so that losing any one device loses no layer.
    """

    layers: tuple[Layer, ...]
    devices: tuple[Device, ...]
    micro_batches: int
    p2p_ms: float = 0.0
    allreduce_ms: float = 0.0
    pipeline_degrees: tuple[int, ...] | None = None
    shared_partition: bool = True
    allow_exclude: bool = False
    min_layers_per_stage: int = 1
    min_data_degree: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "devices", tuple(self.devices))
        if self.pipeline_degrees is not None:
            object.__setattr__(self, "pipeline_degrees", tuple(self.pipeline_degrees))
        self._validate()

    def _validate(self) -> None:
        if not self.layers:
            raise ProblemError("problem has no layers")
        if not self.devices:
            raise ProblemError("problem has no devices")
        for index, layer in enumerate(self.layers):
            for name in ("compute_ms", "static_mb", "activation_mb"):
                value = getattr(layer, name)
                if not _is_real(value) or value < 0 or math.isinf(value):
                    raise ProblemError(f"layers[{index}].{name} must be a finite number >= 0, got {value!r}")
        seen: set[int] = set()
        for index, device in enumerate(self.devices):
            if not isinstance(device.id, int) or isinstance(device.id, bool):
                raise ProblemError(f"devices[{index}].id must be an integer, got {device.id!r}")
            if device.id in seen:
                raise ProblemError(f"device id {device.id} appears twice in devices")
            seen.add(device.id)
            if not _is_real(device.speed) or not device.speed > 0 or math.isinf(device.speed):
                raise ProblemError(f"devices[{index}].speed must be a finite number > 0, got {device.speed!r}")
            if not _is_real(device.link_speed) or not device.link_speed > 0 or math.isinf(device.link_speed):
                raise ProblemError(
                    f"devices[{index}].link_speed must be a finite number > 0, got {device.link_speed!r}"
                )
            if not _is_real(device.memory_mb) or not device.memory_mb > 0:
                raise ProblemError(f"devices[{index}].memory_mb must be a number > 0, got {device.memory_mb!r}")
        if not isinstance(self.micro_batches, int) or isinstance(self.micro_batches, bool) or self.micro_batches < 1:
            raise ProblemError(f"micro_batches must be an integer >= 1, got {self.micro_batches!r}")
        for name in ("p2p_ms", "allreduce_ms"):
            value = getattr(self, name)
            if not _is_real(value) or value < 0 or math.isinf(value):
                raise ProblemError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("min_layers_per_stage", "min_data_degree"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ProblemError(f"{name} must be an integer >= 1, got {value!r}")
        if self.pipeline_degrees is not None:
            if not self.pipeline_degrees:
                raise ProblemError("pipeline_degrees is empty; give at least one degree or leave it out")
            for degree in self.pipeline_degrees:
                if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                    raise ProblemError(f"pipeline_degrees must hold integers >= 1, got {degree!r}")
        for name in ("shared_partition", "allow_exclude"):
            if not isinstance(getattr(self, name), bool):
                raise ProblemError(f"{name} must be true or false, got {getattr(self, name)!r}")

    # ----------------------------------------------------------------------------------- derived
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def total_speed(self) -> float:
        """S, the sum of all devices' speeds."""
        return sum(d.speed for d in self.devices)

    def device(self, device_id: int) -> Device:
        """Returns the device with this id (raises ``KeyError`` when there is none)."""
        return self._device_index()[device_id]

    def _device_index(self) -> dict[int, Device]:
        return {d.id: d for d in self.devices}

    def candidate_shapes(self) -> list[tuple[int, int]]:
        """Every (P, D) a plan may take: P allowed, P*D devices available, min_data_degree <= D <= M,
        P <= L / min layers.

        Without ``allow_exclude`` P*D must equal the device count; with it, P*D may be smaller.
        """
        n, layers, m = self.num_devices, self.num_layers, self.micro_batches
        max_p = layers // self.min_layers_per_stage
        allowed = self.pipeline_degrees if self.pipeline_degrees is not None else range(1, n + 1)
        shapes = []
        for p in sorted(set(allowed)):
            if p > max_p or p > n:
                continue
            if self.allow_exclude:
                shapes.extend((p, d) for d in range(self.min_data_degree, min(n // p, m) + 1))
            elif n % p == 0 and self.min_data_degree <= n // p <= m:
                shapes.append((p, n // p))
        return shapes

    def healthy(self) -> Problem:
        """The same problem with every device at speed 1.0 and link speed 1.0 (the reference for ideal throughput)."""
        return replace(self, devices=tuple(replace(d, speed=1.0, link_speed=1.0) for d in self.devices))

    def allreduce_for(self, device_ids: Sequence[int], data_degree: int) -> float:
        """The all-reduce of a plan using ``device_ids``: ``allreduce_ms * max u`` when D > 1, else 0."""
        if data_degree <= 1:
            return 0.0
        index = self._device_index()
        return self.allreduce_ms * max(index[i].link_slowdown for i in device_ids)

    # -------------------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layers"] = [asdict(layer) for layer in self.layers]
        data["devices"] = [_device_to_dict(d) for d in self.devices]
        data["pipeline_degrees"] = list(self.pipeline_degrees) if self.pipeline_degrees is not None else None
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Problem:
        """Builds a problem from its JSON form; unknown fields are refused by name."""
        if not isinstance(data, Mapping):
            raise ProblemError(f"a problem must be a JSON object, got {type(data).__name__}")
        _refuse_unknown(data, cls, "problem")
        for required in ("layers", "devices", "micro_batches"):
            if required not in data:
                raise ProblemError(f"problem is missing the field '{required}'")
        layers = [_from_mapping(Layer, item, f"layers[{i}]") for i, item in enumerate(_as_list(data, "layers"))]
        devices = [_from_mapping(Device, item, f"devices[{i}]") for i, item in enumerate(_as_list(data, "devices"))]
        kwargs = {k: v for k, v in data.items() if k not in ("layers", "devices")}
        return cls(layers=tuple(layers), devices=tuple(devices), **kwargs)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Problem:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ProblemError(f"problem is not valid JSON: {err}") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> Problem:
        """Reads a problem from a JSON file."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as err:
            raise ProblemError(f"cannot read problem file {str(path)!r}: {err.strerror}") from None
        return cls.from_json(text)


@dataclass(frozen=True)
class Replica:
    """One data-parallel replica of a plan.

    Attributes:
        devices: the P device ids holding stages 0..P-1, in stage order.
        bounds: P+1 layer indices 0 = b0 < b1 < ... < bP = L; stage j holds layers b_j..b_{j+1}-1.
        micro_batches: m_r >= 1, micro-batches this replica runs per iteration.
    """

    devices: tuple[int, ...]
    bounds: tuple[int, ...]
    micro_batches: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "bounds", tuple(self.bounds))

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    def stage_layers(self, stage: int) -> range:
        """The layer indices held by ``stage``."""
        return range(self.bounds[stage], self.bounds[stage + 1])


@dataclass(frozen=True)
class Plan:
    """A layout: P stages times D replicas, their bounds and micro-batch counts.

    Attributes:
        replicas: the D replicas.
        iteration_ms: T predicted by the solver that made the plan (``None`` when not computed).
        status: ``"optimal"`` only when the solver proved it; otherwise ``"feasible"`` or
            ``"heuristic"``, or ``"given"`` for a hand-written plan.
        solver: the backend that made the plan.
        solve_seconds: wall time the solver took.
        gap: the proven relative gap ``(T - bound) / T`` of a solver's plan, where bound is a proven
            lower bound on the optimum: 0.0 when ``status`` is ``"optimal"``; ``None`` when unknown
            (a hand-written plan).
    """

    replicas: tuple[Replica, ...]
    iteration_ms: float | None = None
    status: str = "given"
    solver: str = ""
    solve_seconds: float = 0.0
    gap: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", tuple(self.replicas))

    @property
    def pipeline_degree(self) -> int:
        """P, the number of stages of every replica."""
        return self.replicas[0].num_stages if self.replicas else 0

    @property
    def data_degree(self) -> int:
        """D, the number of replicas."""
        return len(self.replicas)

    @property
    def device_ids(self) -> list[int]:
        """Every device the plan uses, replica by replica, stage by stage."""
        return [device for replica in self.replicas for device in replica.devices]

    @property
    def shared_bounds(self) -> bool:
        """Whether every replica uses the same stage bounds."""
        return len({r.bounds for r in self.replicas}) <= 1

    def layout_key(self) -> tuple:
        """What makes two plans the same layout (ignores solver metadata)."""
        return tuple((r.devices, r.bounds, r.micro_batches) for r in self.replicas)

    def with_result(self, **changes: Any) -> Plan:
        """A copy with solver metadata changed (``iteration_ms``, ``status``, ``solver``, ...)."""
        return replace(self, **changes)

    @classmethod
    def uniform(
        cls,
        device_ids: Sequence[int],
        num_layers: int,
        pipeline_degree: int,
        micro_batches: int,
    ) -> Plan:
        """The textbook layout: consecutive ids per replica, layers and micro-batches split evenly.

        Args:
            device_ids: the devices, replica-major (replica r holds ids r*P .. r*P+P-1).
            num_layers: L.
            pipeline_degree: P; must divide ``len(device_ids)`` and be <= L.
            micro_batches: M, split as evenly as possible (first replicas get the remainder).
        """
        n = len(device_ids)
        if pipeline_degree < 1 or n % pipeline_degree or pipeline_degree > num_layers:
            raise PlanError(
                f"pipeline degree {pipeline_degree} must divide the {n} devices and be at most {num_layers} layers"
            )
        data_degree = n // pipeline_degree
        if micro_batches < data_degree:
            raise PlanError(f"{micro_batches} micro-batches cannot feed {data_degree} replicas (each needs >= 1)")
        bounds = even_bounds(num_layers, pipeline_degree)
        counts = even_split(micro_batches, data_degree)
        replicas = [
            Replica(tuple(device_ids[r * pipeline_degree : (r + 1) * pipeline_degree]), bounds, counts[r])
            for r in range(data_degree)
        ]
        return cls(tuple(replicas))

    # -------------------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """The JSON form documented in docs/architecture.md ("The planning model")."""
        return {
            "pipeline_degree": self.pipeline_degree,
            "data_degree": self.data_degree,
            "replicas": [
                {"devices": list(r.devices), "bounds": list(r.bounds), "micro_batches": r.micro_batches}
                for r in self.replicas
            ],
            "iteration_ms": self.iteration_ms,
            "status": self.status,
            "solver": self.solver,
            "solve_seconds": self.solve_seconds,
            "gap": self.gap,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Reads a plan from its JSON form (``pipeline_degree``/``data_degree`` are checked, not trusted)."""
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan must be a JSON object, got {type(data).__name__}")
        allowed = {"pipeline_degree", "data_degree", "replicas", "iteration_ms", "status", "solver", "solve_seconds", "gap"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise PlanError(f"unknown field '{unknown[0]}' in plan; allowed: {', '.join(sorted(allowed))}")
        if "replicas" not in data or not isinstance(data["replicas"], list):
            raise PlanError("plan needs a list 'replicas'")
        replicas = []
        for i, item in enumerate(data["replicas"]):
            if not isinstance(item, Mapping) or set(item) != {"devices", "bounds", "micro_batches"}:
                raise PlanError(f"replicas[{i}] must have exactly the fields devices, bounds, micro_batches")
            replicas.append(Replica(tuple(item["devices"]), tuple(item["bounds"]), item["micro_batches"]))
        plan = cls(
            tuple(replicas),
            iteration_ms=data.get("iteration_ms"),
            status=data.get("status", "given"),
            solver=data.get("solver", ""),
            solve_seconds=data.get("solve_seconds", 0.0),
            gap=data.get("gap"),
        )
        for name, actual in (("pipeline_degree", plan.pipeline_degree), ("data_degree", plan.data_degree)):
            if name in data and data[name] != actual:
                raise PlanError(f"plan says {name}={data[name]} but its replicas give {actual}")
        return plan

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as err:
            raise PlanError(f"plan is not valid JSON: {err}") from None


@dataclass(frozen=True)
class Evaluation:
    """What a plan costs on a problem.

    Attributes:
        iteration_ms: T.
        replica_ms: T_r per replica, without the all-reduce.
        stage_ms: t[r][j].
        memory_mb: memory used on device (r, j).
        over_memory: (replica, stage, device id, used MB, capacity MB) for every device over capacity.
    """

    iteration_ms: float
    replica_ms: tuple[float, ...]
    stage_ms: tuple[tuple[float, ...], ...]
    memory_mb: tuple[tuple[float, ...], ...]
    over_memory: tuple[tuple[int, int, int, float, float], ...] = field(default=())

    @property
    def fits_memory(self) -> bool:
        return not self.over_memory


def layout_label(pipeline_degree: int, data_degree: int, micro_batches: Sequence[int] = ()) -> str:
    """``"2x2"`` (P x D), or ``"2x2 [3,5]"`` when the replicas run different micro-batch counts."""
    label = f"{pipeline_degree}x{data_degree}"
    if len(set(micro_batches)) > 1:
        label += " [" + ",".join(str(m) for m in micro_batches) + "]"
    return label


def validate(problem: Problem, plan: Plan, *, check_memory: bool = True) -> None:
    """Checks that ``plan`` is a legal layout for ``problem``.

    Raises:
        PlanError: naming the first rule the plan breaks (devices, degrees, bounds, micro-batches,
            shared partition, exclusion or memory).
    """
    if not plan.replicas:
        raise PlanError("plan has no replicas")
    known = problem._device_index()
    p = plan.pipeline_degree
    used: set[int] = set()
    for r, replica in enumerate(plan.replicas):
        if replica.num_stages != p:
            raise PlanError(f"replica {r} has {replica.num_stages} stages, replica 0 has {p}; all must have P stages")
        for device_id in replica.devices:
            if device_id not in known:
                raise PlanError(f"replica {r} uses device {device_id!r}, which is not in the problem")
            if device_id in used:
                raise PlanError(f"device {device_id} is used twice in the plan")
            used.add(device_id)
        _check_bounds(replica.bounds, p, problem.num_layers, problem.min_layers_per_stage, f"replica {r}")
        if not isinstance(replica.micro_batches, int) or isinstance(replica.micro_batches, bool):
            raise PlanError(f"replica {r} micro_batches must be an integer, got {replica.micro_batches!r}")
        if replica.micro_batches < 1:
            raise PlanError(f"replica {r} runs {replica.micro_batches} micro-batches; each replica needs >= 1")
    total = sum(r.micro_batches for r in plan.replicas)
    if total != problem.micro_batches:
        raise PlanError(f"replicas run {total} micro-batches in all; the problem's global batch is {problem.micro_batches}")
    if plan.data_degree < problem.min_data_degree:
        raise PlanError(f"the plan has {plan.data_degree} replica(s); the problem's min_data_degree is {problem.min_data_degree}")
    if problem.pipeline_degrees is not None and p not in problem.pipeline_degrees:
        raise PlanError(f"pipeline degree {p} is not among the allowed pipeline_degrees {list(problem.pipeline_degrees)}")
    if problem.shared_partition and not plan.shared_bounds:
        raise PlanError("replicas have different stage bounds but the problem requires shared_partition")
    if not problem.allow_exclude and len(used) != problem.num_devices:
        missing = sorted(set(known) - used)
        raise PlanError(f"devices {missing} are left out but the problem does not allow_exclude")
    if check_memory:
        over = evaluate(problem, plan, check=False).over_memory
        if over:
            r, j, device_id, used_mb, cap = over[0]
            raise PlanError(
                f"device {device_id} (replica {r}, stage {j}) needs {used_mb:.1f} MB but has {cap:.1f} MB"
            )


def evaluate(problem: Problem, plan: Plan, *, check: bool = True) -> Evaluation:
    """Prices ``plan`` on ``problem`` with the 1F1B formula (module docstring) and checks memory.

    Args:
        problem: the planning problem.
        plan: the layout to price.
        check: validate the plan's structure first (memory overflows are reported, not raised).

    Returns:
        The iteration time and its parts; ``over_memory`` lists devices over capacity.
    """
    if check:
        validate(problem, plan, check_memory=False)
    devices = problem._device_index()
    p = plan.pipeline_degree
    prefix = prefix_sums(problem)
    stage_ms, memory_mb, replica_ms, over = [], [], [], []
    for r, replica in enumerate(plan.replicas):
        times, memories = [], []
        for j, device_id in enumerate(replica.devices):
            lo, hi = replica.bounds[j], replica.bounds[j + 1]
            device = devices[device_id]
            compute = prefix.compute[hi] - prefix.compute[lo]
            times.append(compute / device.speed + stage_p2p_ms(problem.p2p_ms, device.link_slowdown, j, p))
            in_flight = min(p - j, replica.micro_batches)
            used = prefix.static[hi] - prefix.static[lo] + in_flight * (prefix.activation[hi] - prefix.activation[lo])
            memories.append(used)
            if used > device.memory_mb * (1 + EPS) + EPS:
                over.append((r, j, device_id, used, device.memory_mb))
        stage_ms.append(tuple(times))
        memory_mb.append(tuple(memories))
        replica_ms.append(pipeline_ms(times, replica.micro_batches))
    # The ring runs at its slowest member's link (Problem.allreduce_for, with the index at hand).
    allreduce = problem.allreduce_ms * max(devices[i].link_slowdown for i in plan.device_ids) if plan.data_degree > 1 else 0.0
    iteration = max(replica_ms) + allreduce
    return Evaluation(iteration, tuple(replica_ms), tuple(stage_ms), tuple(memory_mb), tuple(over))


def link_slowdown(link_speed: float) -> float:
    """u = 1 / min(link_speed, 1): the factor on a device's transfers (exactly 1.0 on a healthy link)."""
    return 1.0 / link_speed if link_speed < 1.0 else 1.0


def stage_p2p_ms(p2p_ms: float, slowdown: float, stage: int, num_stages: int) -> float:
    """The transfer time stage ``stage`` of ``num_stages`` pays per micro-batch on a device of this slowdown.

    ``p2p_ms * ([j < P-1] * u + [j > 0] * (u - 1))``: its own transfer to the next stage (activations
    out, gradients in) at its link speed, plus the extra its slow link adds to the transfer from
    the previous stage. The transfer between stages j and j+1 thus costs
    ``p2p_ms * (u_j + u_{j+1} - 1)`` in all: exactly ``p2p_ms * max(u_j, u_{j+1})`` when at most
    one end is slow, more when both are. With ``u == 1`` it is ``p2p_ms`` for every stage but the
    last and ``0.0`` for the last, bit for bit. Every backend prices a stage through this function
    (or the same two terms), so they round alike.
    """
    send = p2p_ms * slowdown if stage < num_stages - 1 else 0.0
    receive = p2p_ms * (slowdown - 1.0) if stage > 0 else 0.0
    return send + receive


#: The four stage positions the transfer cost depends on: (stage, num_stages) of an only, first, last
#: and middle stage; :func:`stage_position` gives a stage's index into this table.
STAGE_POSITIONS = ((0, 1), (0, 2), (1, 2), (1, 3))


def stage_position(stage: int, num_stages: int) -> int:
    """Index into :data:`STAGE_POSITIONS`: 0 only, 1 first, 2 last, 3 middle."""
    return 2 * (stage > 0) + (stage < num_stages - 1)


def stage_p2p_by_position(p2p_ms: float, slowdown: float) -> tuple[float, ...]:
    """:func:`stage_p2p_ms` for each of :data:`STAGE_POSITIONS` (the solvers' per-class table)."""
    return tuple(stage_p2p_ms(p2p_ms, slowdown, j, p) for j, p in STAGE_POSITIONS)


def pipeline_ms(stage_ms: Sequence[float], micro_batches: int) -> float:
    """T_r of one replica: fill and drain plus (m - 1) steady-state steps of the slowest stage."""
    return sum(stage_ms) + (micro_batches - 1) * max(stage_ms)


def ideal_ms(problem: Problem, healthy_plan: Plan) -> float:
    """T_ideal = (T_h - AR) * N / S + AR: the healthy time scaled by the aggregate speed left.

    Args:
        problem: the problem as it is now (speeds < 1 for slow devices; link speeds do not enter
            the ideal: it is the healthy fleet's time scaled by the compute left).
        healthy_plan: the best plan when every device has speed 1.0 (T_h is its time on
            ``problem.healthy()``; AR counts only when that plan has D > 1).
    """
    healthy_ms = evaluate(problem.healthy(), healthy_plan).iteration_ms
    allreduce = problem.allreduce_ms if healthy_plan.data_degree > 1 else 0.0
    return (healthy_ms - allreduce) * problem.num_devices / problem.total_speed + allreduce


def efficiency(problem: Problem, healthy_plan: Plan, plan: Plan) -> float:
    """E = T_ideal / T_plan (1.0 means the plan reaches the physical limit)."""
    return ideal_ms(problem, healthy_plan) / evaluate(problem, plan).iteration_ms


@dataclass(frozen=True)
class DeviceClass:
    """Devices of equal speed, link slowdown and memory: interchangeable for the planning model.

    Attributes:
        speed: their speed.
        memory_mb: their memory.
        ids: their ids, ascending.
        link_slowdown: their u = 1 / min(link_speed, 1) (1.0 on healthy links). Devices whose link
            speeds differ but are both >= 1 are priced alike and share a class.
    """

    speed: float
    memory_mb: float
    ids: tuple[int, ...]
    link_slowdown: float = 1.0


def device_classes(problem: Problem) -> list[DeviceClass]:
    """The devices grouped by (speed, link slowdown, memory): fastest first, then faster links, then larger memory."""
    groups: dict[tuple[float, float, float], list[int]] = {}
    for device in problem.devices:
        groups.setdefault((device.speed, device.link_slowdown, device.memory_mb), []).append(device.id)
    keys = sorted(groups, key=lambda k: (-k[0], k[1], -k[2]))
    return [DeviceClass(k[0], k[2], tuple(sorted(groups[k])), k[1]) for k in keys]


def even_bounds(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Stage bounds that split ``num_layers`` as evenly as possible (earlier stages get the remainder)."""
    base, extra = divmod(num_layers, num_stages)
    bounds, at = [0], 0
    for j in range(num_stages):
        at += base + (1 if j < extra else 0)
        bounds.append(at)
    return tuple(bounds)


def even_split(total: int, parts: int) -> tuple[int, ...]:
    """``total`` split into ``parts`` integers differing by at most one (earlier parts get more)."""
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


@dataclass(frozen=True)
class PrefixSums:
    """Running totals over the layers: entry l is the sum over layers 0..l-1 (entry 0 is 0.0).

    A stage holding layers a..b-1 has ``compute[b] - compute[a]`` ms of compute (at speed 1.0),
    and likewise for static and activation memory. Every cost in the planner is taken from these
    differences, so every backend rounds a stage's cost the same way.

    Attributes:
        compute: prefix sums of ``compute_ms``.
        static: prefix sums of ``static_mb``.
        activation: prefix sums of ``activation_mb``.
    """

    compute: tuple[float, ...]
    static: tuple[float, ...]
    activation: tuple[float, ...]


def prefix_sums(problem: Problem) -> PrefixSums:
    """The L + 1 prefix sums of the layers' compute, static and activation memory."""
    compute, static, activation = [0.0], [0.0], [0.0]
    for layer in problem.layers:
        compute.append(compute[-1] + layer.compute_ms)
        static.append(static[-1] + layer.static_mb)
        activation.append(activation[-1] + layer.activation_mb)
    return PrefixSums(tuple(compute), tuple(static), tuple(activation))


# ------------------------------------------------------------------------------------ internals
def _check_bounds(bounds: Sequence[int], stages: int, num_layers: int, min_layers: int, where: str) -> None:
    if len(bounds) != stages + 1:
        raise PlanError(f"{where} has {len(bounds)} bounds; {stages} stages need {stages + 1}")
    if any(not isinstance(b, int) or isinstance(b, bool) for b in bounds):
        raise PlanError(f"{where} bounds must be integers, got {list(bounds)}")
    if bounds[0] != 0 or bounds[-1] != num_layers:
        raise PlanError(f"{where} bounds {list(bounds)} must start at 0 and end at {num_layers} (all layers)")
    for j in range(stages):
        if bounds[j + 1] - bounds[j] < min_layers:
            raise PlanError(
                f"{where} stage {j} holds {bounds[j + 1] - bounds[j]} layers; the minimum is {min_layers}"
            )


def _device_to_dict(device: Device) -> dict[str, Any]:
    data = asdict(device)
    if math.isinf(device.memory_mb):
        del data["memory_mb"]
    if device.link_speed == 1.0:
        del data["link_speed"]  # the default: problems without slow links keep their JSON form
    return data


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _as_list(data: Mapping[str, Any], key: str) -> list[Any]:
    value = data[key]
    if not isinstance(value, list):
        raise ProblemError(f"'{key}' must be a list, got {type(value).__name__}")
    return value


def _refuse_unknown(data: Mapping[str, Any], cls: type, where: str) -> None:
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ProblemError(f"unknown field '{unknown[0]}' in {where}; allowed: {', '.join(sorted(allowed))}")


def _from_mapping(cls: type, item: Any, where: str) -> Any:
    if not isinstance(item, Mapping):
        raise ProblemError(f"{where} must be a JSON object, got {type(item).__name__}")
    _refuse_unknown(item, cls, where)
    try:
        return cls(**item)
    except TypeError as err:
        raise ProblemError(f"{where}: {err}") from None
