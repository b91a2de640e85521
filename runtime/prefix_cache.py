"""An exact cache of computed prefixes across requests (the Engine's; clover-serve's --prefix-cache-mb).

Chat clients and agents resend the whole conversation every turn. When a request ends, the tokens its slot computed
(its prompt and its answer) are copied out of the runner (`Runner.snapshot`); a later request whose prompt begins
with some of them copies those rows into its fresh slot (`Runner.restore`) and prefills only the rest. Entries are
copies: a running request never holds one, so eviction (least recently used first, within a byte budget) never
waits on anyone. The reuse is exact: the restored rows are bit for bit the rows the request would have computed,
since every backend's rows depend only on the tokens at and before them (the same property that makes a verify
row equal a plain step's); the tests check the tokens with the cache on and off.

vLLM hashes fixed-size KV blocks in a paged cache, SGLang keeps a radix tree of them; the runners here keep each
sequence's cache in one piece, so an entry is a whole sequence and the match is its longest common prefix with the
prompt, found by a scan (entries are few: tens of thousands of tokens each at most).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from clover.runtime.backend import Prefix, Runner, Slot

# Fewer reused tokens than this are prefilled instead: a copy of a handful of rows saves less than it costs to keep.
MIN_REUSE = 16


def default_budget_mb() -> int:
    """The budget when none is given: 1/16 of the machine's memory, at most 1 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 256
    return int(min(1024, total / 16 / 2**20))


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two id arrays share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass(eq=False)
class Entry:
    """One ended sequence's cached rows. `tokens` holds one token more than the rows (the one after the last): a
    head's row i was computed with token i + 1, so a row is reused only where that token matches too."""

    tokens: np.ndarray  # int64 [rows + 1 or more]
    prefix: Prefix
    salt: str | None = None  # only requests of the same cache_salt reuse it


class PrefixCache:
    """Ended sequences' caches by their tokens, within `budget_bytes` (see the module doc). Used on the engine's
    thread only; its counters are read by metrics."""

    def __init__(self, runner: Runner, budget_bytes: int, min_reuse: int = MIN_REUSE, heads: bool = True) -> None:
        """heads=False: keep the base's caches alone (an engine that never drafts with the runner's heads)."""
        self.runner, self.budget, self.min_reuse, self.heads = runner, int(budget_bytes), min_reuse, heads
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._next = 0
        self.bytes = 0
        self.queried_tokens = 0  # prompt tokens of the requests that looked
        self.hit_tokens = 0  # of them, the rows restored instead of prefilled

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: np.ndarray, salt: str | None = None) -> tuple[int | None, int]:
        """The entry of `salt` that covers most of `prompt` and the rows it gives (at most all but the prompt's last
        token, which the prefill runs for its logits); (None, 0) below the minimum."""
        best, rows = None, 0
        for key, e in self._entries.items():
            if e.salt != salt:
                continue
            n = min(common_prefix(e.tokens, prompt) - 1, e.prefix.rows, len(prompt) - 1)
            if n > rows or (n == rows and best is not None):  # ties: the more recently used
                best, rows = key, n
        return (best, rows) if rows >= self.min_reuse else (None, 0)

    def restore(self, slot: Slot, prompt: np.ndarray, salt: str | None = None) -> int:
        """Fill a fresh slot with the longest cached prefix of `prompt` among `salt`'s entries: the rows restored (0:
        none)."""
        self.queried_tokens += len(prompt)
        key, rows = self.match(prompt, salt)
        if key is None:
            return 0
        self._entries.move_to_end(key)
        self.runner.restore(slot, self._entries[key].prefix, rows)
        self.hit_tokens += rows
        return rows

    def store(self, slot: Slot, tokens: np.ndarray, salt: str | None = None) -> None:
        """Keep an ended sequence's rows for requests of `salt`: `tokens` are those its slot cached and the one after
        them (or fewer: rows past them, from a step whose tokens were dropped, are left out)."""
        rows = min(slot.past, len(tokens) - 1)
        if rows < self.min_reuse or rows * self.runner.info.kv_bytes_per_token > self.budget:
            return
        for key, e in self._entries.items():  # already held: an entry that begins with all of these
            if (
                e.salt == salt
                and len(e.tokens) >= rows + 1
                and e.prefix.rows >= rows
                and common_prefix(e.tokens, tokens) >= rows + 1
            ):
                self._entries.move_to_end(key)
                return
        prefix = self.runner.snapshot(slot, rows, self.heads)
        if prefix.rows < self.min_reuse or prefix.nbytes > self.budget:
            return
        tokens = np.array(tokens[: prefix.rows + 1], dtype=np.int64)
        for key, e in list(self._entries.items()):  # entries this one holds all of: an earlier turn, a prompt alone
            if e.salt == salt and e.prefix.rows <= prefix.rows and common_prefix(e.tokens, tokens) >= e.prefix.rows + 1:
                self._drop(key)
        self._entries[self._next] = Entry(tokens, prefix, salt)
        self._next += 1
        self.bytes += prefix.nbytes
        while self.bytes > self.budget:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).prefix.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
