"""The trace evaluation with TP groups priced per GPU: ResiHP's rule (TP-drop) and the project's joint
policies, which choose the TP groups with the plan (evaluation/cluster.py, evaluation/trace_policies.py)."""

from __future__ import annotations

import math
import random

import pytest

from resihp_lightning.evaluation import Trace, TraceEvent, WorkloadSpec, build_profile
from resihp_lightning.evaluation.cluster import Cluster
from resihp_lightning.evaluation.replay import replay
from resihp_lightning.evaluation.trace_policies import AWARE_TP, Joint, TensorLayout, healthy_tensor_layout, make_policy
from resihp_lightning.evaluation.traces import GpuState
from resihp_lightning.tensor_plan import resihp_rule_groups, validate_tensor_plan

REL = 1e-9


def _cluster(gpus: int = 32) -> Cluster:
    # LLaMA2-7B at 4K tokens on TP-4 groups: eight groups of four GPUs, two nodes of eight per group pair.
    profile = build_profile("llama2-7b", WorkloadSpec(seq_len=4096, tp=4, micro_batches_per_device=2))
    return Cluster(Trace(gpus, 3600.0), profile)


def _random_state(rng: random.Random, gpus: int) -> GpuState:
    speed, alive = [1.0] * gpus, [True] * gpus
    for g in rng.sample(range(gpus), rng.randint(1, 3)):
        if rng.random() < 0.5:
            alive[g] = False
        else:
            speed[g] = rng.choice([0.5, 0.67, 0.83])
    return GpuState(tuple(speed), tuple(alive), (1.0,) * (gpus // 8), 8)


def test_resihp_rule_devices_are_the_rule_groups_of_the_per_gpu_model():
    cluster = _cluster()
    state = GpuState(tuple(0.4 if g == 5 else 1.0 for g in range(32)), tuple(g != 14 for g in range(32)), (1.0,) * 4, 8)
    problem = cluster.tensor_problem(state, AWARE_TP)
    groups = {problem.domain_of(g.id): g for g in resihp_rule_groups(problem, 4)}
    devices = cluster.devices(state, AWARE_TP)
    assert [d.id for d in devices] == list(range(8))
    for device in devices:
        expected = problem.group_device(groups[device.id])
        assert (device.speed, device.memory_mb) == (expected.speed, expected.memory_mb)
    assert groups[1].degree == 2 and 5 not in groups[1].members  # 2 x 1.0 beats 4 x 0.4
    assert groups[3].degree == 2  # three live GPUs: a pair (3 does not split 32 heads)


def test_a_whole_group_costs_what_the_group_profile_says():
    """On the healthy cluster the per-GPU model prices the healthy plan as the atomic groups do, up to the
    head's TP all-reduce, which the per-GPU model charges at the model-wide fraction."""
    cluster = _cluster()
    policy = make_policy("none")
    layout = policy.start(cluster)
    state = GpuState((1.0,) * 32, (True,) * 32, (1.0,) * 4, 8)
    atomic = layout.iteration_ms(cluster, state)
    tensor = healthy_tensor_layout(cluster, layout.plan).iteration_ms(cluster, state)
    assert tensor == pytest.approx(atomic, rel=1e-3) and tensor >= atomic


def test_a_solved_tensor_plan_is_valid_relabelled_and_lost_with_a_member():
    cluster = _cluster()
    state = GpuState(tuple(0.5 if g == 9 else 1.0 for g in range(32)), (True,) * 32, (1.0,) * 4, 8)
    found = cluster.solve_tensor(state, AWARE_TP, shared=False)
    validate_tensor_plan(cluster.tensor_problem(state, AWARE_TP, shared=False), found)
    assert cluster.tensor_iteration_ms(found, state) == pytest.approx(found.iteration_ms, rel=REL)
    # The same state with the slow GPU in another TP group is the same problem up to relabelling.
    moved = GpuState(tuple(0.5 if g == 29 else 1.0 for g in range(32)), (True,) * 32, (1.0,) * 4, 8)
    again = cluster.solve_tensor(moved, AWARE_TP, shared=False)
    assert cluster.solve_count == 1
    assert cluster.tensor_iteration_ms(again, moved) == pytest.approx(cluster.tensor_iteration_ms(found, state), rel=REL)
    used = {g for group in found.used_groups for g in group.members}
    dead = GpuState((1.0,) * 32, tuple(g != min(used) for g in range(32)), (1.0,) * 4, 8)
    assert math.isinf(cluster.tensor_iteration_ms(found, dead))


@pytest.mark.parametrize("shared", [True, False])
def test_the_joint_policy_is_never_worse_than_resihp_rules_on_single_moments(shared):
    """At any moment the project's plan (groups chosen with the plan) is at most ResiHP's rule's layout
    (TP-drop, spares, one repartition, micro-batch migration), both priced by the per-GPU TP model."""
    cluster = _cluster()
    rng = random.Random(17 if shared else 18)
    strictly = 0
    for _ in range(4):
        state = _random_state(rng, 32)
        rules = make_policy("resihp_rules")
        start = rules.start(cluster)
        rule_ms = rules.react(cluster, 0.0, state, start)[-1].layout.iteration_ms(cluster, state)
        ours = Joint(shared)._plan(cluster, state)
        assert isinstance(ours, TensorLayout)
        ours_ms = ours.iteration_ms(cluster, state)
        assert ours_ms <= rule_ms * (1 + REL)
        strictly += ours_ms < rule_ms * (1 - 1e-6)
    assert strictly >= 1


def test_a_tp_job_drops_a_dead_member_in_process_and_takes_it_back():
    cluster = _cluster()
    trace = Trace(32, 2400.0, (TraceEvent("fail_stop", 600.0, 900.0, gpu=6),), gpus_per_node=8)
    cluster = Cluster(trace, cluster.profile)
    result = replay(cluster, make_policy("joint_per_replica"))
    assert result.counts["recover"] == 1 and "restart" not in result.counts
    assert result.counts.get("migrate", 0) >= 1  # the repaired GPU rejoins
    oracle = replay(cluster, make_policy("oracle"))
    assert result.tokens <= oracle.tokens * (1 + 1e-9)


def test_a_re_cut_moves_its_missing_shares_over_nvlink_and_new_layers_over_the_network():
    cluster = _cluster()
    hw = cluster.profile.hardware
    mb = cluster._layer_mb
    layers = range(3, 7)
    old = [((0, 1, 2, 3), layers)]
    rebuild = cluster.costs.rebuild_per_replica_s
    # 4 -> 2 on the same layers: each kept GPU had a quarter and needs a half, from its old group.
    recut = cluster.gpu_migration_s(old, [((0, 1), layers)], shared=False) - rebuild
    assert recut == pytest.approx(sum(mb[l] for l in layers) / 4 * 1e6 / (hw.nvlink_gbps * 1e9 * hw.link_efficiency))
    # The same pair taking layers no GPU of it held: half of each over its own NIC.
    moved = cluster.gpu_migration_s(old, [((0, 1), range(7, 11))], shared=False) - rebuild
    assert moved == pytest.approx(sum(mb[l] for l in range(7, 11)) / 2 * 1e6 / (hw.network_gbps * 1e9 * hw.link_efficiency))
    assert cluster.gpu_migration_s(old, old, shared=True) == cluster.costs.rebuild_shared_s  # nothing moves
