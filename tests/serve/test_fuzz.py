"""clover-serve fuzzed from its own OpenAPI schema (schemathesis + hypothesis): cases generated for every operation,
the model name set to the served one (so they reach the engine), with and without an API key. No case gets a 5xx
other than 503 with Retry-After, every case ends within a bound, and /health stays 200 after every one. A longer
campaign: benchmarks/fuzz_serve.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from ort_helpers import tiny_artifact

from clover.runtime.engine import Engine
from clover.serve.app import create_app
from clover.serve.limits import RequestLimits

_spec = importlib.util.spec_from_file_location(
    "fuzz_serve", Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz_serve.py"
)
fuzz_serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz_serve)
fuzz, MODEL = fuzz_serve.fuzz, fuzz_serve.MODEL
EXAMPLES = 100  # per operation (two POST operations reach the engine)
CASE_SECONDS = 30.0  # a hang's bound, with room for a 2-core machine busy with other tests


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", attention="fused")


@pytest.mark.parametrize("key", [None, "sesame"])
def test_fuzzed_requests_never_break_the_server(artifact, key):
    engine = Engine.load(artifact, tree="chain-2", max_batch=4, log=None)
    try:
        app = create_app(engine, MODEL, api_key=key, warmup=False, limits=RequestLimits(allow_ignore_eos=True))
        seen = fuzz(app, EXAMPLES, None if key is None else {"authorization": f"Bearer {key}"}, CASE_SECONDS)
        posts = seen[("POST", "/v1/chat/completions")] + seen[("POST", "/v1/completions")]
        assert 200 in posts and 400 in posts, seen  # the cases reach the engine, and bad ones are refused
        if key is not None:  # and without the key nothing gets past the guard
            assert set(fuzz(app, 10, None, CASE_SECONDS).get(("POST", "/v1/completions"), [])) == {401}
        assert engine.alive
    finally:
        engine.close(timeout=10)
