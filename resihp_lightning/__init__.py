"""resihp-lightning: resilient pipeline x data-parallel training for PyTorch Lightning.

``import resihp_lightning`` is cheap: it does not import torch, Lightning or DeepSpeed. It registers
the ``"resihp"`` strategy in ``lightning.pytorch``'s registry as soon as that package is (or has been)
imported, and exposes the strategy's public names lazily.
"""

from __future__ import annotations

from resihp_lightning import _registration
from resihp_lightning.__about__ import __version__
from resihp_lightning._lazy import lazy_getattr

_LAZY = {
    "ResiHPStrategy": "resihp_lightning.strategy.strategy",
    "ResiHPModule": "resihp_lightning.strategy.module",
    "StrategyOptions": "resihp_lightning.strategy.options",
}

__all__ = ["__version__", *_LAZY]

_registration.install()


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
