"""ONNX Runtime backend: runs an exported artifact with numpy + onnxruntime only (no torch, no model code).

The runner is graph.GraphRunner (KV caches, commit, drafting) over numpy arrays; this module runs the
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

Execution providers (`OrtOptions.providers`, `--providers cuda,cpu`: names in order of preference). On the CPU
the tensors are numpy arrays. On CUDA (onnxruntime-gpu) they are torch CUDA tensors (trt.TorchArrays:
KV caches and step tensors stay on the device, only logits come back), bound through IOBinding by address, and
every session runs on the runner's own CUDA stream (the provider's `user_compute_stream`), so torch's copies and
ONNX Runtime's kernels are ordered without host waits; torch is imported on this path only. Where the CUDA
provider is missing (the CPU build of onnxruntime) or did not start (onnxruntime-gpu without the CUDA / cuDNN
libraries creates CPU sessions with only a log line), `cuda,cpu` runs on the CPU and says so in one line
(`OrtRunner.placement.note`, logged once); `cuda` alone fails with that line.

CUDA graphs (`OrtOptions.cuda_graphs`, off by default) need every captured call to repeat its shapes and
buffer addresses. That holds only for the head graphs that take no KV cache (`medusa_heads`, `draft_step`):
their inputs are copied into static buffers, one set and one graph (`gpu_graph_id`) per shape (one per tree
level's node count). The base graph (verify and prefill: a new row count every step, KV caches bound at
per-sequence addresses that move when a cache doubles), the batched base, `draft_begin` (its own KV cache) and
the LM head run without. ONNX Runtime refuses capture for a graph with nodes on the CPU; such a graph runs
uncaptured, said in one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clover.artifact import (
    ARTIFACT_HEADS,
    BATCH_GRAPH,
    DRAFT_LM_HEAD,
    ROW_COUNTS,
    GraphSpec,
    Manifest,
    open_artifact,
    read_draft_vocab,
    uses_exported_heads,
)
from clover.artifact import tokenizer_dir as base_dir  # noqa: F401 (the backend interface's name)
from clover.errors import CloverError
from clover.runtime.backend import EngineClock, RunnerSpec
from clover.runtime.backends.graph import Arrays, GraphRunner, KVCache, NumpyArrays, graphs_used
from clover.runtime.lookup import NgramStore

LM_HEAD, LM_INPUT = "lm_head", "lm_input"  # as clover.export.lm_head (no export import here: no torch)
PROVIDERS = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}  # --providers names: ONNX Runtime's
CUDA, CPU = PROVIDERS["cuda"], PROVIDERS["cpu"]
CUDA_GRAPHS = ("medusa_heads", "draft_step")  # the graphs whose calls repeat their shapes (module doc)
CUDA_GRAPH_SHAPES = 16  # captured shapes per graph; calls of other shapes run uncaptured
# I/O element types for binding by address; 16 = onnx.TensorProto.BFLOAT16 (numpy has no bfloat16).
ELEMENT_TYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": 16,
    "int64": np.int64,
    "int32": np.int32,
    "bool": np.bool_,
}
GPU_EXTRA = "install the gpu extra in an environment of its own (onnxruntime-gpu cannot share one with onnxruntime)"
log = logging.getLogger(__name__)


def _ort():
    try:
        import onnxruntime
    except ImportError as e:
        raise CloverError("the ort backend needs onnxruntime: pip install onnxruntime (or clover-deploy[onnx])") from e
    return onnxruntime


@dataclass(frozen=True)
class OrtOptions:
    """threads: intra-op threads per session; 0 = $OMP_NUM_THREADS where it is set (the count torch takes too, so
      processes that share a machine can cap both with one variable), else onnxruntime's default (one per
      physical core).
    spin: a session's idle intra-op threads busy-wait for its next op. A decode step runs a few
      hundred ops, each waking a sleeping thread otherwise, so a plain step is faster spinning. Every session
      of the runner (base, LM heads, draft graphs) spins, and spinning stops when a run returns, so the
      sessions alternate without stealing each other's cores (a session left spinning after its run, or pools
      spinning in several sessions at once, slow decoding down). The draft graphs run on `threads` spinning
      threads instead of the calling thread alone, which shortens drafting (measured: docs/experiments.md,
      2026-11-24 "the fused base graph and spinning sessions", 2026-11-25 "draft graphs on the spinning
      threads"). False: every session's threads sleep between ops, and every session uses `threads`.
    checksums: verify every file's sha256 on load (sizes are always checked).
    cache_block: KV cache slots allocated at the start of a sequence (doubled when full).
    batch: load the artifact's batched base graph (if it has one) to run several sequences per forward; a
      one-sequence Generator does not need it (it holds the weights a second time).
    providers: execution providers in order of preference, from "cuda" and "cpu" (a comma-separated string
      such as "cuda,cpu" is accepted); "cuda,cpu" runs on the CPU, saying so in one line, where CUDA is not
      available (module doc).
    device: the CUDA device index.
    cuda_graphs: capture CUDA graphs where the calls repeat their shapes (the head graphs, module doc)."""

    threads: int = 0
    spin: bool = True
    checksums: bool = True
    cache_block: int = 256
    batch: bool = False
    providers: tuple[str, ...] = ("cpu",)
    device: int = 0
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise CloverError(f"threads must be >= 0 (0 = onnxruntime's default), got {self.threads}")
        if self.cache_block < 1:
            raise CloverError(f"cache_block must be >= 1 slot, got {self.cache_block}")
        object.__setattr__(self, "providers", parse_providers(self.providers))
        if self.device < 0:
            raise CloverError(f"device must be a CUDA device index >= 0, got {self.device}")
        if self.cuda_graphs and "cuda" not in self.providers:
            raise CloverError(
                f"CUDA graphs need the cuda provider, but providers are {','.join(self.providers)}: "
                "use --providers cuda,cpu"
            )


def parse_providers(given: str | Sequence[str]) -> tuple[str, ...]:
    """--providers "cuda,cpu" (or a sequence of names) as ("cuda", "cpu"), checked: known names, each once,
    the CPU last (it has a kernel for every node, so a provider after it would run nothing)."""
    names = tuple(n.strip().lower() for n in (given.split(",") if isinstance(given, str) else given))
    shown = given if isinstance(given, str) else ",".join(given)
    choices = f"choose from {', '.join(PROVIDERS)}, comma-separated in order of preference (e.g. cuda,cpu)"
    bad = [n for n in names if n not in PROVIDERS]
    if bad or not names:
        raise CloverError(f"unknown execution provider {bad[0] if bad else ''!r} in --providers {shown!r}: {choices}")
    if len(set(names)) < len(names):
        raise CloverError(f"--providers {shown!r} names a provider twice: {choices}")
    if names[-1] != "cpu" and "cpu" in names:
        raise CloverError(
            f"--providers {shown!r} lists cpu before {names[-1]}, which would then run nothing (the CPU "
            f"provider has a kernel for every node): put cpu last, e.g. {names[-1]},cpu"
        )
    return names


@dataclass(frozen=True)
class Placement:
    """Where a runner's sessions run. providers: ONNX Runtime's names, asked of every session in order; cuda: the
    runner's tensors live on the CUDA device (every session got the CUDA provider); note: one line when the
    runner does not run where the first provider asked would have it (logged once, kept for reports)."""

    providers: tuple[str, ...]
    cuda: bool
    note: str | None = None


def place(options: OrtOptions, available: Sequence[str] | None = None) -> Placement:
    """The providers to ask each session for, from what was asked and what this onnxruntime has (`available`:
    onnxruntime.get_available_providers()); a one-line error for cuda without it, and without cpu to fall to."""
    ort = _ort()
    available = list(ort.get_available_providers() if available is None else available)
    asked = options.providers
    if "cuda" in asked and CUDA not in available:
        why = f"this onnxruntime ({ort.__version__}) has no CUDA execution provider (it has {', '.join(available)})"
        if "cpu" not in asked:
            raise CloverError(f"{why}: for CUDA {GPU_EXTRA}; or pass --providers cpu")
        return Placement(
            (CPU,), False, f"--providers {','.join(asked)}: running on the CPU, as {why}; for CUDA {GPU_EXTRA}"
        )
    return Placement(tuple(PROVIDERS[n] for n in asked), asked[0] == "cuda")


def check_session(placement: Placement, session, name: str) -> Placement:
    """`placement` after a session was created under it. onnxruntime-gpu lists the CUDA provider even when its
    libraries cannot load, then creates the session on the CPU with no error (only a log line): say so in one
    line and run on the CPU, or fail if the CPU was not asked for."""
    got = session.get_providers()
    if CUDA not in placement.providers or CUDA in got:
        return placement
    why = (
        f"onnxruntime {_ort().__version__} lists the CUDA execution provider, but created the session for {name} "
        f"with {', '.join(got)} only: the CUDA 12/13 runtime or cuDNN 9 libraries were not found (python -c "
        '"import onnxruntime; onnxruntime.preload_dlls()" names the missing one; pip install '
        "'onnxruntime-gpu[cuda,cudnn]' brings the nvidia-* wheels)"
    )
    if CPU not in placement.providers:
        raise CloverError(why)
    return Placement((CPU,), False, f"{why}: running on the CPU")


def env_threads() -> int:
    """$OMP_NUM_THREADS as a thread count, 0 (onnxruntime's default) where it is unset or not a positive int."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 0


def session_options(opts: OrtOptions):
    """Session options of every session of a runner: `opts.threads` intra-op threads that, with `opts.spin`,
    busy-wait for the next op while a run lasts and stop when it returns (see OrtOptions.spin)."""
    ort = _ort()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL  # one request, one op at a time: no inter-op pool
    so.intra_op_num_threads = opts.threads or env_threads()
    so.inter_op_num_threads = 1
    so.log_severity_level = 3  # errors only: optimizer notes are not actionable for a user
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if opts.spin else "0")
    if opts.spin:  # the runner's sessions run one after the other: none may keep spinning after its run
        so.add_session_config_entry("session.force_spinning_stop", "1")
    return so


class Graph:
    """One InferenceSession and its IOBinding, driven by the I/O names, dims and dtypes of the manifest
    (graph.EngineGraph). It binds numpy arrays (OrtValues over their memory) or, after `on_device`, torch
    tensors by address. `cuda_graph`: the session was created with CUDA graphs (module doc)."""

    def __init__(self, spec: GraphSpec, session, clock: EngineClock, cuda_graph: bool = False) -> None:
        ort = _ort()
        self.spec, self.session, self.clock, self.cuda_graph = spec, session, clock, cuda_graph
        self.binding = session.io_binding()
        self._ortvalue = ort.OrtValue.ortvalue_from_numpy
        # Arrays bound now (they must outlive the run): an input or in-place output bound to the same array as
        # last call is not bound again (a KV cache stays bound from step to step: 2 x layers arrays).
        self._inputs: dict[str, Any] = {}
        self._into: dict[str, Any] = {}
        self._outputs = [(t.name, t.shape, t.dtype) for t in spec.outputs]
        self._dtypes = {t.name: t.dtype for t in (*spec.inputs, *spec.outputs)}
        self.lm_head: Graph | None = None  # runs after this graph when it outputs LM_INPUT (use_lm_head)
        self.device: tuple[str, int] | None = None  # where bound tensors live, after on_device
        self._arrays: Any = None  # their TorchArrays
        self._torch_dtype: Any = None  # trt.torch_dtype, imported with torch
        self._captured: dict[tuple, CapturedShape] = {}  # by input shapes
        # A session with CUDA graphs captures every run it is not told otherwise of: gpu_graph_id -1 runs uncaptured.
        self._run_options = None
        if cuda_graph:
            self._run_options = ort.RunOptions()
            self._run_options.add_run_config_entry("gpu_graph_id", "-1")

    def has_input(self, name: str) -> bool:
        return self.spec.has_input(name)

    def on_device(self, device_type: str, index: int, arrays: Arrays) -> None:
        """Take torch tensors (`arrays`: trt.TorchArrays) on device `device_type` ("cuda"; "cpu" in tests)
        and bind them by address; outputs are new tensors there."""
        from clover.runtime.backends.trt import torch_dtype

        self.device, self._arrays, self._torch_dtype = (device_type, index), arrays, torch_dtype
        self._inputs, self._into, self._captured = {}, {}, {}

    def _empty(self, dims: Sequence[int | str], dtype: str, sizes: Mapping[str, int]):
        """A new output array shaped by `sizes` (empty: no page is touched before ONNX Runtime writes it)."""
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in dims)
        if self.device is None:
            return np.empty(shape, np.dtype(dtype))
        return self._arrays.torch.empty(shape, dtype=self._torch_dtype(dtype), device=self._arrays.device)

    def _bind(self, bound: dict[str, Any], name: str, array: Any, output: bool) -> None:
        if bound.get(name) is array:
            return
        if self.device is not None:
            bound[name] = array = array.contiguous()  # kept while bound: ONNX Runtime holds only its address
            bind_address(self.binding, name, array, self._dtypes[name], self.device, output)
            return
        array = np.ascontiguousarray(array)  # shares memory: no copy for the arrays it is given
        bound[name] = array
        (self.binding.bind_ortvalue_output if output else self.binding.bind_ortvalue_input)(name, self._ortvalue(array))

    def run(
        self, inputs: Mapping[str, Any], sizes: Mapping[str, int], into: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Run with the outputs in `into` written there in place and every other output straight into a new
        array shaped by `sizes` (a later run never overwrites what this one returned). A graph cut before the
        shared LM head gives `logits` all the same: its LM_INPUT rows go through `lm_head`."""
        outs = None
        if self.cuda_graph and self.device is not None and not into:
            outs = self._run_captured(inputs, sizes)
        if outs is None:
            outs = self._run(inputs, sizes, into)
        if self.lm_head is not None:
            rows = outs.pop(LM_INPUT)
            flat = rows.reshape(-1, rows.shape[-1])
            logits = self.lm_head.run({LM_INPUT: flat}, {self.lm_head.spec.input(LM_INPUT).shape[0]: flat.shape[0]})[
                "logits"
            ]
            outs["logits"] = logits.reshape(*rows.shape[:-1], -1)
        return outs

    def _run(
        self, inputs: Mapping[str, Any], sizes: Mapping[str, int], into: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        for name, array in inputs.items():
            self._bind(self._inputs, name, array, output=False)
        for name, array in (into or {}).items():
            self._bind(self._into, name, array, output=True)
        outs = {
            name: self._empty(dims, dtype, sizes) for name, dims, dtype in self._outputs if not into or name not in into
        }
        for name, array in outs.items():
            if self.device is not None:
                bind_address(self.binding, name, array, dtype=self._dtypes[name], device=self.device, output=True)
            else:
                self.binding.bind_ortvalue_output(name, self._ortvalue(array))
        with self.clock:
            self.session.run_with_iobinding(self.binding, self._run_options)
        return outs

    def _run_captured(self, inputs: Mapping[str, Any], sizes: Mapping[str, int]) -> dict[str, Any] | None:
        """The call on the CUDA graph of its input shapes (captured on first use), or None past CUDA_GRAPH_SHAPES
        shapes. The inputs are copied into the graph's static buffers and its outputs out of them."""
        key = tuple((name, tuple(array.shape)) for name, array in inputs.items())
        shape = self._captured.get(key)
        if shape is None:
            if len(self._captured) >= CUDA_GRAPH_SHAPES:
                return None
            shape = self._captured[key] = CapturedShape(self, len(self._captured) + 1, inputs, sizes)
        for name, array in inputs.items():
            shape.inputs[name].copy_(array)
        with self.clock:
            self.session.run_with_iobinding(shape.binding, shape.run_options)
        return {name: array.clone() for name, array in shape.outputs.items()}  # the next call of this shape reuses them

    def use_lm_head(self, lm_head: Graph) -> None:
        """This graph stops before the shared LM head (it outputs LM_INPUT): `run` runs `lm_head` after it."""
        self.lm_head = lm_head


class CapturedShape:
    """One CUDA graph of a Graph: static input and output tensors of one set of input shapes, bound once to an
    IOBinding of their own, and the run options naming the graph (gpu_graph_id 1, 2, ...: ONNX Runtime keeps 0).
    ONNX Runtime captures it on its first runs and replays it after: same shapes, same addresses."""

    def __init__(self, graph: Graph, graph_id: int, inputs: Mapping[str, Any], sizes: Mapping[str, int]) -> None:
        ort = _ort()
        self.binding = graph.session.io_binding()
        self.inputs = {name: array.contiguous().clone() for name, array in inputs.items()}
        self.outputs = {name: graph._empty(dims, dtype, sizes) for name, dims, dtype in graph._outputs}
        for name, array in (*self.inputs.items(), *self.outputs.items()):
            bind_address(self.binding, name, array, graph._dtypes[name], graph.device, output=name in self.outputs)
        self.run_options = ort.RunOptions()
        self.run_options.add_run_config_entry("gpu_graph_id", str(graph_id))


def bind_address(binding, name: str, tensor: Any, dtype: str, device: tuple[str, int], output: bool) -> None:
    """Bind a dense torch tensor to I/O `name` by its address on `device` (device type, index)."""
    bind = binding.bind_output if output else binding.bind_input
    bind(name, device[0], device[1], ELEMENT_TYPES[dtype], tuple(tensor.shape), tensor.data_ptr())


class CudaDevice:
    """A runner's CUDA side: torch's device and the runner's stream, which every session runs on (the CUDA
    provider's user_compute_stream) and every torch op of the runner is ordered on (TorchArrays.scope)."""

    def __init__(self, index: int) -> None:
        try:
            import torch
        except ImportError as e:
            raise CloverError(
                "the ort backend keeps its CUDA tensors in torch: install torch with CUDA (the gpu "
                "extra), or pass --providers cpu"
            ) from e
        if not torch.cuda.is_available():
            raise CloverError(
                f"torch {torch.__version__} sees no CUDA device (a CPU build, or no driver): install "
                "torch with CUDA (the gpu extra), or pass --providers cpu"
            )
        if index >= torch.cuda.device_count():
            raise CloverError(f"CUDA device {index} does not exist: torch sees {torch.cuda.device_count()}")
        self.index, self.device = index, torch.device("cuda", index)
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)  # not the legacy default stream: ONNX Runtime refuses 0

    def provider_options(self, cuda_graph: bool) -> dict[str, str]:
        options = {"device_id": str(self.index), "user_compute_stream": str(self.stream.cuda_stream)}
        if cuda_graph:
            options["enable_cuda_graph"] = "1"
        return options

    def arrays(self) -> Arrays:
        from clover.runtime.backends.trt import TorchArrays

        return TorchArrays(self.device, self.stream)


