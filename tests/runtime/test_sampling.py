"""Sampling parameters, temperature / top-p probabilities, top-k, draws without replacement."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from scipy import special, stats

from clover.errors import CloverError
from clover.runtime.sampling import (
    SamplingParams,
    probs_from_logits,
    sample_token,
    sample_without_replacement,
    topk_tokens,
)

ALPHA = 1e-3


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of observed counts to probs; cells with probability 0 must be empty."""
    assert counts[probs == 0].sum() == 0, "drew a zero-probability outcome"
    support = probs > 0
    if support.sum() < 2:
        return 1.0
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(stats.chisquare(counts[support], expected).pvalue)


# ---- SamplingParams -------------------------------------------------------------------------------


def test_params_defaults_and_greedy() -> None:
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    # a temperature this small is greedy: dividing logits by it would overflow (a fuzzed request sent 2.2e-309)
    assert SamplingParams(temperature=2.225073858507203e-309).greedy
    assert SamplingParams(temperature=9e-6).greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, r"temperature must be a finite number >= 0"),
        ({"temperature": float("inf")}, r"temperature"),
        ({"temperature": float("nan")}, r"temperature"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p"),
        ({"top_p": float("nan")}, r"top_p"),
        ({"top_k": -2}, r"top_k must be an int >= 1, or 0 or -1"),
        ({"top_k": 2.0}, r"top_k"),
        ({"top_k": True}, r"top_k"),
        ({"min_p": -0.1}, r"min_p must be a number in \[0, 1\]"),
        ({"min_p": 1.01}, r"min_p"),
        ({"min_p": float("nan")}, r"min_p"),
    ],
)
def test_params_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(CloverError, match=match):
        SamplingParams(**kwargs)


# ---- probs_from_logits ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_probs_are_temperature_softmax(dtype: type) -> None:
    logits = np.random.default_rng(0).normal(size=(5, 1000)).astype(dtype) * 4
    for t in (0.3, 1.0, 2.5):
        probs = probs_from_logits(logits, SamplingParams(temperature=t))
        assert probs.dtype == np.float64 and probs.shape == logits.shape
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-12)
        np.testing.assert_allclose(probs, special.softmax(logits.astype(np.float64) / t, axis=1))


def test_lower_temperature_is_sharper() -> None:
    logits = np.random.default_rng(1).normal(size=(3, 50))
    cold = probs_from_logits(logits, SamplingParams(temperature=0.5))
    hot = probs_from_logits(logits, SamplingParams(temperature=2.0))
    assert np.all(cold.max(axis=1) > hot.max(axis=1))


def test_large_logits_are_stable() -> None:
    probs = probs_from_logits(np.array([[1e4, 1e4 - 1.0, -1e4]]), SamplingParams(temperature=1.0))
    assert np.all(np.isfinite(probs))
    np.testing.assert_allclose(probs[0, :2], special.softmax([1.0, 0.0]))


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.4, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.99, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_smallest_nucleus(top_p: float, kept: list[int]) -> None:
    p = np.array([0.15, 0.5, 0.05, 0.3])  # token order differs from probability order
    order = [1, 3, 0, 2]
    probs = probs_from_logits(np.log(p)[None], SamplingParams(temperature=1.0, top_p=top_p))[0]
    keep = sorted(order[i] for i in kept)
    assert np.flatnonzero(probs).tolist() == keep
    np.testing.assert_allclose(probs[keep], p[keep] / p[keep].sum())


def test_top_p_ties_keep_lower_ids_and_at_least_one() -> None:
    probs = probs_from_logits(np.zeros((1, 4)), SamplingParams(temperature=1.0, top_p=0.5))
    np.testing.assert_allclose(probs[0], [0.5, 0.5, 0.0, 0.0])
    tiny = probs_from_logits(np.log([[0.1, 0.6, 0.3]]), SamplingParams(temperature=1.0, top_p=1e-9))
    np.testing.assert_allclose(tiny[0], [0.0, 1.0, 0.0])


def test_top_p_matches_brute_force() -> None:
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(8, 60)) * 2
    for top_p in (0.3, 0.6, 0.9):
        params = SamplingParams(temperature=0.8, top_p=top_p)
        got = probs_from_logits(logits, params)
        full = special.softmax(logits / 0.8, axis=1)
        for row, p in zip(got, full, strict=True):
            order = sorted(range(p.size), key=lambda i: (-p[i], i))
            n = next(n for n in range(1, p.size + 1) if p[order[:n]].sum() >= top_p)
            assert set(np.flatnonzero(row).tolist()) == set(order[:n])
            np.testing.assert_allclose(row.sum(), 1.0)


