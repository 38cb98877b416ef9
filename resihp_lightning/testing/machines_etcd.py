"""The job's etcd cluster on :class:`~.machines.Machines`: one member per machine, started as the recipe starts it.

:class:`MachinesEtcd` runs, on every machine, the command ``examples/torchrun_per_process.sh`` runs
there with ``ETCD_MEMBERS=node0,node1,node2`` set::

    python -m resihp_lightning.resilience.etcd_member --members node0,node1,node2 --name node1 --token JOB \
        --data-dir $TMPDIR/resihp-etcd-JOB-node1

(:mod:`resihp_lightning.resilience.etcd_member`: ``etcd`` named after the machine, listening on the
machine's address, its data in the machine's own temporary directory), then, on machine 0 (the first
of the list), the recipe's one-off set-up of the job's user (``python -m
resihp_lightning.resilience.etcd_admin --user job``, passwords in the shared run directory). :meth:`MachinesEtcd.store_options` is the job's
``fail_stop.store``. The members end with their machines (:meth:`~.machines.Machines.close`).

    with Machines(3) as machines, MachinesEtcd(machines, run_dir) as etcd:
        job = TorchrunJob(machines, run_dir, TorchrunJobConfig(per_process=True, store=etcd.store_options()))
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from resihp_lightning.resilience.etcd_member import DEFAULT_CLIENT_PORT, client_endpoints
from resihp_lightning.testing.machines import Machine, Machines
from resihp_lightning.testing.torchrun_machines import ROOT, TorchrunJob

#: The job's etcd user (the recipe's).
USER = "job"


class MachinesEtcd:
    """One etcd member per machine and the job's user; a context manager.

    Args:
        machines: one member on each.
        run_dir: the shared directory of the members' logs and the password files.
        token: the cluster token (the recipe's ``JOB_ID``).
        setup_timeout_s: bound of the user set-up (it waits for the members to elect a leader).
    """

    def __init__(self, machines: Machines, run_dir: str | Path, *, token: str = "machines-job",
                 setup_timeout_s: float = 60.0) -> None:
        self.machines, self.run_dir, self.token = machines, Path(run_dir), token
        self.setup_timeout_s = setup_timeout_s
        self.members = [m.hostname for m in machines]
        self.processes: list[subprocess.Popen] = []

    @property
    def endpoints(self) -> list[str]:
        """The members' client URLs."""
        return client_endpoints(self.members, DEFAULT_CLIENT_PORT)

    @property
    def password_file(self) -> Path:
        return self.run_dir / "etcd-job.pw"

    def member_command(self, machine: Machine) -> list[str]:
        """What ``machine`` runs (the recipe's line; the member listens on the address its name resolves to)."""
        data_dir = machine.tmpdir / f"resihp-etcd-{self.token}-{machine.hostname}"
        return [sys.executable, "-m", "resihp_lightning.resilience.etcd_member", "--members", ",".join(self.members),
                "--name", machine.hostname, "--token", self.token, "--data-dir", str(data_dir)]

    def admin_command(self) -> list[str]:
        """The recipe's one-off set-up of the job's user, run on machine 0."""
        return [sys.executable, "-m", "resihp_lightning.resilience.etcd_admin", "--endpoints", ",".join(self.endpoints),
                "--user", USER, "--password-file", str(self.password_file),
                "--root-password-file", str(self.run_dir / "etcd-root.pw")]

    def store_options(self, **extra: Any) -> dict[str, Any]:
        """The job's ``fail_stop.store`` (``extra``: more etcd options, e.g. ``request_timeout_s``)."""
        return {"backend": "etcd", "endpoints": self.endpoints, "user": USER, "password_file": str(self.password_file),
                **extra}

    def start(self) -> MachinesEtcd:
        """Starts every member, then makes the job's user (which waits for a leader)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        env = TorchrunJob.environment()
        for machine in self.machines:
            with open(self.run_dir / f"etcd-{machine.hostname}.log", "w") as log:
                self.processes.append(machine.popen(self.member_command(machine), env=env, cwd=ROOT, stdout=log,
                                                    stderr=subprocess.STDOUT))
        self.machines[0].check_call(["env", f"PYTHONPATH={env['PYTHONPATH']}", *self.admin_command()],
                                    timeout=self.setup_timeout_s)
        return self

    def member_view(self, index: int, timeout_s: float = 30.0) -> tuple[int, int]:
        """``(revision, number of job keys)`` as machine ``index``'s own member answers a linearizable read (it
        answers only as part of a quorum, so two members that answer the same have one history), retried until
        ``timeout_s``."""
        code = (
            "import time, sys\n"
            "from resihp_lightning.resilience.etcd_gateway import EtcdGateway, b64\n"
            "from resihp_lightning.resilience.etcd_config import ETCD_KEY_PREFIX, prefix_end\n"
            f"g = EtcdGateway([{self.endpoints[index]!r}], user={USER!r}, password=open({str(self.password_file)!r}).read().strip())\n"
            "p = ETCD_KEY_PREFIX.encode()\n"
            "a = g.call('/v3/kv/range', {'key': b64(p), 'range_end': b64(prefix_end(p)), 'count_only': True},\n"
            f"           deadline=time.monotonic() + {timeout_s!r})\n"
            "print(a['header']['revision'], a.get('count', 0))\n"
        )
        env = TorchrunJob.environment()
        out = self.machines[index].check_call(["env", f"PYTHONPATH={env['PYTHONPATH']}", sys.executable, "-c", code],
                                              timeout=timeout_s + 30)
        revision, count = out.split()
        return int(revision), int(count)

    def alive(self) -> list[bool]:
        """Whether each member's process still runs."""
        return [p.poll() is None for p in self.processes]

    def __enter__(self) -> MachinesEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                pass
