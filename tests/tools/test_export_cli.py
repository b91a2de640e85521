"""clover-export then clover-generate --artifact DIR --backend ort, end to end through the CLIs."""

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import tiny_corpus

from clover.artifact import open_artifact
from clover.errors import CloverError
from clover.tools.export import main as export_main
from clover.tools.generate import main as generate_main

pytest.importorskip("transformers")
PROMPT = ["--prompt", "w7 w8 w9 w10", "--max-new-tokens", "24", "--json"]


@pytest.fixture
def artifact(cli_artifact):
    return cli_artifact


def cli(capsys, main, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_export_progress_and_artifact(base_dir, tmp_path, capsys):
    out = tmp_path / "plain"
    code, stdout, stderr = cli(capsys, export_main, "--base", base_dir, "--out", out, "--max-context", 100)
    assert code == 0 and stdout.strip() == str(out)
    assert "[1/3] base: exporting base.onnx" in stderr and "checker ok" in stderr and "logits" in stderr
    m = open_artifact(out)
    assert m.heads is None and m.max_context == 100 and m.sources == {"base": str(base_dir), "heads": "none"}
    # the default for ONNX Runtime float32 is the fast path: the fused graph, and its batched twin for the engine
    assert m.attention == "fused" and "base_batch" in m.graphs and m.drafts is None
    # exporting again into the same artifact is safe; this time with an n-gram store of a corpus of its answers
    code, _, stderr = cli(
        capsys,
        export_main,
        "--base",
        base_dir,
        "--out",
        out,
        "--no-verify",
        "--ngram-store",
        tiny_corpus(base_dir, tmp_path / "corpus"),
    )
    m = open_artifact(out)
    assert code == 0 and m.max_context == 128 and m.parity == {}
    assert m.ngram_store.contexts > 0 and m.ngram_store.source.startswith("corpus: ") and "n-gram store" in stderr
    # with a store and no --tree, plain decoding and prompt lookup are timed here and the faster is the default
    versus = m.tree_timing["versus_lookup"]
    assert set(versus) == {"plain", "lookup"} and m.tree is None
    assert m.drafts == ("lookup" if versus["lookup"] > versus["plain"] else "heads")


def test_export_defaults_are_the_fast_path():
    from clover.tools.demo import shipped_corpora
    from clover.tools.export import build_parser, default_attention, ngram_store_corpora

    assert default_attention("onnx", "float32") == "fused"
    assert default_attention("trt", "float16") == default_attention("onnx", "float16") == "portable"
    assert ngram_store_corpora("none", "smollm2") is None  # asked for none
    assert ngram_store_corpora(None, "/some/other/base") is None  # no corpora of another base's answers
    assert ngram_store_corpora(None, "smollm2") == (shipped_corpora("smollm2") or None)  # a clone ships them
    helped = " ".join(build_parser().format_help().split())
    assert "fused (default for --backend onnx --dtype float32)" in helped and "Default: for --base smollm2" in helped


def test_corpus_sources_read_the_shards_once(base_dir, tmp_path, monkeypatch):
    """--ngram-store and --draft-vocab from one corpus: one read of its shards gives both, equal to what each
    alone gives."""
    import numpy as np

    from clover.tools.export import corpus_sources
    from clover.train.corpus import Corpus

    corpus = tiny_corpus(base_dir, tmp_path / "corpus")
    reads = []
    read_shard = Corpus.read_shard
    monkeypatch.setattr(Corpus, "read_shard", lambda self, entry: reads.append(entry.file) or read_shard(self, entry))
    store, counts = corpus_sources(corpus)
    assert sorted(reads) == sorted(s.file for s in Corpus.open(corpus).provenance.shards)
    alone_store, alone_counts = corpus_sources(corpus, counts=False)[0], corpus_sources(corpus, store=False)[1]
    assert np.array_equal(counts.counts, alone_counts.counts) and counts.counts.sum() == alone_counts.counts.sum() > 0
    assert np.array_equal(counts.counts, Corpus.open(corpus).token_counts(len(counts.counts)))
    assert len(store.store) == len(alone_store.store) > 0 and store.source == counts.source
    assert np.array_equal(store.store.tokens, alone_store.store.tokens)
    assert np.array_equal(store.store.sa, alone_store.store.sa)


def test_generate_from_artifact_is_identical_to_torch(base_dir, artifact, capsys):
    code, out, err = cli(capsys, generate_main, "--base", base_dir, *PROMPT)
    assert code == 0, err
    torch_plain = json.loads(out)
    code, out, err = cli(capsys, generate_main, "--artifact", artifact, "--backend", "ort", *PROMPT)
    assert code == 0, err
    spec = json.loads(out)
    assert spec["token_ids"] == torch_plain["token_ids"]
    assert spec["backend"] == "ort" and spec["heads"] == "random:clover2" and spec["tree"] == "small"
    assert spec.keys() == torch_plain.keys()  # same JSON as the torch backend
    code, out, _ = cli(
        capsys, generate_main, "--artifact", artifact, "--heads", "none", "--threads", 1, *PROMPT
    )  # --backend ort implied
    plain = json.loads(out)
    assert code == 0 and plain["token_ids"] == torch_plain["token_ids"] and plain["tree"] == "plain"
    code, out, err = cli(
        capsys,
        generate_main,
        "--artifact",
        artifact,
        "--tree",
        "chain-2",
        "--prompt",
        "w7 w8",
        "--max-new-tokens",
        "8",
        "--stream",
    )
    assert code == 0 and out.strip() and "tokens/step" in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--backend", "trt"], "TensorRT is not installed"),
        (["--backend", "trt", "--attention", "plugin", "--dtype", "float16"], "TensorRT is not installed"),
        (["--dtype", "int8"], "unsupported export dtype"),
        (["--attention", "flash"], "unknown attention variant"),
        (["--max-prompt", "64"], "--max-prompt sizes TensorRT's prefill profile"),
        (["--draft-quant", "int2"], "unknown --draft-quant 'int2'"),
        (["--draft-quant", "int8", "--dtype", "float16"], "use it with --backend onnx --dtype float32"),
        (["--heads", "random:gpt"], "random:ARCH"),
        (["--tree", "mc26", "--heads", "random:clover"], "tree mc26 has depth 5"),
        (["--max-context", "100000"], "exceeds the base model's max_position_embeddings"),
        (["--ngram-store", "no-such-corpus"], "corpus folder no-such-corpus does not exist"),
    ],
)
def test_export_user_errors_are_one_line(base_dir, tmp_path, capsys, args, message):
    if "TensorRT is not installed" in message and importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    code, out, err = cli(capsys, export_main, "--base", base_dir, "--out", tmp_path / "a", *args)
    assert code == 2 and out == ""
    last = err.splitlines()[-1]  # progress lines may come first; the error is the last line, alone
    assert last.startswith("clover-export: error:") and message in last and err.count("error:") == 1, err
    assert not (tmp_path / "a").exists()