class Sessions:
    """Opens a runner's sessions (`open`) on the providers `place` chose, each checked once created
    (`check_session`: the placement drops to the CPU when a session did not get CUDA), then gives the runner its
    Arrays (`arrays`): numpy, or TorchArrays on the CUDA device with every graph binding by address."""

    def __init__(self, root: Path, options: OrtOptions, clock: EngineClock) -> None:
        self.root, self.options, self.clock = root, options, clock
        self.placement = place(options)
        self.cuda = CudaDevice(options.device) if self.placement.cuda else None
        self.graphs: list[Graph] = []

    def open(self, name: str, spec: GraphSpec, so) -> Graph:
        """The graph `name` of the manifest (`spec`) with session options `so`."""
        ort, path = _ort(), self.root / spec.file
        capture = self.options.cuda_graphs and self.placement.cuda and name in CUDA_GRAPHS
        for cuda_graph in (True, False) if capture else (False,):
            providers = [
                (p, self.cuda.provider_options(cuda_graph)) if p == CUDA else p for p in self.placement.providers
            ]
            try:
                session = ort.InferenceSession(str(path), so, providers=providers)
                break
            except Exception as e:  # onnxruntime raises its own Fail / InvalidGraph types
                first = (str(e).splitlines() or [type(e).__name__])[0]
                if cuda_graph and "graph capture" in first:  # nodes on the CPU (module doc)
                    log.warning("CUDA graphs off for %s: %s", spec.file, first)
                    continue
                raise CloverError(f"onnxruntime cannot load {path}: {first}") from e
        self.placement = check_session(self.placement, session, spec.file)
        graph = Graph(spec, session, self.clock, cuda_graph=cuda_graph)
        self.graphs.append(graph)
        return graph

    def arrays(self) -> Arrays:
        if not self.placement.cuda:
            return NumpyArrays()
        return self.bind_by_address("cuda", self.cuda.index, self.cuda.arrays())

    def bind_by_address(self, device_type: str, index: int, arrays: Arrays) -> Arrays:
        for graph in self.graphs:
            graph.on_device(device_type, index, arrays)
        return arrays


