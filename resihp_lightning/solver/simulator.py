"""A 1F1B event simulator: replays a plan micro-batch by micro-batch to check the cost formula.

Each replica runs the non-interleaved 1F1B schedule (PipeDream-flush, as DeepSpeed's
``TrainSchedule``): stage j of P first runs ``w_j = min(P - 1 - j, m)`` warm-up forwards, then
alternates one forward and one backward until every forward is done, then drains the remaining
backwards. Events per (stage, micro-batch):

* ``F`` forward compute, ``forward_fraction * compute / speed``;
* ``send_act`` (stages j < P-1): the activation to stage j+1, ``forward_fraction * p2p_ms * u_j``, a
  blocking send that occupies the sending stage;
* ``B`` backward compute, the rest of the compute;
* ``recv_grad`` (stages j < P-1): the gradient from stage j+1, ``(1 - forward_fraction) * p2p_ms * u_j``,
  occupying the receiving stage before its backward;
* only on a slow link (``u_j > 1``, stages j > 0), what it adds to the transfers with stage j-1:
  ``recv_act``, ``forward_fraction * p2p_ms * (u_j - 1)`` after the activation arrived and before
  ``F``, and ``send_grad``, ``(1 - forward_fraction) * p2p_ms * (u_j - 1)`` after ``B``, before the
  gradient counts as sent.

Here ``u_j = 1 / min(link_speed, 1)`` of the stage's device, as in :func:`~resihp_lightning.plan.stage_p2p_ms`,
so a stage's forward and backward events of one micro-batch take exactly ``t[r][j]`` of the formula.
``F(j, i)`` waits for ``send_act(j-1, i)``; ``recv_grad(j, i)`` waits for ``B(j+1, i)`` (and its
``send_grad``). Every replica's last event is followed by the data-parallel all-reduce
(``allreduce_ms`` times the largest ``u`` among the devices used, when D > 1); the makespan is the
latest replica plus the all-reduce.

Relation to the formula ``T_r = sum_j t_j + (m - 1) max_j t_j`` (measured, see tests/solver/test_simulator.py):

* equal stage times (``t_j`` all equal, for every ``forward_fraction``): the simulated replica time
  equals the formula exactly, ``(m + P - 1) t``; so does one stage (P = 1) and one micro-batch (m = 1);
* unequal stage times: the simulated time never exceeds the formula (the formula is an upper bound)
  and is at least ``max(sum_j t_j + (m - 1) max_j t_j - (P - 1)(max_j t_j - min_j t_j), sum_j t_j,
  m max_j t_j)``. On 600 random replicas (P = 2..6, m = 1..12, stage times within a factor 2 of
  each other) the ratio simulated / formula was 0.85-1.0, 0.97 on average: the formula is a close,
  slightly pessimistic estimate (it charges every stage's fill and drain at its own time and the steady
  state at the bottleneck, while 1F1B overlaps part of the fill of fast stages).
* slow links keep both: equal stage times (transfers included) are still exact, and the formula
  still bounds the simulation from above; on 600 random replicas with links at u = 1, 2 or 5
  (p2p 0.1-0.5 ms against 1-2 ms stages) the ratio was 0.77-1.0, 0.96 on average (the transfer
  terms spread the stage times further).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from resihp_lightning.errors import ConfigError
from resihp_lightning.plan import Plan, Problem, validate


@dataclass(frozen=True)
class Event:
    """One event of the schedule: replica, stage, micro-batch, kind, start and end (ms)."""

    replica: int
    stage: int
    micro_batch: int
    kind: str
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class Simulation:
    """What the simulator measured.

    Attributes:
        makespan_ms: iteration time: latest replica plus all-reduce.
        replica_ms: each replica's time without the all-reduce.
        busy_ms: per replica and stage, time spent in events.
        idle_ms: per replica and stage, the replica's time minus the busy time (bubbles).
        events: every event, when ``keep_events`` was set.
    """

    makespan_ms: float
    replica_ms: tuple[float, ...]
    busy_ms: tuple[tuple[float, ...], ...]
    idle_ms: tuple[tuple[float, ...], ...]
    events: tuple[Event, ...] = field(default=())


def schedule_1f1b(stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """The order of ("F"|"B", micro-batch) operations of one stage under 1F1B."""
    warmup = min(stages - 1 - stage, micro_batches)
    ops = [("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        ops.append(("F", warmup + i))
        ops.append(("B", i))
    ops.extend(("B", i) for i in range(micro_batches - warmup, micro_batches))
    return ops


def simulate_replica(
    compute_ms: list[float],
    micro_batches: int,
    p2p_ms: float,
    forward_fraction: float = 1.0 / 3.0,
    replica: int = 0,
    events: list[Event] | None = None,
    link_slowdown: list[float] | None = None,
) -> tuple[float, list[float]]:
    """Simulates one replica: ``compute_ms[j]`` is stage j's compute per micro-batch (already / speed).

    ``link_slowdown[j]`` is u of stage j's device (default: all 1.0, healthy links).

    Returns:
        (replica time, busy time per stage).
    """
    p = len(compute_ms)
    u = link_slowdown if link_slowdown is not None else [1.0] * p
    fwd = [forward_fraction * c for c in compute_ms]
    bwd = [(1 - forward_fraction) * c for c in compute_ms]
    send = [forward_fraction * p2p_ms * u[j] if j < p - 1 else 0.0 for j in range(p)]
    recv = [(1 - forward_fraction) * p2p_ms * u[j] if j < p - 1 else 0.0 for j in range(p)]
    # What a slow link adds to the transfers with the previous stage (0.0 on healthy links).
    recv_extra = [forward_fraction * p2p_ms * (u[j] - 1.0) if j > 0 else 0.0 for j in range(p)]
    send_extra = [(1 - forward_fraction) * p2p_ms * (u[j] - 1.0) if j > 0 else 0.0 for j in range(p)]
    ops = [schedule_1f1b(p, j, micro_batches) for j in range(p)]
    position = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    act_ready: dict[tuple[int, int], float] = {}  # (stage, mb): activation arrived at stage
    grad_done: dict[tuple[int, int], float] = {}  # (stage, mb): backward of stage finished
    remaining = sum(len(o) for o in ops)
    while remaining:
        progressed = False
        for j in range(p):
            while position[j] < len(ops[j]):
                kind, i = ops[j][position[j]]
                if kind == "F":
                    ready = 0.0 if j == 0 else act_ready.get((j, i))
                    if ready is None:
                        break
                    start = max(clock[j], ready)
                    end = start
                    if recv_extra[j] > 0:
                        _record(events, replica, j, i, "recv_act", end, end + recv_extra[j])
                        end += recv_extra[j]
                    _record(events, replica, j, i, "F", end, end + fwd[j])
                    end += fwd[j]
                    if j < p - 1:
                        _record(events, replica, j, i, "send_act", end, end + send[j])
                        end += send[j]
                        act_ready[(j + 1, i)] = end
                    busy[j] += end - start
                else:
                    if j < p - 1:
                        ready = grad_done.get((j + 1, i))
                        if ready is None:
                            break
                    else:
                        ready = 0.0
                    start = max(clock[j], ready)
                    end = start
                    if j < p - 1:
                        _record(events, replica, j, i, "recv_grad", end, end + recv[j])
                        end += recv[j]
                    _record(events, replica, j, i, "B", end, end + bwd[j])
                    end += bwd[j]
                    if send_extra[j] > 0:
                        _record(events, replica, j, i, "send_grad", end, end + send_extra[j])
                        end += send_extra[j]
                    grad_done[(j, i)] = end
                    busy[j] += end - start
                clock[j] = end
                position[j] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - 1F1B cannot deadlock
            raise RuntimeError("1F1B schedule deadlocked")
    return max(clock), busy


def _record(events: list[Event] | None, r: int, j: int, i: int, kind: str, start: float, end: float) -> None:
    if events is not None:
        events.append(Event(r, j, i, kind, start, end))


def simulate(problem: Problem, plan: Plan, *, forward_fraction: float = 1.0 / 3.0, keep_events: bool = False) -> Simulation:
    """Replays ``plan`` on ``problem`` (see module docstring).

    Args:
        problem: the planning problem (layers' compute, devices' speeds and link speeds, p2p and
            all-reduce times).
        plan: a valid plan for it (memory is not checked: the simulator measures time only).
        forward_fraction: the share of ``compute_ms`` (and of ``p2p_ms``) spent in the forward pass;
            1/3 by default (a backward costs about twice a forward).
        keep_events: also return every event.

    Raises:
        ConfigError: ``forward_fraction`` is not in [0, 1].
        PlanError: the plan does not fit the problem.
    """
    if not 0.0 <= forward_fraction <= 1.0:
        raise ConfigError(f"invalid value {forward_fraction!r} for option `forward_fraction`; allowed: a number in [0, 1]")
    validate(problem, plan, check_memory=False)
    layers = problem.layers
    events: list[Event] | None = [] if keep_events else None
    replica_ms, busy_ms, idle_ms = [], [], []
    for r, replica in enumerate(plan.replicas):
        compute, links = [], []
        for j, device_id in enumerate(replica.devices):
            # Summed layer by layer, not through plan.prefix_sums: the replay stays independent of the formula.
            work = sum(layers[l].compute_ms for l in replica.stage_layers(j))
            device = problem.device(device_id)
            compute.append(work / device.speed)
            links.append(device.link_slowdown)
        total, busy = simulate_replica(compute, replica.micro_batches, problem.p2p_ms, forward_fraction, r, events, links)
        replica_ms.append(total)
        busy_ms.append(tuple(busy))
        idle_ms.append(tuple(total - b for b in busy))
    allreduce = problem.allreduce_for(plan.device_ids, plan.data_degree)
    return Simulation(
        max(replica_ms) + allreduce,
        tuple(replica_ms),
        tuple(busy_ms),
        tuple(idle_ms),
        tuple(events) if events is not None else (),
    )
