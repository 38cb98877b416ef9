"""examples/finetune.py end to end: 4 gloo processes launched by the script itself, and bad input."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "finetune.py"
TINY = ROOT / "examples" / "configs" / "tiny_test.yaml"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("RESIHP_RUN_DIR", None)
    return subprocess.run([sys.executable, str(SCRIPT), "--config", str(TINY), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_rank_0_killed_mid_step_under_the_scripts_own_launcher_costs_one_step_and_the_command_lives_on(tmp_path: Path) -> None:
    """Lightning's launcher (supervised) starts ranks 0..3; killing rank 0 inside a step must end neither the
    job nor the command the user typed, which is no rank: it streams the survivors' output and exits 0.

    Six micro-batches, so that the three survivors run 2 + 2 + 2 and beat two survivors' 3 + 3: with the
    config's four, three replicas (1 + 1 + 2) compute no faster than two (2 + 2), and any measured all-reduce
    cost rightly makes the planner leave one survivor idle.
    """
    run_dir = tmp_path / "run"
    result = _run("--run_dir", str(run_dir), "--strategy.micro_batches", "6", "--fault.kind", "kill",
                  "--fault.rank", "0", "--fault.start_step", "3", "--fault.micro_batch", "2", timeout=230)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(6))  # no step lost, none repeated
    assert [s["P"] * s["D"] for s in steps] == [4, 4, 4, 3, 3, 3]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    for kind in ("fault_struck", "fail_stop_detected", "recovery_started", "plan_applied", "recovery_finished"):
        assert kind in kinds, kinds
    finished = [e for e in events if e["event"] == "recovery_finished"]
    assert [(e["members"], e["step"]) for e in finished] == [([1, 2, 3], 3)]
    # The report and the summary come from the new rank 0 (launch rank 1), after the first one died.
    report = (run_dir / "report.txt").read_text()
    assert "killed (SIGKILL) inside step 3" in report
    # What happened, from the events: the death, its recovery and the smaller world; the injection is a note.
    # "exited", or "exited (reported by rank r)" when the reporter learnt it from a survivor that saw the exit first.
    assert "what happened (6 steps, 4 -> 3 processes" in report and "step 3: rank 0 lost (exited" in report
    assert "recovered in-process in" in report and "injected: rank 0 killed inside step 3" in report
    assert "trained 6 steps" in result.stdout and "on 3 processes" in result.stdout
    # The command is no rank: its supervisor saw rank 0 die, waited for the survivors and exited with the job's status.
    assert "[resihp supervisor] local rank 0 ended (killed by SIGKILL)" in result.stderr
    assert "the job's exit status is 0" in result.stderr


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("finetune: error: ")
    return lines[0]


def test_unknown_config_key_is_one_line(tmp_path: Path) -> None:
    line = _one_line_error(_run("--run_dir", str(tmp_path / "r"), "--detector.windw", "3", timeout=60))
    assert "unknown config key 'detector.windw'" in line
    assert not (tmp_path / "r").exists()


def test_invalid_option_value_is_one_line(tmp_path: Path) -> None:
    line = _one_line_error(_run("--run_dir", str(tmp_path / "r"), "--fault.kind", "boom", timeout=60))
    assert "fault.kind" in line and "'slow'" in line


def _finetune_module():
    spec = importlib.util.spec_from_file_location("finetune_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _in_process_error(args: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the script's main() here (cheaper than a new interpreter) and returns its one error line."""
    monkeypatch.delenv("RESIHP_RUN_DIR", raising=False)
    finetune = _finetune_module()
    with pytest.raises(SystemExit) as exit_info:
        finetune.main(["--config", str(TINY), *args])
    monkeypatch.delenv("RESIHP_RUN_DIR", raising=False)
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("finetune: error: "), lines
    return lines[0]


def test_missing_checkpoint_dir_and_unsupported_architecture(tmp_path: Path, capsys, monkeypatch) -> None:
    line = _in_process_error(["--model.model_path", str(tmp_path / "nowhere")], capsys, monkeypatch)
    assert "nowhere" in line and "not a directory" in line
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    line = _in_process_error(["--model.model_path", str(gpt2)], capsys, monkeypatch)
    assert "gpt2" in line and "llama" in line


