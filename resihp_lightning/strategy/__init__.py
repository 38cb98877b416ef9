"""ResiHPStrategy: a Lightning strategy that runs a DeepSpeed pipeline x data-parallel job and re-plans it live.

Modules (each with one job): ``options`` (constructor options), ``module`` (the LightningModule
contract), ``topology`` (placement of a Plan on ranks), ``pipeline_module`` (explicit stage bounds),
``engine`` (build / destroy DeepSpeed engines), ``migration`` (moving layers between ranks),
``batching`` (slicing the global batch), ``profiling`` (per-micro-batch and per-layer timing),
``checkpoint`` (layer-keyed checkpoints), ``strategy`` (the Lightning strategy itself).
Public names are imported lazily so that importing this package stays cheap.
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
