"""Weight quantization for ONNX Runtime on CPU.

`clover-export --weights int8|int4`: every graph's linears, the LM head included, become ONNX Runtime's
blockwise MatMulNBits (and for int4 the token embedding GatherBlockQuantized). Decoding at batch 1 is
bound by the weight bytes read per token, and 4-bit weights are ~5x fewer bytes than fp32. The output
changes with the weights; losslessness is measured against plain decoding of the same graphs.

`clover-export --draft-quant int8|int4`: the same blockwise MatMulNBits weights (int8 compute) in the draft
graphs only. Drafting is op- and memory-bound on CPU (SmolLM2 fp32: Clover-2's two augmenting layers and
its LM head read ~140 MB per step); int8 blocks cut the fp32 artifact's drafting from 5.6 to 2.8 ms per
step with the same acceptance. The LM head the drafts share with the base stays out of it: the drafts get
their own quantized copy, draft_lm_head.onnx (export/draft_vocab.py). The base graph, which verifies every
token, keeps its precision, so the output stays token-identical to plain decoding: the drafts' rounding
only changes which candidates are proposed.

The exporter writes the tied LM head as MatMul(x, Transpose(W)) with W shared by the token embedding
(a Gather). onnxruntime's quantizer only takes MatMuls whose weight is an initializer, so the transposed
copy is materialised first (the Gather keeps W in fp32).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np

from clover.errors import CloverError


def fold_transposed_weights(model) -> int:
    """Replace Transpose(initializer) nodes by a transposed initializer; returns how many were folded."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    folded = 0
    for node in list(model.graph.node):
        if node.op_type != "Transpose" or node.input[0] not in inits:
            continue
        w = numpy_helper.to_array(inits[node.input[0]])
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        model.graph.initializer.append(
            numpy_helper.from_array(np.ascontiguousarray(np.transpose(w, perm)), node.output[0])
        )
        model.graph.node.remove(node)
        folded += 1
    return folded


