"""Placement of a :class:`~resihp_lightning.plan.Plan` on global ranks as a DeepSpeed topology."""

from __future__ import annotations

from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

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
