"""Hot spares: live processes that the plan in force leaves idle, kept in step with the members.

With fail-stop recovery on, a plan may use fewer devices than the job has (the planner's
``allow_exclude``: seven survivors need not run a 7 x 1 pipeline, a device at a tenth of the speed
can be left out). The processes it leaves out stay in the job as *spares*: outside the current
generation's process group (DeepSpeed needs its topology to be the whole default group), beating,
and running the same Lightning loop as the members, so that a later plan can take them back at any
step boundary (a second failure, a device that healed).

A spare computes nothing. Each call the strategy makes for Lightning (``training_step``,
``validation_step``, ``test_step``, ``predict_step``) is numbered the same on every process of the
job; the members' rank 0 publishes what call ``n`` returned (:meth:`CallMirror.publish`) and the
spares return the same thing (:meth:`CallMirror.wait`), so their loops, logged values, callbacks
and checkpoints stay in step without a process group. Before a call that changes who is a member,
the members' rank 0 announces the new plan for the current generation
(:meth:`CallMirror.announce`); every process of the job then reshapes the groups together
(``SurvivingJob.reshape``). When the generation is aborted (a member died), a waiting spare raises
:class:`~resihp_lightning.resilience.failures.PeerFailure` like a member would, and joins the regroup.

Newcomers admitted at a call (:mod:`.admission`) are named in that call's records (result and
announcement), so that every spare, and a spare taken in at that call, records them too.

Costs while spares exist: one store write (and one delete) per call on the members' rank 0; each
spare polls the store every ``poll_s``. A spare also shares its speed-probe time (:func:`share_idle_probe`,
one small key per spare) so that the members can tell when a device left out for slowness healed.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from resihp_lightning.failstop.admission import Admitted
from resihp_lightning.plan import Plan

#: Published results kept in the store (a spare lags its members by at most one call).
KEEP_RECORDS = 64


def result_key(call: int) -> str:
    return f"spares/result/{call}"


def idle_probe_key(device: int) -> str:
    return f"spares/probe/{device}"


def share_idle_probe(world: Any, device: int, step: int, probe_ms: float) -> None:
    """A spare: publishes its speed-probe time at ``step`` (replacing its last), for the members' rank 0."""
    world.store.control.set(idle_probe_key(device), json.dumps({"step": int(step), "ms": float(probe_ms)}))


def idle_probes(world: Any, devices: tuple[int, ...]) -> dict[int, tuple[int, float]]:
    """The latest probe time each of ``devices`` shared: device -> ``(step, ms)`` (those without one left out)."""
    store = world.store.control
    out: dict[int, tuple[int, float]] = {}
    for device in devices:
        key = idle_probe_key(device)
        if store.check([key]):
            record = json.loads(store.get(key))
            out[device] = (int(record["step"]), float(record["ms"]))
    return out


def reshape_key(generation: int, call: int) -> str:
    # Per generation: an announcement that a failure cut short must not be read after the regroup.
    return f"spares/reshape/gen{generation}/{call}"


@dataclass(frozen=True)
class Mirrored:
    """What the members' call returned, for a spare to return too.

    Attributes:
        value: the call's result (plain data and tensors).
        plan: the plan the members ran the call under, when it changed since the last record.
        admitted: newcomers the members admitted at this call.
    """

    value: Any
    plan: Plan | None
    admitted: Admitted | None = None


@dataclass(frozen=True)
class Reshape:
    """The members change at this call: every process of the job reshapes the groups to ``plan``.

    Attributes:
        old: the plan in force before the call (the transfers are computed from it).
        plan: the plan to put in force.
        include: spares that join the grown group although ``plan`` leaves them idle (the end of
            ``fit``: they receive the trained weights).
        admitted: newcomers the members admitted at this call (before the reshape).
    """

    old: Plan
    plan: Plan
    include: tuple[int, ...] = ()
    admitted: Admitted | None = None


class CallMirror:
    """Numbered strategy calls, published by the members' rank 0 and replayed by the spares.

    Args:
        world: the job's :class:`~resihp_lightning.resilience.world.ElasticWorld`.
        poll_s: how often a waiting spare reads the store.
    """

    def __init__(self, world: Any, poll_s: float = 0.01) -> None:
        self.world = world
        self.poll_s = poll_s
        self.calls = 0
        self._published_plan: str | None = None
        self._admitted: dict[int, Admitted] = {}  # call -> newcomers admitted there, for its records

    def next_call(self) -> int:
        """Numbers the strategy call that starts now (every process of the job calls it, in step)."""
        self.calls += 1
        return self.calls

    def note_admission(self, call: int, admitted: Admitted) -> None:
        """Members' rank 0: ``call``'s records (its announcement, its result) name the newcomers admitted there."""
        self._admitted = {call: admitted}

    def _admission(self, call: int) -> Admitted | None:
        return self._admitted.get(call)

    def publish(self, call: int, value: Any, plan: Plan) -> None:
        """Members' rank 0: records what ``call`` returned (with the plan, when it changed)."""
        key = plan.layout_key()
        admitted = self._admitted.pop(call, None)
        payload = {"value": value, "plan": None if key == self._published_plan else plan.to_dict(),
                   "admitted": None if admitted is None else (admitted.ranks, admitted.considered)}
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        store = self.world.store.control
        store.set(result_key(call), buffer.getvalue())
        self._published_plan = key
        if call > KEEP_RECORDS:
            store.delete_key(result_key(call - KEEP_RECORDS))

    def forget_published_plan(self) -> None:
        """The next record carries its plan (after the members changed: new spares, a new rank 0)."""
        self._published_plan = None

    def announce(self, call: int, old: Plan, plan: Plan, include: tuple[int, ...] = ()) -> None:
        """Members' rank 0: before ``call``, the job reshapes from ``old`` to ``plan`` (see :class:`Reshape`)."""
        admitted = self._admission(call)
        body = json.dumps({"old": old.to_dict(), "plan": plan.to_dict(), "include": list(include),
                           "admitted": None if admitted is None else [list(admitted.ranks), admitted.considered]})
        self.world.store.control.set(reshape_key(self.world.current.number, call), body)

    def wait(self, call: int) -> Mirrored | Reshape:
        """A spare: blocks until the members finish ``call`` or announce a reshape before it.

        Raises:
            PeerFailure: the current generation was aborted (the spare joins the regroup).
        """
        world = self.world
        store = world.store.control
        done = result_key(call)
        while True:
            # The result first: once published, the call is done, whatever happens to the members after
            # (at the end of a job they finish and exit while a spare may still be polling).
            if store.check([done]):
                payload = torch.load(io.BytesIO(store.get(done)), weights_only=False)
                plan = payload["plan"]
                return Mirrored(payload["value"], Plan.from_dict(plan) if plan is not None else None,
                                _admitted(payload.get("admitted")))
            world.check()
            announced = reshape_key(world.current.number, call)
            if store.check([announced]):
                body = json.loads(store.get(announced))
                return Reshape(Plan.from_dict(body["old"]), Plan.from_dict(body["plan"]), tuple(body.get("include", ())),
                               _admitted(body.get("admitted")))
            time.sleep(self.poll_s)


def _admitted(value: Any) -> Admitted | None:
    """An admission as a record carries it (``[ranks, considered]``), or ``None``."""
    if value is None:
        return None
    ranks, considered = value
    return Admitted(tuple(int(r) for r in ranks), int(considered))
