"""TensorRT backend: runs the engines of an artifact exported with clover-export --backend trt, on one
CUDA GPU, with the same commit / draft semantics as the ONNX Runtime backend (ort_backend.py), so greedy
speculative output is token-identical to plain greedy decoding on this backend.

Device buffers are torch CUDA tensors, not polygraphy.cuda or cuda-python allocations: torch is already
part of every GPU install here (the plugin's Triton kernel runs on it), its caching allocator makes the
per-step output allocations free, its streams order our copies after TensorRT's writes, `index_select`
compacts the KV cache on the device, and `.cpu().numpy()` hands logits to the loop without another copy.

KV cache. Per layer one [1, Hkv, slots, D] buffer on the GPU, bound whole as the graph's past input (a
prefix view along the slot axis would not be contiguous); the graph masks slots >= past_lengths, and
0 slots are bound while the cache is empty, so the prefill reads no masked slots. As in ort_backend the
buffers start at `cache_block` slots and double when full (capped at the capacity): attention reads at
most ~2x the slots it needs. The engines return only the new tokens' K/V; `commit` copies the accepted
rows into the next slots on the device. Only logits ever travel to the host.

Execution. One execution context per optimization profile of an engine, each bound to its profile once
at load: the base engine's "prefill" and "verify" contexts, picked per call by the shapes (the tightest
profile that accepts them: verify for trees and single tokens, prefill for long prompts). Every
TensorRT enqueue and every torch op of a runner runs on the runner's own CUDA stream (TensorRT warns
that enqueueing on the legacy default stream costs extra synchronizations); the host waits only when
it copies logits back.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from clover.errors import CloverError
from clover.runtime import tensorrt as rt
from clover.runtime.artifact import (
    ARTIFACT_HEADS, EngineSpec, GraphSpec, Manifest, ProfileSpec, open_artifact, uses_exported_heads,
)
from clover.runtime.artifact import tokenizer_dir as base_dir  # noqa: F401 (the backend interface's name)
from clover.runtime.backend import Runner, RunnerInfo, Slot
from clover.runtime.tree import compile_tree

PAST, PRESENT = "past_key_values", "present"


# -- pure parts: binding tables and profile choice ----------------------------------------------------------

@dataclass(frozen=True)
class Binding:
    """One engine I/O tensor as the manifest describes it: dims are ints (static) or dim names."""

    name: str
    dtype: str  # numpy name
    dims: tuple[int | str, ...]

    @property
    def dynamic(self) -> bool:
        return any(isinstance(d, str) for d in self.dims)

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(sizes[d] if isinstance(d, str) else int(d) for d in self.dims)

    def nbytes(self, sizes: Mapping[str, int]) -> int:
        return math.prod(self.shape(sizes)) * rt.ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class BindingTable:
    """The I/O of one engine: shapes and sizes of every tensor for given dim sizes, and the profile
    (execution context) that runs them."""

    graph: str
    inputs: tuple[Binding, ...]
    outputs: tuple[Binding, ...]
    profiles: tuple[ProfileSpec, ...]

    @classmethod
    def of(cls, name: str, graph: GraphSpec, profiles: Sequence[ProfileSpec]) -> "BindingTable":
        io = lambda ts: tuple(Binding(t.name, t.dtype, tuple(t.shape)) for t in ts)  # noqa: E731
        return cls(name, io(graph.inputs), io(graph.outputs), tuple(profiles))

    def input_shapes(self, sizes: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        """Shapes of the inputs with dynamic dims: what set_input_shape needs."""
        return {b.name: b.shape(sizes) for b in self.inputs if b.dynamic}

    def output_shapes(self, sizes: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        return {b.name: b.shape(sizes) for b in self.outputs}

    def nbytes(self, sizes: Mapping[str, int]) -> dict[str, int]:
        """Bytes of every I/O tensor: the device buffers one call needs."""
        return {b.name: b.nbytes(sizes) for b in (*self.inputs, *self.outputs)}

    def profile(self, sizes: Mapping[str, int]) -> int:
        """Index of the tightest profile (smallest max shapes) whose [min, max] holds every input."""
        shapes = self.input_shapes(sizes)
        fits = [i for i, p in enumerate(self.profiles) if profile_accepts(p, shapes)]
        if not fits:
            raise CloverError(no_profile_message(self, sizes))
        return min(fits, key=lambda i: (profile_volume(self.profiles[i]), i))


def profile_accepts(profile: ProfileSpec, shapes: Mapping[str, tuple[int, ...]]) -> bool:
    for name, shape in shapes.items():
        lo, _, hi = profile.shapes[name]
        if len(shape) != len(lo) or any(not a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False
    return True


def profile_volume(profile: ProfileSpec) -> int:
    return sum(math.prod(hi) for _, _, hi in profile.shapes.values())


def dim_bounds(profile: ProfileSpec, graph_inputs: Sequence[Binding]) -> dict[str, tuple[int, int]]:
    """Dim name -> (min, max) in a profile, read off the inputs' shapes."""
    out: dict[str, tuple[int, int]] = {}
    for b in graph_inputs:
        if b.name in profile.shapes:
            lo, _, hi = profile.shapes[b.name]
            for d, a, z in zip(b.dims, lo, hi):
                if isinstance(d, str):
                    out[d] = (a, z)
    return out


