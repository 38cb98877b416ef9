"""The controller's planner worker: solves run in another process, are polled, and are superseded."""

from __future__ import annotations

import time

from resihp_lightning.callbacks.replan.background_planner import BackgroundPlanner
from resihp_lightning.config import PlannerConfig
from resihp_lightning.plan import Device, Layer, Plan, Problem
from resihp_lightning.solver import solve


def _problem(slow: int) -> Problem:
    return Problem(
        layers=tuple(Layer(1.0 + 0.1 * i) for i in range(8)),
        devices=tuple(Device(i, speed=0.5 if i == slow else 1.0) for i in range(4)),
        micro_batches=8,
    )


def test_solves_come_back_from_the_worker_and_a_newer_job_supersedes_an_older_one():
    planner = BackgroundPlanner()
    try:
        config = PlannerConfig(solver="exact")
        assert planner.poll(0.0) == (False, None, None) and not planner.busy
        planner.submit(_problem(1), config, tag="first")
        planner.submit(_problem(2), config, tag="second")  # the speeds moved: the first is superseded
        started = time.monotonic()
        done, tag, plan = False, None, None
        while not done and time.monotonic() - started < 60:
            done, tag, plan = planner.poll(0.5)
        assert done and tag == "second" and isinstance(plan, Plan) and not planner.busy
        want = solve(_problem(2), config)
        assert plan.layout_key() == want.layout_key() and plan.iteration_ms == want.iteration_ms
        # A failing solve comes back as its exception (the controller logs it and keeps the plan in force).
        planner.submit(Problem(layers=(Layer(1.0, static_mb=10.0),) * 8, devices=(Device(0, memory_mb=1.0),), micro_batches=1,
                               allow_exclude=False), PlannerConfig(solver="exact"), tag="bad")
        done = False
        while not done and time.monotonic() - started < 60:
            done, tag, result = planner.poll(0.5)
        assert done and tag == "bad" and isinstance(result, BaseException)
    finally:
        planner.close()
