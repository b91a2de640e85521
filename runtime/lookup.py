"""Training-free drafts by prompt lookup (n-gram matching over the sequence so far).

Answers repeat their prompt and themselves: names, code identifiers, quoted text, list scaffolding. The
draft for the next step is what followed the most recent earlier occurrence of the sequence's last n
tokens (n from `max_ngram` down to `min_ngram`, longest match first), as llama.cpp's prompt lookup and
onnxruntime-genai's n-gram speculation do. Drafting costs a dictionary lookup, no model call.

The index maps every n-gram to the positions after its latest occurrences that have a continuation (the last
OCCURRENCES, for a grammar to pick among: PromptLookup.propose_valid), and is updated as tokens arrive
(O(max_ngram) per token), so a proposal never scans the sequence. A match found through it is then extended
backwards token by token (up to MATCH_EXTEND) to its real length L, and proposes up to MATCH_DRAFTS_PER_TOKEN * L
tokens: a long repeated span (a signature, a quoted paragraph, a list's scaffold) goes on repeating.
`LookupLength` (clover.runtime.policy) then verifies as much of the proposal as pays for its rows on the runner's
measured verify-cost curve, with acceptance by repeat length learned online. It is faster than a fixed rule (a match of n <= 3 tokens
drafts n) on a base where extra rows are cheap, where it verifies longer repeats, and on a quantized one, where rows
are dear and it verifies fewer (measured: docs/experiments.md, 2026-11-25 "cost-aware lookup lengths").

When the sequence's tail matches nothing of 2+ tokens, an `NgramStore` (clover-export --ngram-store) drafts
instead: what the base itself wrote after the longest stored match of the sequence's tail, over corpora of its
own answers (REST, arXiv 2311.08252; SuffixDecoding, arXiv 2411.04975). Still no model call: binary searches
over a suffix array, ~0.1 ms a proposal. A store raises prompt lookup's tokens per step, and the suffix array's
longer matches and longer drafts raise them further than the format-1 store's 2-3 token contexts (NgramStore;
measured: docs/experiments.md, 2026-11-26 "the n-gram store as a suffix array").
"""

from __future__ import annotations

import bisect
import mmap
import re
import struct
import sys
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from clover.artifact import Manifest
from clover.errors import CloverError

STORE_MIN_CONTEXT = 2  # tokens of the tail a store must match at least: after one token the next is a guess
STORE_LONGEST = 24  # ... and at most (longer matches are rare and predict no better)
STORE_SORTED = 64  # the suffix array orders suffixes by this many tokens, ties in text order: matches and drafts
# read no further (a draft stops there), as the search and the walk rely on that order
STORE_PROMPT_TAIL = 3  # prompt tokens kept before each answer: the chat template's turn header, so answer starts match
STORE_FORMAT = 2  # 1: 2-3 token contexts and their most frequent next token; 2: a suffix array
MATCH_EXTEND = 32  # a match is measured up to this many tokens back
MATCH_DRAFTS_PER_TOKEN = 2  # a match of L tokens drafts up to 2L (L, 3L, 4L replayed worse or no better per ms)
# under a grammar, with no earlier n-gram to follow: the output's last word (at least TEXT_MATCH_BYTES long, over at
# most TEXT_MATCH_TOKENS tokens) found earlier as text, ending where a token ends (see PromptLookup.propose_valid)
TEXT_MATCH_BYTES = 3
TEXT_MATCH_TOKENS = 3
TEXT_MATCH_TRIES = 8  # earlier occurrences looked at, latest first
_WORD = rb"[0-9A-Za-z\x80-\xff]"  # a byte of a word (UTF-8 letters' bytes included)
_WORD_BYTE, _LAST_WORD = re.compile(_WORD), re.compile(_WORD + rb"+$")
OCCURRENCES = 4  # latest occurrences of each n-gram kept: under a grammar, the one it allows furthest drafts


