"""`resihp plan` and `resihp simulate`: output, errors (one line, no traceback), console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resihp_lightning import cli
from resihp_lightning.plan import Plan, Problem, evaluate

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "problems"
DESIGN = EXAMPLES / "design_example.json"


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_has_the_documented_fields(capsys):
    code, out, err = _run(capsys, "plan", str(DESIGN), "--solver", "exact", "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert set(data) == {"pipeline_degree", "data_degree", "replicas", "iteration_ms", "status", "solver", "solve_seconds", "gap"}
    assert data["gap"] == 0.0
    for replica in data["replicas"]:
        assert set(replica) == {"devices", "bounds", "micro_batches"}
    problem = Problem.load(DESIGN)
    plan = Plan.from_dict(data)
    assert data["iteration_ms"] == pytest.approx(evaluate(problem, plan).iteration_ms)
    assert data["status"] == "optimal" and data["solver"] == "exact"
    assert sum(r["micro_batches"] for r in data["replicas"]) == problem.micro_batches


def test_plan_table_shows_stages_and_efficiency(capsys):
    code, out, _ = _run(capsys, "plan", str(DESIGN), "--solver", "exact")
    assert code == 0
    for text in ("replica", "stage", "device", "speed", "layers", "stage ms", "predicted iteration time",
                 "healthy time", "ideal time", "E = T_ideal / T_plan"):
        assert text in out
    efficiency = float(out.strip().splitlines()[-1].split()[-1])
    assert 0 < efficiency <= 1.0


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.json")))
def test_every_example_problem_plans(capsys, name):
    code, out, err = _run(capsys, "plan", str(EXAMPLES / name), "--solver", "exact", "--json")
    assert code == 0, err
    problem = Problem.load(EXAMPLES / name)
    assert Plan.from_dict(json.loads(out)).data_degree >= 1
    assert json.loads(out)["iteration_ms"] == pytest.approx(evaluate(problem, Plan.from_dict(json.loads(out))).iteration_ms)


def test_demo_problem_matches_the_brief():
    problem = Problem.load(EXAMPLES / "two_slow_of_sixteen.json")
    assert problem.num_devices == 16 and problem.num_layers == 32
    assert sorted(d.speed for d in problem.devices)[:3] == [0.5, 0.5, 1.0]
    # Memory matters: the whole model does not fit one device, so P = 1 is out.
    assert sum(l.static_mb for l in problem.layers) > min(d.memory_mb for d in problem.devices)


def test_slow_link_example_routes_around_the_link(capsys):
    """examples/problems/slow_link_of_sixteen.json: device 9's links at 0.1, p2p 0.5 ms."""
    path = EXAMPLES / "slow_link_of_sixteen.json"
    problem = Problem.load(path)
    assert [d.id for d in problem.devices if d.link_speed != 1.0] == [9]
    code, out, _ = _run(capsys, "plan", str(path), "--solver", "exact", "--json")
    assert code == 0
    plan = Plan.from_dict(json.loads(out))
    # Device 9 holds a last stage (only the extra of its incoming transfer is its own), and its
    # replica runs fewer micro-batches; the healthy layout would be much slower on these links.
    holding = [r for r in plan.replicas if 9 in r.devices]
    assert len(holding) == 1 and holding[0].devices[-1] == 9
    assert holding[0].micro_batches < max(r.micro_batches for r in plan.replicas)
    healthy = Plan.uniform(list(range(16)), 32, 4, 64)
    assert plan.iteration_ms < 0.85 * evaluate(problem, healthy).iteration_ms
    code, out, _ = _run(capsys, "plan", str(path), "--solver", "exact")
    assert code == 0 and " link " in out.splitlines()[1] and "all devices and links at speed 1.0" in out
    code, out, _ = _run(capsys, "plan", str(DESIGN), "--solver", "exact")
    assert " link " not in out.splitlines()[1]  # no link column without link speeds


def _write(tmp_path, data, name="problem.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _design() -> dict:
    return json.loads(DESIGN.read_text())


def _bad_inputs(tmp_path):
    unknown = _design() | {"gpus": 3}
    negative = _design()
    negative["devices"][1]["speed"] = -0.5
    memory = _design()
    for device in memory["devices"]:
        device["memory_mb"] = 500
    link = _design()
    link["devices"][0]["link_speed"] = 0
    return {
        "unknown field": (_write(tmp_path, unknown, "u.json"), "gpus"),
        "negative speed": (_write(tmp_path, negative, "n.json"), "speed"),
        "zero link speed": (_write(tmp_path, link, "l.json"), "devices[0].link_speed"),
        "bad json": (_write(tmp_path, "{not json", "b.json"), "JSON"),
        "missing file": (str(tmp_path / "nope.json"), "nope.json"),
        "memory": (_write(tmp_path, memory, "m.json"), "memory"),
    }


@pytest.mark.parametrize("case", ["unknown field", "negative speed", "zero link speed", "bad json", "missing file", "memory"])
def test_bad_input_exits_with_one_line(capsys, tmp_path, case):
    path, needle = _bad_inputs(tmp_path)[case]
    code, out, err = _run(capsys, "plan", path, "--solver", "exact")
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert needle in lines[0]


def test_bad_time_limit_names_the_option(capsys):
    code, _, err = _run(capsys, "plan", str(DESIGN), "--solver", "exact", "--time-limit", "-1")
    assert code == 2 and "time_limit" in err and len(err.strip().splitlines()) == 1


def test_simulate_compares_formula_and_schedule(capsys, tmp_path):
    code, out, _ = _run(capsys, "plan", str(DESIGN), "--solver", "exact", "--json")
    plan_path = _write(tmp_path, out, "plan.json")
    code, out, err = _run(capsys, "simulate", str(DESIGN), plan_path, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["simulated_ms"] <= data["formula_ms"] + 1e-9
    assert data["formula_ms"] == pytest.approx(json.loads(Path(plan_path).read_text())["iteration_ms"])
    code, out, _ = _run(capsys, "simulate", str(DESIGN), plan_path)
    assert code == 0 and "formula" in out and "simulated" in out
    bad = _write(tmp_path, {"replicas": [{"devices": [0], "bounds": [0, 2], "micro_batches": 16}]}, "bad.json")
    code, _, err = _run(capsys, "simulate", str(DESIGN), bad)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_console_script_runs_without_heavy_imports(tmp_path):
    script = Path(sys.executable).parent / "resihp"
    assert script.exists(), "the resihp console script is not installed in this environment"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [str(script), "plan", str(DESIGN), "--solver", "exact", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "optimal"
    bad = _write(tmp_path, _design() | {"gpus": 1})
    done = subprocess.run([str(script), "plan", bad], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    probe = "import sys, resihp_lightning.cli as c; c.build_parser(); print(sorted(m for m in ('torch', 'lightning', 'deepspeed', 'ortools') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == "[]"
