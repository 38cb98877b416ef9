"""The API reference (docs/api.md) lists every public package and top-level module, so that
``make docs`` builds a page, and checks the references, for each of them."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Not part of the public API: test helpers shipped with the package.
NOT_DOCUMENTED = {"testing"}


def test_every_public_module_has_an_api_page() -> None:
    listed = {line.strip() for line in (ROOT / "docs" / "api.md").read_text().splitlines()}
    package = ROOT / "resihp_lightning"
    public = {p.stem for p in package.glob("*.py") if not p.name.startswith("_")}
    public |= {p.parent.name for p in package.glob("*/__init__.py")} - NOT_DOCUMENTED
    missing = sorted(name for name in public if f"resihp_lightning.{name}" not in listed)
    assert not missing, f"docs/api.md does not list: {missing}"