def test_top_k_and_min_p_match_brute_force() -> None:
    """top_k keeps the k most likely tokens (ties by lower id), min_p those at least min_p x the most likely, and
    top_p the nucleus of what they kept (renormalized); -1 disables top_k as 0 does."""
    rng = np.random.default_rng(3)
    logits = np.round(rng.normal(size=(8, 40)) * 2, 1)  # rounded: ties at the k-th place occur
    assert SamplingParams(top_k=-1).top_k == 0
    for top_k, min_p, top_p in ((1, 0.0, 1.0), (5, 0.0, 1.0), (5, 0.2, 1.0), (0, 0.3, 1.0), (12, 0.05, 0.7)):
        got = probs_from_logits(logits, SamplingParams(temperature=0.8, top_p=top_p, top_k=top_k, min_p=min_p))
        full = special.softmax(logits / 0.8, axis=1)
        for row, p in zip(got, full, strict=True):
            order = sorted(range(p.size), key=lambda i: (-p[i], i))
            kept = [i for rank, i in enumerate(order) if (not top_k or rank < top_k) and p[i] >= min_p * p[order[0]]]
            q = p[kept] / p[kept].sum()
            n = next(n for n in range(1, len(kept) + 1) if q[:n].sum() >= top_p) if top_p < 1 else len(kept)
            assert set(np.flatnonzero(row).tolist()) == set(kept[:n]), (top_k, min_p, top_p)
            np.testing.assert_allclose(row[kept[:n]], p[kept[:n]] / p[kept[:n]].sum())


def full_sort_nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-probs, axis=1, kind="stable")
    sorted_p = np.take_along_axis(probs, order, axis=1)
    inside = np.cumsum(sorted_p, axis=1) - sorted_p < top_p
    inside[:, 0] = True
    keep = np.zeros_like(inside)
    np.put_along_axis(keep, order, inside, axis=1)
    return keep


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999])
def test_top_p_matches_full_sort_on_large_vocab(top_p: float) -> None:
    # Nuclei from 1 token to most of the vocabulary, and heavy ties (the threshold must fall several times).
    rng = np.random.default_rng(9)
    v = 20_000
    logits = np.stack([
        rng.normal(size=v) * 12,  # peaked
        rng.normal(size=v) * 3,
        rng.normal(size=v) * 0.2,  # nearly flat: nucleus ~ top_p * V
        np.zeros(v),  # all tied
        rng.integers(0, 3, size=v).astype(np.float64),  # large tie groups
        np.where(np.arange(v) % 97 == 0, 5.0, 0.0),  # a tied head of 207 tokens
    ])  # fmt: skip
    params = SamplingParams(temperature=1.0, top_p=top_p)
    got = probs_from_logits(logits, params)
    want_keep = full_sort_nucleus(special.softmax(logits, axis=1), top_p)
    np.testing.assert_array_equal(got > 0, want_keep)
    for row in range(logits.shape[0]):  # one row at a time takes the same decisions
        one = probs_from_logits(logits[row : row + 1], params)
        np.testing.assert_array_equal(one[0] > 0, want_keep[row])


def test_probs_rejects_1d() -> None:
    with pytest.raises(CloverError, match=r"expected logits of shape \[N, V\]"):
        probs_from_logits(np.zeros(5), SamplingParams(temperature=1.0))


# ---- topk_tokens ----------------------------------------------------------------------------------


def test_topk_order() -> None:
    logits = np.array([[0.1, 3.0, -1.0, 2.0, 5.0]], dtype=np.float32)
    ids = topk_tokens(logits, 3)
    assert ids.dtype == np.int64 and ids.tolist() == [[4, 1, 3]]


def test_topk_ties_prefer_lower_ids() -> None:
    logits = np.array([[1.0, 2.0, 2.0, 0.0, 2.0, 2.0]])
    assert topk_tokens(logits, 1).tolist() == [[1]]  # the argmax path keeps the rule
    assert topk_tokens(logits, 2).tolist() == [[1, 2]]
    assert topk_tokens(logits, 5).tolist() == [[1, 2, 4, 5, 0]]
    assert topk_tokens(logits, 6).tolist() == [[1, 2, 4, 5, 0, 3]]


