"""clover-serve over a base model (no chat template): /v1/completions serves it, a chat request is a 400 naming
the fix, and a template given at load (EngineOptions.chat_template, clover-serve --chat-template) serves chat."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import Server, tiny_base, tiny_tokenizer_dir

from clover.errors import CloverError
from clover.export.artifact import artifact_from_modules
from clover.export.config import ExportConfig
from clover.runtime.engine import Engine
from clover.runtime.generator import Generator
from clover.runtime.params import EngineOptions, GenerationParams

MODEL = "base"
TEMPLATE = "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
PROMPT = "w7 w8 w9"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """A tiny fused artifact of a base model: its tokenizer has no chat template."""
    root = tmp_path_factory.mktemp("base-artifact")
    tokenizer = tiny_tokenizer_dir(root / "tokenizer")
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    config = ExportConfig(attention="fused", max_batch=2, verify=False)
    return artifact_from_modules(tiny_base(seed=3), None, tokenizer, root / "artifact", config)


def post(server: Server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/{route}", json={"model": MODEL, "max_tokens": 6, "temperature": 0, **body})


def test_a_base_model_serves_completions_and_answers_chat_with_400(artifact):
    engine = Engine.load(artifact, tree="plain", log=None, options=EngineOptions(max_batch=2))
    server = Server(engine, MODEL)
    try:
        r = post(server, "completions", {"prompt": PROMPT})
        want = Generator.load(artifact, "none", backend="ort").generate(PROMPT, GenerationParams(max_new_tokens=6))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
        r = post(server, "chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "messages" and error["code"] == "no_chat_template"
        assert "/v1/completions" in error["message"] and "--chat-template" in error["message"]
        r = post(server, "chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "model": "other"})
        assert r.status_code == 404  # the model is checked first, as for every request
    finally:
        server.close()
        engine.close()


def test_a_template_given_at_load_serves_chat(artifact):
    options = EngineOptions(max_batch=2, chat_template=TEMPLATE)
    engine = Engine.load(artifact, tree="plain", log=None, options=options)
    server = Server(engine, MODEL)
    try:
        r = post(server, "chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})
        plain = Generator.load(artifact, "none", backend="ort")
        want = plain.generate(f"w3 {PROMPT} w4 w5", GenerationParams(max_new_tokens=6))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want.text
        assert r.json()["usage"]["prompt_tokens"] == want.prompt_tokens
    finally:
        server.close()
        engine.close()
    with pytest.raises(CloverError, match="not valid Jinja"):
        Engine.load(artifact, tree="plain", log=None, options=EngineOptions(chat_template="{% if %}"))
    with pytest.raises(CloverError, match="chat_template must be"):
        EngineOptions(chat_template=3)


def test_clover_serve_chat_template_flag(artifact, tmp_path, capsys):
    from clover.tools.serve import build_parser, main

    args = build_parser().parse_args(["--artifact", str(artifact), "--chat-template", str(tmp_path / "t.jinja")])
    assert args.chat_template == str(tmp_path / "t.jinja")
    code = main(["--artifact", str(artifact), "--ray", "--chat-template", TEMPLATE])
    err = capsys.readouterr().err
    assert code == 2 and "clover-export --chat-template" in err
    code = main(["--artifact", str(artifact), "--chat-template", str(tmp_path / "missing.jinja")])
    assert code == 2 and "neither a readable template file" in capsys.readouterr().err
