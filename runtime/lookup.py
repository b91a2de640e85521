"""Training-free drafts by prompt lookup (n-gram matching over the sequence so far).

Answers repeat their prompt and themselves: names, code identifiers, quoted text, list scaffolding. The
draft for the next step is what followed the most recent earlier occurrence of the sequence's last n
tokens (n from `max_ngram` down to `min_ngram`, longest match first), as llama.cpp's prompt lookup and
onnxruntime-genai's n-gram speculation do. Drafting costs a dictionary lookup, no model call.

The index maps every n-gram to the position after its latest occurrence that has a continuation, and is
updated as tokens arrive (O(max_ngram) per token), so a proposal never scans the sequence. A match found
through it is then extended backwards token by token (up to MATCH_EXTEND) to its real length L, and proposes up
to MATCH_DRAFTS_PER_TOKEN * L tokens: a long repeated span (a signature, a quoted paragraph, a list's scaffold)
goes on repeating. `LookupLength` then verifies as much of the proposal as pays for its rows on the runner's
measured verify-cost curve, with acceptance by repeat length learned online. Against the earlier fixed rule (a
match of n <= 3 tokens drafts n), in one interleaved run each (SmolLM2, 16 prompts x 128 tokens, greedy, the
corpus's n-gram store): lookup alone 1.38x -> 1.43x (MT-Bench) and 1.53x -> 1.60x (code) on the fp32 graph,
1.13x -> 1.26x and 1.28x -> 1.39x on the int4 one, where rows are dear and it verifies fewer.

When the sequence's tail matches nothing of 2+ tokens, an `NgramStore` (clover-export --ngram-store) drafts
instead: the continuations the base itself wrote most often after that context, counted over a corpus of its
own answers (REST, arXiv 2311.08252; SuffixDecoding, arXiv 2411.04975). Still no model call: a binary search
per drafted token. On SmolLM2 int4 with the 735k-token self-distilled corpus, greedy, 128 new tokens, it raised
prompt lookup's tokens per step from 1.36 to 1.56 on MT-Bench and from 1.66 to 1.88 on the code prompts
(replayed on fixed greedy outputs); contexts longer than 3 tokens added nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from clover.artifact import Manifest
from clover.errors import CloverError


STORE_CONTEXT = 3  # tokens of context an n-gram store keys on at most
STORE_MIN_CONTEXT = 2  # ... and at least: after one token the base's next token is a guess
STORE_MIN_COUNT = 2  # contexts seen fewer times are left out of a store
MATCH_EXTEND = 32  # a match is measured up to this many tokens back
MATCH_DRAFTS_PER_TOKEN = 2  # a match of L tokens drafts up to 2L (L, 3L, 4L replayed worse or no better per ms)
STORE_DRAFTS = 3  # tokens a store drafts at most: each is a guess from 2-3 tokens of context (longer replayed worse)
_BITS = 21  # bits per token in a packed context key: vocabularies up to 2**21 - 1 tokens, 3 tokens per uint64


class NgramStore:
    """What the base wrote after each short context, over a corpus of its own answers: for every context of
    STORE_MIN_CONTEXT..STORE_CONTEXT tokens seen at least STORE_MIN_COUNT times, its most frequent next token and
    that token's share. Contexts are packed exactly into uint64 keys (`_BITS` per token, id + 1, so lengths
    differ), kept sorted for binary search. Read-only once built: one store serves every sequence and thread."""

    def __init__(self, keys: np.ndarray, next_ids: np.ndarray, share: np.ndarray, vocab_size: int) -> None:
        if vocab_size >= 1 << _BITS:
            raise CloverError(f"an n-gram store packs token ids in {_BITS} bits, but the vocabulary has {vocab_size} "
                              "tokens: export without --ngram-store")
        self.keys = np.asarray(keys, dtype=np.uint64)
        self.next_ids = np.asarray(next_ids, dtype=np.int64)
        self.share = np.asarray(share, dtype=np.float32)
        self.vocab_size = int(vocab_size)
        if not (len(self.keys) == len(self.next_ids) == len(self.share)) or bool(np.any(np.diff(self.keys) <= 0)) or (
                len(self.next_ids) and (self.next_ids.min() < 0 or self.next_ids.max() >= vocab_size)):
            raise CloverError("an n-gram store needs sorted distinct keys and one next token below the vocabulary "
                              "size per key")

    def __len__(self) -> int:
        return len(self.keys)

    @staticmethod
    def pack(context: Sequence[int]) -> int:
        key = 0
        for t in context:
            key = (key << _BITS) | (int(t) + 1)
        return key

    @classmethod
    def build(cls, sequences: Iterable[tuple[np.ndarray, int]], vocab_size: int) -> "NgramStore":
        """The store of `sequences`: (tokens, start) pairs, counting the tokens from `start` on (an answer) after
        the contexts before each (which may reach into its prompt)."""
        keys, nexts = [], []
        for tokens, start in sequences:
            t = np.asarray(tokens, dtype=np.uint64) + np.uint64(1)
            for n in range(STORE_MIN_CONTEXT, STORE_CONTEXT + 1):
                first = max(start, n)  # positions with n tokens of context
                if first >= len(t):
                    continue
                key = np.zeros(len(t) - first, dtype=np.uint64)
                for j in range(n, 0, -1):  # oldest token in the highest bits, as pack()
                    key = (key << np.uint64(_BITS)) | t[first - j:len(t) - j]
                keys.append(key)
                nexts.append(np.asarray(tokens[first:], dtype=np.int64))
        if not keys:
            return cls(np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.float32), vocab_size)
        key, nxt = np.concatenate(keys), np.concatenate(nexts)
        order = np.lexsort((nxt, key))
        key, nxt = key[order], nxt[order]
        # runs of equal (key, next): their counts; then per key the total and the most frequent next token
        pair_start = np.flatnonzero(np.r_[True, (key[1:] != key[:-1]) | (nxt[1:] != nxt[:-1])])
        pair_count = np.diff(np.r_[pair_start, len(key)])
        pair_key, pair_next = key[pair_start], nxt[pair_start]
        key_start = np.flatnonzero(np.r_[True, pair_key[1:] != pair_key[:-1]])
        total = np.add.reduceat(pair_count, key_start)
        best = np.maximum.reduceat(pair_count, key_start)
        # the first pair of each key with the best count: the smallest such token id (pairs are sorted by id)
        group = np.repeat(np.arange(len(key_start)), np.diff(np.r_[key_start, len(pair_key)]))
        best_pairs = np.flatnonzero(pair_count == best[group])
        first_best = best_pairs[np.r_[True, group[best_pairs][1:] != group[best_pairs][:-1]]]
        keep = total >= STORE_MIN_COUNT
        return cls(pair_key[key_start][keep], pair_next[first_best][keep], (best / total)[keep], vocab_size)

    def next_token(self, context: Sequence[int]) -> tuple[int, float] | None:
        """The most frequent continuation of the longest stored tail of `context`, and its share; None if none."""
        for n in range(min(STORE_CONTEXT, len(context)), STORE_MIN_CONTEXT - 1, -1):
            key = np.uint64(self.pack(context[len(context) - n:]))
            i = int(np.searchsorted(self.keys, key))
            if i < len(self.keys) and self.keys[i] == key:
                return int(self.next_ids[i]), float(self.share[i])
        return None

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens continuing `tokens`, each the store's continuation of the sequence so far."""
        tail, out = list(tokens[-STORE_CONTEXT:]), []
        while len(out) < k:
            found = self.next_token(tail)
            if found is None:
                break
            out.append(found[0])
            tail = tail[1:] + [found[0]]
        return out

    def save(self, path: Path) -> None:
        with open(path, "wb") as f:
            np.savez_compressed(f, keys=self.keys, next_ids=self.next_ids.astype(np.int32), share=self.share,
                                vocab_size=np.int64(self.vocab_size))

    @classmethod
    def of_artifact(cls, root: Path, manifest: Manifest) -> "NgramStore | None":
        """The artifact's store (clover-export --ngram-store), or None if it has none."""
        if manifest.ngram_store is None:
            return None
        store = cls.load(Path(root) / manifest.ngram_store.file)
        vocab = int(manifest.base_config.get("vocab_size", 0))
        if store.vocab_size != vocab or len(store) != manifest.ngram_store.contexts:
            raise CloverError(f"artifact {root}: {manifest.ngram_store.file} does not match its manifest entry "
                              f"({manifest.ngram_store.contexts} contexts, vocabulary {vocab}): export it again")
        return store

    @classmethod
    def load(cls, path: Path) -> "NgramStore":
        try:
            with np.load(path, allow_pickle=False) as z:
                return cls(z["keys"], z["next_ids"], z["share"], int(z["vocab_size"]))
        except (OSError, ValueError, KeyError) as e:
            raise CloverError(f"cannot read the n-gram store {path} ({e}): export the artifact again") from None