def test_empty_dataset_is_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    empty = tmp_path / "corpus"
    empty.mkdir()
    line = _in_process_error(["--data.source", str(empty), "--run_dir", str(tmp_path / "r")], capsys, monkeypatch)
    assert "dataset is empty" in line
    assert not (tmp_path / "r").exists()


def test_shared_partition_under_controller_names_its_new_place(tmp_path: Path, capsys, monkeypatch) -> None:
    moved = tmp_path / "moved.yaml"
    moved.write_text("controller:\n  shared_partition: true\n")
    for args in (["--config", str(moved)], ["--controller.shared_partition", "true"]):
        line = _in_process_error([*args, "--run_dir", str(tmp_path / "r")], capsys, monkeypatch)
        assert "`controller.shared_partition` was removed; use `planner.shared_partition`" in line
    assert not (tmp_path / "r").exists()


def test_unknown_start_plan_is_named_with_the_choices(tmp_path: Path, capsys, monkeypatch) -> None:
    line = _in_process_error(["--strategy.start", "best", "--run_dir", str(tmp_path / "r")], capsys, monkeypatch)
    assert "strategy.start" in line and "best" in line and "planned" in line


def test_every_option_of_the_script_has_help_text() -> None:
    """``--help`` documents every option, the optional sections (``--fault.help`` ...) included: the text comes
    from the config dataclasses' docstrings, which jsonargparse reads with docstring-parser."""
    from jsonargparse import ArgumentParser, ActionConfigFile

    from resihp_lightning.callbacks.faults.slowdowns import FaultConfig
    from resihp_lightning.callbacks.restart.periodic_checkpoint import CheckpointConfig
    from resihp_lightning.failstop.fail_stop_config import FailStopConfig

    parsers = [_finetune_module().build_parser()]
    for config_class in (FaultConfig, CheckpointConfig, FailStopConfig):
        section = ArgumentParser()
        section.add_class_arguments(config_class, "section")
        parsers.append(section)
    undocumented, options = [], 0
    for parser in parsers:
        for action in parser._actions:
            if type(action).__name__ != "ActionTypeHint" or isinstance(action, ActionConfigFile):
                continue
            options += 1
            if not (action.help or "").strip():
                undocumented.append(action.dest)
    assert options > 100 and not undocumented, undocumented


def test_a_tensor_parallel_run_names_the_options_it_needs_off(tmp_path: Path, capsys, monkeypatch) -> None:
    line = _in_process_error(["--strategy.tensor_degree", "2", "--run_dir", str(tmp_path / "r"), "--strategy.start",
                              "planned"], capsys, monkeypatch)
    assert "strategy.tensor_degree 2 cannot start from a planned layout" in line and "--strategy.start uniform" in line
    line = _in_process_error(["--strategy.tensor_degree", "0"], capsys, monkeypatch)
    assert "strategy.tensor_degree" in line and "an integer >= 1" in line


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_readme_tensor_parallel_command_trains(tmp_path: Path) -> None:
    """The README's TP command: the tiny config (its 2x slowdown of rank 1 from step 3 included) on 2 groups of 2.

    It also stands for the tiny config's plain run: its steps, events, report and timeline are the
    script's, whatever the layout (the kill test runs the same config without TP)."""
    run_dir = tmp_path / "run"
    result = _run("--run_dir", str(run_dir), "--strategy.tensor_degree", "2", "--model.scratch.num_key_value_heads", "2",
                  timeout=230)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(6)) and all(math.isfinite(s["loss"]) for s in steps)
    assert steps[0]["loss"] < math.log(260) + 1.0  # a sane start for a 260-token vocabulary
    assert all(s["tokens"] > 0 and s["wall_ms"] > 0 for s in steps)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    # The plan starts with 2 groups; the injected slow member may be dropped from its group (a regroup
    # is a plan change on the record) if the detector names it within the 6 steps.
    assert steps[0]["P"] * steps[0]["D"] == 2
    if any(s["P"] * s["D"] != 2 for s in steps):
        assert any(e["event"] == "plan_applied" for e in events), [(s["P"], s["D"]) for s in steps]
    assert [(e["rank"], e["step"], e["factor"]) for e in events if e["event"] == "fault_injected"] == [(1, 3, 2.0)]
    assert (run_dir / "timeline.png").stat().st_size > 10_000
    assert "slowed, before re-plan" in (run_dir / "report.txt").read_text()
    assert "trained 6 steps" in result.stdout
    assert "on 4 processes (2 tensor-parallel groups of 2)" in result.stdout
