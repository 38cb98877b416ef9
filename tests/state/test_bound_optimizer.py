"""Keeping the user's optimizer across engine rebuilds (:mod:`resihp_lightning.state.bound_optimizer`):
stable parameter keys, group assignment (in a one-process gloo world) and re-assignment."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from resihp_lightning.state.bound_optimizer import FROZEN, BoundOptimizer, assign, group_assignment, local_parameters


@pytest.fixture
def world_of_one(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _layers(indices, seed=0):
    torch.manual_seed(seed)
    return {i: nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)) for i in indices}


def test_local_parameters_are_keyed_by_layer_index_in_layer_order():
    layers = _layers([5, 2, 7])  # dict order is not layer order
    params = local_parameters(layers)
    expected = [(f"{i}.{n}", p) for i in (2, 5, 7) for n, p in layers[i].named_parameters()]
    assert list(params) == [k for k, _ in expected]
    assert all(params[k] is p for k, p in expected)
    assert list(params)[:4] == ["2.0.weight", "2.0.bias", "2.1.weight", "2.1.bias"]


def test_group_assignment_follows_the_optimizer_and_places_unknown_parameters(world_of_one):
    layers = _layers([0, 1])
    params = local_parameters(layers)
    layers[1][1].weight.requires_grad_(False)
    optimizer = torch.optim.SGD(
        [{"params": [params["0.0.weight"]]}, {"params": [params["0.0.bias"], params["1.0.weight"]], "lr": 0.5}], lr=0.1
    )
    group_of = group_assignment(optimizer, params)
    assert group_of == {
        "0.0.weight": 0, "0.0.bias": 1, "1.0.weight": 1,
        # not given to the optimizer: trainable -> group 0, frozen -> left out
        "0.1.weight": 0, "0.1.bias": 0, "1.0.bias": 0, "1.1.weight": FROZEN, "1.1.bias": 0,
    }


def test_assign_trains_exactly_the_new_parameters_and_keeps_the_group_dicts():
    old = local_parameters(_layers([0, 1], seed=1))
    optimizer = torch.optim.SGD([{"params": list(old.values())[:2]}, {"params": list(old.values())[2:], "lr": 0.5}], lr=0.1)
    groups = list(optimizer.param_groups)
    for p in old.values():
        optimizer.state[p] = {"momentum_buffer": torch.zeros_like(p)}
    new = dict(local_parameters(_layers([1, 2], seed=2)))
    new["1.0.weight"] = old["1.0.weight"]  # a parameter this rank keeps (same object)
    group_of = {"1.0.weight": 1, "1.0.bias": FROZEN, "2.0.weight": 1}  # others missing -> group 0
    arrived = {"2.0.weight": {"momentum_buffer": torch.ones(3, 3)}}
    assign(optimizer, groups, group_of, new, arrived)
    assert all(a is b for a, b in zip(optimizer.param_groups, groups)) and len(optimizer.param_groups) == 2
    by_group = [[id(p) for p in g["params"]] for g in optimizer.param_groups]
    assert by_group[1] == [id(new["1.0.weight"]), id(new["2.0.weight"])]
    assert by_group[0] == [id(p) for k, p in new.items() if k not in group_of]
    assert optimizer.param_groups[1]["lr"] == 0.5
    # State survives for kept parameters, is dropped for the others, and arrives for received ones.
    assert set(map(id, optimizer.state)) == {id(new["1.0.weight"]), id(new["2.0.weight"])}
    assert optimizer.state[new["2.0.weight"]]["momentum_buffer"] is arrived["2.0.weight"]["momentum_buffer"]


def test_a_bound_optimizer_keeps_its_scheduler_across_reassignment(world_of_one):
    first = local_parameters(_layers([0, 1], seed=3))
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)  # placeholder, as the strategy gets it
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    bound = BoundOptimizer.bind(optimizer, first)
    assert set(bound.group_of) == set(first) and set(bound.group_of.values()) == {0}
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in first.values()]
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.5
    second = local_parameters(_layers([2], seed=4))
    bound.assign(second)
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in second.values()]
    scheduler.step()  # the scheduler still writes the lr the optimizer uses
    assert optimizer.param_groups[0]["lr"] == 0.25
    weight = second["2.0.weight"]
    before = weight.detach().clone()
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    assert torch.equal(weight.detach(), before - 0.25)
