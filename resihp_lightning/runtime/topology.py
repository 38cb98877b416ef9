"""Placement of a :class:`~resihp_lightning.plan.Plan` on global ranks as a DeepSpeed topology."""

from __future__ import annotations

from collections.abc import Sequence

from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology

from resihp_lightning.plan import Plan


class PlanTopology(PipeDataParallelTopology):
    """A pipe x data topology whose coordinate (stage j, replica r) maps to ``plan.replicas[r].devices[j]``.

    DeepSpeed derives every process group (pipeline, data parallel, p2p neighbours) from ``mapping``,
    so permuting it is all that placement needs.
    """

    def __init__(self, plan: Plan) -> None:
        super().__init__(num_pp=plan.pipeline_degree, num_dp=plan.data_degree)
        self.mapping = {
            self.ProcessCoord(pipe=j, data=r): device
            for r, replica in enumerate(plan.replicas)
            for j, device in enumerate(replica.devices)
        }


class TensorPlanTopology(PipeModelDataParallelTopology):
    """DeepSpeed's pipe x data x model topology of a plan over tensor-parallel groups.

    Coordinate (stage j, replica r, model i) maps to ``slices[i].replicas[r].devices[j]``: member i of
    the group the plan puts there. DeepSpeed's pipeline and data-parallel groups then stay inside a
    slice (same model coordinate), and its model groups are the tensor-parallel groups.

    Args:
        slices: the plan in the ranks of each slice, in member order
            (:meth:`~resihp_lightning.tensor.tensor_groups.TensorGroups.slice_plans`).
    """

    def __init__(self, slices: Sequence[Plan]) -> None:
        first = slices[0]
        super().__init__(num_pp=first.pipeline_degree, num_mp=len(slices), num_dp=first.data_degree)
        self.mapping = {
            self.ProcessCoord(pipe=j, data=r, model=i): rank
            for i, plan in enumerate(slices)
            for r, replica in enumerate(plan.replicas)
            for j, rank in enumerate(replica.devices)
        }
