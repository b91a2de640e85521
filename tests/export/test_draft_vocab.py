"""A draft vocabulary (export/draft_vocab.py): the heads score only the K tokens the base emits most often,
through draft_lm_head.onnx; the base still verifies with its full LM head, so the output does not change."""

import dataclasses
import json

import numpy as np
import pytest
from helpers import assert_identical, run_tokens, tiny_tokenizer_dir
from ort_helpers import PROMPTS, tiny_artifact, tiny_modules, tiny_token_counts

from clover.artifact import DRAFT_LM_HEAD, MANIFEST_FILE, open_artifact, read_draft_vocab, read_manifest
from clover.errors import CloverError
from clover.export.artifact import ArtifactOptions, artifact_from_modules
from clover.export.config import ExportConfig
from clover.export.draft_vocab import coverage, ranked_ids
from clover.runtime.backends.ort import load_runner
from clover.runtime.proposers import draft_tree
from clover.runtime.sampling import SamplingParams
from clover.runtime.tree import prune_tree, resolve_tree

K = 64  # of the tiny base's 96 tokens
TREES = {"medusa": "small", "clover": "small", "clover2": "mc26"}  # pruned to the heads' depth


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.getbasetemp()


def test_ranking_is_by_count_then_id():
    counts = np.array([5, 0, 9, 5, 1])
    ids = ranked_ids(counts)
    np.testing.assert_array_equal(ids, [2, 0, 3, 4, 1])
    assert ids.dtype == np.int64
    assert coverage(counts, ids[:2]) == pytest.approx(14 / 20)
    assert coverage(np.zeros(3), ids[:1]) == 0.0


@pytest.mark.parametrize("arch", sorted(TREES))
def test_drafts_score_the_vocabulary_and_the_output_is_unchanged(root, arch):
    full, small = tiny_artifact(root, arch), tiny_artifact(root, arch, draft_vocab=K)
    m = open_artifact(small)  # checksums include draft_lm_head.onnx and draft_vocab.npy
    ids = read_draft_vocab(small, m)
    want = ranked_ids(tiny_token_counts(tiny_modules(arch)[0]).counts)[:K]
    np.testing.assert_array_equal(ids, want)  # the K most frequent, most frequent first
    assert m.draft_vocab.size == K and m.draft_vocab.coverage == pytest.approx(
        coverage(tiny_token_counts(tiny_modules(arch)[0]).counts, want), abs=1e-5
    )
    assert m.graphs[DRAFT_LM_HEAD].output("logits").shape[-1] == K
    assert set(m.draft_vocab.graphs) == {"medusa_heads"} if arch == "medusa" else {"draft_begin", "draft_step"}
    a, b = load_runner(small), load_runner(full)
    np.testing.assert_array_equal(a.info.draft_vocab, ids)
    assert load_runner(small, heads="none").info.draft_vocab is None  # plain decoding drafts nothing
    # The draft logits are the full head's columns `ids`, bit for bit (same op, same rows of the weights).
    prompt = np.array(PROMPTS[1])
    T = len(prompt)
    for r in (a, b):
        r.reset(64)
        r.forward(prompt, np.arange(T), np.tri(T, dtype=bool))
        r.commit(np.arange(T), np.append(prompt[1:], 5))
    np.testing.assert_array_equal(a.draft_begin(), b.draft_begin()[ids])
    tree = prune_tree(resolve_tree(TREES[arch]), a.info.heads_max_depth or 5)
    drafted = draft_tree(a, tree, 5, SamplingParams(), np.random.default_rng(0))
    assert set(drafted.tokens[1:].tolist()) <= set(ids.tolist())  # columns mapped back to token ids
    # Greedy: identical to plain decoding of the same graphs, for every head type.
    plain = load_runner(small, heads="none")
    accepted = 0
    for p in PROMPTS:
        got, steps = run_tokens(a, p, tree, 30)
        want_tokens, _ = run_tokens(plain, p, resolve_tree("plain"), 30)
        assert_identical(got, want_tokens, f"{arch} with a draft vocabulary of {K}", reference=plain)
        accepted += sum(n - 1 for n in steps)
    assert accepted > 0, "no drafted token was ever accepted: the test does not exercise drafting"


