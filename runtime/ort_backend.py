"""ONNX Runtime backend: runs an exported artifact with numpy + onnxruntime only (no torch, no model code).

The runner is graph_runner.GraphRunner (KV caches, commit, drafting) over numpy arrays; this module runs the
graphs. Every input and output goes through IOBinding: an OrtValue over a numpy array shares its memory,
so the graph reads the KV cache where it lies and nothing is copied per step, and arrays bound on the
previous call (the caches) are not bound again. A fused graph (--attention fused) writes its new K/V rows
into the cache buffers, bound as its present outputs too.

One LM head. In an artifact with `lm_head.onnx` the base and the draft graphs that share the base's LM head
stop before it and output `lm_input`; `Graph.run` then runs the LM-head session on those rows, so callers
still get `logits`, and the head's weights are in memory once (clover.export.lm_head).

Batching. With `OrtOptions(batch=True)` the artifact's batched base graph (export/batch_graph.py) runs the
new rows of up to `batch_slots` sequences in one call: packed into one row dimension, a block-diagonal
tree mask, and each sequence slot's own KV buffers bound to its own per-slot inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clover.errors import CloverError
from clover.artifact import (
    ARTIFACT_HEADS, BATCH_GRAPH, ROW_COUNTS, GraphSpec, Manifest, open_artifact, uses_exported_heads,
)
from clover.artifact import tokenizer_dir as base_dir  # noqa: F401 (the backend interface's name)
from clover.runtime.backend import EngineClock
from clover.runtime.graph_runner import GraphRunner, KVCache, NumpyArrays, graphs_used

LM_HEAD, LM_INPUT = "lm_head", "lm_input"  # as clover.export.lm_head (no export import here: no torch)


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
    """One InferenceSession and its IOBinding, driven by the I/O names, dims and dtypes of the manifest
    (graph_runner.EngineGraph)."""

    def __init__(self, root: Path, spec: GraphSpec, so, clock: EngineClock) -> None:
        ort = _ort()
        self.spec, self.clock = spec, clock
        try:
            self.session = ort.InferenceSession(str(root / spec.file), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own Fail / InvalidGraph types
            raise CloverError(f"onnxruntime cannot load {root / spec.file}: {str(e).splitlines()[0]}") from e
        self.binding = self.session.io_binding()
        self._ortvalue = ort.OrtValue.ortvalue_from_numpy
        # Arrays bound now (they must outlive the run): an input or in-place output bound to the same array as
        # last call is not bound again (a KV cache stays bound from step to step: 2 x layers arrays).
        self._inputs: dict[str, np.ndarray] = {}
        self._into: dict[str, np.ndarray] = {}
        self._outputs = [(t.name, t.shape, np.dtype(t.dtype)) for t in spec.outputs]
        self.lm_head: Graph | None = None  # runs after this graph when it outputs LM_INPUT (use_lm_head)

    def has_input(self, name: str) -> bool:
        return self.spec.has_input(name)

    def _bind(self, bound: dict[str, np.ndarray], name: str, array: np.ndarray, output: bool) -> None:
        if bound.get(name) is array:
            return
        array = np.ascontiguousarray(array)  # shares memory: no copy for the arrays it is given
        bound[name] = array
        (self.binding.bind_ortvalue_output if output else self.binding.bind_ortvalue_input)(name, self._ortvalue(array))

    def run(self, inputs: Mapping[str, np.ndarray], sizes: Mapping[str, int],
            into: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Run with the outputs in `into` written there in place and every other output straight into a new
        array shaped by `sizes` (np.empty: no page is touched before ONNX Runtime writes it, and a later run
        never overwrites what this one returned). A graph cut before the shared LM head gives `logits` all
        the same: its LM_INPUT rows go through `lm_head`."""
        for name, array in inputs.items():
            self._bind(self._inputs, name, array, output=False)
        for name, array in (into or {}).items():
            self._bind(self._into, name, array, output=True)
        outs = {name: np.empty(tuple(sizes[d] if isinstance(d, str) else d for d in dims), dtype)
                for name, dims, dtype in self._outputs if not into or name not in into}
        for name, array in outs.items():
            self.binding.bind_ortvalue_output(name, self._ortvalue(array))
        with self.clock:
            self.session.run_with_iobinding(self.binding)
        if self.lm_head is not None:
            rows = outs.pop(LM_INPUT)
            flat = rows.reshape(-1, rows.shape[-1])
            logits = self.lm_head.run({LM_INPUT: flat}, {self.lm_head.spec.input(LM_INPUT).shape[0]: flat.shape[0]})["logits"]
            outs["logits"] = logits.reshape(*rows.shape[:-1], -1)
        return outs

    def use_lm_head(self, lm_head: "Graph") -> None:
        """This graph stops before the shared LM head (it outputs LM_INPUT): `run` runs `lm_head` after it."""
        self.lm_head = lm_head


