"""Forgetting the process groups that libraries cached, once a generation's groups are destroyed.

DeepSpeed keeps module-level state that points at the old generation's groups: ``deepspeed.comm``'s
backend object (``cdb``), the groups registry of ``deepspeed.utils.groups`` and the pipeline p2p
module's ``_groups`` / ``_grid`` / ``_async``. A new engine built over the new generation would
otherwise reuse them (and ``deepspeed.init_distributed`` would do nothing, since ``cdb`` exists).
Only modules already imported are touched: resetting never imports DeepSpeed.

After :func:`reset_deepspeed`, the caller runs ``deepspeed.init_distributed(...)`` again (it finds
the new default group and wraps it) before building an engine. Code that remembers that it already
initialised DeepSpeed must forget it too (resihp's ``runtime/engine.py`` keeps ``_comm_ready``).
"""

from __future__ import annotations

import sys

from resihp_lightning._logging import get_logger

log = get_logger(__name__)


def reset_deepspeed() -> bool:
    """Drops DeepSpeed's references to process groups; returns whether DeepSpeed was loaded."""
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is None:
        return False
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        release = getattr(groups, "_release_process_group_references", None)
        if release is not None:
            release(None)
        else:  # older DeepSpeed: the same globals, by hand
            for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP", "_ALL_TO_ALL_GROUP"):
                getattr(groups, name, {}).clear()
            for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "mpu"):
                if hasattr(groups, name):
                    setattr(groups, name, None)
    p2p = sys.modules.get("deepspeed.runtime.pipe.p2p")
    if p2p is not None:
        p2p._groups = None
        p2p._grid = None
        p2p._async = []
    comm.cdb = None
    log.debug("DeepSpeed's communication state was reset")
    return True
