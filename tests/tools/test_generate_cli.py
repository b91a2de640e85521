"""clover-generate end to end: JSON output, streaming, identity across heads, one-line errors."""

import json
import subprocess
import sys

import pytest
from helpers import tiny_hf_folder as make_base

from clover.models.head_io import random_heads, save_heads
from clover.models.loading import load_base
from clover.runtime.loop import LOOKUP_DRAFTS
from clover.tools.generate import main

transformers = pytest.importorskip("transformers")

JSON_KEYS = {
    "token_ids",
    "text",
    "new_tokens",
    "steps",
    "tokens_per_step",
    "seconds",
    "tokens_per_second",
    "finish_reason",
    "backend",
    "heads",
    "tree",
}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("base"))


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_and_identity_across_heads(base_dir, capsys):
    common = ["--base", str(base_dir), "--prompt", "w7 w8 w9 w10", "--max-new-tokens", "24", "--json"]
    code, out, _ = run_cli(capsys, *common, "--heads", "none")
    assert code == 0
    plain = json.loads(out)
    assert JSON_KEYS <= plain.keys()
    assert plain["backend"] == "torch" and plain["heads"] == "none" and plain["tree"] == "plain"
    assert plain["new_tokens"] == len(plain["token_ids"]) > 0
    for heads, tree in [
        ("random:medusa", "chain-4"),
        ("random:clover", "chain-3"),
        ("random:clover2", "mc26"),
        ("random:clover2:5", "small"),
    ]:
        code, out, _ = run_cli(capsys, *common, "--heads", heads, "--tree", tree)
        doc = json.loads(out)
        assert code == 0 and doc["token_ids"] == plain["token_ids"], heads
        assert doc["heads"] == heads and doc["tree"] == tree
    for tree in (None, "chain-2"):  # prompt-lookup drafts (chain-12 by default)
        code, out, _ = run_cli(capsys, *common, "--heads", "lookup", *(["--tree", tree] if tree else []))
        doc = json.loads(out)
        assert code == 0 and doc["token_ids"] == plain["token_ids"] and doc["heads"] == "lookup"
        assert doc["tree"] == (tree or f"chain-{LOOKUP_DRAFTS}")
    code, _, err = run_cli(capsys, *common, "--heads", "lookup", "--tree", "mc26")
    assert code != 0 and "tree mc26 branches: use chain-N" in err and len(err.strip().splitlines()) == 1


def test_saved_heads_folder_and_stream(base_dir, tmp_path, capsys):
    heads_dir = tmp_path / "heads"
    save_heads(random_heads(load_base(base_dir), "clover2", 3), heads_dir)
    code, out, err = run_cli(
        capsys,
        "--base",
        str(base_dir),
        "--heads",
        str(heads_dir),
        "--prompt",
        "w7 w8",
        "--max-new-tokens",
        "8",
        "--stream",
    )
    assert code == 0 and out.strip() and "tokens/step" in err


