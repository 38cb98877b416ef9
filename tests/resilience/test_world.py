"""In-process recovery with real gloo processes: kill, stop or hang a rank; the survivors go on.

Each test runs 4 fresh processes (``resihp_lightning/testing/harness.py``: a rank that dies is an
outcome, not a harness failure; everything still running at the end is SIGKILLed, so nothing hangs)
in a loop of collectives under :class:`ElasticWorld`. The victim leaves the ``time.monotonic()`` of
its failure (one clock for all processes of a machine); the survivors report when their blocked
collective was released (:class:`PeerFailure` caught) and when the new generation was formed, and
prove it with an all_reduce whose exact sum names its members.

At the end, single-process checks of ``world.py``'s options and of how it tells transport errors from bugs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from resihp_lightning.errors import ConfigError
from resihp_lightning.resilience.failure_detector import FailureDetectorConfig
from resihp_lightning.resilience.store import StoreConfig
from resihp_lightning.resilience.world import WorldConfig, is_transport_error
from resihp_lightning.testing.harness import last_words, run_job


def _sum_of(members) -> float:
    """What the final all_reduce of (original rank + 1) gives over exactly these members."""
    return float(sum(r + 1 for r in members))


def _fail(run_dir: str, rank: int, kind: str) -> None:
    last_words(run_dir, rank, at=time.monotonic(), kind=kind)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return  # resumed (SIGCONT) after its peers went on without it
    elif kind == "hang":  # stuck in compute: the heartbeat thread keeps beating
        time.sleep(120)
    elif kind == "gil":  # healthy, but a long C call holds the GIL: the heartbeat thread cannot beat
        import ctypes

        ctypes.PyDLL(None).sleep(3)  # libc sleep(3) through PyDLL: the GIL stays held
        return
    raise AssertionError(f"rank {rank} outlived its failure ({kind})")


def _step(world, mode: str, step: int) -> None:
    import torch
    import torch.distributed as dist

    if mode == "all_reduce":
        value = torch.ones(4)
        dist.all_reduce(value)
        assert value[0].item() == world.world_size
        return
    # "p2p": a pipeline's forward then backward pass along a chain of ranks, blocking send/recv.
    rank, size = world.rank, world.world_size
    activation = torch.zeros(4)
    if rank > 0:
        dist.recv(activation, rank - 1)
    activation += 1
    if rank < size - 1:
        dist.send(activation, rank + 1)
        dist.recv(activation, rank + 1)  # the gradient coming back
    if rank > 0:
        dist.send(activation, rank - 1)
    assert activation[0].item() == size


def _exact_sum(world) -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(world.original_rank + 1)])
    dist.all_reduce(value)
    return value.item()


def _train(rank, world_size, run_dir, *, mode, failures, steps, progress_timeout_s=None, dies_after_joining=None,
           resume=None, stall=None, join_timeout_s=10.0, machines=None):
    if machines is not None:  # this rank's simulated machine
        from resihp_lightning.resilience.procs import MACHINE_ENV, pid_namespace

        os.environ[MACHINE_ENV] = machines[rank]
        pid_namespace.cache_clear()
    import torch
    import torch.distributed as dist

    from resihp_lightning.resilience import (
        FailureDetectorConfig,
        ElasticWorld,
        EvictedError,
        PeerFailure,
        StoreConfig,
        WorldConfig,
    )
    from resihp_lightning.resilience.procs import ProcessIdentity

    config = WorldConfig(
        store=StoreConfig(run_dir=run_dir, linger_s=1.0),
        detector=FailureDetectorConfig(progress_timeout_s=progress_timeout_s),
        join_timeout_s=join_timeout_s,
        regroup_timeout_s=30.0,
        collective_timeout_s=60.0,
        kill_evicted=resume is None,  # a rank woken after its eviction must be left alive to learn it is out
    )
    world = ElasticWorld(config).start()
    if rank == dies_after_joining:
        # Joins the next generation's member list, then dies before its groups are formed.
        world._teardown = lambda generation: _fail(run_dir, rank, "kill")
    events = []
    step = 0
    while step < steps:
        for victim, at, kind in failures:
            if rank == victim and step == at:
                _fail(run_dir, rank, kind)
        try:
            with world.guard():
                _step(world, mode, step)
            step += 1
            world.progress(step)
            time.sleep(0.002)  # a little compute; keeps 4 busy processes from starving 2 cores
        except PeerFailure as failure:
            released = time.monotonic()
            if stall is not None and rank == stall[0]:  # alive, but late for the regroup (e.g. stuck)
                last_words(run_dir, rank, at=time.monotonic())
                time.sleep(stall[1])
            try:
                world.regroup()
            except EvictedError as evicted:
                world.close()
                return {"evicted": evicted.members, "generation": evicted.generation, "events": events}
            regrouped = time.monotonic()
            if resume is not None and world.rank == 0:  # wake the stopped rank: it must learn it is out
                os.kill(ProcessIdentity.from_json(world.store.control.get(f"proc/{resume}")).pid, signal.SIGCONT)
            # Resume at the step the slowest survivor had not finished (the real loop redoes it).
            agreed = torch.tensor([step])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            step = int(agreed.item())
            events.append({
                "released": released, "regrouped": regrouped, "aborted_generation": failure.generation,
                "generation": world.generation, "members": list(world.members), "rank": world.rank,
                "sum": _exact_sum(world), "failed": dict(world.failed),
            })
    result = {"events": events, "members": list(world.members), "generation": world.generation,
              "sum": _exact_sum(world), "rank_of": {r: world.rank_of(r) for r in world.members}}
    world.close()
    return result


def _survivors(outcome, expected):
    values = outcome.values()
    assert sorted(values) == expected, outcome.describe()
    return values


def _deaths(outcome):
    return {r.rank: r.last_words["at"] for r in outcome.ranks if r.last_words}


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["all_reduce", "p2p"])
def test_sigkill_of_rank_two_releases_the_survivors_who_regroup_into_three(mode):
    outcome = run_job(_train, 4, timeout=45, wait_for=[0, 1, 3], store_host_grace_s=8.0,
                      mode=mode, failures=[(2, 20, "kill")], steps=40)
    values = _survivors(outcome, [0, 1, 3])
    died = _deaths(outcome)[2]
    for rank, value in values.items():
        (event,) = value["events"]
        assert event["generation"] == 1 and event["members"] == [0, 1, 3]
        assert event["sum"] == _sum_of([0, 1, 3]) == value["sum"]
        assert event["released"] - died < 2.0, f"rank {rank} released after {event['released'] - died:.2f} s"
        assert event["regrouped"] - died < 4.0
        assert value["rank_of"] == {0: 0, 1: 1, 3: 2}
    # It exits linger_s (2 s) after the last member; the rest of the grace is for a loaded machine.
    assert outcome.store_host_ended_by_itself, "the store host outlived the job by 8 s"


@pytest.mark.multiprocess
def test_rank_zero_then_rank_three_die_in_a_pipeline_chain_and_the_store_survives():
    outcome = run_job(_train, 4, timeout=50, wait_for=[1, 2], mode="p2p",
                      failures=[(0, 15, "kill"), (3, 35, "kill")], steps=50)
    values = _survivors(outcome, [1, 2])
    deaths = _deaths(outcome)
    for rank, value in values.items():
        first, second = value["events"]
        assert (first["generation"], first["members"], first["sum"]) == (1, [1, 2, 3], _sum_of([1, 2, 3]))
        assert (second["generation"], second["members"], second["sum"]) == (2, [1, 2], _sum_of([1, 2]))
        assert first["released"] - deaths[0] < 2.0 and second["released"] - deaths[3] < 2.0
        assert value["rank_of"] == {1: 0, 2: 1}


@pytest.mark.multiprocess
def test_a_stopped_rank_is_evicted_the_others_go_on_and_it_learns_so_when_resumed():
    outcome = run_job(_train, 4, timeout=45, mode="all_reduce",
                      failures=[(1, 20, "stop")], steps=40, progress_timeout_s=1.5, resume=1)
    values = _survivors(outcome, [0, 1, 2, 3])
    stopped = _deaths(outcome)[1]
    assert values.pop(1) == {"evicted": [0, 2, 3], "generation": 1, "events": []}
    for value in values.values():
        (event,) = value["events"]
        assert event["members"] == [0, 2, 3] and event["sum"] == _sum_of([0, 2, 3])
        # Nothing breaks on the wire: only the detector (1 s of silence, counted from the last beat, up to
        # a 0.2 s interval before the stop) can release them.
        assert 0.7 < event["released"] - stopped < 3.0
    # Who saw it first names the cause; the others adopted it or learned it from the member list.
    reasons = [value["events"][0]["failed"][1] for value in values.values()]
    assert any(reason.startswith("silent") for reason in reasons), reasons


@pytest.mark.multiprocess
def test_a_live_rank_whose_heartbeat_cannot_run_is_not_evicted():
    """Rank 1 holds the GIL for 3 s inside a C call (its detector thread cannot beat, as when a CPU hog
    starves it): before the local /proc check, its peers found it silent after 1 s and evicted and
    killed it. A live, running process on the same machine is not silent: nobody is lost."""
    outcome = run_job(_train, 4, timeout=90, mode="all_reduce", failures=[(1, 10, "gil")], steps=30)
    values = _survivors(outcome, [0, 1, 2, 3])
    for value in values.values():
        assert value["events"] == [] and value["generation"] == 0 and value["sum"] == _sum_of([0, 1, 2, 3])
    assert set(_deaths(outcome)) == {1}  # it did hold the GIL (and lived)


MACHINES = {0: "m0", 1: "m0", 2: "m1", 3: "m1"}  # two simulated machines (RESIHP_MACHINE_ID)


@pytest.mark.multiprocess
def test_a_lost_machine_is_found_by_the_other_machine_and_named_once():
    """Both ranks of m1 stop. No process of m0 can see m1's through /proc; m1's machine beat stops and
    m0's monitor loses ranks 2 and 3 together, as machine m1's; rank 1 (no monitor) learns it from the
    abort marker, which its monitor relays through m0's board."""
    outcome = run_job(_train, 4, timeout=60, wait_for=[0, 1], mode="all_reduce",
                      failures=[(2, 15, "stop"), (3, 15, "stop")], steps=30, machines=MACHINES)
    values = _survivors(outcome, [0, 1])
    stopped = max(_deaths(outcome).values())
    for value in values.values():
        (event,) = value["events"]
        assert event["members"] == [0, 1] and event["sum"] == _sum_of([0, 1])
        assert 0.8 < event["released"] - stopped < 3.5
        assert set(event["failed"]) == {2, 3}
    assert all(why.startswith("silent") for why in values[0]["events"][0]["failed"].values())


