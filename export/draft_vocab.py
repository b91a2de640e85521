"""A draft vocabulary (FR-Spec, arXiv 2502.14856): the heads draft over the K tokens the base itself emits most
often, not over all V.

Drafting runs the LM head on every drafted row and takes the top-k of its logits: for SmolLM2 that is a 49k x 576
matmul and a 49k-wide top-k per row, most of a draft step on CPU. The base's own answers use few of those tokens
(the corpus `clover-data grow` builds: ~99% of its answer tokens are among the 8k most frequent), so a head that
scores only K of them costs about K/V as much and proposes the same tokens nearly always.

`add_draft_vocab` writes, beside `lm_head.onnx` (export/lm_head.py):
    draft_lm_head.onnx   lm_input [n, H] -> logits [n, K]: the same op and attributes as lm_head.onnx, over the K
                         rows of its weights (for MatMulNBits: the K rows of its packed blocks, scales and zero points)
    draft_vocab.npy      int64 [K]: the full-vocabulary id of each column, most frequent first
The draft graphs that share the base's LM head then run draft_lm_head.onnx instead. With --draft-quant its
weights are quantized like the draft graphs' (MatMulNBits); without --draft-vocab the draft vocabulary is then
the whole vocabulary, so that the drafts still run a quantized LM head of their own. Only what is proposed
changes: the base still verifies with the full head, so output stays lossless (greedy: identical; sampling: the
draft law is zero outside the K tokens, which rejection sampling accounts for).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clover.artifact import DRAFT_LM_HEAD, DRAFT_VOCAB_FILE, DraftVocabSpec, GraphSpec, Manifest
from clover.errors import CloverError
from clover.export.lm_head import LM_HEAD, LM_INPUT, save_model
from clover.onnx_ir import capped

MIN_SIZE = 64
WHOLE_VOCABULARY = "the whole vocabulary"  # the source of a draft vocabulary of every token (--draft-quant alone)


@dataclass(frozen=True)
class TokenCounts:
    """How often each token occurs in what the base emitted (e.g. a corpus grown by clover-data grow)."""

    counts: np.ndarray  # int64 [V]
    source: str  # what was counted, for the manifest
    base_fingerprint: dict[str, Any]  # the base that emitted them (clover.models.heads.BaseFingerprint, as a dict)


def ranked_ids(counts: np.ndarray) -> np.ndarray:
    """Token ids by how often they occur (`counts` [V]), most frequent first; ties by id."""
    counts = np.asarray(counts)
    return np.lexsort((np.arange(len(counts)), -counts)).astype(np.int64)


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    """Share of the counted tokens that are in `ids`."""
    total = float(np.sum(counts))
    return float(np.sum(np.asarray(counts)[ids]) / total) if total else 0.0


def check_size(size: int, vocab_size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or not MIN_SIZE <= size <= vocab_size:
        raise CloverError(
            f"--draft-vocab must be an int in {MIN_SIZE}..{vocab_size} (tokens the heads draft over; the "
            f"base's vocabulary has {vocab_size}), got {size!r}"
        )


def draft_lm_head_model(lm_model, ids: np.ndarray):
    """draft_lm_head.onnx from lm_head.onnx: its one matmul over the rows (output columns) `ids`."""
    from onnx import helper, numpy_helper

    (node,) = lm_model.graph.node
    inits = {t.name: numpy_helper.to_array(t) for t in lm_model.graph.initializer}
    weights = []
    attributes = {a.name: a for a in node.attribute}
    if node.op_type == "MatMulNBits":
        # B [N, blocks, blob], scales [N * blocks] or [N, blocks], zero_points [N * packed] or [N, packed]: N first
        N = attributes["N"].i
        for name in node.input[1:]:
            if not name:
                continue
            w = inits[name]
            rows = w.reshape(N, -1)[ids]
            weights.append(
                numpy_helper.from_array(
                    np.ascontiguousarray(
                        rows.reshape((len(ids), *w.shape[1:])) if w.shape[0] == N else rows.reshape(-1)
                    ),
                    name,
                )
            )
        copy = helper.make_node(node.op_type, list(node.input), ["logits"], name=DRAFT_LM_HEAD, domain=node.domain)
        copy.attribute.extend(helper.make_attribute("N", len(ids)) if a.name == "N" else a for a in node.attribute)
    elif node.op_type == "MatMul":  # weight [H, V]
        name = node.input[1]
        weights.append(numpy_helper.from_array(np.ascontiguousarray(inits[name][:, ids]), name))
        copy = helper.make_node("MatMul", list(node.input), ["logits"], name=DRAFT_LM_HEAD)
    else:
        raise CloverError(
            f"{LM_HEAD}.onnx computes with {node.op_type}, which a draft vocabulary cannot slice: "
            "export without --draft-vocab"
        )
    out = lm_model.graph.output[0].type.tensor_type
    inp = lm_model.graph.input[0]
    graph = helper.make_graph(
        [copy], DRAFT_LM_HEAD, [inp], [helper.make_tensor_value_info("logits", out.elem_type, ["n", len(ids)])], weights
    )
    model = helper.make_model(graph, opset_imports=list(lm_model.opset_import), producer_name="clover-deploy")
    model.ir_version = lm_model.ir_version
    return capped(model)


def add_draft_vocab(
    folder: Path, specs: dict[str, GraphSpec], ids: np.ndarray, source: str, covered: float, quant: str | None = None
) -> tuple[dict[str, GraphSpec], DraftVocabSpec]:
    """Write draft_lm_head.onnx and draft_vocab.npy into `folder` (an artifact being built, whose draft graphs
    share lm_head.onnx) for the draft vocabulary `ids`; checks that its logits are lm_head.onnx's columns `ids`,
    then (`quant`: the artifact's --draft-quant) quantizes its weights."""
    import onnx

    from clover.export.onnx_graph import check_onnx, checking_session, graph_spec

    shared = [n for n, s in specs.items() if n not in ("base", "base_batch") and s.has_output(LM_INPUT)]
    if LM_HEAD not in specs or not shared:
        raise CloverError(
            "--draft-vocab needs draft graphs that share the base's LM head (ONNX Runtime, float32, "
            "Clover or Clover-2 heads): export without --draft-vocab otherwise"
        )
    ids = np.asarray(ids, dtype=np.int64)
    vocab = int(specs[LM_HEAD].output("logits").shape[-1])
    check_size(len(ids), vocab)
    if len(np.unique(ids)) != len(ids) or ids.min() < 0 or ids.max() >= vocab:
        raise CloverError(f"a draft vocabulary lists distinct token ids in 0..{vocab - 1}: this is a clover-export bug")
    lm_path = folder / specs[LM_HEAD].file
    save_model(draft_lm_head_model(onnx.load(str(lm_path)), ids), folder / f"{DRAFT_LM_HEAD}.onnx")
    check_onnx(folder / f"{DRAFT_LM_HEAD}.onnx")
    np.save(folder / DRAFT_VOCAB_FILE, ids)
    # Same op, attributes and row bytes: each column is computed as lm_head.onnx computes it.
    x = np.random.default_rng(0).standard_normal((3, int(specs[LM_HEAD].input(LM_INPUT).shape[-1]))).astype(np.float32)
    full = checking_session(lm_path).run(["logits"], {LM_INPUT: x})[0]
    small = checking_session(folder / f"{DRAFT_LM_HEAD}.onnx").run(["logits"], {LM_INPUT: x})[0]
    if not np.array_equal(full[:, ids], small):
        raise CloverError(
            f"{DRAFT_LM_HEAD}.onnx does not give lm_head.onnx's logits of its tokens: this is a "
            "clover-export bug, please report it"
        )
    if quant is not None:
        from clover.export.quantize import quantize_draft_graph

        quantize_draft_graph(folder / f"{DRAFT_LM_HEAD}.onnx", quant)
        check_onnx(folder / f"{DRAFT_LM_HEAD}.onnx")
    out = dict(specs)
    out[DRAFT_LM_HEAD] = graph_spec(folder / f"{DRAFT_LM_HEAD}.onnx")
    return out, DraftVocabSpec(
        size=len(ids), file=DRAFT_VOCAB_FILE, source=source, coverage=round(covered, 5), graphs=tuple(sorted(shared))
    )


def draft_vocab_change(token_counts: TokenCounts, size: int) -> Callable[[Path, Manifest], Manifest]:
    """The `derived_artifact` change that gives an artifact's heads the `size` most frequent tokens of
    `token_counts` as their draft vocabulary, replacing any they had."""
    import dataclasses

    ids = ranked_ids(token_counts.counts)[:size]

    def change(tmp: Path, manifest: Manifest) -> Manifest:
        graphs = {k: v for k, v in manifest.graphs.items() if k != DRAFT_LM_HEAD}
        graphs, spec = add_draft_vocab(
            tmp, graphs, ids, token_counts.source, coverage(token_counts.counts, ids), quant=manifest.draft_quant
        )
        return dataclasses.replace(manifest, graphs=graphs, draft_vocab=spec)

    return change


def with_draft_vocab(src: Path, out: Path, token_counts: TokenCounts, size: int) -> Path:
    """A copy of the artifact `src` at `out` whose heads draft over the `size` most frequent tokens of `token_counts`
    (replacing any draft vocabulary it had): no re-export, the graphs are copied as they are."""
    from clover.artifact import check_corpus_base, open_artifact
    from clover.export.artifact import derived_artifact

    manifest = open_artifact(src)
    check_corpus_base(
        token_counts.base_fingerprint, manifest.base_fingerprint, f"the token counts ({token_counts.source})"
    )
    old = manifest.draft_vocab
    drop = (
        {
            old.file,
            *(
                f
                for g in (DRAFT_LM_HEAD,)
                if g in manifest.graphs
                for f in (manifest.graphs[g].file, *manifest.graphs[g].external_data)
            ),
        }
        if old
        else set()
    )
    return derived_artifact(src, out, drop, draft_vocab_change(token_counts, size))