def gemms_as_matmul(model) -> int:
    """Rewrite Gemm(x, W, b) with W an initializer (how a Linear on 2-D rows exports) as MatMul(x, W') + b, which
    onnxruntime's weight quantizer takes (it skips Gemm); returns how many were rewritten."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    rewritten = 0
    for node in list(model.graph.node):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (
            node.op_type != "Gemm"
            or node.input[1] not in inits
            or attrs.get("transA", 0)
            or attrs.get("alpha", 1.0) != 1.0
            or attrs.get("beta", 1.0) != 1.0
        ):
            continue
        w = numpy_helper.to_array(inits[node.input[1]])
        name = f"{node.input[1]}.matmul"
        model.graph.initializer.append(
            numpy_helper.from_array(np.ascontiguousarray(w.T if attrs.get("transB", 0) else w), name)
        )
        bias = len(node.input) > 2 and node.input[2]
        product = f"{node.output[0]}.matmul" if bias else node.output[0]
        i = list(model.graph.node).index(node)
        new = [helper.make_node("MatMul", [node.input[0], name], [product], name=node.name)]
        if bias:
            new.append(helper.make_node("Add", [product, node.input[2]], list(node.output), name=f"{node.name}.bias"))
        model.graph.node.remove(node)
        for k, n in enumerate(new):
            model.graph.node.insert(i + k, n)
        rewritten += 1
    used = {i for n in model.graph.node for i in n.input}
    for t in [t for t in model.graph.initializer if t.name not in used]:
        model.graph.initializer.remove(t)
    return rewritten


BITS = {"int8": 8, "int4": 4}
# MatMulNBits accuracy_level 0: fp32 compute on the de-quantized blocks. Level 4 (int8 activations, VNNI)
# decodes SmolLM2 int4 ~1.35x faster (78 vs 58 tok/s, 2 threads) but breaks losslessness: SmolLM2's
# residual stream carries massive activations (~1e3), so a block's int8 scale is coarse and the last-bit
# differences between a 1-token step and a tree verify (attention sums split differently) flip whole
# quantization steps. Greedy speculative output then left plain decoding on 6 of 6 MT-Bench prompts
# (top-2 margins 0.07-0.3 at the divergence); with level 0 it matched on 6 of 6.
ACCURACY_LEVEL = 0
# The fused base graph (--attention fused) attends over one KV buffer on >= 2 rows (export/fused_graph.py), and
# MatMulNBits at level 4 is row-invariant (1 row or many, bit for bit), so every row of a chain verify is
# computed exactly as the same row of a plain step: there level 4 keeps greedy speculation exact for chains.
FUSED_ACCURACY_LEVEL = 4
# The draft graphs only propose tokens (the base verifies them), so their rounding cannot change the output:
# they take the faster int8 compute.
DRAFT_ACCURACY_LEVEL = 4
DRAFT_BLOCK_SIZE = 32  # --draft-quant: onnxruntime-genai's default block
# Asymmetric blocks (a zero point each): the embedded default's GGUF is Q4_1, itself asymmetric 4-bit in
# blocks of 32, and greedy decoding followed fp32 for longer than with symmetric blocks.
SYMMETRIC = False


def _onnx_quantization():
    try:
        import onnx
        from onnxruntime import quantization
    except ImportError as e:
        raise CloverError("quantizing graphs needs onnx and onnxruntime: pip install 'clover-deploy[onnx]'") from e
    return onnx, quantization


def quantize_weights(
    path: Path, scheme: str, block_size: int, accuracy_level: int, gemms: bool = False, keep_lm_head: str | None = None
) -> str:
    """Rewrite the fp32 graph at `path` with MatMulNBits weights computing at `accuracy_level`, except Gemm nodes
    (unless `gemms`) and the LM head whose weights `keep_lm_head` names (lm_head.weights_key: the base's, which
    the draft graphs share); returns how the token embedding is stored ("int4" or "float32": onnxruntime
    quantizes Gather to 4 bits only)."""
    from clover.export.lm_head import lm_head_names

    onnx, _ = _onnx_quantization()
    with quiet_root_logger():  # importing it calls logging.basicConfig(level=INFO) for the whole process
        from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    model = onnx.load(str(path))
    fold_transposed_weights(model)  # the quantizer takes MatMuls whose weight is an initializer
    if gemms:
        gemms_as_matmul(model)  # ... and no Gemm (a Linear on rows: Clover's draft_step, Medusa's ResBlocks)
    embedding_lookups_as_gather(model)  # ... and Gathers (the heads' embedding rows, 113 MB in fp32 for SmolLM2)
    ops = ("MatMul", "Gather") if scheme == "int4" else ("MatMul",)
    config = DefaultWeightOnlyQuantConfig(
        block_size=block_size,
        is_symmetric=SYMMETRIC,
        accuracy_level=accuracy_level or None,
        bits=BITS[scheme],
        op_types_to_quantize=ops,
        quant_axes=(("MatMul", 0), ("Gather", 1)),
    )
    quantizer = MatMulNBitsQuantizer(
        model, nodes_to_exclude=list(lm_head_names(model, keep_lm_head)), algo_config=config
    )
    with quiet_root_logger(), np.errstate(invalid="ignore", divide="ignore"):  # all-zero blocks: scale 0, handled
        quantizer.process()
    replace_graph(path, lambda out: quantizer.model.save_model_to_file(str(out), use_external_data_format=True))
    return "int4" if scheme == "int4" and "GatherBlockQuantized" in quantized_ops(path) else "float32"


def embedding_lookups_as_gather(model) -> int:
    """Rewrite GatherND(W, Unsqueeze(ids, -1)) with W an initializer, which is how `weight[ids]` exports, as
    the equivalent Gather(W, ids); returns how many were rewritten."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    rewritten = 0
    for node in list(model.graph.node):
        if node.op_type != "GatherND" or node.input[0] not in inits or any(a.i for a in node.attribute):
            continue  # batch_dims != 0 is another lookup
        unsqueeze = producer.get(node.input[1])
        if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or unsqueeze.input[1] not in inits:
            continue
        if numpy_helper.to_array(inits[unsqueeze.input[1]]).tolist() != [-1]:
            continue
        gather = helper.make_node(
            "Gather", [node.input[0], unsqueeze.input[0]], list(node.output), name=node.name, axis=0
        )
        model.graph.node.insert(list(model.graph.node).index(node), gather)
        model.graph.node.remove(node)
        if not any(unsqueeze.output[0] in n.input for n in model.graph.node):
            model.graph.node.remove(unsqueeze)
        rewritten += 1
    return rewritten


def replace_graph(path: Path, write) -> None:
    """Let `write(tmp_path)` write a graph (and its external data) next to `path`, then replace the old files
    (same names), so a failed write leaves the old graph whole."""
    with tempfile.TemporaryDirectory(prefix=".quant-", dir=path.parent) as scratch:
        write(Path(scratch) / path.name)
        for f in Path(scratch).iterdir():  # the graph and <name>.data: same names as the fp32 files they replace
            shutil.move(str(f), path.parent / f.name)
            (path.parent / f.name).chmod(0o644)  # the quantizers create their data files private


def quantize_draft_graph(path: Path, scheme: str, keep_lm_head: str | None = None) -> None:
    """Rewrite the fp32 draft graph at `path` (and its external data) with `scheme` MatMulNBits weights, except
    the LM head it shares with the base (`keep_lm_head`: that head's weights_key; None: nothing shared)."""
    quantize_weights(path, scheme, DRAFT_BLOCK_SIZE, DRAFT_ACCURACY_LEVEL, gemms=True, keep_lm_head=keep_lm_head)


@contextlib.contextmanager
def quiet_root_logger():
    """Errors only from the root logger during the body, and its level and handlers as they were after it
    (onnxruntime's quantizers log hints meant for CNNs, and one module calls logging.basicConfig on import)."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers


def base_accuracy_level(attention: str) -> int:
    """MatMulNBits accuracy level of the base graph exported with `attention`."""
    return FUSED_ACCURACY_LEVEL if attention == "fused" else ACCURACY_LEVEL


QUANTIZED_OPS = ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulNBits", "GatherBlockQuantized")


def quantized_ops(path: Path) -> list[str]:
    """The quantized-weight nodes of a graph (empty: nothing was quantized)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return [n.op_type for n in model.graph.node if n.op_type in QUANTIZED_OPS]
