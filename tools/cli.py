"""What every clover CLI does around its work: user errors become one line on stderr and exit code 2 (an optional
dependency that is not installed too, naming the extra that brings it), and Ctrl-C one line and exit code 130 (no
traceback)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from clover.errors import CloverError

TORCH_CPU = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# an optional dependency's top-level module -> how to install it
EXTRAS = {
    "torch": f"{TORCH_CPU}, then pip install 'clover-deploy[torch,onnx]'",
    "transformers": "pip install 'clover-deploy[torch]'",
    "gguf": "pip install 'clover-deploy[torch]'",
    "onnx": "pip install 'clover-deploy[onnx]'",
    "onnxscript": "pip install 'clover-deploy[onnx]'",
    "onnxruntime": "pip install 'clover-deploy[onnx]'",
    "polygraphy": "pip install 'clover-deploy[onnx]'",
    "fastapi": "pip install 'clover-deploy[serve]'",
    "uvicorn": "pip install 'clover-deploy[serve]'",
    "prometheus_client": "pip install 'clover-deploy[serve]'",
    "triton": "pip install 'clover-deploy[kernels]'",
    "matplotlib": "pip install 'clover-deploy[bench]'",
    "tensorrt": "a GPU environment with the gpu extra (docs/gpu.md)",
}


def run_cli(
    prog: str,
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None,
    interrupted: str = "",
) -> int:
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
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        if missing not in EXTRAS:
            raise
        print(f"{prog}: error: this needs {missing}, which is not installed: {EXTRAS[missing]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted" + (f" ({interrupted})" if interrupted else ""), file=sys.stderr)
        return 130
