"""The one module that calls TensorRT's builder and runtime API (TensorRT 10.x and 11.x).

    trt = require_tensorrt()                                   # or one clear CloverError line
    plan = build_serialized_engine(onnx_path, profiles, "float16", timing_cache_path, progress)
    engine = deserialize_engine(path)
    ctx = create_context(engine, profile_index, stream_handle)
    run_context(ctx, shapes, addresses, stream_handle)

`tensorrt` is imported lazily (STYLE.md 7): importing clover, its runtime core or this module needs no
TensorRT. Everything else in the project reaches TensorRT through these functions, so a TensorRT API
change is fixed here once.

Precision. Every network is strongly typed: the tensor types are those of the ONNX graph, which
clover-export writes in the artifact's dtype (float32 / float16 / bfloat16 weights, activations and KV
cache, with its own explicit casts, e.g. RoPE in float32). TensorRT 11 only builds strongly typed networks
(it removed BuilderFlag.FP16 / BF16 and the other weak-typing flags); on 10.x we ask for the same with
NetworkDefinitionCreationFlag.STRONGLY_TYPED instead of BuilderFlag.FP16 / BF16, because weak typing
would let the builder run any layer in either precision (fp16 RMSNorm variance overflows) and would
ignore the graph's casts, so 10.x and 11.x engines and ONNX Runtime would compute different things.
  https://docs.nvidia.com/deeplearning/tensorrt/latest/api/migration/tensorrt-10x-to-11x-python-api-reference.html
  https://docs.nvidia.com/deeplearning/tensorrt/11.0.0/getting-started/release-notes-11/11.0.0.html
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from clover.errors import CloverError
from clover.artifact import EngineSpec, ProfileSpec

SUPPORTED_MAJORS = (10, 11)
DEFAULT_WORKSPACE_BYTES = 4 << 30  # tactic scratch memory the builder may use; TensorRT's default is the whole GPU
MISSING = ("TensorRT is not installed: clover-export --backend trt and the trt runtime backend need TensorRT 10.x or "
           "11.x and a CUDA GPU (pip install tensorrt on a machine with NVIDIA's index); use --backend onnx / "
           "--backend ort to run on ONNX Runtime")
# numpy dtype name -> trt.DataType member name
TRT_DTYPES = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BF16", "int64": "INT64", "int32": "INT32",
              "bool": "BOOL", "int8": "INT8", "uint8": "UINT8"}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1, "int8": 1, "uint8": 1}


# -- import and version ---------------------------------------------------------------------------------

def require_tensorrt() -> ModuleType:
    """The `tensorrt` module, or a CloverError saying what to install (also for an unsupported version)."""
    try:
        import tensorrt
    except ImportError as e:
        raise CloverError(MISSING) from e
    check_version(tensorrt.__version__)
    return tensorrt


def parse_version(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a TensorRT version string such as "10.7.0.post1" or "11.1.0.12"."""
    m = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise CloverError(f"cannot read the TensorRT version {version!r}: expected MAJOR.MINOR.PATCH, e.g. 10.13.0")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def check_version(version: str) -> tuple[int, int, int]:
    v = parse_version(version)
    if v[0] not in SUPPORTED_MAJORS:
        raise CloverError(f"TensorRT {version} is installed, clover supports TensorRT "
                          f"{' and '.join(f'{m}.x' for m in SUPPORTED_MAJORS)}: pip install 'tensorrt>=10,<12'")
    return v


def same_engine_version(a: str, b: str) -> bool:
    """Engines load only in the TensorRT release that built them (major.minor.patch; we do not build
    version-compatible "lean runtime" engines)."""
    return parse_version(a) == parse_version(b)


