"""The report's "what happened" part: phases from the events the job logged (no injected fault needed).

The event logs are written by the job's own :class:`~resihp_lightning.callbacks.events.EventLog` with
the fields the recovery, the detector and the controller log (``callbacks/events.py``); the step
records are those ``StepRecorder`` writes. No training runs here.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from resihp_lightning.callbacks.events import EventLog
from resihp_lightning.cli import main
from resihp_lightning.report import build_timeline, format_report, load_run, summarize
from resihp_lightning.report.timeline import format_timeline

TOKENS = 4096


def _plan(*replicas: tuple[list[int], int]) -> dict:
    return {"pipeline_degree": len(replicas[0][0]), "data_degree": len(replicas),
            "replicas": [{"devices": devices, "bounds": [0, 8], "micro_batches": micro} for devices, micro in replicas]}


def _write_steps(run_dir: Path, walls: dict[int, float], shape: dict[int, tuple[int, int, list[int]]],
                 migrated: tuple[int, ...] = ()) -> None:
    """``walls``: step -> wall seconds; ``shape``: the first step of each plan -> (P, D, micro)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    records, current = [], None
    for step in sorted(walls):
        current = shape.get(step, current)
        p, d, micro = current
        records.append({"step": step, "time": 1000.0 + step, "wall_ms": walls[step] * 1000.0, "tokens": TOKENS,
                        "loss": 1.0, "P": p, "D": d, "micro": micro, "migrated": step in migrated})
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _recovery(log: EventLog, step: int, generation: int, failed: dict[int, str], members: list[int],
              spares: list[int], plan: dict, total_s: float) -> None:
    """What FailStopReporter logs after the step redone on the survivors."""
    for rank, how in sorted(failed.items()):
        log.log("fail_stop_detected", step, rank=rank, how=how, at=100.0 + step)
    log.log("recovery_started", step, generation=generation, members=members, failed=failed)
    log.log("plan_applied", step, plan=plan, migration_seconds=0.1, bytes_moved=2**20, world=len(members) + len(spares),
            spares=spares)
    log.log("recovery_finished", step, generation=generation, members=members, spares=spares, abort_s=0.0,
            regroup_s=0.2, plan_s=0.02, restore_s=0.1, redo_s=total_s - 0.32, total_s=total_s, bytes_moved=2**20)


def test_a_rank_killed_from_outside_shows_its_death_the_recovery_and_the_smaller_world(tmp_path: Path) -> None:
    """Nothing injected: rank 2 dies inside step 10 (redone in 2 s); 4 processes at 0.5 s/step, then 3 at 0.6 s."""
    run_dir = tmp_path / "killed"
    walls = {s: 2.0 if s < 3 or s == 10 else 0.5 if s < 10 else 0.6 for s in range(20)}
    _write_steps(run_dir, walls, {0: (2, 2, [4, 4]), 10: (1, 3, [2, 3, 3])}, migrated=(10,))
    typical = statistics.median(w for s, w in walls.items() if s >= 3 and s != 10)
    log = EventLog(run_dir)
    log.log("healthy_reference", 5, plan=_plan(([0], 2), ([1], 2), ([2], 2), ([3], 2)), predicted_ms=400.0,
            current_plan=_plan(([0, 1], 4), ([2, 3], 4)), current_ms=500.0)
    _recovery(log, 10, 1, {2: "exited"}, [0, 1, 3], [], _plan(([0], 2), ([1], 3), ([3], 3)), total_s=1.82)
    timeline = build_timeline(load_run(run_dir))
    assert [(p.span, p.world, p.condition, p.plans) for p in timeline.phases] == [
        ("0-9", 4, "healthy", ["2x2"]), ("10-19", 3, "without rank 2", ["1x3 [2,3,3]"])]
    assert timeline.phases[0].steps == list(range(3, 10)) and timeline.phases[1].steps == list(range(11, 20))
    assert timeline.phases[0].tokens_per_s == pytest.approx(TOKENS / 0.5)
    assert timeline.phases[1].tokens_per_s == pytest.approx(TOKENS / 0.6)
    assert timeline.world_label == "4 -> 3 processes" and timeline.transition_steps == {10: 2.0}
    (death,) = timeline.incidents
    assert (death.step, death.kind, death.ranks, death.world, death.seconds) == (10, "fail_stop", (2,), 3, 1.82)
    text = format_report(timeline, summarize(load_run(run_dir)))
    assert "what happened (20 steps, 4 -> 3 processes" in text
    assert ("step 10: rank 2 lost (exited); recovered in-process in 1.82 s (regroup 0.200 s, plan 0.020 s, restore "
            "0.100 s, 1.0 MiB moved, step redone in 1.50 s) on 3 processes (ranks 0, 1, 3), plan 1x3 [2,3,3]; "
            f"step 10 took 2.00 s (typical step {typical:.2f} s)") in text
    assert "no fault injected" in text and "fault:" not in text
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report.txt").read_text().strip() == text and (run_dir / "timeline.png").stat().st_size > 20_000