def test_export_refuses_a_folder_that_is_not_an_artifact(base_dir, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    code, _, err = cli(capsys, export_main, "--base", base_dir, "--out", tmp_path / "mine")
    assert code == 2 and "is a non-empty folder that is not a clover artifact" in err
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "precious"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--backend", "ort"], "pass --artifact DIR"),
        (["--artifact", "{art}", "--backend", "torch"], "pass --backend ort"),
        (["--artifact", "{art}", "--base", "{base}"], "pass --artifact alone"),
        (["--artifact", "{art}", "--heads", "random:medusa"], "cannot be added to an exported artifact"),
        (["--artifact", "{art}", "--dtype", "float16"], "holds float32 graphs"),
        (["--artifact", "{base}"], "is not a clover artifact"),
        (
            ["--artifact", "{art}", "--backend", "trt"],
            "TensorRT",
        ),  # not installed here, and no engines in this artifact
        (["--artifact", "{art}", "--threads", "0"], "--threads must be at least 1"),
    ],
)
def test_generate_artifact_errors(base_dir, artifact, capsys, args, message):
    args = [a.format(art=artifact, base=base_dir) for a in args]
    code, out, err = cli(capsys, generate_main, *args, "--prompt", "w7")
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_console_entry_point_exit_code(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "clover.tools.export", "--out", str(tmp_path / "x"), "--backend", "trt"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "TensorRT" in proc.stderr


def test_bench_compares_ort_and_torch_from_one_artifact(artifact, tmp_path, capsys):
    from clover.tools.bench import main as bench_main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w7 w8 w9"}\n{"prompt": "w20 w21"}\n')
    out = tmp_path / "bench.json"
    code, table, err = cli(
        capsys,
        bench_main,
        "--artifact",
        artifact,
        "--backend",
        "ort,torch",
        "--prompts",
        prompts,
        "--no-chat",
        "--max-new-tokens",
        10,
        "--json",
        out,
    )
    assert code == 0, err
    rows = {(r["backend"], r["heads"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {("ort", "none"), ("ort", "random:clover2"), ("torch", "none"), ("torch", "random:clover2")}
    assert all(r["identical_to_plain"] == "2/2" for r in rows.values())
    assert rows[("ort", "random:clover2")]["tree"] == rows[("torch", "random:clover2")]["tree"] == "small"
    assert "p95 ms" in table
    code, _, err = cli(capsys, bench_main, "--backend", "ort", "--prompts", prompts)
    assert code == 2 and "--artifact" in err


def test_plugin_attention_export_through_the_cli(base_dir, tmp_path, capsys):
    """--attention plugin: checked against PyTorch on ONNX Runtime through the node's reference function;
    the ONNX Runtime backend then refuses the artifact (its nodes are TensorRT plugins)."""
    out = tmp_path / "plugin"
    code, stdout, stderr = cli(
        capsys,
        export_main,
        "--base",
        base_dir,
        "--heads",
        "random:clover2",
        "--out",
        out,
        "--attention",
        "plugin",
        "--tree",
        "small",
    )
    assert code == 0, stderr
    m = open_artifact(out)
    assert m.attention == "plugin" and m.parity["base"]["logits"] < 1e-3 and m.engines == {}
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no reference copy left behind
    code, stdout, err = cli(capsys, generate_main, "--artifact", out, "--backend", "ort", "--prompt", "w7")
    assert code == 2 and "--attention plugin" in err and "--backend trt" in err


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130)])
def test_a_stopped_export_removes_its_staging_folder(base_dir, tmp_path, sig, code):
    """clover-export stopped mid-export by SIGTERM or Ctrl-C: no `.tmp-` folder beside --out, no --out."""
    out = tmp_path / "art"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clover.tools.export",
            "--base",
            str(base_dir),
            "--heads",
            "random:clover2",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".tmp-art-*/tokenizer")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # the staging folder exists and the export is under way
    assert proc.poll() is None, proc.communicate()[1].decode()[-400:]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    # Python 3.11 ends with SIGINT itself (a shell shows 130 all the same) when Ctrl-C landed inside exec() of a
    # string, which dataclasses run while torch.onnx imports its exporter, even though run_cli caught it
    assert proc.returncode in (code, -signal.SIGINT), err.decode()[-400:]
    assert list(tmp_path.iterdir()) == []