def check_engine_compatible(spec: EngineSpec, tensorrt_version: str, device_name: str, compute_capability: str) -> None:
    """An engine runs only with the TensorRT release and on the GPU model it was built for: say which of
    these differs here, before TensorRT fails on it with a less helpful message."""
    rebuild = "rebuild the engines on this machine with clover-export --backend trt"
    if not same_engine_version(spec.tensorrt_version, tensorrt_version):
        built = ".".join(map(str, parse_version(spec.tensorrt_version)))
        here = ".".join(map(str, parse_version(tensorrt_version)))
        raise CloverError(f"engine {spec.file} was built with TensorRT {built} but TensorRT {here} is installed: "
                          f"{rebuild}, or install the TensorRT it was built with (pip install 'tensorrt=={built}.*')")
    if spec.compute_capability != compute_capability or spec.device_name != device_name:
        raise CloverError(f"engine {spec.file} was built for {spec.device_name} (compute capability "
                          f"{spec.compute_capability}) but this GPU is {device_name} (compute capability "
                          f"{compute_capability}): {rebuild}")


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # e.g. "NVIDIA H100 80GB HBM3"
    compute_capability: str  # "9.0"
    free_memory: int  # bytes free on the device when asked


def device_info(device: int = 0) -> DeviceInfo:
    """Name and compute capability of a CUDA device, through torch (on every machine that builds or runs
    engines; cuda-python would be one more dependency for two numbers)."""
    try:
        import torch
    except ImportError as e:
        raise CloverError("TensorRT engines need torch with CUDA here (pip install torch from the CUDA index)") from e
    if not torch.cuda.is_available() or device >= torch.cuda.device_count():
        raise CloverError(f"TensorRT needs a CUDA GPU, but torch sees {torch.cuda.device_count()} CUDA devices "
                          f"(asked for device {device}): run on a GPU machine, or use --backend ort")
    major, minor = torch.cuda.get_device_capability(device)
    free, _ = torch.cuda.mem_get_info(device)
    return DeviceInfo(torch.cuda.get_device_name(device), f"{major}.{minor}", int(free))


_LOGGER = None
_RUNTIME = None  # engines must not outlive the runtime that deserialized them: keep one for the process


def logger():
    """One trt.Logger per process (TensorRT expects the builder and the runtime to share it)."""
    global _LOGGER
    trt = require_tensorrt()
    if _LOGGER is None:
        _LOGGER = trt.Logger(trt.Logger.WARNING)
    return _LOGGER


# -- building ------------------------------------------------------------------------------------------

def build_serialized_engine(onnx_path: Path, profiles: Sequence[ProfileSpec], precision: str,
                            timing_cache_path: Path | None = None, progress: Callable[[str], None] | None = None,
                            workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, plugins: bool = False) -> bytes:
    """Parse an ONNX file (external data beside it) and build a serialized engine with one optimization
    profile per ProfileSpec, in that order.

    Args:
        onnx_path: the graph; parse_from_file so the parser finds its external-data files.
        profiles: (min, opt, max) shape per dynamic input; every dynamic input must be covered.
        precision: the float dtype the graph was exported in (checked against its float inputs).
        timing_cache_path: tactic timings loaded before and merged back after the build (None: no cache).
        progress: called with one line per top-level builder phase.
        workspace_bytes: limit of the builder's workspace memory pool.
        plugins: register clover's TensorRT plugins (tree attention) before parsing.
    """
    trt = require_tensorrt()
    if plugins:
        from clover.plugins.trt_plugin import register

        register()  # the parser looks nodes up in the plugin registry, so this comes first
    builder = trt.Builder(logger())
    network = builder.create_network(network_flags(trt, plugins))
    parser = trt.OnnxParser(network, logger())
    # parse_from_file (not parse(bytes)): the parser resolves external-data locations relative to the file.
    # https://docs.nvidia.com/deeplearning/tensorrt/latest/_static/python-api/parsers/Onnx/pyOnnx.html
    if not parser.parse_from_file(str(onnx_path)) or parser.num_errors:
        first = str(parser.get_error(0)).strip().splitlines()[0] if parser.num_errors else "no error reported"
        raise CloverError(f"TensorRT cannot parse {Path(onnx_path).name}: {first} ({parser.num_errors} errors)")
    check_network_inputs(trt, network, profiles, precision, Path(onnx_path).name)

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    if precision == "float32" and hasattr(trt.BuilderFlag, "TF32"):
        # TF32 matmuls are on by default; float32 engines must match ONNX Runtime float32 (DESIGN.md parity).
        config.clear_flag(trt.BuilderFlag.TF32)
    for spec in profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in spec.shapes.items():
            profile.set_shape(name, lo, opt, hi)
        if config.add_optimization_profile(profile) < 0:
            raise CloverError(f"TensorRT rejected optimization profile {spec.name} of {Path(onnx_path).name}: "
                              f"{spec.shapes}")
    cache = load_timing_cache(config, timing_cache_path)
    monitor = progress_monitor(trt, progress) if progress is not None else None
    if monitor is not None:
        config.progress_monitor = monitor  # must outlive the build: `monitor` is referenced until we return
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise CloverError(f"TensorRT could not build an engine from {Path(onnx_path).name} (its log above says why); "
                          "try a smaller --max-prompt / --max-context, or --backend onnx")
    if timing_cache_path is not None:
        save_timing_cache(config, cache, Path(timing_cache_path))
    return bytes(plan)  # IHostMemory supports the buffer protocol


