"""The interface every backend implements, so one loop drives PyTorch, ONNX Runtime and TensorRT.

A runner holds one base model (and optionally draft heads) and the KV caches of one sequence. All
arrays crossing this interface are numpy; the runner keeps its tensors (cache, hidden states, head
states) on its own device (STYLE.md 5: public methods validate, `_impl` methods do the work).
"""

from __future__ import annotations

import abc
import importlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from clover.errors import CloverError
from clover.runtime.tree import Tree


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
    # compute, ort_backend.py): a branching tree could change the output, so it is refused.
    chains_only: bool = False

    def check_tree(self, tree: Tree) -> None:
        """One-line error for a tree this runner cannot verify losslessly."""
        if self.chains_only and not tree.is_chain:
            raise CloverError(f"tree {tree.name} branches, but {CHAINS_ONLY}")


CHAINS_ONLY = ("this artifact's base graph (fused attention, int8 compute) verifies only chains exactly: use plain "
               "or chain-N, or export with --attention portable for branching trees")


class EngineClock:
    """Wall time spent inside the engine's own calls (graph runs, module forwards): a step's time minus
    this is the host's share (top-k, masks, bindings, KV bookkeeping, Python). Used as `with clock: ...`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> "EngineClock":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds += time.perf_counter() - self._start


class Runner(abc.ABC):
    """One sequence on one engine: forward (prefill / verify), commit, and tree drafting."""

    info: RunnerInfo
    # Backends whose engine calls return when the work is done (CPU) time them here; asynchronous ones
    # (TensorRT on a CUDA stream) leave it None: host time cannot be told apart there without syncing.
    engine_clock: EngineClock | None = None

    def __init__(self) -> None:
        self._past = 0
        self._capacity = 0
        self._pending = 0  # rows of the last forward not yet committed

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Release engine resources (idempotent)."""

    @property
    def past_length(self) -> int:
        return self._past

    @property
    def capacity(self) -> int:
        return self._capacity

    def reset(self, capacity: int) -> None:
        """Start a new sequence with room for `capacity` cached tokens."""
        if not 1 <= capacity <= self.info.max_context:
            raise CloverError(f"sequence capacity {capacity} is outside 1..{self.info.max_context} (the model's context)")
        self._past, self._capacity, self._pending = 0, capacity, 0
        self._reset(capacity)

    # -- the step ---------------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, depths: np.ndarray, mask: np.ndarray, last_only: bool = False) -> np.ndarray:
        """Run new tokens over the cache: tokens [T] int64 at positions past + depths [T], mask [T, T] bool
        (row i attends to new token j). Returns logits [T, V] float32 ([1, V] if last_only)."""
        T = tokens.shape[0]
        assert depths.shape == (T,) and mask.shape == (T, T), "runner.forward: inconsistent shapes"
        if self.info.chains_only and not np.array_equal(mask, np.tri(T, dtype=bool)):
            raise CloverError(f"a branching tree was given, but {CHAINS_ONLY}")
        if self._past + T > self._capacity:
            raise CloverError(f"{T} new tokens after {self._past} cached exceed the sequence capacity {self._capacity}")
        self._pending = T
        return self._forward(tokens, depths, mask, last_only)

    def commit(self, path: np.ndarray, next_tokens: np.ndarray) -> None:
        """Keep rows `path` (increasing) of the last forward: compact their KV into the next cache slots
        and let the heads consume them, each paired with the token that follows it."""
        assert len(path) == len(next_tokens) and len(path) >= 1 and path[-1] < self._pending
        self._commit(np.asarray(path, dtype=np.int64), np.asarray(next_tokens, dtype=np.int64))
        self._past += len(path)
        self._pending = 0

    def draft_begin(self) -> np.ndarray:
        """Draft logits [V] for the children of the root (the last emitted token), after a commit."""
        if self.info.heads is None:
            raise CloverError("this runner has no draft heads: use the plain tree")
        return self._draft_begin()

    def draft_step(self, depth: int, nodes: np.ndarray, parents: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """For tree nodes at `depth` with their parents and tokens: draft logits [n, V] for their children."""
        return self._draft_step(depth, nodes, parents, tokens)

    # -- implementations ------------------------------------------------------------------------
    @abc.abstractmethod
    def _reset(self, capacity: int) -> None: ...

    @abc.abstractmethod
    def _forward(self, tokens: np.ndarray, depths: np.ndarray, mask: np.ndarray, last_only: bool) -> np.ndarray: ...

    @abc.abstractmethod
    def _commit(self, path: np.ndarray, next_tokens: np.ndarray) -> None: ...

    @abc.abstractmethod
    def _draft_begin(self) -> np.ndarray: ...

    @abc.abstractmethod
    def _draft_step(self, depth: int, nodes: np.ndarray, parents: np.ndarray, tokens: np.ndarray) -> np.ndarray: ...


BACKENDS = {"torch": "clover.runtime.torch_backend", "ort": "clover.runtime.ort_backend", "trt": "clover.runtime.trt_backend"}


def backend_module(name: str):
    """Import a backend lazily, so the core never pulls in torch / onnxruntime / TensorRT."""
    if name not in BACKENDS:
        raise CloverError(f"unknown backend {name!r}: available backends are {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])
