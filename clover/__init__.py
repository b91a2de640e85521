"""clover-deploy: Clover speculative decoding, exported and served.

Importing `clover` has no side effects and needs neither torch, onnxruntime nor TensorRT;
subpackages import heavy dependencies where they are used.
"""

from clover.errors import CloverError

__all__ = ["CloverError", "Engine", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`clover.Engine` and `clover.SamplingParams`, imported on first use (numpy only; backends load lazily)."""
    if name == "Engine":
        from clover.runtime.engine import Engine

        return Engine
    if name == "SamplingParams":
        from clover.runtime.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'clover' has no attribute {name!r}")