def store_dtype(vocab_size: int) -> np.dtype:
    """How a store holds token ids: big-endian (byte strings then compare like the token sequences, so the search
    bisects on bytes), 16 bits where the vocabulary leaves room for the separator (the largest value), else 32."""
    if vocab_size >= 0xFFFFFFFF:
        raise CloverError(
            f"an n-gram store holds token ids in 32 bits, but the vocabulary has {vocab_size} "
            "tokens: export without --ngram-store"
        )
    return np.dtype(np.uint16 if vocab_size < 0xFFFF else np.uint32).newbyteorder(">")


def suffix_array(tokens: np.ndarray, depth: int = STORE_SORTED) -> np.ndarray:
    """Start positions of `tokens`' suffixes in the order of their first `depth` tokens (a shorter suffix before
    its extensions; equal prefixes in text order), by prefix doubling: log2(depth) stable sorts in numpy."""
    n = len(tokens)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64).reshape(-1)  # dense: keys below stay < n^2
    order = np.argsort(rank, kind="stable")
    k = 1
    while k < depth and n:
        after = np.zeros(n, dtype=np.int64)  # rank of the suffix k further on, + 1 (0: past the end)
        after[: n - k] = rank[k:] + 1
        key = rank * (n + 1) + after
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(np.r_[0, sorted_key[1:] != sorted_key[:-1]])
        k *= 2
        if rank[order[-1]] == n - 1:  # all distinct already
            break
    return order.astype(np.uint32)


