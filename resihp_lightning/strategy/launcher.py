"""Lightning's script launcher, run by a supervisor that is no rank (``fail_stop`` on, one command per machine).

Lightning's ``_SubprocessScriptLauncher`` makes the command the user typed (``python train.py``) rank 0:
it starts ranks 1.. as its children and watches them with a thread that kills every process when one
child fails. Under in-process fail-stop recovery both are wrong: the survivors of a dead rank are
about to regroup, and a rank 0 that dies ends the command (status 137) while the survivors train on
in the background. :func:`supervised` gives the launcher a subclass whose ``launch``, in the process
the user started, starts *every* local rank (rank 0 included) as a child process the way Lightning
starts ranks 1.. (the same script and arguments, ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` / ``MASTER_PORT``) and then only supervises them
(:class:`~resihp_lightning.strategy.rank_supervisor.RankSupervisor`): their output goes to the
command's stdout / stderr, SIGINT / SIGTERM are forwarded, and when the last rank has exited the
process exits with the job's status (0 when the survivors finished, ``fail_stop.exit_code`` when they
ask for a restart, the failure's status when every rank failed). It never returns there: the code
after ``trainer.fit`` runs in the ranks, as before (rank 0's included). In a rank (``LOCAL_RANK`` set)
``launch`` just runs the training function.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

from resihp_lightning.strategy.rank_supervisor import RankSupervisor

_CLASSES: dict[type, type] = {}


def supervised(launcher: Any, *, restart_code: int) -> Any:
    """Turns ``launcher`` (a ``_SubprocessScriptLauncher`` of either Lightning package) into a supervised one.

    Args:
        launcher: the strategy's launcher, changed in place (its class) and returned.
        restart_code: the status with which ranks ask for a restart (``fail_stop.exit_code``).
    """
    base = type(launcher)
    if not getattr(base, "_resihp_supervised", False):
        if base not in _CLASSES:
            _CLASSES[base] = _supervised_class(base)
        launcher.__class__ = _CLASSES[base]
    launcher.restart_code = restart_code
    return launcher


def _supervised_class(base: type) -> type:
    class SupervisedLauncher(base):  # type: ignore[misc, valid-type]
        """``launch`` starts every local rank under a :class:`RankSupervisor` and exits with the job's status."""

        _resihp_supervised = True
        restart_code: int
        supervisor: RankSupervisor | None = None

        def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
            if not self.cluster_environment.creates_processes_externally:
                status = self.supervise()
                sys.stdout.flush()
                sys.stderr.flush()
                # Not sys.exit: SystemExit would run Lightning's exception path (callbacks' on_exception,
                # teardown) in a process that never trained.
                os._exit(status)
            _set_num_threads_if_needed(num_processes=self.num_processes)
            return function(*args, **kwargs)

        def supervise(self) -> int:
            """Starts every local rank, waits for all of them and returns the job's status."""
            commands, envs, cwd = self.rank_commands()
            self.supervisor = RankSupervisor(commands, envs, cwd=cwd, restart_code=self.restart_code)
            self.supervisor.start()
            self.procs = list(self.supervisor.procs)
            return self.supervisor.wait()

        def rank_commands(self) -> tuple[list[list[str]], list[dict[str, str]], str | None]:
            """Each local rank's command line and environment, as Lightning builds them for ranks 1.."""
            self._check_can_spawn_children()
            env = self.cluster_environment
            shared = {
                "MASTER_ADDR": env.main_address,
                "MASTER_PORT": str(env.main_port),
                "NODE_RANK": str(env.node_rank()),
                "WORLD_SIZE": str(self.num_processes * self.num_nodes),
            }
            os.environ.update(shared)  # as Lightning does: what this process reads later agrees with its ranks
            commands, envs, cwd = [], [], None
            for local_rank in range(self.num_processes):
                rank_env = {**os.environ, "LOCAL_RANK": str(local_rank)}
                command, cwd = _script_command(local_rank)
                commands.append(command)
                envs.append(rank_env)
            return commands, envs, cwd

        def kill(self, signum: Any) -> None:
            if self.supervisor is not None:
                self.supervisor.send(signum)

    SupervisedLauncher.__name__ = SupervisedLauncher.__qualname__ = f"Supervised{base.__name__}"
    return SupervisedLauncher


def _script_command(local_rank: int) -> tuple[list[str], str | None]:
    """The command that runs this script again as ``local_rank`` (Lightning's, Hydra-aware)."""
    from lightning.fabric.strategies.launchers.subprocess_script import (
        _HYDRA_AVAILABLE,
        _basic_subprocess_cmd,
        _hydra_subprocess_cmd,
    )

    if _HYDRA_AVAILABLE:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            command, cwd = _hydra_subprocess_cmd(local_rank)
            return list(command), cwd
    return list(_basic_subprocess_cmd()), None
