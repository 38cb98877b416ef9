"""Lazy public names for packages whose contents import heavy dependencies (torch, Lightning)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, names: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """Builds a module-level ``__getattr__`` (PEP 562) that imports a name on first access.

    Args:
        package: the package's ``__name__``, for error messages.
        names: public name -> absolute module that defines it.
        namespace: the package's ``globals()``; a loaded name is cached there, so the next access
            does not come back here.
    """

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
