"""clover-serve for real: uvicorn on 127.0.0.1 (a free port) over a clover.Engine on a tiny fused artifact, driven
by the official `openai` client (sync and async, streaming and not) and by raw HTTP for malformed requests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from helpers import Server, rss_bytes, script_module
from ort_helpers import tiny_artifact

from clover.runtime.backends.ort import load_runner
from clover.runtime.engine import Engine
from clover.runtime.generator import Generator
from clover.runtime.params import EngineOptions, GenerationParams
from clover.runtime.tokenizer import Tokenizer
from clover.tools.serve import free_port, wait_healthy

openai = pytest.importorskip("openai")

MODEL = "tiny"
PROMPTS = [f"w{10 + i} w{20 + (i * 7) % 60} w30 w{40 + i}" for i in range(16)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", attention="fused")


@pytest.fixture(scope="module")
def server(artifact):
    engine = Engine.load(artifact, tree="auto", log=None, options=EngineOptions(max_batch=4, max_waiting=64))
    s = Server(engine, MODEL)
    yield s
    s.close()
    engine.close()


@pytest.fixture(scope="module")
def solo(artifact):
    """Plain greedy decoding of each prompt alone (same graphs): what every greedy request must return."""
    gen = Generator(load_runner(artifact, heads="none"), Tokenizer.from_dir(artifact / "tokenizer"), "plain")
    return lambda prompt, chat=True, **kw: gen.generate(
        [{"role": "user", "content": prompt}] if chat else prompt,
        GenerationParams(max_new_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw),
    )


def client(server, **kw):
    return openai.OpenAI(base_url=server.url, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def test_chat_and_completion_equal_solo_plain_with_exact_usage(server, solo):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0, max_tokens=MAX_TOKENS
    )
    want = solo(PROMPTS[0])
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.prompt_tokens, want.new_tokens)
    assert r.usage.total_tokens == want.prompt_tokens + want.new_tokens
    spec = r.model_extra["clover"]
    assert spec["steps"] >= 1 and spec["acceptance_length"] >= 1 and spec["accepted_tokens"] <= spec["drafted_tokens"]
    r = c.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=0, max_tokens=MAX_TOKENS)
    want = solo(PROMPTS[1], chat=False)
    assert r.choices[0].text == want.text and r.usage.completion_tokens == want.new_tokens


def test_sixteen_concurrent_greedy_requests_each_equal_their_solo_decoding(server, solo):
    async def main():
        c = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
        return await asyncio.gather(
            *(
                c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=MAX_TOKENS
                )
                for p in PROMPTS
            )
        )

    got = asyncio.run(main())
    for p, r in zip(PROMPTS, got):
        assert r.choices[0].message.content == solo(p).text, p


def test_streaming_adds_up_with_usage_and_stop_strings_never_leak(server, solo):
    c = client(server)
    want = solo(PROMPTS[2])
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPTS[2]}],
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
        "length" if want.finish_reason == "length" else "stop"
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.new_tokens
    # a stop string from the middle of the output: cut before it, never sent, counted exactly
    words = want.text.split()
    stop = " " + words[len(words) // 2]
    cut = solo(PROMPTS[2], stop=[stop])
    assert stop not in cut.text and want.text.startswith(cut.text)
    for stream in (False, True):
        r = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPTS[2]}],
            temperature=0,
            max_tokens=MAX_TOKENS,
            stop=stop,
            stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )
        if stream:
            parts = list(r)
            got = "".join(ch.choices[0].delta.content or "" for ch in parts if ch.choices)
            tokens, reason = (
                parts[-1].usage.completion_tokens,
                [ch.choices[0].finish_reason for ch in parts if ch.choices][-1],
            )
        else:
            got, tokens, reason = r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason
        assert (got, tokens, reason) == (cut.text, cut.new_tokens, "stop")


def test_seeded_sampling_is_reproducible(server):
    c = client(server)
    ask = lambda seed: (
        c.completions.create(model=MODEL, prompt=PROMPTS[3], temperature=0.9, top_p=0.95, seed=seed, max_tokens=12)
        .choices[0]
        .text
    )
    assert ask(7) == ask(7)


def test_n_choices_and_best_of_through_the_openai_client(server, solo):
    """n choices are separate sequences of the batch: greedy ones each equal solo plain decoding, seeded sampled
    choice i equals a lone request seeded seed + i, streamed chunks carry their choice's index; usage counts the
    prompt once and every candidate's tokens; best_of returns the candidate of highest mean log-probability."""
    c = client(server)
    msgs = [{"role": "user", "content": PROMPTS[2]}]
    want = solo(PROMPTS[2])
    r = c.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=MAX_TOKENS, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert all(ch.message.content == want.text for ch in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.prompt_tokens, 3 * want.new_tokens)
    sampled = dict(temperature=2.0, max_tokens=12, seed=41, logit_bias={"44": -100})  # the prompt ends with w44
    r = c.completions.create(model=MODEL, prompt=PROMPTS[4], n=3, **sampled)
    alone = [
        c.completions.create(model=MODEL, prompt=PROMPTS[4], **{**sampled, "seed": 41 + i}).choices[0].text
        for i in range(3)
    ]
    assert [ch.text for ch in r.choices] == alone and len(set(alone)) > 1, alone
    texts = ["", "", ""]
    for chunk in c.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=MAX_TOKENS, n=3, stream=True, logprobs=True
    ):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [want.text] * 3
    # best_of: the candidate whose tokens have the highest mean log-probability, without logprobs asked for
    r = c.completions.create(model=MODEL, prompt=PROMPTS[4], best_of=3, **sampled)
    scored = []
    for i in range(3):
        one = c.completions.create(model=MODEL, prompt=PROMPTS[4], logprobs=0, **{**sampled, "seed": 41 + i})
        lps = one.choices[0].logprobs.token_logprobs
        scored.append((sum(lps) / len(lps), one.choices[0].text))
    assert len(r.choices) == 1 and r.choices[0].text == max(scored)[1] and r.choices[0].logprobs is None
    assert r.usage.completion_tokens >= 12  # every candidate's tokens


