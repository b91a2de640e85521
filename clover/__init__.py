"""clover-deploy: Clover speculative decoding, exported and served.

Importing `clover` has no side effects and needs neither torch, onnxruntime nor TensorRT;
subpackages import heavy dependencies where they are used.
"""

import importlib

from clover.errors import CloverError

# the public API, imported on first use (numpy only; backends load lazily): name -> its module
_LAZY = {
    "Engine": "clover.runtime.engine",
    "EngineStream": "clover.runtime.engine",
    "Generator": "clover.runtime.generator",
    "GenerationResult": "clover.runtime.results",
    "GenerationParams": "clover.runtime.params",
    "EngineOptions": "clover.runtime.params",
    "DraftSource": "clover.runtime.params",
    "SamplingParams": "clover.runtime.sampling",
    "Grammar": "clover.runtime.grammar",
    "StreamDelta": "clover.runtime.results",
    "QueueFull": "clover.runtime.scheduler",
    "Cancelled": "clover.runtime.scheduler",
    "EngineUnavailable": "clover.runtime.scheduler",
}
__all__ = ["CloverError", *_LAZY]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'clover' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
