"""The package's layers: every module imports only from its own package and the layers below it,
and the planning core stays free of torch (docs/architecture.md, "Layers and import direction")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "resihp_lightning"

#: The torch-free core: top-level modules that everything may import.
CORE = "core"
#: Top-level entry points and test helpers may import anything.
ANYTHING = "anything"

#: Layer -> the layers it may import (besides itself and the core).
ALLOWED: dict[str, set[str]] = {
    CORE: set(),
    "solver": set(),
    "torch_utils": set(),
    "resilience": set(),
    "data": set(),
    "evaluation": {"solver"},
    "state": {"torch_utils"},
    "tensor": {"torch_utils"},
    "runtime": {"torch_utils", "state", "tensor"},
    "failstop": {"solver", "resilience", "runtime", "state", "tensor", "torch_utils"},
    "strategy": {"solver", "resilience", "runtime", "state", "tensor", "failstop", "torch_utils"},
    # Callbacks see the strategy only through contract.py (core). Injected link faults delay the
    # runtime's own transfers, so callbacks/faults may reach into the runtime.
    "callbacks": {"solver", "torch_utils"},
    "callbacks/faults": {"solver", "torch_utils", "runtime"},
    # The heartbeat callback reports what the one failure detector (resilience/) finds.
    "callbacks/failstop": {"solver", "torch_utils", "resilience"},
    "models": {"torch_utils", "data", "tensor", "strategy"},
    ANYTHING: set(),
}

ENTRY_POINTS = {"cli", "report", "__init__", "testing"}
LAYER_PACKAGES = {name for name in ALLOWED if name not in (CORE, ANYTHING)}


def layer_of(module: str) -> str:
    """``resihp_lightning.callbacks.faults.slowdowns`` -> ``callbacks/faults``; top-level modules -> core."""
    parts = module.split(".")[1:]
    if not parts:
        return ANYTHING
    if parts[0] in ENTRY_POINTS:
        return ANYTHING
    if len(parts) >= 2 and f"{parts[0]}/{parts[1]}" in ALLOWED:
        return f"{parts[0]}/{parts[1]}"
    if parts[0] in ALLOWED:
        return parts[0]
    if len(parts) == 1:
        return CORE
    raise AssertionError(f"{module}: a package that tests/test_import_layers.py does not place in a layer")


def package_of(layer: str) -> str:
    return layer.split("/")[0]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("resihp_lightning"):
                found.add(node.module)
                # ``from resihp_lightning.runtime import batching`` imports a module of that package
                for alias in node.names:
                    candidate = PACKAGE.parent / (node.module.replace(".", "/") + f"/{alias.name}.py")
                    if candidate.exists():
                        found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("resihp_lightning"))
    return found


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def all_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_import_goes_down_the_layers() -> None:
    wrong = []
    for path in all_modules():
        name = module_name(path)
        own = layer_of(name)
        if own == ANYTHING:
            continue
        for target in imported_modules(path):
            if target == "resihp_lightning":
                target_layer = ANYTHING if own == CORE else CORE  # the package root: only its lazy names
            else:
                target_layer = layer_of(target)
            if target_layer in (CORE,) or package_of(target_layer) == package_of(own):
                continue
            if target_layer not in ALLOWED[own]:
                wrong.append(f"{name} ({own}) imports {target} ({target_layer})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_every_package_has_a_layer() -> None:
    packages = {p.parent.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    assert packages <= LAYER_PACKAGES | ENTRY_POINTS, packages - LAYER_PACKAGES - ENTRY_POINTS


def test_no_two_modules_share_a_name() -> None:
    seen: dict[str, Path] = {}
    clashes = []
    for path in all_modules():
        if path.name == "__init__.py":
            continue
        if path.stem in seen:
            clashes.append(f"{seen[path.stem].relative_to(PACKAGE)} and {path.relative_to(PACKAGE)}")
        seen[path.stem] = path
    assert not clashes, clashes


@pytest.mark.parametrize(
    "modules",
    [
        # the planning core and the solvers (`resihp plan` starts fast, the background planner's worker too)
        "resihp_lightning.plan resihp_lightning.placement resihp_lightning.config resihp_lightning.contract "
        "resihp_lightning.telemetry resihp_lightning.errors resihp_lightning.launcher_env resihp_lightning.solver "
        "resihp_lightning.solver.exact resihp_lightning.solver.cpsat resihp_lightning.solver.pulp_backend",
        # the callbacks' decisions: pure cores, testable without torch
        "resihp_lightning.callbacks.failslow.straggler_core resihp_lightning.callbacks.failslow.link_core "
        "resihp_lightning.callbacks.replan.replan_policy resihp_lightning.callbacks.events "
        "resihp_lightning.evaluation.run resihp_lightning.resilience",
    ],
)
def test_torch_free_modules_do_not_import_torch(modules: str) -> None:
    code = f"import sys, importlib\nfor m in {modules.split()!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False", f"importing {modules} pulled in torch"
