"""The SLURM recipe ``examples/slurm_in_process.sbatch`` on three namespace machines, srun emulated.

SLURM is not installed here: :mod:`resihp_lightning.testing.slurm_machines` runs the batch script itself
on machine 0 (the first node, as SLURM does) with an emulated ``srun`` (:mod:`resihp_lightning.testing.fake_slurm`:
one *slurmd* per machine starts that node's tasks with the variables srun gives them; ``--kill-on-bad-exit=0``:
nobody kills the others when one dies). The user's command is ``ETCD_NODES=3 sbatch --nodes 3
--ntasks-per-node 2 examples/slurm_in_process.sbatch ...``, with ``SCRIPT`` naming the exactness job
(``resihp_lightning/testing/machines_job.py``, 2 stages x 3 replicas, each step ~2 s) in place of
``examples/finetune.py``: the recipe starts one etcd member per machine as a job step, makes the job's user,
and starts the training step, one task per "GPU".

One launch, two faults: task 2 (machine 1) SIGKILLed inside step 2, then machine 0's link cut 0.7 s
after step 3's record (inside step 4, or 5 when the five survivors step faster). Asserted: each costs the survivors one step in-process (the dead task is named at once by its
machine's neighbour; machine 0's tasks are evicted within the heartbeat timeout plus an etcd leader
election); the three survivors finish with the one-process reference's losses and weights (1e-6) and exit
0; machine 0's tasks, cut off, end by themselves with the restart status (75) and write no result; srun
reports every failed task and the batch script ends with srun's status after stopping the etcd step.

Never hangs: each wait has a deadline and the machines' clean-up SIGKILLs every process.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from resihp_lightning.testing.etcd_cluster import etcd_unavailable_reason
from resihp_lightning.testing.machines import Machines, unavailable_reason
from resihp_lightning.testing.slurm_machines import SbatchJob
from resihp_lightning.testing.toy_jobs import reference_fit

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

STEPS = 6
#: Seconds into a step (after the previous step's record) when a fault strikes.
INTO_STEP = 0.7
#: The heartbeat timeout (the tests' 3 s: the default 1 s evicts a healthy rank at start-up now and then here).
DETECT_S = 3.0
#: A cut-off task blocked this long in a collective, the store lost, ends itself (fail_stop.join_timeout_s).
JOIN_S = 10.0
#: Machine 0's etcd member may lead: the others elect a new leader first (docs/machines.md).
M0_SLACK_S = 6.0
JOB = "resihp_lightning/testing/machines_job.py"


def _fault_inside_step(job: SbatchJob, step: int) -> tuple[float, float]:
    """Waits for step ``step - 1``'s record, then ``INTO_STEP``; the (monotonic, Unix) time of the fault."""
    job.wait_for(lambda: job.max_step() >= step - 1, 240, f"step {step - 1}")
    time.sleep(INTO_STEP)
    return time.monotonic(), time.time()


def _rank(tag: str) -> int:
    return int(tag.split("-")[1])


def _assert_exact(results: dict[str, dict]) -> None:
    losses, _, params = reference_fit(STEPS, None)
    for tag, result in results.items():
        assert len(result["losses"]) == STEPS, (tag, result["losses"])
        for step, (got, want) in enumerate(zip(result["losses"], losses, strict=True)):
            assert abs(got - want) < 1e-6, f"{tag} step {step}: {got} vs reference {want}"
        for key, want in params.items():
            assert torch.allclose(torch.tensor(result["state"][key]), want, atol=1e-6, rtol=0), (tag, key)


def _recoveries(job: SbatchJob, failed: set[int]) -> list[dict]:
    return [e for e in job.events() if e["event"] == "recovery_started" and set(map(int, e["failed"])) == failed]


def _last_step(job: SbatchJob, ranks: set[int]) -> int:
    return max(r["step"] for tag, rows in job.steps().items() if _rank(tag) in ranks for r in rows)


