"""A machine is lost under torchrun: the job restarts on the two left and goes on from its checkpoint.

Three torchrun agents on this machine, one process each, ``--nnodes 2:3``, c10d rendezvous on
localhost (agent 0 hosts the rendezvous store), run ``resihp_lightning/testing/elastic_job.py`` (3 replicas,
periodic checkpoints every 4 steps). Once a checkpoint exists, one agent and its worker are SIGKILLed,
as a machine dies. The survivors' collectives fail, their agents re-rendezvous without the dead one
(its keep-alive lapses after 2 s), start the job again on 2 processes, which plans for 2 from the
checkpoint's layer costs (``ElasticRestart``), loads the newest checkpoint and finishes.

Checked: the job finishes on two; the events log has the failure (``worker_failed``), the restart
(``job_restarted``, 3 -> 2) and the new plan (``plan_applied``, reason ``restart``); each row is
trained once, and the steps redone after the restart see the same rows as before the kill (the data
position); and the losses after the restart equal those of a separate 2-process run resumed from the
same checkpoint under the same plan.

Never hangs: every wait has a deadline, each agent runs in its own session and every agent and
worker is SIGKILLed on the way out; the test has a pytest timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resihp_lightning.testing.multiproc import free_port, run_distributed

ROOT = Path(__file__).resolve().parents[3]
JOB = ROOT / "resihp_lightning" / "testing" / "elastic_job.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
STEPS, EVERY, KILL_AFTER_STEP = 12, 4, 9
ROWS_PER_STEP = 24  # elastic_job: M x micro-batch size


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return env


def _agent(run_dir: Path, port: int, index: int, *job_args: str) -> subprocess.Popen:
    conf = f"is_host={'true' if index == 0 else 'false'},last_call_timeout=1,keep_alive_interval=1," \
           "keep_alive_max_attempt=2,join_timeout=60"
    cmd = [str(TORCHRUN), "--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--rdzv-conf", conf,
           "--monitor-interval", "0.1", str(JOB), "--run-dir", str(run_dir), *job_args]
    log = open(run_dir / f"agent{index}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by the kill
            pass
    return out


def _kill_all(agents: list[subprocess.Popen], run_dir: Path) -> None:
    """SIGKILLs every agent's session and every worker any restart started (workers have sessions of their own)."""
    pids = [int(p.read_text()) for p in (run_dir / "pids").glob("*") if p.read_text().strip().isdigit()] \
        if (run_dir / "pids").is_dir() else []
    for pid in [a.pid for a in agents] + pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for agent in agents:
        try:
            agent.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _reference_rank(rank: int, world_size: int, args: list[str]) -> None:
    from resihp_lightning.testing import elastic_job

    elastic_job.main(args)


def _reference(run_dir: Path, ckpt: str, plan: dict) -> list[dict]:
    """A 2-process run resumed from ``ckpt`` under ``plan``: the job's own ``main`` on ranks that see what
    torchrun gives its workers (``TORCHELASTIC_RUN_ID``, no restart yet), forked from the test jobs' server
    instead of two fresh interpreters (the agents' part is what the restarted run above tested)."""
    run_dir.mkdir()
    plan_file = run_dir / "plan.json"
    plan_file.write_text(json.dumps(plan))
    args = ["--run-dir", str(run_dir), "--max-steps", str(STEPS), "--every-n-steps", "1000", "--ckpt", ckpt,
            "--plan", str(plan_file)]
    run_distributed(_reference_rank, 2, timeout=120, env={"TORCHELASTIC_RUN_ID": "reference", "PYTHONWARNINGS": "ignore"},
                    args=args)
    return _jsonl(run_dir / "steps.jsonl")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_lost_machine_restarts_the_job_on_two_from_its_checkpoint(tmp_path):
    run_dir = tmp_path / "elastic"
    run_dir.mkdir()
    port = free_port()
    job_args = ("--max-steps", str(STEPS), "--every-n-steps", str(EVERY), "--keep-last", "20", "--slow-s", "0.3",
                "--pipeline-degree", "1")
    agents: list[subprocess.Popen] = []
    try:
        agents.append(_agent(run_dir, port, 0, *job_args))
        _wait(lambda: _listening(port), 30, "agent 0's rendezvous store")
        agents += [_agent(run_dir, port, i, *job_args) for i in (1, 2)]
        _wait(lambda: any(r["step"] >= KILL_AFTER_STEP for r in _jsonl(run_dir / "steps.jsonl")), 90,
              f"step {KILL_AFTER_STEP} on 3 processes")
        victim = agents[2]
        worker = int((run_dir / "pids" / str(victim.pid)).read_text())
        killed_at = time.time()
        os.kill(worker, signal.SIGKILL)
        os.killpg(victim.pid, signal.SIGKILL)
        for agent in agents[:2]:
            agent.wait(150)
        codes = [agent.returncode for agent in agents[:2]]
        assert codes == [0, 0], "\n".join((run_dir / f"agent{i}.log").read_text()[-2000:] for i in range(2))
    finally:
        _kill_all(agents, run_dir)

    steps = _jsonl(run_dir / "steps.jsonl")
    before = [r for r in steps if r["world"] == 3]
    after = [r for r in steps if r["world"] == 2]
    assert before and after and after[-1]["step"] == STEPS - 1, [(r["step"], r["world"]) for r in steps]
    # No restart before the kill. After it, rank 0's count says nothing: torchrun counts a restart only on
    # an agent whose own workers failed, an agent restarted for the new rendezvous round keeps 0 (the
    # job_restarted event below is the restart's evidence).
    assert {r["restart"] for r in before} == {0}

    events = _jsonl(run_dir / "events.jsonl")
    names = [e["event"] for e in events]
    failed = [e for e in events if e["event"] == "worker_failed"]
    assert failed and all(e["at"] >= killed_at for e in failed), events
    restarted = [e for e in events if e["event"] == "job_restarted"]
    assert len(restarted) == 1 and restarted[0]["world_before"] == 3 and restarted[0]["world_after"] == 2, events
    applied = [e for e in events if e["event"] == "plan_applied" and e.get("reason") == "restart"]
    assert applied and names.index("worker_failed") < names.index("job_restarted") < names.index("plan_applied"), names
    plan = applied[0]["plan"]
    assert sorted(d for r in plan["replicas"] for d in r["devices"]) == [0, 1]
    resumed_from = restarted[0]["checkpoint_step"]
    assert resumed_from % EVERY == 0 and resumed_from >= 8 and after[0]["step"] == resumed_from

    # Data position: each step's rows as last trained; steps redone after the restart saw the same rows.
    final = {r["step"]: r for r in steps}
    rows = [i for s in range(STEPS) for i in final[s]["rows"]]
    assert sorted(final) == list(range(STEPS)) and len(rows) == len(set(rows)) == STEPS * ROWS_PER_STEP
    first_try = {r["step"]: r["rows"] for r in before}
    redone = [r for r in after if r["step"] in first_try]
    assert redone and all(r["rows"] == first_try[r["step"]] for r in redone)

    # The restarted job's losses equal a fresh 2-process resume from the same checkpoint under the same plan.
    reference = {r["step"]: r for r in _reference(tmp_path / "reference", restarted[0]["checkpoint"], plan)}
    assert sorted(reference) == [r["step"] for r in after]
    for record in after:
        assert record["rows"] == reference[record["step"]]["rows"]
        assert record["loss"] == pytest.approx(reference[record["step"]]["loss"], rel=1e-6, abs=1e-7), record["step"]