class OrtRunner(GraphRunner):
    """A Runner over an artifact's ONNX graphs; use `load_runner` to build one from a folder."""

    def __init__(self, root: str | Path, manifest: Manifest, use_heads: bool = True, options: OrtOptions = OrtOptions()):
        root = Path(root)
        so, draft_so = session_options(options, spin=options.spin), session_options(options)
        self.options = options
        self.engine_clock = clock = EngineClock()
        graphs = {n: Graph(root, manifest.graphs[n], so if n == "base" else draft_so, clock) for n in graphs_used(manifest, use_heads)}
        # The batched base (fused artifacts, export/batch_graph.py): several sequences' rows in one forward.
        self.batch = Graph(root, manifest.graphs[BATCH_GRAPH], so, clock) if options.batch and BATCH_GRAPH in manifest.graphs else None
        self.lm_head = None
        if LM_HEAD in manifest.graphs:  # on the base's thread settings: it computes every verified row's logits
            self.lm_head = Graph(root, manifest.graphs[LM_HEAD], so, clock)
            for g in (*graphs.values(), self.batch):
                if g is not None and g.spec.has_output(LM_INPUT):
                    g.use_lm_head(self.lm_head)
        fused = manifest.attention == "fused"  # in-place KV cache (module doc)
        self.batch_slots = int(self.batch.spec.input(ROW_COUNTS).shape[0]) if self.batch is not None else 1
        super().__init__(manifest, graphs, NumpyArrays(), use_heads=use_heads, backend="ort", cache_block=options.cache_block,
                         in_place=fused, chains_only=fused and manifest.weights is not None and manifest.weights.accuracy_level != 0,
                         batch_slots=self.batch_slots)
        self._idle: dict[int, KVCache] = {}  # 2-slot buffers of the batched graph's slot inputs not in a step

    def close(self) -> None:
        self.base = self.batch = self.drafter = self.lm_head = None
        self._free = []

    def _forward_batch(self, batch):
        """Sequences in the batched graph's slots run in one call; the rest (or a lone one) on the base graph."""
        packed = sorted((v for v in batch if v.slot.index < self.batch_slots), key=lambda v: v.slot.index)
        if self.batch is None or len(packed) < 2:
            return super()._forward_batch(batch)
        out = dict(zip((id(v) for v in packed), self._forward_packed(packed)))
        return [out[id(v)] if id(v) in out else self._forward(v.slot, v.tokens, v.depths, v.mask, v.last_only) for v in batch]

    def _forward_packed(self, packed):
        N = self.batch_slots
        counts, pasts = np.zeros(N, np.int64), np.zeros(N, np.int64)
        by_slot = {v.slot.index: v for v in packed}
        caches, into = {}, {}
        for b in range(N):
            v = by_slot.get(b)
            if v is None:  # not in this step: its nodes run on 2 dummy rows over an idle 2-slot buffer
                cache = self._idle.get(b) or self._idle.setdefault(b, KVCache(self.base_spec, 2, self.arrays, shared=True))
            else:
                self._make_room(v.slot, len(v.tokens))
                cache, counts[b], pasts[b] = v.slot.state.cache, len(v.tokens), v.slot.past
            past, present, _ = cache.bound(pasts[b], slot=b)
            caches.update(past)
            into.update(present)
        ends = np.cumsum([len(v.tokens) for v in packed])
        R = int(ends[-1])
        mask = np.zeros((1, R, R), dtype=bool)  # [1, R, R] block diagonal: each sequence's own tree
        for v, end in zip(packed, ends):
            T = len(v.tokens)
            mask[0, end - T:end, end - T:end] = v.mask
        # logit rows: a prompt's last row, every row of a tree
        rows = np.concatenate([[end - 1] if v.last_only else np.arange(end - len(v.tokens), end) for v, end in zip(packed, ends)])
        out = self.batch.run({
            "input_ids": np.concatenate([v.tokens for v in packed]).astype(np.int64)[None],  # [1, R]
            "position_ids": np.concatenate([v.slot.past + v.depths.astype(np.int64) for v in packed])[None],  # [1, R]
            "tree_mask": mask,
            "past_lengths": pasts,  # [N]
            ROW_COUNTS: counts,  # [N]
            "logit_rows": np.asarray(rows, dtype=np.int64),
            **caches,
        }, {"new": R, "rows": len(rows)}, into)
        logits = out["logits"][0].astype(np.float32, copy=False)  # [rows, V]
        results, at = [], 0
        for v, end in zip(packed, ends):
            T, n = len(v.tokens), 1 if v.last_only else len(v.tokens)
            v.slot.state.last = {"hidden_states": out["hidden_states"][:, end - T:end]}  # [1, T, H]
            results.append(logits[at:at + n])
            at += n
        return results


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
