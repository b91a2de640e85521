"""Prompt-lookup drafts: the n-gram index, and greedy identity with plain decoding on every backend path
(portable and fused graphs, heads present or not)."""

import numpy as np
import pytest
from helpers import assert_identical, run_tokens
from ort_helpers import PROMPTS, tiny_artifact

from clover.artifact import open_artifact
from clover.errors import CloverError
from clover.runtime.backends.ort import load_runner
from clover.runtime.generator import Generator
from clover.runtime.lookup import NgramStore, PromptLookup
from clover.runtime.params import GenerationParams
from clover.runtime.proposers import Draft, merge_lookup
from clover.runtime.tokenizer import Tokenizer
from clover.runtime.tree import resolve_tree


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


def test_a_longer_match_drafts_longer():
    """The indexed n-gram's match is extended backwards to its real length L, and drafts up to 2L tokens."""
    seq = [8, 1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3, 4]  # tail (1, 2, 3, 4) repeats positions 1-4: L = 4
    lookup = PromptLookup(seq, max_ngram=3)
    assert lookup.match_length(5, 3) == 4
    assert lookup.propose(16).tolist() == [5, 6, 7, 9, 1, 2, 3, 4]  # 2L = 8
    assert lookup.propose(3).tolist() == [5, 6, 7]
    short = PromptLookup([7, 2, 3, 4, 5, 6, 7, 8, 9, 1, 3, 4], max_ngram=3)  # only (3, 4) repeats: L = 2
    assert short.propose(16).tolist() == [5, 6, 7, 8]
    store = NgramStore.build([([5, 6, 7, 8, 9, 1, 2], 0)] * 2, vocab_size=10)
    assert PromptLookup([3, 5, 6], store=store).propose(16).tolist() == [7, 8, 9, 1]  # its match of 2: up to 4


def test_under_a_grammar_the_match_it_allows_furthest_drafts():
    """propose_valid: among the kept occurrences of the tail's n-grams (and the store's draft), the continuation
    the grammar allows furthest, cut where it stops; ties go to propose's own draft."""
    seq = [1, 2, 5, 6, 7, 0, 1, 2, 8, 9, 0, 1, 2]  # (1, 2) was followed by 5 6 7 (oldest) and 8 9 0 (latest)
    lookup = PromptLookup(seq, max_ngram=2)
    assert lookup.propose(3).tolist() == [8, 9, 0]
    everything = lambda draft: len(draft)  # noqa: E731
    assert lookup.propose_valid(3, everything).tolist() == [8, 9, 0]
    no_eight = lambda draft: next((i for i, t in enumerate(draft) if t == 8), len(draft))  # noqa: E731
    assert lookup.propose_valid(3, no_eight).tolist() == [5, 6, 7]
    assert lookup.match == 2
    only_one = lambda draft: min(len(draft), 1)  # noqa: E731
    assert lookup.propose_valid(3, only_one).tolist() == [8]  # a tie: propose's draft
    assert lookup.propose_valid(3, lambda draft: 0).tolist() == []
    store = NgramStore.build([([3, 4, 6, 6, 6], 0)] * 2, vocab_size=10)
    stored = PromptLookup([9, 3, 4, 5, 3, 4], max_ngram=2, store=store)  # (3, 4) -> 5 here, -> 6 6 6 stored
    assert stored.propose(3).tolist() == [5, 3, 4]
    assert stored.propose_valid(3, lambda draft: 0 if draft[0] == 5 else len(draft)).tolist() == [6, 6, 6]
    assert stored.match < 0  # learned apart, as the store's drafts are


