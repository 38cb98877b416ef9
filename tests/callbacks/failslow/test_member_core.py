"""Naming the slow member of a tensor-parallel group from its own compute (:mod:`...failslow.member_core`)."""

from __future__ import annotations

import random

import pytest

from resihp_lightning.callbacks.failslow.member_core import MemberCore, MemberSample
from resihp_lightning.errors import ConfigError


def _step(step: int, own: dict[int, float], groups: dict[int, int]) -> list[MemberSample]:
    return [MemberSample(step, p, groups[p], ms) for p, ms in own.items()]


GROUPS = {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1}


def test_a_member_three_times_slower_is_named_after_patience_steps_and_cleared_when_it_heals():
    core = MemberCore(threshold=1.5, patience=3)
    rng = random.Random(0)
    events = []
    for step in range(12):
        slow = 3.0 if 2 <= step < 7 else 1.0
        own = {p: 100.0 * rng.uniform(0.95, 1.05) for p in GROUPS}
        own[2] *= slow
        events += core.update(_step(step, own, GROUPS))
    names = [(e["event"], e["rank"], e["step"]) for e in events]
    # Flagged at its third slow step, cleared at its third healed one; nobody else, no other group.
    assert names == [("fail_slow_member_detected", 2, 4), ("fail_slow_member_recovered", 2, 9)]
    assert events[0]["group"] == 0 and events[0]["speed"] == pytest.approx(1 / 3, rel=0.1)
    assert core.flagged == {}


def test_noise_below_the_threshold_and_a_lone_member_flag_nobody():
    core = MemberCore(threshold=1.5, patience=2, warmup_steps=3)
    for step in range(3):  # the warm-up is not judged, however slow a member looks
        assert core.update(_step(step, {0: 900.0, 1: 100.0, 2: 100.0}, GROUPS)) == []
    rng = random.Random(1)
    for step in range(3, 50):
        own = {p: 100.0 * rng.uniform(0.8, 1.2) for p in GROUPS}
        own[6] = 500.0  # alone in group 2: nobody to compare with
        assert core.update(_step(step, own, {**GROUPS, 6: 2})) == []


def test_an_interrupted_streak_starts_again_and_the_state_round_trips():
    core = MemberCore(threshold=1.5, patience=3)
    pattern = [2.0, 2.0, 1.0, 2.0, 2.0]  # never three in a row
    for step, factor in enumerate(pattern):
        assert core.update(_step(step, {0: 100.0 * factor, 1: 100.0, 2: 100.0}, GROUPS)) == []
    copy = MemberCore(threshold=1.5, patience=3)
    copy.load_state_dict(core.state_dict())
    event = copy.update(_step(5, {0: 200.0, 1: 100.0, 2: 100.0}, GROUPS))
    assert [e["rank"] for e in event] == [0]  # the third slow step in a row, counted from the restored streak


@pytest.mark.parametrize(("threshold", "patience"), [(1.0, 3), (0.5, 3), (1.5, 0), (1.5, True)])
def test_bad_options_are_refused_by_name(threshold, patience):
    with pytest.raises(ConfigError, match="member_"):
        MemberCore(threshold=threshold, patience=patience)
    with pytest.raises(ConfigError, match="warmup_steps"):
        MemberCore(warmup_steps=-1)
