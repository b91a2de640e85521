"""The interface every backend implements, so one loop drives PyTorch, ONNX Runtime and TensorRT.

A runner holds one base model (and optionally draft heads) and serves sequences in slots: each slot has
its own KV caches and draft states, and one forward can run several slots' new tokens. All arrays crossing
this interface are numpy; the runner keeps its tensors (cache, hidden states, head states) on its own
device (docs/design.md, Conventions 5: public methods validate, `_impl` methods do the work).
"""

from __future__ import annotations

import abc
import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from clover.errors import CloverError
from clover.runtime.logprobs import StepLogprobs
from clover.runtime.lookup import NgramStore
from clover.runtime.processors import LogitsProcessors
from clover.runtime.sampling import SamplingParams
from clover.runtime.tree import Tree


@dataclass(frozen=True, kw_only=True)
class RunnerSpec:
    """What a caller asks of a backend's runner (runtime/configure.py); each backend's `from_spec` reads the fields
    it has and passes them to its `load_runner` by name."""

    heads: str | None = None  # the heads to draft with (None: the backend's default)
    dtype: str | None = None  # the precision expected (None: the backend's or the artifact's)
    threads: int | None = None  # intra-op threads (torch, ort)
    batch: bool = False  # ort: the artifact's batched base graph, if any
    device: str | None = None  # torch: the stacked runner on this device
    providers: str | Sequence[str] | None = None  # ort: execution providers


@dataclass(frozen=True)
class RunnerInfo:
    backend: str  # "torch", "ort", "trt"
    vocab_size: int
    max_context: int  # longest sequence (prompt + generated) the model supports
    heads: str | None  # head architecture, None for plain decoding
    heads_max_depth: int | None  # deepest tree the heads can draft (None: any)
    heads_name: str = "none"  # what --heads named, for reports
    default_tree: Tree | None = None  # the tree an exported artifact was built for (used when none is asked)
    # The base verifies chains bit for bit like plain steps but not branching trees (a fused graph with int8
    # compute, backends/ort.py): a branching tree could change the output, so it is refused.
    chains_only: bool = False
    kv_bytes_per_token: int = 0  # KV cache bytes one cached token takes (base and heads), for memory plans
    batch_slots: int = 1  # sequences one forward runs together (more take several engine calls)
    # int64 [K]: the full id of each column of the draft logits (clover-export --draft-vocab); None: all V tokens
    draft_vocab: np.ndarray | None = None
    # the base's continuations counted over its own answers (clover-export --ngram-store): prompt lookup drafts
    # from it when the sequence itself has no match (runtime/lookup.py); None: prompt lookup alone
    ngram_store: NgramStore | None = None
    # what this runner's verify time depends on besides the machine (artifact digest, graphs loaded, backend version
    # and settings): the key its verify-cost curve is cached under across loads (cost.verify_cost); None: not cached
    cost_key: str | None = None
    max_rows: int | None = None  # most new rows one forward of a sequence takes (TensorRT: its profiles); None: any

    def check_tree(self, tree: Tree) -> None:
        """One-line error for a tree this runner cannot verify losslessly."""
        if self.chains_only and not tree.is_chain:
            raise CloverError(f"tree {tree.name} branches, but {CHAINS_ONLY}")


CHAINS_ONLY = (
    "this artifact's base graph (fused attention, int8 compute) verifies only chains exactly: use plain "
    "or chain-N, or export with --attention portable for branching trees"
)


