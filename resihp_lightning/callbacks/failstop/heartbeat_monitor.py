"""``HeartbeatMonitor``: reports fail-stop failures for the length of ``trainer.fit``.

At ``setup`` it takes the detector the job already runs, when there is one (the strategy's, with
``fail_stop`` on: ``strategy.failure_detector``, see :class:`~resihp_lightning.contract.Survivable`), and only
reports what that detector finds: the strategy recovers, so ``on_failure`` does not apply and the
trainer is not stopped. Without one it starts a :class:`~.heartbeat.Heartbeat` with a detector of its
own (the process group exists by then, so rank 0 can pick a free port for the store and broadcast
it), tells it the step at each training batch (for ``progress_timeout_s``), and stops it with a
goodbye in ``teardown`` so that ranks finishing at slightly different times are not reported dead. A
dead rank then stops the trainer on the reporting rank (``should_stop``) unless ``on_failure`` ends
the process first; see :mod:`.heartbeat` for how the job avoids hanging.

It needs nothing from the strategy beyond the process group, and saves no state in checkpoints:
liveness is about the processes of the run that is going on.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from resihp_lightning._logging import user_warn
from resihp_lightning.callbacks.events import EventLog
from resihp_lightning.callbacks.failstop.heartbeat import Heartbeat, HeartbeatConfig
from resihp_lightning.config import config_from_options


class HeartbeatMonitor(Callback):
    """Fail-stop reporting during training.

    Args:
        config: heartbeat options; alternatively pass them as keyword arguments (same names).
        events: the event log; default ``<trainer.log_dir>/events.jsonl``.
        log_dir: where to put the default event log instead of the trainer's log directory.
        **options: fields of :class:`~.heartbeat.HeartbeatConfig`.
    """

    def __init__(self, config: HeartbeatConfig | None = None, *, events: EventLog | None = None,
                 log_dir: str | None = None, **options: Any) -> None:
        self.config = config_from_options(HeartbeatConfig, config, options, "HeartbeatMonitor")
        self.events = events
        self.log_dir = log_dir
        self.heartbeat: Heartbeat | None = None
        self._trainer: Any = None

    @property
    def dead(self) -> dict[int, float]:
        """Ranks this rank has reported dead (rank -> report time)."""
        return dict(self.heartbeat.dead) if self.heartbeat is not None else {}

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.heartbeat is not None:
            return
        if self.events is None:
            log_dir = self.log_dir or trainer.log_dir or trainer.default_root_dir
            self.events = EventLog(Path(log_dir), rank=trainer.global_rank)
        self._trainer = trainer
        detector = getattr(trainer.strategy, "failure_detector", None)
        if detector is not None:
            ignored = _options_without_effect(self.config)
            if ignored:
                user_warn(
                    f"HeartbeatMonitor: {', '.join(ignored)} do not apply with the strategy's fail_stop, whose "
                    "detector it reports (fail_stop's interval_s, detect_timeout_s and progress_timeout_s "
                    "apply; lost ranks are recovered in-process, not acted on)"
                )
            self.heartbeat = Heartbeat(self.config, detector=detector, events=self.events).start()
        else:
            self.heartbeat = Heartbeat(self.config, rank=trainer.global_rank, world_size=trainer.world_size,
                                       events=self.events, on_dead=self._on_dead).start()

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat.progress(trainer.global_step)

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.heartbeat is not None and stage == "fit":
            self.heartbeat.stop()
            self.heartbeat = None

    def _on_dead(self, ranks: list[int]) -> None:
        if self._trainer is not None:
            self._trainer.should_stop = True


def _options_without_effect(config: HeartbeatConfig) -> list[str]:
    """The options set away from their defaults that a running detector's reports ignore
    (everything but ``monitor``: detection is the detector's, recovery the strategy's)."""
    default = HeartbeatConfig()
    return [f"{name}={getattr(config, name)!r}" for name in (f.name for f in fields(config))
            if name != "monitor" and getattr(config, name) != getattr(default, name)]
