"""The planner's worker process (``python -m resihp_lightning.callbacks.replan.planner_worker``).

Reads pickled ``(job id, Problem or TensorProblem, PlannerConfig)`` requests from stdin and writes pickled
``(job id, Plan / TensorPlan or the exception the solve raised)`` to stdout, one at a time, until stdin closes
(its parent, the controller's rank 0, exited or closed it).
"""

from __future__ import annotations

import os
import pickle
import sys

#: Added to the worker's nice value (lower CPU priority than the training processes).
NICENESS = 19


def main() -> None:
    # Below the training processes in the CPU scheduler's eyes: a solve uses cores they leave idle.
    os.nice(NICENESS)
    from resihp_lightning.solver import solve
    from resihp_lightning.solver.tensor_search import solve_tensor
    from resihp_lightning.tensor_plan import TensorProblem

    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            job, problem, config = pickle.load(requests)
        except (EOFError, OSError):
            return
        try:
            result: object = solve_tensor(problem, config) if isinstance(problem, TensorProblem) else solve(problem, config)
        except Exception as err:  # noqa: BLE001 - the controller logs it and keeps the plan in force
            result = err
        pickle.dump((job, result), replies)
        replies.flush()


if __name__ == "__main__":
    main()
