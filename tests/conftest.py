"""Shared fixtures: multi-process gloo jobs and small planning problems."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Multi-process tests oversubscribe two cores; one thread per process keeps them predictable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A fail-stop job's store host forked from its rank instead of a new interpreter (StoreConfig.start_method):
# the test jobs' ranks hold almost nothing, and each job then starts ~1.5 s sooner and ~3 CPU s cheaper.
# tests/resilience/test_store.py runs both start methods.
os.environ.setdefault("RESIHP_STORE_START_METHOD", "fork")


from resihp_lightning.testing.multiproc import free_port, run_distributed, start_rank_server  # noqa: E402

#: CPU seconds per test with RESIHP_CPU_PROFILE=<file> (tests/cpu_profile.py); off otherwise.
pytest_plugins = ("tests.cpu_profile",)

#: Test files whose assertions rest on measured time or speed, which ``make test`` runs apart from the
#: rest (the list, and how each runs: tests/timing_files.txt, ``<speed|timeout> <path>``). They carry
#: the ``timing`` marker.
TIMING_FILES = {
    line.split()[-1] for line in (Path(__file__).parent / "timing_files.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for item in items:
        if item.path.relative_to(root).as_posix() in TIMING_FILES:
            item.add_marker(pytest.mark.timing)


@pytest.fixture(scope="session", autouse=True)
def rank_server(request: pytest.FixtureRequest) -> None:
    """When the selected tests include multi-process ones, the ranks' fork server starts importing
    torch, Lightning and DeepSpeed at the first test, on another core, while the single-process tests
    run. (Started inside a test, not at collection: its ranks' output then goes to pytest's capture.)"""
    if any(item.get_closest_marker("multiprocess") for item in request.session.items):
        start_rank_server()


@pytest.fixture
def port() -> int:
    """A free TCP port on 127.0.0.1."""
    return free_port()


@pytest.fixture
def distributed():
    """``distributed(fn, world_size, timeout=..., **kwargs)`` runs ``fn(rank, world_size, **kwargs)``
    on real gloo-ready processes and returns every rank's result; a hang fails the test."""
    return run_distributed
