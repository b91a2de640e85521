"""Speculative sampling is lossless end to end: the real loop emits the base model's own sampling law.

`speculative_steps` is driven with real (random-init) draft heads - Clover-2 on the 26-node `mc26` tree,
Medusa on the depth-4 `small` tree - at temperature 0.9, with and without top-p, on a tiny random base
with a 12-token vocabulary. The first generated token x1 comes from the prefill; x2 and x3 come from
speculative steps, i.e. from drafting, verification, recursive rejection sampling over siblings,
bonus tokens and KV compaction. The exact reference law is computed with plain base forwards of
prompt + prefix (no cache, no tree) through the same `probs_from_logits`:

    joint law of (x1, x2): V * V cells;  marginal law of x3: sum over (x1, x2) of P(x1, x2) p(x3 | x1, x2).

N independent generations (one numpy generator per run, spawned from one fixed master seed) are
compared with it by Pearson chi-square goodness of fit (cells with expected count < 5 merged into
one), at significance level ALPHA = 1e-3 per check. Zero-probability cells (outside the top-p
nucleus) must be empty, checked exactly.

The seeds are fixed, so the test is deterministic: it passes or fails the same way on every run. If
the loop were exact, a given seed would fail a check only with probability 1e-3 (that is how the seed
was vetted: every check passes with p-values far from ALPHA); so a failure after a code change means,
with high probability, that the emitted tokens no longer follow the base model's law - a real bias.

The test is not vacuous: the same counts are rejected against plausible wrong laws (the draft heads'
own law, a law that forgets x1), a textbook broken verifier (rejection without the residual update)
run through the same loop is rejected, and every case asserts that draft tokens were both accepted
and rejected, so the rejection-sampling path, not only the bonus-token path, is what was measured.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import tiny_base
from scipy import stats

import clover.runtime.acceptance as acceptance
from clover.models.decoder import causal_mask
from clover.models.head_io import random_heads
from clover.runtime.backends.torch_runner import TorchRunner
from clover.runtime.loop import Decoding, speculative_steps, step
from clover.runtime.params import GenerationParams
from clover.runtime.sampling import SamplingParams, probs_from_logits, sample_token
from clover.runtime.tree import compile_tree, resolve_tree

ALPHA = 1e-3
V = 12  # vocabulary: V * V joint cells stay cheap to enumerate exactly
# Embedding scale 0.035 on seed 0: next-token laws have max probability ~0.3-0.65 at temperature 0.9
# (neither near-uniform nor near-one-hot; see test_reference_laws_are_informative).
BASE_SEED, BASE_SCALE = 0, 0.035
PROMPT = [3, 7, 1, 9]
TEMPERATURE = 0.9
NUM_TOKENS = 3  # x1 (prefill), x2, x3 (speculative steps)
N = 1000  # generations per case
N_BROKEN = 400  # generations for the broken-verifier power check (its bias is large)
MASTER_SEED = 20_240_805

# (arch, tree, law): law is top_p, or (top_p, top_k, min_p)
CASES = [
    ("clover2", "mc26", 1.0),
    ("clover2", "mc26", 0.8),
    ("medusa", "small", 1.0),
    ("clover2", "mc26", (1.0, 6, 0.05)),
]
CASE_IDS = [
    f"{a}-{t}-top_p{p}" if not isinstance(p, tuple) else f"{a}-{t}-top_p{p[0]}-top_k{p[1]}-min_p{p[2]}"
    for a, t, p in CASES
]


def sampling_params(law: float | tuple[float, int, float]) -> SamplingParams:
    top_p, top_k, min_p = law if isinstance(law, tuple) else (law, 0, 0.0)
    return SamplingParams(temperature=TEMPERATURE, top_p=top_p, top_k=top_k, min_p=min_p)


# -- exact reference ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base():
    return tiny_base(seed=BASE_SEED, scale=BASE_SCALE, vocab=V)


@pytest.fixture(scope="module")
def base_logits(base):
    """Plain base logits: l1 [V] after the prompt, l2 [V, V] after prompt + x1, l3 [V, V, V] after
    prompt + x1 + x2. One uncached forward of prompt + [x1, x2] per pair (a causal chain, empty cache)."""
    P = len(PROMPT)
    l2 = np.zeros((V, V))
    l3 = np.zeros((V, V, V))
    T = P + 2
    with torch.inference_mode():
        for x1 in range(V):
            for x2 in range(V):
                ids = torch.tensor([PROMPT + [x1, x2]])
                out = base(ids, torch.arange(T)[None], causal_mask(T), torch.tensor([0]), *base.empty_cache(1, 0))
                logits = out.logits[0].double().numpy()  # [T, V]
                l1 = logits[P - 1]
                l2[x1] = logits[P]
                l3[x1, x2] = logits[P + 1]
    return l1, l2, l3


def exact_laws(base_logits, sampling: SamplingParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(joint [V, V] law of (x1, x2), marginal [V] law of x3, conditional [V, V, V] p(x3 | x1, x2))."""
    l1, l2, l3 = base_logits
    p1 = probs_from_logits(l1[None], sampling)[0]  # [V]
    p2 = probs_from_logits(l2, sampling)  # [V(x1), V]
    p3 = probs_from_logits(l3.reshape(V * V, V), sampling).reshape(V, V, V)
    joint = p1[:, None] * p2
    return joint, np.einsum("ab,abc->c", joint, p3), p3


