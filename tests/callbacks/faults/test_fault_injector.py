"""Fault injection: slowdowns that look like a slower device, delayed sends, configs; the detector sees them."""

from __future__ import annotations

import time
import types

import pytest
import torch
from torch import nn

from resihp_lightning.callbacks.faults.slowdowns import FaultConfig, Slowdown
from resihp_lightning.runtime.transport_delays import DelayedCall, delay_p2p_sends
from resihp_lightning.callbacks.failslow.straggler_core import StragglerConfig, LocalTracker, StragglerCore
from resihp_lightning.errors import ConfigError
from resihp_lightning.telemetry import MicroBatchStats, StepStats


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward take known wall time (deterministic 'compute')."""

    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd_s)
        return grad * 1.0, None, None


class FakeLayer(nn.Module):
    """A layer whose cost grows with its input's token count: 3 ms + 3 ms per 1000 tokens forward, twice that backward."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x):
        fwd = 0.003 + 0.003 * x.shape[0] / 1000
        return _Sleep.apply(x * self.weight, fwd, 2 * fwd)


def _busy_ms(module, tokens, requires_grad=True):
    x = torch.ones(tokens, 1, requires_grad=requires_grad)
    start = time.perf_counter()
    out = module(x)
    mid = time.perf_counter()
    out.sum().backward()
    end = time.perf_counter()
    return (mid - start) * 1e3, (end - mid) * 1e3


def test_slowdown_scales_forward_and_backward_and_keeps_gradients():
    factor = {"value": 1.0}
    model = nn.Sequential(FakeLayer(), FakeLayer())
    slow = Slowdown(lambda: factor["value"], cuda_sync=False)
    for layer in model:
        slow.wrap(layer)
    slow.wrap(model[0])  # idempotent
    assert len(slow.wrapped) == 2
    base = [_busy_ms(model, 2000) for _ in range(3)]  # min over repeats: machine load only adds time
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    factor["value"] = 3.0
    slowed = [_busy_ms(model, 2000) for _ in range(3)]
    for p, g in zip(model.parameters(), grads):
        assert torch.allclose(p.grad, g)  # same three accumulated gradients with and without the slowdown
    fwd_ratio = min(s[0] for s in slowed) / min(b[0] for b in base)
    bwd_ratio = min(s[1] for s in slowed) / min(b[1] for b in base)
    assert fwd_ratio == pytest.approx(3.0, rel=0.2)
    assert bwd_ratio == pytest.approx(3.0, rel=0.2)
    factor["value"] = 1.0
    again = min(_busy_ms(model, 2000)[0] for _ in range(3))
    assert again == pytest.approx(min(b[0] for b in base), rel=0.3)
    slow.unwrap_all()
    assert "forward" not in vars(model[0])


def test_module_without_differentiable_input_is_slowed_backward_too():
    """An embedding-like first layer (input ids need no gradient): its backward ends at its parameters."""
    layer = FakeLayer()
    base = [_busy_ms(layer, 1000, requires_grad=False) for _ in range(3)]
    Slowdown(lambda: 2.0, cuda_sync=False).wrap(layer)
    runs = [_busy_ms(layer, 1000, requires_grad=False) for _ in range(3)]
    assert min(r[0] for r in runs) / min(b[0] for b in base) == pytest.approx(2.0, rel=0.25)
    assert min(r[1] for r in runs) / min(b[1] for b in base) == pytest.approx(2.0, rel=0.25)