@pytest.mark.timeout(420)
@pytest.mark.skipif(etcd_unavailable_reason() is not None, reason=str(etcd_unavailable_reason()))
def test_the_sbatch_recipe_on_etcd_loses_a_task_then_machine_0_each_for_one_step(tmp_path):
    """``ETCD_NODES=3 sbatch examples/slurm_in_process.sbatch``: task 2 killed inside step 2, machine 0's link
    cut during a later step; the three survivors finish exactly, in-process, and every task and step ends."""
    run_dir = tmp_path / "run"
    argv = ["--nodes", "3", "--ntasks-per-node", "2", "examples/slurm_in_process.sbatch", "--steps", str(STEPS),
            "--step-s", "2.0", "--detect-timeout-s", str(DETECT_S), "--join-timeout-s", str(JOIN_S)]
    env = {"ETCD_NODES": "3", "SCRIPT": JOB, "RUN_DIR": str(run_dir)}
    with Machines(3) as machines, SbatchJob(machines, run_dir, argv, env=env) as job:
        killed_at, _ = _fault_inside_step(job, 2)
        start = next(s for s in job.starts() if s["host"] == "node1" and s["local_rank"] == 0)
        os.kill(machines[1].host_pid(start["pid"]), signal.SIGKILL)
        victim = _rank(start["tag"])
        job.wait_for(lambda: _recoveries(job, {victim}), 60, "the recovery from the killed task")
        cut_at, cut_wall = _fault_inside_step(job, 4)
        machines[0].cut_link()
        cut_done = time.monotonic()  # (taking the link down took a moment: a step may have ended meanwhile)
        results = job.wait_for(lambda: (r := job.results()) and len(r) >= 3 and r, 120, "the three survivors' results")
        _assert_exact(results)
        assert {_rank(tag) for tag in results} == {3, 4, 5}
        # Known bug (docs/machines.md): a survivor still in the last step's collectives when the others finish
        # evicts them (a recovery "at step 6") and may SIGKILL the finished ones on its machine. Allowed only so.
        at_the_end = {int(r) for res in results.values() if res["recovery"]["step"] >= STEPS
                      for r in res["recovery"]["failed"]}
        in_training = [r for r in results.values() if r["recovery"]["step"] < STEPS]
        assert in_training and all(r["world"] == 3 for r in in_training)

        # srun's layout: task ids are the ranks; no MASTER_ADDR (the strategy takes SLURM's first node).
        assert sorted(_rank(s["tag"]) for s in job.starts()) == list(range(6))
        assert all(_rank(s["tag"]) == 2 * int(s["host"][-1]) + s["local_rank"] for s in job.starts())
        assert {s["master_addr"] for s in job.starts()} == {None}

        # The dead task: named "exited" by its machine's neighbour within the heartbeat timeout; its step redone.
        found = [e for e in job.events() if e["event"] == "fail_stop_detected" and int(e["rank"]) == victim]
        assert found and all(e["how"].startswith("exited") for e in found), found
        assert 0 < min(e["at"] for e in found) - killed_at < DETECT_S, (found, killed_at)
        first = _recoveries(job, {victim})
        assert len(first) == 1 and first[0]["step"] == _last_step(job, {victim}) + 1, first

        # Machine 0 cut off: ranks 0 and 1 evicted (silent) within the heartbeat timeout and an election; the
        # survivors redo the step they never finished.
        second = _recoveries(job, {0, 1})
        assert len(second) == 1 and second[0]["step"] == _last_step(job, {0, 1}) + 1 >= 4, second
        for result in in_training:
            recovery = result["recovery"]
            assert sorted(map(int, recovery["failed"])) == [0, 1] and sorted(recovery["members"]) == [3, 4, 5]
            assert all(how.startswith(("silent", "left out")) for how in recovery["failed"].values()), recovery
            assert 0 < recovery["detected_at"] - cut_at < DETECT_S + M0_SLACK_S, recovery
        redone = min(r["monotonic"] for rows in job.steps().values() for r in rows if r["world"] == 3)
        assert redone - cut_at < DETECT_S + M0_SLACK_S + 4.0, "the first step after the recovery"

        # Every task ends: the survivors 0, the killed one by its signal, machine 0's by themselves with 75.
        training = job.step_of(JOB)
        assert training is not None and training.nodes == ("node0", "node1", "node2") and training.per_node == 2
        exits = job.wait_for(lambda: (e := job.task_exits(training)) and len(e) == 6 and e, 60, "every task's exit")
        statuses = {t: e["status"] for t, e in exits.items()}
        assert {t: statuses[t] for t in (0, 1, 2)} == {0: 75, 1: 75, 2: -signal.SIGKILL}, statuses
        assert all(statuses[t] == 0 or (statuses[t] == -signal.SIGKILL and t in at_the_end) for t in (3, 4, 5)), (
            statuses, at_the_end)
        assert max(exits[t]["time"] for t in (0, 1)) - cut_wall < JOIN_S + 35, "machine 0's tasks ended by themselves"
        assert {_rank(tag) for tag in job.results()} == {3, 4, 5}, "machine 0's tasks wrote no result"
        assert all(rows[-1]["monotonic"] < cut_done for tag, rows in job.steps().items() if _rank(tag) in (0, 1))
        ended = [e for e in job.events() if e["event"] == "fail_stop_unrecoverable"]
        assert sorted(e["rank"] for e in ended) == [0, 1] and all("store is lost" in e["reason"] for e in ended)

        # The batch script stops the etcd step and ends with srun's status: the highest task status (128 + 9).
        machines[0].restore_link()
        assert job.wait_batch(60) == 128 + signal.SIGKILL, job.agent_log()
        etcd = job.step_of("etcd_member")
        assert etcd is not None and etcd.nodes == ("node0", "node1", "node2") and etcd.per_node == 1
        assert len(job.task_exits(etcd)) == 3, job.task_exits(etcd)
        output = job.agent_log()
        assert "srun: error: node1: task 2: Killed by signal 9" in output
        assert "srun: error: node0: task 0: Exited with exit code 75" in output

