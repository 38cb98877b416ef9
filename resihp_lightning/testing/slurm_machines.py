"""A SLURM batch job across :class:`~.machines.Machines`: the recipe's own script, with srun emulated.

:class:`SbatchJob` takes what a user types, ``sbatch [--nodes N] [--ntasks-per-node P] SCRIPT ARGS``
(its ``argv``) and the variables set before it (``env``, e.g. ``ETCD_NODES=3``), and runs it as SLURM
would once the allocation is granted: a *slurmd* on every machine (:mod:`.fake_slurm`), then ``bash
SCRIPT ARGS`` on machine 0, the first node of the allocation, with the batch job's variables
(``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``, ``SLURM_NNODES``, ``SLURM_NTASKS_PER_NODE``,
``SLURM_SUBMIT_DIR``, ...) and the emulated ``srun`` and ``scontrol`` first on its ``PATH``. The
script's output goes to ``slurm-<job id>.out`` in the run directory (its ``#SBATCH --output``).

``#SBATCH`` lines give the defaults of ``--nodes``, ``--ntasks-per-node``, ``--job-name`` and
``--gpus-per-node`` (only its count, ``SLURM_GPUS_PER_NODE``: nothing binds a GPU), the command line
overrides them; the allocation is every machine (``--nodes`` must say so). Other ``#SBATCH`` options
(``--time``, ``--no-kill``, ``--requeue``, ...) mean nothing here and are ignored; on the command line
they are refused.
The readers of :class:`~.torchrun_machines.TorchrunJob` read what the workers of
:mod:`.machines_job` wrote; :meth:`SbatchJob.task_exits` reads each task's exit status.

    with Machines(3) as machines, SbatchJob(machines, run_dir, ["examples/slurm_in_process.sbatch", ...],
                                             env={"ETCD_NODES": "3"}) as job:
        ...
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from resihp_lightning.testing.fake_slurm import (
    BIN,
    NODE_TIMEOUT_ENV,
    SPOOL_ENV,
    StepRequest,
    compress_hostlist,
    read_exits,
    read_request,
    step_dirs,
)
from resihp_lightning.testing.machines import Machines
from resihp_lightning.testing.torchrun_machines import ROOT, TorchrunJob

#: The sbatch options the emulation reads; every other one is ignored.
_SBATCH_OPTIONS = {"-N": "nodes", "--nodes": "nodes", "--ntasks-per-node": "ntasks_per_node",
                   "-J": "job_name", "--job-name": "job_name", "--gpus-per-node": "gpus_per_node"}


def parse_sbatch(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """``sbatch`` options (those the emulation reads) and the script with its arguments."""
    options: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        name, eq, value = argv[i].partition("=")
        if name not in _SBATCH_OPTIONS:
            raise ValueError(f"sbatch option {name} is not emulated (only {', '.join(sorted(_SBATCH_OPTIONS))})")
        if not eq:
            i += 1
            value = argv[i]
        options[_SBATCH_OPTIONS[name]] = value
        i += 1
    if i >= len(argv):
        raise ValueError("sbatch: no batch script given")
    return options, list(argv[i:])


def script_options(script: Path) -> dict[str, str]:
    """The ``#SBATCH`` lines' options the emulation reads (those before the first command)."""
    options: dict[str, str] = {}
    for line in script.read_text().splitlines():
        if line.startswith("#SBATCH"):
            for word in shlex.split(line[len("#SBATCH"):]):
                name, _, value = word.partition("=")
                if name in _SBATCH_OPTIONS and value:
                    options[_SBATCH_OPTIONS[name]] = value
        elif line.strip() and not line.startswith("#"):
            break
    return options


