"""The end of training is no failure: a process that finished ``fit`` says goodbye before it exits.

One job of 4 real gloo processes (the exactness job, 2 steps, ``fail_stop`` on, ``HeartbeatMonitor``
reporting every verdict as an event). At the end of ``fit`` every rank creates two groups, ``[1, 2]``
and ``[0, 1]``; rank 0 lingers in its teardown (the monitor still listening) while the others return.
Then, after ``fit``:

* rank 3 returns at once: the harness ends it as a normal exit ends a process (its ``SurvivingJob``
  closes: goodbye, groups destroyed, store left) and it exits;
* ranks 1 and 2 wait until rank 3's process is gone, then all-reduce over ``[1, 2]`` (a collective that
  does not need rank 3);
* rank 0 waits in a barrier over ``[0, 1]``, which rank 1 reaches late (a collective that waits for a peer
  with a delay), then broadcasts from rank 3 through the strategy (a collective that needs the finished
  rank): :class:`~resihp_lightning.resilience.failures.PeerFinished`, at once;
* rank 2 then SIGKILLs itself, after fit and before any goodbye: ranks 0 and 1 find it ``exited``.

Asserted: before rank 2's kill no rank has a verdict, an abort or a ``fail_stop_detected`` event, and every
rank counts rank 3 finished; rank 2's death gives the ``exited`` verdict. Without the goodbye rank 3's exit
was judged ``exited``: the generation was aborted and the post-fit collectives broke.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from resihp_lightning.testing.toy_jobs import M, MBS, build_class, make_data

STEPS = 2
FINISHER, VICTIM = 3, 2
#: How long rank 0 lingers in its teardown (monitor subscribed) after the others left fit.
LINGER_S = 1.5


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def _job(rank: int, world: int, run_dir: str) -> dict:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from resihp_lightning.callbacks import HeartbeatMonitor
    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.resilience.failures import PeerFinished
    from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.testing.harness import last_words

    groups: dict = {}

    class End(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            groups["pair"] = dist.new_group([1, 2])  # every rank creates every group (torch requires it)
            groups["wait"] = dist.new_group([0, 1])

        def teardown(self, trainer, pl_module, stage):
            if rank == 0:  # before the monitor's teardown: it still reports whatever the detector finds
                time.sleep(LINGER_S)

    x, y = make_data()
    strategy = ResiHPStrategy(micro_batch_size=MBS, fail_stop=FailStopConfig(), pipeline_degree=2)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[End(), HeartbeatMonitor(monitor="all")], default_root_dir=run_dir)
    trainer.fit(build_class()(), DataLoader(TensorDataset(x, y), batch_size=M * MBS))
    if rank == FINISHER:
        return {"finished": True}
    world_ = strategy._membership.job.world
    detector = world_.detector
    finisher = detector.identities[FINISHER]
    _wait(lambda: not finisher.alive(), 30, "rank 3 did not exit")
    result: dict = {"finisher_gone_at": time.monotonic()}
    if rank in (1, 2):
        time.sleep(3 * detector.config.interval_s)  # the detectors have seen rank 3 gone
        total = torch.ones(1)
        dist.all_reduce(total, group=groups["pair"])
        result["pair_sum"] = total.item()
    if rank in (0, 1):
        dist.barrier(group=groups["wait"])  # rank 0 waits here for rank 1's pair all-reduce
    if rank == 0:
        started = time.monotonic()
        try:
            strategy.broadcast("x", src=FINISHER)
        except PeerFinished as err:
            result["needs_finished"] = (sorted(err.finished), round(time.monotonic() - started, 3), str(err))
        Path(run_dir, "rank0-checked").touch()
    result.update(failed_before=dict(world_.failed), aborted_before=world_.aborted,
                  aborts=[h for h in world_.history if h["event"] == "abort"], finished=sorted(world_.finished))
    if rank == VICTIM:
        _wait(lambda: Path(run_dir, "rank0-checked").exists(), 30, "rank 0 did not finish its checks")
        last_words(run_dir, rank, **result)
        os.kill(os.getpid(), signal.SIGKILL)
    _wait(lambda: VICTIM in world_.failed, 10, "rank 2's death after fit gave no verdict")
    result["victim_verdict"] = world_.failed[VICTIM]
    return result


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_finished_process_exits_without_a_verdict_and_a_death_after_fit_still_gives_one(tmp_path):
    from resihp_lightning.callbacks.events import EVENTS_FILE, read_events
    from resihp_lightning.testing.harness import run_job

    outcome = run_job(_job, 4, timeout=100, wait_for=[0, 1, 3], run_dir=str(tmp_path))
    values = outcome.values()
    assert sorted(values) == [0, 1, 3], outcome.describe()
    by_rank = {**values, VICTIM: next(r.last_words for r in outcome.ranks if r.rank == VICTIM)}
    assert by_rank[VICTIM] is not None, outcome.describe()
    for rank in (0, 1, 2):
        result = by_rank[rank]
        assert result["failed_before"] == {} and not result["aborted_before"] and result["aborts"] == [], (rank, result)
        assert result["finished"] == [FINISHER], (rank, result)
    assert by_rank[1]["pair_sum"] == by_rank[2]["pair_sum"] == 2.0
    needs, took, message = by_rank[0]["needs_finished"]
    assert needs == [FINISHER] and took < 5.0 and "finished" in message, by_rank[0]
    for rank in (0, 1):
        assert by_rank[rank]["victim_verdict"].startswith("exited"), (rank, by_rank[rank])
    logged = read_events(outcome.run_dir) if (Path(outcome.run_dir) / EVENTS_FILE).exists() else []
    deaths = [e for e in logged if e["event"] == "fail_stop_detected"]
    assert deaths == [], deaths


def _exits(rank: int, world: int, run_dir: str) -> dict:
    """Rank 1 ends a clean fit but leaves by an unhandled exception, rank 2 ends cleanly; rank 0 watches."""
    import sys

    from resihp_lightning.failstop.fail_stop_config import FailStopConfig
    from resihp_lightning.failstop.survivors import SurvivingJob

    job = SurvivingJob(FailStopConfig(), rank, world, "gloo", 60.0)
    if rank > 0:
        job.ended_cleanly = True  # what the strategy's teardown records after a fit without an exception
        if rank == 1:
            sys.last_value = RuntimeError("code after fit raised")  # set by the interpreter before its exit handlers
        job.close()
        return {}
    detector = job.world.detector
    for peer in (1, 2):
        _wait(lambda: peer in detector.identities and not detector.identities[peer].alive(), 30, f"rank {peer} lives")
    _wait(lambda: 1 in job.world.failed, 5, "rank 1's exit by an exception gave no verdict")
    time.sleep(3 * detector.config.interval_s)
    return {"failed": job.world.failed, "finished": sorted(job.world.finished)}


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_an_exit_by_an_exception_after_a_clean_fit_is_a_failure_a_clean_exit_is_not():
    from resihp_lightning.testing.harness import run_job

    outcome = run_job(_exits, 3, timeout=60, wait_for=[0])
    values = outcome.values()
    assert 0 in values, outcome.describe()
    assert values[0]["finished"] == [2], values[0]
    assert list(values[0]["failed"]) == [1] and values[0]["failed"][1].startswith("exited"), values[0]
