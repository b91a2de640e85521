"""TensorRT backend: runs the engines of an artifact exported with clover-export --backend trt, on one
CUDA GPU, with the same commit / draft semantics as the ONNX Runtime backend (backends/ort.py), so greedy
speculative output is token-identical to plain greedy decoding on this backend.

Device buffers are torch CUDA tensors, not polygraphy.cuda or cuda-python allocations: torch is already
part of every GPU install here (the plugin's Triton kernel runs on it), its caching allocator makes the
per-step output allocations free, its streams order our copies after TensorRT's writes, `index_select`
compacts the KV cache on the device, and `.cpu().numpy()` hands logits to the loop without another copy.

The runner is graph.GraphRunner (KV caches, commit, drafting), the same as ONNX Runtime's, over
`TorchArrays`: caches are [1, Hkv, slots, D] device tensors per layer, compacted on the device; only logits
ever travel to the host.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clover.artifact import (
    ARTIFACT_HEADS,
    EngineSpec,
    GraphSpec,
    Manifest,
    ProfileSpec,
    open_artifact,
    uses_exported_heads,
)
from clover.artifact import tokenizer_dir as base_dir  # noqa: F401 (the backend interface's name)
from clover.errors import CloverError
from clover.runtime.backend import RunnerSpec
from clover.runtime.backends import tensorrt as rt
from clover.runtime.backends.graph import Arrays, GraphRunner, graphs_used  # noqa: F401 (graphs_used: tests, tools)
from clover.runtime.lookup import NgramStore
from clover.trt import ITEMSIZE, check_engine_compatible, device_info, require_tensorrt

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
        return math.prod(self.shape(sizes)) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class BindingTable:
    """The I/O of one engine: shapes and sizes of every tensor for given dim sizes, and the profile
    (execution context) that runs them."""

    graph: str
    inputs: tuple[Binding, ...]
    outputs: tuple[Binding, ...]
    profiles: tuple[ProfileSpec, ...]

    @classmethod
    def of(cls, name: str, graph: GraphSpec, profiles: Sequence[ProfileSpec]) -> BindingTable:
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
    built = "; ".join(
        p.name + " " + ", ".join(f"{d} {a}..{z}" for d, (a, z) in dim_bounds(p, table.inputs).items())
        for p in table.profiles
    )
    asked = ", ".join(f"{k} {v}" for k, v in sizes.items())
    return (
        f"TensorRT engine {table.graph} has no optimization profile for {asked} (it was built for {built}): use a "
        "shorter prompt or a smaller tree, or rebuild the engines with clover-export --backend trt and larger limits"
    )


def max_slots(table: BindingTable) -> int:
    """Most cache slots every profile of an engine accepts (the `past` dim), or a large number without one."""
    bounds = [dim_bounds(p, table.inputs).get("past") for p in table.profiles]
    return min((b[1] for b in bounds if b is not None), default=1 << 62)


# -- the GPU side --------------------------------------------------------------------------------------------


def _torch():
    try:
        import torch
    except ImportError as e:
        raise CloverError("the trt backend needs torch with CUDA (pip install torch from the CUDA index)") from e
    return torch


def torch_dtype(name: str):
    torch = _torch()
    return {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "int64": torch.int64,
        "int32": torch.int32,
        "bool": torch.bool,
    }[name]


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

    def run(
        self, inputs: Mapping[str, Any], sizes: Mapping[str, int], into: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Enqueue one call on the runner's stream; outputs are new device tensors (from torch's caching
        allocator, on that stream, so they are reused only after this call has read and written them)."""
        torch = _torch()
        assert not into, "TensorRT engines return their outputs (no in-place KV cache: that is ORT's fused attention)"
        profile = self.table.profile(sizes)
        outputs = {
            n: torch.empty(s, dtype=self.out_dtypes[n], device=self.device)
            for n, s in self.table.output_shapes(sizes).items()
        }
        inputs = {n: t.contiguous() for n, t in inputs.items()}  # addresses of dense tensors
        for b in self.table.inputs:
            assert tuple(inputs[b.name].shape) == b.shape(sizes), (
                self.table.graph,
                b.name,
                inputs[b.name].shape,
                sizes,
            )
        addresses = {n: t.data_ptr() for n, t in (*inputs.items(), *outputs.items())}
        rt.run_context(self.contexts[profile], self.table.input_shapes(sizes), addresses, self.stream.cuda_stream)
        return outputs


def check_engine_io(table: BindingTable, io: Mapping[str, tuple[bool, str]], file: str) -> None:
    """The engine has exactly the graph's inputs and outputs, with the manifest's dtypes."""
    want = {b.name: (True, b.dtype) for b in table.inputs} | {b.name: (False, b.dtype) for b in table.outputs}
    if dict(io) != want:
        diff = sorted(set(io.items()) ^ set(want.items()))
        raise CloverError(
            f"engine {file} does not match graph {table.graph} of the manifest (differs in "
            f"{', '.join(n for n, _ in diff[:4])}): export the artifact again"
        )


