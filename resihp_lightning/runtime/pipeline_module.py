"""A DeepSpeed ``PipelineModule`` with explicit stage bounds and reusable layer objects."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule
from torch import nn

from resihp_lightning.runtime.topology import PlanTopology


class BoundedPipelineModule(PipelineModule):
    """``PipelineModule`` whose stage ``j`` holds exactly layers ``bounds[j]..bounds[j+1]-1``.

    Local layers are registered under their global index (``"7.weight"``), so parameter names are
    the same under every partition. ``reuse`` maps global layer indices to modules this rank already
    holds; those objects are used instead of building the layer again, which keeps their
    ``Parameter`` objects (and so the optimizer's state keyed by them) across rebuilds.

    Args:
        layers: the model's layers in order (``nn.Module`` or DeepSpeed ``LayerSpec``).
        topology: the plan's topology.
        grid: the pipeline grid to use instead of the one DeepSpeed derives from ``topology``
            (:class:`~resihp_lightning.runtime.tensor_grid.TensorGrid`, whose topology is ``topology``).
        bounds: the P + 1 stage bounds.
        loss_fn: ``loss_fn(outputs, labels)`` run on the last stage.
        reuse: modules this rank already holds, by global layer index (layers migrated in are built
            beforehand with :func:`materialize_layer` and passed here).
        **kwargs: passed to ``PipelineModule`` (activation checkpointing options).
    """

    def __init__(
        self,
        layers: Sequence[Any],
        topology: PlanTopology,
        bounds: Sequence[int],
        loss_fn: Callable[..., Any],
        reuse: Mapping[int, nn.Module] | None = None,
        grid: Any = None,
        **kwargs: Any,
    ) -> None:
        # Set before PipelineModule.__init__, which calls _partition_layers.
        object.__setattr__(self, "_resihp_bounds", list(bounds))
        specs = list(layers)
        for index, module in (reuse or {}).items():
            specs[index] = module
        with _given_grid(grid):
            super().__init__(
                layers=specs,
                topology=topology,
                loss_fn=loss_fn,
                partition_method="uniform",
                dynamic_shape=True,
                **kwargs,
            )

    def _partition_layers(self, method: str = "uniform") -> None:  # noqa: ARG002 - bounds are given
        stage = self._topo.get_coord(self.global_rank).pipe
        self.parts = list(self._resihp_bounds)
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def local_layers(self) -> dict[int, nn.Module]:
        """This rank's layers that are modules, by global index."""
        return {int(name): module for name, module in self.named_children() if name.isdigit()}


@contextlib.contextmanager
def _given_grid(grid: Any) -> Iterator[None]:
    """While ``PipelineModule.__init__`` runs, its grid is ``grid`` (when given) instead of a
    ``PipelineParallelGrid`` built from the topology."""
    if grid is None:
        yield
        return
    from deepspeed.runtime.pipe import module as pipe_module

    saved = pipe_module.PipelineParallelGrid
    pipe_module.PipelineParallelGrid = lambda process_group=None, topology=None: grid
    try:
        yield
    finally:
        pipe_module.PipelineParallelGrid = saved


def materialize_layer(layer: Any, skip_init: bool = False) -> nn.Module:
    """The module of one pipeline layer: a ``LayerSpec`` built (without ``torch.nn.init`` when
    ``skip_init``: its values will be overwritten by a migration, and a large layer's random init costs
    more than receiving it), or the ``nn.Module`` itself."""
    if isinstance(layer, LayerSpec):
        return (_NoInitLayerSpec(layer) if skip_init else layer).build()
    return layer


_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)


@contextlib.contextmanager
def _no_weight_init() -> Iterator[None]:
    """Turns ``torch.nn.init``'s in-place initialisers into no-ops (they return the tensor untouched)."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS if hasattr(torch.nn.init, name)}
    try:
        for name in saved:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


class _NoInitLayerSpec(LayerSpec):
    """A ``LayerSpec`` built without weight initialisation (its values arrive by migration)."""

    def __init__(self, spec: LayerSpec) -> None:
        self.__dict__.update(spec.__dict__)
        self._spec = spec

    def build(self, log: bool = False) -> nn.Module:
        with _no_weight_init():
            return self._spec.build(log=log)