def no_profile_message(table: BindingTable, sizes: Mapping[str, int]) -> str:
    built = "; ".join(p.name + " " + ", ".join(f"{d} {a}..{z}" for d, (a, z) in dim_bounds(p, table.inputs).items())
                      for p in table.profiles)
    asked = ", ".join(f"{k} {v}" for k, v in sizes.items())
    return (f"TensorRT engine {table.graph} has no optimization profile for {asked} (it was built for {built}): use a "
            "shorter prompt or a smaller tree, or rebuild the engines with clover-export --backend trt and larger limits")


def max_slots(table: BindingTable) -> int:
    """Most cache slots every profile of an engine accepts (the `past` dim), or a large number without one."""
    bounds = [dim_bounds(p, table.inputs).get("past") for p in table.profiles]
    return min((b[1] for b in bounds if b is not None), default=1 << 62)


def graphs_used(manifest: Manifest, use_heads: bool) -> tuple[str, ...]:
    """The engines a runner loads: the base, and the heads' draft graphs if it drafts with them."""
    heads = manifest.heads if use_heads else None
    if heads is None:
        return ("base",)
    return ("base", "medusa_heads") if heads.arch == "medusa" else ("base", "draft_begin", "draft_step")


# -- the GPU side --------------------------------------------------------------------------------------------

def _torch():
    try:
        import torch
    except ImportError as e:
        raise CloverError("the trt backend needs torch with CUDA (pip install torch from the CUDA index)") from e
    return torch


def torch_dtype(name: str):
    torch = _torch()
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64,
            "int32": torch.int32, "bool": torch.bool}[name]


class EngineGraph:
    """One engine of the artifact with one execution context per optimization profile."""

    def __init__(self, root: Path, name: str, graph: GraphSpec, spec: EngineSpec, device, stream) -> None:
        self.table = BindingTable.of(name, graph, spec.profiles)
        self.device, self.stream = device, stream
        self.engine = rt.deserialize_engine(root / spec.file)
        check_engine_io(self.table, rt.engine_io(self.engine), spec.file)
        self.contexts = [rt.create_context(self.engine, i, stream.cuda_stream) for i in range(len(spec.profiles))]
        self.out_dtypes = {b.name: torch_dtype(b.dtype) for b in self.table.outputs}

    def has_input(self, name: str) -> bool:
        return any(b.name == name for b in self.table.inputs)

    def close(self) -> None:
        self.contexts = []  # contexts before their engine
        self.engine = None

    def run(self, inputs: Mapping[str, Any], sizes: Mapping[str, int]) -> dict[str, Any]:
        """Enqueue one call on the runner's stream; outputs are new device tensors (from torch's caching
        allocator, on that stream, so they are reused only after this call has read and written them)."""
        torch = _torch()
        profile = self.table.profile(sizes)
        outputs = {n: torch.empty(s, dtype=self.out_dtypes[n], device=self.device)
                   for n, s in self.table.output_shapes(sizes).items()}
        for b in self.table.inputs:
            assert tuple(inputs[b.name].shape) == b.shape(sizes), (self.table.graph, b.name, inputs[b.name].shape, sizes)
        addresses = {n: t.data_ptr() for n, t in (*inputs.items(), *outputs.items())}
        rt.run_context(self.contexts[profile], self.table.input_shapes(sizes), addresses, self.stream.cuda_stream)
        return outputs


