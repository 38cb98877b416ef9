"""The events log: one JSON object per line, writer ranks, reading back."""

from __future__ import annotations

import json

import pytest

from resihp_lightning.callbacks.events import EVENT_NAMES, EventLog, read_events
from resihp_lightning.errors import ConfigError
from resihp_lightning.plan import Plan


def test_every_event_kind_round_trips_through_the_file(tmp_path):
    log = EventLog(tmp_path / "run", rank=0)
    plan = Plan.uniform([0, 1, 2, 3], 8, 2, 8)
    log.log("fault_injected", 3, kind="slow", rank=2, factor=2.0)
    log.log("fail_slow_detected", 7, rank=2, speed=0.5)
    log.log("plan_computed", 7, plan=plan, predicted_ms=12.5, solve_seconds=0.1, status="optimal")
    log.log("plan_applied", 8, plan=plan, migration_seconds=0.3, bytes_moved=1024)
    log.log("plan_rejected", 9, reason="cooldown")
    log.log("fail_slow_recovered", 20, rank=2, speed=1.0)
    log.log("fail_stop_detected", None, rank=1)
    log.log("fault_struck", 21, kind="kill", rank=1, at=12.5)
    log.log("recovery_started", 21, generation=1, members=[0, 2, 3], failed={1: "exited"})
    log.log("recovery_finished", 21, generation=1, members=[0, 2, 3], total_s=0.2)
    log.log("fail_stop_unrecoverable", 22, reason="layer 3 lost", exit_code=75)
    log.log("worker_failed", 23, force=True, rank=1, error="RuntimeError: Connection closed by peer", at=30.5)
    log.log("job_restarted", 20, restart_count=1, checkpoint="ckpts/step00000020.ckpt", world_before=4, world_after=3)
    log.log("slow_link_detected", 24, rank=3, link_speed=0.25)
    log.log("slow_link_recovered", 30, rank=3, link_speed=0.97)
    log.log("healthy_reference", 5, plan=plan, predicted_ms=10.0, current_plan=plan, current_ms=10.0)
    log.log("fail_slow_member_detected", 31, rank=2, group=1, speed=0.33)
    log.log("fail_slow_member_recovered", 40, rank=2, group=1)
    log.log("machine_lost", 41, machine="node1", ranks=[2, 3], status="silent")
    log.log("newcomers_admitted", 45, ranks=[4, 5], live=[0, 1, 4, 5], world=4)
    lines = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    assert len(lines) == 20 and all(json.loads(line)["event"] for line in lines)
    events = read_events(tmp_path / "run")
    assert [e["event"] for e in events] == [
        "fault_injected", "fail_slow_detected", "plan_computed", "plan_applied", "plan_rejected",
        "fail_slow_recovered", "fail_stop_detected", "fault_struck", "recovery_started", "recovery_finished",
        "fail_stop_unrecoverable", "worker_failed", "job_restarted", "slow_link_detected", "slow_link_recovered",
        "healthy_reference", "fail_slow_member_detected", "fail_slow_member_recovered", "machine_lost",
        "newcomers_admitted",
    ]
    assert set(e["event"] for e in events) == set(EVENT_NAMES)
    assert all({"time", "step", "event"} <= set(e) for e in events)
    assert events[1]["rank"] == 2 and events[1]["speed"] == 0.5 and events[1]["step"] == 7
    assert Plan.from_dict(events[2]["plan"]).layout_key() == plan.layout_key()
    assert events[6]["step"] is None
    assert events == log.events


def test_only_writer_ranks_write_unless_forced(tmp_path):
    quiet = EventLog(tmp_path, rank=3)
    quiet.log("fail_slow_detected", 1, rank=0, speed=0.7)
    assert not (tmp_path / "events.jsonl").exists() and len(quiet.events) == 1
    quiet.log("fail_stop_detected", 2, force=True, rank=0)
    everyone = EventLog(tmp_path, rank=5, writer_ranks=None)
    everyone.log("plan_rejected", 3, reason="x")
    assert [e["step"] for e in read_events(tmp_path / "events.jsonl")] == [2, 3]


def test_unknown_event_and_bad_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="unknown event 'fail_slow'"):
        EventLog(None).log("fail_slow", 1)
    with pytest.raises(ConfigError, match="no events log"):
        read_events(tmp_path / "nothing")
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "plan_rejected", "step": 1, "time": 0}\n{"event": "plan_rej')  # killed mid-write
    assert len(read_events(path)) == 1
    path.write_text('garbage\n{"event": "plan_rejected", "step": 1, "time": 0}\n')
    with pytest.raises(ConfigError, match="events.jsonl:1"):
        read_events(path)


def test_non_finite_numbers_become_null(tmp_path):
    log = EventLog(tmp_path, rank=0)
    log.log("plan_computed", 1, plan=None, predicted_ms=float("inf"), solve_seconds=0.0, status="infeasible")
    assert read_events(tmp_path)[0]["predicted_ms"] is None
