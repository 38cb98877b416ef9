"""A torchrun job across three namespace machines, ``fail_stop`` on: what losing a machine does today.

3 machines x 2 workers (2 stages x 3 replicas), one ``torchrun --nnodes 3 --nproc-per-node 2
--rdzv-backend c10d --rdzv-endpoint node0:29400`` agent per machine, the exactness job of
``resihp_lightning/testing/toy_jobs.py`` (``resihp_lightning/testing/machines_job.py``), each step
~1.6 s. The fault strikes inside step 3 (step 2 in the machine-0 test). Asserted is today's behaviour (``docs/machines.md`` has the
measured times and what is still wrong).

The heartbeat timeout is 3 s (``DETECT_S``). Asserted:

* machine 1 killed (every process), then machine 2 SIGSTOPped: each time the survivors recover
  in-process (torchrun's agents never notice: an agent only watches its own workers) and machine 0's
  two workers finish with the one-process reference's losses and weights (1e-6). Its agent then waits
  in torchrun's exit barrier for the lost agents (300 s, fixed in torch) before it exits 0;
* machine 0 lost with the store on etcd (one member per machine, started with the recipe's command, and
  one ``torchrun --standalone`` agent per process): its link cut inside step 2, the majority (machines 1
  and 2, an etcd quorum) evicts its two workers and finishes in-process exactly; machine 0's workers, cut
  off, end with the restart status and touch nothing; with the link back, machine 0's etcd member serves
  the survivors' keys. (With the TCP store host on machine 0 the cut is a split brain: machine 0's two
  workers finish alone and the majority stalls; measured, documented in ``docs/machines.md``.)
* torchft's launch pattern (one ``torchrun --standalone`` agent per process, ranks from the job's rank
  store, as ``examples/torchrun_per_process.sh`` starts them): one worker killed, then the rest of its
  machine, then a machine frozen and resumed after the others recovered; meanwhile a replacement machine
  joins (``JOIN=1``, ``RESIHP_JOIN=1``): its newcomers are admitted at a step boundary and the next plan
  uses them. Machine 0's two processes and the two newcomers finish exactly, in-process, the resumed
  workers learn they were evicted and exit without touching the job, and every command ends.

What one dead worker does under one agent per machine (its agent restarts its worker group, and every
other agent its own at the next rendezvous round) is torch's behaviour, measured by hand and written
down in ``docs/machines.md``, not asserted here.

Never hangs: each wait has a deadline and the machines' clean-up SIGKILLs every agent and worker.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from resihp_lightning.testing.etcd_cluster import etcd_unavailable_reason
from resihp_lightning.testing.machines import Machines, unavailable_reason
from resihp_lightning.testing.machines_etcd import MachinesEtcd
from resihp_lightning.testing.toy_jobs import reference_fit, reference_run
from resihp_lightning.testing.torchrun_machines import TorchrunJob, TorchrunJobConfig

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

STEPS = 6
#: Seconds into step 3 (after step 2's record) when the fault strikes.
INTO_STEP = 0.7
EXIT_BARRIER_LOG = "Waiting 300 seconds for other agents to finish"
#: The heartbeat timeout: 3 s, not the default 1 s, which on this shared 2-core machine now and then
#: evicts a healthy rank at start-up (a known bug of the detector, issue 25), not what is tested here.
DETECT_S = 3.0
CONFIG = TorchrunJobConfig(detect_timeout_s=DETECT_S)


def _fault_inside_step(job: TorchrunJob, step: int = 3) -> float:
    job.wait_for(lambda: job.max_step() >= step - 1, 240, f"step {step - 1} on six processes")
    time.sleep(INTO_STEP)
    return time.monotonic()


def _results(job: TorchrunJob, count: int) -> dict[str, dict] | None:
    """The workers' end-of-``fit`` records once there are ``count`` of them."""
    results = job.results()
    return results if len(results) >= count else None


def _ranks_of(job: TorchrunJob, host: str) -> list[int]:
    return sorted(int(s["tag"].split("-")[1]) for s in job.starts() if s["host"] == host)


def _assert_exact(results: dict[str, dict], steps: int = STEPS) -> None:
    losses, _, params = reference_fit(steps, None)
    for tag, result in results.items():
        assert len(result["losses"]) == steps, (tag, result["losses"])
        for step, (got, want) in enumerate(zip(result["losses"], losses, strict=True)):
            assert abs(got - want) < 1e-6, f"{tag} step {step}: {got} vs reference {want}"
        for key, want in params.items():
            assert torch.allclose(torch.tensor(result["state"][key]), want, atol=1e-6, rtol=0), (tag, key)


