"""Start a job from the planner's own plan for healthy devices (``strategy.start: planned`` in finetune.py).

The uniform P x D plan a job starts from is not always the best layout for healthy devices: in the
README demo the planner's 1 x 4 (no pipeline bubble) runs faster than the configured 2 x 2. With
``strategy.start: planned`` the launching process times every layer of the model on one micro-batch
of the training data (forward + backward on this process, each layer's backward taken in proportion
to its forward, as the strategy's profiler does), plans for that many healthy devices with the job's
planner and controller options, and the job starts under that plan. The plan is written to
``<run_dir>/initial_plan.json`` (which ``resihp report`` reads to name the healthy plan); every rank reads the same
file (under torchrun, where every rank starts at once, rank 0 writes it and the others wait for it),
so every rank starts under the same plan. A rerun in the same run directory reuses the file.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from resihp_lightning.errors import ConfigError

PLAN_FILE = "initial_plan.json"
START_CHOICES = ("uniform", "planned")


def profile_layers(module: Any, batch: Any, micro_batch_size: int, repeats: int = 3) -> list[Any]:
    """Per-layer costs (:class:`~resihp_lightning.telemetry.LayerCost`) of ``module`` on one micro-batch.

    Args:
        module: a ``ResiHPModule`` (``pipeline_layers``, ``pipeline_batch``, ``pipeline_loss``).
        batch: one global batch as the DataLoader yields it.
        micro_batch_size: rows per micro-batch.
        repeats: timed runs after one warm-up run; the median is kept.
    """
    import torch

    from resihp_lightning.runtime import batching
    from resihp_lightning.telemetry import LayerCost

    split = batching.split_batch(module, batch)
    item = batching.micro_batches(split, 0, 1, micro_batch_size)[0]
    layers = list(module.pipeline_layers())
    if not all(isinstance(layer, torch.nn.Module) for layer in layers):
        raise ConfigError("strategy.start 'planned' needs pipeline_layers() to return nn.Modules (not LayerSpecs)")
    share: list[list[float]] = [[] for _ in layers]
    activation = [0.0] * len(layers)
    for run in range(repeats + 1):
        x: Any = item.inputs[0] if len(item.inputs) == 1 else item.inputs
        forward = []
        begin = time.perf_counter()
        for index, layer in enumerate(layers):
            start = time.perf_counter()
            x = layer(x)
            forward.append(time.perf_counter() - start)
            out = x[0] if isinstance(x, tuple) else x
            activation[index] = out.numel() * out.element_size() / 2**20
        module.pipeline_loss(x, item.labels).backward()
        total_ms = (time.perf_counter() - begin) * 1000.0
        module.zero_grad(set_to_none=True)
        if run:  # the first run warms up allocators
            for index, seconds in enumerate(forward):
                share[index].append(total_ms * seconds / sum(forward))
    costs = []
    for index, layer in enumerate(layers):
        static = sum(p.numel() * p.element_size() * (4 if p.requires_grad else 1) for p in layer.parameters()) / 2**20
        costs.append(LayerCost(index, statistics.median(share[index]), static, activation[index]))
    return costs


def plan_for_healthy_devices(costs: Sequence[Any], world_size: int, micro_batches: int, controller: Any,
                             planner: Any) -> Any:
    """The planner's best plan for ``world_size`` healthy devices (shared stage bounds, every device used)."""
    from resihp_lightning.callbacks.replan.replan_policy import build_problem
    from resihp_lightning.solver import solve

    problem = build_problem(costs, {}, range(world_size), micro_batches, controller, planner)
    return solve(problem, planner)


def initial_plan(run_dir: Path, compute: Any, *, is_writer: bool, wait_s: float = 600.0) -> dict[str, Any]:
    """The plan of ``<run_dir>/initial_plan.json``: written by ``compute()`` on the writer, read by the others.

    Args:
        run_dir: the run directory.
        compute: returns ``(plan, details)``; called only on the writer and only when the file is absent.
        is_writer: whether this process plans (Lightning's launching process, or torchrun's rank 0).
        wait_s: how long a non-writer waits for the file.

    Raises:
        ConfigError: the file did not appear within ``wait_s``.
    """
    path = run_dir / PLAN_FILE
    if not path.is_file():
        if is_writer:
            plan, details = compute()
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"plan": plan.to_dict(), **details}))
            os.replace(tmp, path)  # readers never see half a file
        else:
            deadline = time.monotonic() + wait_s
            while not path.is_file():
                if time.monotonic() > deadline:
                    raise ConfigError(f"strategy.start 'planned': {path} did not appear within {wait_s:.0f} s")
                time.sleep(0.2)
    return json.loads(path.read_text())
