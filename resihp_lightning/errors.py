"""Exceptions raised by resihp-lightning.

Every user-facing error names what is wrong and, where there is a fixed set, what is allowed, so that
a misconfigured job fails with one readable line instead of a traceback deep in DeepSpeed.
Configuration errors subclass ``ValueError`` (as Lightning's own ``MisconfigurationException`` users
expect to catch); the strategy re-raises them as ``MisconfigurationException`` where Lightning does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ResiHPError(Exception):
    """Base class of every exception this package raises on purpose."""


class ConfigError(ResiHPError, ValueError):
    """An option has a value that is not allowed."""


class ProblemError(ResiHPError, ValueError):
    """A planning problem is malformed (unknown field, negative speed, ...)."""


class PlanError(ResiHPError, ValueError):
    """A plan does not fit its problem (bounds, devices, micro-batches or memory)."""


class InfeasibleError(ResiHPError):
    """No plan satisfies the problem's constraints (usually memory)."""


def invalid_option(option: str, value: Any, allowed: str | Iterable[Any]) -> ConfigError:
    """Builds the standard error for an option with a value that is not allowed.

    Args:
        option: the option's name as the user spells it (``"planner.solver"``).
        value: the value that was given.
        allowed: a description of the allowed values, or an iterable of them.

    Returns:
        A :class:`ConfigError` whose message names the option, the value and what is allowed.
    """
    if not isinstance(allowed, str):
        allowed = ", ".join(repr(a) for a in allowed)
    return ConfigError(f"invalid value {value!r} for option `{option}`; allowed: {allowed}")