# -- sampling through the real loop ------------------------------------------------------------------


def first_tokens(runner: TorchRunner, tree, sampling: SamplingParams, n: int, seed: int, drafts: str = "heads"):
    """n generations of the first NUM_TOKENS tokens; returns (tokens [n, 3], per-step emitted counts of
    the speculative steps, number of steps that verified the full tree)."""
    prompt = np.array(PROMPT, dtype=np.int64)
    capacity = len(PROMPT) + NUM_TOKENS + tree.num_nodes
    tokens = np.zeros((n, NUM_TOKENS), dtype=np.int64)
    lengths, full_tree_steps = [], 0
    for i, child in enumerate(np.random.SeedSequence(seed).spawn(n)):
        params = GenerationParams(sampling=dataclasses.replace(sampling, seed=int(child.generate_state(1)[0])))
        out: list[int] = []
        for k, st in enumerate(speculative_steps(runner, prompt, tree, params, drafts, capacity=capacity)):
            out += st.tokens
            if k:
                lengths.append(len(st.tokens))
                full_tree_steps += st.tree_nodes == tree.num_nodes
            if len(out) >= NUM_TOKENS:
                break
        tokens[i] = out[:NUM_TOKENS]
    return tokens, np.array(lengths), full_tree_steps


@pytest.fixture(scope="module")
def samples(base):
    """Lazily computed, cached per case: (tokens [N, 3], step lengths, full-tree step count, runner)."""
    cache = {}

    def get(arch: str, tree: str, top_p: float):
        key = (arch, tree, top_p)
        if key not in cache:
            runner = TorchRunner(base, random_heads(base, arch, seed=0))  # reset by every speculative_steps
            t = resolve_tree(tree)
            assert runner.info.heads_max_depth is None or t.max_depth <= runner.info.heads_max_depth
            cache[key] = (*first_tokens(runner, t, sampling_params(top_p), N, MASTER_SEED), runner)
        return cache[key]

    return get


# -- goodness of fit ---------------------------------------------------------------------------------


