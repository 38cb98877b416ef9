"""``BackgroundPlanner``: the controller's solves run in a process of their own, off the training step.

A solve can take seconds (CP-SAT at scale) and, in Python, would hold the interpreter lock of the
training process that runs it. The controller's rank 0 hands each :class:`~resihp_lightning.plan.Problem`
to one long-lived worker process (:mod:`.planner_worker`, started once at setup so that its imports
overlap the job's warm-up) and polls for the answer at step boundaries; the other ranks never wait
for a solve. A job submitted while an older one runs supersedes it: the older answer is dropped.

The worker is a plain ``python -m`` subprocess talking over pipes, not a ``multiprocessing`` child:
those re-import the launching script (a Lightning script without a ``__main__`` guard would start
training again) and cannot be started from daemonic processes. It exits when its stdin closes, so it
ends with the training process whatever way that ends.
"""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from resihp_lightning.config import PlannerConfig
from resihp_lightning.plan import Plan, Problem


class BackgroundPlanner:
    """One worker process that solves planning problems (use it on the rank that plans)."""

    def __init__(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "resihp_lightning.callbacks.replan.planner_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        self._answers: queue.Queue[tuple[int, Any]] = queue.Queue()
        threading.Thread(target=self._read, name="resihp-planner-reader", daemon=True).start()
        self._submitted = 0
        self._wanted: int | None = None
        self._tag: Any = None

    @property
    def busy(self) -> bool:
        """Whether a submitted job has not been collected yet."""
        return self._wanted is not None

    def submit(self, problem: Problem, config: PlannerConfig, tag: Any = None) -> None:
        """Starts solving ``problem``; a job still pending is superseded (its answer will be ignored)."""
        self._submitted += 1
        self._wanted, self._tag = self._submitted, tag
        try:
            pickle.dump((self._submitted, problem, config), self._proc.stdin)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            self._answers.put((self._submitted, RuntimeError(f"the planner's worker process is gone: {err}")))

    def poll(self, wait_s: float = 0.0) -> tuple[bool, Any, Plan | BaseException | None]:
        """Collects the current job if its answer arrives within ``wait_s`` seconds.

        Returns:
            ``(done, tag, plan or the exception the solve raised)``; ``(False, tag, None)`` while it runs.
        """
        if self._wanted is None:
            return False, None, None
        while True:
            try:
                job, answer = self._answers.get(timeout=wait_s) if wait_s > 0 else self._answers.get_nowait()
            except queue.Empty:
                return False, self._tag, None
            if job == self._wanted:
                self._wanted = None
                return True, self._tag, answer
            # an answer to a superseded job: drop it and keep waiting (within the same budget)

    def close(self) -> None:
        """Stops the worker (a running solve is abandoned)."""
        self._wanted = None
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._proc.kill()

    def _read(self) -> None:
        while True:
            try:
                self._answers.put(pickle.load(self._proc.stdout))
            except (EOFError, OSError, pickle.UnpicklingError):
                if self._wanted is not None:
                    self._answers.put((self._wanted, RuntimeError("the planner's worker process ended")))
                return