def network_flags(trt: ModuleType, plugins: bool) -> int:
    """Strongly typed network (see the module docstring); AOT plugin implementations preferred."""
    flags = 0
    major = parse_version(trt.__version__)[0]
    if major == 10:
        # https://docs.nvidia.com/deeplearning/tensorrt/latest/_static/python-api/infer/Core/Builder.html
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    # 11.x: always strongly typed; the flag is kept only for API compatibility and ignored.
    if plugins and hasattr(trt.NetworkDefinitionCreationFlag, "PREFER_AOT_PYTHON_PLUGINS"):
        # Our plugin defines both a JIT (@trtp.impl) and an AOT (@trtp.aot_impl) implementation; with both,
        # the ONNX parser needs this flag (or an `aot` node attribute) to choose, and AOT engines run
        # without Python callbacks. samples/python/quickly_deployable_plugins/README.md
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS)
    return flags


def check_network_inputs(trt: ModuleType, network: Any, profiles: Sequence[ProfileSpec], precision: str,
                         what: str) -> None:
    """Every dynamic input has a shape in every profile, and float inputs are in `precision`."""
    want = getattr(trt.DataType, TRT_DTYPES[precision])
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        if -1 in tuple(tensor.shape):
            missing = [p.name for p in profiles if tensor.name not in p.shapes]
            if missing:
                raise CloverError(f"{what}: dynamic input {tensor.name} {tuple(tensor.shape)} has no shape in "
                                  f"profile(s) {', '.join(missing)}: this is a clover-export bug, please report it")
        if tensor.dtype in (trt.DataType.FLOAT, trt.DataType.HALF, trt.DataType.BF16) and tensor.dtype != want:
            raise CloverError(f"{what}: input {tensor.name} is {tensor.dtype}, but engines are asked for in {precision}: "
                              f"export the graphs with --dtype {precision}")


