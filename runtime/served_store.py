"""Drafts from what this engine has served: every finished request's answer, with the prompt tail before it, joins a
store that prompt lookup drafts from beside the shipped n-gram store (EngineOptions.draft_store_mb, clover-serve's
--draft-store-mb).

Served traffic repeats itself: a retried or regenerated request, one bot's same question from many clients, an
agent re-running its loop with the same scaffolds and report formats (SuffixDecoding, arXiv 2411.04975, keeps such
a global tree of past outputs; vLLM ships it as `method: "suffix"`). The store is an `NgramStore` (the shipped
store's suffix array) over the latest answers within a byte budget, oldest out first. Adding never blocks a step:
`add` appends to a list under a lock, and a background thread rebuilds each changed scope's suffix array and swaps it
in whole (a search reads one immutable store; a rebuild of 1M tokens takes ~1 s on one core, so a new answer drafts
the next requests within a moment). Drafts are verified like any other, so the output is unchanged.

Scoped: each answer belongs to its request's scope (clover-serve: its API key's digest), and a request drafts only
from its own scope's answers, so a response's speed never tells one tenant what another was told; `shared` puts
every answer in one scope. Persisted, optionally: `directory` keeps each scope's answers in one file, written
atomically (a kill leaves the old file or the new one) and checked on load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from clover import atomic
from clover.errors import CloverError
from clover.runtime.lookup import STORE_PROMPT_TAIL, NgramStore, store_dtype

STORE_FILE_FORMAT = 1
REBUILD_DELAY_S = 0.05  # answers that end together (a batch) join one rebuild
# ... and a rebuild waits at least this many times the last one's duration after it: under steady traffic over a
# large store the background thread takes at most ~1/(1 + this) of a core from the engine
REBUILD_SPACING = 4.0
REBUILD_NICE = 10  # the rebuilding thread's niceness on Linux: the engine's steps go first
SA_BYTES = 4  # the suffix array's entry per token


def default_budget_mb() -> int:
    """The budget when none is given: 64 MiB (about 10M tokens of answers with a 16-bit vocabulary)."""
    return 64


class ServedStore:
    """The latest answers per scope, and the NgramStore built over each (see the module doc)."""

    def __init__(
        self, vocab_size: int, budget_bytes: int, shared: bool = False, directory: str | Path | None = None
    ) -> None:
        self.vocab_size, self.budget, self.shared = int(vocab_size), int(budget_bytes), shared
        self.dtype = store_dtype(vocab_size)
        # bytes per stored token: its id in the answers kept and in the built store's array, and its suffix-array entry
        self.itemsize = 2 * self.dtype.itemsize + SA_BYTES
        self.directory = Path(directory) if directory is not None else None
        self._answers: OrderedDict[str | None, deque[np.ndarray]] = OrderedDict()  # scope -> answers, oldest first
        self._order: deque[str | None] = deque()  # the scope of every answer, oldest first (the budget's order)
        self.bytes = 0
        self._built: dict[str | None, NgramStore] = {}
        self._dirty: set[str | None] = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self.rebuilds = 0
        self.save_error: str | None = None  # the last persistence failure, if any
        if self.directory is not None:
            self._load()
        self._thread = threading.Thread(target=self._rebuild_loop, name="clover-served-store", daemon=True)
        self._thread.start()

    # -- the engine's side --------------------------------------------------------------------------------------
    def scope(self, key: str | None) -> str | None:
        return None if self.shared else key

    def add(self, prompt: Sequence[int], answer: Sequence[int], key: str | None = None) -> None:
        """A finished request's answer (with its prompt's last STORE_PROMPT_TAIL tokens) into `key`'s scope."""
        if not len(answer):
            return
        tail = np.asarray(prompt[-STORE_PROMPT_TAIL:], np.int64)
        tokens = np.concatenate([tail, np.asarray(answer, np.int64)]).astype(self.dtype)
        size = (len(tokens) + 1) * self.itemsize  # and its separator
        if size > self.budget:
            return
        scope = self.scope(key)
        with self._lock:
            self._answers.setdefault(scope, deque()).append(tokens)
            self._order.append(scope)
            self.bytes += size
            self._dirty.add(scope)
            while self.bytes > self.budget:  # the oldest answers leave first, whoever's they were
                old = self._order.popleft()
                gone = self._answers[old].popleft()
                self.bytes -= (len(gone) + 1) * self.itemsize
                self._dirty.add(old)
            self._wake.notify()

    def store(self, key: str | None = None) -> NgramStore | None:
        """The store `key`'s requests draft from now (None: it has no answers yet)."""
        return self._built.get(self.scope(key))

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every answer added so far is searchable (tests, benchmarks, a clean shutdown)."""
        with self._lock:
            self._wake.notify()
            self._wake.wait_for(lambda: not self._dirty and not self._building, timeout)

    def close(self) -> None:
        """Stop the rebuilding thread (after the pending rebuild, so a persisted store is whole)."""
        self.flush()
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._thread.join(30)

    # -- the rebuild ----------------------------------------------------------------------------------------------
    _building = False

    def _rebuild_loop(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # Linux: a thread has its own niceness
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), REBUILD_NICE)
        last = 0.0
        while True:
            with self._lock:
                self._wake.wait_for(lambda: self._dirty or self._closed)
                if self._closed and not self._dirty:
                    return
            threading.Event().wait(max(REBUILD_DELAY_S, REBUILD_SPACING * last) if not self._closed else 0)
            start = time.perf_counter()
            with self._lock:
                dirty, self._dirty = self._dirty, set()
                work = {s: list(self._answers.get(s, ())) for s in dirty}
                self._building = True
            try:
                for scope, answers in work.items():
                    built = NgramStore.build(((a, STORE_PROMPT_TAIL) for a in answers), self.vocab_size)
                    if len(built):
                        self._built[scope] = built
                    else:
                        self._built.pop(scope, None)
                    self.rebuilds += 1
                    if self.directory is not None:
                        try:
                            self._save(scope, answers)
                        except OSError as e:  # a full disk: the old file stays whole, serving goes on
                            self.save_error = f"{type(e).__name__}: {e}"
            finally:
                last = time.perf_counter() - start
                with self._lock:
                    self._building = False
                    self._wake.notify_all()

    # -- persistence -------------------------------------------------------------------------------------------
    def _file(self, scope: str | None) -> Path:
        name = "shared" if scope is None else hashlib.sha256(scope.encode()).hexdigest()[:32]
        return self.directory / f"answers-{name}.npz"

    def _save(self, scope: str | None, answers: list[np.ndarray]) -> None:
        path = self._file(scope)
        if not answers:
            path.unlink(missing_ok=True)
            return
        lengths = np.array([len(a) for a in answers], np.int64)
        tokens = np.concatenate(answers).astype(self.dtype.newbyteorder("="))  # on disk in the machine's byte order
        meta = {"format": STORE_FILE_FORMAT, "vocab_size": self.vocab_size, "scope": scope}
        digest = hashlib.sha256(tokens.tobytes() + lengths.tobytes()).hexdigest()

        with atomic.replacing(path) as f:
            np.savez(f, tokens=tokens, lengths=lengths, meta=np.array(json.dumps(meta)), sha256=np.array(digest))

    def _load(self) -> None:
        """Every scope's answers from `directory` (a file that fails its check is refused in one line)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".answers-*.tmp"):  # a rewrite a kill cut short: the old file is whole
            stale.unlink(missing_ok=True)
        for path in sorted(self.directory.glob("answers-*.npz")):
            try:
                with np.load(path, allow_pickle=False) as z:
                    tokens, lengths = z["tokens"], z["lengths"]
                    tokens_bytes = tokens.tobytes()
                    meta, digest = json.loads(str(z["meta"])), str(z["sha256"])
            except Exception as e:  # noqa: BLE001 - any unreadable file is the same one-line refusal
                raise CloverError(f"draft store {path} cannot be read ({type(e).__name__}): delete it") from None
            if hashlib.sha256(tokens_bytes + lengths.tobytes()).hexdigest() != digest or lengths.sum() != len(tokens):
                raise CloverError(f"draft store {path} fails its checksum: delete it")
            if meta.get("format") != STORE_FILE_FORMAT or meta.get("vocab_size") != self.vocab_size:
                raise CloverError(f"draft store {path} is of another format or vocabulary: delete it")
            if (
                tokens.dtype.kind != "u"
                or tokens.dtype.itemsize != self.dtype.itemsize
                or (len(tokens) and int(tokens.max()) >= self.vocab_size)
            ):
                raise CloverError(f"draft store {path} holds token ids outside the vocabulary: delete it")
            scope, tokens = self.scope(meta.get("scope")), tokens.astype(self.dtype)
            for a in np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else []:
                self._answers.setdefault(scope, deque()).append(a)
                self._order.append(scope)
                self.bytes += (len(a) + 1) * self.itemsize
            self._dirty.add(scope)
        while self.bytes > self.budget:
            old = self._order.popleft()
            self.bytes -= (len(self._answers[old].popleft()) + 1) * self.itemsize
