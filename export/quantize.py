"""Weight-only int8 quantization of the draft graphs, for ONNX Runtime on CPU (`clover-export --draft-quant int8`).

A draft step is memory-bound on CPU: its cost is reading the 49k x H LM head (113 MB in fp32 for
SmolLM2) once per depth. Stored as int8 it is read 4x faster (ONNX Runtime's DynamicQuantizeMatMul).
Only the draft graphs are quantized: the base graph, which verifies every token, keeps its precision,
so the output stays token-identical to plain decoding; int8 only changes which candidates are drafted.

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
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(np.transpose(w, perm)), node.output[0]))
        model.graph.node.remove(node)
        folded += 1
    return folded


def quantize_draft_graph(path: Path) -> None:
    """Rewrite the fp32 graph at `path` (and its external data `<name>.data`) with int8 MatMul weights."""
    try:
        import onnx
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError as e:
        raise CloverError("--draft-quant needs onnx and onnxruntime: pip install 'clover-deploy[onnx]'") from e
    model = onnx.load(str(path))
    fold_transposed_weights(model)
    with tempfile.TemporaryDirectory(prefix=".quant-", dir=path.parent) as scratch:
        out = Path(scratch) / path.name
        # Per output channel: each vocabulary row of the LM head gets its own scale (per tensor, the drafts
        # of SmolLM2's clover2 heads were accepted less often).
        with quiet_root_logger():  # the quantizer logs a pre-processing hint meant for CNNs on every call
            quantize_dynamic(model, out, weight_type=QuantType.QInt8, per_channel=True, use_external_data_format=True)
        for f in Path(scratch).iterdir():  # the graph and <name>.data: same names as the fp32 files they replace
            shutil.move(str(f), path.parent / f.name)
            (path.parent / f.name).chmod(0o644)  # the quantizer creates its data file private


@contextlib.contextmanager
def quiet_root_logger():
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def quantized_ops(path: Path) -> list[str]:
    """The integer-matmul nodes of a graph (empty: nothing was quantized)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return [n.op_type for n in model.graph.node if n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul")]
