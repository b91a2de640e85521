"""Sampling parameters and token distributions (numpy only).

Both the drafter (top-k candidates, draws without replacement) and the verifier (target probabilities,
bonus token) use these, so draft and target distributions go through the same temperature / top-p code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from clover.errors import CloverError

MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-100, 100] (OpenAI's range: -100 bans a token, 100 forces it)
# temperatures below this are greedy, as vLLM's: the law tends to the argmax as the temperature goes to 0, and logits
# divided by a subnormal one (2e-309) overflow to inf, whose softmax is NaN
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen.

    temperature: 0 (or below GREEDY_TEMPERATURE) means greedy (argmax); above, it divides the logits before the
        softmax.
    top_p: nucleus size in (0, 1]; 1 keeps the whole vocabulary. Ignored when greedy.
    seed: seed of the generator's numpy RNG; None draws fresh entropy.

    The logits processors (runtime/processors.py), applied before temperature and top-p, greedy included:
    presence_penalty, frequency_penalty: in [-2, 2], OpenAI's: a token's logit is lowered by
        frequency_penalty x (times it was generated) + presence_penalty x (1 if it was generated), over the
        generated tokens only.
    repetition_penalty: > 0, vLLM's (CTRL's): a token of the prompt or of the generated text has its logit
        divided by it where positive, multiplied where negative; 1 is off.
    logit_bias: token id -> bias in [-100, 100], added to that token's logit (a mapping or (id, bias) pairs;
        kept as pairs sorted by id).
    min_tokens: >= 0; the end-of-sequence and stop-token ids are masked until this many tokens are generated
        (and stop strings are not matched before then).
    allowed_token_ids: vLLM's: only these tokens may be generated (every other logit -inf); () allows all. Kept
        sorted and unique.
    bad_words: vLLM's, as token sequences: the last token of each is banned where the tokens generated so far end
        with the rest of it (a one-token sequence: always).

    After the temperature (ignored when greedy; vLLM's, SGLang's and llama.cpp's): top_k: the k most likely
    tokens only (ties by lower id; 0 or -1: off); min_p: in [0, 1], only the tokens at least min_p times as likely
    as the most likely one (0: off). Then top_p over what they kept.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | Mapping[int, float] = ()
    min_tokens: int = 0
    top_k: int = 0
    min_p: float = 0.0
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise CloverError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}", param="temperature"
            )
        if not (0 < self.top_p <= 1):
            raise CloverError(f"top_p must be in (0, 1], got {self.top_p}: use 1.0 to disable top-p", param="top_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise CloverError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}", param=name)
        if not (
            _number(self.repetition_penalty) and math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0
        ):
            raise CloverError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}",
                param="repetition_penalty",
            )
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise CloverError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}", param="min_tokens")
        if isinstance(self.top_k, (bool, np.bool_)) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < -1:
            raise CloverError(f"top_k must be an int >= 1, or 0 or -1 to disable it, got {self.top_k!r}", param="top_k")
        object.__setattr__(self, "top_k", max(int(self.top_k), 0))
        if not (_number(self.min_p) and 0 <= self.min_p <= 1):
            raise CloverError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}", param="min_p")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        allowed = list(self.allowed_token_ids)
        if not all(_token(t) for t in allowed):
            raise CloverError(
                f"allowed_token_ids must be token ids (ints >= 0), got {self.allowed_token_ids!r}",
                param="allowed_token_ids",
            )
        object.__setattr__(self, "allowed_token_ids", tuple(sorted({int(t) for t in allowed})))
        words = [tuple(w) for w in self.bad_words]
        if any(not w or any(not _token(t) for t in w) for w in words):
            raise CloverError(
                f"bad_words must be non-empty sequences of token ids (ints >= 0), got {self.bad_words!r}",
                param="bad_words",
            )
        object.__setattr__(self, "bad_words", tuple(dict.fromkeys(tuple(int(t) for t in w) for w in words)))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def processes_logits(self) -> bool:
        """Any logits processor is on (penalties, logit_bias, min_tokens, allowed_token_ids)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
            or self.allowed_token_ids
            or self.bad_words
        )