def check_engine_io(table: BindingTable, io: Mapping[str, tuple[bool, str]], file: str) -> None:
    """The engine has exactly the graph's inputs and outputs, with the manifest's dtypes."""
    want = {b.name: (True, b.dtype) for b in table.inputs} | {b.name: (False, b.dtype) for b in table.outputs}
    if dict(io) != want:
        diff = sorted(set(io.items()) ^ set(want.items()))
        raise CloverError(f"engine {file} does not match graph {table.graph} of the manifest (differs in "
                          f"{', '.join(n for n, _ in diff[:4])}): export the artifact again")


class DeviceKVCache:
    """Per-layer K and V buffers [1, Hkv, slots, D] on the GPU, bound as a graph's past inputs."""

    def __init__(self, graph: GraphSpec, slots: int, device) -> None:
        self.names = [t.name for t in graph.inputs if t.name.startswith(PAST + ".")]
        first = graph.input(self.names[0]) if self.names else None
        self.kv_heads, self.head_dim = (int(first.shape[1]), int(first.shape[3])) if first else (0, 0)
        self.dtype = torch_dtype(first.dtype) if first else None
        self.device = device
        self.buffers = self._allocate(slots)

    @property
    def slots(self) -> int:
        return self.buffers[0].shape[2] if self.buffers else 0

    def _allocate(self, slots: int) -> list:
        # Zeroed: masked slots meet exact-zero attention weights, and 0 * NaN from stale memory is not zero.
        torch = _torch()
        return [torch.zeros((1, self.kv_heads, slots, self.head_dim), dtype=self.dtype, device=self.device)
                for _ in self.names]

    def ensure(self, needed: int, filled: int, limit: int) -> None:
        """Make room for `needed` slots (at most `limit`), keeping the first `filled` (copied on the device)."""
        if needed <= self.slots:
            return
        old, self.buffers = self.buffers, self._allocate(min(limit, max(needed, 2 * self.slots)))
        for new, buf in zip(self.buffers, old):
            new[:, :, :filled].copy_(buf[:, :, :filled])

    def bound(self, past: int) -> tuple[dict[str, Any], int]:
        """The past inputs and their slot count: no slots while nothing is cached, else whole buffers."""
        views = self.buffers if past else [b[:, :, :0] for b in self.buffers]  # [1, Hkv, S, D]
        return dict(zip(self.names, views)), (self.slots if past else 0)

    def write(self, start: int, outputs: Mapping[str, Any], rows, count: int) -> None:
        """Copy `count` new rows (rows `rows` of `present`, or its first `count`) to slots start.. on the device."""
        for name, buf in zip(self.names, self.buffers):
            new = outputs[PRESENT + name[len(PAST):]]  # [1, Hkv, T, D]
            buf[:, :, start:start + count].copy_(new[:, :, :count] if rows is None else new.index_select(2, rows))


@dataclass(eq=False)
class TrtSequence:
    """A slot's state in a TrtRunner: its device caches, the last forward's outputs and the draft states."""

    cache: DeviceKVCache
    head_cache: DeviceKVCache | None
    states: Any  # [n, H] device tensor: draft state of tree node i (grown as drafted)
    last: dict[str, Any] = field(default_factory=dict)
    root_state: Any = None  # [1, H]
    root_logits: Any = None  # [V]
    medusa_hidden: Any = None  # [1, 1, H]
    medusa_logits: np.ndarray | None = None  # [K, V] on the host


