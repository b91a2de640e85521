"""ONNX Runtime backend: runs an exported artifact with numpy + onnxruntime only (no torch, no model code).

KV cache. Each layer's K and V live in one preallocated numpy buffer [1, Hkv, slots, D], bound as the
graph's past inputs through IOBinding; on the CPU an OrtValue over a numpy array shares its memory, so
the graph reads the cache where it lies and nothing is copied per step. `past_lengths` masks the slots
not yet filled. A portable graph returns only the new tokens' K/V; `commit` writes the accepted rows of
those into the next slots in place (m rows per layer, never the whole cache). The heads' augmenting-block
cache works the same way. A fused graph (--attention fused) writes the new rows into the buffer itself
(the buffers are bound as its present outputs too); `commit` then only moves an accepted tree path's rows
to contiguous slots, and nothing for a chain.

Attention also reads the masked slots, so the buffers are not sized to the sequence capacity up front
(a 4,000-token budget would make every early step read 4,000 slots): they start at `cache_block` slots
and double when full, capped at the capacity. Growing copies the valid prefix once per doubling, so
the copies add up to less than one extra write per token, and a step reads at most ~2x the slots it
needs (or `cache_block`). A fused graph runs attention on at least 2 rows (a 1-token step repeats its
row, export/fused_graph.py), so its buffers keep one slot of room beyond a 1-token step.

Outputs are bound to numpy arrays allocated per run (np.empty: no page is touched before ONNX Runtime
writes it), so the logits handed to the loop are never overwritten by a later step.

One LM head. In an artifact with `lm_head.onnx` the base and the draft graphs that share the base's LM head
stop before it and output `lm_input`; `Graph.run` then runs the LM-head session on those rows, so callers
still get `logits`, and the head's weights are in memory once (clover.export.lm_head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from clover.errors import CloverError
from clover.runtime.artifact import ARTIFACT_HEADS, GraphSpec, Manifest, open_artifact, uses_exported_heads
from clover.runtime.artifact import tokenizer_dir as base_dir  # noqa: F401 (the backend interface's name)
from clover.runtime.backend import EngineClock, Runner, RunnerInfo, Slot
from clover.runtime.tree import compile_tree

PAST, PRESENT = "past_key_values", "present"
LM_HEAD, LM_INPUT = "lm_head", "lm_input"  # as clover.export.lm_head (no export import here: no torch)
BATCH_GRAPH, ROW_COUNTS = "base_batch", "row_counts"  # as clover.export.batch_graph
FREE_CACHES = 4  # released slots' caches kept for reuse


def _ort():
    try:
        import onnxruntime
    except ImportError as e:
        raise CloverError("the ort backend needs onnxruntime: pip install onnxruntime (or clover-deploy[onnx])") from e
    return onnxruntime


@dataclass(frozen=True)
class OrtOptions:
    """threads: intra-op threads per session, 0 = onnxruntime's default (one per physical core).
    spin: the base graph's idle intra-op threads busy-wait for its next op. A decode step runs a few
      hundred ops, each waking a sleeping thread otherwise: SmolLM2 int4 fused on 2 cores, 6.4 vs 9.0 ms per
      plain step. The draft graphs then run on the calling thread alone: the base's spinning threads hold
      the other cores (pools spinning in several sessions steal each other's cores: 1.7x slower, measured).
      The LM-head session (lm_head.onnx) spins too; spinning stops when a run returns, so the two alternate
      without stealing each other's cores (SmolLM2 int4: as fast as the base with its own LM head; a second
      session left spinning after its run: 0.6x).
      False: every session's threads sleep between ops, and every session uses `threads`.
    checksums: verify every file's sha256 on load (sizes are always checked).
    cache_block: KV cache slots allocated at the start of a sequence (doubled when full).
    batch: load the artifact's batched base graph (if it has one) to run several sequences per forward; a
      one-sequence Generator does not need it (it holds the weights a second time)."""

    threads: int = 0
    spin: bool = True
    checksums: bool = True
    cache_block: int = 256
    batch: bool = False

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise CloverError(f"threads must be >= 0 (0 = onnxruntime's default), got {self.threads}")
        if self.cache_block < 1:
            raise CloverError(f"cache_block must be >= 1 slot, got {self.cache_block}")


def session_options(opts: OrtOptions, spin: bool = False):
    """Session options; spin: this session's idle intra-op threads busy-wait for its next op (the base
    graph's, see OrtOptions.spin); otherwise they sleep, and with spinning on elsewhere the session runs on
    the calling thread alone."""
    ort = _ort()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL  # one request, one op at a time: no inter-op pool
    so.intra_op_num_threads = opts.threads if spin or not opts.spin else 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3  # errors only: optimizer notes are not actionable for a user
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if spin:  # stop spinning when a run returns: the base and the LM-head sessions run one after the other
        so.add_session_config_entry("session.force_spinning_stop", "1")
    return so


class Graph:
    """One InferenceSession and its IOBinding, driven by the I/O names and dtypes of the manifest."""

    def __init__(self, root: Path, spec: GraphSpec, so, clock: EngineClock) -> None:
        ort = _ort()
        self.spec, self.clock = spec, clock
        try:
            self.session = ort.InferenceSession(str(root / spec.file), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own Fail / InvalidGraph types
            raise CloverError(f"onnxruntime cannot load {root / spec.file}: {str(e).splitlines()[0]}") from e
        self.binding = self.session.io_binding()
        self._ortvalue = ort.OrtValue.ortvalue_from_numpy
        self._keep: dict[str, np.ndarray] = {}  # bound arrays must outlive the run
        self.out_dtypes = {t.name: np.dtype(t.dtype) for t in spec.outputs}
        self.lm_head: Graph | None = None  # runs after this graph when it outputs LM_INPUT (use_lm_head)
        self._lm_width = 0
        self.bound_caches: dict[int | None, list[np.ndarray]] = {}  # KV buffers bound now, per slot input (KVCache.bind)

    def bind(self, name: str, array: np.ndarray, output: str | None = None) -> None:
        """Bind a host array as an input without copying it (it must stay alive and unchanged until run);
        with `output`, also as that output: the graph updates it in place."""
        array = np.ascontiguousarray(array)
        self._keep[name] = array
        value = self._ortvalue(array)
        self.binding.bind_ortvalue_input(name, value)
        if output is not None:
            self.binding.bind_ortvalue_output(output, value)

    def run(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """Run with every output written straight into a new array of the given shape. A graph cut before the
        shared LM head gives `logits` all the same: its LM_INPUT rows go through `lm_head`."""
        lm = self.lm_head is not None and "logits" in shapes
        if lm:
            shapes = dict(shapes)
            *lead, _ = shapes.pop("logits")
            shapes[LM_INPUT] = (*lead, self._lm_width)
        outs = {name: np.empty(shape, self.out_dtypes[name]) for name, shape in shapes.items()}
        for name, array in outs.items():
            self.binding.bind_ortvalue_output(name, self._ortvalue(array))
        with self.clock:
            self.session.run_with_iobinding(self.binding)
        if lm:
            rows = outs.pop(LM_INPUT)
            self.lm_head.bind(LM_INPUT, rows.reshape(-1, rows.shape[-1]))
            logits = self.lm_head.run({"logits": (rows.size // rows.shape[-1], self.lm_head.vocab_size)})["logits"]
            outs["logits"] = logits.reshape(*rows.shape[:-1], -1)
        return outs

    def use_lm_head(self, lm_head: "Graph") -> None:
        """This graph stops before the shared LM head (it outputs LM_INPUT): `run` runs `lm_head` after it."""
        self.lm_head, self._lm_width = lm_head, int(self.spec.output(LM_INPUT).shape[-1])

    @property
    def vocab_size(self) -> int:
        return int(self.spec.output("logits").shape[-1])


def slot_name(name: str, slot: int) -> str:
    """A batched graph's per-sequence I/O name (clover.export.batch_graph.slot_name)."""
    return f"{name}.s{slot}"


