"""clover-serve's reuse of earlier traffic, on a tiny artifact under uvicorn: a resent conversation reports its
cached prompt tokens (OpenAI's usage.prompt_tokens_details.cached_tokens, streamed too) and the counters say so; with
several API keys each key's requests reuse only their own prefixes and draft only from their own served answers."""

from __future__ import annotations

import json

import httpx
from helpers import Server, tiny_tokenizer_dir
from ort_helpers import tiny_artifact

from clover.runtime.backends.ort import load_runner
from clover.runtime.engine import Engine
from clover.runtime.params import EngineOptions
from clover.runtime.tokenizer import Tokenizer
from clover.serve.limits import read_api_key_file

WORDS = " ".join(f"w{6 + (7 * i) % 80}" for i in range(40))  # a prompt of 40 tokens


def test_cached_tokens_and_tenants(tmp_path_factory, tmp_path):
    root = tmp_path_factory.getbasetemp()
    tok = Tokenizer.from_dir(tiny_tokenizer_dir(root / "tok-reuse-server"))
    engine = Engine(
        load_runner(tiny_artifact(root, "clover2")), tok, "chain-4", "lookup", log=None, options=EngineOptions()
    )
    keyfile = tmp_path / "keys"
    keyfile.write_text("key-a\n\nkey-b\n")
    keys = read_api_key_file(keyfile)
    assert keys == ("key-a", "key-b")
    server = Server(engine, "tiny", api_key=keys)
    try:
        with httpx.Client(timeout=60) as c:

            def ask(key: str, prompt: str, stream: bool = False) -> dict:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "stream": stream}
                if stream:
                    body["stream_options"] = {"include_usage": True}
                r = c.post(server.url + "/completions", json=body, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
                if not stream:
                    return r.json()
                chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                return chunks[-1]

            first = ask("key-a", WORDS)
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            again = ask("key-a", WORDS + " " + first["choices"][0]["text"] + " w9 w10", stream=True)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 40 + 12 - 3
            engine.served.flush()
            other = ask("key-b", WORDS)  # the other tenant: its own prefill, no drafts from key-a's answer
            assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert other["choices"][0]["text"] == first["choices"][0]["text"]
            assert other["clover"]["sources"].get("served", {"accepted": 0})["accepted"] == 0
            repeat = ask("key-a", WORDS)
            assert repeat["choices"][0]["text"] == first["choices"][0]["text"]
            assert repeat["clover"]["sources"]["served"]["accepted"] > 0  # its own answer drafts it
            metrics = c.get(server.url[: -len("/v1")] + "/metrics").text
            hits = next(line for line in metrics.splitlines() if line.startswith("clover:prefix_cache_hits_total"))
            assert float(hits.split()[1]) > 0
            assert 'clover:spec_decode_source_accepted_tokens_total{source="served"}' in metrics
    finally:
        server.close()
        engine.close()
