"""The machines harness itself: separate addresses, hostnames and processes, the three faults, certain clean-up.

Real namespaces, a real bridge and real TCP between machines; skipped with the reason where the
namespaces cannot be made (not root, no ``ip``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from resihp_lightning.testing.machines import Machines, MachinesConfig, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

#: A one-connection TCP server on port 5000 that prints what it receives.
SERVER = "import socket; s = socket.create_server(('0.0.0.0', 5000)); c, _ = s.accept(); print(c.recv(100).decode())"


def _connect(machine, host: str, timeout: float) -> subprocess.CompletedProcess:
    client = f"import socket; socket.create_connection(({host!r}, 5000), timeout={timeout}).sendall(b'hello from ' + socket.gethostname().encode())"
    return subprocess.run(machine.command([sys.executable, "-S", "-c", client]), capture_output=True, text=True,
                          timeout=timeout + 10)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _alive(pid: int) -> bool:
    try:
        return _state(pid) != "Z"
    except OSError:
        return False


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_machines_have_their_own_names_addresses_and_processes_and_reach_each_other_by_name():
    with Machines(3) as machines:
        for machine in machines:
            out = machine.check_call(["sh", "-c", "hostname; ip -4 -o addr show dev eth0; getent hosts node0 node2"])
            lines = out.split("\n")
            assert lines[0] == machine.hostname == f"node{machine.index}"
            assert f"inet {machine.address}/24" in lines[1]
            assert "10.77.0.1" in lines[2] and "node0" in lines[2] and "10.77.0.3" in lines[3]
            assert machine.pids() == []  # nothing runs on a fresh machine but its init
        server = machines[1].popen([sys.executable, "-S", "-c", SERVER], stdout=subprocess.PIPE, text=True)
        try:
            _wait(lambda: len(machines[1].pids()) == 1, 10, "the server on node1")
            assert machines[0].pids() == [] and machines[2].pids() == []  # each machine sees only its own
            listing = "import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
            inside = eval(machines[1].check_call([sys.executable, "-S", "-c", listing]))
            assert len(inside) == 3 and inside[0] == 1  # its own /proc: its init, the server, this python
            assert len([p for p in os.listdir("/proc") if p.isdigit()]) > 3 + len(inside)
            _wait(lambda: _connect(machines[0], "node1", 2).returncode == 0, 10, "node0 -> node1:5000")
            assert server.communicate(timeout=10)[0].strip() == "hello from node0"
        finally:
            server.kill()
            server.wait()


@pytest.mark.timeout(120)
def test_a_cut_link_leaves_the_machine_running_but_unreachable_until_restored():
    with Machines(2) as machines:
        server = machines[1].popen([sys.executable, "-S", "-c", SERVER], stdout=subprocess.PIPE, text=True)
        try:
            _wait(lambda: len(machines[1].pids()) == 1, 10, "the server on node1")
            machines[1].cut_link()
            started = time.monotonic()
            refused = _connect(machines[0], "node1", 1.5)
            assert refused.returncode != 0 and "timed out" in refused.stderr  # silence, not a reset
            assert time.monotonic() - started >= 1.4
            assert server.poll() is None and machines[1].pids()  # alive behind the cut
            machines[1].restore_link()
            _wait(lambda: _connect(machines[0], "node1", 2).returncode == 0, 15, "node0 -> node1 after the restore")
            assert server.communicate(timeout=10)[0].strip() == "hello from node0"
        finally:
            server.kill()
            server.wait()


@pytest.mark.timeout(120)
def test_kill_takes_every_process_of_one_machine_daemons_included_and_the_machine_runs_new_ones():
    with Machines(2) as machines:
        sleepers = [machines[i].popen(["sh", "-c", "setsid sleep 300 & sleep 300"]) for i in (0, 1)]
        _wait(lambda: all(len(machines[i].pids()) == 3 for i in (0, 1)), 10, "sh and two sleeps on each machine")
        victims = machines[1].pids()
        killed = machines[1].kill()
        assert sorted(killed) == sorted(victims) and not any(_alive(pid) for pid in victims)
        assert sleepers[1].wait(10) == -signal.SIGKILL or sleepers[1].returncode != 0
        assert len(machines[0].pids()) == 3 and sleepers[0].poll() is None  # the other machine is untouched
        assert machines[1].check_call(["hostname"]).strip() == "node1"  # up again: a replacement machine
        for process in sleepers:
            process.kill()
            process.wait()


@pytest.mark.timeout(120)
def test_stop_freezes_every_process_of_a_machine_and_resume_continues_them():
    with Machines(1) as machines:
        launcher = machines[0].popen(["sh", "-c", "sleep 300 & sleep 300"])
        _wait(lambda: len(machines[0].pids()) == 3, 10, "sh and two sleeps")
        stopped = machines[0].stop()
        assert len(stopped) == 3 and all(_state(pid) == "T" for pid in stopped)
        _wait(lambda: _state(launcher.pid) == "T", 10, "nsenter to stop with its command")
        machines[0].resume()
        _wait(lambda: all(_state(pid) == "S" for pid in stopped + [launcher.pid]), 10, "the processes to continue")
        machines[0].stop()  # and left stopped: the clean-up must still end everything
    assert launcher.wait(10) != 0
    _wait(lambda: not any(_alive(pid) for pid in stopped), 10, "the stopped processes to end")


@pytest.mark.timeout(120)
def test_kill_after_stop_ends_the_stopped_processes_and_their_launchers():
    with Machines(1) as machines:
        launcher = machines[0].popen(["sleep", "300"])
        _wait(lambda: len(machines[0].pids()) == 1, 10, "the sleep")
        machines[0].stop()
        _wait(lambda: _state(launcher.pid) == "T", 10, "nsenter to stop with its command")
        machines[0].kill()
        assert launcher.wait(10) == -signal.SIGKILL  # nsenter passes on how its command died


@pytest.mark.timeout(120)
def test_close_leaves_no_process_and_no_namespace_even_after_a_failing_test():
    with pytest.raises(RuntimeError, match="the test failed"), Machines(2) as machines:
        for machine in machines:
            machine.popen(["sh", "-c", "setsid sleep 300 & sleep 300"])
        _wait(lambda: all(len(m.pids()) == 3 for m in machines), 10, "the sleeps")
        inits = [m._holder.inner_pid for m in machines] + [machines._switch.inner_pid]
        pids = [pid for m in machines for pid in m.pids()]
        workdir = machines.workdir
        raise RuntimeError("the test failed")
    _wait(lambda: not any(_alive(pid) for pid in inits + pids), 10, "every process of every machine to end")
    assert not workdir.exists()
    assert machines.close() is None  # idempotent


@pytest.mark.timeout(120)
def test_the_machines_die_with_the_process_that_made_them_even_on_sigkill(tmp_path):
    """No ``close``, no ``atexit``: the owner is SIGKILLed; the parent-death signal still tears down."""
    script = textwrap.dedent(f"""
        import sys, time
        from resihp_lightning.testing.machines import Machines
        machines = Machines(2, workdir={str(tmp_path / "machines")!r})
        for machine in machines:
            machine.popen(["sh", "-c", "setsid sleep 300 & sleep 300"])
        while not all(len(m.pids()) == 3 for m in machines):
            time.sleep(0.05)
        pids = [m._holder.inner_pid for m in machines] + [machines._switch.inner_pid] + [p for m in machines for p in m.pids()]
        print(" ".join(map(str, pids)), flush=True)
        time.sleep(300)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 3 + 6 and all(_alive(pid) for pid in pids)
    finally:
        owner.kill()
        owner.wait()
    _wait(lambda: not any(_alive(pid) for pid in pids), 10, "every machine's processes to die with their owner")


@pytest.mark.timeout(120)
def test_two_harnesses_on_the_same_subnet_do_not_see_each_other():
    """Each harness has a switch of its own: parallel tests need no unique addresses or names."""
    config = MachinesConfig(count=2)
    with Machines(config) as first, Machines(config) as second:
        server = first[1].popen([sys.executable, "-S", "-c", SERVER], stdout=subprocess.PIPE, text=True)
        try:
            _wait(lambda: len(first[1].pids()) == 1, 10, "the server in the first harness")
            assert _connect(second[0], "node1", 1).returncode != 0  # same name, same address, other network
            _wait(lambda: _connect(first[0], "node1", 2).returncode == 0, 10, "the first harness's node0 -> node1")
        finally:
            server.kill()
            server.wait()


def test_the_config_refuses_impossible_layouts():
    with pytest.raises(ValueError, match="count"):
        MachinesConfig(count=0)
    with pytest.raises(ValueError, match="room for 9 hosts"):
        MachinesConfig(count=9, subnet="10.0.0.0/29")
