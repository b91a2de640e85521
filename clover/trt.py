"""TensorRT, imported lazily, and what must agree between the machine that builds an engine and the one that
runs it. The bottom of the TensorRT import graph: clover.export (building), clover.plugins (the plugin)
and clover.runtime (running) all come here, and this module imports nothing of clover but clover.errors.

    trt = require_tensorrt()          # the module, or one CloverError line saying what to install
    check_engine_compatible(spec, trt.__version__, *device_facts)   # before TensorRT fails less helpfully

Importing this module needs neither TensorRT nor torch (docs/design.md, Conventions 7).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from clover.errors import CloverError

if TYPE_CHECKING:
    from clover.artifact import EngineSpec

SUPPORTED_MAJORS = (10, 11)
MISSING = (
    "TensorRT is not installed: clover-export --backend trt and the trt runtime backend need TensorRT 10.x or "
    "11.x and a CUDA GPU (pip install -e '.[torch,gpu]' in an environment of its own, see docs/gpu.md); "
    "use --backend onnx / --backend ort to run on ONNX Runtime"
)
# numpy dtype name -> trt.DataType member name, and bytes per element: the tensor types engines bind
TRT_DTYPES = {
    "float32": "FLOAT",
    "float16": "HALF",
    "bfloat16": "BF16",
    "int64": "INT64",
    "int32": "INT32",
    "bool": "BOOL",
    "int8": "INT8",
    "uint8": "UINT8",
}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1, "int8": 1, "uint8": 1}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


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
        raise CloverError(
            f"TensorRT {version} is installed, clover supports TensorRT "
            f"{' and '.join(f'{m}.x' for m in SUPPORTED_MAJORS)}: pip install 'tensorrt-cu13>=10.13.2,<12'"
        )
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
        raise CloverError(
            f"engine {spec.file} was built with TensorRT {built} but TensorRT {here} is installed: "
            f"{rebuild}, or install the TensorRT it was built with (pip install 'tensorrt=={built}.*')"
        )
    if spec.compute_capability != compute_capability or spec.device_name != device_name:
        raise CloverError(
            f"engine {spec.file} was built for {spec.device_name} (compute capability "
            f"{spec.compute_capability}) but this GPU is {device_name} (compute capability "
            f"{compute_capability}): {rebuild}"
        )


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
        raise CloverError(
            f"TensorRT needs a CUDA GPU, but torch sees {torch.cuda.device_count()} CUDA devices "
            f"(asked for device {device}): run on a GPU machine, or use --backend ort"
        )
    major, minor = torch.cuda.get_device_capability(device)
    free, _ = torch.cuda.mem_get_info(device)
    return DeviceInfo(torch.cuda.get_device_name(device), f"{major}.{minor}", int(free))


_LOGGER = None


def logger() -> Any:
    """The process's trt.Logger for the runtime (warnings and errors, on stderr). Engine builds go through
    Polygraphy, which logs TensorRT's messages through its own logger (clover.export.engines)."""
    global _LOGGER
    trt = require_tensorrt()
    if _LOGGER is None:
        _LOGGER = trt.Logger(trt.Logger.WARNING)
    return _LOGGER