@pytest.mark.multiprocess
def test_a_rank_killed_on_another_machine_is_found_by_its_neighbour_and_learned_from_the_marker():
    """Rank 3 (on m1) is killed: rank 2 sees it exit through /proc at once; m0's ranks cannot, and learn
    it from the abort marker (rank 0 from the store, rank 1 from m0's board), long before any silence."""
    outcome = run_job(_train, 4, timeout=60, wait_for=[0, 1, 2], mode="all_reduce",
                      failures=[(3, 15, "kill")], steps=30, machines=MACHINES)
    values = _survivors(outcome, [0, 1, 2])
    killed = _deaths(outcome)[3]
    for value in values.values():
        (event,) = value["events"]
        assert event["members"] == [0, 1, 2] and event["sum"] == _sum_of([0, 1, 2])
        assert event["released"] - killed < 0.8  # under the silence timeout: not found by silence
    assert values[2]["events"][0]["failed"][3] == "exited"


@pytest.mark.multiprocess
def test_a_rank_stuck_in_its_step_is_evicted_as_hung_not_the_ones_waiting_for_it():
    outcome = run_job(_train, 4, timeout=45, wait_for=[0, 1, 2], mode="p2p",
                      failures=[(3, 20, "hang")], steps=40, progress_timeout_s=1.5)
    values = _survivors(outcome, [0, 1, 2])
    stuck = _deaths(outcome)[3]
    for value in values.values():
        (event,) = value["events"]
        assert event["members"] == [0, 1, 2] and event["sum"] == _sum_of([0, 1, 2])
        assert 1.2 < event["released"] - stuck < 4.0
    reasons = [value["events"][0]["failed"][3] for value in values.values()]
    assert any(reason.startswith("hung") for reason in reasons), reasons