def test_loss_and_optimizer_step_are_slowed_too():
    """A throttled device runs everything slower: the loss (forward and backward) and the optimizer step."""

    def loss_fn(out, target):
        return _Sleep.apply(((out - target) ** 2).mean(), 0.004, 0.008)

    factor = {"value": 1.0}
    slow = Slowdown(lambda: factor["value"], cuda_sync=False)
    slowed_loss = slow.wrap_function(loss_fn)
    slow.slow_optimizer_steps()
    weight = nn.Parameter(torch.ones(4))

    class SleepyOptimizer(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(0.01)
            return super().step(closure)

    opt = SleepyOptimizer([weight], lr=0.0)

    def timed():
        x = weight * torch.ones(4)
        t0 = time.perf_counter()
        loss = slowed_loss(x, torch.zeros(4))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    try:
        base = [timed() for _ in range(3)]
        factor["value"] = 3.0
        slowed = [timed() for _ in range(3)]
    finally:
        slow.unwrap_all()
    for part in range(3):  # forward, backward, optimizer step: min over repeats (load only adds time)
        ratio = min(s[part] for s in slowed) / min(b[part] for b in base)
        assert ratio == pytest.approx(3.0, rel=0.25), (part, base, slowed)
    factor["value"] = 3.0
    start = time.perf_counter()
    opt.step()  # the hooks are gone
    assert time.perf_counter() - start < 0.025


def test_time_in_tensor_parallel_all_reduces_is_not_slowed():
    """A split layer's forward and backward include its all-reduces, which wait for the other members:
    only its own compute is slowed (as a throttled GPU's NVLink transfers are not)."""
    from resihp_lightning.torch_utils.wait_clock import TENSOR_PARALLEL_WAIT

    class WaitsForPeers(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001
            return x.clone()

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001
            _in_all_reduce(0.03)
            return grad

    def _in_all_reduce(seconds: float) -> None:
        started = time.perf_counter()
        time.sleep(seconds)
        TENSOR_PARALLEL_WAIT.total_s += time.perf_counter() - started

    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x):  # noqa: ANN001
            time.sleep(0.02)  # its own compute
            _in_all_reduce(0.03)  # the forward's all-reduce
            return WaitsForPeers.apply(x * self.weight)

    slow = Slowdown(lambda: 3.0, cuda_sync=False)
    layer = Split()
    slow.wrap(layer)
    x = torch.ones(4, requires_grad=True)
    layer(x).sum().backward()
    forward = slow.injected_s
    # (3 - 1) x its own 20 ms, not x the 50 ms the forward took with its all-reduce.
    assert 0.035 < forward < 0.07, forward
    assert layer.weight.grad is not None


def test_detector_finds_the_injected_slowdown_on_a_real_module():
    """Three 'ranks' (a cohort holding the same layer); rank 2 is slowed 2x from step 10."""
    layers = [FakeLayer() for _ in range(3)]
    factor = {"value": 1.0}
    slow = Slowdown(lambda: factor["value"], cuda_sync=False)
    slow.wrap(layers[2])
    config = StragglerConfig(warmup_steps=1, fit_steps=4, patience=3)
    trackers = [LocalTracker(config.warmup_steps, config.fit_steps) for _ in layers]
    core = StragglerCore(config)
    gen = torch.Generator().manual_seed(0)
    events = []
    for step in range(13):
        factor["value"] = 2.0 if step >= 10 else 1.0
        summaries = []
        for rank, layer in enumerate(layers):
            mbs = []
            for _ in range(2):
                tokens = int(torch.randint(200, 2000, (1,), generator=gen))
                fwd, bwd = _busy_ms(layer, tokens)
                mbs.append(MicroBatchStats(fwd + bwd, tokens, tokens * 300))
            summaries.append(trackers[rank].summarize(StepStats(step, rank, rank, 0, (0, 1), tuple(mbs))))
        events += core.update(summaries)
    assert [(e["event"], e["rank"]) for e in events] == [("fail_slow_detected", 2)]
    assert events[0]["step"] == 12
    assert events[0]["speed"] == pytest.approx(0.5, rel=0.15)


def test_delayed_call_waits_then_calls_and_restores():
    space = types.SimpleNamespace(send=lambda x: x + 1)
    delay = {"s": 0.05}
    patch = DelayedCall(space, "send", lambda: delay["s"])
    start = time.perf_counter()
    assert space.send(1) == 2
    assert time.perf_counter() - start >= 0.05
    delay["s"] = 0.0
    assert space.send(2) == 3 and patch.calls == 2
    patch.restore()
    assert space.send(3) == 4 and patch.calls == 2


def test_fault_config_is_validated_and_reads_yaml_mappings():
    fault = FaultConfig.from_dict({"kind": "slow", "rank": 3, "factor": 2.0, "start_step": 10, "end_step": 20})
    assert fault.active(10) and fault.active(19) and not fault.active(20) and not fault.active(9)
    assert FaultConfig.from_dict(fault.to_dict()) == fault
    with pytest.raises(ConfigError, match="fault.kind"):
        FaultConfig(kind="melt")
    with pytest.raises(ConfigError, match="fault.factor"):
        FaultConfig(kind="slow", factor=0.5)
    with pytest.raises(ConfigError, match="fault.end_step"):
        FaultConfig(start_step=5, end_step=5)
    with pytest.raises(ConfigError, match="fault.delay_ms"):
        FaultConfig(kind="delay_p2p")
    with pytest.raises(ConfigError, match="unknown fault option 'speed'"):
        FaultConfig.from_dict({"kind": "slow", "speed": 0.5})


def _slowed_rank(rank: int, world: int, log_dir: str) -> dict:
    import lightning.pytorch as pl
    from torch.nn import functional as F

    from resihp_lightning.callbacks.faults.fault_injector import FaultInjector
    from resihp_lightning.strategy.module import ResiHPModule
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    class Tiny(ResiHPModule):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([FakeLayer(), FakeLayer()])

        def pipeline_layers(self):
            return list(self.layers)

        def pipeline_loss(self, outputs, labels):
            return F.mse_loss(outputs, labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    steps = []

    class Timer(pl.Callback):
        def on_train_batch_start(self, *args):
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, *args):
            busy = sum(mb.compute_ms for mb in trainer.strategy.last_step_stats.micro_batches)
            steps.append((time.perf_counter() - self.t, busy))

    injector = FaultInjector([{"kind": "slow", "rank": 0, "factor": 4.0, "start_step": 4}], log_dir=log_dir)
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, strategy=ResiHPStrategy(micro_batch_size=100),
                         callbacks=[injector, Timer()], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=log_dir)
    rows = torch.ones(8 * 400, 1)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows, rows), batch_size=400))
    return {"steps": steps}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_fault_injector_callback_slows_the_strategys_layers_and_logs(distributed, tmp_path):
    """One rank, ``Trainer(strategy="resihp")``: the slow fault wraps the layers ``strategy.local_layers()``
    names; their busy time (what the detector sees) and the step time grow from ``start_step``."""
    from resihp_lightning.callbacks.events import read_events

    (result,) = distributed(_slowed_rank, 1, timeout=180, log_dir=str(tmp_path))
    wall = [w for w, _ in result["steps"]]
    busy = [b for _, b in result["steps"]]
    # The first layer's input needs no gradient, so only its forward waits: about 3x busy time at factor 4.
    assert min(busy[5:]) > 2.0 * min(busy[1:4]), busy
    assert min(wall[5:]) > 1.5 * min(wall[1:4]), wall
    events = read_events(tmp_path)
    assert [(e["event"], e["step"], e["rank"], e["factor"]) for e in events] == [("fault_injected", 4, 0, 4.0)]


@pytest.mark.slow
def test_delay_p2p_sends_patches_deepspeeds_pipeline_send():
    from deepspeed.runtime.pipe import p2p

    original = p2p.send
    patch = delay_p2p_sends(lambda: 0.0)
    try:
        assert p2p.send is not original and patch.original is original
    finally:
        patch.restore()
    assert p2p.send is original