def _recovered_from(recovery: dict, lost: list[int], fault_at: float, slack_s: float = 3.0) -> None:
    """A recovery that names exactly ``lost`` as failed, found within the heartbeat timeout and ``slack_s``."""
    assert sorted(map(int, recovery["failed"])) == lost, recovery
    # Across machines only the heartbeat tells (no pid to watch): silent, or left out once another was.
    assert all(how.startswith(("silent", "left out")) for how in recovery["failed"].values()), recovery
    assert 0 < recovery["detected_at"] - fault_at < DETECT_S + slack_s, "found within the heartbeat timeout and a step"


def _agents_wait_in_the_exit_barrier(job: TorchrunJob, indices: list[int]) -> None:
    """The survivors' agents outlive their finished workers: torchrun's exit barrier waits for the lost agent."""
    job.wait_for(lambda: all(EXIT_BARRIER_LOG in job.agent_log(i) for i in indices), 30, "the exit barrier")
    time.sleep(2)
    assert [job.agents[i].poll() for i in indices] == [None] * len(indices)


@pytest.mark.timeout(420)
def test_a_killed_machine_then_a_frozen_one_each_cost_one_step_and_the_agents_wait_300_s_at_exit(tmp_path):
    """Machine 1 killed inside step 2 (agent and workers), then machine 2 SIGSTOPped inside step 4: each
    costs the survivors one step in-process; machine 0's two workers finish exactly. Torchrun's agents never
    notice (an agent watches only its own workers): machine 0's waits in the exit barrier for the others."""
    with Machines(3) as machines, TorchrunJob(machines, tmp_path / "run", CONFIG) as job:
        killed_at = _fault_inside_step(job, step=2)
        assert len(machines[1].kill()) == 3  # the agent and its two workers
        stopped_at = _fault_inside_step(job, step=4)
        assert len(machines[2].stop()) == 3
        results = job.wait_for(lambda: _results(job, 2), 120, "machine 0's results")
        assert {r["host"] for r in results.values()} == {"node0"} and len(results) == 2
        assert all(tag.startswith("r0-") for tag in results), "no torchrun restart"
        _assert_exact(results)
        node0, node1, node2 = (_ranks_of(job, f"node{i}") for i in range(3))
        steps = job.steps()
        # The step a lost machine never finished is the one the survivors redid.
        last_of = {i: max((r["step"] for tag, rows in steps.items() if int(tag.split("-")[1]) in ranks for r in rows),
                          default=-1) for i, ranks in ((1, node1), (2, node2))}
        assert last_of[1] >= 1 and last_of[2] > last_of[1], last_of
        for result in results.values():
            recovery = result["recovery"]  # the last one: machine 2's
            assert recovery["step"] == last_of[2] + 1 and sorted(recovery["members"]) == node0, recovery
            assert result["world"] == 2
            _recovered_from(recovery, node2, stopped_at)
        first = [e for e in job.events() if e["event"] == "recovery_started" and sorted(map(int, e["failed"])) == node1]
        assert first and all(e["step"] == last_of[1] + 1 and sorted(e["members"]) == sorted(node0 + node2)
                             for e in first), job.events()
        assert all(rows[-1]["world"] == 4 for tag, rows in steps.items() if int(tag.split("-")[1]) in node2)
        # Nobody kills a frozen machine's processes (fail_stop.kill_evicted acts on the leader's machine only).
        assert len(machines[2].pids()) == 3
        _agents_wait_in_the_exit_barrier(job, [0])
        assert killed_at < stopped_at


#: The store of the machine-0 test: one etcd member per machine, as examples/torchrun_per_process.sh starts them.
M0_STEPS = 4
#: A collective blocked this long, once the store is lost, ends a process that was cut off (fail_stop.join_timeout_s).
M0_JOIN_S = 10.0
#: When machine 0's member was etcd's leader, the others first elect a new one (election timeout 1 s, randomized
#: up to 2 s): their monitors' polls wait for it, and a late poll restarts the silence clock (2.6 s more, measured).
M0_SLACK_S = 6.0
WORKER_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")


