"""What every clover CLI does around its work: user errors become one line on stderr and exit code 2, and
Ctrl-C one line and exit code 130 (no traceback)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from clover.errors import CloverError


def run_cli(prog: str, parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int],
            argv: list[str] | None, interrupted: str = "") -> int:
    """Parse `argv` (default sys.argv[1:]; kept as args.argv for provenance) and call `run`.
    `interrupted`: what survives a Ctrl-C, said after "interrupted"."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return run(args)
    except CloverError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted" + (f" ({interrupted})" if interrupted else ""), file=sys.stderr)
        return 130