class TrtRunner(Runner):
    """A Runner over an artifact's TensorRT engines; use `load_runner` to build one from a folder."""

    def __init__(self, root: str | Path, manifest: Manifest, use_heads: bool = True, device: int = 0,
                 cache_block: int = 256) -> None:
        super().__init__()
        torch = _torch()
        trt = rt.require_tensorrt()
        if cache_block < 1:
            raise CloverError(f"cache_block must be >= 1 slot, got {cache_block}")
        root = Path(root)
        here = rt.device_info(device)
        names = graphs_used(manifest, use_heads)
        for name in names:
            if name not in manifest.engines:
                raise CloverError(f"artifact {root} has no TensorRT engine for graph {name}: export it again with "
                                  "clover-export --backend trt")
            rt.check_engine_compatible(manifest.engines[name], trt.__version__, here.name, here.compute_capability)
        if manifest.attention == "plugin":
            from clover.plugins.trt_plugin import register

            register()  # AOT engines embed the kernel; engines with a JIT (Python) plugin need it registered
        cuda = torch.device("cuda", device)
        with torch.cuda.device(cuda):
            stream = torch.cuda.Stream(cuda)
            engines = {n: EngineGraph(root, n, manifest.graphs[n], manifest.engines[n], cuda, stream) for n in names}
        self._setup(manifest, use_heads, engines, cuda, stream, cache_block)

    def _setup(self, manifest: Manifest, use_heads: bool, engines: Mapping[str, Any], device, stream,
               cache_block: int) -> None:
        """Everything but loading: `engines` maps graph names to objects with EngineGraph's run / table /
        has_input / out_dtypes. stream None runs torch ops on the current stream (CPU tests of the
        bookkeeping drive this class with ONNX Runtime in place of the engines)."""
        self.manifest, self.cache_block, self.device, self.stream = manifest, cache_block, device, stream
        self.base = engines["base"]
        self.medusa, self.begin, self.step = (engines.get(n) for n in ("medusa_heads", "draft_begin", "draft_step"))
        self.vocab_size = int(manifest.graphs["base"].output("logits").shape[-1])
        self.hidden_size = int(manifest.graphs["base"].output("hidden_states").shape[-1])
        heads = manifest.heads if use_heads else None
        self.arch = heads.arch if heads is not None else None
        tree = manifest.tree if heads is not None else None
        slot_limit = min(max_slots(g.table) for g in (self.base, self.begin) if g is not None)
        self.info = RunnerInfo(
            backend="trt", vocab_size=self.vocab_size, max_context=min(manifest.max_context, slot_limit),
            heads=self.arch, heads_max_depth=heads.max_depth if heads is not None else None,
            heads_name=heads.name if heads is not None else "none",
            default_tree=compile_tree(tree["choices"], tree["name"]) if tree else None,
        )

    # -- helpers ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        torch = _torch()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def _dev(self, array: np.ndarray):
        """A small host array on the device (one H2D copy, ordered on the runner's stream)."""
        return _torch().tensor(np.asarray(array), device=self.device)  # copies: 0-d and read-only arrays too

    @staticmethod
    def _host(t) -> np.ndarray:
        """Logits to the host as float32 (bfloat16 has no numpy type: convert on the device first)."""
        return t.float().cpu().numpy()

    # -- Runner ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # nothing enqueued may outlive the buffers and contexts
        for graph in (self.base, self.begin, self.step, self.medusa):
            if hasattr(graph, "close"):
                graph.close()
        self.base = self.begin = self.step = self.medusa = None
        self.cache = self.head_cache = None

    @property
    def cache(self) -> DeviceKVCache:
        return self._solo.state.cache if self._solo else None  # the solo sequence's (tests, tools)

    @property
    def head_cache(self) -> DeviceKVCache | None:
        return self._solo.state.head_cache if self._solo else None

    def _open_slot(self, slot: Slot) -> TrtSequence:
        slots = min(slot.capacity, self.cache_block)
        with self._on_stream():
            return TrtSequence(
                DeviceKVCache(self.manifest.graphs["base"], slots, self.device),
                DeviceKVCache(self.manifest.graphs["draft_begin"], slots, self.device) if self.begin is not None else None,
                _torch().zeros((0, self.hidden_size), dtype=self.base.out_dtypes["hidden_states"], device=self.device))

    def _forward(self, slot, tokens, depths, mask, last_only):
        seq, P, T = slot.state, slot.past, tokens.shape[0]
        rows = np.array([T - 1] if last_only else range(T), dtype=np.int64)
        with self._on_stream():
            seq.cache.ensure(P + T, P, slot.capacity)
            past, slots = seq.cache.bound(P)
            inputs = {
                "input_ids": self._dev(tokens.astype(np.int64, copy=False)[None]),  # [1, T]
                "position_ids": self._dev((P + depths.astype(np.int64))[None]),  # [1, T]
                "tree_mask": self._dev(mask.astype(bool, copy=False)[None]),  # [1, T, T]
                "past_lengths": self._dev(np.array([P], dtype=np.int64)),  # [1]
                "logit_rows": self._dev(rows),  # [R]
                **past,  # [1, Hkv, slots, D] each
            }
            seq.last = self.base.run(inputs, {"batch": 1, "new": T, "rows": len(rows), "past": slots})
            return self._host(seq.last["logits"][0])  # [R, V]

    def _commit(self, slot, path, next_tokens):
        seq, P, m = slot.state, slot.past, len(path)
        contiguous = bool(path[0] == 0 and path[-1] == m - 1)  # prefill / plain step: no gather
        with self._on_stream():
            rows = None if contiguous else self._dev(path)
            seq.cache.write(P, seq.last, rows, m)
            states = seq.last["hidden_states"]  # [1, T, H]
            hidden = states[:, :m] if contiguous else states.index_select(1, rows)  # [1, m, H]
            if self.medusa is not None:
                seq.medusa_hidden = hidden[:, -1:].contiguous()  # its heads only read the last accepted token's state
            elif self.begin is not None:
                seq.head_cache.ensure(P + m, P, slot.capacity)
                past, slots = seq.head_cache.bound(P)
                out = self.begin.run({
                    "hidden_states": hidden.contiguous(),
                    "next_tokens": self._dev(next_tokens[None]),  # [1, m]
                    "position_ids": self._dev(np.arange(P, P + m, dtype=np.int64)[None]),  # [1, m]
                    "past_lengths": self._dev(np.array([P], dtype=np.int64)),
                    **past,
                }, {"batch": 1, "accepted": m, "past": slots})
                seq.head_cache.write(P, out, None, m)
                seq.root_state, seq.root_logits = out["state"], out["logits"][0]  # [1, H], [V]

    def _draft_begin(self, slot):
        seq = slot.state
        with self._on_stream():
            if self.medusa is not None:
                out = self.medusa.run({"hidden_states": seq.medusa_hidden}, {"batch": 1, "accepted": 1})
                seq.medusa_logits = self._host(out["logits"][0])  # [K, V]
                return seq.medusa_logits[0]
            seq.states = seq.root_state.clone()  # row i = state of tree node i (grown as drafted)
            return self._host(seq.root_logits)

    def _draft_step(self, slot, depth, nodes, parents, tokens):
        seq = slot.state
        if self.medusa is not None:  # every node at a depth gets the same draft
            return np.repeat(seq.medusa_logits[depth][None], len(nodes), axis=0)
        torch = _torch()
        with self._on_stream():
            need = int(nodes.max()) + 1
            if seq.states.shape[0] < need:
                grown = torch.zeros((need, self.hidden_size), dtype=seq.states.dtype, device=self.device)
                grown[: seq.states.shape[0]] = seq.states
                seq.states = grown
            inputs = {"parent_state": seq.states.index_select(0, self._dev(parents.astype(np.int64))),  # [n, H]
                      "tokens": self._dev(tokens.astype(np.int64, copy=False))}  # [n]
            if self.step.has_input("depth"):
                inputs["depth"] = self._dev(np.array(depth, dtype=np.int64))  # []
            out = self.step.run(inputs, {"candidates": len(nodes)})
            seq.states.index_copy_(0, self._dev(nodes.astype(np.int64)), out["state"])
            return self._host(out["logits"])  # [n, V]


