"""clover-deploy: Clover speculative decoding, exported and served.

Importing `clover` has no side effects and needs neither torch, onnxruntime nor TensorRT;
subpackages import heavy dependencies where they are used.
"""

from clover.errors import CloverError

__all__ = ["CloverError"]
__version__ = "0.1.0"
