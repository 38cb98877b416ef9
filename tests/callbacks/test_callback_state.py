"""Callback state across a checkpoint: ``state_dict`` -> torch.save/load (weights_only) -> ``load_state_dict``.

The detector is driven rank by rank as in a job (one ``StragglerDetector`` per rank, each with its own
tracker; every core sees every rank's summary, which is what the all-gather gives them). The merged
state is what rank 0 writes after ``state_dict``'s gather; each fresh detector takes its own rank's
part back. The resumed detectors must then behave exactly like the uninterrupted ones.
"""

from __future__ import annotations

import io

import pytest
import torch

from resihp_lightning.callbacks import ReplanController, StragglerDetector
from resihp_lightning.callbacks.failslow.straggler_core import StragglerConfig
from resihp_lightning.plan import Plan
from resihp_lightning.telemetry import LayerCost

from resihp_lightning.testing.synthetic import SyntheticFault, TraceSpec, generate_trace

SLOW = 6
# Rank 6 at half speed from step 16, at a quarter from step 30 (re-reported with the new speed).
SPEC = TraceSpec(steps=44, seed=3, faults=(SyntheticFault(SLOW, 2.0, 16), SyntheticFault(SLOW, 2.0, 30)))
CONFIG = StragglerConfig()  # warm-up 2, fit 10, patience 3


def _job(ranks: int) -> list[StragglerDetector]:
    detectors = [StragglerDetector(CONFIG) for _ in range(ranks)]
    for rank, detector in enumerate(detectors):
        detector.rank = rank  # what setup takes from the trainer
    return detectors


def _step(detectors: list[StragglerDetector], stats_of_step) -> list[dict]:
    """One training step: each rank summarises its own stats; every core folds in all summaries."""
    summaries = [detectors[s.rank].tracker.summarize(s) for s in stats_of_step]
    events = [detector.core.update(summaries) for detector in detectors]
    assert all(e == events[0] for e in events)  # the same decisions on every rank
    return events[0]


def _checkpoint(detectors: list[StragglerDetector]) -> dict:
    """Rank 0's state after the gather, through torch.save and a weights_only load (plain data only)."""
    parts = [detector.state_dict() for detector in detectors]
    state = dict(parts[0], ranks={rank: part["ranks"][rank] for rank, part in enumerate(parts)})
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("resume_at", [22, 6])  # flagged mid-fault; in the middle of the models' fit
def test_resumed_detector_keeps_flags_speeds_and_models_and_behaves_as_uninterrupted(resume_at):
    trace = generate_trace(SPEC)
    ranks = len(trace[0])
    job = _job(ranks)
    before = [e for stats in trace[:resume_at] for e in _step(job, stats)]
    state = _checkpoint(job)
    resumed = _job(ranks)
    for detector in resumed:
        detector.load_state_dict(state)
        assert detector.flagged == job[0].flagged and detector.speeds == job[0].speeds
        assert detector.version == job[0].version
    fits = [d.tracker.fit.fits for d in job]
    assert [d.tracker.fit.fits for d in resumed] == fits
    if resume_at == 22:
        assert [e["rank"] for e in before if e["event"] == "fail_slow_detected"] == [SLOW]
        assert resumed[0].flagged == [SLOW] and resumed[0].speeds[SLOW] == pytest.approx(0.5, rel=0.1)
        # The next step is measured against the saved models: no warm-up, no refit.
        first = [d.tracker.summarize(s) for d, s in zip(resumed, trace[resume_at])]
        assert all(s.ratio is not None and s.fit_id == fits[s.rank] for s in first)
        assert StragglerDetector(CONFIG).tracker.summarize(trace[resume_at][SLOW]).ratio is None  # a fresh one warms up
        for detector in resumed:
            detector.core.update(first)
        _step(job, trace[resume_at])
        start = resume_at + 1
    else:
        assert before == [] and fits == [0] * ranks  # still fitting: the partial fits carry over
        start = resume_at
    after_job = [e for stats in trace[start:] for e in _step(job, stats)]
    after_resumed = [e for stats in trace[start:] for e in _step(resumed, stats)]
    assert after_resumed == after_job
    assert resumed[0].speeds == job[0].speeds and resumed[0].core.raw_speeds == job[0].core.raw_speeds
    assert [d.tracker.fit.fits for d in resumed] == [d.tracker.fit.fits for d in job]
    assert resumed[0].speeds[SLOW] == pytest.approx(0.25, rel=0.1)
    if resume_at == 6:
        assert [e["rank"] for e in after_job if e["event"] == "fail_slow_detected"] == [SLOW, SLOW]


def test_controller_state_is_plain_data_and_round_trips():
    plan = Plan.uniform([0, 1, 2, 3], 8, 2, 8)
    state = {
        "last_change_step": 17,
        "seen_version": 3,
        "migration_overhead_s": 0.4,
        "migration_bandwidth_mb_s": 250.0,
        "profile": [{"index": i, "compute_ms": 2.0, "static_mb": 50.0, "activation_mb": 1.0} for i in range(8)],
        "chosen": plan.to_dict(),
        "awaiting": True,
        "retry_at": 21,
    }
    controller = ReplanController()
    controller.load_state_dict(state)
    buffer = io.BytesIO()
    torch.save(controller.state_dict(), buffer)
    buffer.seek(0)
    again = ReplanController()
    again.load_state_dict(torch.load(buffer, weights_only=True))
    assert again.state_dict() == state
    assert ReplanController().state_dict() == {
        "last_change_step": None, "seen_version": 0, "migration_overhead_s": 1.0, "migration_bandwidth_mb_s": 1000.0,
        "profile": None, "chosen": None, "awaiting": False, "retry_at": None,
    }
    assert LayerCost(**state["profile"][0]) == LayerCost(0, 2.0, 50.0, 1.0)


def test_each_rank_takes_back_its_own_unreported_summaries_and_tracker():
    trace = generate_trace(TraceSpec(stages=2, replicas=2, micro_batches=8, steps=14, seed=1))
    job = _job(4)
    for stats in trace[:13]:
        _step(job, stats)
    pending = {s.rank: [job[s.rank].tracker.summarize(s).to_dict()] for s in trace[13]}  # not reported yet
    state = _checkpoint(job)
    for rank, part in state["ranks"].items():
        part["pending"] = pending[rank]
    resumed = _job(4)
    for rank, detector in enumerate(resumed):
        detector.load_state_dict(state)
        mine = detector.state_dict()["ranks"]  # no process group here: only its own part comes back
        assert list(mine) == [rank] and mine[rank]["pending"] == pending[rank]
        assert mine[rank]["tracker"] == job[rank].tracker.state_dict()
    late = StragglerDetector(CONFIG)
    late.rank = 7  # a rank the checkpoint does not know starts its own warm-up
    late.load_state_dict(state)
    assert late.tracker.fit.model is None and late.flagged == job[0].flagged
