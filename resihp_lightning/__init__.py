"""resihp-lightning: resilient pipeline x data-parallel training for PyTorch Lightning."""

from resihp_lightning.__about__ import __version__

__all__ = ["__version__"]
