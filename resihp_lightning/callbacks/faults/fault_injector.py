"""``FaultInjector``: a Lightning callback that creates failures from a config (examples, tests, benchmarks).

Per fault (:class:`~resihp_lightning.callbacks.faults.slowdowns.FaultConfig`), on the rank it names:

* ``slow``: from ``start_step`` to ``end_step`` all of the rank's compute runs at ``1/factor`` speed,
  as on a throttled device (:class:`~resihp_lightning.callbacks.faults.slowdowns.Slowdown`: the waits sit
  inside each piece of work, in proportion to its measured duration): its layers' forward and
  backward, the loss (``pipeline_loss``, forward and backward) and the optimizer step. The layers
  are the strategy's ``local_layers()`` (:class:`~resihp_lightning.contract.LayerHost`, checked at
  ``setup`` on a rank that has a ``slow`` fault; other faults need nothing from the strategy),
  re-wrapped after every re-plan, since a rebuild may hand the rank other modules.
* ``slow_link``: the rank's links are slow: each of its pipeline sends and gradient all-reduces
  waits ``delay_ms`` while active (its compute is untouched).
* ``delay_p2p``: every pipeline send waits ``delay_ms`` while active.
* ``kill`` / ``hang``: inside step ``start_step``, at the forward of the rank's ``micro_batch``-th
  micro-batch (a pre-hook on its first layer), the process sends itself SIGKILL (as ``kill -9``
  would) or SIGSTOP (frozen, as a hung device looks from outside).

Each fault writes one ``fault_injected`` event when it starts (by the faulted rank, which may not be
rank 0, so the write is forced).

The injector keeps no state across a resume: faults are scheduled by ``trainer.global_step``, which
Lightning restores, so a fault in force at the checkpoint is in force again after it (and, being
injected anew into the new process, is logged again).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from resihp_lightning._logging import get_logger
from resihp_lightning.callbacks.events import EventLog
from resihp_lightning.callbacks.faults.slowdowns import STOP_KINDS, FaultConfig, Slowdown
from resihp_lightning.contract import LayerHost, require
from resihp_lightning.runtime.transport_delays import DelayedCall, delay_p2p_sends, slow_links
from resihp_lightning.torch_utils.speed_probe import PROBE

log = get_logger(__name__)


class FaultInjector(Callback):
    """Injects the configured faults.

    Args:
        faults: fault configs (or mappings with the same keys, e.g. from YAML).
        events: the event log; default: ``<trainer.log_dir>/events.jsonl`` (rank 0 writer, faults forced).
        log_dir: where to put the default event log instead of the trainer's log directory.
    """

    def __init__(
        self,
        faults: FaultConfig | Mapping[str, Any] | Sequence[FaultConfig | Mapping[str, Any]] = (),
        *,
        events: EventLog | None = None,
        log_dir: str | None = None,
    ) -> None:
        if isinstance(faults, (FaultConfig, Mapping)):
            faults = [faults]
        self.faults = [FaultConfig.from_dict(f) for f in faults]
        self.events = events
        self.log_dir = log_dir
        self.rank = 0
        self.step = 0
        self._mine: list[FaultConfig] = []
        self._announced: set[int] = set()
        self._slowdown: Slowdown | None = None
        self._restore_probe: Any = None
        self._delays: list[DelayedCall] = []
        self._module: Any = None  # the LightningModule whose pipeline_loss is slowed

    # --------------------------------------------------------------------------- helpers
    def current_factor(self) -> float:
        factor = 1.0
        for fault in self._mine:
            if fault.kind == "slow" and fault.active(self.step):
                factor *= fault.factor
        return factor

    def current_delay_s(self) -> float:
        return self._delay_s("delay_p2p")

    def current_link_delay_s(self) -> float:
        return self._delay_s("slow_link")

    def _delay_s(self, kind: str) -> float:
        return sum(f.delay_ms for f in self._mine if f.kind == kind and f.active(self.step)) / 1000.0

    # ------------------------------------------------------------------------- callbacks
    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.rank = trainer.global_rank
        self._mine = [f for f in self.faults if f.rank == self.rank]
        slow = any(f.kind == "slow" for f in self._mine)
        if slow or any(f.kind in STOP_KINDS for f in self._mine):
            require(trainer.strategy, LayerHost, "FaultInjector (a slow, kill or hang fault on this rank)")
        if self.events is None:
            log_dir = self.log_dir or trainer.log_dir or trainer.default_root_dir
            self.events = EventLog(Path(log_dir), rank=self.rank)
        if slow and self._slowdown is None:
            self._slowdown = Slowdown(self.current_factor)
            self._slowdown.slow_optimizer_steps()
            if callable(getattr(pl_module, "pipeline_loss", None)):
                self._module = pl_module
                pl_module.pipeline_loss = self._slowdown.wrap_function(pl_module.pipeline_loss)
            # A throttled device runs the detector's speed probe slower too.
            self._restore_probe = PROBE.wrap(self._slowdown.wrap_function)
        if any(f.kind == "delay_p2p" for f in self._mine) and not self._delays:
            self._delays.append(delay_p2p_sends(self.current_delay_s))
        if any(f.kind == "slow_link" for f in self._mine):
            self._delays.extend(slow_links(self.current_link_delay_s))

    def _strike_inside_step(self, host: LayerHost, fault: FaultConfig) -> None:
        """Arms a pre-hook on this rank's first layer that kills / freezes the process mid-schedule."""
        layers = host.local_layers()
        seen = [0]
        sig = signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP

        def strike(module: Any, args: Any) -> None:
            seen[0] += 1
            if seen[0] == fault.micro_batch or module is None:
                self.events.log("fault_struck", self.step, force=True, kind=fault.kind, rank=self.rank, at=time.monotonic())
                os.kill(os.getpid(), sig)

        if not layers:  # an idle rank (a hot spare) runs no schedule: it fails at the step's start
            strike(None, None)
            return
        layers[min(layers)].register_forward_pre_hook(strike)

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._slowdown is not None:
            self._slowdown.unwrap_all()
            self._slowdown = None
        if self._restore_probe is not None:
            self._restore_probe()
            self._restore_probe = None
        if self._module is not None:
            vars(self._module).pop("pipeline_loss", None)
            self._module = None
        for delay in reversed(self._delays):
            delay.restore()
        self._delays = []

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.step = trainer.global_step
        for index, fault in enumerate(self._mine):
            if not fault.active(self.step):
                continue
            if index not in self._announced:
                self._announced.add(index)
                self.events.log("fault_injected", self.step, force=True, **fault.to_dict())
                log.warning("injecting %s on rank %d at step %d", fault.kind, self.rank, self.step)
            if fault.kind in STOP_KINDS and self.step == fault.start_step:
                self._strike_inside_step(trainer.strategy, fault)
        if self._slowdown is not None and self.current_factor() > 1.0:
            host: LayerHost = trainer.strategy
            for module in host.local_layers().values():
                self._slowdown.wrap(module)
