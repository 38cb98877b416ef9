"""Lightning's script launcher, minus the observer that ends the whole job when one process dies.

On one machine Lightning's ``_SubprocessScriptLauncher`` starts ranks 1.. as child processes of
rank 0 and watches them with a thread that kills every process (rank 0 included) as soon as one
child exits with an error. Under in-process fail-stop recovery that defeats the point: the survivors
are about to regroup. :func:`without_observer` gives the launcher's class a subclass whose ``launch``
starts the children the same way and does not watch them; a child that dies is the survivors'
business, and a rank 0 that dies leaves its children running (they are not killed with it).
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

_CLASSES: dict[type, type] = {}


def without_observer(launcher: Any) -> Any:
    """Turns ``launcher`` (a ``_SubprocessScriptLauncher`` of either Lightning package) observer-free."""
    base = type(launcher)
    if getattr(base, "_resihp_no_observer", False):
        return launcher
    if base not in _CLASSES:

        class SurvivingLauncher(base):  # type: ignore[misc, valid-type]
            _resihp_no_observer = True

            def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
                self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
                if not self.cluster_environment.creates_processes_externally:
                    self._call_children_scripts()
                _set_num_threads_if_needed(num_processes=self.num_processes)
                return function(*args, **kwargs)

        SurvivingLauncher.__name__ = SurvivingLauncher.__qualname__ = f"Surviving{base.__name__}"
        _CLASSES[base] = SurvivingLauncher
    launcher.__class__ = _CLASSES[base]
    return launcher
