"""The emulated srun (resihp_lightning/testing/fake_slurm.py) on this host: two slurmd daemons stand for two nodes.

The namespace test (tests/machines/test_srun_machines.py) runs it across machines; here, without root,
what a task is given, how srun ends, a lost node and refused options.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resihp_lightning.testing.fake_slurm import (
    BIN,
    NODE_TIMEOUT_ENV,
    SPOOL_ENV,
    SrunError,
    compress_hostlist,
    expand_hostlist,
    parse_srun,
    read_exits,
    step_dirs,
)

ROOT = Path(__file__).resolve().parents[2]


def test_host_lists_expand_and_compress_as_slurm_writes_them():
    assert expand_hostlist("node[0-2,5],gpu01,x[08-10]") == ["node0", "node1", "node2", "node5", "gpu01", "x08",
                                                              "x09", "x10"]
    assert compress_hostlist(["node0", "node1", "node2", "node5"]) == "node[0-2,5]"
    assert expand_hostlist(compress_hostlist(["n0", "n1"])) == ["n0", "n1"]


def test_srun_options_are_read_up_to_the_command_and_others_refused_by_name():
    options = parse_srun(["--overlap", "-N", "3", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "python", "-N", "5"])
    assert (options.nodes, options.ntasks_per_node, options.kill_on_bad_exit) == (3, 1, False)
    assert options.argv == ("python", "-N", "5")
    assert parse_srun(["-K", "true"]).kill_on_bad_exit
    with pytest.raises(SrunError, match="--exclusive is not emulated"):
        parse_srun(["--exclusive", "true"])
    with pytest.raises(SrunError, match="no command"):
        parse_srun(["--nodes", "2"])


@pytest.fixture
def two_nodes(tmp_path):
    """Two slurmd daemons on this host, nodes n0 and n1, and the batch script's environment."""
    spool = tmp_path / "spool"
    spool.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{BIN}:{os.environ['PATH']}", SPOOL_ENV: str(spool),
           "RESIHP_FAKE_SLURM_PYTHON": sys.executable, NODE_TIMEOUT_ENV: "1", "SLURM_JOB_ID": "77",
           "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_NTASKS_PER_NODE": "2"}
    for name in ("n0", "n1"):
        (tmp_path / name).mkdir()
    daemons = {name: subprocess.Popen([sys.executable, "-m", "resihp_lightning.testing.fake_slurm", "slurmd", str(spool),
                                       name], env={**env, "TMPDIR": str(tmp_path / name)}) for name in ("n0", "n1")}
    yield spool, env, daemons
    for daemon in daemons.values():
        daemon.kill()
        daemon.wait()


def _srun(env: dict, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["srun", *argv], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(60)
def test_each_task_gets_srun_variables_and_srun_ends_with_the_highest_status(two_nodes, tmp_path):
    spool, env, _ = two_nodes
    show = 'echo "$SLURM_PROCID $SLURM_LOCALID $SLURM_NODEID $SLURMD_NODENAME $SLURM_NTASKS $SLURM_NNODES $TMPDIR"'
    result = _srun(env, "--kill-on-bad-exit=0", "sh", "-c", f'{show}; exit "$SLURM_PROCID"')
    assert result.returncode == 3, result.stderr
    lines = sorted(result.stdout.split("\n")[:-1])
    assert lines == [f"{t} {t % 2} {t // 2} n{t // 2} 4 2 {tmp_path / f'n{t // 2}'}" for t in range(4)]
    assert sorted(line for line in result.stderr.splitlines() if "srun: error" in line) == [
        f"srun: error: n{t // 2}: task {t}: Exited with exit code {t}" for t in (1, 2, 3)]
    # --nodes takes the first nodes of the allocation; a second step gets the next step id.
    one = _srun(env, "--nodes", "1", "--ntasks-per-node", "1", "sh", "-c", 'echo "$SLURM_STEP_ID $SLURMD_NODENAME"')
    assert (one.returncode, one.stdout) == (0, "1 n0\n")
    assert [p.name for p in step_dirs(spool)] == ["step-0", "step-1"]


@pytest.mark.timeout(60)
def test_kill_on_bad_exit_1_kills_the_others_and_signals_reach_the_tasks(two_nodes):
    spool, env, _ = two_nodes
    result = _srun(env, "--kill-on-bad-exit=1", "sh", "-c", '[ "$SLURM_PROCID" = 1 ] && exit 4; exec sleep 30')
    assert result.returncode == 128 + signal.SIGKILL
    statuses = {t: e["status"] for t, e in read_exits(step_dirs(spool)[-1]).items()}
    assert statuses == {0: -signal.SIGKILL, 1: 4, 2: -signal.SIGKILL, 3: -signal.SIGKILL}
    # SIGTERM to srun goes to every task.
    client = subprocess.Popen(["srun", "sleep", "30"], env=env, cwd=ROOT)
    deadline = time.monotonic() + 20
    while len(list((spool / "step-1").glob("task-*.out"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    client.send_signal(signal.SIGTERM)
    assert client.wait(20) == 128 + signal.SIGTERM


@pytest.mark.timeout(60)
def test_a_node_whose_slurmd_is_gone_counts_as_lost_and_the_step_ends(two_nodes, tmp_path):
    spool, env, daemons = two_nodes
    sleeper = '[ "$SLURMD_NODENAME" = n1 ] && echo $$ > "$TMPDIR/task-$SLURM_PROCID.pid" && exec sleep 30; exit 0'
    client = subprocess.Popen(["srun", "sh", "-c", sleeper],
                              env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    pids = [tmp_path / "n1" / f"task-{task}.pid" for task in (2, 3)]
    while (len(read_exits(spool / "step-0")) < 2 or not all(p.exists() and p.read_text() for p in pids)) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    daemons["n1"].kill()  # the node's daemon gone: its beat stops (its sleeping tasks are left to the fixture's end)
    _, stderr = client.communicate(timeout=20)
    assert client.returncode == 1
    assert "srun: error: n1: task 2: Node failure on n1" in stderr and "task 3: Node failure on n1" in stderr
    for pid in pids:  # the lost node's tasks, still sleeping
        os.kill(int(pid.read_text()), signal.SIGKILL)
