"""A torchrun job across :class:`~.machines.Machines`: one agent per machine, as a cluster user starts it.

:class:`TorchrunJob` starts, on every machine, the command a user types there::

    torchrun --nnodes 3 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint node0:29400 \\
        resihp_lightning/testing/machines_job.py --run-dir RUN --store-port 29600

and reads back what the workers wrote (:mod:`.machines_job`): which rank ran where, each step's loss,
each survivor's final losses and weights, the events log. Faults come from the machines themselves
(:meth:`~.machines.Machine.kill`, :meth:`~.machines.Machine.cut_link`, :meth:`~.machines.Machine.stop`).
Every wait has a deadline; the machines' clean-up ends every agent and worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resihp_lightning.testing.machines import Machines

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "resihp_lightning" / "testing" / "machines_job.py"


@dataclass(frozen=True, kw_only=True)
class TorchrunJobConfig:
    """The torchrun command line of every machine.

    Attributes:
        nproc_per_node: workers per machine (``--nproc-per-node``).
        nnodes: ``--nnodes`` (``"3"``, or ``"2:3"`` for an elastic range).
        max_restarts: ``--max-restarts``.
        rdzv_port: the c10d rendezvous port on machine 0 (``--rdzv-endpoint node0:PORT``).
        store_port: ``fail_stop.store_port`` (the job's own store host, on node rank 0).
        store: ``fail_stop.store`` instead of ``store_port`` (e.g. :meth:`.machines_etcd.MachinesEtcd.store_options`:
            the etcd members of the machines).
        steps: training steps (one epoch of the toy job is 6; toy_jobs.reference_run is the reference of more).
        step_s: sleep inside each step (in all), so that an outside fault lands inside one.
        rdzv_conf: ``--rdzv-conf``.
        detect_timeout_s: ``fail_stop.detect_timeout_s`` (the library's default 1 s evicts healthy ranks
            now and then on an overloaded machine: issue 25's "no false evictions").
        join_timeout_s: ``fail_stop.join_timeout_s``.
        job_args: more arguments of the worker script.
        per_process: torchft's pattern instead: ``nproc_per_node`` agents per machine, each
            ``torchrun --standalone --nproc-per-node 1`` (its own rendezvous, nobody else's workers),
            the ranks from the job's rank store on machine 0 at ``rank_port``
            (``RESIHP_RANKS_AT``, :mod:`resihp_lightning.process_ranks`).
        rank_port: with ``per_process``, the rank-assignment store's port on machine 0.
    """

    nproc_per_node: int = 2
    nnodes: str = "3"
    max_restarts: int = 2
    rdzv_port: int = 29400
    store_port: int = 29600
    store: Mapping[str, Any] | None = None
    steps: int = 6
    step_s: float = 2.0
    rdzv_conf: str = "join_timeout=120,last_call_timeout=1"
    detect_timeout_s: float = 1.0
    join_timeout_s: float = 30.0
    job_args: Sequence[str] = field(default_factory=tuple)
    per_process: bool = False
    rank_port: int = 29500


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            pass
    return out


class TorchrunJob:
    """One torchrun agent per machine running :mod:`.machines_job`; a context manager that ends them all.

    Args:
        machines: where to run (agent ``i`` on machine ``i``; the rendezvous endpoint is machine 0).
        run_dir: the directory every machine shares (the workers' records, the agents' logs).
        config: the command line.
    """

    def __init__(self, machines: Machines, run_dir: Path, config: TorchrunJobConfig | None = None) -> None:
        self.machines, self.run_dir, self.config = machines, Path(run_dir), config or TorchrunJobConfig()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.agents: list[subprocess.Popen] = []
        self.agent_machines: list[int] = []  # the machine of each agent
        self.started_at = time.monotonic()

    def command(self, local_index: int = 0, join: bool = False) -> list[str]:
        """The command of one agent (``local_index``: its index on its machine, with ``per_process``;
        ``join``: a newcomer that joins the running job, with ``per_process``)."""
        cfg = self.config
        torchrun = Path(sys.executable).with_name("torchrun")
        store = ["--store", json.dumps(dict(cfg.store))] if cfg.store is not None else ["--store-port", str(cfg.store_port)]
        job = [str(JOB), "--run-dir", str(self.run_dir), *store, "--steps", str(cfg.steps), "--step-s", str(cfg.step_s),
               "--detect-timeout-s", str(cfg.detect_timeout_s), "--join-timeout-s", str(cfg.join_timeout_s), *cfg.job_args]
        if cfg.per_process:  # what examples/torchrun_per_process.sh starts for each process
            world = len(self.machines) * cfg.nproc_per_node
            ranks = [f"RESIHP_RANKS_AT={self.machines[0].hostname}:{cfg.rank_port}", f"RESIHP_WORLD_SIZE={world}",
                     f"RESIHP_NPROC_PER_NODE={cfg.nproc_per_node}", f"RESIHP_LOCAL_INDEX={local_index}",
                     "RESIHP_JOB_ID=machines-job", *(["RESIHP_JOIN=1"] if join else [])]
            return ["env", *ranks, str(torchrun), "--standalone", "--nnodes", "1", "--nproc-per-node", "1",
                    "--max-restarts", str(cfg.max_restarts), "--monitor-interval", "0.1", *job]
        return [str(torchrun), "--nnodes", cfg.nnodes, "--nproc-per-node", str(cfg.nproc_per_node),
                "--max-restarts", str(cfg.max_restarts), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{self.machines[0].hostname}:{cfg.rdzv_port}", "--rdzv-id", "job",
                "--rdzv-conf", cfg.rdzv_conf, "--monitor-interval", "0.1", *job]

    @staticmethod
    def environment() -> dict[str, str]:
        """This process's environment without a launcher's variables, one thread per worker, torchrun's
        agent logging at INFO (its exit barrier and restarts show in the agents' logs)."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC", "GROUP_", "RESIHP_RANKS",
                                    "RESIHP_WORLD_SIZE", "RESIHP_LOCAL_INDEX", "RESIHP_NPROC_PER_NODE", "RESIHP_JOB_ID",
                                    "RESIHP_NODE_NAME", "RESIHP_JOIN", "RESIHP_MASTER_ADDR", "SLURM_"))}
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", LOGLEVEL="INFO",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        return env

    def start(self) -> TorchrunJob:
        """Starts every machine's agent(s) (machine 0's first: it hosts the rendezvous)."""
        self.started_at = time.monotonic()
        per_machine = self.config.nproc_per_node if self.config.per_process else 1
        for machine in self.machines:
            for local_index in range(per_machine):
                log = open(self.run_dir / f"agent{len(self.agents)}.log", "w")
                command = self.command(local_index)
                self.agents.append(machine.popen(command, env=self.environment(), cwd=ROOT, stdout=log,
                                                 stderr=subprocess.STDOUT))
                self.agent_machines.append(machine.index)
                log.close()
        return self

    def join(self, machine_index: int) -> list[int]:
        """Starts ``nproc_per_node`` newcomers on machine ``machine_index`` (e.g. a replacement for a killed one), as
        ``JOIN=1 examples/torchrun_per_process.sh`` does: each under its own ``torchrun --standalone`` agent with
        ``RESIHP_JOIN=1`` and the job's variables. Returns the new agents' indices."""
        if not self.config.per_process:
            raise ValueError("join() starts newcomers of the per_process launch")
        machine, started = self.machines[machine_index], []
        for local_index in range(self.config.nproc_per_node):
            log = open(self.run_dir / f"agent{len(self.agents)}.log", "w")
            self.agents.append(machine.popen(self.command(local_index, join=True), env=self.environment(),
                                             cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
            self.agent_machines.append(machine_index)
            started.append(len(self.agents) - 1)
            log.close()
        return started

    def __enter__(self) -> TorchrunJob:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        for machine in self.machines:
            machine.kill()  # SIGKILL ends stopped processes too
        for agent in self.agents:
            try:
                agent.wait(10)
            except subprocess.TimeoutExpired:
                pass

    # --- what the workers wrote ------------------------------------------------------------------
    def starts(self) -> list[dict]:
        """Each worker's start record (host, node rank, local rank, pid, ``MASTER_ADDR``), with its ``tag``."""
        return [{**json.loads(p.read_text()), "tag": p.stem[len("start-"):]} for p in sorted(self.run_dir.glob("start-*.json"))]

    def steps(self) -> dict[str, list[dict]]:
        """Each worker's finished steps, keyed by tag (``r<restart>-<rank>-<pid>``)."""
        return {p.stem[len("steps-"):]: _read_jsonl(p) for p in sorted(self.run_dir.glob("steps-*.jsonl"))}

    def results(self) -> dict[str, dict]:
        """Each worker's end-of-``fit`` record, keyed by tag."""
        out = {}
        for path in sorted(self.run_dir.glob("result-*.json")):
            try:
                out[path.stem[len("result-"):]] = json.loads(path.read_text())
            except json.JSONDecodeError:  # being written
                pass
        return out

    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        return _read_jsonl(path) if path.exists() else []

    def agent_log(self, index: int) -> str:
        return (self.run_dir / f"agent{index}.log").read_text(errors="replace")

    def max_step(self) -> int:
        return max((r["step"] for rows in self.steps().values() for r in rows), default=-1)

    # --- waiting ---------------------------------------------------------------------------------
    def wait_for(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        """Polls ``condition`` until it is truthy (returns it); fails naming ``what`` and the agents' log tails."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- agent{i}\n{self.agent_log(i)[-1500:]}" for i in range(len(self.agents)))
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tails}")
            time.sleep(0.1)

    def wait_agents(self, indices: Sequence[int], timeout: float) -> list[int | None]:
        """Exit statuses of the given agents once they have all ended (``None`` for one still running at the deadline)."""
        deadline = time.monotonic() + timeout
        for i in indices:
            try:
                self.agents[i].wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [self.agents[i].poll() for i in indices]