def counts_of(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(counts [V, V] of (x1, x2), counts [V] of x3)."""
    joint = np.zeros((V, V), dtype=np.int64)
    np.add.at(joint, (tokens[:, 0], tokens[:, 1]), 1)
    return joint, np.bincount(tokens[:, 2], minlength=V)


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of counts against n * probs; cells expecting < 5 are merged into one
    (and that cell into the smallest other one if it still expects < 5). Zero-probability cells must be
    empty (asserted: such a token is a bias no matter how rare)."""
    counts, probs = counts.ravel(), probs.ravel()
    bad = np.flatnonzero((probs == 0) & (counts > 0))
    assert bad.size == 0, f"emitted zero-probability cells {bad.tolist()} (counts {counts[bad].tolist()})"
    n = counts.sum()
    expected = n * probs
    small = expected < 5
    obs, exp = list(counts[~small].astype(float)), list(expected[~small])
    if small.any() and expected[small].sum() > 0:
        lumped_obs, lumped_exp = float(counts[small].sum()), float(expected[small].sum())
        if lumped_exp < 5:
            j = int(np.argmin(exp))
            obs[j] += lumped_obs
            exp[j] += lumped_exp
        else:
            obs.append(lumped_obs)
            exp.append(lumped_exp)
    obs_a, exp_a = np.array(obs), np.array(exp)
    assert obs_a.size >= 2, "too few cells for a chi-square test"
    return float(stats.chisquare(obs_a, exp_a * obs_a.sum() / exp_a.sum()).pvalue)


# -- tests -------------------------------------------------------------------------------------------


def test_reference_laws_are_informative(base_logits):
    """The tiny base is in the regime the test needs: laws neither flat nor one-hot; top-p truncates."""
    l1, l2, _ = base_logits
    p = probs_from_logits(np.vstack([l1[None], l2]), sampling_params(1.0))  # [1 + V, V]
    top = p.max(axis=1)
    assert 0.2 < top.min() and top.max() < 0.8, top
    entropy = -(p * np.log(p)).sum(axis=1)
    assert np.all(entropy > 0.5) and np.all(entropy < 0.95 * np.log(V)), entropy
    kept = (probs_from_logits(np.vstack([l1[None], l2]), sampling_params(0.8)) > 0).sum(axis=1)
    assert kept.min() >= 2 and kept.max() < V, kept  # top-p removes tokens but leaves a choice
    kept = (probs_from_logits(np.vstack([l1[None], l2]), sampling_params(CASES[3][2])) > 0).sum(axis=1)
    assert kept.min() >= 2 and kept.max() <= 6, kept  # so do top-k and min-p
    joint, marginal, _ = exact_laws(base_logits, sampling_params(1.0))
    assert np.isclose(joint.sum(), 1.0) and np.isclose(marginal.sum(), 1.0)


@pytest.mark.parametrize("arch,tree,top_p", CASES, ids=CASE_IDS)
def test_speculative_sampling_matches_base_law(base_logits, samples, arch, tree, top_p):
    tokens, lengths, full_tree_steps, _ = samples(arch, tree, top_p)
    joint, marginal, _ = exact_laws(base_logits, sampling_params(top_p))
    c12, c3 = counts_of(tokens)
    p12, p3 = chi2_pvalue(c12, joint), chi2_pvalue(c3, marginal)
    # The speculative path was really exercised: the first speculative step of every run verified the
    # whole tree; draft tokens were accepted (steps emitting > 1 token, some >= 3: depth-2 acceptance)
    # and every root candidate was rejected in other steps (1 token: the bonus from the residual).
    assert full_tree_steps >= N
    assert np.mean(lengths > 1) > 0.5, np.bincount(lengths)
    assert np.mean(lengths >= 3) > 0.2, np.bincount(lengths)
    assert np.mean(lengths == 1) > 0.1, np.bincount(lengths)
    assert p12 > ALPHA, f"(x1, x2) joint law differs from the base's: chi-square p = {p12:.2e}"
    assert p3 > ALPHA, f"x3 marginal law differs from the base's: chi-square p = {p3:.2e}"


LOOKUP_PROMPT_NOTE = "x1 in PROMPT: its successor there is drafted (one-hot law), accepted w.p. p(x2)"


def test_lookup_drafts_sample_the_base_law(base, base_logits):
    """Prompt-lookup drafts (a point-mass draft law) through the same loop keep the base's law: from the sequence
    itself (x1 odd: x1 in PROMPT, its successor there) and from an n-gram store (x1 even: the store knows
    (PROMPT[-1], x1) and drafts the base's two most likely next tokens, runtime/lookup.py)."""
    from clover.runtime.lookup import NgramStore

    l1, l2, l3 = base_logits
    seqs = []
    for x1 in range(0, V, 2):
        y = int(np.argmax(l2[x1]))
        seqs += [([PROMPT[-1], x1, y, int(np.argmax(l3[x1, y]))], 2)] * 2  # contexts (9, x1) and (x1, y), twice
    sampling = sampling_params(1.0)
    runner = TorchRunner(base, None, ngram_store=NgramStore.build(seqs, V))
    tokens, lengths, _ = first_tokens(runner, resolve_tree("chain-2"), sampling, N, MASTER_SEED + 1, drafts="lookup")
    joint, marginal, _ = exact_laws(base_logits, sampling)
    c12, c3 = counts_of(tokens)
    # Drafts were proposed and both accepted (> 1 token per step) and rejected (1 token) often.
    assert np.mean(lengths > 1) > 0.1 and np.mean(lengths == 1) > 0.3, (LOOKUP_PROMPT_NOTE, np.bincount(lengths))
    p12, p3 = chi2_pvalue(c12, joint), chi2_pvalue(c3, marginal)
    assert p12 > ALPHA, f"(x1, x2) joint law differs from the base's with lookup drafts: p = {p12:.2e}"
    assert p3 > ALPHA, f"x3 marginal law differs from the base's with lookup drafts: p = {p3:.2e}"


def draft_law(runner: TorchRunner, sampling: SamplingParams) -> np.ndarray:
    """[V(x1), V] the draft heads' law for the root's children after prompt + x1 (what rank 0 draws)."""
    P = len(PROMPT)
    q = np.zeros((V, V))
    for x1 in range(V):
        runner.reset(P + 1)
        runner.forward(np.array(PROMPT), np.arange(P), np.tri(P, dtype=bool), last_only=True)
        runner.commit(np.arange(P), np.array(PROMPT[1:] + [x1]))
        q[x1] = probs_from_logits(runner.draft_begin()[None], sampling)[0]
    return q


def test_goodness_of_fit_rejects_wrong_laws(base_logits, samples):
    """Power: the very counts that pass against the base law fail against plausible wrong laws."""
    tokens, _, _, runner = samples(*CASES[0])
    sampling = sampling_params(CASES[0][2])
    joint, _, _ = exact_laws(base_logits, sampling)
    c12, _ = counts_of(tokens)
    p1 = joint.sum(axis=1)
    # (a) x2 from the draft heads (a verifier that always accepted the first candidate);
    # (b) x2 from its marginal, independent of x1 (a cache / position mix-up that loses x1).
    wrong = {
        "draft-head law": p1[:, None] * draft_law(runner, sampling),
        "x2 independent of x1": np.outer(p1, joint.sum(axis=0)),
    }
    assert chi2_pvalue(c12, joint) > ALPHA
    for name, law in wrong.items():
        p = chi2_pvalue(c12, law)
        assert p < ALPHA, f"chi-square failed to reject the {name}: p = {p:.2e}"


def verify_node_without_residual(p, q, candidates, rng, point=None):
    """A classic broken verifier: after a rejection it keeps the target p instead of moving to the
    residual normalize(max(p - q, 0)), so tokens the draft favours are over-emitted."""
    assert point is None  # heads-only drafts
    p = np.asarray(p, dtype=np.float64) / np.sum(p)
    if len(candidates) == 0:  # the prefill and plain steps: nothing to verify
        return -1, sample_token(p, rng)
    q_j = np.asarray(q, dtype=np.float64) / np.sum(q)
    for j, x in enumerate(candidates):
        x = int(x)
        if rng.random() * q_j[x] < p[x]:
            return j, x
        q_j = q_j.copy()
        q_j[x] = 0.0
        q_j /= q_j.sum()
    return -1, sample_token(p, rng)


def test_broken_verifier_is_detected(base, base_logits, monkeypatch):
    """Power through the real loop: the same harness, with the residual step removed, fails."""
    arch, tree, top_p = CASES[0]
    sampling = sampling_params(top_p)
    monkeypatch.setattr(acceptance, "verify_node", verify_node_without_residual)
    runner = TorchRunner(base, random_heads(base, arch, seed=0))
    tokens, lengths, _ = first_tokens(runner, resolve_tree(tree), sampling, N_BROKEN, MASTER_SEED + 1)
    assert np.mean(lengths > 1) > 0.5
    joint, _, _ = exact_laws(base_logits, sampling)
    c12, _ = counts_of(tokens)
    p = chi2_pvalue(c12, joint)
    assert p < ALPHA, f"a verifier without the residual update went undetected: p = {p:.2e}"


def batched_first_tokens(runner: TorchRunner, tree, sampling: SamplingParams, n: int, seed: int, batch: int = 8):
    """first_tokens, but `batch` generations at a time share every step (clover.runtime.loop.step, one slot
    each, as clover.Engine runs them); returns (tokens [n, 3], per-step emitted counts)."""
    prompt = np.array(PROMPT, dtype=np.int64)
    capacity = len(PROMPT) + NUM_TOKENS + tree.num_nodes
    tokens = np.zeros((n, NUM_TOKENS), dtype=np.int64)
    children = np.random.SeedSequence(seed).spawn(n)
    lengths = []
    for start in range(0, n, batch):
        group = range(start, min(start + batch, n))
        ds = [
            Decoding(
                slot=runner.open_slot(capacity),
                prompt=prompt,
                tree=tree,
                sampling=sampling,
                rng=np.random.default_rng(children[i]),
            )
            for i in group
        ]
        outs: list[list[int]] = [[] for _ in ds]
        while any(len(o) < NUM_TOKENS for o in outs):
            live = [k for k, o in enumerate(outs) if len(o) < NUM_TOKENS]
            for k, st in zip(live, step(runner, [ds[k] for k in live])):
                if st.tokens and outs[k]:  # a speculative step (the prefill's first token is not one)
                    lengths.append(len(st.tokens))
                outs[k] += st.tokens
        for i, d, o in zip(group, ds, outs):
            tokens[i] = o[:NUM_TOKENS]
            runner.release(d.slot)
    return tokens, np.array(lengths)


def test_batched_steps_sample_the_base_law(base, base_logits):
    """Generations sharing steps in batches of 8 (each with its own generator) keep the base's law."""
    sampling = sampling_params(1.0)
    runner = TorchRunner(base, random_heads(base, "clover2", seed=0))
    tokens, lengths = batched_first_tokens(runner, resolve_tree("mc26"), sampling, N, MASTER_SEED + 2)
    joint, marginal, _ = exact_laws(base_logits, sampling)
    c12, c3 = counts_of(tokens)
    assert np.mean(lengths > 1) > 0.5 and np.mean(lengths == 1) > 0.1, np.bincount(lengths)
    p12, p3 = chi2_pvalue(c12, joint), chi2_pvalue(c3, marginal)
    assert p12 > ALPHA, f"(x1, x2) joint law differs from the base's in batched steps: p = {p12:.2e}"
    assert p3 > ALPHA, f"x3 marginal law differs from the base's in batched steps: p = {p3:.2e}"


def test_heads_and_lookup_in_one_tree_sample_the_base_law(base, base_logits):
    """heads+lookup: the lookup path joins the heads' sampled tree as point-mass nodes, verified after their
    sampled siblings; the loop still emits the base's law, and merged trees were verified and accepted."""
    sampling = sampling_params(1.0)
    runner = TorchRunner(base, random_heads(base, "clover2", seed=0))
    tree = resolve_tree("chain-2")
    prompt = np.array(PROMPT, dtype=np.int64)
    tokens = np.zeros((N, NUM_TOKENS), dtype=np.int64)
    merged = lookup_accepted = 0
    for i, child in enumerate(np.random.SeedSequence(MASTER_SEED + 3).spawn(N)):
        out: list[int] = []
        steps = speculative_steps(
            runner,
            prompt,
            tree,
            GenerationParams(sampling=dataclasses.replace(sampling, seed=int(child.generate_state(1)[0]))),
            "heads+lookup",
            capacity=len(PROMPT) + NUM_TOKENS + tree.num_nodes + 3,
        )
        for k, st in enumerate(steps):
            out += st.tokens
            if k and st.heads_tree is not None:
                merged += 1
                lookup_accepted += len(st.heads_path) < len(st.path)  # the accepted path left the heads' nodes
            if len(out) >= NUM_TOKENS:
                break
        tokens[i] = out[:NUM_TOKENS]
    assert merged > 0.1 * N and lookup_accepted > 0.02 * N, (LOOKUP_PROMPT_NOTE, merged, lookup_accepted)
    joint, marginal, _ = exact_laws(base_logits, sampling)
    c12, c3 = counts_of(tokens)
    p12, p3 = chi2_pvalue(c12, joint), chi2_pvalue(c3, marginal)
    assert p12 > ALPHA, f"(x1, x2) joint law differs from the base's with heads+lookup drafts: p = {p12:.2e}"
    assert p3 > ALPHA, f"x3 marginal law differs from the base's with heads+lookup drafts: p = {p3:.2e}"


def test_a_draft_vocabulary_samples_the_base_law(base, base_logits):
    """With a draft vocabulary the heads' law is zero outside its K tokens (export/draft_vocab.py): drafts are
    drawn from the K columns and mapped back to token ids, and rejection sampling still emits the base's law."""
    sampling = sampling_params(1.0)
    vocab = np.array([9, 0, 4, 2, 11, 6, 7])  # 7 of the V = 12 tokens, in no particular order
    runner = TorchRunner(base, random_heads(base, "clover2", seed=0), draft_vocab=vocab)
    tokens, lengths, full_tree_steps = first_tokens(runner, resolve_tree("small"), sampling, N, MASTER_SEED + 4)
    joint, marginal, _ = exact_laws(base_logits, sampling)
    c12, c3 = counts_of(tokens)
    assert full_tree_steps >= N and np.mean(lengths > 1) > 0.3 and np.mean(lengths == 1) > 0.1, np.bincount(lengths)
    # tokens outside the vocabulary are still emitted (as bonus tokens from the residual)
    assert not set(np.unique(tokens[:, 1:]).tolist()) <= set(vocab.tolist())
    p12, p3 = chi2_pvalue(c12, joint), chi2_pvalue(c3, marginal)
    assert p12 > ALPHA, f"(x1, x2) joint law differs from the base's with a draft vocabulary: p = {p12:.2e}"
    assert p3 > ALPHA, f"x3 marginal law differs from the base's with a draft vocabulary: p = {p3:.2e}"


@pytest.mark.parametrize("spec", ["dynamic-8", "dynamic-3-w1"])
def test_dynamic_trees_sample_the_base_law(base, base_logits, spec):
    """Dynamic trees (loop.draft_dynamic) under sampling: which nodes are expanded depends on what was drawn, but
    each node's child count is fixed before its children are drawn and every drawn node is verified, so the
    loop still emits the base's law."""
    from clover.runtime.tree import dynamic_tree

    sampling = sampling_params(1.0)
    runner = TorchRunner(base, random_heads(base, "clover2", seed=0))
    tree = dynamic_tree(spec, runner.info.heads_max_depth)
    tokens, lengths, _ = first_tokens(runner, tree, sampling, N, MASTER_SEED + 5)
    joint, marginal, _ = exact_laws(base_logits, sampling)
    c12, c3 = counts_of(tokens)
    assert np.mean(lengths > 1) > 0.3 and np.mean(lengths == 1) > 0.1, np.bincount(lengths)
    p12, p3 = chi2_pvalue(c12, joint), chi2_pvalue(c3, marginal)
    assert p12 > ALPHA, f"(x1, x2) joint law differs from the base's with {spec}: p = {p12:.2e}"
    assert p3 > ALPHA, f"x3 marginal law differs from the base's with {spec}: p = {p3:.2e}"


def two_by_two_samples(base, sampling: SamplingParams, seed: int, options) -> tuple[np.ndarray, np.ndarray]:
    """N generations of the first NUM_TOKENS tokens with Clover-2 heads on a tree with siblings at both depths a
    step can use, stepped by clover.runtime.loop.step; options(): the Decoding's per-generation fields (a fresh
    processor chain, grammar state). Returns (tokens [N, 3], tokens emitted by each speculative step)."""
    runner = TorchRunner(base, random_heads(base, "clover2", seed=0))
    tree = compile_tree([[0], [1], [0, 0], [1, 0]], "two-by-two")
    prompt = np.array(PROMPT, dtype=np.int64)
    tokens = np.zeros((N, NUM_TOKENS), dtype=np.int64)
    lengths = []
    for i, child in enumerate(np.random.SeedSequence(seed).spawn(N)):
        out: list[int] = []
        runner.reset(len(PROMPT) + NUM_TOKENS + tree.num_nodes)
        d = Decoding(
            slot=runner.solo, prompt=prompt, tree=tree, sampling=sampling, rng=np.random.default_rng(child), **options()
        )
        while len(out) < NUM_TOKENS:
            (st,) = step(runner, [d])
            if st.tokens and out:  # a speculative step (the prefill's first token is not one)
                lengths.append(len(st.tokens))
            out += st.tokens
        tokens[i] = out[:NUM_TOKENS]
    return tokens, np.array(lengths)


def test_logits_processors_sample_the_processed_base_law(base, base_logits):
    """With penalties, a logit bias and min_tokens, every tree row is adjusted with its own path's history and
    rejection sampling runs against the adjusted rows: the loop emits the processed base law exactly (the exact law:
    plain rows after prompt + prefix through the same processors, PLAIN tree), which the unprocessed law is not."""
    from clover.runtime.loop import PLAIN
    from clover.runtime.processors import LogitsProcessors

    sampling = SamplingParams(
        temperature=TEMPERATURE,
        presence_penalty=0.7,
        frequency_penalty=0.5,
        repetition_penalty=1.6,
        logit_bias={4: 1.5},
        min_tokens=2,
    )
    stop_ids = (int(np.argmax(base_logits[0])),)  # x1's likeliest token ends generation: masked for x1 and x2
    prompt = np.array(PROMPT, dtype=np.int64)

    def processed(logits: np.ndarray, history: list[int]) -> np.ndarray:
        proc = LogitsProcessors(sampling, prompt, stop_ids, V)
        proc.extend(history)
        return probs_from_logits(proc.apply(logits[None], PLAIN, np.zeros(1, dtype=np.int64)), sampling)[0]

    l1, l2, l3 = base_logits
    p1 = processed(l1, [])
    joint = p1[:, None] * np.array([processed(l2[a], [a]) for a in range(V)])
    marginal = np.einsum(
        "ab,abc->c", joint, np.array([[processed(l3[a, b], [a, b]) for b in range(V)] for a in range(V)])
    )
    tokens, lengths = two_by_two_samples(
        base, sampling, MASTER_SEED + 6, lambda: {"processors": LogitsProcessors.of(sampling, prompt, stop_ids, V)}
    )
    assert np.mean(lengths > 1) > 0.3 and np.mean(lengths == 1) > 0.1, np.bincount(lengths)
    c12, c3 = counts_of(tokens)
    assert not np.any(tokens[:, :2] == stop_ids[0])  # masked before min_tokens
    p12, p3 = chi2_pvalue(c12, joint), chi2_pvalue(c3, marginal)
    assert p12 > ALPHA, f"(x1, x2) joint law differs from the processed base law: p = {p12:.2e}"
    assert p3 > ALPHA, f"x3 marginal law differs from the processed base law: p = {p3:.2e}"
    raw_joint, _, _ = exact_laws(base_logits, sampling_params(1.0))
    assert chi2_pvalue(c12, np.where(joint > 0, raw_joint, 0) + 1e-12) < ALPHA  # the processors did change the law


def test_a_grammar_samples_the_masked_base_law(base, base_logits, tmp_path):
    """Under a grammar the heads draw from their law masked by each node's grammar state and every verify row is
    masked by its own path's state: the loop emits plain constrained sampling's law (the exact law: each row after
    prompt + prefix masked by a matcher fed that prefix, then temperature), which the unmasked law is not."""
    pytest.importorskip("llguidance")
    from helpers import char_tokenizer_dir

    from clover.runtime.grammar import Grammar, GrammarCompiler
    from clover.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(char_tokenizer_dir(tmp_path, eos=V - 1, chars="abcdefghijk"))
    compiler = GrammarCompiler(tok, V, check_spelling=False)  # 11 letters: the grammar uses no other character
    # after "g" only h-k may follow, so x3's mask depends on x2; the end is not allowed before 3 characters
    grammar = Grammar.regex("[a-d]([a-f]|g[h-k]){2,}")
    sampling = sampling_params(1.0)

    def allowed(prefix: list[int]) -> np.ndarray:
        m = compiler.state(grammar).matcher
        if not all(m.consume_token(t) for t in prefix):
            return np.zeros(V, dtype=bool)
        return np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")[:V].astype(bool)

    def masked(logits: np.ndarray, prefix: list[int]) -> np.ndarray:
        ok = allowed(prefix)
        return probs_from_logits(np.where(ok, logits, -np.inf)[None], sampling)[0] if ok.any() else np.zeros(V)

    l1, l2, l3 = base_logits
    p1 = masked(l1, [])
    joint = p1[:, None] * np.array([masked(l2[a], [a]) for a in range(V)])
    marginal = np.einsum("ab,abc->c", joint, np.array([[masked(l3[a, b], [a, b]) for b in range(V)] for a in range(V)]))
    tokens, lengths = two_by_two_samples(base, sampling, MASTER_SEED + 7, lambda: {"grammar": compiler.state(grammar)})
    assert np.mean(lengths > 1) > 0.3 and np.mean(lengths == 1) > 0.05, np.bincount(lengths)
    c12, c3 = counts_of(tokens)
    p12, p3 = chi2_pvalue(c12, joint), chi2_pvalue(c3, marginal)
    assert p12 > ALPHA, f"(x1, x2) joint law differs from the masked base law: p = {p12:.2e}"
    assert p3 > ALPHA, f"x3 marginal law differs from the masked base law: p = {p3:.2e}"
    raw_joint, _, _ = exact_laws(base_logits, sampling)
    assert raw_joint[joint == 0].sum() > 0.3, "the grammar barely changes the law: the test proves little"


# -- the device-side step (runtime/backends/torch_batch.py) -------------------------------------------------------------


def device_first_tokens(base, arch: str, tree, sampling: SamplingParams, n: int, seed: int, batch: int = 250):
    """first_tokens through the stacked runner: `batch` sequences of the prompt stepped together by the loop, whose
    unseeded sampled steps run on the device (`decode`, drawing from the runner's generator, seeded here)."""
    from clover.runtime.backends.torch_batch import BatchedTorchRunner

    runner = BatchedTorchRunner(base, random_heads(base, arch, seed=0))
    runner.generator.manual_seed(seed)
    calls = []
    decode = runner.decode_async
    runner.decode_async = lambda slots, t, *args: calls.append(len(slots)) or decode(slots, t, *args)
    capacity = len(PROMPT) + NUM_TOKENS + tree.num_nodes
    tokens, lengths = np.zeros((n, NUM_TOKENS), dtype=np.int64), []
    for start in range(0, n, batch):
        rngs = np.random.SeedSequence(seed + start).spawn(batch)
        ds = [
            Decoding(
                slot=runner.open_slot(capacity),
                prompt=np.array(PROMPT),
                tree=tree,
                sampling=sampling,
                rng=np.random.default_rng(r),
            )
            for r in rngs
        ]
        out: list[list[int]] = [[] for _ in ds]
        while live := [i for i in range(batch) if len(out[i]) < NUM_TOKENS]:
            for i, st in zip(live, step(runner, [ds[i] for i in live])):
                if st.tree is not None:
                    lengths.append(len(st.tokens))
                out[i] += st.tokens
        tokens[start : start + batch] = [o[:NUM_TOKENS] for o in out]
        for d in ds:
            runner.release(d.slot)
    assert calls and max(calls) == batch, calls  # the speculative steps ran on the device, all rows at once
    return tokens, np.array(lengths)


@pytest.mark.parametrize("arch,tree,top_p", CASES, ids=CASE_IDS)
def test_device_step_samples_the_base_law(base, base_logits, arch, tree, top_p):
    """The same goodness of fit for the device-side step: Gumbel-top-k drafts, recursive rejection sampling over
    siblings with the residual update, bonus tokens and the KV commit, all as torch ops over a batch of rows."""
    tokens, lengths = device_first_tokens(base, arch, resolve_tree(tree), sampling_params(top_p), N, MASTER_SEED)
    joint, marginal, _ = exact_laws(base_logits, sampling_params(top_p))
    c12, c3 = counts_of(tokens)
    p12, p3 = chi2_pvalue(c12, joint), chi2_pvalue(c3, marginal)
    assert np.mean(lengths > 1) > 0.5 and np.mean(lengths == 1) > 0.1, np.bincount(lengths)
    assert p12 > ALPHA, f"(x1, x2) joint law differs from the base's: chi-square p = {p12:.2e}"
    assert p3 > ALPHA, f"x3 marginal law differs from the base's: chi-square p = {p3:.2e}"