@pytest.mark.multiprocess
def test_a_rank_dying_after_it_joined_the_regroup_costs_one_more_generation_not_a_hang():
    outcome = run_job(_train, 4, timeout=45, wait_for=[0, 1], mode="all_reduce",
                      failures=[(2, 20, "kill")], steps=40, dies_after_joining=3)
    values = _survivors(outcome, [0, 1])
    deaths = _deaths(outcome)
    for value in values.values():
        (event,) = value["events"]  # one regroup() call: generation 1 failed while forming, 2 formed
        assert (event["generation"], event["members"], event["sum"]) == (2, [0, 1], _sum_of([0, 1]))
        assert event["regrouped"] - deaths[3] < 4.0


def _loses_the_store(rank, world_size, run_dir):
    import torch
    import torch.distributed as dist

    from resihp_lightning.resilience import ElasticWorld, PeerFailure, StoreConfig, StoreUnavailable, WorldConfig

    world = ElasticWorld(WorldConfig(store=StoreConfig(run_dir=run_dir, timeout_s=5), join_timeout_s=5,
                                     regroup_timeout_s=20)).start()
    value = torch.ones(1)
    try:
        for step in range(40):
            if step == 10 and rank == 0:
                os.kill(world.store.host_identity.pid, signal.SIGKILL)
            if step == 20 and rank == 2:
                _fail(run_dir, rank, "kill")
            with world.guard():
                dist.all_reduce(value)
            time.sleep(0.02)
    except PeerFailure as failure:
        started = time.monotonic()
        try:
            world.regroup()
        except StoreUnavailable:
            return {"store_unavailable_after": time.monotonic() - started, "aborted": failure.generation}
    raise AssertionError("no failure or no StoreUnavailable")