class NgramStore:
    """Every n-gram the base wrote, with what followed it, over a corpus of its own answers (REST, arXiv
    2311.08252; SuffixDecoding, arXiv 2411.04975): the answers (each after the last STORE_PROMPT_TAIL tokens of
    its prompt, then a separator) in one token array, and its suffix array. A draft finds the longest tail of
    the sequence (STORE_MIN_CONTEXT..STORE_LONGEST tokens) that occurs in it by binary search, then follows the
    most frequent continuation of those occurrences token by token: suffixes sharing a prefix are adjacent and
    sorted by what follows, so each drafted token narrows a range, with no per-context table. It replaces the
    format-1 store, which kept 2-3 token contexts and drafted 3 tokens at most: the longer matches and longer drafts
    give prompt lookup more tokens per step (measured: docs/experiments.md, 2026-11-26 "the n-gram store as a
    suffix array"). Read-only once built: one store serves every sequence and thread."""

    def __init__(self, tokens: np.ndarray, sa: np.ndarray, vocab_size: int, _mapped: tuple | None = None) -> None:
        dtype = store_dtype(vocab_size)
        self.sep = int(np.iinfo(dtype).max)  # between answers; no token has this id
        self.tokens = np.asarray(tokens).astype(dtype, copy=False)
        self.sa = np.asarray(sa).astype(np.dtype(np.uint32).newbyteorder("<"), copy=False)
        self.vocab_size = int(vocab_size)
        # a loaded store's file is checksummed with its artifact: checking every entry would read all its pages
        if len(self.sa) != len(self.tokens) or (
            len(self.tokens)
            and (
                int(self.tokens[-1]) != self.sep
                or (
                    _mapped is None
                    and (
                        int(self.tokens[self.tokens != self.sep].max(initial=0)) >= vocab_size
                        or int(self.sa.max()) >= len(self.tokens)
                    )
                )
            )
        ):
            raise CloverError(
                "an n-gram store needs answers below the vocabulary size, each ended by the separator, "
                "and one suffix-array entry per token"
            )
        self._width = dtype.itemsize
        # a loaded store searches its file's pages in place (mmap: shared between processes, read only where
        # touched); a built one a copy of its tokens' bytes
        self._text, self._offset = _mapped if _mapped is not None else (self.tokens.tobytes(), 0)
        native = self.sa if sys.byteorder == "little" else self.sa.astype(np.uint32)  # x86: no copy
        self._sa = memoryview(np.ascontiguousarray(native)).cast("B").cast("I")  # indexable: plain 'I' items

    def __len__(self) -> int:
        """Tokens stored, separators included: each the end of a context the store can match."""
        return len(self.tokens)

    @classmethod
    def build(cls, sequences: Iterable[tuple[Sequence[int], int]], vocab_size: int) -> NgramStore:
        """The store of `sequences`: (tokens, start) pairs, an answer from `start` on after its prompt."""
        dtype = store_dtype(vocab_size)
        sep = np.array([np.iinfo(dtype).max], dtype=dtype)
        parts = []
        for tokens, start in sequences:
            t = np.asarray(tokens, dtype=np.int64)
            if start < len(t):
                parts += [t[max(0, start - STORE_PROMPT_TAIL) :].astype(dtype), sep]
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        return cls(tokens, suffix_array(tokens), vocab_size)

    def _key(self, size: int) -> Callable[[int], bytes]:
        text, w, o = self._text, self._width, self._offset
        return lambda s: text[o + s * w : o + s * w + size]

    def _first(self, pattern: bytes) -> int:
        """The suffix-array index of the first suffix that starts with `pattern`, or -1 if none does."""
        key = self._key(len(pattern))
        lo = bisect.bisect_left(self._sa, pattern, key=key)
        return lo if lo < len(self._sa) and key(self._sa[lo]) == pattern else -1

    def match(self, tokens: Sequence[int]) -> tuple[int, int, int]:
        """(m, lo, hi): the longest tail of `tokens` of STORE_MIN_CONTEXT..STORE_LONGEST tokens found in the
        store and the suffix-array range of its occurrences; m = 0 if none. A tail that occurs has every shorter
        tail occurring too, so m is found by binary search (one bisection per probe; the range's end once)."""
        tail = np.asarray(tokens[max(0, len(tokens) - STORE_LONGEST) :], dtype=np.int64)
        if len(tail) < STORE_MIN_CONTEXT or not len(self.tokens) or tail.max() >= self.vocab_size or tail.min() < 0:
            return 0, 0, 0
        best, low, high = (0, 0, b""), STORE_MIN_CONTEXT, len(tail)
        while low <= high:
            m = (low + high) // 2
            pattern = tail[len(tail) - m :].astype(self.tokens.dtype).tobytes()
            lo = self._first(pattern)
            if lo >= 0:
                best, low = (m, lo, pattern), m + 1
            else:
                high = m - 1
        m, lo, pattern = best
        return (m, lo, bisect.bisect_right(self._sa, pattern, lo=lo, key=self._key(len(pattern)))) if m else (0, 0, 0)

    def propose(self, tokens: Sequence[int], k: int, per_token: int | None = None) -> tuple[list[int], int]:
        """Up to k tokens continuing `tokens` (and up to per_token * m for a match of m, if given): where its
        longest stored tail occurs, the most frequent next token (ties: the smallest id), then the most frequent
        after that among the occurrences that went on so, and so on (ending at an answer's end). Also the tail's
        length m (0: no tail of STORE_MIN_CONTEXT tokens occurs)."""
        m, lo, hi = self.match(tokens) if k > 0 else (0, 0, 0)
        if per_token is not None:
            k = min(k, per_token * m)
        out: list[int] = []
        text = self.tokens
        while m and len(out) < k:
            # the range is sorted, so what its first and last occurrences share, all of them share: take it
            d = m + len(out)
            n = min(k - len(out), STORE_SORTED - d)
            if n <= 0:
                break
            first, last = self._sa[lo] + d, self._sa[hi - 1] + d
            a, b = text[first : first + n].tolist(), text[last : last + n].tolist()
            same = next(
                (j for j in range(min(len(a), len(b))) if a[j] != b[j] or a[j] == self.sep), min(len(a), len(b))
            )
            out += a[:same]
            if len(out) == k or same < len(a) and a[same] == self.sep or same == len(a):
                break
            # they part here: the most frequent next token (runs: the range is sorted by it), then its sub-range
            d += same
            nxt = self.tokens[self.sa[lo:hi].astype(np.int64) + d]
            starts = np.flatnonzero(np.r_[True, nxt[1:] != nxt[:-1]])
            runs = np.diff(np.r_[starts, len(nxt)])
            best = int(np.argmax(runs))
            token = int(nxt[starts[best]])
            if token == self.sep:
                break
            out.append(token)
            lo, hi = lo + int(starts[best]), lo + int(starts[best]) + int(runs[best])
        return out[:k], m

    def save(self, path: Path) -> None:
        with open(path, "wb") as f:  # stored, not compressed: loading maps the arrays in place
            np.savez(
                f, format=np.int64(STORE_FORMAT), tokens=self.tokens, sa=self.sa, vocab_size=np.int64(self.vocab_size)
            )

    @classmethod
    def of_artifact(cls, root: Path, manifest: Manifest) -> NgramStore | None:
        """The artifact's store (clover-export --ngram-store), or None if it has none."""
        if manifest.ngram_store is None:
            return None
        store = cls.load(Path(root) / manifest.ngram_store.file)
        vocab = int(manifest.base_config.get("vocab_size", 0))
        if store.vocab_size != vocab or len(store) != manifest.ngram_store.contexts:
            raise CloverError(
                f"artifact {root}: {manifest.ngram_store.file} does not match its manifest entry "
                f"({manifest.ngram_store.contexts} contexts, vocabulary {vocab}): export it again"
            )
        return store

    @classmethod
    def load(cls, path: Path) -> NgramStore:
        """The store saved at `path`, its arrays mapped from the file rather than read (numpy's npz members are
        stored uncompressed by `save`: each is a .npy at an offset in the zip)."""
        try:
            with np.load(path, allow_pickle=False) as z:
                if "format" not in z.files or int(z["format"]) != STORE_FORMAT:
                    raise CloverError(
                        f"the n-gram store {path} is of an older format: export the artifact again "
                        "(or add a store with clover.export.ngram_store.with_ngram_store)"
                    )
                vocab_size = int(z["vocab_size"])
            with open(path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                if hasattr(mmap, "MADV_RANDOM"):  # binary searches: no read-ahead around each probe
                    mapped.madvise(mmap.MADV_RANDOM)
                with zipfile.ZipFile(f) as z:
                    infos = {name: z.getinfo(f"{name}.npy") for name in ("tokens", "sa")}
                arrays = {name: _npz_member(f, info, mapped) for name, info in infos.items()}
            tokens, sa = arrays["tokens"][0], arrays["sa"][0]
            if tokens.dtype.byteorder != ">":  # the search compares the file's bytes: big-endian ids only
                raise ValueError("its tokens are not stored big-endian")
            # bounds, once at load (one pass over the map): a crafted store must fail here, not inside a step
            if sa.dtype.kind not in "iu" or (len(sa) and (int(sa.min()) < 0 or int(sa.max()) >= len(tokens))):
                raise ValueError("its suffix array points outside its tokens")
            if tokens.dtype != store_dtype(vocab_size):
                raise ValueError(
                    f"its tokens are {tokens.dtype}, not {store_dtype(vocab_size)} for a vocabulary of {vocab_size}"
                )
            sep = np.iinfo(tokens.dtype).max  # between sequences
            if len(tokens) and int(np.where(tokens == sep, 0, tokens).max()) >= vocab_size:
                raise ValueError(f"its tokens are not ids below its vocabulary size {vocab_size}")
            return cls(tokens, sa, vocab_size, (mapped, arrays["tokens"][1]))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            raise CloverError(f"cannot read the n-gram store {path} ({e}): export the artifact again") from None


def _npz_member(f, info: zipfile.ZipInfo, mapped: mmap.mmap) -> tuple[np.ndarray, int]:
    """The npz member `info` (stored uncompressed) as a view of `mapped` (the file's map), and its data offset."""
    name = info.filename
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{name} is compressed")
    f.seek(info.header_offset + 26)  # the local header's name and extra-field lengths
    name_len, extra_len = struct.unpack("<HH", f.read(4))
    f.seek(info.header_offset + 30 + name_len + extra_len)
    version = np.lib.format.read_magic(f)
    shape, fortran, dtype = (
        np.lib.format.read_array_header_1_0(f) if version == (1, 0) else np.lib.format.read_array_header_2_0(f)
    )
    if fortran or len(shape) != 1:
        raise ValueError(f"{name} is not a flat array")
    offset = f.tell()
    return np.frombuffer(mapped, dtype=dtype, count=shape[0], offset=offset), offset


class PromptLookup:
    def __init__(
        self,
        tokens: Sequence[int],
        max_ngram: int = 3,
        min_ngram: int = 1,
        store: NgramStore | None = None,
        texts: Callable[[int], bytes] | None = None,
        served: NgramStore | None = None,
    ) -> None:
        """store: the shipped n-gram store; served: the store of this engine's own past answers (runtime/served_store.py);
        texts: each token's bytes (the tokenizer's), for matches of text (`propose_valid`); None: none."""
        if not 1 <= min_ngram <= max_ngram:
            raise CloverError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram, self.store, self.texts = max_ngram, min_ngram, store, texts
        self.served = served
        self.from_served = False  # the last proposal came from the served answers (a store draft: match < 0)
        self.tokens: list[int] = []
        self._text = bytearray()  # with `texts`: the sequence's bytes, and where each token ends in them
        self._ends: list[int] = []
        # n-gram -> the index of the token after each of its OCCURRENCES latest occurrences, oldest first: propose
        # drafts after the last, propose_valid picks among them
        self._recent: dict[tuple[int, ...], list[int]] = {}
        # the last proposal's match length: > 0 in the sequence itself, < 0 (minus it) in the store, 0 none
        self.match = 0
        self.forbidden = 0  # of propose's draft, the tokens the grammar of the last propose_valid forbade
        # (from the served answers, k) -> (drafts, match) of each store's search at sequence length _searched_at
        self._searches: dict[tuple[bool, int], tuple[list[int], int]] = {}
        self._searched_at = -1
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the sequence (the prompt, then each step's emitted tokens)."""
        seq = self.tokens
        for t in tokens:
            seq.append(int(t))
            if self.texts is not None:
                self._text += self.texts(int(t))
                self._ends.append(len(self._text))
            end = len(seq) - 1  # the n-grams ending just before the new token now have a continuation
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n >= 0:
                    recent = self._recent.setdefault(tuple(seq[end - n : end]), [])
                    recent.append(end)
                    if len(recent) > OCCURRENCES:
                        del recent[0]

    def propose(self, k: int) -> np.ndarray:
        """Up to k draft tokens continuing the sequence (empty when its tail occurred nowhere before). A match
        of L tokens (the indexed n-gram extended backwards) drafts at most MATCH_DRAFTS_PER_TOKEN * L: a longer
        matched context predicts a longer continuation, and each drafted token costs a verify row whether or
        not it is accepted. With a store, a match of one token drafts only if the store has nothing (its
        matches of 2+ tokens, over many answers, predict better); the store's drafts are capped alike."""
        seq, self.match, self.from_served = self.tokens, 0, False
        stores = self._has_store and k > 0
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            recent = self._recent.get(tuple(seq[len(seq) - n :]))
            if recent:
                start = recent[-1]
                if n < STORE_MIN_CONTEXT and stores:
                    stored = self._stored(k)
                    if len(stored):
                        return stored
                length = self.match_length(start, n)
                if self.served is not None and k > 0:  # an answer served before that matches longer goes first
                    drafts, m = self._search(True, k)
                    if drafts and m > length:
                        self.match, self.from_served = -m, True
                        return np.array(drafts, dtype=np.int64)
                self.match = length
                return np.array(seq[start : start + min(k, MATCH_DRAFTS_PER_TOKEN * length)], dtype=np.int64)
        return self._stored(k) if stores else np.zeros(0, dtype=np.int64)

    def propose_valid(self, k: int, valid: Callable[[list[int]], int]) -> np.ndarray:
        """Under a grammar: of `propose`'s draft and the continuations of the tail's other kept occurrences (every
        matching n-gram, longest first, latest first; then the store's), the longest prefix `valid` allows (it
        returns how many leading tokens of a draft the grammar accepts); ties go to the earlier one, `propose`'s
        first. The latest occurrence of a JSON key's text is often the schema in the prompt, whose continuation
        the grammar forbids where an earlier value's is allowed. Drafting only: the verify decides what is
        emitted, so the output is the same whichever draft is picked."""
        first = self.propose(k)
        best, best_match = first[: valid(first.tolist())], self.match
        self.forbidden = len(first) - len(best)
        if len(best) == len(first) == k:
            return best
        seq = self.tokens
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            for start in reversed(self._recent.get(tuple(seq[len(seq) - n :]), ())):
                match = self.match_length(start, n)
                draft = seq[start : start + min(k, MATCH_DRAFTS_PER_TOKEN * match)]
                ok = valid(draft)
                if ok > len(best):
                    best, best_match = np.array(draft[:ok], dtype=np.int64), match
        if self._has_store and k > len(best):
            stored = self._stored(k)
            ok = valid(stored.tolist())
            if ok > len(best):
                best, best_match = stored[:ok], self.match
        if best_match <= 0 and self.texts is not None:  # no n-gram of the sequence recurs: its last word may
            text, match = self._text_match(k)
            ok = valid(text.tolist()) if len(text) else 0
            if ok:
                best, best_match = text[:ok], match
        self.match = best_match
        return best

    def _text_match(self, k: int) -> tuple[np.ndarray, int]:
        """Drafts after an earlier occurrence of the sequence's last word as text (a whole word there, ending
        where a token ends), and how many tokens the word spans (its match length); none if it does not occur
        so. Inside a JSON string the first word of a value has no space before it, so it is another token than
        in the prompt ("Marie" after the quote, " Marie" in "about Marie Curie"): no n-gram recurs, but the
        word does, and what followed it there (" Curie") is likely next."""
        n, ends = len(self.tokens), self._ends
        if n < 2:
            return np.zeros(0, dtype=np.int64), 0
        window = ends[max(0, n - 1 - TEXT_MATCH_TOKENS)]  # where the last few tokens begin
        word = _LAST_WORD.search(bytes(self._text[window:]))
        if word is None or len(word.group()) < TEXT_MATCH_BYTES:
            return np.zeros(0, dtype=np.int64), 0
        word = word.group()
        begin = len(self._text) - len(word)
        spans = n - bisect.bisect_right(ends, begin)  # tokens ending inside the word
        hi = begin  # occurrences that end before the word itself begins
        for _ in range(TEXT_MATCH_TRIES):
            at = self._text.rfind(word, 0, hi)
            if at < 0:
                break
            end = bisect.bisect_right(ends, at + len(word)) - 1  # the token that ends there, if one does
            if end >= 0 and ends[end] == at + len(word) and (at == 0 or not _WORD_BYTE.match(self._text, at - 1)):
                return np.array(
                    self.tokens[end + 1 : end + 1 + min(k, MATCH_DRAFTS_PER_TOKEN * spans)], np.int64
                ), spans
            hi = at + len(word) - 1
        return np.zeros(0, dtype=np.int64), 0

    @property
    def _has_store(self) -> bool:
        return self.store is not None or self.served is not None

    def _stored(self, k: int) -> np.ndarray:
        """The stores' draft: of the served answers' and the shipped store's, the one of the longer match (the served
        answers' on a tie); `match` becomes minus its matched length and `from_served` says whose it is (LookupLength
        learns each source's drafts apart)."""
        best: tuple = ([], 0, False)
        for served in (True, False):
            drafts, m = self._search(served, k)
            if drafts and m > best[1]:
                best = (drafts, m, served)
        drafts, m, served = best
        self.match, self.from_served = (-m if drafts else 0), bool(drafts) and served
        return np.array(drafts, dtype=np.int64)

    def _search(self, served: bool, k: int) -> tuple[list[int], int]:
        """One store's draft for the sequence as it is and its match length, searched once until the sequence grows:
        a step may ask again (propose's served answers, then `_stored`; propose_valid; the forced tokens), and a
        search of a large store costs ~0.2 ms."""
        if self._searched_at != len(self.tokens):
            self._searches.clear()
            self._searched_at = len(self.tokens)
        found = self._searches.get((served, k))
        if found is None:
            store = self.served if served else self.store
            found = store.propose(self.tokens, k, MATCH_DRAFTS_PER_TOKEN) if store is not None else ([], 0)
            self._searches[(served, k)] = found
        return found

    def match_length(self, start: int, n: int) -> int:
        """How many tokens before `start` equal the sequence's tail (n known to), up to MATCH_EXTEND."""
        seq, end, length = self.tokens, len(self.tokens), n
        while length < MATCH_EXTEND and start - length - 1 >= 0 and seq[start - length - 1] == seq[end - length - 1]:
            length += 1
        return length