def kv_bytes_per_token(spec: GraphSpec) -> int:
    """Bytes of K and V one cached token takes over a graph's past inputs [batch, Hkv, slots, D]."""
    return sum(int(t.shape[1]) * int(t.shape[3]) * np.dtype(t.dtype).itemsize
               for t in spec.inputs if t.name.startswith(PAST + "."))


class KVCache:
    """One sequence's per-layer K and V buffers [1, Hkv, slots, D], bound as a graph's past inputs (and,
    `shared`, as its present outputs) before each call that runs it; slots grow by doubling."""

    def __init__(self, spec: GraphSpec, slots: int, shared: bool = False) -> None:
        self.shared = shared
        self.names = [t.name for t in spec.inputs if t.name.startswith(PAST + ".")]
        first = spec.input(self.names[0]) if self.names else None
        self.kv_heads, self.head_dim = (first.shape[1], first.shape[3]) if first else (0, 0)
        self.dtype = np.dtype(first.dtype) if first else np.dtype(np.float32)
        self.buffers = self._allocate(slots)

    @property
    def slots(self) -> int:
        return self.buffers[0].shape[2] if self.buffers else 0

    def _allocate(self, slots: int) -> list[np.ndarray]:
        # Zeroed (calloc: pages appear on first write): masked slots meet exact-zero attention weights,
        # and 0 * NaN from uninitialised memory would not be zero.
        return [np.zeros((1, self.kv_heads, slots, self.head_dim), self.dtype) for _ in self.names]

    def bind(self, graph: Graph, slot: int | None = None) -> None:
        """Bind the buffers to `graph` (to slot input `slot` of a batched graph) unless they are what it holds
        already (sequences take turns on a graph, and keep their slot input from step to step)."""
        if graph.bound_caches.get(slot) is self.buffers:
            return
        for name, buf in zip(self.names, self.buffers):
            out = PRESENT + name[len(PAST):] if self.shared else None
            if slot is None:
                graph.bind(name, buf, output=out)
            else:
                graph.bind(slot_name(name, slot), buf, output=out and slot_name(out, slot))
        graph.bound_caches[slot] = self.buffers

    def ensure(self, needed: int, filled: int, limit: int) -> None:
        """Make room for `needed` slots (at most `limit`), keeping the first `filled`."""
        if needed <= self.slots:
            return
        old, self.buffers = self.buffers, self._allocate(min(limit, max(needed, 2 * self.slots)))
        for new, buf in zip(self.buffers, old):
            new[:, :, :filled] = buf[:, :, :filled]

    def present_shapes(self, rows: int) -> dict[str, tuple[int, ...]]:
        return {PRESENT + n[len(PAST):]: (1, self.kv_heads, rows, self.head_dim) for n in self.names}

    def move(self, start: int, rows: np.ndarray) -> None:
        """Shared buffers: move slots start + rows to start, start + 1, ... (an accepted tree path)."""
        for buf in self.buffers:
            buf[0, :, start:start + len(rows)] = buf[0][:, start + rows]  # fancy indexing reads (copies) first

    def write(self, start: int, outputs: dict[str, np.ndarray], rows: np.ndarray | None, count: int) -> None:
        """Copy `count` new rows (the rows `rows` of `present`, or its first `count`) to slots start.."""
        for name, buf in zip(self.names, self.buffers):
            new = outputs[PRESENT + name[len(PAST):]][0]  # [Hkv, T, D]
            buf[0, :, start:start + count] = new[:, :count] if rows is None else new[:, rows]


