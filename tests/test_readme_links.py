"""The README's links into the repository resolve: every linked file exists and every ``#anchor`` names
a heading of it. (The pages under docs/ are checked by ``make docs``; the README is not part of that
site, GitHub renders it.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s#]+)?(?:#([^)\s]+))?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's (and MyST's) anchors of a page's headings: lower case, punctuation dropped, spaces as '-'."""
    anchors = set()
    for line in FENCE.sub("", markdown).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def readme_links() -> list[tuple[str, str | None]]:
    text = FENCE.sub("", (ROOT / "README.md").read_text())
    return [(path, anchor) for path, anchor in LINK.findall(text) if path and "://" not in path]


def test_the_readme_links_into_docs():
    assert any(path.startswith("docs/") for path, _ in readme_links())


@pytest.mark.parametrize(("path", "anchor"), readme_links())
def test_a_readme_link_resolves(path, anchor):
    target = ROOT / path
    assert target.is_file(), f"README.md links to {path}, which does not exist"
    if anchor:
        assert anchor in heading_anchors(target.read_text()), f"README.md links to {path}#{anchor}: no such heading"
