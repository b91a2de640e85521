"""`make demo`'s tool on a tiny base: exports once (cached), streams, checks identity with plain decoding."""

import pytest
from helpers import tiny_hf_folder as make_base

from clover.runtime.loop import LOOKUP_DRAFTS
from clover.tools.demo import main


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_demo_runs_and_reports_identity(tmp_path, capsys, monkeypatch, backend):
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    base = make_base(tmp_path / "base")
    args = [
        "--base",
        str(base),
        "--heads",
        "random:clover2",
        "--prompt",
        "w7 w8",
        "--max-new-tokens",
        "8",
        "--backend",
        backend,
    ]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0
    assert "identical to plain greedy decoding" in out and "acceptance length" in out and f"{backend} backend" in out
    assert "DIFFERENT" not in out and f"prompt-lookup drafts (chain-{LOOKUP_DRAFTS} at most)" in out
    assert ("memory-bandwidth limit here" in out) == (backend == "ort")  # beside the speeds, for the artifact
    if backend == "ort":
        assert "exporting" in err and list((tmp_path / "cache" / "artifacts").iterdir())
        assert main(args) == 0  # the second run reuses the exported artifact
        assert "(cached)" in capsys.readouterr().err


def test_demo_error_is_one_line(tmp_path, capsys):
    code = main(["--base", str(tmp_path / "missing")])
    assert code == 2 and "clover-demo: error:" in capsys.readouterr().err


def test_demo_artifact_with_a_corpus(tmp_path, monkeypatch):
    """with_corpus: a cached copy of the export that drafts from the corpus (n-gram store), redone only when the
    corpus changes. No heads: the tiny base's 96 tokens are fewer than the demo's draft vocabulary, so none would
    be added anyway (tests/export/test_draft_vocab.py covers adding one)."""
    from helpers import tiny_corpus

    from clover.artifact import open_artifact
    from clover.tools.demo import cached_artifact

    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    base = make_base(tmp_path / "base")
    corpus = tiny_corpus(base, tmp_path / "corpus")
    art = cached_artifact(str(base), "none", weights=None, attention="portable", corpus=corpus)
    m = open_artifact(art)
    assert m.ngram_store.contexts > 0 and m.draft_vocab is None and m.heads is None
    assert cached_artifact(str(base), "none", weights=None, attention="portable", corpus=corpus) == art
