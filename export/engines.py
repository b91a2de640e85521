"""TensorRT engines from an artifact's ONNX graphs: optimization profiles, a memory estimate, and the build,
composed of Polygraphy's TensorRT loaders (docs/design.md, Conventions 6).

    limits = EngineLimits(max_prompt=2048, max_tree=64, max_context=4096, max_accepted=8, max_candidates=16)
    engines = build_engines(root, manifest_graphs, "float16", limits, timing_cache, print)

    loader = engine_loader(trt, onnx_path, profiles, timing_cache=..., save_timing_cache=..., progress=print)
    plan = loader()   # EngineBytesFromNetwork(NetworkFromOnnxPath(...), CreateConfig(...)): the serialized engine

Everything here but calling a loader is pure Python: `engine_loader` takes the tensorrt module (the real one
from clover.trt.require_tensorrt, or a stand-in in tests) and only reads its version and enum members, so
the loader chain and its profiles can be inspected without TensorRT. The runtime's check that an engine
fits this machine, check_engine_compatible, is clover.trt's (re-exported here).

Precision. Every network is strongly typed: the tensor types are those of the ONNX graph, which
clover-export writes in the artifact's dtype (float32 / float16 / bfloat16 weights, activations and KV
cache, with its own explicit casts, e.g. RoPE in float32). TensorRT 11 only builds strongly typed networks
(it removed BuilderFlag.FP16 / BF16 and the other weak-typing flags); on 10.x we ask for the same with
NetworkDefinitionCreationFlag.STRONGLY_TYPED instead of BuilderFlag.FP16 / BF16, because weak typing
would let the builder run any layer in either precision (fp16 RMSNorm variance overflows) and would
ignore the graph's casts, so 10.x and 11.x engines and ONNX Runtime would compute different things.
TF32 is off (Polygraphy's default), so float32 layers compute in float32, as on ONNX Runtime.
  https://docs.nvidia.com/deeplearning/tensorrt/latest/api/migration/tensorrt-10x-to-11x-python-api-reference.html
  https://docs.nvidia.com/deeplearning/tensorrt/11.0.0/getting-started/release-notes-11/11.0.0.html

Profiles (TensorRT picks kernels for the `opt` shape and accepts anything in [min, max]):
    base          "prefill": new 1..max_prompt, rows 1 (the prefill wants the last token's logits only,
                  which saves a [prompt, V] output), past 0..max_context
                  "verify":  new 1..max_tree, rows 1..max_tree, past 0..max_context
    draft_begin   "draft": accepted 1..max(max_prompt, max_accepted) (the prefill's commit hands the
                  heads the whole prompt), past 0..max_context
    draft_step    "draft": candidates 1..max_candidates
    medusa_heads  "draft": accepted 1..max_accepted (the runtime passes the last accepted token only)
`past` is the number of cache *slots* bound, not the valid length: the runtime binds its preallocated
[B, Hkv, slots, D] buffers whole (a prefix view along the slot axis is not contiguous) and the graph
masks slots >= past_lengths; slots never exceed the sequence capacity, so max_context bounds it, and
0 slots are bound while the cache is empty (prefill), so prefill's attention reads no masked slots.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import IO, Any

from clover import atomic
from clover.artifact import EngineSpec, GraphSpec, ProfileSpec, TensorSpec
from clover.errors import CloverError
from clover.trt import FLOAT_DTYPES, ITEMSIZE, check_engine_compatible, device_info, parse_version, require_tensorrt

__all__ = [
    "EngineLimits",
    "dim_ranges",
    "profiles_for",
    "profile_sizes",
    "build_memory",
    "estimate_build_memory",
    "memory_note",
    "build_engines",
    "uses_plugin",
    "check_engine_compatible",
    "require_engine_builder",
    "network_loader",
    "config_loader",
    "engine_loader",
    "polygraphy_profiles",
]

Progress = Callable[[str], None]
Range = tuple[int, int, int]  # (min, opt, max) of one dim
ENGINES_DIR = "engines"
PLUGIN_OP_TYPE = "CloverTreeAttention"  # clover.plugins.onnx_node.OP_TYPE (that module imports torch)
DEFAULT_WORKSPACE_BYTES = 4 << 30  # tactic scratch memory the builder may use; TensorRT's default is the whole GPU
POLYGRAPHY_MISSING = (
    "Polygraphy is not installed: clover-export --backend trt builds engines with it "
    "(pip install -e '.[torch,gpu]' in an environment of its own, see docs/gpu.md)"
)


@dataclass(frozen=True)
class EngineLimits:
    """The largest shapes the engines accept (TensorRT fixes them at build time; ONNX Runtime does not).

    max_batch: sequences per call (the runtime runs one).
    max_prompt: longest prompt the prefill profile takes.
    max_tree: most tree nodes one verify step takes (the tree's num_nodes).
    max_context: most cached tokens, prompt + generated (the artifact's max_context).
    max_accepted: most tokens one verify step accepts (tree depth + 1).
    max_candidates: most tree nodes drafted at one depth (one draft_step call).
    """

    max_prompt: int
    max_tree: int
    max_context: int
    max_accepted: int
    max_candidates: int
    max_batch: int = 1

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_prompt", "max_tree", "max_context", "max_accepted", "max_candidates"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CloverError(f"TensorRT engine limit {name} must be a positive integer, got {value!r}")
        for small, big in (
            ("max_prompt", "max_context"),
            ("max_tree", "max_context"),
            ("max_accepted", "max_tree"),
            ("max_candidates", "max_tree"),
        ):
            if getattr(self, small) > getattr(self, big):
                raise CloverError(
                    f"TensorRT engine limit {small} ({getattr(self, small)}) exceeds {big} "
                    f"({getattr(self, big)}): lower {small.replace('_', '-')} or raise {big.replace('_', '-')}"
                )

    @classmethod
    def for_tree(
        cls, num_nodes: int, max_depth: int, widest_level: int, max_context: int, max_prompt: int | None = None
    ) -> EngineLimits:
        """Limits that fit one token tree (clover.runtime.tree.Tree: num_nodes, max_depth,
        max(len(level) for level in levels)); max_prompt defaults to min(max_context, 2048)."""
        return cls(
            max_prompt=max_prompt if max_prompt is not None else min(max_context, 2048),
            max_tree=num_nodes,
            max_context=max_context,
            max_accepted=max_depth + 1,
            max_candidates=widest_level,
        )


# -- profiles ---------------------------------------------------------------------------------------------


def dim_ranges(name: str, limits: EngineLimits) -> dict[str, dict[str, Range]]:
    """Per profile of graph `name`: dim name -> (min, opt, max). Opt is the shape each profile runs most:
    one sequence, a full tree, half the context (an average position over a long generation)."""
    L = limits
    batch = (1, 1, L.max_batch)
    past = (0, L.max_context // 2, L.max_context)
    if name == "base":
        return {
            "prefill": {
                "batch": batch,
                "new": (1, cdiv(L.max_prompt, 2), L.max_prompt),
                "rows": (1, 1, 1),
                "past": (0, 0, L.max_context),
            },  # a prompt meets an empty cache
            "verify": {
                "batch": batch,
                "new": (1, L.max_tree, L.max_tree),
                "rows": (1, L.max_tree, L.max_tree),
                "past": past,
            },
        }
    if name == "draft_begin":
        return {
            "draft": {"batch": batch, "accepted": (1, L.max_accepted, max(L.max_prompt, L.max_accepted)), "past": past}
        }
    if name == "draft_step":
        return {"draft": {"candidates": (1, L.max_candidates, L.max_candidates)}}
    if name == "medusa_heads":
        return {"draft": {"batch": batch, "accepted": (1, 1, L.max_accepted)}}
    raise CloverError(
        f"no TensorRT profiles are defined for graph {name!r}: expected base, draft_begin, draft_step "
        "or medusa_heads (this is a clover bug, please report it)"
    )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tensor_range(tensor: TensorSpec, dims: Mapping[str, Range], graph: str) -> tuple[tuple[int, ...], ...]:
    """(min shape, opt shape, max shape) of one tensor: static dims fixed, named dims from `dims`."""
    shapes: list[list[int]] = [[], [], []]
    for d in tensor.shape:
        if isinstance(d, str) and d not in dims:
            raise CloverError(
                f"graph {graph}: {tensor.name} has dynamic dim {d!r}, which has no TensorRT range "
                f"(known: {', '.join(dims)}): this is a clover-export bug, please report it"
            )
        lo, opt, hi = dims[d] if isinstance(d, str) else (int(d),) * 3
        for s, v in zip(shapes, (lo, opt, hi)):
            s.append(v)
    return tuple(tuple(s) for s in shapes)  # type: ignore[return-value]


def profiles_for(name: str, graph: GraphSpec, limits: EngineLimits) -> tuple[ProfileSpec, ...]:
    """The optimization profiles of graph `name`: a (min, opt, max) shape for every input with a
    dynamic dim (static inputs, e.g. draft_step's depth [], need none)."""
    out = []
    for profile, dims in dim_ranges(name, limits).items():
        shapes = {t.name: tensor_range(t, dims, name) for t in graph.inputs if any(isinstance(d, str) for d in t.shape)}
        out.append(ProfileSpec(profile, shapes))
    return tuple(out)


# -- memory estimate ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildMemory:
    weights: int  # bytes of the ONNX file and its external data
    io: int  # largest total of the graph's inputs + outputs at a profile's max shapes
    io_profile: str
    workspace: int

    @property
    def total(self) -> int:
        return self.weights + self.io + self.workspace


def profile_sizes(graph: GraphSpec, profile: ProfileSpec, which: int = 2) -> dict[str, int]:
    """Dim name -> size in a profile's min (0), opt (1) or max (2) shapes, read off the graph's inputs
    (every dim of an output also names an input dim)."""
    sizes: dict[str, int] = {}
    for tensor in graph.inputs:
        if tensor.name in profile.shapes:
            for d, v in zip(tensor.shape, profile.shapes[tensor.name][which]):
                if isinstance(d, str):
                    sizes[d] = v
    return sizes


def build_memory(
    root: Path, graph: GraphSpec, profiles: tuple[ProfileSpec, ...], workspace: int = DEFAULT_WORKSPACE_BYTES
) -> BuildMemory:
    """The terms of `estimate_build_memory`, for printing."""
    weights = sum((Path(root) / f).stat().st_size for f in (graph.file, *graph.external_data))
    best, best_profile = 0, ""
    for profile in profiles:
        sizes = profile_sizes(graph, profile)
        io = sum(tensor_bytes(t, sizes) for t in (*graph.inputs, *graph.outputs))
        if io > best:
            best, best_profile = io, profile.name
    return BuildMemory(weights, best, best_profile, int(workspace))


def estimate_build_memory(
    root: Path,
    graph: GraphSpec,
    profiles: tuple[ProfileSpec, ...],
    precision: str,
    workspace: int = DEFAULT_WORKSPACE_BYTES,
) -> int:
    """Bytes of GPU memory the build needs at least:

        weights (the ONNX file and its external data, already in `precision`; the builder holds a device copy)
      + the largest total of the graph's inputs and outputs at one profile's max shapes (KV cache in and
        out, logits, hidden states)
      + the workspace pool limit.

    Intermediate activations (e.g. attention scores) come on top and depend on the kernels TensorRT picks,
    so the real peak is higher: this is for a sanity print and a "will not fit" warning, not a guarantee.
    """
    check_precision(graph, precision)
    return build_memory(root, graph, profiles, workspace).total


def check_precision(graph: GraphSpec, precision: str) -> None:
    floats = sorted({t.dtype for t in (*graph.inputs, *graph.outputs) if t.dtype in FLOAT_DTYPES})
    if floats and floats != [precision]:
        raise CloverError(
            f"graph {graph.file} has {'/'.join(floats)} tensors, but engines are asked for in {precision}: "
            f"export with --dtype {precision} (TensorRT builds strongly typed engines in the graph's types)"
        )


def tensor_bytes(tensor: TensorSpec, sizes: Mapping[str, int]) -> int:
    return math.prod(sizes[d] if isinstance(d, str) else int(d) for d in tensor.shape) * ITEMSIZE[tensor.dtype]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def memory_note(name: str, m: BuildMemory) -> str:
    return (
        f"{name}: weights {human_bytes(m.weights)} + I/O at max shapes ({m.io_profile}) {human_bytes(m.io)} + "
        f"workspace {human_bytes(m.workspace)} = at least {human_bytes(m.total)} of GPU memory"
    )


# -- the loader chain ---------------------------------------------------------------------------------------


def require_engine_builder() -> ModuleType:
    """The tensorrt module once TensorRT and Polygraphy are both importable, else one CloverError line."""
    trt = require_tensorrt()
    try:
        import polygraphy.backend.trt  # noqa: F401
    except ImportError as e:
        raise CloverError(POLYGRAPHY_MISSING) from e
    return trt


def network_loader(onnx_path: Path, tensorrt_version: str) -> Any:
    """NetworkFromOnnxPath: parse_from_file, so the parser finds the graph's external data beside it. Strongly
    typed (module docstring): the flag on 10.x; 11.x networks always are, and deprecate the flag."""
    from polygraphy.backend.trt import NetworkFromOnnxPath

    return NetworkFromOnnxPath(str(onnx_path), strongly_typed=parse_version(tensorrt_version)[0] == 10)


def polygraphy_profiles(profiles: Sequence[ProfileSpec]) -> list[Any]:
    """One polygraphy Profile per ProfileSpec, in order (the runtime picks execution contexts by index)."""
    from polygraphy.backend.trt import Profile

    out = []
    for spec in profiles:
        profile = Profile()
        for name, (lo, opt, hi) in spec.shapes.items():
            profile.add(name, lo, opt, hi)
        out.append(profile)
    return out


def config_loader(
    trt: ModuleType,
    profiles: Sequence[ProfileSpec],
    workspace: int = DEFAULT_WORKSPACE_BYTES,
    timing_cache: Path | None = None,
    progress: Progress | None = None,
) -> Any:
    """CreateConfig: the profiles, the workspace pool limit, TF32 off, tactic timings loaded from
    `timing_cache` when that file exists (Polygraphy reads it under a lock file), and a progress monitor
    that reports the builder's top-level phases through `progress`."""
    from polygraphy.backend.trt import CreateConfig

    cache = str(timing_cache) if timing_cache is not None and Path(timing_cache).is_file() else None
    return CreateConfig(
        profiles=polygraphy_profiles(profiles),
        tf32=False,
        memory_pool_limits={trt.MemoryPoolType.WORKSPACE: int(workspace)},
        load_timing_cache=cache,
        progress_monitor=progress_monitor(trt, progress) if progress is not None else None,
    )


def engine_loader(
    trt: ModuleType,
    onnx_path: Path,
    profiles: Sequence[ProfileSpec],
    *,
    workspace: int = DEFAULT_WORKSPACE_BYTES,
    timing_cache: Path | None = None,
    save_timing_cache: IO[bytes] | None = None,
    progress: Progress | None = None,
) -> Any:
    """The loader chain of one engine, not yet run: EngineBytesFromNetwork(network_loader, config_loader).

    Args:
        trt: the tensorrt module (its version and enum members are read here; nothing is called).
        onnx_path: the graph; plugin graphs need clover.plugins.trt_plugin registered before the call.
        profiles: one optimization profile per ProfileSpec; a (min, opt, max) shape per dynamic input.
        workspace: limit of the builder's workspace memory pool, bytes.
        timing_cache: tactic timings loaded before the build, if the file exists.
        save_timing_cache: an open binary file (read + write) the build's timings are written into: the
            loaded ones plus the new ones (see build_engine).
        progress: called with one line per top-level builder phase.
    """
    from polygraphy.backend.trt import EngineBytesFromNetwork

    return EngineBytesFromNetwork(
        network_loader(onnx_path, trt.__version__),
        config_loader(trt, profiles, workspace, timing_cache, progress),
        save_timing_cache=save_timing_cache,
    )


def progress_monitor(trt: ModuleType, say: Progress) -> Any:
    """A trt.IProgressMonitor that reports top-level phases (nested ones are too chatty) through `say`.
    TensorRT calls it from several builder threads, hence the lock."""

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self._lock = threading.Lock()

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            if parent_phase is None:
                with self._lock:
                    say(f"      TensorRT: {phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name: str, step: int) -> bool:
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            pass

    return Monitor()


# -- building -----------------------------------------------------------------------------------------------


def build_engine(
    trt: ModuleType,
    onnx_path: Path,
    profiles: Sequence[ProfileSpec],
    timing_cache: Path | None,
    progress: Progress,
    workspace: int = DEFAULT_WORKSPACE_BYTES,
) -> bytes:
    """Run one engine's loader chain; its serialized engine.

    The timing cache is replaced atomically under a unique temporary name (clover.atomic), so exports that
    share it never read a half-written file or write into each other's: the last build to finish writes
    what it loaded plus what it timed (timings another export added meanwhile are re-measured later).
    Polygraphy's messages (TensorRT's warnings and errors among them) go to stderr, at WARNING and above.
    """
    from polygraphy.exception import PolygraphyException
    from polygraphy.logger import G_LOGGER

    with contextlib.ExitStack() as stack:
        cache_out = stack.enter_context(atomic.replacing(timing_cache, "w+b")) if timing_cache is not None else None
        stack.enter_context(G_LOGGER.verbosity(G_LOGGER.WARNING))
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))  # stdout is clover-export's result
        loader = engine_loader(
            trt,
            onnx_path,
            profiles,
            workspace=workspace,
            timing_cache=timing_cache,
            save_timing_cache=cache_out,
            progress=progress,
        )
        try:
            return bytes(loader())  # IHostMemory supports the buffer protocol
        except PolygraphyException as e:
            first = next((line for line in str(e).splitlines() if line.strip()), "no error reported")
            raise CloverError(
                f"TensorRT could not build an engine from {Path(onnx_path).name}: {first} (the log "
                "above says why); try a smaller --max-prompt / --max-context, or --backend onnx"
            ) from e


def build_engines(
    root: Path,
    graphs: Mapping[str, GraphSpec],
    precision: str,
    limits: EngineLimits,
    timing_cache: Path | None,
    progress: Progress,
    workspace: int = DEFAULT_WORKSPACE_BYTES,
) -> dict[str, EngineSpec]:
    """Build one engine per graph into root/engines/<name>.engine and describe each for the manifest.

    Args:
        root: the artifact folder being written (its ONNX graphs are read from there).
        graphs: Manifest.graphs (name -> GraphSpec).
        precision: the artifact's dtype; the graphs must be in it (engines are strongly typed).
        limits: the largest shapes the engines accept.
        timing_cache: tactic timing cache file, read and updated (None: no cache).
        progress: called with one line per step.
    """
    trt = require_engine_builder()
    device = device_info()
    say = progress
    engines = {}
    for i, (name, graph) in enumerate(graphs.items(), 1):
        profiles = profiles_for(name, graph, limits)
        say(
            f"[engine {i}/{len(graphs)}] {name}: TensorRT {trt.__version__} on {device.name} "
            f"(sm {device.compute_capability}), {precision}, profiles {', '.join(p.name for p in profiles)}"
        )
        check_precision(graph, precision)
        memory = build_memory(root, graph, profiles, workspace)
        say(f"      {memory_note(name, memory)}")
        if memory.total > device.free_memory:
            say(
                f"      warning: that is more than the {human_bytes(device.free_memory)} free on this GPU; the build "
                "may fail (lower --max-prompt / --max-context, or free the GPU)"
            )
        onnx_path = Path(root) / graph.file
        if uses_plugin(onnx_path):
            from clover.plugins.trt_plugin import register

            register()  # the parser looks plugin nodes up in the registry, so this comes first
        t0 = time.perf_counter()
        plan = build_engine(trt, onnx_path, profiles, timing_cache, say, workspace)
        rel = f"{ENGINES_DIR}/{name}.engine"
        atomic.write_bytes(Path(root) / rel, plan)
        say(f"      {rel}: {human_bytes(len(plan))} ({time.perf_counter() - t0:.1f} s)")
        engines[name] = EngineSpec(
            graph=name,
            file=rel,
            profiles=profiles,
            precision=precision,
            tensorrt_version=trt.__version__,
            device_name=device.name,
            compute_capability=device.compute_capability,
        )
    return engines


def uses_plugin(onnx_path: Path) -> bool:
    """Whether the graph has tree-attention plugin nodes (the `plugin` attention variant); reads the graph
    structure only, not its external data."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return any(node.op_type == PLUGIN_OP_TYPE for node in model.graph.node)