def load_runner(artifact: str | Path, heads: str = ARTIFACT_HEADS, dtype: str | None = None, checksums: bool = True,
                device: int = 0, cache_block: int = 256) -> TrtRunner:
    """Open and validate an artifact folder with TensorRT engines and build its runner.

    Args:
        artifact: folder written by clover-export --backend trt.
        heads: "artifact" (default) or the name the heads were exported from: the artifact's heads;
            "none": plain decoding on the base engine.
        dtype: None, or the precision the caller expects (must be the artifact's).
        checksums: verify every file's sha256 (engines included) on load; sizes are always checked.
        device: CUDA device index.
        cache_block: KV cache slots allocated at the start of a sequence (doubled when full).
    """
    manifest = open_artifact(artifact, checksums=checksums)
    rt.require_tensorrt()
    if dtype is not None and dtype != manifest.dtype:
        raise CloverError(f"artifact {artifact} holds {manifest.dtype} engines, not {dtype}: omit --dtype, or export "
                          f"again with clover-export --backend trt --dtype {dtype}")
    use_heads = uses_exported_heads(artifact, manifest, heads)
    if not manifest.engines:
        raise CloverError(f"artifact {artifact} has no TensorRT engines (exported with --backend {manifest.backend}): "
                          "export it with clover-export --backend trt on this GPU machine, or run it with --backend ort")
    return TrtRunner(artifact, manifest, use_heads=use_heads, device=device, cache_block=cache_block)
