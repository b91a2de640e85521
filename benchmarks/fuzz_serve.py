"""clover-serve fuzzed from its own OpenAPI schema (schemathesis + hypothesis), in process, on the tiny test artifact
(or --artifact): every operation, the model name set to the served one so cases reach the engine, with and without
an API key. Fails on any 5xx other than 503 with Retry-After, a case over --case-seconds, or /health not 200 after a
case. Prints the status codes per operation and writes JSON (default benchmarks/results/fuzz_serve.json).
`tests/serve/test_fuzz.py` runs the same with 100 cases per operation.

    python benchmarks/fuzz_serve.py [--examples 2000] [--artifact DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

from clover.runtime.params import EngineOptions

MODEL = "tiny"


def fuzz(
    app, examples: int, headers: dict[str, str] | None = None, case_seconds: float = 10.0, model: str = MODEL
) -> dict[tuple[str, str], list[int]]:
    """Every operation of `app`'s schema, `examples` cases each; returns the status codes seen per operation."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from starlette.testclient import TestClient

    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    health = TestClient(app)
    seen: dict[tuple[str, str], list[int]] = {}
    for result in schema.get_all_operations():
        op = result.ok()

        @given(case=op.as_strategy())
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def run(case):
            if isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = model
            t0 = time.perf_counter()
            r = case.call(headers=headers)
            took = time.perf_counter() - t0
            seen.setdefault((op.method.upper(), op.path), []).append(r.status_code)
            assert r.status_code < 500 or (r.status_code == 503 and "retry-after" in r.headers), (
                case.body,
                r.status_code,
                r.text[:300],
            )
            assert took < case_seconds, (case.body, took)
            assert health.get("/health").status_code == 200, case.body

        run()
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=2000, help="cases per operation (default 2000)")
    ap.add_argument(
        "--artifact", type=Path, default=None, help="default: the tiny test artifact, made in a temp folder"
    )
    ap.add_argument("--case-seconds", type=float, default=10.0)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "fuzz_serve.json")
    args = ap.parse_args(argv)
    from clover import atomic
    from clover.runtime.engine import Engine
    from clover.serve.app import AppOptions, create_app
    from clover.serve.limits import RequestLimits
    from clover.tools.machine import host

    with tempfile.TemporaryDirectory() as tmp:
        artifact = args.artifact
        if artifact is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from ort_helpers import tiny_artifact

            artifact = tiny_artifact(Path(tmp), "clover2", attention="fused")
        rows = []
        for key in (None, "sesame"):
            engine = Engine.load(artifact, tree="auto", log=None, options=EngineOptions(max_batch=4))
            try:
                app = create_app(
                    engine, MODEL, AppOptions(api_key=key, warmup=False, limits=RequestLimits(allow_ignore_eos=True))
                )
                t0 = time.perf_counter()
                seen = fuzz(
                    app, args.examples, None if key is None else {"authorization": f"Bearer {key}"}, args.case_seconds
                )
                seconds = time.perf_counter() - t0
            finally:
                engine.close(timeout=10)
            for (method, path), codes in sorted(seen.items()):
                rows.append(
                    {
                        "key": key is not None,
                        "operation": f"{method} {path}",
                        "cases": len(codes),
                        "codes": dict(sorted(collections.Counter(codes).items())),
                        "seconds": round(seconds, 1),
                    }
                )
    print(f"{'key':<5}{'operation':<28}{'cases':>7}  status codes")
    for r in rows:
        print(f"{'yes' if r['key'] else 'no':<5}{r['operation']:<28}{r['cases']:>7}  {r['codes']}")
    doc = {
        "host": host(),
        "examples_per_operation": args.examples,
        "rows": rows,
        "note": "no 5xx other than 503 with Retry-After, every case within case_seconds, /health 200 after each",
    }
    atomic.write_text(args.json, json.dumps(doc, indent=1, default=str) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