class SbatchJob(TorchrunJob):
    """``sbatch ARGV`` run on the machines (see the module's documentation); a context manager that ends it all.

    Args:
        machines: the allocation (machine 0 runs the batch script).
        run_dir: the directory every machine shares (the workers' records, the spool, the script's output).
        argv: what follows ``sbatch`` on the user's command line.
        env: the variables the user sets for the script (e.g. ``{"ETCD_NODES": "3", "RUN_DIR": ...}``).
        job_id: ``SLURM_JOB_ID``.
        node_timeout_s: when the emulated srun counts a node whose slurmd is silent as lost.
    """

    def __init__(self, machines: Machines, run_dir: Path, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 job_id: int = 4242, node_timeout_s: float = 5.0) -> None:
        super().__init__(machines, run_dir)
        options, self.script = parse_sbatch(argv)
        self.options = {**script_options(ROOT / self.script[0]), **options}
        nodes = int(self.options.get("nodes", len(machines)))
        if nodes != len(machines):
            raise ValueError(f"sbatch --nodes {nodes}: the emulation allocates every machine ({len(machines)})")
        self.user_env = dict(env or {})
        self.job_id, self.node_timeout_s = job_id, node_timeout_s
        self.spool = self.run_dir / f"spool-{job_id}"
        self.daemons: list[subprocess.Popen] = []

    @property
    def output(self) -> Path:
        """The batch script's output (``slurm-<job id>.out``)."""
        return self.run_dir / f"slurm-{self.job_id}.out"

    def batch_environment(self) -> dict[str, str]:
        """What the batch script starts with: the harness's clean environment, the batch job's variables, the
        emulated commands first on ``PATH``, then the user's variables."""
        names = [m.hostname for m in self.machines]
        per_node = int(self.options.get("ntasks_per_node", "1"))
        env = self.environment()
        path = [str(BIN), str(Path(sys.executable).parent), env.get("PATH", "")]
        env.update({
            "PATH": ":".join(path), SPOOL_ENV: str(self.spool), "RESIHP_FAKE_SLURM_PYTHON": sys.executable,
            NODE_TIMEOUT_ENV: str(self.node_timeout_s), "SLURM_JOB_ID": str(self.job_id), "SLURM_JOBID": str(self.job_id),
            "SLURM_JOB_NAME": self.options.get("job_name", Path(self.script[0]).name),
            "SLURM_JOB_NODELIST": compress_hostlist(names), "SLURM_NODELIST": compress_hostlist(names),
            "SLURM_NNODES": str(len(names)), "SLURM_JOB_NUM_NODES": str(len(names)),
            "SLURM_NTASKS": str(len(names) * per_node), "SLURM_NPROCS": str(len(names) * per_node),
            "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_TASKS_PER_NODE": f"{per_node}(x{len(names)})",
            "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_NODEID": "0", "SLURMD_NODENAME": names[0],
        })
        if "gpus_per_node" in self.options:  # the count only: nothing here binds a GPU
            env["SLURM_GPUS_PER_NODE"] = self.options["gpus_per_node"]
        env.update(self.user_env)
        return env

    def start(self) -> SbatchJob:
        """Starts every machine's slurmd, then the batch script on machine 0."""
        self.started_at = time.monotonic()
        self.spool.mkdir(parents=True, exist_ok=True)
        for machine in self.machines:
            with open(self.run_dir / f"slurmd-{machine.hostname}.log", "w") as log:
                self.daemons.append(machine.popen(
                    [sys.executable, "-m", "resihp_lightning.testing.fake_slurm", "slurmd", str(self.spool),
                     machine.hostname], env=self.environment(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        self.wait_for(lambda: all((self.spool / f"node-{m.hostname}.beat").exists() for m in self.machines), 60,
                      "every slurmd")
        with open(self.output, "w") as out:
            self.agents.append(self.machines[0].popen(["bash", *self.script], env=self.batch_environment(), cwd=ROOT,
                                                      stdout=out, stderr=subprocess.STDOUT))
        self.agent_machines.append(0)
        return self

    def agent_log(self, index: int = 0) -> str:
        """The batch script's output (there is one "agent": the script)."""
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    # --- the steps -------------------------------------------------------------------------------
    def steps_started(self) -> list[StepRequest]:
        """Every job step the script started, in order."""
        return [r for r in map(read_request, step_dirs(self.spool)) if r is not None]

    def step_of(self, word: str) -> StepRequest | None:
        """The first step whose command has ``word`` in one of its arguments."""
        return next((r for r in self.steps_started() if any(word in a for a in r.argv)), None)

    def task_exits(self, step: StepRequest) -> dict[int, dict]:
        """``{task: {"status", "node", "time", "how"}}`` of ``step``'s tasks that ended (``time``: Unix seconds)."""
        return read_exits(self.spool / f"step-{step.step_id}")

    def wait_batch(self, timeout: float) -> int | None:
        """The batch script's exit status once it ended (``None`` if it still runs at the deadline)."""
        return self.wait_agents([0], timeout)[0]
