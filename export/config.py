"""`ExportConfig`: what `clover-export` makes, as one typed, frozen object (STYLE.md 1)."""

from __future__ import annotations

from dataclasses import dataclass

from clover.errors import CloverError

BACKENDS = ("onnx",)
DTYPES = ("float32", "float16")
ATTENTION = ("portable",)
OPSETS = range(18, 24)  # torchlib implements 18+; 23 is the newest torch.onnx targets
DEFAULT_OPSET = 20  # torch.onnx's default; TensorRT 10's parser and onnxruntime >= 1.17 read it


@dataclass(frozen=True)
class ExportConfig:
    """Args:
    backend: "onnx" (TensorRT engines come later).
    dtype: precision of the weights, activations and KV cache in the graphs.
    attention: "portable": standard ONNX ops with an explicit mask (DESIGN.md).
    opset: default-domain ONNX opset.
    tree: default token tree recorded in the manifest (any tree runs on ONNX Runtime: the tree dims are
      dynamic); None: mc26, pruned to the heads' depth.
    max_context: longest sequence (prompt + generated) the artifact serves; None: the base's
      max_position_embeddings.
    verify: run every graph once on ONNX Runtime against PyTorch and record the max abs error.
    """

    backend: str = "onnx"
    dtype: str = "float32"
    attention: str = "portable"
    opset: int = DEFAULT_OPSET
    tree: str | None = None
    max_context: int | None = None
    verify: bool = True

    def __post_init__(self) -> None:
        if self.backend in ("trt", "tensorrt"):
            raise CloverError(
                "TensorRT engines are not supported by clover-export yet: use --backend onnx and run the "
                "artifact with ONNX Runtime (clover-generate --artifact DIR --backend ort)"
            )
        if self.backend not in BACKENDS:
            raise CloverError(f"unknown export backend {self.backend!r}: use one of {', '.join(BACKENDS)}")
        if self.dtype not in DTYPES:
            raise CloverError(f"unsupported export dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.attention not in ATTENTION:
            raise CloverError(f"unknown attention variant {self.attention!r}: use one of {', '.join(ATTENTION)}")
        if self.opset not in OPSETS:
            raise CloverError(f"opset {self.opset} is not supported: use {OPSETS.start}..{OPSETS.stop - 1}")
        if self.max_context is not None and self.max_context < 2:
            raise CloverError(
                f"--max-context must be at least 2 (one prompt and one generated token), got {self.max_context}")