@pytest.mark.timeout(420)
@pytest.mark.skipif(etcd_unavailable_reason() is not None, reason=str(etcd_unavailable_reason()))
def test_machine_0_cut_off_with_the_store_on_etcd_costs_the_majority_one_step_and_ends_machine_0s_processes(tmp_path):
    """One etcd member per machine (``python -m resihp_lightning.resilience.etcd_member``, the recipe's command) and one
    ``torchrun --standalone`` agent per process: nothing the job needs after start-up lives on machine 0 alone. Its
    link cut inside step 2: machines 1 and 2 (2 of 3 etcd members, a quorum) evict ranks 0 and 1 within the
    heartbeat timeout and finish in-process with the one-process reference's losses and weights; original rank 2
    takes rank 0's duties (the plan, the event log). Machine 0's processes, cut off, lose the store (every
    operation raises ``StoreUnavailable`` without a quorum) and, once blocked in their collective for
    ``join_timeout_s``, end with the restart status: no result, no step, nothing written but their own exits. The
    link then comes back: machine 0's member rejoins and serves the survivors' keys (one store, no split brain)."""
    with Machines(3) as machines, MachinesEtcd(machines, tmp_path / "run") as etcd:
        config = TorchrunJobConfig(per_process=True, max_restarts=0, steps=M0_STEPS, detect_timeout_s=DETECT_S,
                                   join_timeout_s=M0_JOIN_S, store=etcd.store_options())
        with TorchrunJob(machines, tmp_path / "run", config) as job:
            cut_at = _fault_inside_step(job, step=2)
            machines[0].cut_link()
            results = job.wait_for(lambda: _results(job, 4), 120, "the four survivors' results")
            _assert_exact(results, M0_STEPS)
            assert {int(tag.split("-")[1]) for tag in results} == {2, 3, 4, 5}
            for result in results.values():
                recovery = result["recovery"]
                assert recovery["step"] == 2 and sorted(recovery["members"]) == [2, 3, 4, 5] and result["world"] == 4
                _recovered_from(recovery, [0, 1], cut_at, M0_SLACK_S)
            redone = min(r["monotonic"] for rows in job.steps().values() for r in rows if r["world"] == 4)
            assert redone - cut_at < DETECT_S + M0_SLACK_S + 4.0, "the first step after the recovery"
            events = job.events()  # written by the survivors' rank 0 (original rank 2)
            assert [e["members"] for e in events if e["event"] == "recovery_started"] == [[2, 3, 4, 5]], events
            # Machine 0's processes end by themselves, the link still down: the store lost, their collective stalled.
            codes = job.wait_agents([0, 1], 60)
            ended_at = time.monotonic()
            assert codes == [1, 1] and all(set(WORKER_EXIT.findall(job.agent_log(i))) == {"75"} for i in (0, 1)), codes
            assert ended_at - cut_at < 45, ended_at - cut_at
            cut_off = {tag: rows for tag, rows in job.steps().items() if int(tag.split("-")[1]) in (0, 1)}
            assert len(cut_off) == 2 and all(rows[-1]["monotonic"] < cut_at for rows in cut_off.values())
            assert {int(tag.split("-")[1]) for tag in job.results()} == {2, 3, 4, 5}
            exits = [e for e in job.events() if e["event"] == "fail_stop_unrecoverable"]
            assert sorted(e["rank"] for e in exits) == [0, 1] and all("store is lost" in e["reason"] for e in exits)
            assert job.wait_agents(range(2, 6), 60) == [0, 0, 0, 0]
            machines[0].restore_link()
            assert etcd.member_view(0, timeout_s=30) == etcd.member_view(1, timeout_s=30)
            assert etcd.alive() == [True, True, True]


def _kill_one_worker(machines: Machines, job: TorchrunJob, host_index: int, local_rank: int) -> int:
    """SIGKILLs one worker (its agent and the machine's other worker live); returns its rank."""
    start = next(s for s in job.starts() if s["host"] == f"node{host_index}" and s["local_rank"] == local_rank)
    os.kill(machines[host_index].host_pid(start["pid"]), signal.SIGKILL)
    return int(start["tag"].split("-")[1])


def _exit_found_at_once(job: TorchrunJob, victim: int, killed_at: float) -> None:
    """The killed worker is named by a failure verdict (its machine's neighbours see its pid gone), well
    inside the heartbeat timeout: not by the regroup's join timeout (30 s)."""
    found = [e for e in job.events() if e["event"] == "fail_stop_detected" and int(e["rank"]) == victim]
    assert found and all(e["how"].startswith("exited") for e in found), found
    assert 0 < min(e["at"] for e in found) - killed_at < DETECT_S, (found, killed_at)


