"""resihp-lightning: resilient pipeline x data-parallel training for PyTorch Lightning.

``import resihp_lightning`` is cheap: it does not import torch, Lightning or DeepSpeed. It registers
the ``"resihp"`` strategy in ``lightning.pytorch``'s registry as soon as that package is (or has been)
imported, and exposes the strategy's public names lazily.
"""

from __future__ import annotations

from typing import Any

from resihp_lightning import _registration
from resihp_lightning.__about__ import __version__

_LAZY = {
    "ResiHPStrategy": "resihp_lightning.strategy.strategy",
    "ResiHPModule": "resihp_lightning.strategy.module",
    "StrategyOptions": "resihp_lightning.strategy.options",
}

__all__ = ["__version__", *_LAZY]

_registration.install()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'resihp_lightning' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