def test_topk_matches_lexsort_reference() -> None:
    rng = np.random.default_rng(3)
    logits = rng.integers(-3, 4, size=(16, 40)).astype(np.float32)  # many ties
    for k in (1, 2, 5, 39, 40):
        ref = np.stack([np.lexsort((np.arange(40), -row))[:k] for row in logits])
        np.testing.assert_array_equal(topk_tokens(logits, k), ref)
    wide = rng.normal(size=(4, 50_000)).astype(np.float32)
    ref = np.stack([np.lexsort((np.arange(50_000), -row))[:8] for row in wide])
    np.testing.assert_array_equal(topk_tokens(wide, 8), ref)


@pytest.mark.parametrize("k", [0, 7])
def test_topk_bad_k(k: int) -> None:
    with pytest.raises(CloverError, match=r"1 <= k <= vocabulary size 6"):
        topk_tokens(np.zeros((2, 6)), k)


# ---- sample_without_replacement / sample_token ----------------------------------------------------


def test_without_replacement_distinct_and_zero_prob_never_drawn() -> None:
    rng = np.random.default_rng(4)
    probs = np.array([0.0, 0.4, 0.0, 0.3, 0.2, 0.1, 0.0])
    for _ in range(2000):
        ids = sample_without_replacement(probs, 3, rng)
        assert ids.dtype == np.int64 and ids.size == 3
        assert len(set(ids.tolist())) == 3
        assert np.all(probs[ids] > 0)


def test_without_replacement_small_support_returns_fewer() -> None:
    rng = np.random.default_rng(5)
    probs = np.zeros(50_000)
    probs[[7, 42]] = [0.9, 0.1]
    for _ in range(50):
        ids = sample_without_replacement(probs, 4, rng)
        assert sorted(ids.tolist()) == [7, 42]
    assert sample_without_replacement(probs, 0, rng).size == 0
    one_hot = np.zeros(10)
    one_hot[3] = 1.0
    assert sample_without_replacement(one_hot, 3, rng).tolist() == [3]


def test_without_replacement_marginals_match_sequential_law() -> None:
    """First- and second-draw marginals equal the exact sequential law (chi-square, alpha=1e-3)."""
    rng = np.random.default_rng(6)
    p = np.array([0.35, 0.25, 0.2, 0.1, 0.07, 0.03, 0.0])
    n = 50_000
    draws = np.stack([sample_without_replacement(p, 2, rng) for _ in range(n)])  # [n, 2]
    first = np.bincount(draws[:, 0], minlength=p.size)
    second = np.bincount(draws[:, 1], minlength=p.size)
    # P(second = b) = sum_{a != b} p_a * p_b / (1 - p_a)
    exact_second = np.array([sum(p[a] * p[b] / (1 - p[a]) for a in range(p.size) if a != b) for b in range(p.size)])
    pair = np.zeros((p.size, p.size), dtype=np.int64)
    np.add.at(pair, (draws[:, 0], draws[:, 1]), 1)
    exact_pair = np.array([[p[a] * p[b] / (1 - p[a]) if a != b else 0.0 for b in range(p.size)] for a in range(p.size)])
    assert chi2_pvalue(first, p) > ALPHA
    assert chi2_pvalue(second, exact_second) > ALPHA
    assert chi2_pvalue(pair.ravel(), exact_pair.ravel()) > ALPHA


def test_sample_token_law_and_zero_weights() -> None:
    """sample_token draws from unnormalized weights with the right law (chi-square, alpha=1e-3)."""
    rng = np.random.default_rng(7)
    w = np.array([0.0, 2.0, 0.0, 1.0, 1.0, 0.0])
    counts = np.bincount([sample_token(w, rng) for _ in range(20_000)], minlength=w.size)
    assert chi2_pvalue(counts, w / w.sum()) > ALPHA
    leading = np.array([0.0, 0.0, 1.0])
    assert all(sample_token(leading, rng) == 2 for _ in range(100))


def test_all_pairs_reachable() -> None:
    rng = np.random.default_rng(8)
    p = np.array([0.5, 0.3, 0.2])
    seen = {tuple(sample_without_replacement(p, 3, rng).tolist()) for _ in range(3000)}
    assert seen == set(itertools.permutations(range(3)))
