"""Carrying the optimizer's per-parameter state across engine rebuilds, moves and checkpoints.

Three implementations of one interface, picked once from the DeepSpeed config by :func:`carrier_for`:

* :class:`PlainStateCarrier` — the user's optimizer steps the model parameters itself and keeps its
  state in ``optimizer.state`` (fp32, no ZeRO; also ``precision="bf16-mixed"`` under the layer-wise
  engine, whose fp32 parameters are the masters). Parameters and their state objects simply move.
* :class:`~resihp_lightning.state.sharded_moments.ShardedStateCarrier` — the layer-wise ZeRO-1: Adam's
  moments in slices over each layer's holders, whole while a plan changes and in checkpoints.
* :class:`WrappedStateCarrier` — DeepSpeed wraps the optimizer (its ZeRO-1, its bf16): fp32 masters and
  moments live in flat partitions; they are read and written per parameter through
  :mod:`~resihp_lightning.state.wrapped_state`.

A plan switch calls, in order: :meth:`~StateCarrier.capture` on the old engine (collective for the
wrapped carrier), :meth:`~StateCarrier.prepare_incoming` on freshly built layers,
:meth:`~StateCarrier.complete` once the old plan's live processes form the current group (collective
for the sharded carrier), :meth:`~StateCarrier.outgoing` for the transfer, :meth:`~StateCarrier.bind` once the new layers are
known, and :meth:`~StateCarrier.restore` on the new engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from resihp_lightning.state import layer_checkpoint, wrapped_state
from resihp_lightning.state.bound_optimizer import BoundOptimizer

#: Per-parameter state by parameter key (``"<layer>.<name>"``).
StateByKey = dict[str, dict[str, Any]]


@dataclass
class CapturedState:
    """This rank's optimizer state taken from the old engine before it is destroyed.

    Attributes:
        by_key: per-parameter state by key (what the carrier will put back or send).
        params: the old parameters by key.
        scaler: the wrapper's loss-scaler fields (empty for the plain optimizer).
    """

    by_key: StateByKey = field(default_factory=dict)
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    scaler: dict[str, Any] = field(default_factory=dict)


class StateCarrier(ABC):
    """Reads and writes the optimizer state of this rank's parameters (see the module docstring).

    Args:
        bound: the user's optimizer with its kept parameter groups (``None`` outside fitting).
        deepspeed_config: the engine's DeepSpeed config.
    """

    #: Whether replicas may have different stage bounds (the layer-wise gradient reduction runs).
    per_replica_bounds: bool = True

    def __init__(self, bound: BoundOptimizer | None, deepspeed_config: Mapping[str, Any]) -> None:
        self.bound = bound
        self.deepspeed_config = deepspeed_config

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype DeepSpeed gives the model's parameters."""
        return wrapped_state.engine_param_dtype(self.deepspeed_config)

    @abstractmethod
    def capture(self, engine: Any, params: Mapping[str, nn.Parameter]) -> CapturedState:
        """This rank's state before ``engine`` goes (collective over each stage for the wrapped carrier)."""

    def complete(self, captured: CapturedState, holding: Any) -> CapturedState:
        """Makes ``captured`` whole once the old plan's live processes form the current group, before the
        transfer (collective for the layer-wise ZeRO-1; default: it is whole already).

        Args:
            holding: the old plan and who is alive
                (:class:`~resihp_lightning.state.sharded_moments.OldHolding`).
        """
        return captured

    def carry_over(self, previous: StateCarrier) -> None:
        """Takes the state ``previous`` (the carrier of a runtime this one replaces under the same plan and
        layers) keeps outside the user's optimizer, once the engine is built (default: nothing; the plain
        optimizer's state lives in the optimizer object itself)."""

    def prepare_incoming(self, layers: Iterable[nn.Module]) -> None:
        """Readies freshly built layers to receive migrated values (default: nothing)."""

    def outgoing(self, captured: CapturedState) -> dict[Tensor, dict[str, Any]]:
        """The captured state keyed by old parameter, as :func:`~resihp_lightning.state.migration.migrate` sends it."""
        return {captured.params[key]: entry for key, entry in captured.by_key.items() if key in captured.params}

    @abstractmethod
    def bind(self, params: Mapping[str, nn.Parameter], received: StateByKey) -> None:
        """Makes the user's optimizer train ``params`` (before the new engine is built)."""

    def restore(self, engine: Any, params: Mapping[str, nn.Parameter], captured: CapturedState, received: StateByKey) -> None:
        """Puts kept and received state into the new ``engine`` (default: nothing left to do)."""

    @abstractmethod
    def checkpoint_state(self, engine: Any, params: Mapping[str, nn.Parameter]) -> StateByKey:
        """Per-parameter state to save (collective over each stage for the wrapped carrier)."""

    @abstractmethod
    def load_checkpoint(self, engine: Any, params: Mapping[str, nn.Parameter], saved: Mapping[str, Any]) -> None:
        """Restores hyper-parameters and this rank's state from a saved optimizer state (local)."""

    def weights_loaded(self, engine: Any, params: Mapping[str, nn.Parameter]) -> None:
        """Called after new values were written into ``params`` (default: nothing)."""

    def trained_values(self, engine: Any, params: Mapping[str, nn.Parameter]) -> dict[str, Tensor]:
        """The trained value of each of ``params`` in full precision (default: the parameter itself)."""
        return {key: p.detach() for key, p in params.items()}

    @abstractmethod
    def state_bytes(self, engine: Any, param: nn.Parameter) -> float:
        """Bytes of optimizer state this rank keeps for ``param`` (its share, under ZeRO-1)."""


