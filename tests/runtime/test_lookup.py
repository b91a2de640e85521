"""Prompt-lookup drafts: the n-gram index, and greedy identity with plain decoding on every backend path
(portable and fused graphs, heads present or not)."""

import numpy as np
import pytest

from clover.errors import CloverError
from clover.runtime.generator import Generator
from clover.runtime.lookup import PromptLookup
from clover.runtime.loop import Draft, merge_lookup
from clover.runtime.ort_backend import load_runner
from clover.runtime.tokenizer import Tokenizer
from clover.artifact import open_artifact
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


# -- heads+lookup: the lookup path merged into the heads' tree ------------------------------------------------

def heads_draft(tree, tokens):
    return Draft(np.array(tokens, dtype=np.int64), np.ones(tree.num_nodes, dtype=bool), None)


def test_merge_follows_drafted_nodes_then_branches():
    tree = resolve_tree("small")  # root children ranks 0..; nodes sorted by (depth, path)
    tokens = [100] + [200 + i for i in range(1, tree.num_nodes)]
    first = int(tree.children[0][0])  # the rank-0 child of the root
    merged, draft = merge_lookup(tree, heads_draft(tree, tokens), np.array([tokens[first], 7, 8]))
    assert merged.num_nodes == tree.num_nodes + 2  # the first token was drafted: only 7 and 8 are new rows
    new = np.flatnonzero(draft.point)
    assert draft.tokens[new].tolist() == [7, 8]
    kept = np.flatnonzero(draft.heads >= 0)
    assert len(kept) == tree.num_nodes and draft.tokens[kept].tolist() == [tokens[i] for i in draft.heads[kept]]
    seven = new[0]
    assert merged.choices[merged.parent[seven] - 1] == tree.choices[first - 1]  # under the matched head node
    assert merged.rank[seven] == len(tree.children[first])  # after that node's drafted children
    assert merged.parent[new[1]] == seven


def test_merge_of_a_drafted_or_empty_proposal_changes_nothing():
    tree = resolve_tree("chain-2")
    d = heads_draft(tree, [1, 2, 3])
    assert merge_lookup(tree, d, np.array([2, 3]))[0] is tree
    assert merge_lookup(tree, d, np.zeros(0, dtype=np.int64))[0] is tree


def test_merge_on_a_chains_only_graph_keeps_a_chain():
    tree = resolve_tree("chain-3")
    merged, draft = merge_lookup(tree, heads_draft(tree, [1, 2, 3, 4]), np.array([2, 9, 9]), chains_only=True)
    assert merged.is_chain and draft.tokens.tolist() == [1, 2, 9, 9]  # the heads' 3, 4 give way after the match
    assert draft.heads.tolist() == [0, 1, -1, -1] and draft.point.tolist() == [False, False, True, True]
    merged, draft = merge_lookup(tree, heads_draft(tree, [1, 2, 3, 4]), np.array([5]), chains_only=False)
    assert not merged.is_chain and draft.tokens.tolist() == [1, 2, 5, 3, 4]


def test_heads_plus_lookup_spec_and_label(tmp_path):
    """'NAME+lookup' loads the heads and merges lookup; results say so."""
    art = tiny_artifact(tmp_path, "clover2")
    g = Generator.load(art, heads="artifact+lookup", backend="ort", tree="small")
    assert g.drafts == "heads+lookup" and g.runner.info.heads == "clover2"
    r = g.generate([5, 9, 2, 7, 5, 9, 2, 7, 5, 9], max_new_tokens=12)
    plain = Generator.load(art, heads="none", backend="ort").generate([5, 9, 2, 7, 5, 9, 2, 7, 5, 9], max_new_tokens=12)
    assert r.token_ids == plain.token_ids and r.heads.endswith("+lookup")
