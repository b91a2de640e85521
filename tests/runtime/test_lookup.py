"""Prompt-lookup drafts: the n-gram index, and greedy identity with plain decoding on every backend path
(portable and fused graphs, heads present or not)."""

import numpy as np
import pytest

from clover.errors import CloverError
from clover.runtime.generator import Generator
from clover.runtime.lookup import PromptLookup
from clover.runtime.ort_backend import load_runner
from clover.runtime.tokenizer import Tokenizer
from clover.runtime.artifact import open_artifact
from clover.runtime.tree import resolve_tree
from helpers import assert_identical, run_tokens
from ort_helpers import PROMPTS, tiny_artifact


def test_longest_latest_match_first():
    seq = [1, 2, 3, 9, 2, 3, 7, 5, 1, 2, 3]
    lookup = PromptLookup(seq, max_ngram=3)
    # the 3-gram (1, 2, 3) occurred at 0 (followed by 9); the 2-gram (2, 3) last at 4 (followed by 7)
    assert lookup.propose(3).tolist() == [9, 2, 3]
    lookup.extend([4])
    assert lookup.propose(2).tolist() == []  # (.., 3, 4): 4 never occurred before
    lookup.extend([2, 3])
    assert lookup.propose(2).tolist() == [4, 2]  # (4, 2, 3) is new; (2, 3) was last followed by 4, 2
    assert PromptLookup([5]).propose(4).tolist() == []
    assert PromptLookup([5, 5, 5]).propose(4).tolist() == [5]  # the continuation stops at the sequence end


def test_bad_ngram_bounds():
    with pytest.raises(CloverError, match="1 <= min_ngram <= max_ngram"):
        PromptLookup([1], max_ngram=1, min_ngram=2)


def greedy_identity(art, heads, tree):
    plain = load_runner(art, heads="none")
    runner = load_runner(art, heads=heads)
    tokenizer = Tokenizer.from_dir(art / open_artifact(art).tokenizer)
    accepted = 0
    for p in PROMPTS + [[7, 8, 9, 7, 8, 9, 7, 8]]:
        want, _ = run_tokens(plain, p, resolve_tree("plain"), 40)
        gen = Generator(runner, tokenizer, tree, drafts="lookup")
        result = gen.generate(p, max_new_tokens=40, ignore_eos=True)
        assert result.heads == "lookup"
        assert_identical(result.token_ids, want, f"lookup on {art.name}")
        accepted += sum(n - 1 for n in result.accepted_per_step)
    assert accepted > 0, "no lookup draft was accepted: the test did not exercise verification"


@pytest.mark.parametrize("kind", ["portable", "fused-int4"])
def test_lookup_greedy_equals_plain(tmp_path_factory, kind):
    root = tmp_path_factory.getbasetemp()
    if kind == "portable":
        art = tiny_artifact(root, "clover2", tree="mc26")
    else:
        art = tiny_artifact(root, "clover2", tree="chain-3", weights="int4", attention="fused")
    greedy_identity(art, "none", "chain-3")
    greedy_identity(art, "artifact", "chain-2")  # a runner with heads: lookup ignores them


def test_lookup_needs_a_chain(tmp_path_factory):
    art = tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", tree="mc26")
    tokenizer = Tokenizer.from_dir(art / open_artifact(art).tokenizer)
    with pytest.raises(CloverError, match="tree mc26 branches: use chain-N"):
        Generator(load_runner(art, heads="none"), tokenizer, "mc26", drafts="lookup")
    with pytest.raises(CloverError, match="unknown draft source 'ngram'"):
        Generator(load_runner(art, heads="none"), tokenizer, "chain-2", drafts="ngram")
