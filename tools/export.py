"""clover-export: export a base model and draft heads to an artifact directory (ONNX graphs + manifest)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from clover.tools.cli import run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clover-export",
        description="Export a base model and Clover draft heads to ONNX graphs in one artifact directory "
                    "(run it with clover-generate --artifact DIR --backend ort).",
    )
    p.add_argument("--base", default="smollm2", help="Hugging Face model folder, or 'smollm2' (embedded default)")
    p.add_argument("--heads", default="none",
                   help="head checkpoint folder, random:ARCH[:SEED] (medusa, clover, clover2), or none (plain decoding)")
    p.add_argument("--out", required=True, type=Path,
                   help="artifact folder to write (new, empty, or an artifact to replace)")
    p.add_argument("--backend", default="onnx", help="onnx (TensorRT engines are not supported yet)")
    p.add_argument("--tree", default=None,
                   help="default token tree recorded in the artifact (default: mc26, pruned to the heads' depth)")
    p.add_argument("--dtype", default="float32", help="float32 or float16")
    p.add_argument("--max-context", type=int, default=None,
                   help="longest sequence the artifact serves (default: the base's max_position_embeddings)")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default 20)")
    p.add_argument("--no-verify", action="store_true", help="skip the export-time ONNX Runtime vs PyTorch parity check")
    return p


def run(args: argparse.Namespace) -> int:
    from clover.export.config import DEFAULT_OPSET, ExportConfig

    config = ExportConfig(backend=args.backend, dtype=args.dtype, opset=args.opset or DEFAULT_OPSET, tree=args.tree,
                          max_context=args.max_context, verify=not args.no_verify)
    from clover.export.artifact import export_artifact  # imports torch: after the cheap checks

    start = time.perf_counter()
    out = export_artifact(args.base, args.heads, args.out, config,
                          progress=lambda msg: print(f"clover-export: {msg}", file=sys.stderr, flush=True))
    print(f"clover-export: done in {time.perf_counter() - start:.0f} s; run it with: clover-generate --artifact {out} "
          "--backend ort --prompt ...", file=sys.stderr)
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("clover-export", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
