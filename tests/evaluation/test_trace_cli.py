"""`resihp trace run` / `resihp trace generate` with good and bad trace files."""

from __future__ import annotations

import json

import pytest

from resihp_lightning.cli import main


def _write(tmp_path, data, name="trace.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


GOOD = {"name": "log", "gpus": 16, "duration_s": 1800, "gpus_per_node": 8, "events": [
    {"kind": "fail_slow", "start_s": 100, "duration_s": 600, "gpu": 3, "slowdown": 2.0},
    {"kind": "fail_stop", "start_s": 900, "duration_s": None, "gpu": 12},
    {"kind": "comm_slow", "start_s": 300, "duration_s": 60, "node": 1, "slowdown": 4.0},
]}


def test_run_prints_every_policy(tmp_path, capsys):
    path = _write(tmp_path, GOOD)
    assert main(["trace", "run", path, "--seq-len", "8192", "--policies", "none,joint_shared,oracle", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["policies"]) == ["none", "joint_shared", "oracle"]
    tokens = {k: v["tokens_per_s"] for k, v in out["policies"].items()}
    assert tokens["none"] < tokens["joint_shared"] <= tokens["oracle"] <= out["healthy_tokens_per_s"]


def test_run_reads_yaml(tmp_path, capsys):
    pytest.importorskip("yaml")
    text = "gpus: 16\nduration_s: 600\nevents:\n  - {kind: fail_slow, start_s: 10, duration_s: 100, gpu: 0, slowdown: 1.5}\n"
    path = _write(tmp_path, text, "trace.yaml")
    assert main(["trace", "run", path, "--seq-len", "8192", "--policies", "none"]) == 0
    assert "none" in capsys.readouterr().out


@pytest.mark.parametrize("events, message", [
    ([{"kind": "fail_slow", "start_s": 1, "duration_s": 5, "gpu": 99, "slowdown": 2}], r"events\[0\].*gpu must be an integer in 0..15"),
    ([{"kind": "fail_slow", "start_s": 1, "gpu": 0, "slowdown": 0.5}], r"slowdown must be a number >= 1"),
    ([{"kind": "crash", "start_s": 1, "gpu": 0}], r"events\[0\].kind must be one of fail_slow, fail_stop, comm_slow"),
    ([{"kind": "fail_stop", "start_s": 1, "gpu": 0, "slowdown": 2}], r"unknown field 'slowdown' in events\[0\] \(fail_stop\)"),
    ([{"kind": "comm_slow", "start_s": 1, "duration_s": 5, "slowdown": 2}], r"missing the field 'node'"),
    ([{"kind": "fail_stop", "start_s": -3, "gpu": 0}], r"start_s must be a number of seconds >= 0"),
])
def test_bad_events_are_named(tmp_path, capsys, events, message):
    path = _write(tmp_path, {"gpus": 16, "duration_s": 100, "events": events})
    assert main(["trace", "run", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("resihp trace: error:")
    assert __import__("re").search(message, err), err


def test_bad_files_and_options(tmp_path, capsys):
    assert main(["trace", "run", str(tmp_path / "missing.json")]) == 2
    assert "cannot read trace file" in capsys.readouterr().err
    assert main(["trace", "run", _write(tmp_path, "{not json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["trace", "run", _write(tmp_path, {"gpus": 16, "events": []})]) == 2
    assert "missing the field 'duration_s'" in capsys.readouterr().err
    assert main(["trace", "run", _write(tmp_path, {"gpus": 16, "duration_s": 10, "events": [], "hours": 1})]) == 2
    assert "unknown field 'hours' in trace" in capsys.readouterr().err
    assert main(["trace", "run", _write(tmp_path, GOOD), "--policies", "nope"]) == 2
    assert "--policies" in capsys.readouterr().err
    assert main(["trace", "run", _write(tmp_path, GOOD), "--tp", "3"]) == 2
    assert "TP groups of 3" in capsys.readouterr().err


def test_generate_then_run(tmp_path, capsys):
    out = str(tmp_path / "gen.json")
    assert main(["trace", "generate", "fail-stop", "--gpus", "16", "--hours", "1", "--seed", "4", "-o", out]) == 0
    data = json.loads(open(out).read())
    assert data["gpus"] == 16 and [e["start_s"] for e in data["events"]] == [1800.0]
    capsys.readouterr()
    assert main(["trace", "run", out, "--seq-len", "8192", "--policies", "recycle,joint_per_replica"]) == 0
    assert "joint_per_replica" in capsys.readouterr().out
    assert main(["trace", "generate", "storm", "-o", out]) == 2
    assert "scenario" in capsys.readouterr().err
