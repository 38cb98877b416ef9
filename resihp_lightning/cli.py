"""The ``resihp`` command line: ``resihp plan``, ``resihp simulate``, ``resihp report``.

Sub-commands import their heavy dependencies lazily so that ``resihp --help`` answers at once.
Errors the user can fix exit with status 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from resihp_lightning.__about__ import __version__
from resihp_lightning.errors import ResiHPError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resihp",
        description="Resilient hybrid-parallel training: plan layouts, simulate them, report runs.",
    )
    parser.add_argument("--version", action="version", version=f"resihp-lightning {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``resihp`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.handler(args)
    except ResiHPError as err:
        print(f"resihp {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