class OrtRunner(GraphRunner):
    """A Runner over an artifact's ONNX graphs; use `load_runner` to build one from a folder."""

    def __init__(
        self, root: str | Path, manifest: Manifest, use_heads: bool = True, options: OrtOptions = OrtOptions()
    ):
        so = session_options(options)
        self.options = options
        self.engine_clock = clock = EngineClock()
        sessions = Sessions(Path(root), options, clock)
        graphs = {n: sessions.open(n, manifest.graphs[n], so) for n in graphs_used(manifest, use_heads)}
        # The batched base (fused artifacts, export/batch_graph.py): several sequences' rows in one forward.
        self.batch = None
        if options.batch and BATCH_GRAPH in manifest.graphs:
            self.batch = sessions.open(BATCH_GRAPH, manifest.graphs[BATCH_GRAPH], so)
        self.lm_head = None
        if LM_HEAD in manifest.graphs:  # on the base's thread settings: it computes every verified row's logits
            self.lm_head = sessions.open(LM_HEAD, manifest.graphs[LM_HEAD], so)
            for g in (*graphs.values(), self.batch):
                if g is not None and g.spec.has_output(LM_INPUT):
                    g.use_lm_head(self.lm_head)
        # A draft vocabulary (export/draft_vocab.py): the draft graphs' rows go through its K-token LM head instead.
        draft_vocab = read_draft_vocab(Path(root), manifest) if use_heads else None
        if draft_vocab is not None:
            draft_lm_head = sessions.open(DRAFT_LM_HEAD, manifest.graphs[DRAFT_LM_HEAD], so)
            for name in manifest.draft_vocab.graphs:
                if name in graphs:
                    graphs[name].use_lm_head(draft_lm_head)
        # Where the sessions run (providers asked, what this onnxruntime has, what each session got): one line
        # when it is not where the first provider asked would have it.
        self.placement = sessions.placement
        if self.placement.note:
            log.warning(self.placement.note)
        self.stream = sessions.cuda.stream if self.placement.cuda else None
        fused = manifest.attention == "fused"
        self.batch_slots = int(self.batch.spec.input(ROW_COUNTS).shape[0]) if self.batch is not None else 1
        super().__init__(
            manifest,
            graphs,
            self._arrays(sessions),
            use_heads=use_heads,
            backend="ort",
            cache_block=options.cache_block,
            chains_only=fused and manifest.weights is not None and manifest.weights.accuracy_level != 0,
            batch_slots=self.batch_slots,
            draft_vocab=draft_vocab,
            ngram_store=NgramStore.of_artifact(Path(root), manifest),
        )
        self._idle: dict[int, KVCache] = {}  # 2-slot buffers of the batched graph's slot inputs not in a step
        self.two_rows = self.lone_row_differs()
        self.info = dataclasses.replace(self.info, cost_key=self._cost_key(manifest, use_heads))

    def _cost_key(self, manifest: Manifest, use_heads: bool) -> str | None:
        """What a verify forward's time depends on besides the machine (the verify-cost cache's key); None on CUDA,
        whose device the key would not name."""
        if self.placement.cuda:
            return None
        o = self.options
        digest = hashlib.sha256(json.dumps(manifest.to_dict(), sort_keys=True).encode()).hexdigest()
        return (
            f"ort {_ort().__version__}; manifest digest {digest}; heads {use_heads}; "
            f"batch graph {self.batch is not None}; two rows {self.two_rows}; threads {o.threads}; spin {o.spin}; "
            f"cache block {o.cache_block}; providers {','.join(self.placement.providers)}"
        )

    def _arrays(self, sessions: Sessions) -> Arrays:
        """Where the runner's tensors live (tests bind torch CPU tensors by address here, as CUDA would)."""
        return sessions.arrays()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # nothing enqueued may outlive the buffers
        self.base = self.batch = self.drafter = self.lm_head = None
        self._free = []

    def _forward_batch(self, batch):
        """Sequences in the batched graph's slots run in one call; the rest (or a lone one) on the base graph."""
        packed = sorted((v for v in batch if v.slot.index < self.batch_slots), key=lambda v: v.slot.index)
        if self.batch is None or len(packed) < 2:
            return super()._forward_batch(batch)
        out = dict(zip((id(v) for v in packed), self._forward_packed(packed)))
        return [
            out[id(v)] if id(v) in out else self._forward(v.slot, v.tokens, v.depths, v.mask, v.last_only)
            for v in batch
        ]

    def _forward_packed(self, packed):
        with self.arrays.scope():
            return self._forward_packed_impl(packed)

    def _forward_packed_impl(self, packed):
        N, a = self.batch_slots, self.arrays
        counts, pasts = np.zeros(N, np.int64), np.zeros(N, np.int64)
        by_slot = {v.slot.index: v for v in packed}
        caches, into = {}, {}
        for b in range(N):
            v = by_slot.get(b)
            if v is None:  # not in this step: its nodes run on 2 dummy rows over an idle 2-slot buffer
                cache = self._idle.get(b) or self._idle.setdefault(
                    b, KVCache(self.base_spec, 2, self.arrays, shared=True)
                )
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
            mask[0, end - T : end, end - T : end] = v.mask
        # logit rows: a prompt's last row, every row of a tree
        rows = np.concatenate(
            [[end - 1] if v.last_only else np.arange(end - len(v.tokens), end) for v, end in zip(packed, ends)]
        )
        out = self.batch.run(
            {
                "input_ids": a.put(np.concatenate([v.tokens for v in packed]).astype(np.int64)[None]),  # [1, R]
                "position_ids": a.put(
                    np.concatenate([v.slot.past + v.depths.astype(np.int64) for v in packed])[None]
                ),  # [1, R]
                "tree_mask": a.put(mask),
                "past_lengths": a.put(pasts),  # [N]
                ROW_COUNTS: a.put(counts),  # [N]
                "logit_rows": a.put(np.asarray(rows, dtype=np.int64)),
                **caches,
            },
            {"new": R, "rows": len(rows)},
            into,
        )
        logits = a.host(out["logits"][0])  # [rows, V]
        results, at = [], 0
        for v, end in zip(packed, ends):
            T, n = len(v.tokens), 1 if v.last_only else len(v.tokens)
            v.slot.state.last = {"hidden_states": out["hidden_states"][:, end - T : end]}  # [1, T, H]
            results.append(logits[at : at + n])
            at += n
        return results