def test_bad_requests_get_their_status_and_the_server_keeps_serving(server, artifact):
    base = server.url
    post = lambda path, body, **kw: httpx.post(
        base + path,
        content=body if isinstance(body, str) else json.dumps(body),
        headers={"content-type": "application/json"},
        timeout=10,
        **kw,
    )
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "w10"}], "max_tokens": 4}
    cases = [
        ("/chat/completions", "{not json", 400, None),
        ("/chat/completions", {**chat, "temperature": -1}, 400, "temperature"),
        ("/chat/completions", {**chat, "n": 0}, 400, "n"),
        ("/chat/completions", {**chat, "messages": []}, 400, "messages"),
        ("/chat/completions", {**chat, "messages": [{"role": "robot", "content": "x"}]}, 400, None),
        ("/chat/completions", {**chat, "max_tokens": 0}, 400, "max_tokens"),
        ("/chat/completions", {**chat, "model": "gpt-9"}, 404, "model"),
        ("/chat/completions", {**chat, "messages": [{"role": "user", "content": "w7 " * 400}]}, 400, "messages"),
        ("/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
        ("/completions", {"model": MODEL, "prompt": ["w1"] * 65}, 400, "prompt"),  # over 64 prompts
    ]
    for path, body, status, param in cases:
        r = post(path, body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["message"] and "\n" not in err["message"] and err["type"], r.text
        if param:
            assert err["param"] == param, r.text
    assert "context" in post("/chat/completions", cases[7][1]).json()["error"]["message"]
    assert httpx.get(base + "/nothing", timeout=5).status_code == 404
    # still serving
    r = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w10 w11"}], max_tokens=4
    )
    assert r.choices[0].message.content is not None


def test_text_that_is_not_valid_unicode_is_400_naming_its_field(server):
    """A lone surrogate (a JSON \\ud800 escape with no partner, or its bytes sent raw) or bytes that are not UTF-8,
    in any text field: 400 in OpenAI's shape naming the field, however deep (it reached the tokenizer and answered
    500 in plain text). A surrogate pair is one character and is served; so is the next request."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "w10"}], "max_tokens": 4}
    comp = {"model": MODEL, "prompt": "w10", "max_tokens": 4}
    schema = {"name": "x", "schema": {"type": "string", "enum": ["w1"]}}
    lone, low = "\ud800", "\udfff"  # json.dumps writes them as \u escapes, as a client's encoder does
    parts = [{"type": "text", "text": "w2"}, {"type": "text", "text": low}]
    cases = [  # (the body, the param)
        ({**chat, "messages": [{"role": "user", "content": f"w10 {lone} w11"}]}, "messages.0.content"),
        (
            {**chat, "messages": [{"role": "system", "content": "w1"}, {"role": "user", "content": parts}]},
            "messages.1.content.1.text",
        ),
        ({**chat, "messages": [{"role": "user", "content": "\ude00\ud83d"}]}, "messages.0.content"),  # reversed pair
        ({**comp, "prompt": f"w10 {lone}"}, "prompt"),
        ({**comp, "prompt": [f"w10 {low}"]}, "prompt.0"),
        ({**comp, "stop": lone}, "stop"),
        ({**comp, "stop": ["w3", f"w{lone}"]}, "stop.1"),
        ({**comp, "user": f"u{lone}"}, "user"),
        ({**chat, "safety_identifier": low}, "safety_identifier"),
        ({**chat, "prompt_cache_key": lone}, "prompt_cache_key"),
        ({**chat, "metadata": {"k": lone}}, "metadata.k"),
        ({**chat, "metadata": {f"k{lone}": "v"}}, "metadata.k\\ud800"),  # a name: \u-escaped in the param
        ({**chat, "model": f"{MODEL}{lone}"}, "model"),  # a 400, not a 404 that would echo it
        ({**comp, "guided_choice": ["w1", lone]}, "guided_choice.1"),
        (
            {**chat, "response_format": {"type": "json_schema", "json_schema": {**schema, "description": lone}}},
            "response_format.json_schema.description",
        ),
        (
            {
                **chat,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [low]}}},
            },
            "response_format.json_schema.schema.enum.0",
        ),
        ({**comp, "prompt": f"w10 {lone}", "stream": True}, "prompt"),  # refused before any event
    ]
    post = lambda path, content: httpx.post(  # noqa: E731
        server.url + path, content=content, headers={"content-type": "application/json"}, timeout=10
    )
    for body, param in cases:
        path = "/chat/completions" if "messages" in body else "/completions"
        # \u escapes (ASCII), and the surrogate's own three bytes (which Python's JSON parser reads as one)
        for content in (json.dumps(body), json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")):
            r = post(path, content)
            assert r.status_code == 400 and r.headers["content-type"] == "application/json", (param, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] is None, r.text
            assert err["message"].startswith(f"{param}: ") and "not valid Unicode" in err["message"], r.text
    # bytes that are not UTF-8 at all: the field that holds them where the rest is JSON, else no field
    for raw, param in (
        (b'{"model": "tiny", "prompt": "w10 \xff", "max_tokens": 4}', "prompt"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "w1 \xc3("}]}', "messages.0.content"),
        (b'{"model": "tiny", "prompt": "w10 \xff"', None),
    ):
        r = post("/chat/completions" if b"messages" in raw else "/completions", raw)
        assert r.status_code == 400 and "not valid UTF-8" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == param, r.text
    # a pair is one character (U+1F600): served, and so is an ordinary request after all of the above
    r = post("/completions", json.dumps({**comp, "prompt": "w10 \U0001f600 w11"}))
    assert r.status_code == 200 and isinstance(r.json()["choices"][0]["text"], str), r.text
    r = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w10 w11"}], max_tokens=4
    )
    assert r.choices[0].message.content is not None
    assert httpx.get(server.url.removesuffix("/v1") + "/health", timeout=5).status_code == 200


def test_bad_ids_and_lengths_are_400_while_a_canary_streams_and_health_stays_ok(server, solo):
    """The rows the trusted servers answer with 400 (vLLM, llama.cpp): token ids outside the vocabulary, negative,
    past int64; max_tokens past the context; and abuse: 10,000 stop strings, a 50 MB body, JSON nested 100,000 deep,
    100,000 messages (over the body limit) and 20,000 (past the context). Each is refused within a second before it
    reaches the engine, memory stays put, a request streaming meanwhile gets its solo text and /health stays 200."""
    import threading

    base = server.url
    post = lambda body: httpx.post(base + "/completions", json=body, timeout=10)  # noqa: E731
    got = {}

    def canary():
        stream = client(server).chat.completions.create(  # long enough to outlast the abuse below
            model=MODEL,
            messages=[{"role": "user", "content": PROMPTS[5]}],
            temperature=0,
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        got["text"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    t = threading.Thread(target=canary)
    t.start()
    while not server.engine.scheduler.running and t.is_alive():  # the canary is decoding before the abuse starts
        time.sleep(0.005)
    for prompt in ([1, 2, 99999999], [-5, 3], [9223372036854775808], [1, 2, 96]):
        r = post({"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 400, (prompt, r.text)
        err = r.json()["error"]
        assert err["param"] == "prompt" and "vocabulary" in err["message"], r.text
        assert "Gather" not in err["message"] and "node_" not in err["message"], r.text  # no backend internals
    for limit in (10**6, 10**30, 1e30):  # past the context (the engine says so), past what a field holds (pydantic)
        r = post({"model": MODEL, "prompt": "w10 w11", "max_tokens": limit})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert limit != 10**6 or "context" in r.json()["error"]["message"], r.text
    rss = rss_bytes()  # the bodies come from another process: a client's copies of them must not count here
    out = subprocess.run(
        [sys.executable, "-c", ABUSER, server.url, MODEL, "once"], capture_output=True, text=True, timeout=120
    )
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert [a["status"] for a in answers] == [400, 400, 400, 413, 400, 413, 400, 400], out.stdout + out.stderr
    for a in answers:
        assert a["message"] and a["seconds"] < 1.0, a
    assert rss_bytes() - rss < 100 * 2**20  # not even one copy of the 50 MB body, nor the parse of a refused one
    assert t.is_alive() or len(got.get("text", "")) > 0  # it decoded through the abuse (or just finished)
    t.join(timeout=60)
    assert not t.is_alive() and got["text"] == solo(PROMPTS[5], max_tokens=200, ignore_eos=True).text
    health = httpx.get(base.removesuffix("/v1") + "/health", timeout=5)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert httpx.head(base.removesuffix("/v1") + "/health", timeout=5).status_code == 200  # a load balancer's probe


# The abuse cases, sent from their own process (benchmarks/serve_load.py --abuse measures a canary beside them).
with script_module(Path(__file__).parents[2] / "benchmarks" / "serve_load.py") as _serve_load:
    ABUSER = _serve_load.ABUSER


def test_a_canary_keeps_its_inter_token_p99_while_abuse_is_refused(server, solo):
    """A streaming request's gaps between chunks (p99 over 3 runs of 200 tokens) while another process sends the
    abuse cases in a loop, interleaved with 3 runs alone: its text is its solo text, every abuse case gets its 4xx, and
    no gap comes near a stalled event loop (100 ms beside abuse, over 10x its gaps alone: work that belongs off the
    loop, such as tokenizing or templating a huge prompt, stalls it for hundreds of ms). The pauses of parsing a
    refused ~1 MB body (json and pydantic, C calls that hold the GIL, 10-30 ms on 2 shared cores: no Python server
    avoids them in-process) are not bounded tighter here: how tight they are is a measurement, and measurements of
    speed belong in benchmarks/ (serve_load.py --abuse), where noise is controlled and reported, not in a unit test."""
    import numpy as np

    def canary_gaps() -> list[float]:
        stream = client(server).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPTS[6]}],
            temperature=0,
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        times, text = [], ""
        for c in stream:
            times.append(time.perf_counter())
            text += c.choices[0].delta.content or "" if c.choices else ""
        assert text == solo(PROMPTS[6], max_tokens=200, ignore_eos=True).text
        return list(np.diff(times))

    alone, beside, codes = [], [], []
    for _ in range(3):  # interleaved: whatever else loads the machine weighs on both alike
        alone += canary_gaps()
        abuser = subprocess.Popen(
            [sys.executable, "-c", ABUSER, server.url, MODEL, "loop"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert abuser.stdout.readline()  # the loop under way
            beside += canary_gaps()
        finally:
            out, _ = abuser.communicate("", timeout=60)
        codes += out.split()
    assert len(codes) >= 7 and set(codes) <= {"400", "413"}, codes
    alone, beside = np.percentile(alone, 99), np.percentile(beside, 99)
    assert beside <= 0.100 and alone <= 0.020, (
        f"inter-token p99 {beside * 1e3:.1f} ms beside abuse, {alone * 1e3:.1f} ms alone"
    )


def test_request_limits_stop_strings_ignore_eos_prompt_and_max_tokens(artifact):
    from clover.serve.limits import RequestLimits

    engine = Engine.load(artifact, tree="chain-2", log=None, options=EngineOptions(max_batch=2))
    s = Server(
        engine,
        MODEL,
        limits=RequestLimits(
            max_stop_strings=2,
            max_stop_chars=8,
            max_input_tokens=6,
            max_tokens_cap=5,
            max_messages=2,
            max_prompt_chars=30,
        ),
    )
    post = lambda body: httpx.post(
        s.url + "/completions",
        json={
            "model": MODEL,
            "prompt": "w10",
            "max_tokens": 4,  # noqa: E731
            **body,
        },
        timeout=10,
    )
    try:
        for body, words in (
            ({"stop": ["w1", "w2", "w3"]}, "at most 2"),
            ({"stop": "w" * 9}, "at most 8"),
            ({"stop": ["w"] * 10_000}, "at most 2"),
            ({"ignore_eos": True}, "--allow-ignore-eos"),
        ):
            r = post(body)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == ("ignore_eos" if "ignore_eos" in body else "stop")
        assert post({"stop": ["w1", "w" * 8]}).status_code == 200
        r = post({"prompt": "w10 w11 w12 w13 w14 w15 w16"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "at most 6" in r.text, r.text
        r = post({"max_tokens": 6})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and "at most 5" in r.text, r.text
        capped = httpx.post(
            s.url + "/chat/completions",
            json={
                "model": MODEL,
                "messages": [  # no max_tokens: the cap
                    {"role": "user", "content": "w10"}
                ],
            },
            timeout=10,
        )
        assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] <= 5, capped.text
        chat = lambda messages: httpx.post(
            s.url + "/chat/completions",
            timeout=10,
            json={  # noqa: E731
                "model": MODEL,
                "messages": [{"role": "user", "content": m} for m in messages],
                "max_tokens": 2,
            },
        )
        for r, param, words in (
            (chat(["w10"] * 3), "messages", "3 messages: this server takes at most 2"),
            (chat(["w10 " * 4, "w11 " * 4]), "messages", "32 characters"),
            (post({"prompt": "w1 " * 11}), "prompt", "33 characters"),
        ):
            assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.text, r.text
    finally:
        s.close()
        engine.close(timeout=5)


def test_key_and_body_size_are_refused_before_the_body_is_read(artifact):
    """A 50 MB body without the key: 401 from the headers alone; with the key, 413 by its Content-Length; a chunked
    body is cut off at the limit; deep JSON within the limit is a 400. The server keeps serving."""
    from clover.serve.limits import RequestLimits

    engine = Engine.load(artifact, tree="chain-2", log=None, options=EngineOptions(max_batch=2))
    s = Server(engine, MODEL, api_key="sesame", limits=RequestLimits(max_body_bytes=64 * 1024))
    key = {"authorization": "Bearer sesame", "content-type": "application/json"}
    try:
        big = b"x" * (50 * 2**20)
        t0 = time.perf_counter()
        r = httpx.post(s.url + "/completions", content=big, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = httpx.post(s.url + "/completions", content=big, headers=key, timeout=30)
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"], r.text
        assert time.perf_counter() - t0 < 10

        def chunks():
            for _ in range(64):
                yield b" " * 4096

        r = httpx.post(s.url + "/completions", content=chunks(), headers=key, timeout=30)
        assert r.status_code == 413, r.text
        r = httpx.post(s.url + "/completions", content="[" * 30_000 + "]" * 30_000, headers=key, timeout=30)
        assert r.status_code == 400, r.text
        ok = httpx.post(
            s.url + "/completions", json={"model": MODEL, "prompt": "w10", "max_tokens": 2}, headers=key, timeout=30
        )
        assert ok.status_code == 200 and httpx.get(s.url.removesuffix("/v1") + "/health", timeout=5).status_code == 200
    finally:
        s.close()
        engine.close(timeout=5)


def test_concurrency_limit_metrics_key_docs_off_and_key_file(artifact, tmp_path):
    from clover.serve.limits import RequestLimits
    from clover.tools.serve import main as serve_main

    engine = Engine.load(artifact, tree="chain-2", log=None, options=EngineOptions(max_batch=2))
    s = Server(
        engine,
        MODEL,
        api_key="k",
        limits=RequestLimits(allow_ignore_eos=True, max_concurrent_requests=1),
        docs=False,
        metrics_need_key=True,
    )
    key = {"authorization": "Bearer k"}
    root = s.url.removesuffix("/v1")
    forward_batch, calls = engine.runner.forward_batch, []
    engine.runner.forward_batch = lambda batch: (calls.append(1), time.sleep(0.02), forward_batch(batch))[2]
    try:
        body = {"model": MODEL, "prompt": "w10", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/completions", json=body, headers=key, timeout=30) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: a dropped iterator closes the stream (a disconnect)
            next(lines)
            busy = httpx.post(
                s.url + "/completions", json={"model": MODEL, "prompt": "w10", "max_tokens": 2}, headers=key, timeout=10
            )
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1", (busy.text, len(calls))
            assert "--max-concurrent-requests" in busy.json()["error"]["message"]
            assert httpx.get(root + "/health", timeout=5).status_code == 200  # not counted
        ok = httpx.post(
            s.url + "/completions", json={"model": MODEL, "prompt": "w10", "max_tokens": 2}, headers=key, timeout=10
        )
        assert ok.status_code == 200, ok.text
        assert httpx.get(root + "/metrics", timeout=5).status_code == 401
        assert httpx.get(root + "/metrics", headers=key, timeout=5).status_code == 200
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(root + path, timeout=5).status_code == 404, path
    finally:
        s.close()
        engine.close(timeout=5)
    assert serve_main(["--artifact", str(artifact), "--api-key-file", str(tmp_path / "nope")]) == 2
    (tmp_path / "empty").write_text("\n")
    assert serve_main(["--artifact", str(artifact), "--api-key-file", str(tmp_path / "empty")]) == 2


def test_manifest_pin_refuses_another_artifact_before_loading(artifact, capsys):
    import hashlib

    from clover.artifact import check_pin
    from clover.tools.serve import main as serve_main

    digest = hashlib.sha256((artifact / "manifest.json").read_bytes()).hexdigest()
    check_pin(artifact, digest.upper())  # the reviewed artifact passes (as sha256sum prints it, or upper case)
    for pin, words in (("0" * 64, "not the pinned"), ("abc", "64 hex digits")):
        assert serve_main(["--artifact", str(artifact), "--manifest-sha256", pin]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err


def test_a_request_whose_step_part_fails_gets_500_alone_and_health_stays_ok(artifact, solo):
    """The engine's forward raises for one request's rows at every step (tests/helpers.Faulty): that request gets
    500 in OpenAI's shape naming only the error's type and its id (X-Request-Id; the server log has the whole
    error), the requests decoding beside it get their solo text, and /health stays 200."""
    from concurrent.futures import ThreadPoolExecutor

    from helpers import POISON, Faulty

    engine = Engine.load(artifact, tree="chain-2", log=None, options=EngineOptions(max_batch=4))
    Faulty(engine.runner, "forward")
    s = Server(engine, MODEL)
    try:
        post = lambda prompt: httpx.post(
            s.url + "/completions",
            timeout=30,
            json={  # noqa: E731
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(post, [PROMPTS[0], POISON, PROMPTS[1], PROMPTS[2]]))
        bad = answers.pop(1)
        err = bad.json()["error"]
        assert bad.status_code == 500 and err["type"] == "server_error", bad.text
        assert "RuntimeError" in err["message"] and "/secret" not in err["message"], bad.text
        assert bad.headers["x-request-id"] in err["message"], bad.text
        for prompt, r in zip(PROMPTS, answers):
            assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"], r.text
            assert r.json()["choices"][0]["text"] == solo(prompt, chat=False, ignore_eos=True).text
        health = httpx.get(s.url.removesuffix("/v1") + "/health", timeout=5)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
    finally:
        s.close()
        engine.close(timeout=5)


def test_health_says_dead_and_requests_get_503_once_the_engine_loop_died(artifact):
    engine = Engine.load(artifact, tree="chain-2", log=None, options=EngineOptions(max_batch=2))
    s = Server(engine, MODEL)
    try:

        def dying():
            raise SystemExit("the loop breaks")

        engine._iteration = dying
        r = httpx.post(s.url + "/completions", json={"model": MODEL, "prompt": "w10", "max_tokens": 4}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        assert "stopped" in r.json()["error"]["message"]
        health = httpx.get(s.url.removesuffix("/v1") + "/health", timeout=5)
        assert health.status_code == 503 and health.json() == {"status": "dead"}
        r = httpx.post(s.url + "/completions", json={"model": MODEL, "prompt": "w10", "max_tokens": 4}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    finally:
        s.close()
        engine.close(timeout=5)


def test_a_disconnected_stream_frees_its_slot(server):
    engine, base = server.engine, server.url.removesuffix("/v1")
    aborted = lambda: sum(
        float(line.split()[-1])
        for line in httpx.get(base + "/metrics", timeout=5).text.splitlines()
        if line.startswith('clover:request_success_total{finished_reason="abort"}')
    )
    before, attempts = aborted(), 0
    for _ in range(5):  # the tiny model is fast: retry until the request is still running when the client leaves
        attempts += 1  # each attempt leaves before reading its end: an abort, whether or not it still ran
        with httpx.stream(
            "POST",
            server.url + "/completions",
            timeout=10,
            json={
                "model": MODEL,
                "prompt": PROMPTS[4],
                "max_tokens": 200,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            },
        ) as r:
            next(r.iter_lines())  # the first event (the role chunk: the request may not have joined a step yet)
            running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        if running:
            break
    assert running == 1, "every request ended before its client disconnected"
    deadline = time.time() + 10
    while (engine.scheduler.running or aborted() == before) and time.time() < deadline:
        time.sleep(0.02)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert aborted() == before + attempts
    assert "clover:num_requests_running 0.0" in httpx.get(base + "/metrics", timeout=5).text


def test_metrics_count_what_was_served(server):
    c = client(server)
    get = lambda: {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=5).text.splitlines()
        if line and not line.startswith("#")
    }
    before = get()
    r = c.completions.create(model=MODEL, prompt=PROMPTS[5], temperature=0, max_tokens=16)
    after = get()
    delta = lambda k: after.get(k, 0.0) - before.get(k, 0.0)
    assert delta("clover:generation_tokens_total") == r.usage.completion_tokens
    assert delta("clover:prompt_tokens_total") == r.usage.prompt_tokens
    spec = r.model_extra["clover"]
    assert delta("clover:spec_decode_num_draft_tokens_total") == spec["drafted_tokens"]
    assert delta("clover:spec_decode_num_accepted_tokens_total") == spec["accepted_tokens"]
    assert delta("clover:time_to_first_token_seconds_count") == 1
    assert delta("clover:inter_token_latency_seconds_count") == r.usage.completion_tokens - 1  # after the first
    for name in ("clover:spec_decode_num_drafts_total", "clover:num_requests_waiting", "clover:batch_size"):
        assert name in after
    deadline = time.monotonic() + 5
    while get()["clover:batch_size"] != 0 and time.monotonic() < deadline:  # the engine goes idle after the request
        time.sleep(0.05)
    assert get()["clover:batch_size"] == 0
    # vLLM's names beside, with its model_name label: the same counts, and its request timing histograms
    vllm = lambda name: f'vllm:{name}{{model_name="{MODEL}"}}'  # noqa: E731
    assert delta(vllm("generation_tokens_total")) == r.usage.completion_tokens
    assert delta(vllm("prompt_tokens_total")) == r.usage.prompt_tokens
    assert delta(vllm("spec_decode_num_accepted_tokens_total")) == spec["accepted_tokens"]
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time"):
        assert delta(vllm(f"{name}_seconds_count")) == 1, name
        assert delta(vllm(f"{name}_seconds_sum")) >= 0, name
    assert delta(vllm("request_inference_time_seconds_sum")) <= delta(vllm("e2e_request_latency_seconds_sum"))
    assert delta(vllm("request_prompt_tokens_sum")) == r.usage.prompt_tokens
    assert delta(vllm("request_generation_tokens_sum")) == r.usage.completion_tokens
    assert delta(vllm("request_params_max_tokens_sum")) == 16 and delta(vllm("request_params_n_sum")) == 1
    assert 0 <= after[vllm("kv_cache_usage_perc")] <= 1 and vllm("num_requests_running") in after
    assert not any(k.startswith("vllm:batch_size") for k in after)  # clover-deploy's own series keep their name only


def test_api_key_and_a_full_queue(artifact):
    engine = Engine.load(artifact, tree="plain", log=None, options=EngineOptions(max_batch=1, max_waiting=1))
    s = Server(engine, MODEL, api_key="sesame")
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            client(s, api_key="wrong").models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/models", timeout=5).status_code == 401
        assert [m.id for m in client(s, api_key="sesame").models.list().data] == [MODEL]
        # a burst of 12 at max_batch 1 and max_waiting 1: the queue fills, the rest are turned away with
        # Retry-After, every other request completes, and the server keeps serving
        body = {"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 64, "temperature": 0, "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(timeout=60, headers={"authorization": "Bearer sesame"}) as h:
                return await asyncio.gather(*(h.post(s.url + "/completions", json=body) for _ in range(12)))

        replies = asyncio.run(burst())
        codes = sorted(r.status_code for r in replies)
        assert 503 in codes and 200 in codes and set(codes) == {200, 503}, codes
        busy = next(r for r in replies if r.status_code == 503)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "service_unavailable"
        assert all(r.json()["usage"]["completion_tokens"] == 64 for r in replies if r.status_code == 200)
        assert client(s, api_key="sesame").completions.create(model=MODEL, prompt="w10", max_tokens=2).choices[0].text
    finally:
        s.close()
        engine.close()


def test_clover_serve_drains_on_sigterm_and_exits_0(artifact):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clover.tools.serve",
            "--artifact",
            str(artifact),
            "--port",
            str(port),
            "--max-batch",
            "2",
            "--tree",
            "plain",
            "--model",
            MODEL,
            "--allow-ignore-eos",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "CLOVER_API_KEY": ""},
    )
    try:
        if not wait_healthy(port, 60):
            raise AssertionError(proc.stderr.read() if proc.poll() is not None else "not healthy in 60 s")
        url = f"http://127.0.0.1:{port}/v1/completions"
        with httpx.stream(
            "POST",
            url,
            json={
                "model": MODEL,
                "prompt": PROMPTS[7],
                "max_tokens": 60,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            },
            timeout=30,
        ) as r:
            it = r.iter_lines()
            lines = [next(it)]
            proc.send_signal(signal.SIGTERM)  # in flight: it must still finish
            lines += list(it)
        assert "data: [DONE]" in lines[-3:], lines[-3:]
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert len("".join(e["choices"][0]["text"] for e in events).split()) == 60  # all of it (one word per token)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


# -- log-probabilities, penalties and the fields the server refuses -----------------------------------------------


def close_logprobs(got: list[float], want: list[float], what: str = "") -> None:
    from helpers import tiny_config
    from numerics import assert_close_paths, chain_reduction

    assert_close_paths(got, want, reduction=chain_reduction(tiny_config(), context=256), msg=what)


def test_logprobs_through_the_openai_client_streamed_and_not(server, solo, artifact):
    """chat logprobs=True, top_logprobs=5 and completions logprobs=3, streamed and not: plain decoding's tokens and
    log-probabilities (within the paths' tolerance), alternatives sorted with the greedy token first; a streamed
    chunk carries the log-probabilities of the tokens whose text it carries, and they add up to the whole."""
    tok = Tokenizer.from_dir(artifact / "tokenizer")
    c = client(server)
    want = solo(PROMPTS[8], logprobs=5)
    text = lambda ids: [tok.token_text(t) for t in ids]  # noqa: E731
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[8]}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        top_logprobs=5,
    )
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == want.text
    assert [e.token for e in content] == text(want.token_ids)
    assert [e.bytes for e in content] == [list(tok.token_bytes(t)) for t in want.token_ids]
    close_logprobs([e.logprob for e in content], [e.logprob for e in want.logprobs], "chat logprobs")
    for e, w in zip(content, want.logprobs):
        assert [a.token for a in e.top_logprobs] == text([t for t, _ in w.top])
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy: the top-1
        assert [a.logprob for a in e.top_logprobs] == sorted((a.logprob for a in e.top_logprobs), reverse=True)
    streamed = list(
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPTS[8]}],
            temperature=0,
            max_tokens=MAX_TOKENS,
            logprobs=True,
            top_logprobs=5,
            stream=True,
        )
    )
    pieces = [ch.choices[0] for ch in streamed if ch.choices and ch.choices[0].logprobs]
    assert len(pieces) > 1 and "".join(ch.choices[0].delta.content or "" for ch in streamed) == want.text
    for p in pieces:  # each chunk's tokens are its text's words (the tiny tokenizer: one word per token)
        assert (p.delta.content or "").split() == [e.token for e in p.logprobs.content]
    joined = [e for p in pieces for e in p.logprobs.content]
    assert [e.token for e in joined] == [e.token for e in content] and all(len(e.top_logprobs) == 5 for e in joined)
    close_logprobs([e.logprob for e in joined], [e.logprob for e in content], "streamed chat logprobs")

    want = solo(PROMPTS[9], chat=False, logprobs=3)
    r = c.completions.create(model=MODEL, prompt=PROMPTS[9], temperature=0, max_tokens=MAX_TOKENS, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == want.text and lp.tokens == text(want.token_ids)
    assert lp.text_offset == [e.text_offset for e in want.logprobs]
    assert all(want.text[o:].lstrip().startswith(t) for o, t in zip(lp.text_offset, lp.tokens))
    close_logprobs(lp.token_logprobs, [e.logprob for e in want.logprobs], "completion logprobs")
    assert all(len(top) == 3 and max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    chunks = list(
        c.completions.create(
            model=MODEL, prompt=PROMPTS[9], temperature=0, max_tokens=MAX_TOKENS, logprobs=3, stream=True
        )
    )
    parts = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert [t for p in parts for t in p.logprobs.tokens] == lp.tokens
    assert [o for p in parts for o in p.logprobs.text_offset] == lp.text_offset
    for p in parts:
        assert p.text.split() == p.logprobs.tokens
    r = c.completions.create(model=MODEL, prompt=PROMPTS[9], temperature=0, max_tokens=4)
    assert r.choices[0].logprobs is None


def test_penalties_and_token_options_through_the_server_equal_solo_plain(server, solo):
    """Penalties, logit_bias, min_tokens and stop_token_ids from the official client (extra_body for vLLM's
    extensions), streamed and not, give plain decoding's text with the same options; /metrics counts them."""
    from clover.runtime.sampling import SamplingParams

    c = client(server)
    metrics = lambda: {  # noqa: E731
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=5).text.splitlines()
        if line.startswith("clover:request_options_total")
    }
    before = metrics()
    cases = [  # (the client's arguments, extra_body, the same as SamplingParams, Generator's other options)
        (
            {"presence_penalty": 2.0, "frequency_penalty": 2.0},
            {},
            SamplingParams(presence_penalty=2.0, frequency_penalty=2.0),
            {},
        ),
        (
            {"frequency_penalty": 1.5, "logit_bias": {"33": 4.0}},
            {"repetition_penalty": 2.0},
            SamplingParams(frequency_penalty=1.5, logit_bias={33: 4.0}, repetition_penalty=2.0),
            {},
        ),
        (
            {"logit_bias": {"60": 100}},
            {"min_tokens": 4, "stop_token_ids": [60]},
            SamplingParams(logit_bias={60: 100.0}, min_tokens=4),
            {"stop_token_ids": [60]},
        ),
    ]
    for i, (openai_args, extra, sampling, solo_extra) in enumerate(cases):
        want = solo(PROMPTS[10 + i], sampling=sampling, ignore_eos=True, **solo_extra)
        base = dict(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPTS[10 + i]}],
            temperature=0,
            max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True, **extra},
            **openai_args,
        )
        r = c.chat.completions.create(**base)
        assert r.choices[0].message.content == want.text and r.usage.completion_tokens == want.new_tokens, i
        streamed = "".join(
            ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**base, stream=True) if ch.choices
        )
        assert streamed == want.text, i
    assert len(want.token_ids) == 5 and want.finish_reason == "stop"  # min_tokens held the forced stop id back
    after = metrics()
    grew = {k.split('"')[1] for k in after if after[k] - before.get(k, 0) >= 2}
    assert grew == {
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_tokens",
        "stop_token_ids",
    }


