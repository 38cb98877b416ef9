"""Where a rank was stuck when it came late to a regroup: its threads' stacks, written by ``faulthandler``.

After a generation is aborted every survivor should reach the regroup within ``join_timeout_s``; one
that does not is left out (and killed on the leader's machine), and without a trace nobody learns
what held it. :class:`StallDump` arms ``faulthandler.dump_traceback_later`` at the abort (for half of
``join_timeout_s``, so that the dump is written before the others leave the process out) and cancels it
when the process reaches the regroup; if the timer fires first, every thread's stack goes to
``<run_dir>/stalled-rank<rank>.txt``. An empty file (no stall) is removed at the cancel.

``faulthandler`` has one such timer per process: a program that arms its own loses it at an abort.
"""

from __future__ import annotations

import faulthandler
import threading
from pathlib import Path
from typing import IO

from resihp_lightning._logging import get_logger

log = get_logger(__name__)


class StallDump:
    """Dumps this process's thread stacks if it has not reached the regroup ``timeout_s`` after an abort.

    Args:
        directory: where the dump file goes (the run directory).
        rank: the process's original rank (names the file).
    """

    def __init__(self, directory: Path, rank: int) -> None:
        self.path = Path(directory) / f"stalled-rank{rank}.txt"
        self._file: IO[str] | None = None
        self._lock = threading.Lock()

    @property
    def armed(self) -> bool:
        return self._file is not None

    def arm(self, timeout_s: float) -> None:
        """Starts the timer (again: a later abort restarts it). Safe from any thread."""
        with self._lock:
            try:
                if self._file is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._file = open(self.path, "a")  # noqa: SIM115 - faulthandler writes to it later
                faulthandler.dump_traceback_later(timeout_s, repeat=False, file=self._file, exit=False)
            except OSError as err:  # a diagnostic: never a reason to fail the recovery
                log.debug("no stall dump: %s", err)

    def disarm(self) -> None:
        """Cancels the timer; removes the file when nothing was written to it."""
        with self._lock:
            if self._file is None:
                return
            faulthandler.cancel_dump_traceback_later()
            self._file.close()
            self._file = None
            try:
                if self.path.stat().st_size == 0:
                    self.path.unlink()
                else:
                    log.warning("this process was late for a regroup; its threads' stacks are in %s", self.path)
            except OSError:
                pass
