"""--draft-quant int8: int8 MatMulNBits weights in the draft graphs only (their LM head: an int8 copy of the base's),
measured against PyTorch at export; the output stays token-identical to plain decoding (the base graph keeps its
precision)."""

import numpy as np
import onnx
import pytest
from helpers import assert_identical, run_tokens
from numerics import assert_close_paths
from onnx import TensorProto, helper, numpy_helper
from ort_helpers import PROMPTS, tiny_artifact, tiny_modules

from clover.artifact import open_artifact
from clover.errors import CloverError
from clover.export.config import ExportConfig
from clover.export.quantize import fold_transposed_weights, quantized_ops
from clover.runtime.backends.ort import load_runner
from clover.runtime.backends.torch_runner import TorchRunner
from clover.runtime.tree import resolve_tree

N = 40
TREES = {"medusa": "chain-4", "clover": "chain-3", "clover2": "mc26"}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    return {arch: tiny_artifact(root, arch, tree=TREES[arch], draft_quant="int8") for arch in TREES}


@pytest.mark.parametrize("arch", list(TREES))
def test_only_the_draft_graphs_are_int8_and_their_error_is_recorded(artifacts, arch):
    root = artifacts[arch]
    m = open_artifact(root)  # checksums cover the rewritten files
    assert m.draft_quant == "int8"
    for g in ("base", "lm_head"):  # the base and the LM head it verifies with keep float32
        assert quantized_ops(root / m.graphs[g].file) == []
    drafts = [g for g in m.graphs if g not in ("base", "lm_head", "draft_lm_head")]
    assert drafts
    for g in drafts:
        assert set(quantized_ops(root / m.graphs[g].file)) == {"MatMulNBits"}, f"{g} has no int8 matmul"
        assert m.graphs[g].has_output("lm_input")  # ... and runs its LM head in draft_lm_head.onnx
        errors = m.parity[f"{g}.int8"]
        assert errors["logits"] > 0, errors  # quantization moved the logits (within the bound export enforces)
        assert m.parity[g]["logits"] < 1e-3  # the fp32 graph was checked before it was quantized
    # Without --draft-vocab the drafts' own LM head covers the whole vocabulary, quantized like them.
    assert quantized_ops(root / m.graphs["draft_lm_head"].file) == ["MatMulNBits"]
    assert m.draft_vocab.size == m.base_config["vocab_size"] and m.draft_vocab.graphs == tuple(sorted(drafts))
    np.testing.assert_array_equal(np.load(root / m.draft_vocab.file), np.arange(m.base_config["vocab_size"]))


@pytest.mark.parametrize("arch", list(TREES))
def test_int8_drafts_keep_greedy_output_identical(artifacts, arch):
    base, _ = tiny_modules(arch)
    spec = load_runner(artifacts[arch])
    tree = resolve_tree(TREES[arch])
    drafted = accepted = 0
    for p in PROMPTS:
        want, _ = run_tokens(TorchRunner(base), p, resolve_tree("plain"), N)
        got, steps = run_tokens(spec, p, tree, N)
        assert_identical(got, want, f"ORT {arch} int8 drafts, {TREES[arch]}")
        drafted, accepted = drafted + len(steps), accepted + sum(steps)
    assert accepted > drafted, "no drafted token was ever accepted: the int8 drafts are not drafting"


def test_int8_drafts_mostly_agree_with_fp32_drafts(artifacts):
    """The quantized draft ranks the same top candidate as PyTorch for nearly every node."""
    b, h = tiny_modules("clover2")
    ort_runner, torch_runner = load_runner(artifacts["clover2"]), TorchRunner(b, h)
    prompt = np.array(PROMPTS[1])
    for r in (ort_runner, torch_runner):
        r.reset(64)
        r.forward(prompt, np.arange(len(prompt)), np.tri(len(prompt), dtype=bool))
        r.commit(np.arange(len(prompt)), np.append(prompt[1:], 7))
    same = [ort_runner.draft_begin().argmax() == torch_runner.draft_begin().argmax()]
    nodes, parents, tokens = np.arange(1, 9), np.zeros(8, dtype=np.int64), np.arange(20, 28)
    for depth in (1, 2, 3):
        a, b_ = (
            ort_runner.draft_step(depth, nodes, parents, tokens),
            torch_runner.draft_step(depth, nodes, parents, tokens),
        )
        same += list(a.argmax(-1) == b_.argmax(-1))
        nodes, parents = nodes + 8, nodes
    assert np.mean(same) >= 0.8, np.mean(same)


def test_int8_drafts_with_a_draft_vocabulary(tmp_path_factory):
    """--draft-quant with --draft-vocab: draft_lm_head.onnx is an int8 copy of the base's LM head over the K tokens,
    and the output stays identical to plain decoding."""
    k = 64
    root = tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", tree="mc26", draft_quant="int8", draft_vocab=k)
    m = open_artifact(root)
    assert m.draft_vocab.size == k and quantized_ops(root / m.graphs["lm_head"].file) == []
    (node,) = onnx.load(str(root / m.graphs["draft_lm_head"].file)).graph.node
    assert node.op_type == "MatMulNBits" and next(a.i for a in node.attribute if a.name == "N") == k
    base, _ = tiny_modules("clover2")
    spec, tree = load_runner(root), resolve_tree("mc26")
    for p in PROMPTS:
        want, _ = run_tokens(TorchRunner(base), p, resolve_tree("plain"), N)
        got, _ = run_tokens(spec, p, tree, N)
        assert_identical(got, want, "ORT clover2 int8 drafts over a draft vocabulary")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"draft_quant": "int2"}, "unknown --draft-quant 'int2'"),
        ({"draft_quant": "int8", "backend": "trt"}, "use it with --backend onnx --dtype float32"),
        ({"draft_quant": "int8", "dtype": "float16"}, "use it with --backend onnx --dtype float32"),
    ],
)
def test_config_rejects(kwargs, message):
    with pytest.raises(CloverError, match=message.replace("(", r"\(")):
        ExportConfig(**kwargs)


def test_fold_transposed_weights_keeps_the_function():
    """Transpose(W) -> MatMul becomes MatMul with W^T stored, so onnxruntime's quantizer sees a weight."""
    import onnxruntime as ort

    w = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "Wt"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.ones((2, 3), np.float32)
    assert fold_transposed_weights(model) == 1
    assert [n.op_type for n in model.graph.node] == ["MatMul"]
    onnx.checker.check_model(model)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert_close_paths(y, x @ w.T, reduction=3)  # ONNX Runtime's MatMul against numpy's
