"""The ``autoscale`` command line. ``diff``, ``convert`` and ``report`` arrive with later issues."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autoscale", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import autoscale

    if args.version:
        print(autoscale.__version__)
        return 0
    parser.print_help()
    return 0