def test_under_a_grammar_a_word_that_recurs_as_other_tokens_drafts_what_followed_it():
    """With no n-gram of the sequence recurring, propose_valid looks for its last word as text: where it ended a
    whole word earlier, at a token's end, the tokens after it are drafted (up to 2 per token the word spans)."""
    pieces = {1: b"Tell me about", 2: b" Marie", 3: b" Curie", 4: b"'s work", 5: b'{"name": "', 6: b"Marie"}
    pieces |= {9: b" AnneMarie", 10: b" Maries", 11: b"Ma", 12: b"rie"}
    everything = lambda draft: len(draft)  # noqa: E731

    def lookup(seq):
        return PromptLookup(seq, texts=pieces.__getitem__)

    # "Marie" after the quote is token 6, " Marie" in the prompt token 2: no n-gram recurs, the word does
    assert lookup([1, 2, 3, 4, 5, 6]).propose(2).tolist() == []
    marie = lookup([1, 2, 3, 4, 5, 6])
    assert marie.propose_valid(4, everything).tolist() == [3, 4]  # the word spans one token: up to 2 drafts
    assert marie.match == 1
    assert lookup([1, 2, 3, 4, 5, 11, 12]).propose_valid(4, everything).tolist() == [3, 4, 5, 11]  # spans 2: up to 4
    assert lookup([1, 2, 3, 4, 5, 6]).propose_valid(4, lambda draft: 1).tolist() == [3]  # cut where it stops
    assert lookup([1, 9, 3, 5, 6]).propose_valid(4, everything).tolist() == []  # inside a word: not a match
    assert lookup([1, 10, 3, 5, 6]).propose_valid(4, everything).tolist() == []  # ends inside a token
    assert lookup([1, 2, 3, 5, 11]).propose_valid(4, everything).tolist() == []  # "Ma": too short
    assert PromptLookup([1, 2, 3, 4, 5, 6]).propose_valid(4, everything).tolist() == []  # no texts: no words


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
        gen.lookup_length = None  # verify every proposed token: acceptance counts independent of measured timings
        result = gen.generate(p, GenerationParams(max_new_tokens=40, ignore_eos=True))
        assert result.heads == "lookup"
        assert_identical(result.token_ids, want, f"lookup on {art.name}")
        accepted += sum(n - 1 for n in result.accepted_per_step)
    assert accepted > 0, "no lookup draft was accepted: the test did not exercise verification"
    return accepted


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
    r = g.generate([5, 9, 2, 7, 5, 9, 2, 7, 5, 9], GenerationParams(max_new_tokens=12))
    plain = Generator.load(art, heads="none", backend="ort").generate(
        [5, 9, 2, 7, 5, 9, 2, 7, 5, 9], GenerationParams(max_new_tokens=12)
    )
    assert r.token_ids == plain.token_ids and r.heads.endswith("+lookup")


# -- the n-gram store: every n-gram of a corpus of the base's own answers, and what followed it ---------------


def reference_propose(sequences, tail, k):
    """Brute force: the longest tail (2..STORE_LONGEST tokens) found in the stored texts (each answer after its
    prompt's last STORE_PROMPT_TAIL tokens), then per step the most frequent next token of the occurrences still
    going (smallest id on ties), the end of a text ending the draft."""
    from collections import Counter

    from clover.runtime.lookup import STORE_LONGEST, STORE_PROMPT_TAIL

    texts = [list(t[max(0, s - STORE_PROMPT_TAIL) :]) for t, s in sequences if s < len(t)]
    best_m, occ = 0, []
    for m in range(2, min(STORE_LONGEST, len(tail)) + 1):
        pat = list(tail[-m:])
        found = [(i, p + m) for i, t in enumerate(texts) for p in range(len(t) - m + 1) if t[p : p + m] == pat]
        if found:
            best_m, occ = m, found
    out = []
    while best_m and len(out) < k:
        nxt = Counter(texts[i][p] if p < len(texts[i]) else -1 for i, p in occ)  # -1: the text ends
        top = max(nxt.values())
        real = [t for t, c in nxt.items() if c == top and t != -1]
        if not real:
            break
        token = min(real)
        out.append(token)
        occ = [(i, p + 1) for i, p in occ if p < len(texts[i]) and texts[i][p] == token]
    return out, best_m


