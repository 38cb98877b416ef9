"""The recipes' shell on its own (no SLURM, no machines): they parse, and a bad ETCD_NODES is refused by name.

The recipes run end to end on namespace machines in tests/machines/test_srun_machines.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ["slurm_in_process.sbatch", "slurm_finetune.sbatch", "torchrun_multinode.sh", "torchrun_per_process.sh",
           "torchrun_one_machine.sh"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_is_valid_bash(recipe):
    result = subprocess.run(["bash", "-n", str(ROOT / "examples" / recipe)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("value", ["4", "2", "5", "x"])
def test_etcd_nodes_must_be_3_or_5_and_at_most_the_allocation(tmp_path, value):
    env = {**os.environ, "ETCD_NODES": value, "SLURM_NNODES": "4", "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(ROOT),
           "RUN_DIR": str(tmp_path / "run"), "PATH": "/usr/bin:/bin"}  # no srun: nothing may start
    result = subprocess.run(["bash", str(ROOT / "examples" / "slurm_in_process.sbatch")], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"ETCD_NODES={value}: give 3 or 5, at most the job's 4 nodes"), result.stderr