def _token(t) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) and t >= 0


def _number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """(id, bias) pairs sorted by id, each checked: an int id >= 0 (the vocabulary's bound is the caller's) and a
    finite bias in [-100, 100]."""
    pairs = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    out = {}
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise CloverError(f"logit_bias must map token ids to biases, got the entry {pair!r}", param="logit_bias")
        token, value = pair
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)) or token < 0:
            raise CloverError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}", param="logit_bias")
        if not (_number(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise CloverError(
                f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}", param="logit_bias"
            )
        out[int(token)] = float(value)
    return tuple(sorted(out.items()))


def _check_2d(logits: np.ndarray) -> None:
    if logits.ndim != 2:
        raise CloverError(f"expected logits of shape [N, V], got shape {logits.shape}: add a leading axis for one row")


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature softmax, then top-k and min-p, then nucleus (top-p) filtering.

    Args:
        logits: [N, V] any float dtype.
        params: sampling parameters with temperature > 0.

    Returns:
        [N, V] float64 rows summing to 1. With top_k, each row keeps its k most likely tokens (ties broken by
        lower token id); with min_p, the tokens at least min_p times as likely as its most likely one; with
        top_p < 1, of what is left (renormalized), the smallest set of highest-probability tokens whose
        cumulative probability is >= top_p (ties broken by lower token id, at least one token). The rest are
        zeroed and the row renormalized.
    """
    assert not params.greedy, "probs_from_logits is for sampling; greedy uses argmax"
    _check_2d(logits)
    x = np.asarray(logits, dtype=np.float64) / params.temperature  # [N, V]
    x -= x.max(axis=1, keepdims=True)
    probs = np.exp(x)
    probs /= probs.sum(axis=1, keepdims=True)
    if 0 < params.top_k < probs.shape[1]:
        keep = np.zeros(probs.shape, dtype=bool)
        np.put_along_axis(keep, topk_tokens(x, params.top_k), True, axis=1)
        probs = np.where(keep, probs, 0.0)
    if params.min_p > 0:  # relative to the row's most likely token, which top-k keeps
        probs = np.where(probs >= params.min_p * probs.max(axis=1, keepdims=True), probs, 0.0)
    if params.top_k or params.min_p:
        probs /= probs.sum(axis=1, keepdims=True)
    if params.top_p >= 1.0:
        return probs

    keep = _nucleus_mask(probs, params.top_p)  # [N, V]
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum(axis=1, keepdims=True)
    return probs


def _nucleus_mask(probs: np.ndarray, top_p: float) -> np.ndarray:
    """[N, V] bool: the smallest set of highest-probability tokens reaching top_p, ties by lower id.

    Only the tokens at or above a threshold are sorted: the tokens with p >= c are the first ones of the sorted
    order (ties included), so once their mass reaches top_p the nucleus lies among them. c starts at 1e-3 (a
    nucleus is usually a few hundred tokens: 272 for SmolLM2 at temperature 0.7, top_p 0.95) and falls tenfold
    until it holds; at c <= (1 - top_p) / V every token below c together weighs less than 1 - top_p, so the
    search ends. One pass over V per try instead of argpartition's (1-2.5 ms for a 49k-token row)."""
    n, v = probs.shape
    keep = np.zeros((n, v), dtype=bool)
    floor = (1.0 - top_p) / v
    for row in range(n):
        p = probs[row]
        c = max(1e-3, floor)
        while True:
            ids = np.flatnonzero(p >= c)
            vals = p[ids]
            order = np.lexsort((ids, -vals))  # descending probability, lower id first on ties
            vals = vals[order]
            total = np.cumsum(vals)
            if c <= floor or (len(total) and total[-1] >= top_p):
                break
            c = max(c / 10, floor)
        # token j is in the nucleus iff the tokens ranked above it do not yet reach top_p; rank 0 always is
        inside = (total - vals) < top_p
        inside[0] = True
        keep[row, ids[order[inside]]] = True
    return keep


def topk_tokens(logits: np.ndarray, k: int) -> np.ndarray:
    """Top-k token ids per row.

    Args:
        logits: [N, V].
        k: 1 <= k <= V.

    Returns:
        [N, k] int64 ids sorted by descending logit; equal logits are ordered by lower token id, and a
        tie at the k-th place keeps the lower ids.
    """
    _check_2d(logits)
    n, v = logits.shape
    if not 1 <= k <= v:
        raise CloverError(f"top-k needs 1 <= k <= vocabulary size {v}, got k={k}")
    if k == 1:  # chains draft one token per node: argmax (first, i.e. lowest, id of a tie) is ~100x faster
        return logits.argmax(axis=1)[:, None].astype(np.int64)
    if k < v:
        part = np.argpartition(-logits, k - 1, axis=1)[:, :k]  # [N, k] unordered
        kth = np.take_along_axis(logits, part, axis=1).min(axis=1)  # [N] k-th largest value
        at_least = np.count_nonzero(logits >= kth[:, None], axis=1)  # [N]
        if np.any(at_least > k):
            # Ties straddle the k-th place, where argpartition picks arbitrary members: take every
            # token above the k-th value, then fill with the lowest-id tokens equal to it.
            above = logits > kth[:, None]  # [N, V]
            equal = logits == kth[:, None]
            room = k - np.count_nonzero(above, axis=1)  # [N]
            chosen = above | (equal & (np.cumsum(equal, axis=1) <= room[:, None]))
            part = np.nonzero(chosen)[1].reshape(n, k)  # ascending ids per row
    else:
        part = np.broadcast_to(np.arange(v), (n, v))
    part = np.sort(part, axis=1)  # ascending ids so the stable sort below breaks ties by id
    vals = np.take_along_axis(logits, part, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1).astype(np.int64)  # [N, k]


def sample_without_replacement(probs: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Draw up to k distinct tokens sequentially without replacement.

    Gumbel-top-k: the tokens with the k largest log(p) + Gumbel keys, in descending key order, have
    exactly the law of k sequential draws where each draw is from probs with earlier draws removed and
    renormalized. Zero-probability tokens get key -inf and are never drawn.

    Args:
        probs: [V] non-negative weights (need not be normalized).
        k: number of draws, >= 0.
        rng: numpy generator.

    Returns:
        [min(k, support)] int64 token ids in draw order.
    """
    assert probs.ndim == 1, f"expected probs [V], got shape {probs.shape}"
    assert k >= 0
    with np.errstate(divide="ignore"):
        keys = np.log(np.asarray(probs, dtype=np.float64))  # [V], -inf where p == 0
    support = int(np.count_nonzero(probs > 0))
    k = min(k, support)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    keys += rng.gumbel(size=keys.shape)  # -inf stays -inf
    top = np.argpartition(-keys, k - 1)[:k] if k < keys.size else np.arange(keys.size)
    return top[np.argsort(-keys[top], kind="stable")].astype(np.int64)


def sample_token(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token from [V] non-negative weights (need not be normalized); never a zero-weight one."""
    cdf = np.cumsum(probs, dtype=np.float64)  # [V]
    total = cdf[-1]
    assert total > 0, "cannot sample from an all-zero distribution"
    # side="right": the first index whose cdf exceeds u, so zero-weight tokens (flat cdf) are skipped.
    idx = int(np.searchsorted(cdf, rng.random() * total, side="right"))
    if idx >= cdf.size:  # u * total rounded up to total: take the last token with weight
        idx = int(np.flatnonzero(np.asarray(probs) > 0)[-1])
    return idx
