"""ResiHPStrategy: the Lightning wiring of a DeepSpeed pipeline x data-parallel job that re-plans live.

This package holds only what talks to Lightning: the strategy class, its options, the LightningModule
contract (``module``), launcher and Trainer-option checks, checkpoint I/O, and the parts the strategy
composes (``job_membership``, ``tensor_modes``, ``model_state``, ``evaluation_steps``). The plan-dependent DeepSpeed
objects live in :mod:`resihp_lightning.runtime`, moving state in :mod:`resihp_lightning.state`, a job
that can lose ranks in :mod:`resihp_lightning.failstop`. Public names are imported lazily so that
importing this package stays cheap.
"""

from __future__ import annotations

from resihp_lightning._lazy import lazy_getattr

_LAZY = {
    "ResiHPStrategy": "resihp_lightning.strategy.strategy",
    "ResiHPModule": "resihp_lightning.strategy.module",
    "StrategyOptions": "resihp_lightning.strategy.options",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