class TorchArrays(Arrays):
    """A TensorRT runner's tensors: torch, on its CUDA device, every op ordered on its stream (`scope`)."""

    def __init__(self, device, stream) -> None:
        self.torch, self.device, self.stream = _torch(), device, stream

    def put(self, host):
        return self.torch.tensor(np.asarray(host), device=self.device)  # one H2D copy; 0-d and read-only arrays too

    def host(self, array):
        return array.float().cpu().numpy()  # bfloat16 has no numpy type: convert on the device first

    def zeros(self, shape, dtype):
        return self.torch.zeros(shape, dtype=torch_dtype(dtype), device=self.device)

    def take(self, array, index, axis):
        return array.index_select(axis, self.put(np.asarray(index, dtype=np.int64)))

    def scatter(self, dst, index, src):
        dst.index_copy_(0, self.put(np.asarray(index, dtype=np.int64)), src)

    def concat(self, arrays, axis):
        return self.torch.cat(list(arrays), dim=axis)

    def copy(self, array):
        return array.clone()

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        if self.stream is None:  # CPU tests of the bookkeeping: the current stream
            yield
            return
        with self.torch.cuda.device(self.device), self.torch.cuda.stream(self.stream):
            yield


class TrtRunner(GraphRunner):
    """A Runner over an artifact's TensorRT engines; use `load_runner` to build one from a folder."""

    def __init__(
        self, root: str | Path, manifest: Manifest, use_heads: bool = True, device: int = 0, cache_block: int = 256
    ) -> None:
        torch = _torch()
        trt = require_tensorrt()
        if cache_block < 1:
            raise CloverError(f"cache_block must be >= 1 slot, got {cache_block}")
        root = Path(root)
        here = device_info(device)
        names = graphs_used(manifest, use_heads)
        for name in names:
            if name not in manifest.engines:
                raise CloverError(
                    f"artifact {root} has no TensorRT engine for graph {name}: export it again with "
                    "clover-export --backend trt"
                )
            check_engine_compatible(manifest.engines[name], trt.__version__, here.name, here.compute_capability)
        if manifest.attention == "plugin":
            from clover.plugins.trt_plugin import register

            register()  # JIT engines (TensorRT < 10.9) call back into its Python; AOT engines embed the kernel
        cuda = torch.device("cuda", device)
        with torch.cuda.device(cuda):
            stream = torch.cuda.Stream(cuda)
            engines = {n: EngineGraph(root, n, manifest.graphs[n], manifest.engines[n], cuda, stream) for n in names}
        self._setup(manifest, use_heads, engines, cuda, stream, cache_block, NgramStore.of_artifact(root, manifest))

    def _setup(
        self,
        manifest: Manifest,
        use_heads: bool,
        engines: Mapping[str, Any],
        device,
        stream,
        cache_block: int,
        ngram_store: NgramStore | None = None,
    ) -> None:
        """Everything but loading: `engines` maps graph names to objects with EngineGraph's run / table /
        has_input. stream None runs torch ops on the current stream (CPU tests of the bookkeeping drive this
        class with ONNX Runtime in place of the engines)."""
        self.stream = stream
        slot_limit = min(max_slots(engines[n].table) for n in ("base", "draft_begin") if n in engines)
        table = engines["base"].table
        rows = max((dim_bounds(p, table.inputs).get("new", (0, 0))[1] for p in table.profiles), default=0)
        super().__init__(
            manifest,
            engines,
            TorchArrays(device, stream),
            use_heads=use_heads,
            backend="trt",
            cache_block=cache_block,
            max_context=min(manifest.max_context, slot_limit),
            ngram_store=ngram_store,
            max_rows=rows or None,
        )

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # nothing enqueued may outlive the buffers and contexts
        for graph in (self.base, *(self.drafter.graphs if self.drafter is not None else ())):
            if hasattr(graph, "close"):
                graph.close()
        self.base = self.drafter = None
        self._free = []


def load_runner(
    artifact: str | Path,
    heads: str = ARTIFACT_HEADS,
    dtype: str | None = None,
    checksums: bool = True,
    device: int = 0,
    cache_block: int = 256,
) -> TrtRunner:
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
    require_tensorrt()
    if dtype is not None and dtype != manifest.dtype:
        raise CloverError(
            f"artifact {artifact} holds {manifest.dtype} engines, not {dtype}: omit --dtype, or export "
            f"again with clover-export --backend trt --dtype {dtype}"
        )
    use_heads = uses_exported_heads(artifact, manifest, heads)
    if not manifest.engines:
        raise CloverError(
            f"artifact {artifact} has no TensorRT engines (exported with --backend {manifest.backend}): "
            "export it with clover-export --backend trt on this GPU machine, or run it with --backend ort"
        )
    return TrtRunner(artifact, manifest, use_heads=use_heads, device=device, cache_block=cache_block)


def from_spec(artifact: str | Path, spec: RunnerSpec) -> TrtRunner:
    """load_runner with the RunnerSpec fields the trt backend has (heads and dtype)."""
    return load_runner(artifact, heads=ARTIFACT_HEADS if spec.heads is None else spec.heads, dtype=spec.dtype)