def test_phases_split_at_a_detected_slowdown_the_re_plan_the_healing_and_an_eviction_onto_a_spare(tmp_path: Path) -> None:
    """Rank 1 slow from step 5, re-planned at step 7 (the controller logs it after the step that migrated),
    healed at 12; rank 3 silent and evicted at step 15, the survivors keep rank 2 as a spare (world 3, 2 working)."""
    run_dir = tmp_path / "mixed"
    walls = {s: 0.5 for s in range(20)} | {5: 0.9, 6: 0.9, 7: 1.5, 15: 3.0}
    _write_steps(run_dir, walls, {0: (2, 2, [4, 4]), 7: (1, 4, [3, 3, 1, 1]), 15: (1, 2, [4, 4])}, migrated=(7, 15))
    log = EventLog(run_dir)
    log.log("fail_slow_detected", 5, rank=1, speed=0.5)
    log.log("plan_computed", 7, plan=_plan(([0], 3), ([1], 1), ([2], 3), ([3], 1)), predicted_ms=500.0)
    log.log("plan_applied", 8, plan=_plan(([0], 3), ([1], 1), ([2], 3), ([3], 1)), migration_seconds=0.7,
            bytes_moved=3 * 2**20)
    log.log("fail_slow_recovered", 12, rank=1, speed=0.97)
    _recovery(log, 15, 1, {3: "silent"}, [0, 1], [2], _plan(([0], 4), ([1], 4)), total_s=2.5)
    timeline = build_timeline(load_run(run_dir))
    assert [(p.span, p.world, p.condition) for p in timeline.phases] == [
        ("0-4", 4, "healthy"), ("5-6", 4, "rank 1 slow (0.50)"), ("7-11", 4, "rank 1 slow (0.50)"),
        ("12-14", 4, "healthy"), ("15-19", 3, "without rank 3")]
    assert [i.kind for i in timeline.incidents] == ["fail_slow", "plan", "healed", "fail_stop"]
    assert timeline.incidents[1].step == 7  # the step that migrated, not the event's step 8
    assert timeline.phases[1].tokens_per_s == pytest.approx(TOKENS / 0.9) and 7 not in timeline.phases[2].steps
    text = format_timeline(timeline)
    assert "step 7: plan 1x4 [3,1,3,1] applied (migration 0.70 s, 3.0 MiB moved)" in text
    assert "step 12: rank 1 healed (0.97)" in text
    assert "step 15: rank 3 evicted (silent); recovered in-process in 2.50 s" in text
    assert "on 2 processes (ranks 0, 1; spares 2)" in text and "4 -> 3 processes" in text


def test_a_replacement_admitted_after_a_death_brings_the_world_back(tmp_path: Path) -> None:
    """Rank 2 dies inside step 5 (3 survivors); a replacement, rank 4, is admitted at step 9 as a hot spare and the
    plan of step 10 takes it in: the world goes 4 -> 3 -> 4, and the report says who joined when."""
    run_dir = tmp_path / "replaced"
    walls = {s: 2.0 if s < 3 or s in (5, 10) else 0.5 if s < 5 or s >= 10 else 0.6 for s in range(16)}
    _write_steps(run_dir, walls, {0: (2, 2, [4, 4]), 5: (1, 3, [2, 3, 3]), 10: (2, 2, [4, 4])}, migrated=(5, 10))
    log = EventLog(run_dir)
    _recovery(log, 5, 1, {2: "exited"}, [0, 1, 3], [], _plan(([0], 2), ([1], 3), ([3], 3)), total_s=1.5)
    log.log("newcomers_admitted", 9, ranks=[4], live=[0, 1, 3, 4], world=4)
    log.log("plan_applied", 10, plan=_plan(([0, 1], 4), ([3, 4], 4)), migration_seconds=0.4, bytes_moved=2**20)
    timeline = build_timeline(load_run(run_dir))
    assert [(p.span, p.world) for p in timeline.phases] == [("0-4", 4), ("5-8", 3), ("9", 4), ("10-15", 4)]
    assert [(i.step, i.kind, i.ranks, i.world) for i in timeline.incidents] == [
        (5, "fail_stop", (2,), 3), (9, "joined", (4,), 4), (10, "plan", (), None)]
    assert timeline.world_label == "4 -> 3 -> 4 processes"
    text = format_timeline(timeline)
    assert "step 9: rank 4 joined the running job (admitted as hot spare); 4 processes" in text


