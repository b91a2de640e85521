"""Per-request logits processors over a verified tree: penalties, logit bias, min_tokens, allowed tokens (numpy
only).

A tree node's logits row is the base's next-token distribution after the path root..node, so its processors
must see the history of *that* path: the prompt, the tokens generated so far (the root, the last emitted token,
included) and the drafted tokens on the path from the root to the node (the node included, the root excluded).
Plain decoding is the root-only tree, whose one row sees the prompt and the generated tokens: every row of a tree
is adjusted exactly as plain decoding would adjust it once that path had been generated, so greedy speculative
decoding with processors equals greedy plain decoding with them, token for token, and rejection sampling over the
adjusted rows stays exact.

Bit-for-bit: a row's adjusted value for token t is one elementwise formula of (its raw logit, t's count, whether t
was seen, t's bias), the same numpy operations whether t's count comes from the history alone (a block over the
columns the history touches) or from the history plus the path (a per-node fix-up). Columns no processor touches
keep their raw value.

Order (vLLM's): logit_bias, then repetition_penalty (prompt + generated), then frequency and presence penalties
(generated only), then the min_tokens mask (-inf on the end-of-sequence and stop-token ids), then the
allowed_token_ids mask (-inf on every other token) and bad_words (a one-token word -inf everywhere; a longer
one's last token -inf on the rows whose context, the generated tokens then the row's path, ends with the rest of
it): each row masked as plain decoding masks it once that path is generated.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from clover.runtime.sampling import SamplingParams
from clover.runtime.tree import Tree


class LogitsProcessors:
    """One request's processor chain and the history it needs: counts of the generated tokens, which tokens the
    prompt or the generated text holds, how many were generated. Build it with `of` (None when nothing is on, so
    the common path costs nothing); `apply` adjusts a tree's rows, `extend` adds the emitted tokens."""

    def __init__(self, sampling: SamplingParams, prompt: np.ndarray, stop_ids: Sequence[int], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.frequency, self.presence = sampling.frequency_penalty, sampling.presence_penalty
        self.repetition = sampling.repetition_penalty
        self.counts = np.zeros(vocab_size, dtype=np.int64)  # [V] times each token was generated
        self.seen = np.zeros(vocab_size, dtype=bool)  # [V] in the prompt or the generated tokens
        self.seen[np.asarray(prompt, dtype=np.int64)] = True
        self.bias = None  # [V] float64, 0 where no bias
        if sampling.logit_bias:
            self.bias = np.zeros(vocab_size)
            ids, values = zip(*sampling.logit_bias)
            self.bias[list(ids)] = values
        self.generated = 0
        self.min_tokens = sampling.min_tokens
        self.stop_ids = np.array(sorted(set(int(i) for i in stop_ids)), dtype=np.int64)  # masked before min_tokens
        self.path_dependent = bool(self.frequency or self.presence or self.repetition != 1)
        self.banned = None  # [V] bool: tokens no row may take (allowed_token_ids, one-token bad words); None: none
        if sampling.allowed_token_ids:
            self.banned = np.ones(vocab_size, dtype=bool)
            self.banned[list(sampling.allowed_token_ids)] = False
        singles = [w[0] for w in sampling.bad_words if len(w) == 1]
        if singles:
            self.banned = np.zeros(vocab_size, dtype=bool) if self.banned is None else self.banned
            self.banned[singles] = True
        # longer bad words: (the tokens before the last, the last); they need the generated tokens themselves
        self.bad_sequences = [(w[:-1], w[-1]) for w in sampling.bad_words if len(w) > 1]
        self.tail: list[int] = []  # the last generated tokens, as many as the longest bad word's prefix
        self.tail_length = max((len(p) for p, _ in self.bad_sequences), default=0)

    @classmethod
    def of(
        cls, sampling: SamplingParams, prompt: np.ndarray, stop_ids: Sequence[int], vocab_size: int
    ) -> LogitsProcessors | None:
        """The chain for a request, or None when no processor would change a logit. stop_ids: the ids that end
        generation (end-of-sequence unless ignored, and the stop-token ids), masked before min_tokens."""
        penalties = sampling.presence_penalty or sampling.frequency_penalty or sampling.repetition_penalty != 1
        masks = (sampling.min_tokens and len(stop_ids)) or sampling.allowed_token_ids or sampling.bad_words
        if not (penalties or sampling.logit_bias or masks):
            return None
        return cls(sampling, prompt, stop_ids, vocab_size)

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens emitted (in order): they join the history of every later row."""
        t = np.asarray(tokens, dtype=np.int64)
        np.add.at(self.counts, t, 1)
        self.seen[t] = True
        self.generated += len(t)
        if self.tail_length:
            self.tail = (self.tail + [int(x) for x in t])[-self.tail_length :]

    def apply(self, logits: np.ndarray, tree: Tree, tokens: np.ndarray) -> np.ndarray:
        """The tree's rows adjusted, each with its own path's history.

        Args:
            logits: [T, V] raw rows (node order); not modified.
            tree: the verified tree (T nodes; the root-only tree for plain steps and a prompt's last row).
            tokens: [T] int64 node tokens; node 0's (the root, already generated) is not counted again.

        Returns:
            [T, V] adjusted rows, float32 at least.
        """
        dtype = np.promote_types(logits.dtype, np.float32)
        out = np.array(logits, dtype=dtype)  # [T, V] a copy: the raw rows stay for log-probabilities
        cols = self._columns()
        if len(cols):
            out[:, cols] = self._adjust(out[:, cols], self.counts[cols], self.seen[cols], cols)
        if self.path_dependent and tree.num_nodes > 1:
            # (row, token) for every drafted token on each row's path (ancestors and the node, the root excluded)
            rows, nodes = np.nonzero(tree.ancestor_mask[:, 1:])
            key = rows * self.vocab_size + np.asarray(tokens, dtype=np.int64)[nodes + 1]
            key, times = np.unique(key, return_counts=True)
            r, t = key // self.vocab_size, key % self.vocab_size
            out[r, t] = self._adjust(np.array(logits[r, t], dtype=dtype), self.counts[t] + times, True, t)
        if self.min_tokens and len(self.stop_ids):
            early = np.flatnonzero(self.generated + tree.depth < self.min_tokens)  # rows whose token comes too soon
            if len(early):
                out[np.ix_(early, self.stop_ids)] = -np.inf
        if self.banned is not None:
            out[:, self.banned] = -np.inf
        for row, token in self._bad_ends(tree, tokens):
            out[row, token] = -np.inf
        return out

    @property
    def sequence_dependent(self) -> bool:
        """A row's mask depends on the tokens of its context themselves (longer bad words): the host path only."""
        return bool(self.bad_sequences)

    def _bad_ends(self, tree: Tree, tokens: np.ndarray) -> list[tuple[int, int]]:
        """(row, token) for each longer bad word whose last token would complete it on that row: the row's context
        (the generated tokens, then the drafted tokens of its path, the root excluded) ends with the rest of it."""
        if not self.bad_sequences:
            return []
        out = []
        for row in range(tree.num_nodes):
            path = [int(tokens[j]) for j in np.flatnonzero(tree.ancestor_mask[row]) if j != 0]
            context = self.tail + path
            out += [(row, last) for prefix, last in self.bad_sequences if tuple(context[-len(prefix) :]) == prefix]
        return out

    def _columns(self) -> np.ndarray:
        """Tokens whose logit some processor changes given the history alone (sorted ids)."""
        touched = np.zeros(self.vocab_size, dtype=bool)
        if self.repetition != 1:
            touched |= self.seen
        if self.frequency or self.presence:
            touched |= self.counts > 0
        if self.bias is not None:
            touched |= self.bias != 0
        return np.flatnonzero(touched)

    def _adjust(self, x: np.ndarray, counts: np.ndarray, seen, ids: np.ndarray) -> np.ndarray:
        """The one elementwise formula: x (raw logits of tokens `ids`) biased, repetition-penalised where `seen`,
        then frequency- and presence-penalised by `counts`. Same shapes in and out, x's dtype."""
        dt = x.dtype.type
        if self.bias is not None:
            x = x + self.bias[ids].astype(x.dtype)
        if self.repetition != 1:  # in float64, clipped to x's range: any penalty > 0 leaves finite logits
            wide, top = x.astype(np.float64), float(np.finfo(x.dtype).max)
            with np.errstate(over="ignore"):
                scaled = np.where(wide > 0, wide / self.repetition, wide * self.repetition)
            x = np.where(seen, np.clip(scaled, -top, top).astype(x.dtype), x)
        if self.frequency or self.presence:
            c = np.asarray(counts).astype(x.dtype)
            x = x - (dt(self.frequency) * c + dt(self.presence) * (c > 0).astype(x.dtype))
        return x
