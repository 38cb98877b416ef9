"""Registers ``"resihp"`` in Lightning's strategy registry without importing Lightning eagerly.

``import resihp_lightning`` must stay cheap (the ``resihp plan`` CLI imports it and Lightning takes
seconds to import), yet ``Trainer(strategy="resihp")`` must work whichever of the two packages was
imported first. :func:`install` therefore registers at once when ``lightning.pytorch`` is already
imported and otherwise puts a finder on ``sys.meta_path`` that wraps the loader of
``lightning.pytorch`` so that the registration runs right after that package finishes executing.

The same is done for the standalone ``pytorch_lightning`` package when it is installed: its
registry gets a factory for :class:`resihp_lightning.strategy.standalone.ResiHPStrategy`, the
strategy built on ``pytorch_lightning``'s own base classes (its Trainer accepts no other).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from resihp_lightning._logging import get_logger

log = get_logger(__name__)

#: Packages whose strategy registry gets ``"resihp"``.
TARGETS = ("lightning.pytorch", "pytorch_lightning")

#: Module holding the strategy class built on each target's base classes.
STRATEGY_MODULES = {
    "lightning.pytorch": "resihp_lightning.strategy.strategy",
    "pytorch_lightning": "resihp_lightning.strategy.standalone",
}

_registered: set[str] = set()


#: Shown by ``StrategyRegistry.available_strategies()`` and Lightning's error for unknown names.
DESCRIPTION = "ResiHP: DeepSpeed pipeline x data parallelism with live re-planning"


def build_strategy(package: str = "lightning.pytorch", **kwargs: Any) -> Any:
    """Builds the ``ResiHPStrategy`` of ``package``, importing it only when a Trainer asks.

    Registering a factory rather than the class keeps registration free of imports of our own
    strategy modules, so it can run from inside any import of Lightning without a cycle.
    """
    return importlib.import_module(STRATEGY_MODULES[package]).ResiHPStrategy(**kwargs)


def _factory(package: str) -> Any:
    def build(**kwargs: Any) -> Any:
        return build_strategy(package, **kwargs)

    build.__qualname__ = build.__name__ = f"build_strategy[{package}]"
    return build


def register(package: str) -> None:
    """Registers ``"resihp"`` in ``package``'s ``StrategyRegistry`` (idempotent)."""
    if package in _registered:
        return
    registry = importlib.import_module(f"{package}.strategies").StrategyRegistry
    _registered.add(package)
    if "resihp" not in registry:
        registry.register("resihp", _factory(package), description=DESCRIPTION)
    log.debug("registered strategy 'resihp' in %s", package)


class _RegisteringLoader(importlib.abc.Loader):
    """Delegates to the real loader, then registers the strategy."""

    def __init__(self, inner: importlib.abc.Loader, package: str) -> None:
        self._inner = inner
        self._package = package

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        # The package is complete here; it is in sys.modules, so importing it again is free.
        register(self._package)

    def __getattr__(self, name: str):  # e.g. get_resource_reader, is_package
        return getattr(self._inner, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds target packages through the other finders and wraps their loaders."""

    def find_spec(self, fullname: str, path, target=None) -> ModuleSpec | None:
        if fullname not in TARGETS or fullname in _registered:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader, fullname)
                return spec
        return None


_finder = _PostImportFinder()


def install() -> None:
    """Registers now for targets already imported; arranges registration for the others."""
    pending = False
    for package in TARGETS:
        if package in sys.modules and getattr(sys.modules[package], "__spec__", None) is not None:
            module = sys.modules[package]
            # A package still executing (we are imported from inside it) registers on completion.
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                pending = True
            else:
                register(package)
        else:
            pending = True
    if pending and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
