"""The trace evaluation's planning problems: built by the live job's builder from the model profile."""

from __future__ import annotations

from resihp_lightning.evaluation import Trace, WorkloadSpec
from resihp_lightning.evaluation.cluster import Cluster
from resihp_lightning.evaluation.profiles import MODELS, HardwareSpec, ModelProfile
from resihp_lightning.evaluation.trace_policies import AWARE, BLIND
from resihp_lightning.evaluation.traces import GpuState
from resihp_lightning.plan import Layer, evaluate, validate


def _cluster() -> Cluster:
    # An embedding that really costs no compute, then four layers of 1 s.
    layers = (Layer(0.0, 100.0, 1.0),) + tuple(Layer(1000.0, 250.0, 1.0) for _ in range(4))
    profile = ModelProfile(MODELS["llama2-7b"], HardwareSpec(), WorkloadSpec(seq_len=1000, micro_batches_per_device=2),
                           layers, p2p_ms=5.0, allreduce_ms=20.0, reference_stages=1)
    return Cluster(Trace(4, 100.0, gpus_per_node=2), profile)


def test_the_problem_keeps_the_modelled_layers_and_the_devices_as_the_view_sees_them():
    cluster = _cluster()
    state = GpuState((1.0, 0.5, 1.0, 1.0), (True, True, True, False), (1.0, 1.0), 2)
    devices = cluster.devices(state, AWARE)
    problem = cluster.problem(devices, state, AWARE, shared=False, pipeline_degrees=(1, 2))
    assert problem.layers == cluster.profile.layers  # modelled, not measured: the 0 ms embedding stays 0 ms
    assert [(d.id, d.speed, d.memory_mb) for d in problem.devices] == [(d.id, d.speed, d.memory_mb) for d in devices]
    assert [d.id for d in problem.devices] == [0, 1, 2] and problem.devices[1].speed == 0.5
    assert (problem.p2p_ms, problem.allreduce_ms) == (5.0, 20.0)
    assert not problem.shared_partition and problem.allow_exclude and problem.pipeline_degrees == (1, 2)
    blind = cluster.problem(cluster.devices(state, BLIND), state, BLIND)
    assert blind.shared_partition and blind.pipeline_degrees is None and {d.speed for d in blind.devices} == {1.0}


def test_a_solved_plan_is_valid_on_the_problem_it_was_solved_for_and_priced_the_same():
    cluster = _cluster()
    state = GpuState((1.0, 0.5, 1.0, 1.0), (True,) * 4, (1.0, 1.0), 2)
    devices = cluster.devices(state, AWARE)
    plan = cluster.solve(devices, state, AWARE, shared=True)
    problem = cluster.problem(devices, state, AWARE, shared=True)
    validate(problem, plan)
    assert evaluate(problem, plan).iteration_ms == cluster.iteration_ms(plan, state, AWARE)
