"""``ResiHPStrategy`` and ``ResiHPModule`` for the standalone ``pytorch_lightning`` package.

``pytorch_lightning`` ships the same code as ``lightning.pytorch`` under another name, so its
``Trainer`` only accepts strategies and modules built on its own base classes. The classes here are
the package-independent mixins on those bases; everything else (options, planning, re-planning,
checkpoints) is shared. ``Trainer(strategy="resihp")`` picks this class automatically in a
``pytorch_lightning`` Trainer once ``resihp_lightning`` is imported::

    import pytorch_lightning as pl
    import resihp_lightning  # registers "resihp" in both packages' registries
    from resihp_lightning.strategy.standalone import ResiHPModule

    class MyModel(ResiHPModule):  # a pytorch_lightning.LightningModule
        ...

    pl.Trainer(strategy="resihp", accelerator="cpu", devices=4).fit(MyModel(), data)

The callbacks in :mod:`resihp_lightning.callbacks` are plain Lightning callbacks and work in either
Trainer, except :class:`~resihp_lightning.callbacks.progress.ResiHPProgressBar`, which a
``pytorch_lightning`` Trainer does not recognise as its progress bar.
"""

from __future__ import annotations

from pytorch_lightning import LightningModule
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies.ddp import DDPStrategy
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from resihp_lightning.strategy.module import ResiHPModuleMixin
from resihp_lightning.strategy.strategy import ResiHPStrategy as _LightningResiHPStrategy
from resihp_lightning.strategy.strategy import ResiHPStrategyMixin


class ResiHPStrategy(ResiHPStrategyMixin, DDPStrategy):
    __doc__ = (_LightningResiHPStrategy.__doc__ or "") + (
        "\n    This is the class for ``pytorch_lightning`` Trainers; it takes the same arguments.\n"
    )
    misconfiguration_error = MisconfigurationException
    plain_precision = Precision


class ResiHPModule(ResiHPModuleMixin, LightningModule):
    """A ``pytorch_lightning.LightningModule`` with the contract of :class:`~resihp_lightning.strategy.module.ResiHPModule`.

    See :class:`resihp_lightning.strategy.module.ResiHPModule` for what a subclass provides.
    """

    misconfiguration_error = MisconfigurationException
