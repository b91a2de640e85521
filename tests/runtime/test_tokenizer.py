"""clover.runtime.tokenizer against transformers' tokenizer (SmolLM2), plus folder-format edge cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TOKENIZER_CORPUS
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from clover.errors import CloverError
from clover.runtime.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_path: Path) -> Path:
    """The embedded default's folder: transformers saved its tokenizer there when converting the GGUF."""
    return smollm2_path


@pytest.fixture(scope="session")
def reference(smollm2_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


TEXTS = [
    "Hello, world!",
    "",
    " ",
    "   leading spaces",
    "trailing spaces   ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "Ünïcödé façade naïve — “quotes” ‘single’",
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji 🎉🚀👍🏽 👨‍👩‍👧‍👦 family",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "numbers 1234567890 3.14159 -42 1e-9",
    "mixed\u00a0nbsp and zero\u200bwidth",
]

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2+2?"}],
    "single-system": [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    "multi": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help? 🙂"},
        {"role": "user", "content": "Write a haiku about 雪."},
    ],
    "multi-system": [
        SYSTEM,
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  spaces and\nnewlines  "},
    ],
}


# ------------------------------------------------------------------------------ SmolLM2 vs transformers


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, reference, text: str, add_special_tokens: bool) -> None:
    expected = reference.encode(text, add_special_tokens=add_special_tokens)
    assert tok.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(tok: Tokenizer, reference, text: str, skip_special_tokens: bool) -> None:
    ids = reference.encode(text, add_special_tokens=False)
    expected = reference.decode(ids, skip_special_tokens=skip_special_tokens)
    assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == expected
    if not skip_special_tokens:
        assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level BPE is lossless


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(tok: Tokenizer, reference, name: str, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    expected_text = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected_text
    expected_ids = reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt) == list(expected_ids)


def test_special_tokens_and_sizes(tok: Tokenizer, reference) -> None:
    im_end = reference.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tok.eos_token_ids
    assert tok.eos_token_ids[0] == reference.eos_token_id
    assert tok.eos_token == reference.eos_token
    assert tok.bos_token == reference.bos_token
    assert tok.vocab_size == len(reference)
    assert tok.has_chat_template
    assert tok.token_to_id("<|im_end|>") == im_end


def test_save_round_trips(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path)
    again = Tokenizer.from_dir(tmp_path)
    assert again.eos_token_ids == tok.eos_token_ids
    assert (again.bos_token, again.eos_token, again.vocab_size) == (tok.bos_token, tok.eos_token, tok.vocab_size)
    assert again.chat_template == tok.chat_template
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    messages = CONVERSATIONS["multi-system"]
    assert again.encode_chat(messages) == tok.encode_chat(messages)


def test_saved_folder_loads_in_transformers(tok: Tokenizer, reference, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok.save(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    messages = CONVERSATIONS["multi"]
    assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert loaded.encode(TEXTS[8]) == reference.encode(TEXTS[8])


# ------------------------------------------------------------------------- synthetic tokenizer folders


@pytest.fixture(scope="module")
def tiny_backend() -> HFTokenizer:
    """A byte-level BPE trained on a few sentences, with <s> / </s> / <pad> special tokens."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = TOKENIZER_CORPUS
    backend.train_from_iterator(corpus, trainer=trainer)
    return backend


def _write_folder(folder: Path, backend: HFTokenizer, **files: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    for name, content in files.items():
        path = folder / name.replace("__", ".")
        path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return folder


def test_missing_folder_and_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(CloverError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CloverError) as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(info.value) and "tokenizer.json" in str(info.value)
    assert "config.json" in str(info.value)  # says what it found


def test_no_chat_template(tmp_path: Path, tiny_backend: HFTokenizer) -> None:
    tok = Tokenizer.from_dir(_write_folder(tmp_path, tiny_backend))
    assert not tok.has_chat_template
    assert tok.eos_token_ids == () and tok.bos_token is None and tok.eos_token is None
    with pytest.raises(CloverError, match="no chat template .a base model.*--chat-template FILE_OR_TEMPLATE"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(CloverError, match=str(tmp_path)):
        tok.encode_chat([{"role": "user", "content": "hi"}])

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "rag", "template": "x"}]}))
    with pytest.raises(CloverError, match=r"no chat template named 'default' \(it has \['rag'\]\)"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)


def test_a_chat_template_given_by_the_user(tmp_path: Path, tiny_backend: HFTokenizer) -> None:
    """--chat-template as vLLM takes it: a file or the template itself; added to a base model's tokenizer or
    replacing a model's own; compiled at once."""
    from clover.runtime.tokenizer import read_chat_template

    base = Tokenizer.from_dir(_write_folder(tmp_path / "base", tiny_backend))
    messages = [{"role": "user", "content": "hi"}]
    templated = base.with_chat_template(read_chat_template(TEMPLATE))
    assert templated.has_chat_template and not base.has_chat_template
    assert templated.apply_chat_template(messages) == "<user>hi<a>" and templated.encode("hi") == base.encode("hi")
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}!")
    for spec in (tmp_path / "t.jinja", str(tmp_path / "t.jinja")):
        assert base.with_chat_template(read_chat_template(spec)).apply_chat_template(messages) == "hi!"
    own = Tokenizer.from_dir(_write_folder(tmp_path / "own", tiny_backend, chat_template__jinja="x"))
    assert own.with_chat_template(TEMPLATE).apply_chat_template(messages) == "<user>hi<a>"  # replaced
    for spec, message in (
        (str(tmp_path / "missing.jinja"), "neither a readable template file"),
        (str(tmp_path), "neither a readable template file"),  # a folder
        ("{% for m in messages %}", "not valid Jinja"),
        ("  ", "is empty"),
    ):
        with pytest.raises(CloverError, match=message):
            read_chat_template(spec)
    (tmp_path / "bad.jinja").write_text("{{ x ")
    with pytest.raises(CloverError, match=r"chat template file .*bad.jinja is not valid Jinja"):
        read_chat_template(tmp_path / "bad.jinja")


def test_a_written_chat_template_is_what_transformers_reads(tmp_path: Path, tiny_backend: HFTokenizer) -> None:
    from transformers import AutoTokenizer

    from clover.runtime.tokenizer import write_chat_template

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "old"}
    folder = _write_folder(tmp_path, tiny_backend, tokenizer_config__json=config)
    write_chat_template(folder, TEMPLATE)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ours = Tokenizer.from_dir(folder).apply_chat_template(messages)
    reference = AutoTokenizer.from_pretrained(str(folder))
    theirs = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs == "<user>hi<assistant>yo<a>"


