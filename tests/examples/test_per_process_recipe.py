"""``examples/torchrun_per_process.sh``: what its ``JOIN`` switch refuses before it starts anything.

The recipe itself runs across namespace machines in tests/machines/test_torchrun_machines.py (the
harness starts the same agents with the same variables); these are its own checks, no Python started.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_per_process.sh"


def _run(tmp_path: Path, **variables: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RANKS_HOST": "node0", "NNODES": "3", "NPROC": "2", "RUN_DIR": str(tmp_path / "run"),
           "PYTHON": "/bin/false", "TORCHRUN": "/bin/false", **variables}
    return subprocess.run(["bash", str(RECIPE)], env=env, capture_output=True, text=True, timeout=30)


def test_join_must_be_0_or_1(tmp_path: Path) -> None:
    done = _run(tmp_path, JOIN="yes")
    assert done.returncode == 2 and "JOIN=yes: allowed are 1" in done.stderr, done


def test_a_joining_machine_with_etcd_starts_no_member_and_needs_the_jobs_password_file(tmp_path: Path) -> None:
    done = _run(tmp_path, JOIN="1", ETCD_MEMBERS="node0,node1,node2")
    assert done.returncode == 2 and "etcd-job.pw is missing" in done.stderr, done
    assert not list((tmp_path / "run").glob("etcd-*.log"))  # no member was started