def test_top_k_and_min_p_through_the_client(server, solo):
    """vLLM's top_k and min_p (extra_body): sampling from the single most likely token (top_k 1, or min_p 1 where
    no two tokens tie) gives greedy decoding's text at any temperature and seed; a wider top_k still samples
    reproducibly with a seed."""
    c = client(server)
    want = solo(PROMPTS[13], ignore_eos=True)
    base = dict(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[13]}],
        temperature=1.5,
        max_tokens=MAX_TOKENS,
    )
    for seed, extra in ((1, {"top_k": 1}), (2, {"min_p": 1.0}), (3, {"top_k": 1, "min_p": 0.5})):
        r = c.chat.completions.create(**base, seed=seed, extra_body={"ignore_eos": True, **extra})
        assert r.choices[0].message.content == want.text, extra
    wide = [
        c.chat.completions.create(**base, seed=7, extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.05})
        for _ in range(2)
    ]
    assert wide[0].choices[0].message.content == wide[1].choices[0].message.content


def test_bad_option_values_and_unsupported_fields_are_400_naming_them(server):
    """Bad values of the new fields, fields that would change the output but are not supported, and unknown fields:
    400 with the field as `param`. Harmless fields (user, metadata, store, ...) and no-op values are accepted."""
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=10)  # noqa: E731
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "w10"}], "max_tokens": 4}
    comp = {"model": MODEL, "prompt": "w10", "max_tokens": 4}
    cases = [
        (chat, {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        (chat, {"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
        (chat, {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        (chat, {"logprobs": 3}, "logprobs"),  # chat's logprobs is a flag
        (comp, {"logprobs": True}, "logprobs"),  # completions' is a count
        (comp, {"logprobs": 21}, "logprobs"),
        (chat, {"presence_penalty": 2.5}, "presence_penalty"),
        (comp, {"frequency_penalty": -2.01}, "frequency_penalty"),
        (comp, {"repetition_penalty": 0}, "repetition_penalty"),
        (comp, {"repetition_penalty": -1.0}, "repetition_penalty"),
        (chat, {"logit_bias": {"5": 101}}, "logit_bias"),
        (chat, {"logit_bias": {"five": 1}}, "logit_bias"),
        (chat, {"logit_bias": {"-5": 1}}, "logit_bias"),
        (chat, {"logit_bias": {"96": 1}}, "logit_bias"),  # the tiny vocabulary has 96 tokens
        (comp, {"min_tokens": -1}, "min_tokens"),
        (comp, {"min_tokens": 5}, "min_tokens"),  # more than max_tokens 4
        (comp, {"min_tokens": 2, "stop_token_ids": list(range(96))}, "min_tokens"),  # masks every token
        (comp, {"stop_token_ids": [96]}, "stop_token_ids"),
        (comp, {"stop_token_ids": [-1]}, "stop_token_ids"),
        (chat, {"n": 0}, "n"),
        (chat, {"n": 17}, "n"),
        (comp, {"best_of": 2, "n": 3}, "best_of"),
        (comp, {"best_of": 3, "stream": True}, "best_of"),
        (comp, {"echo": True, "stream": True, "logprobs": 1}, "echo"),
        (comp, {"suffix": "w9"}, "suffix"),
        (
            chat,
            {"response_format": {"type": "json_object"}},
            "response_format",
        ),  # the word-level vocabulary cannot spell JSON
        # tools alone ask for tool_choice auto, which needs --enable-auto-tool-choice (as vLLM)
        (chat, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        (chat, {"tool_choice": "auto"}, "tool_choice"),
        (chat, {"functions": [{"name": "f"}]}, "functions"),
        (chat, {"function_call": "auto"}, "function_call"),
        (chat, {"audio": {"voice": "alloy"}}, "audio"),
        (chat, {"modalities": ["text", "audio"]}, "modalities"),
        (chat, {"prediction": {"type": "content", "content": "w1"}}, "prediction"),
        (chat, {"reasoning_effort": "low"}, "reasoning_effort"),
        (chat, {"top_k": -2}, "top_k"),
        (comp, {"top_k": 2.5}, "top_k"),
        (chat, {"min_p": 1.5}, "min_p"),
        (chat, {"mirostat": 2}, "mirostat"),  # unknown here: refused, not ignored
        (comp, {"guided_json": {}}, "guided_json"),  # (the same)
    ]
    for base, extra, param in cases:
        path = "/chat/completions" if "messages" in base else "/completions"
        r = post(path, {**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"] and "\n" not in err["message"], (extra, r.text)
    accepted = {
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "n": 1,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "logprobs": False,
        "stream_options": None,
        "presence_penalty": 0,
        "logit_bias": {},
    }
    assert post("/chat/completions", {**chat, **accepted}).status_code == 200
    assert post("/completions", {**comp, "echo": False, "best_of": 1, "suffix": None, "user": "u"}).status_code == 200


def test_echo_returns_the_prompt_and_its_logprobs_as_openai_does(server, artifact):
    """Completions' echo with logprobs (what evaluation harnesses send to score a text): the prompt's text before
    the completion's, its tokens' log-probabilities first (the first token's null), equal to a teacher-forced pass
    of the prompt; max_tokens 1 as harnesses send it."""
    c = client(server)
    prompt = PROMPTS[5]
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2)
    ch = r.choices[0]
    ids = Tokenizer.from_dir(artifact / "tokenizer").encode(prompt)
    assert ch.text.startswith(prompt) and len(ch.logprobs.tokens) == len(ids) + 1
    assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.top_logprobs[0] is None
    _, logits = load_runner(artifact, heads="none").teacher_forced(np.array(ids), np.arange(len(ids) - 1))
    x = logits.astype(np.float64)
    want = x[np.arange(len(ids) - 1), ids[1:]] - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) - x.max(1)
    close_logprobs(ch.logprobs.token_logprobs[1 : len(ids)], list(want), "echo")
    assert ch.logprobs.text_offset == sorted(ch.logprobs.text_offset)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1
    plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    echoed = c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text and echoed.choices[0].logprobs is None