def test_config_files_and_eos_union(tmp_path: Path, tiny_backend: HFTokenizer) -> None:
    s_id, end_id, pad_id = (tiny_backend.token_to_id(t) for t in ("<s>", "</s>", "<pad>"))
    folder = _write_folder(
        tmp_path,
        tiny_backend,
        tokenizer_config__json={
            "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
            "eos_token": "</s>",
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"},
            ],
        },
        generation_config__json={"eos_token_id": [pad_id, end_id]},
        config__json={"eos_token_id": 7},
    )
    tok = Tokenizer.from_dir(folder)
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"
    assert tok.eos_token_ids == (end_id, pad_id, 7)
    assert tok.vocab_size == tiny_backend.get_vocab_size(with_added_tokens=True)
    assert tok.apply_chat_template([{"role": "user", "content": "the fox"}]) == "<s>the fox"
    assert tok.encode_chat([{"role": "user", "content": "the fox"}])[0] == s_id

    # chat_template.jinja wins over tokenizer_config.json's template
    (folder / "chat_template.jinja").write_text("{{ eos_token }}{{ messages | length }}")
    assert Tokenizer.from_dir(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "</s>1"


def test_template_environment(tmp_path: Path, tiny_backend: HFTokenizer) -> None:
    template = """{% for m in messages %}
    {% if m['role'] == 'tool' %}
{{ raise_exception('tools are not supported') }}
    {% endif %}
    {% if loop.index > 2 %}{% break %}{% endif %}
{{ m | tojson }}
{% endfor %}
{% if add_generation_prompt %}GO{% endif %}"""
    tok = Tokenizer.from_dir(_write_folder(tmp_path, tiny_backend, chat_template__jinja=template))
    messages = [{"role": "user", "content": "<b>é</b>"}, {"role": "assistant", "content": "a"}, {"role": "user"}]
    rendered = tok.apply_chat_template(messages)
    # tojson does not HTML-escape and keeps non-ASCII; loopcontrols' break works; trim_blocks and
    # lstrip_blocks drop the lines that hold only block tags
    assert rendered == '{"role": "user", "content": "<b>é</b>"}\n{"role": "assistant", "content": "a"}\nGO'
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("}\n")
    with pytest.raises(CloverError, match="tools are not supported"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_add_bos_token_flag(tmp_path: Path, tiny_backend: HFTokenizer) -> None:
    folder = _write_folder(
        tmp_path, tiny_backend, tokenizer_config__json={"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    )
    tok = Tokenizer.from_dir(folder)
    s_id = tiny_backend.token_to_id("<s>")
    assert tok.encode("the fox")[0] == s_id
    assert tok.encode("the fox", add_special_tokens=False)[0] != s_id
    assert tok.decode(tok.encode("the fox")) == "the fox"
    tok.save(tmp_path / "saved")
    assert Tokenizer.from_dir(tmp_path / "saved").encode("the fox") == tok.encode("the fox")


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("tokenizer_config.json", "{not json", "not valid JSON"),
        ("tokenizer_config.json", json.dumps({"eos_token": 3}), "eos_token should be a string"),
        ("generation_config.json", json.dumps({"eos_token_id": "2"}), "eos_token_id should be an int"),
        ("config.json", "[1, 2]", "should hold a JSON object"),
    ],
)
def test_bad_config_files(tmp_path: Path, tiny_backend: HFTokenizer, name: str, content: str, match: str) -> None:
    folder = _write_folder(tmp_path, tiny_backend)
    (folder / name).write_text(content)
    with pytest.raises(CloverError, match=match):
        Tokenizer.from_dir(folder)


def test_template_kwargs_reach_the_template_and_the_final_message_can_stay_open(tmp_path):
    from helpers import tiny_tokenizer_dir

    template = (
        "{% if enable_thinking %}w6 {% endif %}{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
        "{% if add_generation_prompt %}w5{% endif %}"
    )
    tok = Tokenizer.from_dir(tiny_tokenizer_dir(tmp_path)).with_chat_template(template)
    chat = [{"role": "user", "content": "w10"}, {"role": "assistant", "content": "w20 w21"}]
    assert tok.apply_chat_template(chat, template_kwargs={"enable_thinking": True}).startswith("w6 w3 w10")
    assert tok.apply_chat_template(chat).startswith("w3 w10")
    assert tok.apply_chat_template(chat, False, continue_final_message=True) == "w3 w10 w4 w3 w20 w21"
    with pytest.raises(CloverError, match="add_generation_prompt"):
        tok.apply_chat_template(chat, True, continue_final_message=True)
    with pytest.raises(CloverError, match="set by the renderer"):
        tok.apply_chat_template(chat, template_kwargs={"add_generation_prompt": False})