def _recovery_events(job: TorchrunJob, failed: set[int]) -> list[dict]:
    return [e for e in job.events() if e["event"] == "recovery_started" and failed <= set(map(int, e["failed"]))]


#: The per-process test's steps: one more than an epoch (the reference of more is toy_jobs.reference_run).
PP_STEPS = 8
#: Its members wait at the start of this step until the replacement's two newcomers have registered (their start-up
#: on this shared host takes longer than the steps before): the step's commit counts them, the next step admits
#: them (they mirror it as hot spares, and the members plan for them), and the step after that uses them.
GATE_STEP = 5


def _reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The one-process reference's losses and final weights (keyed as the job's model names them), any step count."""
    losses, params = reference_run(steps)
    return losses, {f"layers.{key}": value for key, value in params.items()}


def _assert_exact_from(results: dict[str, dict], first_steps: dict[str, int], steps: int) -> None:
    """Each result's losses are the reference's from its first step on (a newcomer's from its admission), its final
    weights the reference's (1e-6)."""
    losses, params = _reference(steps)
    for tag, result in results.items():
        assert result["losses"] == pytest.approx(losses[first_steps[tag]:], abs=1e-6), (tag, result["losses"])
        for key, want in params.items():
            assert torch.allclose(torch.tensor(result["state"][key]), want, atol=1e-6, rtol=0), (tag, key)


@pytest.mark.timeout(420)
def test_with_one_standalone_agent_per_process_deaths_cost_one_step_a_frozen_machine_back_changes_nothing_and_a_replacement_joins(
        tmp_path):
    """torchft's pattern (TorchrunJobConfig.per_process, the agents examples/torchrun_per_process.sh
    starts): one worker of machine 1 killed inside step 2; once the survivors have recovered, every process
    of machine 1 killed inside the next step (the machine stays up: the replacement); once they have
    recovered again, machine 2 SIGSTOPped inside the next step (or while the members wait for the
    newcomers, below) and SIGCONTed once the others have recovered. No agent watches another's worker, so
    the survivors recover in-process three times; machine 2's workers, back in a generation the others left, learn that they were evicted
    and exit (status 75, no result, the survivors unaffected). Meanwhile the replacement runs what
    ``JOIN=1 examples/torchrun_per_process.sh`` runs (two agents, ``RESIHP_JOIN=1``): its two newcomers find
    the running job (run id and store host from the recipe's variables, no rank store), take ranks 6 and 7,
    are admitted at a step boundary as hot spares, and the next plan uses them. Every process the job
    ends with (machine 0's two, the two newcomers) finishes with the one-process reference's losses and
    weights, and every command ends (no exit barrier: each agent's world is its own process).

    Known bug, not this launch's (docs/machines.md): a survivor still in its last step's collectives when
    the others finish sees them go silent, evicts them and SIGKILLs the finished ones on its machine
    (``kill_evicted``); such a worker exits -9 after its result and its agent 1. Allowed here only
    for a rank some survivor's last recovery evicted after the last step."""
    config = TorchrunJobConfig(per_process=True, max_restarts=0, detect_timeout_s=DETECT_S, steps=PP_STEPS,
                               job_args=("--newcomers-at", str(GATE_STEP), "--newcomers", "2"))
    with Machines(3) as machines, TorchrunJob(machines, tmp_path / "run", config) as job:
        killed_at = _fault_inside_step(job, step=2)
        victim = _kill_one_worker(machines, job, 1, 0)
        job.wait_for(lambda: _recovery_events(job, {victim}), 60, "the recovery from the killed worker")
        _exit_found_at_once(job, victim, killed_at)
        machine_killed_at = _fault_inside_step(job, step=3)
        machines[1].kill()  # the rest of machine 1: its other worker and the agents
        lost = set(_ranks_of(job, "node1")) - {victim}
        replacement = job.join(1)  # JOIN=1 on the machine that replaces it
        job.wait_for(lambda: _recovery_events(job, lost), 60, "the recovery from the killed machine")
        stopped_at = _fault_inside_step(job, step=4)
        assert len(machines[2].stop()) == 4  # two agents, two workers
        frozen = set(_ranks_of(job, "node2"))
        job.wait_for(lambda: _recovery_events(job, frozen), 60, "the recovery from the frozen machine")
        machines[2].resume()
        results = job.wait_for(lambda: _results(job, 4), 240, "the four results: machine 0's and the newcomers'")
        codes = job.wait_agents(range(len(job.agents)), 90)
        assert None not in codes and time.monotonic() - killed_at < 240, codes
        starts = job.starts()
        members = [s for s in starts if not s["joined"]]
        newcomers = sorted(int(s["tag"].split("-")[1]) for s in starts if s["joined"])
        # Ranks follow (host, local index): agent i (machine i // 2, local index i % 2) ran rank i. The newcomers
        # ran on the replacement with ranks above every rank the job had, found the store on the rank store's host.
        assert all(int(s["tag"].split("-")[1]) == 2 * int(s["host"][-1]) + s["local_rank"] for s in members)
        assert newcomers == [6, 7] and {s["host"] for s in starts if s["joined"]} == {"node1"}, starts
        assert {s["master_addr"] for s in starts if s["joined"]} == {"node0"}
        survivors = {int(tag.split("-")[1]) for tag in results}
        assert survivors == {0, 1, 6, 7} and lost == {3}, results.keys()
        steps = job.steps()
        first_step = {tag: steps[tag][0]["step"] for tag in results}
        _assert_exact_from(results, first_step, PP_STEPS)
        # Admitted together at a step boundary (the step after the commit that counted them: the gate's, unless
        # they were quicker), mirroring that step as hot spares; the plan of the step after uses them.
        admitted = {steps[tag][0]["step"] for tag in results if int(tag.split("-")[1]) in newcomers}
        assert len(admitted) == 1 and next(iter(admitted)) <= GATE_STEP + 1, admitted
        admitted_at = admitted.pop()
        for tag in results:
            rows = {r["step"]: r for r in steps[tag]}
            assert sorted(rows) == list(range(first_step[tag], PP_STEPS)), (tag, rows)
            if int(tag.split("-")[1]) in newcomers:
                assert [rows[s]["spare"] for s in sorted(rows)] == [True] + [False] * (len(rows) - 1), rows
            else:
                assert not set(newcomers) & set(rows[admitted_at]["devices"]), rows
                assert set(newcomers) <= set(rows[admitted_at + 1]["devices"]), rows
        # Each recovery redid the step its lost ranks never finished.
        last_step = {rank: max((r["step"] for tag, rows in steps.items() if int(tag.split("-")[1]) == rank
                                for r in rows), default=-1) for rank in {victim} | lost | frozen}
        first, middle, second = (_recovery_events(job, ranks)[0] for ranks in ({victim}, lost, frozen))
        assert set(map(int, first["failed"])) == {victim} and first["step"] == last_step[victim] + 1, (first, last_step)
        assert set(map(int, middle["failed"])) == lost and middle["step"] == last_step[3] + 1, (middle, last_step)
        assert set(map(int, second["failed"])) == frozen and second["step"] == max(last_step[r] for r in frozen) + 1, (
            second, last_step)
        assert last_step[victim] >= 1 and last_step[3] > last_step[victim] and min(last_step[r] for r in frozen) > last_step[3]
        found = [e["at"] for e in job.events() if e["event"] == "fail_stop_detected" and int(e["rank"]) in lost]
        assert found and 0 < min(found) - machine_killed_at < DETECT_S + 3.0, (found, machine_killed_at)
        assert all(0 < r["recovery"]["detected_at"] - stopped_at < DETECT_S + 3.0 for tag, r in results.items()
                   if int(tag.split("-")[1]) not in newcomers and r["recovery"]["step"] == second["step"])
        # The frozen machine's workers came back evicted: they wrote no result and their agents failed; machine 1's
        # agents were killed with it (the first victim's may have exited 1 before).
        assert all(codes[r] != 0 for r in frozen), codes
        assert codes[3] == -signal.SIGKILL and codes[victim] in (1, -signal.SIGKILL), codes
        evicted_at_the_end = {int(r) for res in results.values() if res["recovery"] and res["recovery"]["step"] >= PP_STEPS
                              for r in res["recovery"]["failed"]}
        ended = {0: codes[0], 1: codes[1], **{int(s["tag"].split("-")[1]): codes[replacement[s["local_rank"]]]
                                              for s in starts if s["joined"]}}
        failed = {rank for rank, code in ended.items() if code != 0}
        assert failed <= evicted_at_the_end, (codes, evicted_at_the_end)