def test_store_matches_brute_force():
    """Longest tail by binary search over the suffix array, then the most frequent continuation token by token:
    equal to a scan of every stored text (answers after their prompt's turn header, small vocabulary so that
    matches and ties are common)."""
    rng = np.random.default_rng(3)
    sequences = [
        (rng.integers(0, 5, n).tolist(), int(s))
        for n, s in ((60, 5), (3, 1), (40, 0), (1, 0), (30, 29), (50, 10), (2, 2))
    ]
    store = NgramStore.build(sequences, vocab_size=5)
    assert len(store) == sum(len(t) - max(0, s - 3) + 1 for t, s in sequences if s < len(t))
    for _ in range(300):
        tail = rng.integers(0, 5, int(rng.integers(1, 12))).tolist()
        k = int(rng.integers(0, 8))
        want = reference_propose(sequences, tail, k)
        got = store.propose(tail, k)
        assert got == (want if k else ([], 0)), (tail, k, got, want)
    assert NgramStore.build([], 6).propose([1, 2], 3) == ([], 0)


def test_store_prefers_the_longest_match_and_chains():
    # after (1, 2): 3 twice and 4 twice (a tie: the smaller id); after (0, 1, 2): 4 twice; then 5, 6, the end
    seqs = [([1, 2, 3], 0), ([1, 2, 3], 0), ([0, 1, 2, 4, 5, 6], 0), ([0, 1, 2, 4, 5, 6], 0)]
    store = NgramStore.build(seqs, vocab_size=10)
    assert store.propose([1, 2], 1) == ([3], 2)
    assert store.propose([7, 0, 1, 2], 8) == ([4, 5, 6], 3)  # the 3-token match wins over (1, 2); stops at the end
    assert store.propose([9, 9], 3) == ([], 0) and store.propose([2], 3) == ([], 0)  # one token is too little
    long = NgramStore.build([(list(range(30)), 0)], vocab_size=40)
    assert long.match(list(range(30))[:28])[0] == 24  # matched up to STORE_LONGEST tokens back
    assert long.propose([39] + list(range(5)), 3) == ([5, 6, 7], 5)


def test_prompt_lookup_falls_back_to_the_store():
    store = NgramStore.build([([5, 6, 7, 8], 0)] * 2, vocab_size=10)  # (5, 6) -> 7 -> 8
    # a 2-token match in the sequence itself wins over the store
    look = PromptLookup([5, 6, 1, 5, 6], store=store)
    assert look.propose(3).tolist() == [1, 5, 6] and look.match == 2  # 2 matched: up to 4
    # a 1-token match gives way to the store's match of 2+ tokens; `match` is minus the store's
    look = PromptLookup([6, 2, 5, 6], store=store)
    assert look.propose(3).tolist() == [7, 8] and look.match == -2
    assert PromptLookup([6, 2, 5, 6]).propose(3).tolist() == [2, 5]  # 1 matched: up to 2
    # no match at all: the store; nothing in the store either: nothing
    assert PromptLookup([9, 5, 6], store=store).propose(2).tolist() == [7, 8]
    look = PromptLookup([9, 1, 2], store=store)
    assert look.propose(2).tolist() == [] and look.match == 0
    assert PromptLookup([9, 5, 6], store=store).propose(0).tolist() == []
    # a store match of m tokens drafts at most 2m, like a match in the sequence
    capped = NgramStore.build([(list(range(20)), 0)] * 2, vocab_size=20)
    assert PromptLookup([19, 3, 4], store=capped).propose(12).tolist() == [5, 6, 7, 8]


class CountingStore(NgramStore):
    """A real store that counts its searches."""

    searches = 0

    def propose(self, tokens, k, per_token=None):
        self.searches += 1
        return super().propose(tokens, k, per_token)


def test_each_store_is_searched_once_until_the_sequence_grows():
    store = NgramStore.build([([5, 6, 7, 8], 0)] * 2, vocab_size=10)
    served = NgramStore.build([([2, 5, 6, 7, 9], 0)] * 2, vocab_size=10)
    store.__class__ = served.__class__ = CountingStore
    # the tail (5, 6) recurs once in the sequence: the served answers are asked in propose, both stores under
    # the grammar (nothing valid below), and neither again for the same length
    look = PromptLookup([1, 5, 6, 2, 5, 6], store=store, served=served)
    assert look.propose(3).tolist() == [7, 9] and look.from_served  # served: (2, 5, 6) matches 3 > 2
    assert look.propose_valid(3, lambda draft: 0).tolist() == []
    look.propose(3)
    assert (served.searches, store.searches) == (1, 1)
    look.extend([7])
    look.propose(3)
    assert served.searches == 2


