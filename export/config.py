"""`ExportConfig`: what `clover-export` makes, as one typed, frozen object (docs/design.md, Conventions 1)."""

from __future__ import annotations

from dataclasses import dataclass

from clover.errors import CloverError
from clover.models.config import BaseConfig

BACKENDS = ("onnx", "trt")
DTYPES = ("float32", "float16", "bfloat16")
ATTENTION = ("portable", "plugin", "fused")
DRAFT_QUANT = ("int8", "int4")  # MatMulNBits schemes of the draft graphs only (clover-export --draft-quant)
WEIGHTS = ("int8", "int4")  # weight-only MatMulNBits schemes (clover-export --weights)
# clover-export --quant: the quantizers and what each can write (export/quantize.py; kept here, import-free)
QUANTIZERS = ("rtn", "hqq", "gptq", "kquant")
QUANTIZER_SCHEMES = {"rtn": ("int8", "int4"), "hqq": ("int4",), "kquant": ("int8", "int4"), "gptq": ("int4",)}
SYMMETRIC_QUANTIZERS = ("rtn", "gptq")  # hqq and kquant always store a zero point per block
CALIBRATION_SEQUENCES = 32  # --quant gptq: default --calibration-sequences
# --weights' defaults, chosen from benchmarks/quality.py's front (docs/export.md, "Choosing the defaults"): per scheme
# the quantizer, its block size and whether blocks are symmetric
DEFAULT_QUANT = {"int4": ("rtn", 32, True), "int8": ("rtn", 32, True)}
MAX_CALIBRATION_SEQUENCES = 512
FUSED_HEAD_MULTIPLE = 16  # ONNX Runtime's GroupQueryAttention runs head sizes that are multiples of 16
OPSETS = range(18, 24)  # torchlib implements 18+; 23 is the newest torch.onnx targets
DEFAULT_OPSET = 20  # torch.onnx's default; TensorRT 10's parser and onnxruntime >= 1.17 read it


