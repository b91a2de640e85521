"""What every clover CLI does around its work: user errors become one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from clover.errors import CloverError


def run_cli(prog: str, parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int],
            argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    try:
        return run(args)
    except CloverError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
