"""``HeartbeatMonitor``: runs a :class:`~.heartbeat.Heartbeat` for the length of ``trainer.fit``.

Started in ``setup`` (the process group exists by then, so rank 0 can pick a free port for the
store and broadcast it), told the step at each training batch (for ``progress_timeout_s``), and
stopped with a goodbye in ``teardown`` so that ranks finishing at slightly different times are not
reported dead. A dead rank stops the trainer on the reporting rank (``should_stop``) unless
``on_failure`` ends the process first; see :mod:`.heartbeat` for how the job avoids hanging.

It needs nothing from the strategy beyond the process group, and saves no state in checkpoints:
liveness is about the processes of the run that is going on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from resihp_lightning.callbacks.events import EventLog
from resihp_lightning.callbacks.failstop.heartbeat import Heartbeat, HeartbeatConfig
from resihp_lightning.config import config_from_options


class HeartbeatMonitor(Callback):
    """Fail-stop detection during training.

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

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.heartbeat is not None:
            return
        if self.events is None:
            log_dir = self.log_dir or trainer.log_dir or trainer.default_root_dir
            self.events = EventLog(Path(log_dir), rank=trainer.global_rank)
        self._trainer = trainer
        self.heartbeat = Heartbeat(self.config, rank=trainer.global_rank, world_size=trainer.world_size,
                                   events=self.events, on_dead=self._on_dead).start()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat.progress(trainer.global_step)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.heartbeat is not None and stage == "fit":
            self.heartbeat.stop()
            self.heartbeat = None

    def _on_dead(self, ranks: list[int]) -> None:
        if self._trainer is not None:
            self._trainer.should_stop = True
