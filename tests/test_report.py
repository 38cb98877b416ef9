"""``resihp report``: the table and the PNG from a recorded run directory (built here, no training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resihp_lightning.cli import main
from resihp_lightning.report import format_table, load_run, summarize

TOKENS = 4096


def _write_run(run_dir: Path, *, fault: bool = True) -> None:
    """Steps 0-9 healthy (0.5 s each), 10-14 slowed (1.0 s), 15 migrates (3 s), 16-24 after (0.6 s).

    The run's first three steps are start-up steps (2 s each) that the healthy phase leaves out.
    """
    run_dir.mkdir(parents=True)
    steps = []
    for step in range(25):
        wall = 2000.0 if step < 3 else 500.0 if step < 10 or not fault else 1000.0 if step < 15 else 3000.0 if step == 15 else 600.0
        replanned = fault and step >= 15
        steps.append({"step": step, "time": 1000.0 + step, "wall_ms": wall, "step_ms": wall * 0.9, "tokens": TOKENS,
                      "loss": 5.0 - 0.1 * step, "P": 1 if replanned else 2, "D": 4 if replanned else 2,
                      "micro": [2, 2, 2, 2] if replanned else [4, 4], "migrated": fault and step == 15})
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    if not fault:
        return
    plan = {"pipeline_degree": 1, "data_degree": 4,
            "replicas": [{"devices": [d], "bounds": [0, 8], "micro_batches": 2} for d in range(4)]}
    events = [
        {"time": 1010.0, "step": 10, "event": "fault_injected", "kind": "slow", "rank": 1, "factor": 2.0,
         "start_step": 10, "end_step": None},
        {"time": 1013.0, "step": 13, "event": "fail_slow_detected", "rank": 1, "speed": 0.52},
        {"time": 1014.0, "step": 14, "event": "plan_computed", "plan": plan, "predicted_ms": 900.0},
        {"time": 1016.0, "step": 16, "event": "plan_applied", "plan": plan, "migration_seconds": 2.5,
         "bytes_moved": 3 * 2**20},
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_summary_phases_follow_the_recorded_steps(tmp_path: Path) -> None:
    _write_run(tmp_path / "run")
    summary = summarize(load_run(tmp_path / "run"))
    assert summary.healthy.steps == list(range(3, 10))
    assert summary.slowed.steps == list(range(10, 15))
    assert summary.after.steps == list(range(16, 25))  # the migration step 15 is left out
    assert summary.healthy.tokens_per_s == pytest.approx(TOKENS / 0.5)
    assert summary.slowed.tokens_per_s == pytest.approx(TOKENS / 1.0)
    assert summary.after.tokens_per_s == pytest.approx(TOKENS / 0.6)
    # One of four devices at half speed: S = 3.5 of N = 4.
    assert summary.ideal_tokens_per_s == pytest.approx(TOKENS / 0.5 * 3.5 / 4)
    assert summary.detection_latency == 3
    assert summary.migration_s == pytest.approx(2.5)
    assert summary.applied_step == 15
    assert summary.plans == [(0, "2x2"), (15, "1x4")]


def test_report_command_prints_the_table_and_writes_the_png(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    _write_run(run)
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert rows["healthy"].split("|")[3].strip() == f"{TOKENS / 0.5:.0f}"
    assert rows["slowed, before re-plan"].split("|")[3].strip() == f"{TOKENS / 1.0:.0f}"
    assert rows["slowed, after re-plan"].split("|")[3].strip() == f"{TOKENS / 0.6:.0f}"
    assert "latency 3 steps" in out and "migration 2.50 s" in out and "3.0 MiB moved" in out
    png = run / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert (run / "report.txt").read_text().strip() == out.split("timeline:")[0].strip()


def test_phases_follow_the_fault_its_healing_and_the_plan_back(tmp_path: Path) -> None:
    """3x on rank 2 from step 10 to 20 (issue 17): slowed 10-14, re-plan at 15, slowed after it 16-19,
    healed under the fault's plan 20-23, plan-back at 24, healed after it 25-29. The healed phase
    after the plan-back runs the planner's healthy plan faster than the starting plan (no bubble),
    so the ideal is S/N of that, not of the starting plan."""
    run_dir = tmp_path / "healed"
    run_dir.mkdir()
    walls = {**{s: 500.0 for s in range(10)}, **{s: 1000.0 for s in range(10, 15)}, 15: 3000.0,
             **{s: 700.0 for s in range(16, 20)}, **{s: 450.0 for s in range(20, 24)}, 24: 2000.0,
             **{s: 400.0 for s in range(25, 30)}}
    steps = [{"step": s, "time": 1000.0 + s, "wall_ms": w, "tokens": TOKENS, "P": 2 if s < 15 else 1,
              "D": 2 if s < 15 else 4, "micro": [4, 4] if s < 15 else [3, 3, 1, 1] if s < 24 else [2, 2, 2, 2],
              "migrated": s in (15, 24)} for s, w in sorted(walls.items())]
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    events = [
        {"time": 1010.0, "step": 10, "event": "fault_injected", "kind": "slow", "rank": 2, "factor": 3.0,
         "start_step": 10, "end_step": 20},
        {"time": 1013.0, "step": 13, "event": "fail_slow_detected", "rank": 2, "speed": 0.35},
        {"time": 1023.0, "step": 23, "event": "fail_slow_recovered", "rank": 2, "speed": 0.99},
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = summarize(load_run(run_dir))
    spans = {p.name: p.span for p in summary.phases}
    assert spans == {"healthy": "3-9", "slowed, before re-plan": "10-14", "slowed, after re-plan": "16-19",
                     "healed, before plan-back": "20-23", "healed, after plan-back": "25-29"}
    assert summary.best_healthy.name == "healed, after plan-back"
    assert summary.ideal_tokens_per_s == pytest.approx(TOKENS / 0.4 * (3 + 1 / 3) / 4)
    assert (summary.healed_step, summary.recovered_step, summary.recovery_latency) == (20, 23, 3)
    assert main(["report", str(run_dir)]) == 0
    text = (run_dir / "report.txt").read_text()
    assert "healing: step 20, reported recovered at step 23 (latency 3 steps, reading 0.99)" in text
    assert "ideal (S/N of best healthy, S = 3 + 1/3)" in text and "healed, after plan-back" in text


def test_report_of_a_run_without_fault(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _write_run(tmp_path / "run", fault=False)
    other = tmp_path / "picture.png"
    assert main(["report", str(tmp_path / "run"), "--png", str(other)]) == 0
    out = capsys.readouterr().out
    assert "no fault injected" in out and other.is_file()


@pytest.mark.parametrize("case", ["missing", "empty_dir", "empty_steps", "bad_line"])
def test_report_fails_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, case: str) -> None:
    run = tmp_path / "run"
    if case != "missing":
        run.mkdir()
    if case == "empty_steps":
        (run / "steps.jsonl").write_text("")
    if case == "bad_line":
        (run / "steps.jsonl").write_text('{"step": 0}\n{"step": 1, "wall_ms": 5, "tokens": 3}\n')
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("resihp report: error: ")
    assert not (run / "timeline.png").exists()


def test_a_killed_rank_splits_the_run_around_the_redone_step(tmp_path: Path) -> None:
    """Steps 3-9 healthy on 4 processes (0.5 s), step 10 killed and redone (2 s), 11-19 on 3 (0.6 s)."""
    run_dir = tmp_path / "killed"
    run_dir.mkdir()
    steps = [{"step": s, "time": 1000.0 + s, "wall_ms": 2000.0 if s == 10 or s < 3 else 500.0 if s < 10 else 600.0,
              "tokens": TOKENS, "P": 2 if s < 10 else 1, "D": 2 if s < 10 else 3, "micro": [4, 4] if s < 10 else [2, 3, 3],
              "migrated": False} for s in range(20)]
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    plan = {"pipeline_degree": 1, "data_degree": 3,
            "replicas": [{"devices": [d], "bounds": [0, 8], "micro_batches": m} for d, m in ((0, 2), (1, 3), (3, 3))]}
    events = [
        {"time": 1010.0, "step": 10, "event": "fault_injected", "kind": "kill", "rank": 2, "start_step": 10},
        {"time": 1010.1, "step": 10, "event": "fault_struck", "kind": "kill", "rank": 2, "at": 50.0},
        {"time": 1010.2, "step": 10, "event": "fail_stop_detected", "rank": 2, "how": "exited", "at": 50.04},
        {"time": 1010.2, "step": 10, "event": "recovery_started", "generation": 1, "members": [0, 1, 3]},
        {"time": 1010.2, "step": 10, "event": "plan_applied", "plan": plan, "migration_seconds": 0.1, "bytes_moved": 2**20},
        {"time": 1010.2, "step": 10, "event": "recovery_finished", "generation": 1, "members": [0, 1, 3], "abort_s": 0.0,
         "regroup_s": 0.2, "plan_s": 0.02, "restore_s": 0.1, "redo_s": 1.5, "total_s": 1.82, "bytes_moved": 2**20},
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = summarize(load_run(run_dir))
    assert (summary.healthy.span, summary.slowed.span, summary.after.span) == ("3-9", "10-10", "11-19")
    assert summary.healthy.tokens_per_s == pytest.approx(TOKENS / 0.5)
    assert summary.ideal_tokens_per_s == pytest.approx(TOKENS / 0.5 * 3 / 4)
    assert summary.detected_after_s == pytest.approx(0.04)
    code = main(["report", str(run_dir)])
    text = (run_dir / "report.txt").read_text()
    assert code == 0 and "rank 2 killed (SIGKILL) inside step 10" in text and "ideal (3/4 of healthy)" in text
    assert "regroup 0.200 s" in text and "step redone in 1.50 s" in text and (run_dir / "timeline.png").stat().st_size > 10_000


def test_a_plan_applied_without_a_migration_flag_in_the_steps_still_has_its_step(tmp_path: Path) -> None:
    """A resumed run's steps.jsonl may not flag the migration; the plan_applied event's step is used."""
    _write_run(tmp_path / "run")
    path = tmp_path / "run" / "steps.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "migrated": False}) + "\n" for r in records))
    summary = summarize(load_run(tmp_path / "run"))
    assert summary.applied_step == 16  # the event's step (not None)


def test_the_planners_best_healthy_plan_is_reported_as_a_prediction_when_the_run_never_ran_it(tmp_path: Path) -> None:
    """healthy_reference says 1x4 is predicted 10% faster than the 2x2 the job ran healthy: the report
    names it with the predicted throughput; the ideal stays on measured throughput."""
    _write_run(tmp_path / "run")
    base = summarize(load_run(tmp_path / "run"))
    two_by_two = {"replicas": [{"devices": [0, 1], "bounds": [0, 4, 8], "micro_batches": 4},
                               {"devices": [2, 3], "bounds": [0, 4, 8], "micro_batches": 4}]}
    one_by_four = {"replicas": [{"devices": [d], "bounds": [0, 8], "micro_batches": 2} for d in range(4)]}
    reference = {"time": 1009.0, "step": 9, "event": "healthy_reference", "plan": one_by_four, "predicted_ms": 1000.0,
                 "current_plan": two_by_two, "current_ms": 1100.0}
    with (tmp_path / "run" / "events.jsonl").open("a") as handle:
        handle.write(json.dumps(reference) + "\n")
    summary = summarize(load_run(tmp_path / "run"))
    healthy = summary.healthy.tokens_per_s
    assert summary.predicted_best_healthy == pytest.approx(healthy * 1.1)
    assert summary.ideal_tokens_per_s == pytest.approx(base.ideal_tokens_per_s)
    assert summary.healthy_reference_plan == "1x4"
    assert "planner's best healthy plan: 1x4, predicted 1.10x the starting plan's speed" in format_table(summary)
    # A reference no faster than the plan the job ran changes nothing.
    reference.update(predicted_ms=1100.0)
    _write_run(tmp_path / "run3")
    with (tmp_path / "run3" / "events.jsonl").open("a") as handle:
        handle.write(json.dumps(reference) + "\n")
    same = summarize(load_run(tmp_path / "run3"))
    assert same.predicted_best_healthy is None and same.ideal_tokens_per_s == pytest.approx(base.ideal_tokens_per_s)


def test_a_slow_link_fault_is_reported_with_its_link_detection_and_no_compute_ideal(tmp_path: Path) -> None:
    _write_run(tmp_path / "run")
    path = tmp_path / "run" / "events.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()]
    events[0] = {**events[0], "kind": "slow_link", "delay_ms": 20.0, "factor": 2.0}
    events[1] = {"time": 1013.0, "step": 13, "event": "slow_link_detected", "rank": 1, "link_speed": 0.04}
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = summarize(load_run(tmp_path / "run"))
    assert summary.detected_step == 13 and summary.detected_speed == 0.04 and summary.detection_latency == 3
    assert summary.applied_step == 15 and summary.ideal_tokens_per_s is None
    text = format_table(summary)
    assert "fault: slow link on rank 1 (+20.0 ms per send) from step 10" in text
    assert "detection: step 13, latency 3 steps, link speed 0.04" in text and "ideal" not in text
