"""clover-compare: run each graph of an artifact on the same seeded inputs through PyTorch, ONNX Runtime and
TensorRT (Polygraphy's runners and Comparator) and report each output's error against the first backend.

Exit codes: 0 every output within tolerance, 1 a mismatch (the first is named on stderr), 2 a user error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from clover.errors import CloverError
from clover.tools.cli import run_cli

BACKENDS = ("torch", "ort", "trt")  # clover.export.compare.BACKENDS (that module imports torch)
KV_OUTPUTS = "present.*"  # the table folds the KV outputs of a graph into one row; --json keeps each


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clover-compare",
        description="Run every graph of a clover-export artifact (the base at a prefill and at a tree verify, the "
        "draft graphs) on the same seeded inputs through PyTorch, ONNX Runtime and TensorRT (where "
        "present), with Polygraphy, and report max and mean absolute and relative error per output. "
        "Exits 1 on a mismatch.",
    )
    p.add_argument("artifact", type=Path, help="artifact folder written by clover-export")
    p.add_argument(
        "--backends",
        default=None,
        help="comma-separated, the first is the reference: torch, ort, trt (default: torch,ort, and trt "
        "when the artifact has engines; a backend that cannot run here is reported, not fatal)",
    )
    p.add_argument(
        "--atol",
        type=float,
        default=None,
        help="absolute tolerance on max |a - ref| (replaces the export's; alone: only it counts)",
    )
    p.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="tolerance on max |a - ref| / max |ref|, relative to each output's largest reference value "
        "(replaces the export's; alone: only it counts)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write every row as JSON to PATH")
    return p


def parse_backends(spec: str | None) -> tuple[str, ...] | None:
    if spec is None:
        return None
    names = tuple(b.strip() for b in spec.split(",") if b.strip())
    for b in names:
        if b not in BACKENDS:
            raise CloverError(
                f"unknown backend {b!r} in --backends {spec}: choose from {', '.join(BACKENDS)} "
                "(comma-separated, the first is the reference)"
            )
    if len(set(names)) != len(names) or len(names) < 2:
        raise CloverError(
            f"--backends {spec}: name two or more distinct backends of {', '.join(BACKENDS)}, e.g. --backends torch,ort"
        )
    return names


def run(args: argparse.Namespace) -> int:
    backends = parse_backends(args.backends)  # the cheap checks first: loading takes a while
    if not args.artifact.is_dir():
        raise CloverError(f"artifact {args.artifact} does not exist: pass a folder written by clover-export")
    from clover.artifact import read_manifest

    manifest = read_manifest(args.artifact)
    if backends is None:
        backends = ("torch", "ort", "trt") if manifest.engines else ("torch", "ort")
    from clover.export.compare import Tolerance, compare_artifact  # imports torch and Polygraphy

    tolerance = None
    if args.atol is not None or args.rtol is not None:
        tolerance = Tolerance(args.atol or 0.0, args.rtol or 0.0, "--atol/--rtol")
    result = compare_artifact(
        args.artifact,
        backends,
        tolerance,
        args.seed,
        say=lambda msg: print(f"clover-compare: {msg}", file=sys.stderr, flush=True),
    )
    for backend, why in result.unavailable.items():
        print(f"{backend}: not available: {why}")
    for note in result.notes:
        print(f"note: {note}")
    print_table(result.rows)
    if args.json is not None:
        from clover.atomic import write_text

        write_text(args.json, json.dumps(result.to_dict(), indent=1))
    failures = result.failures
    if not failures:
        print(
            f"clover-compare: {len(result.rows)} outputs of {' and '.join(result.backends[1:])} within tolerance of "
            f"{result.backends[0]}",
            file=sys.stderr,
        )
        return 0
    r = failures[0]
    found = r.note or f"max abs {r.max_abs:.3g}, max rel {r.max_rel:.3g}"
    print(
        f"clover-compare: mismatch: {r.graph} output {r.output} ({r.backend} vs {r.reference}): {found}, beyond atol "
        f"{r.tolerance.atol:g} / rtol {r.tolerance.rtol:g}"
        + (f"; {len(failures)} outputs fail" if len(failures) > 1 else ""),
        file=sys.stderr,
    )
    return 1


def table_rows(rows) -> list[dict]:
    """One dict per printed row: each output, the KV outputs of a graph and backend folded into one."""
    out, kv = [], {}
    for r in rows:
        d = dict(
            graph=r.graph,
            output=r.output,
            backends=f"{r.backend} vs {r.reference}",
            max_abs=r.max_abs,
            mean_abs=r.mean_abs,
            max_rel=r.max_rel,
            mean_rel=r.mean_rel,
            tol=tol_text(r.tolerance),
            passed=r.passed,
            count=1,
        )
        if not r.output.startswith("present."):
            out.append(d)
            continue
        key = (r.graph, d["backends"])
        if key not in kv:
            kv[key] = dict(d, output=KV_OUTPUTS)
            out.append(kv[key])
            continue
        folded = kv[key]
        n = folded["count"]
        folded.update(
            max_abs=max(folded["max_abs"], r.max_abs),
            max_rel=max(folded["max_rel"], r.max_rel),
            mean_abs=(folded["mean_abs"] * n + r.mean_abs) / (n + 1),
            mean_rel=(folded["mean_rel"] * n + r.mean_rel) / (n + 1),
            passed=folded["passed"] and r.passed,
            count=n + 1,
        )
    for d in kv.values():
        d["output"] = f"{KV_OUTPUTS} ({d['count']})"
    return out


def tol_text(t) -> str:
    return f"{t.atol:.0e}" if t.atol == t.rtol else f"{t.atol:.0e}/{t.rtol:.0e}"


def num(x: float) -> str:
    return f"{x:9.2e}" if math.isfinite(x) else f"{x!s:>9}"


def print_table(rows) -> None:
    shown = table_rows(rows)
    gw = max([len("graph")] + [len(d["graph"]) for d in shown])
    ow = max([len("output")] + [len(d["output"]) for d in shown])
    bw = max([len("backends")] + [len(d["backends"]) for d in shown])
    head = (
        f"{'graph':{gw}}  {'output':{ow}}  {'backends':{bw}}  {'max abs':>9}  {'mean abs':>9}  {'max rel':>9}  "
        f"{'mean rel':>9}  {'tol':>11}  result"
    )
    print(head)
    print("-" * len(head))
    for d in shown:
        print(
            f"{d['graph']:{gw}}  {d['output']:{ow}}  {d['backends']:{bw}}  {num(d['max_abs'])}  {num(d['mean_abs'])}  "
            f"{num(d['max_rel'])}  {num(d['mean_rel'])}  {d['tol']:>11}  {'pass' if d['passed'] else 'FAIL'}"
        )
    tolerances = ", ".join(
        dict.fromkeys(f"{tol_text(r.tolerance)} ({r.tolerance.why})" for r in rows if r.tolerance.why)
    )
    print(
        "abs = |a - ref|, rel = |a - ref| / max |ref| (the output's largest reference value); pass: max abs <= atol "
        "or max rel <= rtol (tol: atol = rtol, or atol/rtol" + (f"; {tolerances}" if tolerances else "") + ")"
    )


def main(argv: list[str] | None = None) -> int:
    return run_cli("clover-compare", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