def test_sampling_is_reproducible_with_a_seed(base_dir, capsys):
    args = [
        "--base",
        str(base_dir),
        "--heads",
        "random:clover2",
        "--prompt",
        "w7 w8",
        "--max-new-tokens",
        "16",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "11",
        "--json",
    ]
    a = json.loads(run_cli(capsys, *args)[1])
    b = json.loads(run_cli(capsys, *args)[1])
    assert a["token_ids"] == b["token_ids"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", "  "], "prompt is empty"),
        (["--prompt", " ".join(["w9"] * 200)], "context is 128"),
        (["--prompt", "w7", "--heads", "random:clover2", "--tree", "[[0],[2]]"], "tree"),
        (["--prompt", "w7", "--heads", "random:gpt"], "random:ARCH"),
        (["--prompt", "w7", "--heads", "/no/such/heads"], "not found"),
        (["--prompt", "w7", "--tree", "mc26"], "needs draft heads"),
        (["--prompt", "w7", "--temperature", "-1"], "temperature"),
        (["--prompt", "w7", "--max-new-tokens", "0"], "max-new-tokens"),
    ],
)
def test_bad_input_gives_one_line_error(base_dir, capsys, args, message):
    code, out, err = run_cli(capsys, "--base", str(base_dir), *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("clover-generate: error:") and message in err, err


def test_errors_for_bad_base_and_mismatched_heads(base_dir, tmp_path, capsys):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    code, _, err = run_cli(capsys, "--base", str(tmp_path / "gpt2"), "--prompt", "w7")
    assert code == 2 and "unsupported model architecture GPT2LMHeadModel" in err
    other = make_base(tmp_path / "other", seed=1)
    save_heads(random_heads(load_base(other), "clover2"), tmp_path / "h")
    code, _, err = run_cli(capsys, "--base", str(base_dir), "--heads", str(tmp_path / "h"), "--prompt", "w7")
    assert code == 2 and "trained for another base model" in err


def test_console_entry_point_exit_code(base_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "clover.tools.generate", "--base", str(base_dir), "--prompt", ""],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "prompt is empty" in proc.stderr


@pytest.mark.slow
def test_smollm2_chat_is_coherent_and_identical_for_every_head(capsys):
    common = [
        "--base",
        "smollm2",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-new-tokens",
        "24",
        "--json",
    ]
    plain = json.loads(run_cli(capsys, *common, "--heads", "none")[1])
    assert "Paris" in plain["text"]
    for heads in ("random:medusa", "random:clover", "random:clover2"):
        doc = json.loads(run_cli(capsys, *common, "--heads", heads)[1])
        assert doc["token_ids"] == plain["token_ids"], heads


def test_prompt_file_and_stop_string(base_dir, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("w7 w8 w9 w10")
    args = ["--base", str(base_dir), "--prompt-file", str(tmp_path / "p.txt"), "--max-new-tokens", "24", "--json"]
    full = json.loads(run_cli(capsys, *args)[1])
    words = full["text"].split()
    assert len(words) > 4
    stop = " ".join(words[2:4])
    cut = json.loads(run_cli(capsys, *args, "--heads", "random:clover2", "--stop", stop)[1])
    assert cut["finish_reason"] == "stop" and cut["text"] == full["text"][: full["text"].index(stop)]
    code, _, err = run_cli(capsys, "--base", str(base_dir), "--prompt-file", str(tmp_path / "none.txt"))
    assert code == 2 and "does not exist" in err


def test_a_base_model_continues_text_and_chats_with_a_given_template(base_dir, tmp_path, capsys):
    """A base model (no chat template): plain text works; --chat says what to do; --chat-template (a file or the
    template itself) renders the chat, as the same text would be prompted plainly."""
    import shutil

    base = shutil.copytree(base_dir, tmp_path / "base")
    config = json.loads((base / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    common = ["--base", str(base), "--prompt", "w7 w8", "--max-new-tokens", "6", "--json"]
    code, out, err = run_cli(capsys, *common)
    assert code == 0, err
    code, out, err = run_cli(capsys, *common, "--chat")
    assert code == 2 and err.count("\n") == 1 and "has none (a base model" in err
    assert "--chat-template FILE_OR_TEMPLATE, or leave --chat out" in err
    template = "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}w5"
    (tmp_path / "t.jinja").write_text(template)
    rendered = json.loads(run_cli(capsys, *common[:2], "--prompt", "w3 w7 w8 w4 w5", *common[4:])[1])
    for given in (template, str(tmp_path / "t.jinja")):
        code, out, err = run_cli(capsys, *common, "--chat", "--chat-template", given)
        assert code == 0, err
        assert json.loads(out)["token_ids"] == rendered["token_ids"]
    code, _, err = run_cli(capsys, *common, "--chat", "--chat-template", str(tmp_path / "none.jinja"))
    assert code == 2 and "neither a readable template file" in err
