"""One runner over an artifact's exported graphs, for every engine that runs them: ONNX Runtime on the CPU
(numpy arrays) and TensorRT on a GPU (torch CUDA tensors). The backends supply two small things: a graph-run
call (`EngineGraph.run(inputs, sizes, into)`) and an array adapter (`Arrays`: where tensors live and how
rows are gathered); commit, KV compaction, cache growth and drafting are written here once.

KV cache. Each layer's K and V live in one preallocated buffer [1, Hkv, slots, D] per sequence, bound
whole as the graph's past inputs; `past_lengths` masks the slots not yet filled (while nothing is cached,
0 slots are bound, so a prompt reads no masked slots). A graph that returns only the new tokens' K/V gets
the accepted rows written into the next slots at commit (m rows per layer, never the whole cache). A graph
that writes the new rows into the buffer itself (ONNX Runtime's fused attention: the buffers are bound as
its present outputs too, `shared`) only has an accepted tree path's rows moved to contiguous slots, and
nothing for a chain. Buffers start at `cache_block` slots and double when full (capped at the capacity):
attention reads at most ~2x the slots it needs, and growth copies less than one extra write per token.

Draft heads. A `Drafter` adapts each head family: Clover and Clover-2 run a begin graph over every
accepted token (their augmenting block has its own KV cache) and a step graph per tree level; Medusa's
heads read only the last accepted token's hidden state and draft every node at a depth alike. The
begin graph's rows wait until a step drafts: plain steps (`tree="auto"` often picks them) cost no head work.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from clover.artifact import GraphSpec, Manifest, slot_name
from clover.runtime.backend import Prefix, Runner, RunnerInfo, Slot
from clover.runtime.lookup import NgramStore
from clover.runtime.tree import compile_spec

PAST, PRESENT = "past_key_values", "present"
FREE_CACHES = 4  # released sequences' caches kept for reuse
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


class EngineGraph(Protocol):
    """One compiled graph. `run` takes every input (arrays of the runner's `Arrays`) and the sizes of the
    graph's named dims, writes the outputs named in `into` into those arrays, and returns the others."""

    def has_input(self, name: str) -> bool: ...

    def run(
        self, inputs: Mapping[str, Any], sizes: Mapping[str, int], into: Mapping[str, Any] | None = None
    ) -> dict[str, Any]: ...


class Arrays(abc.ABC):
    """Where a runner's tensors live (numpy on the host, torch on a CUDA device): the few operations the
    bookkeeping needs beyond slicing and slice assignment, which both support alike."""

    @abc.abstractmethod
    def put(self, host: np.ndarray) -> Any:
        """A small host array (ids, positions, masks) as an engine input."""

    @abc.abstractmethod
    def host(self, array: Any) -> np.ndarray:
        """Logits back to the host, float32."""

    @abc.abstractmethod
    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any: ...

    @abc.abstractmethod
    def take(self, array: Any, index: np.ndarray, axis: int) -> Any:
        """Rows `index` along `axis`, copied (contiguous)."""

    @abc.abstractmethod
    def scatter(self, dst: Any, index: np.ndarray, src: Any) -> None:
        """dst[index] = src along the first axis."""

    @abc.abstractmethod
    def concat(self, arrays: Sequence[Any], axis: int) -> Any: ...

    @abc.abstractmethod
    def copy(self, array: Any) -> Any: ...

    def scope(self) -> contextlib.AbstractContextManager:
        """Entered around every runner call (a CUDA device and stream)."""
        return contextlib.nullcontext()


class NumpyArrays(Arrays):
    def put(self, host):
        return np.ascontiguousarray(host)

    def host(self, array):
        return array.astype(np.float32, copy=False)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def take(self, array, index, axis):
        return np.take(array, index, axis=axis)

    def scatter(self, dst, index, src):
        dst[index] = src

    def concat(self, arrays, axis):
        return np.concatenate(arrays, axis=axis)

    def copy(self, array):
        return array.copy()


class KVCache:
    """One sequence's per-layer K and V buffers [1, Hkv, slots, D] for a graph's past inputs; slots grow by
    doubling. `shared`: the graph writes its new rows into the buffers (bound as its present outputs too)."""

    def __init__(self, spec: GraphSpec, slots: int, arrays: Arrays, shared: bool = False) -> None:
        self.arrays, self.shared = arrays, shared
        self.names = [t.name for t in spec.inputs if t.name.startswith(PAST + ".")]
        first = spec.input(self.names[0]) if self.names else None
        self.kv_heads, self.head_dim = (int(first.shape[1]), int(first.shape[3])) if first else (0, 0)
        self.dtype = first.dtype if first else "float32"
        self.dim = first.shape[2] if first else "past"  # the graph's name for the cache-slot dim
        self.buffers = self._allocate(slots)
        self._bound: dict[tuple[int | None, bool], tuple[dict, dict, dict]] = {}  # what `bound` returns, per buffer set

    @property
    def slots(self) -> int:
        return self.buffers[0].shape[2] if self.buffers else 0

    def _allocate(self, slots: int) -> list[Any]:
        # Zeroed (numpy: calloc, pages appear on first write): masked slots meet exact-zero attention
        # weights, and 0 * NaN from uninitialised memory would not be zero.
        return [self.arrays.zeros((1, self.kv_heads, slots, self.head_dim), self.dtype) for _ in self.names]

    def make_room(self, past: int, new: int, capacity: int) -> None:
        """Room for `new` rows after `past` cached ones, up to `capacity` tokens. Shared buffers keep one slot more:
        their graph runs attention on at least 2 rows (a lone row is repeated into the slot after it,
        export/fused_graph.py)."""
        self.ensure(past + max(new, 1 + self.shared), past, capacity + self.shared)

    def ensure(self, needed: int, filled: int, limit: int) -> None:
        """Make room for `needed` slots (at most `limit`), keeping the first `filled`."""
        if needed <= self.slots:
            return
        old, self.buffers = self.buffers, self._allocate(min(limit, max(needed, 2 * self.slots)))
        self._bound = {}
        for new, buf in zip(self.buffers, old):
            new[:, :, :filled] = buf[:, :, :filled]

    def bound(self, past: int, slot: int | None = None) -> tuple[dict[str, Any], dict[str, Any], dict[str, int]]:
        """(past inputs, in-place outputs, {slot dim: size}) for a call after `past` cached tokens; `slot`: as
        a batched graph's inputs for that sequence slot."""
        key = (slot, bool(past or self.shared))
        if key not in self._bound:  # built once per buffer set: a step binds 2 x layers arrays per sequence
            views = self.buffers if key[1] else [b[:, :, :0] for b in self.buffers]  # [1, Hkv, S, D]
            name = (lambda n: n) if slot is None else (lambda n: slot_name(n, slot))
            into = {name(PRESENT + n[len(PAST) :]): b for n, b in zip(self.names, self.buffers)} if self.shared else {}
            self._bound[key] = (
                {name(n): v for n, v in zip(self.names, views)},
                into,
                {self.dim: views[0].shape[2] if views else 0},
            )
        return self._bound[key]

    def copy_from(self, other: KVCache, rows: int, capacity: int) -> None:
        """Hold a copy of `other`'s first `rows` slots (a forked sequence; room up to `capacity` tokens)."""
        self.make_room(0, rows, capacity)  # a fresh sequence: nothing of its own to keep
        for new, old in zip(self.buffers, other.buffers):
            new[:, :, :rows] = old[:, :, :rows]

    def export(self, rows: int) -> list[Any]:
        """Copies of the first `rows` slots of every buffer [1, Hkv, rows, D] (a prefix kept for later sequences)."""
        return [self.arrays.copy(b[:, :, :rows]) for b in self.buffers]

    def load(self, saved: Sequence[Any], rows: int, capacity: int) -> None:
        """A fresh sequence's buffers take the first `rows` slots of `export`ed ones (room up to `capacity`)."""
        self.make_room(0, rows, capacity)
        for new, old in zip(self.buffers, saved):
            new[:, :, :rows] = old[:, :, :rows]

    def move(self, start: int, rows: np.ndarray) -> None:
        """Shared buffers: move slots start + rows to start, start + 1, ... (an accepted tree path)."""
        for buf in self.buffers:
            buf[:, :, start : start + len(rows)] = self.arrays.take(buf, start + rows, 2)

    def write(self, start: int, outputs: Mapping[str, Any], rows: np.ndarray | None, count: int) -> None:
        """Copy `count` new rows (the rows `rows` of `present`, or its first `count`) to slots start.."""
        for name, buf in zip(self.names, self.buffers):
            new = outputs[PRESENT + name[len(PAST) :]]  # [1, Hkv, T, D]
            buf[:, :, start : start + count] = new[:, :, :count] if rows is None else self.arrays.take(new, rows, 2)


def writes_in_place(spec: GraphSpec) -> bool:
    """Whether a graph writes its new K/V rows into its cache buffers (fused attention): its present outputs have
    the past inputs' slot dim, not the new rows'."""
    past = [t for t in spec.inputs if t.name.startswith(PAST + ".")]
    return bool(past) and spec.output(PRESENT + past[0].name[len(PAST) :]).shape[2] == past[0].shape[2]


def kv_bytes_per_token(spec: GraphSpec) -> int:
    """Bytes of K and V one cached token takes over a graph's past inputs [batch, Hkv, slots, D]."""
    return sum(
        int(t.shape[1]) * int(t.shape[3]) * ITEMSIZE[t.dtype] for t in spec.inputs if t.name.startswith(PAST + ".")
    )


# -- draft heads ---------------------------------------------------------------------------------------------


class Drafter(abc.ABC):
    """One head family's drafting over its graphs, with per-sequence state of its own (`open`)."""

    graph_names: tuple[str, ...]

    @abc.abstractmethod
    def open(self, slots: int, reuse: Any = None) -> Any:
        """A new sequence's state (`reuse`: what a released one left, see `release`)."""

    @abc.abstractmethod
    def accept(self, state: Any, hidden: Any, next_tokens: np.ndarray) -> None:
        """Accepted rows' hidden states [1, m, H], each with the token that follows it."""

    @abc.abstractmethod
    def begin(self, state: Any, slot: Slot) -> np.ndarray:
        """Draft logits [V] for the root's children."""

    def prepare(self, state: Any, slot: Slot) -> None:
        """Consume the accepted rows waiting for the next `begin` now (default: nothing waits)."""

    @abc.abstractmethod
    def step(self, state: Any, depth: int, nodes: np.ndarray, parents: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Draft logits [n, V] for the children of `nodes`."""

    def release(self, state: Any) -> Any:
        """What a released sequence leaves for reuse (its caches), or None."""
        return None

    @abc.abstractmethod
    def fork(self, src: Any, dst: Any, past: int, capacity: int) -> None:
        """Copy a sequence's drafting state (after `past` committed tokens) into a fresh one's."""

    def seen(self, state: Any, past: int) -> int:
        """Of `past` committed rows, those the heads' caches hold (default: all; they keep none)."""
        return past

    def export(self, state: Any, rows: int) -> Any:
        """Copies of the heads' caches of the first `rows` tokens (<= `seen`), or None where they keep none."""
        return None

    def load(self, state: Any, saved: Any, rows: int, capacity: int) -> None:
        """A fresh sequence's state takes `export`ed caches of `rows` tokens; its next accepted rows follow them."""

    @property
    @abc.abstractmethod
    def graphs(self) -> tuple[EngineGraph, ...]: ...


@dataclass(eq=False)
class TreeDraft:
    """A sequence's Clover / Clover-2 drafting state."""

    cache: KVCache  # the augmenting block's
    states: Any = None  # [n, H] draft state of tree node i (grown as drafted)
    behind: list[tuple[Any, np.ndarray]] = field(default_factory=list)  # accepted rows the heads have not seen
    root_state: Any = None  # [1, H] after the last accepted token
    root_logits: Any = None  # [V]


class TreeDrafter(Drafter):
    """Clover / Clover-2: `draft_begin` runs the augmenting block over the accepted tokens, `draft_step` one
    tree level from its parents' states and tokens."""

    graph_names = ("draft_begin", "draft_step")

    def __init__(
        self, begin: EngineGraph, step: EngineGraph, spec: GraphSpec, arrays: Arrays, state_dtype: str
    ) -> None:
        self.begin_graph, self.step_graph, self.spec, self.arrays, self.state_dtype = (
            begin,
            step,
            spec,
            arrays,
            state_dtype,
        )
        self.in_place = writes_in_place(spec)  # a fused draft_begin (export/fused_graph.py)

    @property
    def graphs(self):
        return self.begin_graph, self.step_graph

    def open(self, slots, reuse=None):
        return TreeDraft(reuse if reuse is not None else KVCache(self.spec, slots, self.arrays, shared=self.in_place))

    def release(self, state):
        return state.cache

    def accept(self, state, hidden, next_tokens):
        state.behind.append((hidden, next_tokens))

    def fork(self, src, dst, past, capacity):
        a = self.arrays
        seen = past - sum(len(t) for _, t in src.behind)  # rows the augmenting block's cache holds
        dst.cache.copy_from(src.cache, seen, capacity)
        # copies: a graph's outputs may live in buffers its next run overwrites
        dst.behind = [(a.copy(h), t) for h, t in src.behind]
        dst.root_state = None if src.root_state is None else a.copy(src.root_state)
        dst.root_logits = None if src.root_logits is None else a.copy(src.root_logits)

    def seen(self, state, past):
        return past - sum(len(t) for _, t in state.behind)

    def export(self, state, rows):
        return state.cache.export(rows)

    def load(self, state, saved, rows, capacity):
        if saved is not None:  # None: a prefix kept without the heads' state, for a caller that never drafts with them
            state.cache.load(saved, rows, capacity)
        state.behind, state.root_state, state.root_logits = [], None, None

    def _catch_up(self, state: TreeDraft, slot: Slot) -> None:
        """The begin graph over the accepted rows it has not seen (one call for several steps)."""
        a = self.arrays
        m = sum(len(t) for _, t in state.behind)
        P = slot.past - m  # where the first waiting row sits in the sequence
        hidden = (
            state.behind[0][0] if len(state.behind) == 1 else a.concat([h for h, _ in state.behind], 1)
        )  # [1, m, H]
        tokens = np.concatenate([t for _, t in state.behind])
        state.behind.clear()
        state.cache.make_room(P, m, slot.capacity)  # in place: the rows land at slots P..
        past, into, dims = state.cache.bound(P)
        out = self.begin_graph.run(
            {
                "hidden_states": hidden,
                "next_tokens": a.put(tokens[None]),  # [1, m]
                "position_ids": a.put(np.arange(P, P + m, dtype=np.int64)[None]),  # [1, m]
                "past_lengths": a.put(np.array([P], dtype=np.int64)),  # [1]
                **past,
            },
            {"batch": 1, "accepted": m, **dims},
            into,
        )
        if not state.cache.shared:
            state.cache.write(P, out, None, m)
        state.root_state, state.root_logits = out["state"], out["logits"][0]

    def prepare(self, state, slot):
        if state.behind:
            self._catch_up(state, slot)

    def begin(self, state, slot):
        self.prepare(state, slot)
        state.states = self.arrays.copy(state.root_state)  # row i = state of tree node i (grown as drafted)
        return self.arrays.host(state.root_logits)

    def step(self, state, depth, nodes, parents, tokens):
        a = self.arrays
        need = int(nodes.max()) + 1
        if state.states.shape[0] < need:
            grown = a.zeros((need, state.states.shape[1]), self.state_dtype)
            grown[: state.states.shape[0]] = state.states
            state.states = grown
        inputs = {
            "parent_state": a.take(state.states, parents, 0),  # [n, H]
            "tokens": a.put(tokens.astype(np.int64, copy=False)),
        }  # [n]
        if self.step_graph.has_input("depth"):
            inputs["depth"] = a.put(np.array(depth, dtype=np.int64))  # []
        out = self.step_graph.run(inputs, {"candidates": len(nodes)})
        a.scatter(state.states, nodes, out["state"])
        return a.host(out["logits"])


@dataclass(eq=False)
class MedusaDraft:
    hidden: Any = None  # [1, 1, H] the last accepted token's hidden state
    logits: np.ndarray | None = None  # [K, V] on the host: every head's draft after it


class MedusaDrafter(Drafter):
    """Medusa: K heads on the last accepted token's hidden state; every node at depth d gets head d's draft."""

    graph_names = ("medusa_heads",)

    def __init__(self, graph: EngineGraph, arrays: Arrays) -> None:
        self.graph, self.arrays = graph, arrays

    @property
    def graphs(self):
        return (self.graph,)

    def open(self, slots, reuse=None):
        return MedusaDraft()

    def accept(self, state, hidden, next_tokens):
        state.hidden = hidden[:, -1:]  # its heads only read the last accepted token's state

    def fork(self, src, dst, past, capacity):
        dst.hidden = None if src.hidden is None else self.arrays.copy(src.hidden)
        dst.logits = src.logits

    def begin(self, state, slot):
        state.logits = self.arrays.host(
            self.graph.run({"hidden_states": state.hidden}, {"batch": 1, "accepted": 1})["logits"][0]
        )
        return state.logits[0]

    def step(self, state, depth, nodes, parents, tokens):
        return np.repeat(state.logits[depth][None], len(nodes), axis=0)


def graphs_used(manifest: Manifest, use_heads: bool) -> tuple[str, ...]:
    """The graphs a runner runs: the base, and the heads' draft graphs if it drafts with them."""
    heads = manifest.heads if use_heads else None
    if heads is None:
        return ("base",)
    return ("base", *(MedusaDrafter if heads.arch == "medusa" else TreeDrafter).graph_names)


# -- the runner -------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class GraphSequence:
    """A slot's state in a GraphRunner: its KV cache, the last forward's outputs and its drafting state."""

    cache: KVCache
    draft: Any = None  # the Drafter's state
    last: dict[str, Any] = field(default_factory=dict)


class GraphRunner(Runner):
    """A Runner over an artifact's graphs, given as EngineGraphs (base, and the heads' draft graphs) and the
    Arrays they take. A base graph that writes its new K/V rows into the cache (fused attention, `writes_in_place`)
    runs attention on at least 2 rows (a 1-token step repeats its row, export/fused_graph.py), so its buffers keep
    one slot of room beyond a 1-token step (KVCache.make_room).

    Where this machine's kernels compute a lone row otherwise than the same row among others (`lone_row_differs`:
    ONNX Runtime's MatMulNBits on AVX2 CPUs has a 1-row kernel of its own), every forward runs at least 2 rows: a
    1-token step runs its token twice (the second row is dropped and its K/V slot overwritten by the next step,
    as a rejected draft's), and a lone logit row is taken twice. A plain step then equals a chain verify's row
    bit for bit, as greedy identity needs, and a lone sequence equals the batched graph's rows."""

    def __init__(
        self,
        manifest: Manifest,
        graphs: Mapping[str, EngineGraph],
        arrays: Arrays,
        *,
        use_heads: bool,
        backend: str,
        cache_block: int,
        max_context: int | None = None,
        chains_only: bool = False,
        batch_slots: int = 1,
        draft_vocab: np.ndarray | None = None,
        ngram_store: NgramStore | None = None,
        max_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.manifest, self.arrays, self.cache_block = manifest, arrays, cache_block
        self.base = graphs["base"]
        self.base_spec = manifest.graphs["base"]
        self.in_place = writes_in_place(self.base_spec)
        self.vocab_size = int(
            manifest.graphs[("lm_head" if "lm_head" in manifest.graphs else "base")].output("logits").shape[-1]
        )
        self.hidden_size = int(self.base_spec.output("hidden_states").shape[-1])
        heads = manifest.heads if use_heads else None
        self.arch = heads.arch if heads is not None else None
        self.drafter: Drafter | None = None
        if self.arch == "medusa":
            self.drafter = MedusaDrafter(graphs["medusa_heads"], arrays)
        elif self.arch is not None:
            self.drafter = TreeDrafter(
                graphs["draft_begin"],
                graphs["draft_step"],
                manifest.graphs["draft_begin"],
                arrays,
                self.base_spec.output("hidden_states").dtype,
            )
        tree = manifest.tree if heads is not None else None
        caches = [self.base_spec] + ([manifest.graphs["draft_begin"]] if isinstance(self.drafter, TreeDrafter) else [])
        self.info = RunnerInfo(
            backend=backend,
            vocab_size=self.vocab_size,
            max_context=max_context or manifest.max_context,
            heads=self.arch,
            heads_max_depth=heads.max_depth if heads is not None else None,
            heads_name=heads.name if heads is not None else "none",
            default_tree=compile_spec(tree) if tree else None,
            chains_only=chains_only,
            kv_bytes_per_token=sum(map(kv_bytes_per_token, caches)),
            batch_slots=batch_slots,
            draft_vocab=draft_vocab if heads is not None else None,
            ngram_store=ngram_store,
            max_rows=max_rows,
        )
        self._free: list[tuple[KVCache, Any]] = []  # released sequences' caches of the initial size
        self.two_rows = False  # run every forward on >= 2 rows (set from lone_row_differs by the backend)

    @property
    def cache(self) -> KVCache | None:
        return self._solo.state.cache if self._solo else None  # the solo sequence's (tests, tools)

    @property
    def head_cache(self) -> KVCache | None:
        draft = self._solo.state.draft if self._solo else None
        return draft.cache if isinstance(draft, TreeDraft) else None

    def _open_slot(self, slot):
        slots = min(slot.capacity, self.cache_block)
        # A released sequence's buffers of this size are reused: they keep its K/V, finite values masked by past_lengths.
        reuse = next((i for i, (c, _) in enumerate(self._free) if c.slots == slots), None)
        cache, head_cache = self._free.pop(reuse) if reuse is not None else (None, None)
        with self.arrays.scope():
            if cache is None:
                cache = KVCache(self.base_spec, slots, self.arrays, shared=self.in_place)
            draft = self.drafter.open(slots, head_cache) if self.drafter is not None else None
        return GraphSequence(cache, draft)

    def _release(self, slot):
        seq = slot.state
        if seq.cache.slots == min(slot.capacity, self.cache_block) and len(self._free) < FREE_CACHES:
            self._free.append((seq.cache, self.drafter.release(seq.draft) if self.drafter is not None else None))

    def _fork(self, src, dst):
        s, d = src.state, dst.state
        with self.arrays.scope():
            d.cache.copy_from(s.cache, src.past, dst.capacity)
            if self.drafter is not None:
                self.drafter.fork(s.draft, d.draft, src.past, dst.capacity)

    def _snapshot(self, slot, rows, heads):
        seq, drafter = slot.state, self.drafter if heads else None
        if drafter is not None:
            rows = min(rows, drafter.seen(seq.draft, slot.past))
        with self.arrays.scope():
            heads = drafter.export(seq.draft, rows) if drafter is not None else None
            base = seq.cache.export(rows)
        return Prefix(rows, sum(a.nbytes for a in base + (heads or [])), (base, heads))

    def _restore(self, slot, prefix, rows):
        seq, (base, heads) = slot.state, prefix.data
        with self.arrays.scope():
            seq.cache.load(base, rows, slot.capacity)
            if self.drafter is not None:
                self.drafter.load(seq.draft, heads, rows, slot.capacity)

    def _make_room(self, slot: Slot, new: int) -> None:
        """The slot's cache holds its past and `new` rows (KVCache.make_room)."""
        slot.state.cache.make_room(slot.past, new, slot.capacity)

    def teacher_forced(self, tokens: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One sequence through the base graph on a fresh slot (causal, empty cache): its hidden states [T, H]
        and the logits [len(rows), V] of `rows`. What head training reads from the graph that will serve."""
        T = len(tokens)
        slot = self.open_slot(T + 2)
        try:
            logits = self._forward(
                slot,
                np.asarray(tokens, dtype=np.int64),
                np.arange(T),
                np.tri(T, dtype=bool),
                False,
                rows=np.asarray(rows, dtype=np.int64),
            )
            return self.arrays.host(slot.state.last["hidden_states"])[0], logits
        finally:
            self.release(slot)

    def lone_row_differs(self) -> bool:
        """Whether a 1-token step's logits or hidden state differ, in any bit, from the first row of a 2-token
        chain over the same cache: measured on a short made-up prompt in a slot of its own (lone rows run alone)."""
        slot, two_rows, self.two_rows = self.open_slot(16), self.two_rows, False
        try:
            prompt = np.arange(1, 4, dtype=np.int64) % self.vocab_size
            self.forward(prompt, np.arange(3), np.tri(3, dtype=bool), slot=slot)
            self.commit(np.arange(3), np.append(prompt[1:], 4 % self.vocab_size), slot=slot)
            chain = np.array([4, 5], dtype=np.int64) % self.vocab_size
            alone = self.forward(chain[:1], np.zeros(1, np.int64), np.ones((1, 1), bool), slot=slot)[0].copy()
            alone_hidden = self.arrays.host(slot.state.last["hidden_states"])[0, 0].copy()
            among = self.forward(chain, np.arange(2), np.tri(2, dtype=bool), slot=slot)[0]
            among_hidden = self.arrays.host(slot.state.last["hidden_states"])[0, 0]
            slot.state.last = {}
            return not (np.array_equal(alone, among) and np.array_equal(alone_hidden, among_hidden))
        finally:
            self.two_rows = two_rows
            self.release(slot)

    def _forward(self, slot, tokens, depths, mask, last_only, rows=None):
        seq, P, T, a = slot.state, slot.past, tokens.shape[0], self.arrays
        if rows is None:
            rows = np.array([T - 1] if last_only else range(T), dtype=np.int64)
        keep, real = len(rows), T
        if self.two_rows:  # see the class docstring
            if T == 1:
                tokens, depths, mask, T = np.repeat(tokens, 2), depths[0] + np.arange(2), np.tri(2, dtype=bool), 2
            rows = np.repeat(rows, 2) if keep == 1 else rows
        with a.scope():
            self._make_room(slot, T)
            past, into, dims = seq.cache.bound(P)
            seq.last = self.base.run(
                {
                    "input_ids": a.put(tokens.astype(np.int64, copy=False)[None]),  # [1, T]
                    "position_ids": a.put((P + depths.astype(np.int64))[None]),  # [1, T]
                    "tree_mask": a.put(mask.astype(bool, copy=False)[None]),  # [1, T, T]
                    "past_lengths": a.put(np.array([P], dtype=np.int64)),  # [1]
                    "logit_rows": a.put(rows),  # [R]
                    **past,  # [1, Hkv, slots, D] each
                },
                {"batch": 1, "new": T, "rows": len(rows), **dims},
                into,
            )
            seq.last["hidden_states"] = seq.last["hidden_states"][:, :real]  # [1, real, H]: a repeated row drops
            return a.host(seq.last["logits"][0])[:keep]  # [R, V]

    def _commit(self, slot, path, next_tokens):
        seq, P, m = slot.state, slot.past, len(path)
        contiguous = bool(path[0] == 0 and path[-1] == m - 1)  # prefill / plain step: no gather
        with self.arrays.scope():
            if not self.in_place:
                seq.cache.write(P, seq.last, None if contiguous else path, m)
            elif not contiguous:  # the graph wrote the rows at slots P + node: gather the path
                seq.cache.move(P, path)
            states = seq.last["hidden_states"]  # [1, T, H]
            seq.last = {}
            if self.drafter is not None:
                self.drafter.accept(
                    seq.draft, states[:, :m] if contiguous else self.arrays.take(states, path, 1), next_tokens
                )

    def _draft_begin(self, slot):
        with self.arrays.scope():
            return self.drafter.begin(slot.state.draft, slot)

    def _draft_prepare(self, slot):
        if self.drafter is not None:  # (a subclass may draft without one)
            with self.arrays.scope():
                self.drafter.prepare(slot.state.draft, slot)

    def _draft_step(self, slot, depth, nodes, parents, tokens):
        with self.arrays.scope():
            return self.drafter.step(slot.state.draft, depth, nodes, parents, tokens)