def load_timing_cache(config: Any, path: Path | None) -> Any:
    """A timing cache filled from `path` if it holds one, else empty; attached to `config`. A cache from
    another TensorRT version or GPU is ignored (rebuilt), not an error."""
    data = b""
    if path is not None and Path(path).is_file():
        data = Path(path).read_bytes()
    try:
        cache = config.create_timing_cache(data)
    except Exception:  # TensorRT raises its own error types for a corrupt or foreign cache
        cache = config.create_timing_cache(b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    return cache


def save_timing_cache(config: Any, cache: Any, path: Path) -> None:
    """Merge the build's timings into the file's cache (others may have written it since) and write it
    atomically (temp file + rename)."""
    current = config.get_timing_cache() or cache
    if path.is_file():
        try:
            current.combine(config.create_timing_cache(path.read_bytes()), ignore_mismatch=True)
        except Exception:  # a foreign or corrupt file is replaced by this build's cache
            pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(bytes(current.serialize()))
    tmp.replace(path)


def progress_monitor(trt: ModuleType, say: Callable[[str], None]) -> Any:
    """A trt.IProgressMonitor that reports top-level phases (nested ones are too chatty) through `say`.
    TensorRT calls it from several builder threads, hence the lock."""
    if not hasattr(trt, "IProgressMonitor"):
        return None

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self._lock = threading.Lock()
            self._steps: dict[str, int] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            if parent_phase is None:
                with self._lock:
                    self._steps[phase_name] = num_steps
                say(f"      TensorRT: {phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name: str, step: int) -> bool:
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            with self._lock:
                self._steps.pop(phase_name, None)

    return Monitor()


# -- running ----------------------------------------------------------------------------------------------

def deserialize_engine(path: Path) -> Any:
    """An ICudaEngine from a plan file (check its EngineSpec against this machine first)."""
    global _RUNTIME
    trt = require_tensorrt()
    if _RUNTIME is None:
        _RUNTIME = trt.Runtime(logger())
    engine = _RUNTIME.deserialize_cuda_engine(Path(path).read_bytes())
    if engine is None:
        raise CloverError(f"TensorRT {trt.__version__} cannot load the engine {path} (its log above says why): "
                          "rebuild it with clover-export --backend trt on this machine")
    return engine


def engine_io(engine: Any) -> dict[str, tuple[bool, str]]:
    """name -> (is_input, numpy dtype name) of every I/O tensor of an engine."""
    trt = require_tensorrt()
    names = {getattr(trt.DataType, v): k for k, v in TRT_DTYPES.items() if hasattr(trt.DataType, v)}
    out = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        dtype = engine.get_tensor_dtype(name)
        out[name] = (engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT, names.get(dtype, str(dtype)))
    return out


def create_context(engine: Any, profile: int, stream: int) -> Any:
    """An execution context bound to optimization profile `profile` for its whole life.

    ON_PROFILE_CHANGE sizes the context's activation memory for its own profile instead of the largest
    profile (STATIC, the default), so a verify context does not reserve prefill-sized scratch.
    https://docs.nvidia.com/deeplearning/tensorrt/latest/_static/python-api/infer/Core/Engine.html
    """
    trt = require_tensorrt()
    strategy = getattr(getattr(trt, "ExecutionContextAllocationStrategy", None), "ON_PROFILE_CHANGE", None)
    context = engine.create_execution_context(strategy) if strategy is not None else engine.create_execution_context()
    if context is None:
        raise CloverError("TensorRT could not create an execution context (out of GPU memory?)")
    # Asynchronous: later work on `stream` sees the new profile, nothing else needs to wait.
    if not context.set_optimization_profile_async(profile, stream):
        raise CloverError(f"TensorRT could not select optimization profile {profile} "
                          f"(the engine has {engine.num_optimization_profiles})")
    return context


def run_context(context: Any, shapes: Mapping[str, tuple[int, ...]], addresses: Mapping[str, int], stream: int) -> None:
    """Set input shapes (`shapes`: the inputs with dynamic dims) and every tensor's device address, then
    enqueue the engine on `stream` (execute_async_v3: the only enqueue API in TensorRT 10 and 11).
    Addresses must stay valid until the stream has run the engine."""
    for name, shape in shapes.items():
        if not context.set_input_shape(name, tuple(shape)):
            raise CloverError(f"TensorRT rejected shape {tuple(shape)} for input {name}: it is outside the "
                              "engine's optimization profile")
    for name, address in addresses.items():
        if not context.set_tensor_address(name, int(address)):
            raise CloverError(f"TensorRT rejected the device address of tensor {name}")
    if not context.execute_async_v3(stream):
        raise CloverError("TensorRT failed to enqueue the engine (its log above says why)")
