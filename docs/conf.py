"""Sphinx configuration of the resihp-lightning documentation (``make docs``)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resihp_lightning.__about__ import __version__  # noqa: E402

project = "resihp-lightning"
author = "resihp-lightning developers"
release = __version__
version = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "myst_parser",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]
templates_path = ["_templates"]

html_theme = "furo"
html_title = f"resihp-lightning {version}"

# --- MyST: the Markdown pages ---------------------------------------------------------------------
# Headings get GitHub-style anchors, so `page.md#a-heading` links are checked against real headings.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]

# --- API pages from the docstrings ----------------------------------------------------------------
autosummary_generate = True
autosummary_imported_members = False
autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
    "member-order": "bysource",
    # Document what a module defines, not what it re-exports (each object has one page, its home).
    "ignore-module-all": True,
}
autodoc_typehints = "signature"
autodoc_class_signature = "separated"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# --- Cross-reference checking (make docs runs sphinx with -n -W --keep-going) -----------------------
nitpicky = True
# There is no network at build time, so no intersphinx inventories: names of other projects
# cannot resolve. Every name of this package must.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|lightning|pytorch_lightning|lightning_utilities|deepspeed|numpy|np|transformers"
               r"|lightning_fabric|safetensors|ortools|pulp|highspy|matplotlib|jsonargparse|yaml)(\..*)?"),
    # The standard library (no intersphinx inventory either).
    (r"py:.*", r"(pathlib|collections|concurrent|datetime|enum|logging|multiprocessing|os|socket|subprocess"
               r"|threading|types|typing|typing_extensions|dataclasses|io|json|queue|random|signal|abc|fractions)(\..*)?"),
    # Type variables and private names (a private base class in "Bases:") are not documented.
    (r"py:class", r"resihp_lightning\..*\.T"),
    (r"py:class", r"resihp_lightning\..*\._[A-Za-z]\w*"),
]

# Docstrings of inherited Lightning / torch methods are theirs, not ours (and use their own directives).
autodoc_inherit_docstrings = False


_ATTRIBUTE_DOCSTRINGS: dict[str, list[str]] = {}
_ATTRIBUTE_KINDS = ("attribute", "property", "data")


def _keep_attribute_docstring(app, what, name, obj, options, lines):
    """Remember an attribute's docstring before napoleon reads it (see ``_restore_attribute_docstring``)."""
    if what in _ATTRIBUTE_KINDS:
        _ATTRIBUTE_DOCSTRINGS[name] = list(lines)


def _restore_attribute_docstring(app, what, name, obj, options, lines):
    """Undo napoleon's Google-style inline type on attributes, properties and module data.

    Napoleon reads an attribute docstring's first line as ``type: description``. This project's
    attribute docstrings are sentences ("Which shard (...): the layers this process holds") whose
    types come from annotations, so napoleon's reading would turn half a sentence into a type.
    """
    if what in _ATTRIBUTE_KINDS and name in _ATTRIBUTE_DOCSTRINGS:
        lines[:] = _ATTRIBUTE_DOCSTRINGS.pop(name)


def setup(app):
    # Around napoleon's own handler (priority 500).
    app.connect("autodoc-process-docstring", _keep_attribute_docstring, priority=400)
    app.connect("autodoc-process-docstring", _restore_attribute_docstring, priority=600)
