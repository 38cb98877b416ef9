"""What a restarted process learns from its launcher (``resihp_lightning.launcher_env``), without processes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from resihp_lightning import launcher_env


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT",
                 "SLURM_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_launcher_shape_follows_torchruns_world(clean_env):
    assert launcher_env.launcher_shape(devices=4, num_nodes=1) == (1, 4)  # not under torchrun: as configured
    clean_env.setenv("TORCHELASTIC_RUN_ID", "job")
    clean_env.setenv("WORLD_SIZE", "24")
    clean_env.setenv("LOCAL_WORLD_SIZE", "8")
    assert launcher_env.launcher_shape(devices=4, num_nodes=1) == (3, 8)  # 3 machines of 8 joined this round


def test_speeds_travel_by_identity_and_ambiguous_identities_count_as_healthy():
    before = ["a:0", "a:1", "b:0", "c:0"]
    saved = launcher_env.speeds_by_identity({1: 0.5, 2: 0.8, 3: 1.0}, before)
    assert saved == {"a:1": 0.5, "b:0": 0.8, "c:0": 1.0}
    # "b" was lost; ranks are dealt anew: a:1 is now rank 0.
    assert launcher_env.speeds_for_ranks(saved, ["a:1", "c:0", "a:0"]) == {0: 0.5, 1: 1.0}
    # One machine with several agents: every identity is the same, nothing can be told apart.
    assert launcher_env.speeds_by_identity({0: 0.5}, ["h:0", "h:0"]) == {}
    assert launcher_env.speeds_for_ranks({"h:0": 0.5}, ["h:0", "h:0"]) == {}


def test_restart_count_and_the_agent_store_warning(clean_env):
    assert launcher_env.restart_count() == 0 and launcher_env.agent_store_warning() is None
    clean_env.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert launcher_env.restart_count() == 2
    clean_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    clean_env.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert launcher_env.agent_store_warning() is None  # no restarts: nothing stale to read
    clean_env.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in launcher_env.agent_store_warning()


def test_process_start_time_is_in_the_past():
    started = launcher_env.process_started_at()
    if not Path("/proc/self/stat").exists():  # None is the answer only where there is no /proc
        assert started is None
        return
    # This process (pytest) started before the test and less than an hour ago.
    assert started is not None and 0 <= time.time() - started < 3600
