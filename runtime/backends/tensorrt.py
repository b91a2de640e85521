"""Running TensorRT engines (TensorRT 10.x and 11.x): the runtime's only TensorRT calls. Engines are built
by clover.export.engines (Polygraphy); this module only loads and runs them.

    engine = deserialize_engine(path)
    ctx = create_context(engine, profile_index, stream_handle)
    run_context(ctx, shapes, addresses, stream_handle)

`tensorrt` is imported lazily through clover.trt (docs/design.md, Conventions 7): importing this module needs no
TensorRT.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from clover.errors import CloverError
from clover.trt import TRT_DTYPES, logger, require_tensorrt

_RUNTIME = None  # engines must not outlive the runtime that deserialized them: keep one for the process


def deserialize_engine(path: Path) -> Any:
    """An ICudaEngine from a plan file (check its EngineSpec against this machine first)."""
    global _RUNTIME
    trt = require_tensorrt()
    if _RUNTIME is None:
        _RUNTIME = trt.Runtime(logger())
    engine = _RUNTIME.deserialize_cuda_engine(Path(path).read_bytes())
    if engine is None:
        raise CloverError(
            f"TensorRT {trt.__version__} cannot load the engine {path} (its log above says why): "
            "rebuild it with clover-export --backend trt on this machine"
        )
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
        raise CloverError(
            f"TensorRT could not select optimization profile {profile} "
            f"(the engine has {engine.num_optimization_profiles})"
        )
    return context


def run_context(context: Any, shapes: Mapping[str, tuple[int, ...]], addresses: Mapping[str, int], stream: int) -> None:
    """Set input shapes (`shapes`: the inputs with dynamic dims) and every tensor's device address, then
    enqueue the engine on `stream` (execute_async_v3: the only enqueue API in TensorRT 10 and 11).
    Addresses must stay valid until the stream has run the engine."""
    for name, shape in shapes.items():
        if not context.set_input_shape(name, tuple(shape)):
            raise CloverError(
                f"TensorRT rejected shape {tuple(shape)} for input {name}: it is outside the "
                "engine's optimization profile"
            )
    for name, address in addresses.items():
        if not context.set_tensor_address(name, int(address)):
            raise CloverError(f"TensorRT rejected the device address of tensor {name}")
    if not context.execute_async_v3(stream):
        raise CloverError("TensorRT failed to enqueue the engine (its log above says why)")
