"""Tiny exported artifacts shared by the export and ONNX Runtime tests.

Exporting takes seconds per graph, so each artifact is built once per test session: `tiny_artifact`
writes into a folder under the session's base temp dir and returns it as is when it is already there.
`tiny_modules` rebuilds the exact PyTorch modules an artifact was exported from, as the reference.
"""

from __future__ import annotations

from pathlib import Path


from clover.export.artifact import artifact_from_modules
from clover.export.config import ExportConfig
from clover.models.decoder import Decoder, rope_inv_freq
from clover.models.head_io import random_heads
from clover.models.heads import DraftHeads
from clover.runtime.artifact import MANIFEST_FILE
from helpers import tiny_base, tiny_tokenizer_dir

BASE_SEED = 3  # as tests/runtime/test_loop.py: peaked enough next-token laws for stable greedy identity
HEADS_SEED = 0


def tiny_modules(arch: str, dtype: str = "float32", base_seed: int = BASE_SEED) -> tuple[Decoder, DraftHeads | None]:
    """The tiny random base (and `random:ARCH` heads, arch 'none' for none) in `dtype`."""
    base = tiny_base(seed=base_seed)
    if dtype == "float16":
        base = base.half()
        # .half() casts buffers too; the loader keeps RoPE frequencies in fp32 (clover.models.loading)
        base.register_buffer("inv_freq", rope_inv_freq(base.config.rope, base.config.head_dim), persistent=False)
    heads = random_heads(base, arch, HEADS_SEED) if arch != "none" else None
    return base, heads


def tiny_artifact(root: Path, arch: str, dtype: str = "float32", tree: str | None = None,
                  draft_quant: str | None = None, weights: str | None = None, attention: str = "portable",
                  shared_lm_head: bool = True) -> Path:
    """Export tiny_modules(arch, dtype) to
    root/artifacts/<arch>-<dtype>[-<tree>][-drafts-<q>][-weights-<w>][-<attention>][-own-lm-heads] once per
    session. shared_lm_head=False: every graph keeps its LM head, as in a TensorRT artifact."""
    parts = (arch, dtype, tree, draft_quant and f"drafts-{draft_quant}", weights and f"weights-{weights}",
             attention if attention != "portable" else None, None if shared_lm_head else "own-lm-heads")
    out = Path(root) / "artifacts" / "-".join(filter(None, parts))
    if (out / MANIFEST_FILE).is_file():
        return out
    base, heads = tiny_modules(arch, dtype)
    tokenizer = tiny_tokenizer_dir(Path(root) / "artifacts" / "tokenizer")
    name = f"random:{arch}:{HEADS_SEED}" if heads is not None else "none"
    config = ExportConfig(dtype=dtype, tree=tree, draft_quant=draft_quant, weights=weights, attention=attention,
                          shared_lm_head=shared_lm_head)
    return artifact_from_modules(base, heads, tokenizer, out, config, heads_name=name)


PROMPTS = [[7, 8, 9, 10, 11], [40, 41, 3, 90, 12, 13, 14, 15, 16, 17, 18]]  # as tests/runtime/test_loop.py


def assert_same_tokens(got: list[int], want: list[int], what: str = "") -> None:
    if got != want:
        i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
        raise AssertionError(f"{what}: tokens diverge at index {i}: {got[i]} vs {want[i]}")