@dataclass(eq=False)
class OrtSequence:
    """A slot's state in an OrtRunner: its caches, the last forward's outputs and its draft states."""

    cache: KVCache
    head_cache: KVCache | None
    states: np.ndarray  # [n, H] draft state of tree node i (grown as drafted)
    last: dict[str, np.ndarray] = field(default_factory=dict)  # outputs of the last forward
    behind: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # accepted rows the heads have not seen
    root_state: np.ndarray | None = None  # [1, H] the heads' state after the last accepted token
    root_logits: np.ndarray | None = None  # [V]
    medusa_hidden: np.ndarray | None = None  # [1, 1, H] Medusa: the last accepted token's hidden state
    medusa_logits: np.ndarray | None = None  # [K, V]


class OrtRunner(Runner):
    """A Runner over an artifact's ONNX graphs; use `load_runner` to build one from a folder."""

    def __init__(self, root: str | Path, manifest: Manifest, use_heads: bool = True, options: OrtOptions = OrtOptions()):
        super().__init__()
        root = Path(root)
        so, draft_so = session_options(options, spin=options.spin), session_options(options)
        self.manifest, self.options = manifest, options
        self.engine_clock = clock = EngineClock()
        self.base = Graph(root, manifest.graphs["base"], so, clock)
        self.fused = manifest.attention == "fused"  # in-place KV cache, attention on >= 2 rows (module doc)
        self.hidden_size = int(self.base.spec.output("hidden_states").shape[-1])
        heads = manifest.heads if use_heads else None
        self.arch = heads.arch if heads is not None else None
        self.begin = self.step = self.medusa = None
        if self.arch == "medusa":
            self.medusa = Graph(root, manifest.graphs["medusa_heads"], draft_so, clock)
        elif self.arch is not None:
            self.begin = Graph(root, manifest.graphs["draft_begin"], draft_so, clock)
            self.step = Graph(root, manifest.graphs["draft_step"], draft_so, clock)
        # The batched base (fused artifacts, export/batch_graph.py): several sequences' rows in one forward.
        self.batch = Graph(root, manifest.graphs[BATCH_GRAPH], so, clock) if options.batch and BATCH_GRAPH in manifest.graphs else None
        self.batch_slots = int(self.batch.spec.input(ROW_COUNTS).shape[0]) if self.batch is not None else 1
        self._idle: dict[int, KVCache] = {}  # 2-slot buffers of the batched graph's slot inputs not in a step
        self.lm_head = None
        if LM_HEAD in manifest.graphs:  # on the base's thread settings: it computes every verified row's logits
            self.lm_head = Graph(root, manifest.graphs[LM_HEAD], so, clock)
            for g in (self.base, self.batch, self.begin, self.step, self.medusa):
                if g is not None and g.spec.has_output(LM_INPUT):
                    g.use_lm_head(self.lm_head)
        self.vocab_size = (self.base.lm_head or self.base).vocab_size
        tree = manifest.tree if heads is not None else None
        self.info = RunnerInfo(
            backend="ort", vocab_size=self.vocab_size, max_context=manifest.max_context, heads=self.arch,
            heads_max_depth=heads.max_depth if heads is not None else None,
            heads_name=heads.name if heads is not None else "none",
            default_tree=compile_tree(tree["choices"], tree["name"]) if tree else None,
            chains_only=self.fused and manifest.weights is not None and manifest.weights.accuracy_level != 0,
            kv_bytes_per_token=sum(kv_bytes_per_token(g.spec) for g in (self.base, self.begin) if g is not None),
            batch_slots=self.batch_slots,
        )
        self._free: list[tuple[KVCache, KVCache | None]] = []  # released slots' caches of the initial size

    def close(self) -> None:
        self.base = self.batch = self.begin = self.step = self.medusa = self.lm_head = None
        self._free = []

    @property
    def cache(self) -> KVCache:
        return self._solo.state.cache if self._solo else None  # the solo sequence's (tests, tools)

    @property
    def head_cache(self) -> KVCache | None:
        return self._solo.state.head_cache if self._solo else None

    def _open_slot(self, slot: Slot) -> OrtSequence:
        slots = min(slot.capacity, self.options.cache_block)
        # A released slot's buffers of this size are reused: they keep its K/V, finite values masked by past_lengths.
        reuse = next((i for i, (c, _) in enumerate(self._free) if c.slots == slots), None)
        cache, head_cache = self._free.pop(reuse) if reuse is not None else (
            KVCache(self.base.spec, slots, shared=self.fused), KVCache(self.begin.spec, slots) if self.begin is not None else None)
        return OrtSequence(cache, head_cache, np.zeros((0, self.hidden_size), self.base.out_dtypes["hidden_states"]))

    def _release(self, slot: Slot) -> None:
        seq = slot.state
        if seq.cache.slots == min(slot.capacity, self.options.cache_block) and len(self._free) < FREE_CACHES:
            self._free.append((seq.cache, seq.head_cache))

    def _forward(self, slot, tokens, depths, mask, last_only):
        seq, P, T = slot.state, slot.past, tokens.shape[0]
        rows = np.array([T - 1] if last_only else range(T), dtype=np.int64)
        seq.cache.ensure(P + max(T, 2 if self.fused else 1), P, slot.capacity + self.fused)  # fused: 2 rows or more
        g = self.base
        seq.cache.bind(g)
        g.bind("input_ids", tokens.astype(np.int64, copy=False)[None])
        g.bind("position_ids", (P + depths.astype(np.int64))[None])
        g.bind("tree_mask", mask.astype(bool, copy=False)[None])
        g.bind("past_lengths", np.array([P], dtype=np.int64))
        g.bind("logit_rows", rows)
        present = {} if self.fused else seq.cache.present_shapes(T)
        seq.last = g.run({"logits": (1, len(rows), self.vocab_size), "hidden_states": (1, T, self.hidden_size),
                          **present})
        return seq.last["logits"][0].astype(np.float32, copy=False)

    def _forward_batch(self, batch):
        """Sequences in the batched graph's slots run in one call; the rest (or a lone one) on the base graph."""
        packed = sorted((v for v in batch if v.slot.index < self.batch_slots), key=lambda v: v.slot.index)
        if self.batch is None or len(packed) < 2:
            return super()._forward_batch(batch)
        out = dict(zip((id(v) for v in packed), self._forward_packed(packed)))
        return [out[id(v)] if id(v) in out else self._forward(v.slot, v.tokens, v.depths, v.mask, v.last_only) for v in batch]

    def _forward_packed(self, packed):
        g, N = self.batch, self.batch_slots
        counts, pasts = np.zeros(N, np.int64), np.zeros(N, np.int64)
        by_slot = {v.slot.index: v for v in packed}
        for b in range(N):
            v = by_slot.get(b)
            if v is None:  # not in this step: its nodes run on 2 dummy rows over an idle 2-slot buffer
                idle = self._idle.get(b) or self._idle.setdefault(b, KVCache(self.base.spec, 2, shared=True))
                idle.bind(g, b)
                continue
            seq, P, T = v.slot.state, v.slot.past, v.tokens.shape[0]
            seq.cache.ensure(P + max(T, 2), P, v.slot.capacity + 1)  # 2 rows or more (fused)
            seq.cache.bind(g, b)
            counts[b], pasts[b] = T, P
        ends = np.cumsum([len(v.tokens) for v in packed])
        R = int(ends[-1])
        mask = np.zeros((1, R, R), dtype=bool)  # [1, R, R] block diagonal: each sequence's own tree
        for v, end in zip(packed, ends):
            T = len(v.tokens)
            mask[0, end - T:end, end - T:end] = v.mask
        # logit rows: a prompt's last row, every row of a tree
        rows = np.concatenate([[end - 1] if v.last_only else np.arange(end - len(v.tokens), end) for v, end in zip(packed, ends)])
        g.bind("input_ids", np.concatenate([v.tokens for v in packed]).astype(np.int64)[None])
        g.bind("position_ids", np.concatenate([v.slot.past + v.depths.astype(np.int64) for v in packed])[None])
        g.bind("tree_mask", mask)
        g.bind("past_lengths", pasts)
        g.bind(ROW_COUNTS, counts)
        g.bind("logit_rows", np.asarray(rows, dtype=np.int64))
        out = g.run({"logits": (1, len(rows), self.vocab_size), "hidden_states": (1, R, self.hidden_size)})
        logits = out["logits"][0].astype(np.float32, copy=False)  # [rows, V]
        results, at = [], 0
        for v, end in zip(packed, ends):
            T, n = len(v.tokens), 1 if v.last_only else len(v.tokens)
            v.slot.state.last = {"hidden_states": out["hidden_states"][:, end - T:end]}  # [1, T, H]
            results.append(logits[at:at + n])
            at += n
        return results

    def _commit(self, slot, path, next_tokens):
        seq, P, m = slot.state, slot.past, len(path)
        contiguous = bool(path[0] == 0 and path[-1] == m - 1)  # prefill / plain step: no gather
        if not self.fused:
            seq.cache.write(P, seq.last, None if contiguous else path, m)
        elif not contiguous:  # the graph wrote the rows at slots P + node: gather the path
            seq.cache.move(P, path)
        hidden = seq.last["hidden_states"][:, :m] if contiguous else seq.last["hidden_states"][:, path]  # [1, m, H]
        seq.last = {}
        if self.medusa is not None:
            seq.medusa_hidden = hidden[:, -1:]  # its heads only read the last accepted token's state
        elif self.begin is not None:
            # The heads' augmenting block must see every accepted token, but only a drafting step needs its
            # output: the rows wait here and draft_begin runs them all at once (none after plain steps).
            seq.behind.append((hidden, next_tokens))

    def _catch_up_heads(self, slot: Slot) -> None:
        """Run the heads' begin graph over the accepted rows it has not seen (one call for several steps)."""
        seq = slot.state
        m = sum(len(t) for _, t in seq.behind)
        P = slot.past - m  # where the first waiting row sits in the sequence
        hidden = seq.behind[0][0] if len(seq.behind) == 1 else np.concatenate([h for h, _ in seq.behind], axis=1)
        tokens = np.concatenate([t for _, t in seq.behind])
        seq.behind.clear()
        seq.head_cache.ensure(P + m, P, slot.capacity)
        g = self.begin
        seq.head_cache.bind(g)
        g.bind("hidden_states", hidden)  # [1, m, H]
        g.bind("next_tokens", tokens[None])
        g.bind("position_ids", np.arange(P, P + m, dtype=np.int64)[None])
        g.bind("past_lengths", np.array([P], dtype=np.int64))
        out = g.run({"state": (1, self.hidden_size), "logits": (1, self.vocab_size),
                     **seq.head_cache.present_shapes(m)})
        seq.head_cache.write(P, out, None, m)
        seq.root_state, seq.root_logits = out["state"], out["logits"][0]

    def _draft_begin(self, slot):
        seq = slot.state
        if self.medusa is not None:
            self.medusa.bind("hidden_states", seq.medusa_hidden)
            heads = self.manifest.heads.num_heads
            seq.medusa_logits = self.medusa.run({"logits": (1, heads, self.vocab_size)})["logits"][0]  # [K, V]
            return seq.medusa_logits[0].astype(np.float32)
        if seq.behind:
            self._catch_up_heads(slot)
        seq.states = seq.root_state.copy()  # row i = state of tree node i (grown as drafted)
        return seq.root_logits.astype(np.float32)

    def _draft_step(self, slot, depth, nodes, parents, tokens):
        seq = slot.state
        if self.medusa is not None:  # every node at a depth gets the same draft
            return np.repeat(seq.medusa_logits[depth][None].astype(np.float32), len(nodes), axis=0)
        need = int(nodes.max()) + 1
        if seq.states.shape[0] < need:
            grown = np.zeros((need, self.hidden_size), seq.states.dtype)
            grown[: seq.states.shape[0]] = seq.states
            seq.states = grown
        g = self.step
        if g.spec.has_input("depth"):
            g.bind("depth", np.array(depth, dtype=np.int64))
        g.bind("parent_state", seq.states[parents])
        g.bind("tokens", tokens.astype(np.int64, copy=False))
        out = g.run({"state": (len(nodes), self.hidden_size), "logits": (len(nodes), self.vocab_size)})
        seq.states[nodes] = out["state"]
        return out["logits"].astype(np.float32, copy=False)


