"""Training-free drafts by prompt lookup (n-gram matching over the sequence so far).

Answers repeat their prompt and themselves: names, code identifiers, quoted text, list scaffolding. The
draft for the next step is what followed the most recent earlier occurrence of the sequence's last n
tokens (n from `max_ngram` down to `min_ngram`, longest match first), as llama.cpp's prompt lookup and
onnxruntime-genai's n-gram speculation do. Drafting costs a dictionary lookup, no model call.

The index maps every n-gram to the position after its latest occurrence that has a continuation, and is
updated as tokens arrive (O(max_ngram) per token), so a proposal never scans the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from clover.errors import CloverError


class PromptLookup:
    def __init__(self, tokens: Sequence[int], max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise CloverError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the sequence (the prompt, then each step's emitted tokens)."""
        seq = self.tokens
        for t in tokens:
            seq.append(int(t))
            end = len(seq) - 1  # the n-grams ending just before the new token now have a continuation
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n >= 0:
                    self._next[tuple(seq[end - n:end])] = end

    def propose(self, k: int) -> np.ndarray:
        """Up to k draft tokens continuing the sequence (empty when its tail occurred nowhere before). A match
        of n tokens drafts at most n: a longer matched context predicts a longer continuation, and each
        drafted token costs a verify row whether or not it is accepted."""
        seq = self.tokens
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            start = self._next.get(tuple(seq[len(seq) - n:]))
            if start is not None:
                return np.array(seq[start:start + min(k, n)], dtype=np.int64)
        return np.zeros(0, dtype=np.int64)
