"""Measures the job's links between steps: point-to-point round trips per pair and one all-reduce.

Inside a pipeline step a send's duration mixes the link with waiting for the peer (its compute, its
own sends), so the costs are measured apart from the schedule, at a step boundary where every rank
is free: a few rounds of pairwise ping-pong (each rank meets a different partner each round, so a
slow link shows on every pair of one rank and on no other pair) and one timed all-reduce after a
barrier.

* The ping-pong sends the activation a stage boundary carries per micro-batch, one way and back: a
  round trip is what a micro-batch's activation forward and gradient backward cost, the planner's
  ``p2p_ms``. Each pair keeps the fastest of ``repeats`` round trips (the network's cost, not the
  machine's noise).
* The all-reduce runs a tensor of the largest per-rank gradient (capped at ``ALLREDUCE_CAP_BYTES``,
  its time then scaled up linearly) over the group, the planner's ``allreduce_ms``. All ranks take
  part, so a slow member slows it for everyone: it prices the sync, the round trips name the link.

Sends go through :func:`send` (looked up per call), so a fault that slows a rank's links
(``FaultInjector`` ``slow_link``) slows its probe sends as it slows its pipeline sends.
"""

from __future__ import annotations

import time
import torch
import torch.distributed as dist

from resihp_lightning.telemetry import LinkSample

#: The all-reduce probe never sends more than this; a larger gradient's time is scaled from it.
ALLREDUCE_CAP_BYTES = 16 * 2**20
#: Round trips need something to carry when no stage boundary was seen yet (one stage, or no step).
MIN_PROBE_BYTES = 4096


def send(tensor: torch.Tensor, dst: int) -> None:
    """One point-to-point send of the probe (a module function so that link faults can wrap it)."""
    dist.send(tensor, dst)


def round_robin(ranks: int, round_index: int) -> list[tuple[int, int]]:
    """The pairs of round ``round_index`` of a round-robin tournament over ``ranks`` ranks (circle method).

    Over ``ranks - 1`` consecutive rounds (``ranks`` when odd: one rank sits out each round) every pair
    meets once. Pairs are ``(low, high)``.
    """
    slots = ranks + (ranks % 2)
    rounds = slots - 1
    r = round_index % rounds
    circle = [0] + [1 + (r + k) % rounds for k in range(rounds)]
    pairs = []
    for k in range(slots // 2):
        a, b = circle[k], circle[slots - 1 - k]
        if a < ranks and b < ranks:
            pairs.append((min(a, b), max(a, b)))
    return pairs


def measure(
    device_id: int,
    boundary_bytes: int,
    gradient_bytes: int,
    step: int,
    first_round: int,
    rounds: int = 3,
    repeats: int = 2,
    device: torch.device | None = None,
) -> LinkSample:
    """Probes the links of the current default process group (collective: every rank calls it).

    Args:
        device_id: this rank's device id (plans name devices; ranks change when a job regroups).
        boundary_bytes: this rank's activation bytes per micro-batch at its stage boundary (0: unknown).
        gradient_bytes: this rank's gradient bytes per iteration.
        step: the step the sample describes.
        first_round: which round of the round-robin schedule to start at (rotate it between probes so
            that ranks meet other partners).
        rounds: rounds of ping-pong in this probe.
        repeats: round trips per pair and round; the fastest counts.
        device: where the probe tensors live (the rank's device).

    Returns:
        The :class:`~resihp_lightning.telemetry.LinkSample`, identical on every rank.
    """
    device = device or torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    known: list[tuple[int, int, int]] = [(0, 0, 0)] * world
    dist.all_gather_object(known, (int(device_id), int(boundary_bytes), int(gradient_bytes)))
    device_ids = [d for d, _, _ in known]
    probe_bytes = max(max(b for _, b, _ in known), MIN_PROBE_BYTES)
    grad_bytes = max(max(g for _, _, g in known), 4)
    payload = torch.zeros(probe_bytes // 4, dtype=torch.float32, device=device)
    reply = torch.empty_like(payload)
    mine: list[tuple[int, float]] = []  # (partner rank, fastest round trip ms) where this rank started
    for r in range(min(rounds, max(world - 1, 0) + (world % 2))):
        for low, high in round_robin(world, first_round + r):
            if rank == low:
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    send(payload, high)
                    dist.recv(reply, high)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    best = min(best, (time.perf_counter() - start) * 1000.0)
                mine.append((high, best))
            elif rank == high:
                for _ in range(repeats):
                    dist.recv(reply, low)
                    send(payload, low)
    allreduce_ms = _timed_allreduce(grad_bytes, device) if world > 1 else 0.0
    gathered: list[list[tuple[int, float]]] = [[] for _ in range(world)]
    dist.all_gather_object(gathered, mine)
    round_trips: dict[int, list[float]] = {d: [] for d in device_ids}
    partners: dict[int, list[int]] = {d: [] for d in device_ids}
    for starter, results in enumerate(gathered):
        for partner, ms in results:
            for a, b in ((starter, partner), (partner, starter)):
                round_trips[device_ids[a]].append(ms)
                partners[device_ids[a]].append(device_ids[b])
    return LinkSample(step, probe_bytes, round_trips, partners, allreduce_ms, grad_bytes)


def _timed_allreduce(grad_bytes: int, device: torch.device) -> float:
    """ms of an all-reduce of ``grad_bytes`` over the group (a barrier first, so waiting is not timed).

    Every rank reports the same number (the slowest rank's view: the sync ends when its slowest
    member is done).
    """
    sent = min(grad_bytes, ALLREDUCE_CAP_BYTES)
    tensor = torch.zeros(max(sent // 4, 1), dtype=torch.float32, device=device)
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) * 1000.0], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item()) * grad_bytes / sent
