"""CPU seconds per test, whatever else the machine is doing (a pytest plugin, for `make test`'s budget).

Wall times on the shared 2-core machine say more about the neighbours than about a test. The CPU time a
test costs, its own and that of every process it starts (ranks, torchrun agents, the namespace
machines' processes, killed ones included), does not. Each pytest process (each xdist worker) moves
itself into a cgroup of its own (cgroup v1 ``cpuacct``, or v2 where mounted so), which every process it
starts inherits, whatever its session or pid namespace; a test's cost is the cgroup's CPU time from the
start of its set-up to the end of its teardown. A process a test leaves running is charged to the tests
after it.

Enabled by ``RESIHP_CPU_PROFILE=<file>`` (root, or a writable cgroup hierarchy): one JSON line per test
(``test``, ``cpu_s``, ``wall_s``) is appended to the file. ``scripts/cpu_profile_report.py`` sums them.
Off, the plugin does nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

_V1 = Path("/sys/fs/cgroup/cpuacct")
_V2 = Path("/sys/fs/cgroup/unified")


class _Group:
    """This process's own cgroup, CPU time read in seconds."""

    def __init__(self) -> None:
        name = f"resihp-cpu-profile/{os.getpid()}"
        if (_V1 / "cpuacct.usage").exists():
            self.path, self.usage = _V1 / name, self._v1
        else:
            self.path, self.usage = _V2 / name, self._v2
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def _v1(self) -> float:
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def _v2(self) -> float:
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6


class CpuProfile:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.group = _Group()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        cpu, wall = self.group.usage(), time.monotonic()
        yield
        record = {"test": item.nodeid, "cpu_s": round(self.group.usage() - cpu, 2),
                  "wall_s": round(time.monotonic() - wall, 2)}
        with open(self.out, "a") as out:
            out.write(json.dumps(record) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    out = os.environ.get("RESIHP_CPU_PROFILE")
    if out:
        config.pluginmanager.register(CpuProfile(Path(out)), "resihp-cpu-profile")