def test_an_export_sweeps_staging_left_by_a_killed_one(base_dir, tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f".tmp-art-{dead.pid}-k1" / "tokenizer").mkdir(parents=True)  # what SIGKILL leaves
    code, _, _ = cli(capsys, export_main, "--base", base_dir, "--out", tmp_path / "art", "--no-verify")
    assert code == 0 and [p.name for p in tmp_path.iterdir()] == ["art"]


def test_corpus_sources_of_several_corpora(base_dir, tmp_path):
    """--ngram-store A,B: one store over both corpora's answers; corpora of different bases are refused."""
    from clover.tools.export import corpus_list, corpus_sources

    a, b = tiny_corpus(base_dir, tmp_path / "a"), tiny_corpus(base_dir, tmp_path / "b")
    one = corpus_sources(a)
    both = corpus_sources(f"{a},{b}")
    assert len(both[0].store) == 2 * len(one[0].store) and (both[1].counts == 2 * one[1].counts).all()
    assert both[0].source == "a: 32 answer tokens + b: 32 answer tokens"
    assert corpus_list([a, b]) == [a, b] and corpus_list(" a , b ") == [Path("a"), Path("b")]
    with pytest.raises(CloverError, match="no corpus given"):
        corpus_list(",")
    prov = json.loads((b / "provenance.json").read_text())
    prov["generator"]["base_fingerprint"].update(lm_head_sha256="0" * 16, lm_head_probe=[1.0])
    (b / "provenance.json").write_text(json.dumps(prov))
    with pytest.raises(CloverError, match="another base model"):
        corpus_sources([a, b])