@dataclass(frozen=True)
class ExportConfig:
    """Args:
    backend: "onnx": ONNX graphs (ONNX Runtime runs them); "trt": the same graphs plus TensorRT engines
      built from them (needs TensorRT and a CUDA GPU at export time).
    dtype: precision of the weights, activations and KV cache in the graphs; TensorRT builds strongly
      typed engines in this precision. bfloat16 is for TensorRT (ONNX Runtime's CPU provider lacks
      bf16 kernels, so its export-time check is the ONNX checker only).
    attention: "portable": standard ONNX ops with an explicit mask; "plugin": one tree-attention node
      per decoder layer for the TensorRT plugin (docs/design.md). Same graph inputs and outputs. "fused": the
      base written as ONNX Runtime's fused CPU operators (GroupQueryAttention writing the KV cache in
      place, SkipSimplifiedLayerNormalization; export/fused_graph.py): ONNX Runtime only, float32.
    opset: default-domain ONNX opset.
    tree: default token tree recorded in the manifest (any tree runs on ONNX Runtime: the tree dims are
      dynamic); None: ONNX artifacts with heads time the candidate trees on their graphs and record the
      fastest (export/tree_timing.py); TensorRT and plugin exports record mc26, pruned to the heads' depth.
    max_context: longest sequence (prompt + generated) the artifact serves; None: the base's
      max_position_embeddings.
    max_prompt: longest prompt the TensorRT prefill profile accepts; None: min(max_context, 2048).
    timing_cache: TensorRT timing cache file reused across builds (None: the user cache folder).
    draft_quant: "int8" | "int4": the draft graphs' linears as blockwise MatMulNBits (their LM head: a quantized
      copy of the base's, draft_lm_head.onnx); the base graph keeps `dtype`, so the output is unchanged. None:
      the draft graphs in `dtype`.
    weights: "int8" | "int4": every linear of every graph (the LM head included; for int4 the token
      embedding too) as ONNX Runtime's blockwise MatMulNBits / GatherBlockQuantized. The output changes
      with the weights: losslessness is against plain decoding of this graph.
    block_size: input channels per quantization block (a power of two, >= 16) with `weights`.
    quant: which onnxruntime quantizer rounds the base graph's weights with `weights` (export/quantize.py): "rtn"
      (round to nearest), "hqq", "gptq" (calibrated: export_artifact's `calibration`), "kquant"; None: "rtn".
    symmetric: `weights` blocks without a zero point (rtn, gptq); False: a zero point per block.
    calibration_sequences: --quant gptq: how many calibration sequences (of at most CALIBRATION_TOKENS tokens)
      it reads; its time grows with them.
    verify: run every graph once on ONNX Runtime against PyTorch and record the max abs error.
    max_batch: (--attention fused) sequences the batched base graph (base_batch.onnx) runs in one forward, for
      clover.Engine and clover-serve; 1: no batched graph.
    shared_lm_head: (backend "onnx", float32, with heads) cut the LM head out of the base and the draft graphs
      into one lm_head.onnx, in memory once (export/lm_head.py). False: each graph keeps its own, as the graphs
      of TensorRT artifacts do.
    draft_vocab: K: the heads draft over the K tokens the base emits most often (export/draft_vocab.py; needs
      the shared LM head and token counts); None: over the whole vocabulary.
    """

    backend: str = "onnx"
    dtype: str = "float32"
    attention: str = "portable"
    opset: int = DEFAULT_OPSET
    tree: str | None = None
    max_context: int | None = None
    max_prompt: int | None = None
    timing_cache: str | None = None
    draft_quant: str | None = None
    weights: str | None = None
    block_size: int | None = None
    quant: str | None = None
    symmetric: bool | None = None
    calibration_sequences: int = CALIBRATION_SEQUENCES
    verify: bool = True
    shared_lm_head: bool = True
    max_batch: int = 8
    draft_vocab: int | None = None

    def __post_init__(self) -> None:
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
                f"--max-context must be at least 2 (one prompt and one generated token), got {self.max_context}"
            )
        if self.max_prompt is not None and self.max_prompt < 1:
            raise CloverError(f"--max-prompt must be at least 1 token, got {self.max_prompt}")
        if self.draft_quant is not None:
            if self.draft_quant not in DRAFT_QUANT:
                raise CloverError(f"unknown --draft-quant {self.draft_quant!r}: use one of {', '.join(DRAFT_QUANT)}")
            if self.backend != "onnx" or self.dtype != "float32":
                raise CloverError(
                    f"--draft-quant {self.draft_quant} quantizes float32 draft graphs for ONNX Runtime: use it with "
                    "--backend onnx --dtype float32 (TensorRT engines take --dtype float16/bfloat16)"
                )
        if self.attention == "fused" and (self.backend != "onnx" or self.dtype != "float32"):
            raise CloverError(
                "--attention fused writes ONNX Runtime's CPU operators: use it with --backend onnx "
                "--dtype float32 (TensorRT takes --attention portable or plugin)"
            )
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or not 1 <= self.max_batch <= 64:
            raise CloverError(f"--max-batch must be an int in 1..64 (sequences per forward), got {self.max_batch!r}")
        if self.weights is not None:
            if self.weights not in WEIGHTS:
                raise CloverError(f"unknown --weights {self.weights!r}: use one of {', '.join(WEIGHTS)}")
            if self.backend != "onnx" or self.dtype != "float32" or self.attention == "plugin":
                raise CloverError(
                    f"--weights {self.weights} quantizes float32 graphs for ONNX Runtime: use it with "
                    "--backend onnx --dtype float32 and --attention fused or portable"
                )
            if self.draft_quant is not None:
                raise CloverError(f"--weights {self.weights} already quantizes the draft graphs: drop --draft-quant")
        self.check_quantizer()
        b = self.block
        if isinstance(b, bool) or not isinstance(b, int) or b < 16 or b & (b - 1):
            raise CloverError(f"--block-size must be a power of two >= 16 (ONNX Runtime's MatMulNBits), got {b!r}")
        if self.draft_vocab is not None:
            if isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int) or self.draft_vocab < 64:
                raise CloverError(
                    f"--draft-vocab must be an int >= 64 (tokens the heads draft over), got {self.draft_vocab!r}"
                )
            if self.backend != "onnx" or self.dtype != "float32" or not self.shared_lm_head:
                raise CloverError(
                    "--draft-vocab cuts the shared LM head of float32 ONNX Runtime artifacts: use it "
                    "with --backend onnx --dtype float32"
                )
        if self.backend == "onnx" and self.max_prompt is not None:
            raise CloverError(
                "--max-prompt sizes TensorRT's prefill profile: use it with --backend trt "
                "(ONNX Runtime takes any prompt length up to --max-context)"
            )

    def _default(self, i: int):
        return DEFAULT_QUANT.get(self.weights, DEFAULT_QUANT["int4"])[i]

    @property
    def quantizer(self) -> str:
        """The quantizer of the base graph's weights (with `weights`): `quant`, else the scheme's default."""
        return self.quant or self._default(0)

    @property
    def block(self) -> int:
        """Input channels per block (with `weights`): `block_size`, else the scheme's default."""
        return self.block_size if self.block_size is not None else self._default(1)

    @property
    def is_symmetric(self) -> bool:
        """Blocks without a zero point: `symmetric`, else the scheme's default (when the quantizer is it too)."""
        if self.symmetric is not None:
            return self.symmetric
        return self._default(2) and self.quant in (None, self._default(0))

    def check_quantizer(self) -> None:
        """--quant / --symmetric / --calibration-sequences: only with --weights, and only what the quantizer writes."""
        if self.weights is None:
            given = [f for f, on in (("--quant", self.quant is not None), ("--symmetric", self.symmetric)) if on]
            if given:
                raise CloverError(
                    f"{' and '.join(given)} choose how --weights rounds the weights: add --weights int4 (or int8), "
                    f"or drop {' and '.join(given)}"
                )
            return
        if self.quant is not None and self.quant not in QUANTIZERS:
            raise CloverError(f"unknown --quant {self.quant!r}: use one of {', '.join(QUANTIZERS)}")
        q = self.quantizer
        if self.weights not in QUANTIZER_SCHEMES[q]:
            can = [n for n in QUANTIZERS if self.weights in QUANTIZER_SCHEMES[n]]
            why = {
                "hqq": "its float zero points have no 8-bit MatMulNBits kernel on CPU",
                "gptq": "at 8 bits onnxruntime keeps the rounded weights as float32 MatMuls",
            }[q]
            raise CloverError(
                f"--quant {q} writes {' and '.join(QUANTIZER_SCHEMES[q])} weights only ({why}): use --weights int4, "
                f"or for --weights {self.weights} --quant {' or '.join(can)}"
            )
        if self.symmetric and q not in SYMMETRIC_QUANTIZERS:
            raise CloverError(
                f"--quant {q} always stores a zero point per block: drop --symmetric, or use --quant "
                f"{' or '.join(SYMMETRIC_QUANTIZERS)} with it"
            )
        n = self.calibration_sequences
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CALIBRATION_SEQUENCES:
            raise CloverError(f"--calibration-sequences must be an int in 1..{MAX_CALIBRATION_SEQUENCES}, got {n!r}")

    def check_base(self, base: BaseConfig) -> None:
        """The checks that need the base's config.json alone: the attention variants its family and shapes allow
        (before minutes of loading a large base)."""
        if self.attention == "fused" and (why := fused_refusal(base)) is not None:
            raise CloverError(f"--attention fused cannot write this base ({why}): export it with --attention portable")