def test_store_of_a_large_vocabulary(tmp_path):
    """Ids past 16 bits are stored in 32 (big-endian, so the byte search still orders them), through a file."""
    big = [70000, 65536, 3, 70001, 65535, 9]
    store = NgramStore.build([(big, 0), ([1, 70000, 65536, 5], 0), ([1, 70000, 65536, 5], 0)], vocab_size=80000)
    assert store.tokens.dtype.itemsize == 4 and store.propose([7, 70000, 65536], 4) == ([5], 2)
    store.save(tmp_path / "big.npz")
    back = NgramStore.load(tmp_path / "big.npz")
    assert back.propose([70000, 65536, 3], 3) == ([70001, 65535, 9], 3)
    assert back.propose([2, 70001, 65535], 3) == ([9], 2)


def test_lookup_length_learns_store_drafts_apart():
    """The store's drafts (match < 0) have their own acceptance estimates: a store that is always wrong does
    not make the sequence's own repeats look bad, and is cut to nothing on a curve where rows cost."""
    from clover.runtime.policy import LookupLength

    ll = LookupLength(lambda rows: 10.0 + 3.0 * (rows - 1))
    for _ in range(50):
        ll.observe(-2, [1, 2, 3, 4], [9, 9, 9, 9])  # store: never right
        ll.observe(3, [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6])  # repeats: always right
    assert ll.choose(-2, 4) == 0 and ll.choose(3, 6) == 6
    assert LookupLength.kind(-2, 4) == 1 and LookupLength.kind(0, 0) == 0 and LookupLength.kind(5, 4) == 3


def test_store_file_round_trip_and_errors(tmp_path):
    store = NgramStore.build([([1, 2, 3, 4], 0)] * 2, vocab_size=8)
    store.save(tmp_path / "s.npz")
    back = NgramStore.load(tmp_path / "s.npz")
    np.testing.assert_array_equal(back.tokens, store.tokens)
    np.testing.assert_array_equal(back.sa, store.sa)
    assert back.propose([1, 2], 4) == ([3, 4], 2) and back.vocab_size == 8
    (tmp_path / "bad.npz").write_bytes(b"not a store")
    with pytest.raises(CloverError, match="cannot read the n-gram store .*bad.npz"):
        NgramStore.load(tmp_path / "bad.npz")
    np.savez(
        tmp_path / "old.npz",
        keys=np.zeros(1, np.uint64),
        next_ids=np.zeros(1, np.int32),
        share=np.ones(1, np.float32),
        vocab_size=np.int64(8),
    )  # STORE_FORMAT 1
    with pytest.raises(CloverError, match="older format: export the artifact again"):
        NgramStore.load(tmp_path / "old.npz")
    with pytest.raises(CloverError, match="separator"):
        NgramStore(np.array([1, 2, 3]), np.array([0, 1, 2]), vocab_size=8)  # no separator at the end
    with pytest.raises(CloverError, match="32 bits"):
        NgramStore.build([], vocab_size=1 << 32)


def own_answers_store(art):
    """A store of the tiny artifact's own greedy answers to a few prompts (as clover-export --ngram-store builds
    from clover-data grow's corpus), so that its drafts are often right."""
    from clover.export.ngram_store import StoreSource

    plain = load_runner(art, heads="none")
    seqs = []
    for p in ([3, 4, 5], [20, 21], [60, 2, 61], [7, 8, 9, 10, 11], [30, 31, 32]):
        out, _ = run_tokens(plain, p, resolve_tree("plain"), 40)
        seqs.append((p + out, len(p)))
    m = open_artifact(art)
    return StoreSource(NgramStore.build(seqs, m.base_config["vocab_size"]), "tiny answers", m.base_fingerprint)


