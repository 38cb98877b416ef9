"""The package imports, carries its version, and its console script runs."""

from __future__ import annotations

import shutil
import subprocess
import sys

import resihp_lightning
from resihp_lightning.__about__ import __version__


def test_package_exposes_version() -> None:
    assert resihp_lightning.__version__ == __version__
    assert __version__.count(".") == 2


def test_console_script_prints_version_and_subcommands() -> None:
    exe = shutil.which("resihp", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert exe is not None, "the `resihp` console script is not installed next to this interpreter"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"resihp-lightning {__version__}"
    help_text = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0, help_text.stderr
    assert "plan" in help_text.stdout


def test_planner_path_does_not_import_lightning() -> None:
    # `resihp plan` must start fast: lightning.pytorch alone takes ~9 s to import on CI machines.
    code = (
        "import sys, resihp_lightning, resihp_lightning.plan, resihp_lightning.config, resihp_lightning.cli;"
        "heavy = [m for m in ('lightning', 'pytorch_lightning', 'deepspeed', 'torch') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