@pytest.mark.multiprocess
def test_without_its_store_host_the_job_trains_on_and_a_later_failure_ends_it_cleanly():
    """The store host's death is the one loss the job cannot regroup from (restart path)."""
    outcome = run_job(_loses_the_store, 4, timeout=45, wait_for=[0, 1, 3])
    values = _survivors(outcome, [0, 1, 3])
    for value in values.values():
        assert value["aborted"] == 0 and value["store_unavailable_after"] < 5.0


@pytest.mark.multiprocess
def test_a_leader_alive_but_late_for_the_regroup_is_left_out_and_the_others_go_on(tmp_path):
    """Rank 0, the regroup's leader, stalls after rank 2 dies: alive (its detector keeps beating), so
    nobody names it failed, and it never joins. After ``join_timeout_s`` the lowest rank that joined (1)
    proposes in its place; ranks 1 and 3 go on as generation 1. Before, everyone waited for the leader's
    proposal until the regroup timeout. The leader, left out, is killed on this machine (kill_evicted)."""
    outcome = run_job(_train, 4, timeout=60, wait_for=[1, 3], mode="all_reduce", run_dir=str(tmp_path),
                      failures=[(2, 20, "kill")], steps=40, stall=(0, 40.0), join_timeout_s=2.0)
    values = _survivors(outcome, [1, 3])
    for value in values.values():
        (event,) = value["events"]
        assert event["generation"] == 1 and event["members"] == [1, 3], event
        assert event["sum"] == _sum_of([1, 3]) == value["sum"]
        assert value["rank_of"] == {1: 0, 3: 1}
    # SIGKILLed by rank 1 (kill_evicted); the harness may find it not yet reaped when it ends the job, and then
    # calls it "killed" itself: the survivor's log says who did.
    leader = outcome.ranks[0]
    assert leader.exitcode == -signal.SIGKILL, outcome.describe()
    assert "killed evicted rank 0" in (Path(outcome.run_dir) / "rank1.log").read_text(), outcome.describe()
    # Where the late leader was stuck: its threads' stacks, dumped join_timeout_s after the abort (the
    # main thread in the test's stall); the survivors, in time, leave no file.
    dumps = sorted(p.name for p in Path(outcome.run_dir).glob("stalled-rank*.txt"))
    assert dumps == ["stalled-rank0.txt"], dumps
    assert "in _train" in (Path(outcome.run_dir) / "stalled-rank0.txt").read_text()


# ------------------------------------- single process: options and errors (from test_resilience_units.py)
@pytest.mark.parametrize(
    ("build", "option"),
    [
        (lambda: WorldConfig(backend="mpi"), "resilience.backend"),
        (lambda: WorldConfig(join_timeout_s=0), "resilience.join_timeout_s"),
        (lambda: WorldConfig(join_timeout_s=50, regroup_timeout_s=40), "resilience.join_timeout_s"),
        (lambda: WorldConfig(min_world_size=0), "resilience.min_world_size"),
        (lambda: FailureDetectorConfig(interval_s=0.5, timeout_s=0.6), "resilience.detector.timeout_s"),
        (lambda: FailureDetectorConfig(progress_timeout_s=0.1), "resilience.detector.progress_timeout_s"),
        (lambda: FailureDetectorConfig(comm_frame_depth=0), "resilience.detector.comm_frame_depth"),
        (lambda: StoreConfig(port=70000), "resilience.store.port"),
        (lambda: StoreConfig(linger_s=-1), "resilience.store.linger_s"),
        (lambda: StoreConfig(run_id="a b"), "resilience.store.run_id"),
    ],
)
def test_options_are_validated(build, option):
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        build()


def test_defaults_detect_a_silent_rank_within_a_second():
    config = WorldConfig()
    assert config.detector.interval_s == 0.2 and config.detector.timeout_s == 1.0
    assert config.backend == "gloo"


def test_transport_errors_are_told_from_bugs():
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    assert is_transport_error(gloo)
    assert not is_transport_error(ValueError("shapes do not match"))