class EngineClock:
    """Wall time spent inside the engine's own calls (graph runs, module forwards): a step's time minus
    this is the host's share (top-k, masks, bindings, KV bookkeeping, Python). Used as `with clock: ...`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> EngineClock:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds += time.perf_counter() - self._start


@dataclass(eq=False)
class Slot:
    """One sequence's place in a runner: its lengths and the backend's per-sequence state (KV caches, the last
    forward's outputs, draft states). A runner serves any number of slots; a sequence never touches another's."""

    index: int  # lowest free number when opened: the row a batched graph binds this sequence to
    capacity: int  # most cached tokens (prompt + generated + the largest tree)
    past: int = 0  # tokens cached
    pending: int = 0  # rows of the last forward not yet committed
    state: Any = None  # the backend's (its own typed class)


@dataclass(frozen=True)
class Verify:
    """New tokens of one slot for a forward: tokens [T] int64 at positions past + depths [T], mask [T, T] bool
    (row i attends to new token j); last_only: logits of the last row only (a prompt)."""

    slot: Slot
    tokens: np.ndarray
    depths: np.ndarray
    mask: np.ndarray
    last_only: bool = False


@dataclass(frozen=True)
class SlotStep:
    """What one sequence's device-side step (`Runner.decode`) asks for beyond greedy: its sampling (temperature,
    top-p), its logits processors (penalties, logit bias, min_tokens), log-probabilities (alternatives per token),
    a grammar (a runtime.grammar.GrammarState: each tree row masked by its path's state)."""

    sampling: SamplingParams | None = None
    processors: LogitsProcessors | None = None
    logprobs: int | None = None
    grammar: Any = None


@dataclass(frozen=True, eq=False)
class Prefix:
    """A copy of one sequence's first `rows` committed tokens' caches, base and heads (`Runner.snapshot`): what
    `Runner.restore` puts back into a fresh slot. It holds memory of its own (`nbytes`), nothing of its slot's."""

    rows: int
    nbytes: int
    data: Any  # the backend's


class Decoded(NamedTuple):
    """One sequence's device-side step (`Runner.decode`): its accepted path (tree nodes, root first), the tokens it
    emitted (the last one the bonus) and their log-probabilities when asked for."""

    path: np.ndarray
    emitted: np.ndarray
    logprobs: StepLogprobs | None = None


class Runner(abc.ABC):
    """Sequences (slots) on one engine: forward (prefill / verify, several slots in one call), commit, and
    tree drafting, each for a slot. The single-sequence methods (`reset`, then `forward` / `commit` /
    `draft_*` without a slot) use one solo slot: batch 1 is just one slot."""

    info: RunnerInfo
    # Backends whose engine calls return when the work is done (CPU) time them here; asynchronous ones
    # (TensorRT on a CUDA stream) leave it None: host time cannot be told apart there without syncing.
    engine_clock: EngineClock | None = None

    def __init__(self) -> None:
        self._open: dict[int, Slot] = {}
        self._solo: Slot | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Release engine resources (idempotent)."""

    def open_slot(self, capacity: int) -> Slot:
        """A new sequence with room for `capacity` cached tokens."""
        if not 1 <= capacity <= self.info.max_context:
            raise CloverError(
                f"sequence capacity {capacity} is outside 1..{self.info.max_context} (the model's context)"
            )
        index = next(i for i in range(len(self._open) + 1) if i not in self._open)
        slot = Slot(index, capacity)
        slot.state = self._open_slot(slot)
        self._open[index] = slot
        return slot

    def release(self, slot: Slot) -> None:
        """Free a slot (its caches go back to the runner); idempotent."""
        if self._open.get(slot.index) is slot:
            del self._open[slot.index]
            self._release(slot)
            slot.state = None

    def fork(self, slot: Slot, capacity: int) -> Slot:
        """A new sequence whose caches start as copies of `slot`'s committed tokens (a prompt prefilled once for
        several choices), with room for `capacity` tokens. NotImplementedError where the backend cannot copy a
        sequence (`can_fork`)."""
        if slot.pending or slot.past > capacity:
            raise CloverError(f"cannot fork a sequence with {slot.pending} uncommitted rows into {capacity} tokens")
        new = self.open_slot(capacity)
        try:
            self._fork(slot, new)
        except BaseException:
            self.release(new)
            raise
        new.past = slot.past
        return new

    @property
    def can_fork(self) -> bool:
        return type(self)._fork is not Runner._fork

    def _fork(self, src: Slot, dst: Slot) -> None:
        """Copy src's committed caches and drafting state into dst's (freshly opened) state."""
        raise NotImplementedError(f"{type(self).__name__} cannot fork a sequence")

    @property
    def can_cache_prefixes(self) -> bool:
        """Whether `snapshot` and `restore` work here (runtime/prefix_cache.py)."""
        return type(self)._snapshot is not Runner._snapshot

    def snapshot(self, slot: Slot, rows: int, heads: bool = True) -> Prefix:
        """A copy of the slot's first `rows` committed tokens' caches, as far as its heads have taken them in
        (`Prefix.rows` may be fewer): another sequence whose tokens begin with those starts from it (`restore`).
        heads=False: the base's alone, for a caller that never drafts with the heads (prompt lookup)."""
        assert 1 <= rows <= slot.past, "runner.snapshot: rows outside the committed tokens"
        return self._snapshot(slot, rows, heads)

    def restore(self, slot: Slot, prefix: Prefix, rows: int) -> None:
        """A fresh slot takes a prefix's first `rows` tokens as its own committed ones; its next forward runs at
        position `rows`. The caller vouches that its tokens begin with those of the prefix's first rows + 1 (the
        heads' row i was computed with token i + 1)."""
        assert slot.past == 0 and not slot.pending, "runner.restore: the slot is not fresh"
        assert 1 <= rows <= min(prefix.rows, slot.capacity), "runner.restore: rows outside the prefix"
        self._restore(slot, prefix, rows)
        slot.past = rows

    def _snapshot(self, slot: Slot, rows: int, heads: bool) -> Prefix:
        raise NotImplementedError(f"{type(self).__name__} cannot copy a sequence's caches out")

    def _restore(self, slot: Slot, prefix: Prefix, rows: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot copy a sequence's caches in")

    @property
    def can_decode(self) -> bool:
        """Whether `decode` runs fixed-tree steps on the device (runtime/backends/torch_batch.py)."""
        return type(self).decode_async is not Runner.decode_async

    def decode(self, slots: Sequence[Slot], tree: Tree, asks: Sequence[SlotStep] | None = None) -> list[Decoded]:
        """One step of `tree` for each slot, drafted, verified, accepted and committed on the runner's device, as
        its `asks` says (SlotStep: sampling, logits processors with each path's history, log-probabilities, a
        grammar's masks; None: greedy, nothing else): each slot's accepted path (root first), emitted tokens and,
        when asked, their log-probabilities. The loop uses it where a sequence needs nothing else of the host in
        its step (runtime/loop.py); runners without it step through forward / commit / draft_*."""
        return self.decode_async(slots, tree, asks)()

    def decode_async(
        self, slots: Sequence[Slot], tree: Tree, asks: Sequence[SlotStep] | None = None
    ) -> Callable[[], list[Decoded]]:
        """`decode`, launched: returns at once where the device runs ahead of the host, with a call that waits for
        the step and returns its results (the slots' lengths advance then). Between the two the host may do its
        own work (the loop's overlap: runtime/loop.launch)."""
        raise NotImplementedError(f"{type(self).__name__} has no device-side step")

    @property
    def open_slots(self) -> int:
        return len(self._open)

    # -- the solo slot (one sequence at a time) ----------------------------------------------------
    def reset(self, capacity: int) -> None:
        """Start a new solo sequence with room for `capacity` cached tokens (the previous one is released)."""
        if self._solo is not None:
            self.release(self._solo)
        self._solo = None
        self._solo = self.open_slot(capacity)

    @property
    def solo(self) -> Slot:
        assert self._solo is not None, "runner: reset() opens the solo sequence"
        return self._solo

    @property
    def past_length(self) -> int:
        return self.solo.past

    @property
    def capacity(self) -> int:
        return self.solo.capacity

    # -- the step ---------------------------------------------------------------------------------
    def forward(
        self,
        tokens: np.ndarray,
        depths: np.ndarray,
        mask: np.ndarray,
        last_only: bool = False,
        slot: Slot | None = None,
    ) -> np.ndarray:
        """Run new tokens over one slot's cache (the solo one by default); see `Verify`. Returns logits
        [T, V] float32 ([1, V] if last_only)."""
        return self.forward_batch([Verify(slot or self.solo, tokens, depths, mask, last_only)])[0]

    def forward_batch(self, batch: Sequence[Verify]) -> list[np.ndarray]:
        """One forward over several slots' new tokens. Returns each slot's logits [T, V] float32 ([1, V] for
        last_only), in order."""
        for v in batch:
            T = v.tokens.shape[0]
            assert v.depths.shape == (T,) and v.mask.shape == (T, T), "runner.forward: inconsistent shapes"
            assert self._open.get(v.slot.index) is v.slot, "runner.forward: slot is not open"
            if self.info.chains_only and not np.array_equal(v.mask, np.tri(T, dtype=bool)):
                raise CloverError(f"a branching tree was given, but {CHAINS_ONLY}")
            if v.slot.past + T > v.slot.capacity:
                raise CloverError(
                    f"{T} new tokens after {v.slot.past} cached exceed the sequence capacity {v.slot.capacity}"
                )
        assert len({v.slot.index for v in batch}) == len(batch), "runner.forward: a slot appears twice"
        for v in batch:
            v.slot.pending = v.tokens.shape[0]
        return self._forward_batch(batch)

    def commit(self, path: np.ndarray, next_tokens: np.ndarray, slot: Slot | None = None) -> None:
        """Keep rows `path` (increasing) of the slot's last forward: compact their KV into the next cache
        slots and let the heads consume them, each paired with the token that follows it."""
        slot = slot or self.solo
        assert len(path) == len(next_tokens) and len(path) >= 1 and path[-1] < slot.pending
        self._commit(slot, np.asarray(path, dtype=np.int64), np.asarray(next_tokens, dtype=np.int64))
        slot.past += len(path)
        slot.pending = 0

    def draft_begin(self, slot: Slot | None = None) -> np.ndarray:
        """Draft logits [V] for the children of the root (the last emitted token), after a commit."""
        if self.info.heads is None:
            raise CloverError("this runner has no draft heads: use the plain tree")
        return self._draft_begin(slot or self.solo)

    def draft_prepare(self, slot: Slot | None = None) -> None:
        """Let the heads consume the rows committed so far now rather than at the next `draft_begin` (which
        takes every row waiting since the last one in one call). A prompt's rows go so: the heads' pass over
        the prompt is prompt processing, paid in the prefill like the base's, not by the first speculative step."""
        if self.info.heads is not None:
            self._draft_prepare(slot or self.solo)

    def draft_step(
        self, depth: int, nodes: np.ndarray, parents: np.ndarray, tokens: np.ndarray, slot: Slot | None = None
    ) -> np.ndarray:
        """For tree nodes at `depth` with their parents and tokens: draft logits [n, V] for their children."""
        return self._draft_step(slot or self.solo, depth, nodes, parents, tokens)

    # -- implementations ------------------------------------------------------------------------
    @abc.abstractmethod
    def _open_slot(self, slot: Slot) -> Any:
        """The backend's state for a new sequence."""

    def _release(self, slot: Slot) -> None:
        """Give a slot's buffers back (default: dropped with its state)."""

    def _forward_batch(self, batch: Sequence[Verify]) -> list[np.ndarray]:
        """Default: one engine call per slot (backends whose graphs batch override this)."""
        return [self._forward(v.slot, v.tokens, v.depths, v.mask, v.last_only) for v in batch]

    def _forward(
        self, slot: Slot, tokens: np.ndarray, depths: np.ndarray, mask: np.ndarray, last_only: bool
    ) -> np.ndarray:
        raise NotImplementedError

    @abc.abstractmethod
    def _commit(self, slot: Slot, path: np.ndarray, next_tokens: np.ndarray) -> None: ...

    @abc.abstractmethod
    def _draft_begin(self, slot: Slot) -> np.ndarray: ...

    def _draft_prepare(self, slot: Slot) -> None:
        """Default: the heads consume rows as they are committed (nothing waits)."""

    @abc.abstractmethod
    def _draft_step(
        self, slot: Slot, depth: int, nodes: np.ndarray, parents: np.ndarray, tokens: np.ndarray
    ) -> np.ndarray: ...


BACKENDS = {
    "torch": "clover.runtime.backends.torch",
    "ort": "clover.runtime.backends.ort",
    "trt": "clover.runtime.backends.trt",
}


def backend_module(name: str):
    """Import a backend lazily, so the core never pulls in torch / onnxruntime / TensorRT. A backend module has
    `from_spec(base, RunnerSpec) -> Runner`, `load_runner(base, ...)` with its own options, and `base_dir(base)`."""
    if name not in BACKENDS:
        raise CloverError(f"unknown backend {name!r}: available backends are {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])
