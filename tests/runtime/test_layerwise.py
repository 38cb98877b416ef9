"""Layer-wise gradient reduction: replicas with different stage bounds train with the exact gradient.

The pure tests check holder sets against hand-worked plans. The multi-process test builds real
DeepSpeed ``PipelineEngine``s on 4 gloo ranks (P=2 x D=2) and compares every loss and the final
parameters with a single-process plain-PyTorch run of the same model, data and Adam.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from resihp_lightning.errors import PlanError
from resihp_lightning.plan import Plan, Replica
from resihp_lightning.placement import holder_sets, layer_holders

WIDTH, DEPTH, MBS, LR, STEPS = 5, 8, 2, 0.05, 3


def _plan(*replicas: tuple[tuple[int, ...], tuple[int, ...], int]) -> Plan:
    return Plan(tuple(Replica(devices, bounds, m) for devices, bounds, m in replicas))


# ----------------------------------------------------------------------------------- pure tests
def test_holder_sets_with_per_replica_bounds():
    plan = _plan(((0, 1), (0, 3, 8), 2), ((2, 3), (0, 6, 8), 2))
    assert layer_holders(plan) == [(0, 2)] * 3 + [(1, 2)] * 3 + [(1, 3)] * 2
    assert holder_sets(plan) == [(0, 2), (1, 2), (1, 3)]


def test_holder_sets_with_shared_bounds_are_the_stage_groups():
    plan = _plan(((3, 0), (0, 4, 8), 1), ((1, 2), (0, 4, 8), 3))
    # One set per stage, ranks in replica order (DeepSpeed's data-parallel groups).
    assert holder_sets(plan) == [(3, 1), (0, 2)]


def test_holder_sets_three_replicas_three_stages():
    plan = _plan(
        ((0, 1, 2), (0, 2, 4, 6), 1),
        ((3, 4, 5), (0, 1, 4, 6), 1),
        ((6, 7, 8), (0, 2, 5, 6), 1),
    )
    # layer: holders -> 0:(0,3,6) 1:(0,4,6) 2:(1,4,7) 3:(1,4,7) 4:(2,5,7) 5:(2,5,8)
    assert holder_sets(plan) == [(0, 3, 6), (0, 4, 6), (1, 4, 7), (2, 5, 7), (2, 5, 8)]


def test_holder_sets_single_replica_and_single_stage():
    assert holder_sets(_plan(((4, 5), (0, 1, 3), 2))) == [(4,), (5,)]
    assert holder_sets(_plan(((1,), (0, 3), 1), ((0,), (0, 3), 1))) == [(1, 0)]


def test_holder_sets_refuse_mismatched_replicas():
    with pytest.raises(PlanError, match="same number of stages"):
        holder_sets(_plan(((0, 1), (0, 2, 4), 1), ((2,), (0, 4), 1)))


# ----------------------------------------------------------------------------- multi-process
class Block(nn.Sequential):
    """Linear + tanh whose initial values depend only on its layer index."""

    def __init__(self, index: int) -> None:
        super().__init__(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        gen = torch.Generator().manual_seed(200 + index)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(WIDTH))


def make_data(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, WIDTH, generator=gen)
    y = torch.sin(x @ torch.randn(WIDTH, WIDTH, generator=gen))
    return x, y


#: The tie of the tied scenarios: layer 7's weight is layer 0's (one parameter used twice).
TIE = ((0, "0.weight"), (DEPTH - 1, "0.weight"))


def reference(micro_batches: int, clip: float, tied: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain PyTorch: loss = mean over the M micro-batches of each one's MSE."""
    layers = nn.ModuleList([Block(i) for i in range(DEPTH)])
    if tied:
        layers[DEPTH - 1][0].weight = layers[0][0].weight  # really one parameter
    opt = torch.optim.Adam(layers.parameters(), lr=LR)
    batch = micro_batches * MBS
    x, y = make_data(STEPS * batch)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for k in range(micro_batches):
            start = step * batch + k * MBS
            out = x[start : start + MBS]
            for layer in layers:
                out = layer(out)
            loss = F.mse_loss(out, y[start : start + MBS]) / micro_batches
            loss.backward()
            total += float(loss.detach())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(layers.parameters(), clip)
        opt.step()
        losses.append(total)
    params = {f"{i}.{n}": p.detach().clone() for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    return losses, params


# (name, replicas as (devices, bounds, micro-batches), reduction, gradient_clipping)
SCENARIOS = [
    ("per-replica", (((2, 0), (0, 3, 8), 2), ((1, 3), (0, 6, 8), 2)), "layerwise", 0.0),
    ("per-replica-unequal-m", (((0, 1), (0, 6, 8), 1), ((2, 3), (0, 2, 8), 3)), "layerwise", 0.0),
    ("per-replica-clipped", (((3, 1), (0, 3, 8), 3), ((0, 2), (0, 5, 8), 2)), "layerwise", 0.05),
    ("shared-layerwise", (((0, 1), (0, 4, 8), 1), ((2, 3), (0, 4, 8), 3)), "layerwise", 0.0),
    ("shared-deepspeed", (((0, 1), (0, 4, 8), 1), ((2, 3), (0, 4, 8), 3)), "deepspeed", 0.0),
    # Tied: the tie spans stages (its own group over 4 ranks) / lies within one stage (holder-set group).
    ("tied-per-replica-clipped", (((3, 1), (0, 3, 8), 3), ((0, 2), (0, 5, 8), 2)), "layerwise-tied", 0.05),
    ("tied-one-stage", (((0,), (0, 8), 1), ((1,), (0, 8), 1), ((2,), (0, 8), 1), ((3,), (0, 8), 1)), "layerwise-tied", 0.0),
]


def _run_scenario(rank: int, replicas, reduction: str, clip: float) -> dict:
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec

    from resihp_lightning.runtime.engine import (
        build_engine,
        destroy_engine,
        engine_config,
    )
    from resihp_lightning.runtime.layerwise import LayerwiseReducer, install
    from resihp_lightning.state.bound_optimizer import local_parameters
    from resihp_lightning.runtime.pipeline_module import BoundedPipelineModule
    from resihp_lightning.placement import position, row_offset
    from resihp_lightning.runtime.topology import PlanTopology

    plan = _plan(*replicas)
    pos = position(plan, rank)
    replica = plan.replicas[pos.replica]
    total = sum(r.micro_batches for r in plan.replicas)
    scale = replica.micro_batches * plan.data_degree / total  # the strategy's m_r * D / M

    def loss_fn(outputs, labels):
        return F.mse_loss(outputs, labels) * scale

    pipe = BoundedPipelineModule(
        [LayerSpec(Block, i) for i in range(DEPTH)], PlanTopology(plan), replica.bounds, loss_fn=loss_fn
    )
    layers = pipe.local_layers()
    layerwise = reduction.startswith("layerwise")
    tied = [TIE] if reduction == "layerwise-tied" else []
    if layerwise and pos.replica > 0:
        # Replicas other than the first start from wrong values: the layer-wise broadcast must fix them.
        with torch.no_grad():
            for p in pipe.parameters():
                p.add_(1.0)
    reducer = LayerwiseReducer(plan, rank, layers, tied=tied) if layerwise else None
    opt = torch.optim.Adam(pipe.parameters(), lr=LR)
    config = engine_config(MBS, replica.micro_batches, plan.data_degree, {"gradient_clipping": clip})
    engine = build_engine(pipe, opt, config, broadcast=not layerwise)
    if layerwise:
        reducer.broadcast()
        install(engine, reducer)
    x, y = make_data(STEPS * total * MBS)
    losses = []
    for step in range(STEPS):
        first = step * total * MBS + row_offset(plan, pos.replica, MBS)
        items = [
            (x[first + k * MBS : first + (k + 1) * MBS], y[first + k * MBS : first + (k + 1) * MBS])
            for k in range(replica.micro_batches)
        ]
        losses.append(float(engine.train_batch(iter(items))))
    params = {k: p.detach().clone() for k, p in local_parameters(layers).items()}
    groups = len(reducer.groups) if reducer is not None else 0
    destroy_engine(engine)
    if reducer is not None:
        reducer.destroy()
    dist.barrier()
    return {"losses": losses, "params": params, "groups": groups, "micro_batches": total}


def _layerwise_rank(rank: int, world_size: int) -> dict:
    import time

    import torch.distributed as dist

    from resihp_lightning.runtime.engine import init_deepspeed_comm

    dist.init_process_group("gloo")
    init_deepspeed_comm("gloo")
    out = {}
    for name, replicas, reduction, clip in SCENARIOS:
        start = time.perf_counter()
        out[name] = _run_scenario(rank, replicas, reduction, clip)
        out[name]["seconds"] = time.perf_counter() - start
    # A ZeRO engine is refused by name.
    from deepspeed.pipe import LayerSpec

    from resihp_lightning.errors import ConfigError
    from resihp_lightning.runtime.engine import (
        build_engine,
        destroy_engine,
        engine_config,
    )
    from resihp_lightning.runtime.layerwise import LayerwiseReducer, install
    from resihp_lightning.runtime.pipeline_module import BoundedPipelineModule
    from resihp_lightning.runtime.topology import PlanTopology

    plan = _plan(((0, 1), (0, 4, 8), 1), ((2, 3), (0, 4, 8), 1))
    pipe = BoundedPipelineModule(
        [LayerSpec(Block, i) for i in range(DEPTH)], PlanTopology(plan), plan.replicas[0].bounds, loss_fn=F.mse_loss
    )
    reducer = LayerwiseReducer(plan, rank, pipe.local_layers())
    config = engine_config(MBS, 1, 2, {"zero_optimization": {"stage": 1}})
    engine = build_engine(pipe, torch.optim.Adam(pipe.parameters(), lr=LR), config)
    try:
        install(engine, reducer)
        out["zero_refused"] = ""
    except ConfigError as err:
        out["zero_refused"] = str(err)
    destroy_engine(engine)
    reducer.destroy()
    dist.barrier()
    return out


@pytest.mark.multiprocess
def test_per_replica_bounds_train_like_one_process(distributed):
    results = distributed(_layerwise_rank, 4, timeout=120)
    for name, replicas, reduction, clip in SCENARIOS:
        plan = _plan(*replicas)
        tied = reduction == "layerwise-tied"
        ref_losses, ref_params = reference(results[0][name]["micro_batches"], clip, tied)
        for rank, result in enumerate(results):
            got = result[name]
            assert got["losses"] == pytest.approx(ref_losses, abs=1e-6, rel=1e-6), (name, rank)
            assert got["params"], (name, rank)
            for key, value in got["params"].items():
                torch.testing.assert_close(value, ref_params[key], atol=1e-6, rtol=1e-6, msg=f"{name} rank {rank} {key}")
        # Every parameter exists on one rank per replica, and all copies are identical.
        seen: dict[str, list[torch.Tensor]] = {}
        for result in results:
            for key, value in result[name]["params"].items():
                seen.setdefault(key, []).append(value)
        assert sorted(seen) == sorted(ref_params), name
        for key, copies in seen.items():
            assert len(copies) == plan.data_degree, (name, key)
            assert all(torch.equal(c, copies[0]) for c in copies), (name, key)
        if reduction == "layerwise":
            expected = {r: sum(1 for s in holder_sets(plan) if r in s and len(s) > 1) for r in range(4)}
            assert [res[name]["groups"] for res in results] == [expected[r] for r in range(4)], name
        if tied:  # the two copies are still one value
            assert torch.equal(seen["0.0.weight"][0], seen[f"{DEPTH - 1}.0.weight"][0]), name
    # With shared bounds the layer-wise reduction is DeepSpeed's, bit for bit.
    for rank, result in enumerate(results):
        assert result["shared-layerwise"]["losses"] == result["shared-deepspeed"]["losses"], rank
        for key, value in result["shared-layerwise"]["params"].items():
            assert torch.equal(value, result["shared-deepspeed"]["params"][key]), (rank, key)
    assert all("zero_optimization.stage" in r["zero_refused"] for r in results), results[0]["zero_refused"]


def test_buckets_cut_after_the_tensor_that_passes_the_limit():
    from resihp_lightning.runtime.layerwise import _buckets

    tensors = [torch.zeros(n) for n in (3, 4, 1, 6, 2)]
    sizes = [[t.numel() for t in b] for b in _buckets(tensors, 5)]
    assert sizes == [[3, 4], [1, 6], [2]]  # as DeepSpeed's allreduce_no_retain cuts its buckets
    assert [[t.numel() for t in b] for b in _buckets(tensors, 100)] == [[3, 4, 1, 6, 2]]