def load_runner(artifact: str | Path, heads: str = ARTIFACT_HEADS, dtype: str | None = None,
                threads: int = 0, spin: bool = True, checksums: bool = True, cache_block: int = 256,
                batch: bool = False) -> OrtRunner:
    """Open and validate an artifact folder and build its runner.

    Args:
        artifact: folder written by clover-export.
        heads: "artifact" (default) or the name the heads were exported from: the artifact's heads;
            "none": plain decoding on the artifact's base graph.
        dtype: None, or the precision the caller expects (must be the artifact's).
        threads, spin, checksums, cache_block, batch: see OrtOptions (clover.Engine loads with batch=True).
    """
    options = OrtOptions(threads=threads, spin=spin, checksums=checksums, cache_block=cache_block, batch=batch)
    manifest = open_artifact(artifact, checksums=options.checksums)
    if manifest.attention == "plugin":
        raise CloverError(
            f"artifact {artifact} was exported with --attention {manifest.attention}: its tree-attention nodes are "
            "TensorRT plugins that ONNX Runtime cannot run; use --backend trt, or export with --attention portable")
    if dtype is not None and dtype != manifest.dtype:
        raise CloverError(f"artifact {artifact} holds {manifest.dtype} graphs, not {dtype}: omit --dtype, or export "
                          f"again with clover-export --dtype {dtype}")
    use_heads = uses_exported_heads(artifact, manifest, heads)
    return OrtRunner(artifact, manifest, use_heads=use_heads, options=options)