@pytest.mark.parametrize("kind", ["portable", "fused-int4"])
def test_store_drafts_keep_greedy_identity(tmp_path_factory, tmp_path, kind):
    """An artifact with an n-gram store (added by with_ngram_store, no re-export): lookup and heads+lookup give
    plain greedy output, and the store's drafts were accepted more than prompt lookup's alone."""
    from clover.export.ngram_store import with_ngram_store

    root = tmp_path_factory.getbasetemp()
    if kind == "portable":
        src = tiny_artifact(root, "clover2", tree="mc26")
    else:
        src = tiny_artifact(root, "clover2", tree="chain-3", weights="int4", attention="fused")
    source = own_answers_store(src)
    art = with_ngram_store(src, tmp_path / "with-store", source)
    m = open_artifact(art)
    assert m.ngram_store.contexts == len(source.store) and m.ngram_store.source == "tiny answers"
    assert load_runner(art, heads="none").info.ngram_store is not None
    assert load_runner(src, heads="none").info.ngram_store is None
    with_store = greedy_identity(art, "none", "chain-3")
    without = greedy_identity(src, "none", "chain-3")
    assert with_store > without, (with_store, without)
    greedy_identity(art, "artifact", "chain-2")
    tokenizer = Tokenizer.from_dir(art / m.tokenizer)
    plain = load_runner(art, heads="none")
    for p in PROMPTS:
        want, _ = run_tokens(plain, p, resolve_tree("plain"), 30)
        got = Generator(load_runner(art), tokenizer, "chain-2", drafts="heads+lookup").generate(
            p, GenerationParams(max_new_tokens=30, ignore_eos=True)
        )
        assert_identical(got.token_ids, want, f"heads+lookup with a store on {kind}")
    bare = with_ngram_store(art, tmp_path / "bare", None)  # and taken out again
    assert open_artifact(bare).ngram_store is None and not (bare / "ngram_store.npz").exists()


def test_store_of_another_base_is_refused(tmp_path_factory, tmp_path):
    import dataclasses

    from clover.export.ngram_store import with_ngram_store

    src = tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", tree="mc26")
    source = own_answers_store(src)
    other = dataclasses.replace(
        source, base_fingerprint={**source.base_fingerprint, "lm_head_sha256": "0" * 16, "lm_head_probe": [1.0]}
    )
    with pytest.raises(CloverError, match="another base model"):
        with_ngram_store(src, tmp_path / "x", other)
    assert not (tmp_path / "x").exists()
    # a store file that does not match its manifest entry is refused on load, with the fix
    import json

    art = with_ngram_store(src, tmp_path / "y", source)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["ngram_store"]["contexts"] += 1
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CloverError, match="ngram_store.npz does not match its manifest entry .*export it again"):
        load_runner(art, heads="none")


def test_lookup_length_weighs_acceptance_against_verify_cost():
    """How much of a proposal to verify: all of it where rows are nearly free, less where they are dear, and
    what it learns moves the choice: repeats that always continue earn long chains, ones that never do earn none."""
    from clover.runtime.policy import LookupLength

    cheap = LookupLength(lambda rows: 10.0 + 0.01 * rows)  # bandwidth-bound: a row costs 0.1% of a step
    dear = LookupLength(lambda rows: 10.0 * rows)  # compute-bound: a row costs a whole step
    assert cheap.choose(4, 8) == 8 and dear.choose(4, 8) == 0
    assert cheap.choose(4, 0) == 0
    mid = LookupLength(lambda rows: 10.0 + 3.0 * rows)
    before = mid.choose(3, 6)
    for _ in range(50):  # a 3-token match whose whole proposal was right every time (step emitted 7 tokens)
        mid.observe(3, [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 9])
    assert mid.choose(3, 6) == 6 > before
    for _ in range(200):  # the store's drafts: the first token was always wrong
        mid.observe(0, [1, 2, 3], [7, 8])
    assert mid.choose(0, 3) == 0
    # a left-out token is still learned from: only 1 of 3 verified, the step emitted the 2nd as its bonus token
    seen = LookupLength(lambda rows: 1.0)
    seen.observe(2, [5, 6, 7], [5, 6])
    assert seen.trials[2:5].tolist() == [1, 1, 0] and seen.hits[2:5].tolist() == [1, 1, 0]


