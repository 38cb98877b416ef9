"""The SLURM restart recipe ``examples/slurm_finetune.sbatch`` on two namespace machines, srun emulated.

The recipe runs ``examples/torchrun_multinode.sh`` under srun, one torchrun agent per node; the harness
(``resihp_lightning/testing/slurm_machines.py``) runs the batch script on machine 0 as SLURM would, with an
emulated ``srun`` (see ``tests/machines/test_srun_machines.py`` for the in-process recipe). Nothing here rests
on measured time, so this file runs with the bulk of the suite, not among the timing files.
"""

from __future__ import annotations

import json

import pytest

from resihp_lightning.testing.machines import Machines, unavailable_reason
from resihp_lightning.testing.slurm_machines import SbatchJob

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]


@pytest.mark.timeout(240)
def test_the_restart_recipe_runs_one_torchrun_agent_per_node_as_typed(tmp_path):
    """``sbatch examples/slurm_finetune.sbatch`` (the restart recipe: srun starts ``examples/torchrun_multinode.sh``,
    one torchrun agent per node, ``--nnodes N-1:N``, ``--nproc-per-node`` from ``--gpus-per-node``) with the tiny
    config on 2 machines x 1 "GPU": the agents meet at the first node's rendezvous, the example trains on 2
    processes and every command ends with 0.
    (A lost machine restarts the job from its checkpoint: tested on one host in
    ``tests/callbacks/restart/test_elastic_restart.py``, measured on the machines in ``docs/machines.md``.)"""
    run_dir = tmp_path / "run"
    argv = ["--nodes", "2", "--gpus-per-node", "1", "examples/slurm_finetune.sbatch", "--trainer.accelerator", "cpu",
            "--trainer.max_steps", "2", "--fault", "null"]
    env = {"CONFIG": "examples/configs/tiny_test.yaml", "RUN_DIR": str(run_dir)}
    with Machines(2) as machines, SbatchJob(machines, run_dir, argv, env=env) as job:
        assert job.wait_batch(180) == 0, job.agent_log()[-3000:]
        step = job.step_of("torchrun_multinode.sh")
        assert step is not None and step.nodes == ("node0", "node1") and step.per_node == 1
        assert [e["status"] for _, e in sorted(job.task_exits(step).items())] == [0, 0]
        steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
        assert [(s["step"], s["P"] * s["D"]) for s in steps] == [(0, 2), (1, 2)]
        assert "trained 2 steps" in job.agent_log() and "on 2 processes" in job.agent_log()