def fused_refusal(base: BaseConfig) -> str | None:
    """Why the fused CPU graph (export/fused_graph.py) cannot write `base`, or None when it can: it has no sliding
    window, and ONNX Runtime's GroupQueryAttention needs head sizes that are multiples of 16."""
    if base.sliding_window is not None:
        return (
            f"it has no sliding window, and this {base.architecture} attends through a {base.sliding_window}-token one"
        )
    if base.sandwich_norms:
        return (
            f"it writes Llama's layers, and this {base.architecture} has Gemma's scaled embedding, 1 + w norms around "
            "each sublayer, GELU MLP and soft-capping"
        )
    if base.post_norms or base.qk_norm == "projection":
        return (
            f"it writes layers that norm their inputs, and this {base.architecture} norms its sublayers' outputs and "
            "its whole query and key projections"
        )
    if base.rotary_dim is not None:
        return (
            f"its attention rotates whole heads, and this {base.architecture} rotates {base.rotary_dim} of each head's "
            f"{base.head_dim} dims"
        )
    if base.head_dim % FUSED_HEAD_MULTIPLE:
        return (
            f"ONNX Runtime's GroupQueryAttention runs head sizes that are multiples of {FUSED_HEAD_MULTIPLE}, and this "
            f"{base.architecture}'s heads are {base.head_dim} wide"
        )
    return None
