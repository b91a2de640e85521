"""Structured output through clover-serve for real (uvicorn on 127.0.0.1, the official `openai` client): OpenAI's
response_format (json_object, json_schema, parsed with pydantic on the client side) and vLLM's guided_* fields,
streamed and not, each equal to solo plain constrained decoding on the same graphs; bad grammars are 400 naming
their field, and the server keeps serving. The tiny fused artifact runs with a character tokenizer (grammars need a
vocabulary that can spell any text)."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from helpers import Server, char_tokenizer_dir
from ort_helpers import tiny_artifact
from pydantic import BaseModel, Field

from clover.runtime.backends.ort import load_runner
from clover.runtime.engine import Engine
from clover.runtime.generator import Generator
from clover.runtime.grammar import Grammar
from clover.runtime.params import EngineOptions, GenerationParams
from clover.runtime.tokenizer import Tokenizer

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

MODEL = "tiny-chars"
MAX_TOKENS = 64
PROMPTS = ["give me json", "another one {", "x"]


class Item(BaseModel):
    name: Literal["ab", "cd", "efg"]
    ok: bool
    tags: list[Literal["x", "yy"]] = Field(max_length=3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    artifact = tiny_artifact(root, "clover2", attention="fused")
    tok = Tokenizer.from_dir(char_tokenizer_dir(root / "char-tokenizer"))
    engine = Engine(load_runner(artifact), tok, "mc26", log=None, options=EngineOptions(max_batch=4, max_waiting=64))
    server = Server(engine, MODEL)
    plain = Generator(load_runner(artifact), tok, "plain")
    yield server, plain
    server.close()
    engine.close()


def solo(plain, prompt: str, grammar: Grammar, chat: bool = True):
    """Plain constrained greedy decoding of the prompt alone: what the server must return."""
    return plain.generate(
        [{"role": "user", "content": prompt}] if chat else prompt,
        GenerationParams(max_new_tokens=MAX_TOKENS, grammar=grammar),
    )


def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def test_json_schema_parsed_by_the_openai_client_equals_solo_constrained(setup):
    server, plain = setup
    from openai.lib._parsing._completions import type_to_response_format_param

    schema = type_to_response_format_param(Item)["json_schema"]["schema"]
    c = client(server)
    for prompt in PROMPTS:
        want = solo(plain, prompt, Grammar.json_schema(schema))
        assert want.finish_reason == "stop", want.text  # the schema's values are bounded: the output ends
        got = c.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            response_format=Item,
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        msg = got.choices[0].message
        assert msg.content == want.text and isinstance(msg.parsed, Item), (msg.content, want.text)
        jsonschema.validate(json.loads(msg.content), schema)
        # streamed: the same text, chunk by chunk
        chunks = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": schema}},
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
        )
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text


def test_json_object_and_guided_fields_equal_solo_constrained(setup):
    """json_object in chat; vLLM's guided_regex, guided_choice, guided_grammar (Lark) and guided_json on both
    endpoints, through the openai client's extra_body."""
    server, plain = setup
    c = client(server)
    regex, lark = r"[a-e]{2,4}( [a-e]{1,3}){1,4}\.", 'start: item ("," item)* "!"\nitem: "ab" | "c" | /[0-9]/'
    cases = [
        (
            {"response_format": {"type": "json_object"}},
            Grammar.json_object(),
            lambda t: isinstance(json.loads(t), dict),
        ),
        ({"extra_body": {"guided_regex": regex}}, Grammar.regex(regex), lambda t: re.fullmatch(regex, t)),
        (
            {"extra_body": {"guided_choice": ["alpha", "beta"]}},
            Grammar.choice(["alpha", "beta"]),
            lambda t: t in ("alpha", "beta"),
        ),
        ({"extra_body": {"guided_grammar": lark}}, Grammar.lark(lark), lambda t: t.endswith("!")),
        (
            {"extra_body": {"guided_json": Item.model_json_schema()}},
            Grammar.json_schema(Item.model_json_schema()),
            lambda t: Item.model_validate_json(t),
        ),
    ]
    for kwargs, grammar, valid in cases:
        for prompt in PROMPTS[:2]:
            want = solo(plain, prompt, grammar)
            got = c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                temperature=0,
                max_tokens=MAX_TOKENS,
                **kwargs,
            )
            assert got.choices[0].message.content == want.text, (kwargs, prompt)
            if got.choices[0].finish_reason == "stop":
                assert valid(want.text), (kwargs, want.text)
            if "extra_body" in kwargs:  # the legacy completions endpoint takes the same fields
                want = solo(plain, prompt, grammar, chat=False)
                got = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, **kwargs)
                assert got.choices[0].text == want.text, (kwargs, prompt)


def test_bad_grammars_are_400_naming_their_field_and_the_server_keeps_serving(setup):
    server, plain = setup
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=10)  # noqa: E731
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    comp = {"model": MODEL, "prompt": "hi", "max_tokens": 8}
    bad_schema = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    cases = [
        (
            chat,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}}},
            "response_format",
        ),
        (
            chat,
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format",
        ),  # no name
        (chat, {"response_format": {"type": "xml"}}, "response_format"),
        (chat, {"response_format": {"type": "json_object", "extra": 1}}, "response_format"),
        (comp, {"guided_regex": "(unclosed"}, "guided_regex"),
        (comp, {"guided_regex": ""}, "guided_regex"),
        (comp, {"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        (comp, {"guided_choice": []}, "guided_choice"),
        (comp, {"guided_choice": ["a", ""]}, "guided_choice"),
        (comp, {"guided_json": bad_schema}, "guided_json"),
        (comp, {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),  # two grammars
        (chat, {"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
    ]
    for base, extra, param in cases:
        path = "/chat/completions" if "messages" in base else "/completions"
        r = post(path, {**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"].startswith(param) and param in err["message"] and "\n" not in err["message"], r.text
    want = solo(plain, PROMPTS[0], Grammar.json_object())
    r = post(
        "/chat/completions",
        {
            **chat,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "response_format": {"type": "json_object"},
            "messages": [{"role": "user", "content": PROMPTS[0]}],
        },
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want.text
    assert httpx.get(server.url.removesuffix("/v1") + "/health").status_code == 200


def test_metrics_count_structured_requests_and_pruned_drafts(setup):
    server, _ = setup
    c = client(server)
    c.completions.create(
        model=MODEL, prompt="ab ab ab ab", max_tokens=16, temperature=0, extra_body={"guided_regex": "[a-c]+"}
    )
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
    count = re.search(r'^clover:request_options_total\{option="structured_output"\} (\S+)$', text, re.M)
    assert count and float(count.group(1)) >= 1, text
    assert re.search(r"^clover:spec_decode_num_pruned_tokens_total \S+$", text, re.M), text


def test_n_sampled_choices_each_follow_the_schema(setup):
    """n = 3 sampled choices under a JSON schema: each one parses into the pydantic model on the client side, and
    choice i equals a lone request seeded seed + i."""
    server, _ = setup
    c = client(server)
    ask = dict(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], response_format=Item, max_tokens=MAX_TOKENS
    )
    r = c.chat.completions.parse(n=3, temperature=1.5, seed=5, **ask)
    assert len(r.choices) == 3 and all(isinstance(ch.message.parsed, Item) for ch in r.choices)
    alone = [c.chat.completions.parse(temperature=1.5, seed=5 + i, **ask).choices[0].message.content for i in range(3)]
    assert [ch.message.content for ch in r.choices] == alone