def test_a_draft_vocabulary_needs_counts_from_this_base(root):
    base, heads = tiny_modules("clover2")
    tok = tiny_tokenizer_dir(root / "dv-tok")
    config = ExportConfig(draft_vocab=K)
    named = ArtifactOptions(heads_name="random:clover2")
    with pytest.raises(CloverError, match="--draft-vocab-data"):
        artifact_from_modules(base, heads, tok, root / "dv-none", config, named)
    counts = tiny_token_counts(base)
    other = dataclasses.replace(
        counts, base_fingerprint={**counts.base_fingerprint, "lm_head_sha256": "0" * 16, "lm_head_probe": [1.0]}
    )
    from_another_base = dataclasses.replace(named, token_counts=other)
    with pytest.raises(CloverError, match="another base model"):
        artifact_from_modules(base, heads, tok, root / "dv-other", config, from_another_base)
    counted = dataclasses.replace(named, token_counts=counts)
    with pytest.raises(CloverError, match="--draft-vocab must be an int in 64..96"):
        artifact_from_modules(base, heads, tok, root / "dv-big", ExportConfig(draft_vocab=97), counted)
    with pytest.raises(CloverError, match="with --heads"):
        artifact_from_modules(base, None, tok, root / "dv-plain", config, ArtifactOptions(token_counts=counts))
    for bad in (dict(draft_vocab=8), dict(draft_vocab=True)):
        with pytest.raises(CloverError, match="--draft-vocab must be an int >= 64"):
            ExportConfig(**bad)
    for bad in (dict(backend="trt"), dict(dtype="float16"), dict(shared_lm_head=False)):
        with pytest.raises(CloverError, match="--draft-vocab cuts the shared LM head"):
            ExportConfig(draft_vocab=K, **bad)
    assert not any((root / n).exists() for n in ("dv-none", "dv-other", "dv-big", "dv-plain"))  # nothing half-written


def test_a_damaged_vocabulary_file_is_named(root, tmp_path):
    import shutil

    src = tiny_artifact(root, "clover2", draft_vocab=K)
    copy = tmp_path / "a"
    shutil.copytree(src, copy)
    np.save(copy / "draft_vocab.npy", np.arange(K + 1))
    with pytest.raises(CloverError, match="draft_vocab.npy is not 64 token ids"):
        read_draft_vocab(copy, read_manifest(copy))
    # An artifact written before draft vocabularies (no "draft_vocab" key) still reads, drafting over all tokens.
    doc = json.loads((copy / MANIFEST_FILE).read_text())
    doc.pop("draft_vocab")
    (copy / MANIFEST_FILE).write_text(json.dumps(doc))
    assert read_manifest(copy).draft_vocab is None and read_draft_vocab(copy, read_manifest(copy)) is None


def test_dynamic_trees_over_a_draft_vocabulary(root):
    """A dynamic tree ranks nodes by the K-token draft law and maps its columns back: still identical output."""
    from clover.runtime.tree import dynamic_tree

    small = tiny_artifact(root, "clover2", draft_vocab=K)
    a, plain = load_runner(small), load_runner(small, heads="none")
    ids = set(a.info.draft_vocab.tolist())
    for spec in ("dynamic-8", "dynamic-4-w1"):
        tree = dynamic_tree(spec, a.info.heads_max_depth)
        for p in PROMPTS:
            got, steps = run_tokens(a, p, tree, 30)
            want, _ = run_tokens(plain, p, resolve_tree("plain"), 30)
            assert_identical(got, want, f"{spec} over a draft vocabulary", reference=plain)
    from clover.runtime.proposers import draft_dynamic

    a.reset(64)
    prompt = np.array(PROMPTS[0])
    a.forward(prompt, np.arange(len(prompt)), np.tri(len(prompt), dtype=bool))
    a.commit(np.arange(len(prompt)), np.append(prompt[1:], 5))
    tree, draft, _ = draft_dynamic(a, dynamic_tree("dynamic-8", 5), 5, SamplingParams(), np.random.default_rng(0))
    assert 1 < tree.num_nodes <= 9 and set(draft.tokens[1:].tolist()) <= ids


def test_a_vocabulary_is_added_to_an_existing_artifact(root, tmp_path):
    """with_draft_vocab: a copy of an artifact with a (new) draft vocabulary, no re-export; same output."""
    from clover.export.draft_vocab import with_draft_vocab

    src = tiny_artifact(root, "clover2")
    counts = tiny_token_counts(tiny_modules("clover2")[0])
    a = with_draft_vocab(src, tmp_path / "a", counts, 80)
    b = with_draft_vocab(a, tmp_path / "b", counts, 70)  # replaces a's
    assert read_manifest(src).draft_vocab is None and open_artifact(a).draft_vocab.size == 80
    m = open_artifact(b)
    assert m.draft_vocab.size == 70 and m.graphs[DRAFT_LM_HEAD].output("logits").shape[-1] == 70
    tree = resolve_tree("mc26")
    plain = load_runner(src, heads="none")
    for p in PROMPTS:
        want, _ = run_tokens(plain, p, resolve_tree("plain"), 20)
        for art in (a, b):
            got, _ = run_tokens(load_runner(art), p, tree, 20)
            assert_identical(got, want, f"{art.name}", reference=plain)
    other = dataclasses.replace(
        counts, base_fingerprint={**counts.base_fingerprint, "lm_head_sha256": "0" * 16, "lm_head_probe": [1.0]}
    )
    with pytest.raises(CloverError, match="another base model"):
        with_draft_vocab(src, tmp_path / "c", other, 80)
    assert not (tmp_path / "c").exists()