def test_lookup_goes_alone_where_the_heads_do_not_pay():
    """heads+lookup: each kind of proposal tries both ways (heads merged first), then takes the one with more
    tokens per measured millisecond, and the other now and then, so both rates stay current."""
    from clover.runtime.policy import LookupLength

    W, E = LookupLength.WARMUP, LookupLength.EXPLORE
    ll = LookupLength(lambda rows: 1.0)
    tried = []
    for _ in range(2 * W):  # a long repeat: alone 5 tokens in 10 ms, merged 4 in 12
        tried.append(ll.alone(6, 8))
        ll.observe_step(LookupLength.kind(6, 8), tried[-1], 5 if tried[-1] else 4, 10.0 if tried[-1] else 12.0)
    assert tried == [False] * W + [True] * W
    runs = [ll.alone(6, 8) for _ in range(2 * E)]
    assert runs.count(False) == 2 and runs[E - 1] is False
    assert not ll.alone(0, 0) and not ll.alone(0, 3)  # other kinds learn on their own (merged first)
    useful = LookupLength(lambda rows: 1.0)
    for _ in range(2 * W):  # a short repeat: alone 1.2 tokens in 10 ms, merged 2 in 12
        a = useful.alone(2, 4)
        useful.observe_step(LookupLength.kind(2, 4), a, 1.2 if a else 2.0, 10.0 if a else 12.0)
    assert [useful.alone(2, 4) for _ in range(E - 1)] == [False] * (E - 1)
    near = LookupLength(lambda rows: 1.0)  # a near tie (alone 3% ahead) stays merged
    for a in [False] * W + [True] * W:
        assert near.alone(2, 4) is a
        near.observe_step(LookupLength.kind(2, 4), a, 1.03 if a else 1.0, 10.0)
    assert not near.alone(2, 4)


@pytest.mark.parametrize("tree", ["chain-2", "dynamic-4"])
def test_heads_plus_lookup_alone_steps_keep_greedy_identity(tmp_path_factory, tree):
    """Steps that verify the lookup proposal without drafting the heads (here: every other step) give plain
    greedy output, with static and dynamic trees, and the heads catch up on the skipped rows when they draft
    again."""
    root = tmp_path_factory.getbasetemp()
    art = tiny_artifact(root, "clover2", tree="chain-3", weights="int4", attention="fused")
    tokenizer = Tokenizer.from_dir(art / open_artifact(art).tokenizer)
    plain = load_runner(art, heads="none")
    chosen = []
    for p in PROMPTS + [[7, 8, 9, 7, 8, 9, 7, 8]]:
        want, _ = run_tokens(plain, p, resolve_tree("plain"), 40)
        gen = Generator(load_runner(art), tokenizer, tree, drafts="heads+lookup")
        gen.lookup_length.alone = lambda *a: chosen.append(len(chosen) % 2 == 0) or chosen[-1]
        got = gen.generate(p, GenerationParams(max_new_tokens=40, ignore_eos=True))
        assert_identical(got.token_ids, want, "heads+lookup with lookup-alone steps")
    assert len(chosen) > 10


def test_a_crafted_store_is_refused_at_load(tmp_path):
    """Bounds are checked once at load: a suffix array pointing past the tokens, ids past the vocabulary, a
    truncated file: one CloverError line, never an index error inside a step."""
    store = NgramStore.build([([5, 6, 7, 8, 9, 1, 2], 0)] * 2, vocab_size=10)
    good = tmp_path / "good.npz"
    store.save(good)
    assert len(NgramStore.load(good)) == len(store)

    def crafted(name, **arrays):
        path = tmp_path / name
        parts = dict(format=np.int64(3), tokens=store.tokens, sa=store.sa, vocab_size=np.int64(10))
        with np.load(good) as z:
            parts["format"] = z["format"]
        parts.update(arrays)
        with open(path, "wb") as f:
            np.savez(f, **parts)
        return path

    sa = np.array(store.sa)
    sa[0] = len(store.tokens) + 5
    for path, words in (
        (crafted("sa.npz", sa=sa), "points outside"),
        (crafted("vocab.npz", vocab_size=np.int64(3)), "below its vocabulary"),
    ):
        with pytest.raises(CloverError, match=words) as e:
            NgramStore.load(path)
        assert "\n" not in str(e.value)
    truncated = tmp_path / "cut.npz"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CloverError, match="cannot read the n-gram store"):
        NgramStore.load(truncated)