class PromptLookup:
    def __init__(self, tokens: Sequence[int], max_ngram: int = 3, min_ngram: int = 1,
                 store: NgramStore | None = None) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise CloverError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram, self.store = max_ngram, min_ngram, store
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self.match = 0  # the last proposal's match length in the sequence (0: the store's, or none)
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
        of L tokens (the indexed n-gram extended backwards) drafts at most MATCH_DRAFTS_PER_TOKEN * L: a longer
        matched context predicts a longer continuation, and each drafted token costs a verify row whether or
        not it is accepted. With a store, a match of one token drafts only if the store has nothing (its 2-3
        token contexts, counted over many answers, predict better)."""
        seq, self.match = self.tokens, 0
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            start = self._next.get(tuple(seq[len(seq) - n:]))
            if start is not None:
                if n < STORE_MIN_CONTEXT and self.store is not None and k > 0:
                    stored = self.store.propose(seq, min(k, STORE_DRAFTS))
                    if stored:
                        return np.array(stored, dtype=np.int64)
                self.match = self.match_length(start, n)
                return np.array(seq[start:start + min(k, MATCH_DRAFTS_PER_TOKEN * self.match)], dtype=np.int64)
        stored = self.store.propose(seq, min(k, STORE_DRAFTS)) if self.store is not None and k > 0 else []
        return np.array(stored, dtype=np.int64)

    def match_length(self, start: int, n: int) -> int:
        """How many tokens before `start` equal the sequence's tail (n known to), up to MATCH_EXTEND."""
        seq, end, length = self.tokens, len(self.tokens), n
        while length < MATCH_EXTEND and start - length - 1 >= 0 and seq[start - length - 1] == seq[end - length - 1]:
            length += 1
        return length


