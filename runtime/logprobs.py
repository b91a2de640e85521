"""Log-probabilities of generated tokens, from the verify forward's rows (numpy only).

Which distribution: the base model's raw next-token distribution, log_softmax of the verify logits before any
logits processor (penalties, logit_bias, min_tokens), temperature or top-p, as vLLM v1 reports by default. So a
token's log-probability does not depend on how it was sampled, and greedy speculative decoding reports plain
decoding's values (within floating-point rounding: a tree's rows and plain rows run different kernels).

Speculation adds no forward: row i of a verified tree is the distribution after the path root..i, so the token
emitted after node i (an accepted child, or the bonus token at the last accepted node) takes its log-probability
from row i; a step's emitted tokens come from the rows of its accepted path, in order. The prompt's last row gives
the first generated token's.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from clover.errors import CloverError
from clover.runtime.sampling import topk_tokens

MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs bound; vLLM's default max_logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the base's raw distribution, its most likely alternatives
    (`top`: (token id, log-probability) pairs, most likely first, ties by lower id; as many as asked), where its
    text starts in the generated text (`text_offset`: characters, counted in the text before any stop-string cut)
    and, where it was computed, its rank in the distribution (1 + how many tokens are more likely; vLLM's)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    text_offset: int
    rank: int | None = None


@dataclass(frozen=True)
class StepLogprobs:
    """The log-probabilities of one step's emitted tokens (arrays, as the loop computes them)."""

    token_ids: np.ndarray  # [n] int64
    logprobs: np.ndarray  # [n] float64
    top_ids: np.ndarray  # [n, k] int64, most likely first
    top_logprobs: np.ndarray  # [n, k] float64
    ranks: np.ndarray | None = None  # [n] int64: 1 + the tokens more likely than each (None: not computed)

    def entries(self, text_offsets: Sequence[int]) -> list[TokenLogprob]:
        """The first len(text_offsets) tokens (those the output kept) as TokenLogprobs, with their offsets."""
        return [
            TokenLogprob(
                int(self.token_ids[i]),
                float(self.logprobs[i]),
                tuple(zip(self.top_ids[i].tolist(), self.top_logprobs[i].tolist())),
                int(text_offsets[i]),
                None if self.ranks is None else int(self.ranks[i]),
            )
            for i in range(min(len(text_offsets), len(self.token_ids)))
        ]


def text_offsets(token_bytes: Sequence[bytes]) -> list[int]:
    """Where each token's text starts (characters) in the text of the tokens' bytes together: a token that ends
    inside a UTF-8 character moves the offsets after it by the characters it completes."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out, chars = [], 0
    for b in token_bytes:
        out.append(chars)
        chars += len(decoder.decode(b))
    return out


def prompt_entries(steps: Sequence[StepLogprobs], token_bytes: Sequence[bytes]) -> list[TokenLogprob]:
    """The prompt's log-probabilities (one per prompt token but the first: its steps' StepLogprobs in order) as
    TokenLogprobs, with offsets in the prompt's text (`token_bytes`: every prompt token's bytes)."""
    offsets = text_offsets(token_bytes)[1:]
    out: list[TokenLogprob] = []
    for st in steps:
        out += st.entries(offsets[len(out) : len(out) + len(st.token_ids)])
    return out


def check_logprobs(k: int | None, param: str = "logprobs") -> None:
    """None (no log-probabilities) or an int in [0, MAX_LOGPROBS]: the alternatives wanted per token."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= MAX_LOGPROBS):
        raise CloverError(
            f"{param} must be None or an int from 0 to {MAX_LOGPROBS} (alternatives per token), got {k!r}",
            param=param,
        )


def token_logprobs(rows: np.ndarray, tokens: Sequence[int], k: int, ranks: bool = False) -> StepLogprobs:
    """log_softmax of each row at its token, and each row's k most likely tokens.

    Args:
        rows: [n, V] raw logits; row i is the distribution token i was drawn from.
        tokens: [n] the tokens emitted.
        k: alternatives per token (0: none).
        ranks: also each token's rank (the prompt's log-probabilities report it; generated tokens' do not).

    Returns:
        StepLogprobs, float64 (the log-sum-exp summed in float64).
    """
    x = np.asarray(rows)
    x = x.astype(np.promote_types(x.dtype, np.float32), copy=False)  # [n, V]
    ids = np.asarray(tokens, dtype=np.int64)
    n, v = x.shape
    peak = x.max(axis=1, keepdims=True)
    # exp in the rows' precision (10x faster than float64 on a 49k vocabulary), summed in float64
    lse = peak[:, 0].astype(np.float64) + np.log(np.exp(x - peak).sum(axis=1, dtype=np.float64))  # [n]
    picked = x[np.arange(n), ids]
    chosen = picked.astype(np.float64) - lse
    rank = 1 + (x > picked[:, None]).sum(axis=1) if ranks else None  # [n]
    top = topk_tokens(x, min(k, v)) if k else np.zeros((n, 0), dtype=np.int64)  # [n, k]
    top_lp = np.take_along_axis(x, top, axis=1).astype(np.float64) - lse[:, None]
    return StepLogprobs(ids, chosen, top, top_lp, rank)