def load_runner(
    artifact: str | Path,
    heads: str = ARTIFACT_HEADS,
    dtype: str | None = None,
    *,
    threads: int | None = None,
    batch: bool | None = None,
    providers: str | Sequence[str] | None = None,
    options: OrtOptions = OrtOptions(),
) -> OrtRunner:
    """Open and validate an artifact folder and build its runner.

    Args:
        artifact: folder written by clover-export.
        heads: "artifact" (default) or the name the heads were exported from: the artifact's heads;
            "none": plain decoding on the artifact's base graph.
        dtype: None, or the precision the caller expects (must be the artifact's).
        threads, batch, providers: the OrtOptions fields every caller of a backend names (clover.Engine loads with
            batch=True; providers: e.g. "cuda,cpu", the runner's `placement` says where it runs); given, they
            replace `options`' own.
        options: the rest (spin, checksums, cache_block, device, cuda_graphs: see OrtOptions).
    """
    options = dataclasses.replace(
        options,
        threads=options.threads if threads is None else threads,
        batch=options.batch if batch is None else batch,
        providers=options.providers if providers is None else providers,
    )
    manifest = open_artifact(artifact, checksums=options.checksums)
    if manifest.attention == "plugin":
        raise CloverError(
            f"artifact {artifact} was exported with --attention {manifest.attention}: its tree-attention nodes are "
            "TensorRT plugins that ONNX Runtime cannot run; use --backend trt, or export with --attention portable"
        )
    if dtype is not None and dtype != manifest.dtype:
        raise CloverError(
            f"artifact {artifact} holds {manifest.dtype} graphs, not {dtype}: omit --dtype, or export "
            f"again with clover-export --dtype {dtype}"
        )
    use_heads = uses_exported_heads(artifact, manifest, heads)
    return OrtRunner(artifact, manifest, use_heads=use_heads, options=options)


def from_spec(artifact: str | Path, spec: RunnerSpec) -> OrtRunner:
    """load_runner with the RunnerSpec fields the ort backend has."""
    return load_runner(
        artifact,
        heads=ARTIFACT_HEADS if spec.heads is None else spec.heads,
        dtype=spec.dtype,
        threads=spec.threads,
        batch=spec.batch or None,
        providers=spec.providers,
    )
