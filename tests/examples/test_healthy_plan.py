"""examples/healthy_plan.py: the planner's own healthy plan as a job's starting plan (issue 17, item 7)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from healthy_plan import initial_plan, plan_for_healthy_devices, profile_layers  # noqa: E402

from resihp_lightning.callbacks.replan.replan_policy import ControllerConfig  # noqa: E402
from resihp_lightning.config import PlannerConfig  # noqa: E402
from resihp_lightning.errors import ConfigError  # noqa: E402
from resihp_lightning.plan import Plan, Replica  # noqa: E402


class _Stack(nn.Module):
    """The strategy's module contract, without Lightning: four layers, the middle two wider."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        shapes = [(64, 64), (64, 256), (256, 64), (64, 64)]
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in shapes)

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_batch(self, batch):
        x, y = batch
        return x, y, None

    def pipeline_loss(self, outputs, labels):
        return nn.functional.mse_loss(outputs, labels)


def test_layers_are_timed_and_the_plan_uses_every_healthy_device():
    module = _Stack()
    batch = (torch.randn(8 * 64, 64), torch.randn(8 * 64, 64))
    costs = profile_layers(module, batch, micro_batch_size=64)
    assert [c.index for c in costs] == [0, 1, 2, 3] and all(c.compute_ms > 0 for c in costs)
    assert costs[0].static_mb > 0 and costs[1].activation_mb == pytest.approx(64 * 256 * 4 / 2**20)
    assert all(p.grad is None for p in module.parameters())  # the timing leaves no gradients behind
    plan = plan_for_healthy_devices(costs, 4, 8, ControllerConfig(), PlannerConfig(solver="exact"))
    assert sorted(d for r in plan.replicas for d in r.devices) == [0, 1, 2, 3]
    # Without transfer costs no pipeline bubble pays: 4 replicas of 2 micro-batches beat 2 x 2.
    assert (plan.pipeline_degree, plan.data_degree) == (1, 4)


def test_one_process_plans_and_the_others_read_its_file(tmp_path: Path):
    plan = Plan((Replica((0,), (0, 4), 4), Replica((1,), (0, 4), 4)))
    calls = []

    def compute():
        calls.append(1)
        time.sleep(0.3)
        return plan, {"predicted_ms": 1.0}

    seen = {}
    reader = threading.Thread(target=lambda: seen.setdefault("r", initial_plan(tmp_path, None, is_writer=False, wait_s=10)))
    reader.start()
    written = initial_plan(tmp_path, compute, is_writer=True)
    reader.join()
    assert Plan.from_dict(written["plan"]) == plan and seen["r"] == written and calls == [1]
    assert initial_plan(tmp_path, compute, is_writer=True) == written and calls == [1]  # a rerun reuses the file
    with pytest.raises(ConfigError, match="did not appear"):
        initial_plan(tmp_path / "elsewhere", None, is_writer=False, wait_s=0.3)
