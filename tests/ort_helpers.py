"""Tiny exported artifacts shared by the export, ONNX Runtime and TensorRT tests.

Exporting takes seconds per graph, so each artifact is built once per test session: `tiny_artifact`
writes into a folder under the session's base temp dir and returns it as is when it is already there.
`tiny_modules` rebuilds the exact PyTorch modules an artifact was exported from, as the reference.
`cpu_runner` drives the TensorRT runner's bookkeeping with ONNX Runtime in place of the engines (`OrtEngine`);
`no_tensorrt_gpu` says why the real TensorRT tests cannot run here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import built_once, shared_root, tiny_base, tiny_tokenizer_dir

from clover.artifact import read_manifest
from clover.export.artifact import ArtifactOptions, artifact_from_modules
from clover.export.config import ExportConfig
from clover.export.engines import EngineLimits, profiles_for
from clover.models.decoder import Decoder, rope_inv_freq
from clover.models.head_io import random_heads
from clover.models.heads import DraftHeads

BASE_SEED = 3  # as tests/runtime/test_loop.py: peaked enough next-token laws for stable greedy identity
HEADS_SEED = 0


def tiny_modules(arch: str, dtype: str = "float32", base_seed: int = BASE_SEED) -> tuple[Decoder, DraftHeads | None]:
    """The tiny random base (and `random:ARCH` heads, arch 'none' for none) in `dtype`."""
    base = tiny_base(seed=base_seed)
    if dtype == "float16":
        base = base.half()
        # .half() casts buffers too; the loader keeps RoPE frequencies in fp32 (clover.models.loading)
        base.register_buffer("inv_freq", rope_inv_freq(base.config.rope, base.config.rope_dim), persistent=False)
    heads = random_heads(base, arch, HEADS_SEED) if arch != "none" else None
    return base, heads


def tiny_artifact(
    root: Path,
    arch: str,
    dtype: str = "float32",
    tree: str | None = None,
    draft_quant: str | None = None,
    weights: str | None = None,
    attention: str = "portable",
    shared_lm_head: bool = True,
    draft_vocab: int | None = None,
) -> Path:
    """Export tiny_modules(arch, dtype) to shared_root(root)/artifacts/
    <arch>-<dtype>[-<tree>][-drafts-<q>][-weights-<w>][-<attention>][-own-lm-heads][-dv<K>] once per run (built_once:
    one build for all xdist workers). shared_lm_head=False: every graph keeps its LM head, as in a TensorRT
    artifact. draft_vocab: the K most frequent tokens of `tiny_token_counts`."""
    parts = (
        arch,
        dtype,
        tree,
        draft_quant and f"drafts-{draft_quant}",
        weights and f"weights-{weights}",
        attention if attention != "portable" else None,
        None if shared_lm_head else "own-lm-heads",
        draft_vocab and f"dv{draft_vocab}",
    )
    out = shared_root(root) / "artifacts" / "-".join(filter(None, parts))
    return built_once(
        out,
        lambda out: _export_tiny(out, arch, dtype, tree, draft_quant, weights, attention, shared_lm_head, draft_vocab),
    )


def _export_tiny(out, arch, dtype, tree, draft_quant, weights, attention, shared_lm_head, draft_vocab) -> Path:
    base, heads = tiny_modules(arch, dtype)
    tokenizer = tiny_tokenizer_dir(out.parent / f".tokenizer-{out.name}")  # one per artifact: built side by side
    name = f"random:{arch}:{HEADS_SEED}" if heads is not None else "none"
    config = ExportConfig(
        dtype=dtype,
        tree=tree,
        draft_quant=draft_quant,
        weights=weights,
        attention=attention,
        shared_lm_head=shared_lm_head,
        draft_vocab=draft_vocab,
    )
    counts = tiny_token_counts(base) if draft_vocab else None
    options = ArtifactOptions(heads_name=name, token_counts=counts)
    return artifact_from_modules(base, heads, tokenizer, out, config, options)


def tiny_token_counts(base: Decoder):
    """Token counts for a tiny base's draft vocabulary: every token seen, in a seeded order of frequency."""
    import dataclasses

    import numpy as np

    from clover.export.draft_vocab import TokenCounts
    from clover.models.heads import BaseFingerprint

    V = base.config.vocab_size
    counts = np.random.default_rng(5).permutation(V).astype(np.int64) + 1
    return TokenCounts(counts, "tiny counts", dataclasses.asdict(BaseFingerprint.of(base)))


PROMPTS = [[7, 8, 9, 10, 11], [40, 41, 3, 90, 12, 13, 14, 15, 16, 17, 18]]  # as tests/runtime/test_loop.py

# Engine limits of the TensorRT tests (cpu_runner's profiles).
TRT_LIMITS = EngineLimits(max_prompt=48, max_tree=26, max_context=128, max_accepted=5, max_candidates=10)


class OrtEngine:
    """Stands in for a TensorRT engine in the runner's bookkeeping tests, and says so: the same
    run(inputs, sizes) contract computed by ONNX Runtime on CPU torch tensors. It checks that every call
    fits one of the engine's optimization profiles and records which. TensorRT numerics are the GPU test's."""

    def __init__(self, root, name, graph, limits):
        ort = pytest.importorskip("onnxruntime")
        from clover.runtime.backends.trt import BindingTable, torch_dtype

        self.table = BindingTable.of(name, graph, profiles_for(name, graph, limits))
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(root / graph.file), opts, providers=["CPUExecutionProvider"])
        self.out_dtypes = {b.name: torch_dtype(b.dtype) for b in self.table.outputs}
        self.calls = []

    def has_input(self, name):
        return any(b.name == name for b in self.table.inputs)

    def run(self, inputs, sizes, into=None):
        assert not into, "TensorRT engines return their outputs"
        import torch

        self.calls.append(self.table.profiles[self.table.profile(sizes)].name)
        for b in self.table.inputs:
            assert tuple(inputs[b.name].shape) == b.shape(sizes), (b.name, inputs[b.name].shape, sizes)
        names = [b.name for b in self.table.outputs]
        outs = self.session.run(names, {n: t.contiguous().numpy() for n, t in inputs.items()})
        shapes = self.table.output_shapes(sizes)
        assert all(o.shape == shapes[n] for n, o in zip(names, outs))
        return {n: torch.from_numpy(o) for n, o in zip(names, outs)}


def cpu_runner(artifact, use_heads=True, limits=TRT_LIMITS, cache_block=8):
    """A TrtRunner over `artifact`'s graphs (exported with shared_lm_head=False) run by OrtEngine on the CPU, and
    its engines by graph name. The small cache_block makes the KV caches double many times."""
    from clover.runtime.backend import Runner
    from clover.runtime.backends.trt import TrtRunner, graphs_used

    m = read_manifest(artifact)
    engines = {n: OrtEngine(artifact, n, m.graphs[n], limits) for n in graphs_used(m, use_heads)}
    runner = TrtRunner.__new__(TrtRunner)
    Runner.__init__(runner)
    runner._setup(m, use_heads, engines, "cpu", None, cache_block)
    return runner, engines


def no_tensorrt_gpu() -> str | None:
    """Why the TensorRT tests cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        return "needs TensorRT (pip install tensorrt on a GPU machine)"
    try:
        import torch
    except ImportError as e:
        return f"needs torch ({e})"
    return None if torch.cuda.is_available() else "needs a CUDA GPU"