def test_an_injected_kill_is_an_annotation_with_its_detection_time_and_keeps_its_evaluation(tmp_path: Path) -> None:
    run_dir = tmp_path / "injected"
    _write_steps(run_dir, {s: 2.0 if s < 3 or s == 10 else 0.5 if s < 10 else 0.6 for s in range(20)},
                 {0: (2, 2, [4, 4]), 10: (1, 3, [2, 3, 3])})
    log = EventLog(run_dir)
    log.log("fault_injected", 10, kind="kill", rank=2, start_step=10)
    log.log("fault_struck", 10, kind="kill", rank=2, at=109.96)
    _recovery(log, 10, 1, {2: "exited"}, [0, 1, 3], [], _plan(([0], 2), ([1], 3), ([3], 3)), total_s=1.82)
    run = load_run(run_dir)
    timeline = build_timeline(run)
    assert [(p.span, p.world) for p in timeline.phases] == [("0-9", 4), ("10-19", 3)]  # the fault split nothing more
    text = format_report(timeline, summarize(run))
    assert "step 10: rank 2 lost (exited), detected 0.040 s after the injected kill;" in text
    assert "injected: rank 2 killed inside step 10" in text
    assert "the injected fault:" in text and "rank 2 killed (SIGKILL) inside step 10" in text  # the evaluation, as before


def test_a_loss_without_recovery_and_the_restart_that_followed(tmp_path: Path) -> None:
    """D = 1: rank 1 lost at step 6, unrecoverable (exit 75); the job restarts from step 5's checkpoint on 3."""
    run_dir = tmp_path / "restarted"
    _write_steps(run_dir, {s: 0.5 for s in range(12)}, {0: (4, 1, [8]), 5: (3, 1, [8])})
    log = EventLog(run_dir)
    log.log("fail_stop_detected", 6, rank=1, how="exited", at=10.0)
    log.log("fail_stop_unrecoverable", 6, reason="layer 3 lost with every holder", exit_code=75)
    log.log("job_restarted", 5, restart_count=1, checkpoint="ckpt/step5", checkpoint_step=5, world_before=4,
            world_after=3, lost=[1], new=[])
    timeline = build_timeline(load_run(run_dir))
    # The loss happened in the attempt whose steps 5.. the restart redid: it splits none of the resumed steps.
    assert [(p.span, p.world, p.condition) for p in timeline.phases] == [("0-4", 4, "healthy"), ("5-11", 3, "healthy")]
    lines = format_timeline(timeline).splitlines()
    assert lines[-3:] == [  # in the order they happened
        "step 6: rank 1 lost (exited); no recovery recorded (in the attempt before the restart)",
        "step 6: the job could not recover in-process (layer 3 lost with every holder): exit 75 for a restart "
        "(in the attempt before the restart)",
        "step 5: job restarted from the checkpoint of step 5 on 3 processes (before: 4); lost: 1"]


def test_a_run_where_nothing_was_detected_says_so(tmp_path: Path) -> None:
    run_dir = tmp_path / "quiet"
    _write_steps(run_dir, {s: 0.5 for s in range(8)}, {0: (2, 2, [4, 4])})
    timeline = build_timeline(load_run(run_dir))
    assert [(p.span, p.world, p.condition) for p in timeline.phases] == [("0-7", 4, "healthy")]
    assert "nothing detected" in format_timeline(timeline) and timeline.world_label == "4 processes"


def test_the_exit_of_a_rank_the_survivors_left_out_is_its_own_not_the_jobs(tmp_path: Path) -> None:
    """Machine 0 cut off inside step 3: ranks 2-5 recover without ranks 0 and 1 and finish; ranks 0 and 1, which
    lost the store, end later with the restart status and log ``fail_stop_unrecoverable`` into the same shared
    log. The report shows their exits, not "the job could not recover"."""
    run_dir = tmp_path / "cut"
    _write_steps(run_dir, {s: 0.5 for s in range(6)}, {0: (2, 3, [2, 2, 2]), 3: (1, 4, [2, 2, 1, 1])})
    log = EventLog(run_dir)
    _recovery(log, 3, 1, {0: "silent", 1: "silent"}, [2, 3, 4, 5], [], _plan(([2], 2), ([3], 2), ([4], 1), ([5], 1)), 1.5)
    reason = "the survivors could not regroup: the rendezvous store is lost; the job cannot regroup"
    for rank in (0, 1):
        log.log("fail_stop_unrecoverable", 3, force=True, reason=reason, exit_code=75, rank=rank)
    timeline = build_timeline(load_run(run_dir))
    assert [i.kind for i in timeline.incidents] == ["fail_stop"]
    assert [(p.span, p.world) for p in timeline.phases] == [("0-2", 6), ("3-5", 4)]
    text = format_timeline(timeline)
    assert "could not recover" not in text
    assert f"rank 0, left out by the survivors, ended with exit 75 ({reason})" in text
    assert f"rank 1, left out by the survivors, ended with exit 75 ({reason})" in text