class PlainStateCarrier(StateCarrier):
    """The user's optimizer owns its state in ``optimizer.state`` (fp32, no DeepSpeed wrapper)."""

    per_replica_bounds = True

    def _state(self) -> Mapping[Tensor, Any]:
        return self.bound.optimizer.state if self.bound is not None else {}

    def capture(self, engine: Any, params: Mapping[str, nn.Parameter]) -> CapturedState:
        state = self._state()
        return CapturedState({key: state[p] for key, p in params.items() if p in state}, dict(params))

    def bind(self, params: Mapping[str, nn.Parameter], received: StateByKey) -> None:
        if self.bound is not None:
            self.bound.assign(params, received)

    def checkpoint_state(self, engine: Any, params: Mapping[str, nn.Parameter]) -> StateByKey:
        state = self._state()
        return {key: state[p] for key, p in params.items() if state.get(p)}

    def load_checkpoint(self, engine: Any, params: Mapping[str, nn.Parameter], saved: Mapping[str, Any]) -> None:
        if self.bound is not None:
            layer_checkpoint.load_optimizer_state(self.bound.optimizer, self.bound.groups, saved, params)

    def state_bytes(self, engine: Any, param: nn.Parameter) -> float:
        entry = self._state().get(param, {})
        return float(sum(v.numel() * v.element_size() for v in entry.values() if isinstance(v, Tensor)))


class WrappedStateCarrier(StateCarrier):
    """A DeepSpeed wrapper (ZeRO-1 / bf16) owns fp32 masters and moments in flat partitions."""

    per_replica_bounds = False

    def capture(self, engine: Any, params: Mapping[str, nn.Parameter]) -> CapturedState:
        return CapturedState(wrapped_state.export_state(engine, params), dict(params), wrapped_state.export_scaler(engine))

    def prepare_incoming(self, layers: Iterable[nn.Module]) -> None:
        # Received values arrive in the sender's dtype (the engine's): cast the fresh layers first.
        wrapped_state.cast_parameters(layers, self.param_dtype)

    def bind(self, params: Mapping[str, nn.Parameter], received: StateByKey) -> None:
        # The user's optimizer only ever holds the wrapper's flat partitions: the state goes in at restore.
        if self.bound is not None:
            self.bound.assign(params, None)

    def restore(self, engine: Any, params: Mapping[str, nn.Parameter], captured: CapturedState, received: StateByKey) -> None:
        kept = {key: entry for key, entry in captured.by_key.items() if key in params}
        wrapped_state.import_state(engine, params, {**kept, **received})
        wrapped_state.import_scaler(engine, captured.scaler)

    def checkpoint_state(self, engine: Any, params: Mapping[str, nn.Parameter]) -> StateByKey:
        return wrapped_state.export_state(engine, params)

    def load_checkpoint(self, engine: Any, params: Mapping[str, nn.Parameter], saved: Mapping[str, Any]) -> None:
        if self.bound is not None:
            layer_checkpoint.load_hyperparameters(self.bound.groups, saved)
        entries = {k: wrapped_state.as_wrapped_entry(saved["state"][k], p) for k, p in params.items() if k in saved["state"]}
        wrapped_state.import_state(engine, params, entries)

    def weights_loaded(self, engine: Any, params: Mapping[str, nn.Parameter]) -> None:
        # The wrapper steps its fp32 masters: they must hold the new weights too.
        wrapped_state.set_masters(engine, params)

    def trained_values(self, engine: Any, params: Mapping[str, nn.Parameter]) -> dict[str, Tensor]:
        """The wrapper's fp32 masters (collective over each stage's data-parallel group, like export)."""
        if self.bound is None or not wrapped_state.is_wrapped(engine):
            return super().trained_values(engine, params)
        return wrapped_state.master_values(engine, params)

    def state_bytes(self, engine: Any, param: nn.Parameter) -> float:
        if not param.requires_grad or not wrapped_state.is_wrapped(engine):
            return 0.0
        return param.numel() * wrapped_state.state_bytes_per_element(engine)


def carrier_for(bound: BoundOptimizer | None, deepspeed_config: Mapping[str, Any]) -> StateCarrier:
    """The carrier for a DeepSpeed config: wrapped when DeepSpeed wraps the optimizer (its ZeRO, bf16, fp16),
    sharded for the layer-wise ZeRO-1 (:mod:`~resihp_lightning.state.zero_config`), else plain."""
    from resihp_lightning.state.sharded_moments import ShardedStateCarrier
    from resihp_lightning.state.zero_config import layerwise_zero

    if layerwise_zero(deepspeed_config):
        return ShardedStateCarrier(bound, deepspeed_config)
    cls = WrappedStateCarrier if wrapped_state.wraps_optimizer(deepspeed_config) else PlainStateCarrier
    return cls(bound, deepspeed_config)
