"""Logging convention.

Library internals log through ``get_logger(__name__)`` (a child of the ``resihp_lightning`` logger,
silent unless the application configures logging). Messages meant for the person running the job go
through Lightning's ``rank_zero_info`` / ``rank_zero_warn`` so that they are printed once, not once
per rank; see :func:`user_info` and :func:`user_warn`, which import Lightning only when called.
"""

from __future__ import annotations

import logging

ROOT_LOGGER_NAME = "resihp_lightning"
logging.getLogger(ROOT_LOGGER_NAME).addHandler(logging.NullHandler())


def get_logger(name: str) -> logging.Logger:
    """Returns the logger for a module of this package.

    Args:
        name: usually ``__name__``; names outside the package are nested under it.
    """
    if name != ROOT_LOGGER_NAME and not name.startswith(ROOT_LOGGER_NAME + "."):
        name = f"{ROOT_LOGGER_NAME}.{name}"
    return logging.getLogger(name)


def user_info(message: str) -> None:
    """Prints an informational message for the user, on global rank 0 only."""
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(message)


def user_warn(message: str) -> None:
    """Emits a warning for the user, on global rank 0 only."""
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn(message)


def quiet_agreed_errors(rank: int) -> None:
    """On ranks other than 0, configuration errors end the process without a second traceback.

    Such errors (``ConfigError``, Lightning's ``MisconfigurationException``) come from checks that every
    rank runs on the same inputs, so rank 0 prints the same message; other exceptions print as usual.
    """
    if rank == 0:
        return
    import sys

    from resihp_lightning.errors import ConfigError

    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: object) -> None:
        if isinstance(value, ConfigError) or type(value).__name__ == "MisconfigurationException":
            return
        previous(kind, value, tb)

    sys.excepthook = hook