class LookupLength:
    """How many tokens of a lookup proposal to verify: as many as maximise expected tokens per verify millisecond
    on `cost` (rows -> ms: the runner's measured verify-cost curve, clover.runtime.cost). Extra rows are cheap on
    a bandwidth-bound base (fp32 SmolLM2: 13 rows ~1.9x one row) and dear on a quantized one (int4: 5 rows ~1.9x),
    so one fixed length loses on one of them. The chance that the next drafted token is accepted, given that the
    repeat so far is l tokens long (a match of L whose first j drafts were accepted is a repeat of L + j), is
    learned online from every verified proposal, starting from PRIOR; the store's drafts have their own.
    One per Generator or Engine: every sequence it decodes shares what it learns."""

    PRIOR, STRENGTH = 0.6, 4.0  # prior acceptance and its weight in pseudo-trials
    LONGEST = 24  # repeats this long and longer share one estimate
    # drafts="heads+lookup": whether to draft the heads beside the lookup path is learned from measured steps
    EXPLORE = 16  # every 16th choice of a kind takes the other arm, so both rates stay current
    WARMUP = 4  # steps each arm is tried first, per kind
    MARGIN = 1.05  # alone only when clearly faster: near-ties are within the rates' noise

    def __init__(self, cost: Callable[[int], float]) -> None:
        self.cost = cost
        self.hits = np.zeros(self.LONGEST + 1)  # index l: repeats of l tokens (0: the store's drafts)
        self.trials = np.zeros(self.LONGEST + 1)
        # [kind, arm (0: heads and lookup merged, 1: lookup alone), (tokens, ms, steps)]: running sums of what
        # steps of each kind of proposal (`kind`) emitted and took, per arm
        self.arms = np.zeros((4, 2, 3))
        self.choices = [0] * 4  # decisions per kind, after the warm-up

    def _repeats(self, match: int, n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.int64) if match == 0 else np.minimum(match + np.arange(n), self.LONGEST)

    def choose(self, match: int, n: int, rows: int = 1) -> int:
        """Tokens to verify of a proposal of n from a match of `match` tokens (0: the store), beside `rows` other
        rows (the root, and a merged tree's head nodes)."""
        if n == 0:
            return 0
        at = self._repeats(match, n)
        q = (self.hits[at] + self.STRENGTH * self.PRIOR) / (self.trials[at] + self.STRENGTH)
        expected = 1.0 + np.concatenate(([0.0], np.cumsum(np.cumprod(q))))  # tokens per step verifying k = 0..n
        ms = np.array([self.cost(rows + k) for k in range(n + 1)])
        return int(np.argmax(expected / ms))

    @staticmethod
    def kind(match: int, n: int) -> int:
        """What the heads add depends on what the lookup offers: nothing, the store's drafts, a short repeat,
        a long one."""
        return 0 if n == 0 else 1 if match == 0 else 2 if match < 4 else 3

    def alone(self, match: int, n: int) -> bool:
        """drafts="heads+lookup": whether this step should verify the lookup proposal (n tokens from a match of
        `match`; none: a plain step) alone, without drafting the heads. Decided by the tokens per millisecond
        measured so far on steps with this kind of proposal, each way: a long repeat (code, quoting) is right so
        often, and on a quantized base a step is so short, that the heads' drafting time can buy fewer tokens
        than it costs; on fp32 SmolLM2 they pay. A model of it (the verify-cost curve, the heads' time and
        their tokens beyond the lookup's) was tried first and went alone too often there."""
        k = self.kind(match, n)
        (tm, msm, nm), (ta, msa, na) = self.arms[k]
        if nm < self.WARMUP or na < self.WARMUP:
            return bool(nm >= self.WARMUP)  # the merged arm first, then the lone one
        self.choices[k] += 1
        go = bool(ta / msa > self.MARGIN * tm / msm)
        return go != (self.choices[k] % self.EXPLORE == 0)

    def observe_step(self, kind: int, alone: bool, tokens: int, ms: float) -> None:
        """A heads+lookup step with a proposal of `kind`: lookup `alone` or merged, its tokens and time."""
        self.arms[kind, int(alone)] += (tokens, ms, 1)

    def observe(self, match: int, proposal: Sequence[int], emitted: Sequence[int]) -> None:
        """A step's whole proposal (before `choose` cut it) beside the tokens the step emitted. The base's next
        tokens say whether each proposed token would have been accepted as far as the step emitted, so the
        tokens left out are learned from too (a repeat length once judged not worth a row is not judged so
        forever)."""
        n = min(len(proposal), len(emitted))
        right = next((j for j in range(n) if proposal[j] != emitted[j]), n)
        at = self._repeats(match, n)
        np.add.at(self.trials, at[:min(right + 1, n)], 1.0)
        np.add.at(self.hits, at[:right], 1.0)
