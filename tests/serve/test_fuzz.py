"""clover-serve fuzzed from its own OpenAPI schema (schemathesis + hypothesis): cases generated for every operation,
the model name set to the served one (so they reach the engine), with and without an API key. No case gets a 5xx
other than 503 with Retry-After, every case ends within a bound, and /health stays 200 after every one. A longer
campaign: benchmarks/fuzz_serve.py. Beside it, valid bodies with a lone surrogate in a random text field (hypothesis;
schemathesis' text never holds one): each a 400 naming that field."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import strategies as st
from ort_helpers import tiny_artifact

from clover.runtime.engine import Engine
from clover.runtime.params import EngineOptions
from clover.serve.app import AppOptions, create_app
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
    engine = Engine.load(artifact, tree="chain-2", log=None, options=EngineOptions(max_batch=4))
    try:
        app = create_app(
            engine, MODEL, AppOptions(api_key=key, warmup=False, limits=RequestLimits(allow_ignore_eos=True))
        )
        seen = fuzz(app, EXAMPLES, None if key is None else {"authorization": f"Bearer {key}"}, CASE_SECONDS)
        posts = seen[("POST", "/v1/chat/completions")] + seen[("POST", "/v1/completions")]
        assert 200 in posts and 400 in posts, seen  # the cases reach the engine, and bad ones are refused
        if key is not None:  # and without the key nothing gets past the guard
            assert set(fuzz(app, 10, None, CASE_SECONDS).get(("POST", "/v1/completions"), [])) == {401}
        assert engine.alive
    finally:
        engine.close(timeout=10)


# -- text that is not valid Unicode, in random text fields of otherwise valid bodies ---------------------------------
SURROGATE_EXAMPLES = 40
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w10 w11"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "w10 w11", "max_tokens": 2}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "description": "d", "schema": {"enum": ["w1", "w2"]}}}
# fields either route takes (where the text goes: a path into the body), and each route's own
SHARED = [
    ({"model": MODEL}, ("model",)),
    ({"user": "u"}, ("user",)),
    ({"stop": "w3"}, ("stop",)),
    ({"stop": ["w3", "w4"]}, ("stop", 1)),
    ({"metadata": {"k": "v", "k2": "v2"}}, ("metadata", "k2")),
    ({"service_tier": "auto"}, ("service_tier",)),
    ({"prompt_cache_key": "p"}, ("prompt_cache_key",)),
    ({"safety_identifier": "s"}, ("safety_identifier",)),
    ({"guided_regex": "w[0-9]"}, ("guided_regex",)),
    ({"guided_choice": ["w1", "w2"]}, ("guided_choice", 0)),
    ({"guided_json": {"type": "object", "title": "t"}}, ("guided_json", "title")),
    ({"response_format": SCHEMA}, ("response_format", "json_schema", "description")),
    ({"response_format": SCHEMA}, ("response_format", "json_schema", "schema", "enum", 1)),
]
OWN = {
    "/v1/chat/completions": [
        ({}, ("messages", 0, "content")),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "w1"}]}]},
            ("messages", 0, "content", 0, "text"),
        ),
        (
            {"messages": [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2"}]},
            ("messages", 1, "content"),
        ),
    ],
    "/v1/completions": [({}, ("prompt",)), ({"prompt": ["w10 w11"]}, ("prompt", 0))],
}
# hypothesis's text has no surrogates: the one put in is lone (a high one before a low one would make a pair)
LONE = st.tuples(st.text(max_size=8), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), st.text(max_size=8))


@st.composite
def poisoned(draw) -> tuple[str, bytes, str]:
    """(route, body, the param its answer must name): a valid body with a lone surrogate in one text field (or in a
    field's name), sent as a \\u escape, as its raw bytes, or as a byte that is not UTF-8 (0xFF)."""
    route = draw(st.sampled_from(sorted(OWN)))
    extra, path = draw(st.sampled_from(OWN[route] + SHARED))
    body = copy.deepcopy({**(CHAT if route.endswith("chat/completions") else COMPLETION), **extra})
    before, surrogate, after = draw(LONE)
    sent = draw(st.sampled_from(["escape", "bytes", "not utf-8"]))
    seen = before + ("\udcff" if sent == "not utf-8" else surrogate) + after  # the text the server reads
    holder = body
    for step in path[:-1]:
        holder = holder[step]
    if isinstance(path[-1], str) and draw(st.booleans()):  # in the field's name
        holder[before + surrogate + after] = holder.pop(path[-1])
        path = (*path[:-1], seen.encode("utf-8", "backslashreplace").decode())
    else:
        holder[path[-1]] = before + surrogate + after
    body["stream"] = draw(st.booleans())
    if sent == "escape":
        content = json.dumps(body).encode()
    else:
        content = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
        if sent == "not utf-8":
            content = content.replace(surrogate.encode("utf-8", "surrogatepass"), b"\xff")
    return route, content, ".".join(map(str, path))


def test_text_that_is_not_valid_unicode_is_always_400_naming_its_field(artifact):
    """Every body with a lone surrogate (or a byte that is not UTF-8) in a random text field: 400 in OpenAI's shape,
    its param the field; in process, and the server serves the next request."""
    from hypothesis import HealthCheck, given, settings
    from starlette.testclient import TestClient

    engine = Engine.load(artifact, tree="chain-2", log=None, options=EngineOptions(max_batch=4))
    try:
        with TestClient(create_app(engine, MODEL, AppOptions(warmup=False))) as client:

            @given(case=poisoned())
            @settings(
                max_examples=SURROGATE_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
            )
            def run(case):
                route, content, param = case
                r = client.post(route, content=content, headers={"content-type": "application/json"})
                assert r.status_code == 400 and r.headers["content-type"] == "application/json", (case, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
                assert err["param"] == param and err["message"].startswith(f"{param}: "), (case, r.text)

            run()
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
            assert client.get("/health").status_code == 200
        assert engine.alive
    finally:
        engine.close(timeout=10)
