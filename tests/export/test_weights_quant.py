"""--weights int8|int4: every graph's linears as MatMulNBits. The output follows the quantized weights, so
losslessness is speculative output == plain output of the same quantized graphs."""

import dataclasses
import json
import shutil

import pytest
from helpers import assert_identical, run_tokens
from ort_helpers import PROMPTS, tiny_artifact

from clover.artifact import MANIFEST_FILE, open_artifact, read_manifest
from clover.errors import CloverError
from clover.export.config import ExportConfig
from clover.export.quantize import quantized_ops
from clover.runtime.backends.ort import load_runner
from clover.runtime.tree import resolve_tree

N = 40
TREES = {"medusa": "chain-4", "clover": "chain-3", "clover2": "mc26"}
SCHEMES = ("int8", "int4")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    return {(arch, w): tiny_artifact(root, arch, tree=TREES[arch], weights=w) for arch in TREES for w in SCHEMES}


@pytest.mark.parametrize("weights", SCHEMES)
@pytest.mark.parametrize("arch", list(TREES))
def test_every_graph_is_quantized_and_measured(artifacts, arch, weights):
    root = artifacts[arch, weights]
    m = open_artifact(root)  # checksums cover the rewritten files
    assert m.weights.scheme == weights and m.weights.block_size == 32
    assert m.weights.accuracy_level == 0 and m.weights.draft_accuracy_level == 4
    assert m.draft_quant is None
    assert "lm_head" in m.graphs  # the LM head of every graph, once (test_lm_head.py)
    lm_head_ops = quantized_ops(root / m.graphs["lm_head"].file)
    assert lm_head_ops == ["MatMulNBits"]
    for name, graph in m.graphs.items():
        if name == "lm_head":  # cut out of the checked base graph
            continue
        ops = quantized_ops(root / graph.file) + lm_head_ops  # what runs for this graph's logits
        assert "MatMulNBits" in ops, f"{name} has no MatMulNBits"
        assert m.parity[name]["logits"] < 1e-3  # the fp32 graph was checked before it was quantized
        assert m.parity[f"{name}.{weights}"]["logits"] > 0  # then measured again, quantized
    base_ops = quantized_ops(root / m.graphs["base"].file)
    assert ("GatherBlockQuantized" in base_ops) == (weights == "int4")  # the embedding: 4 bits only
    if arch != "medusa":  # the heads' token embedding too (exported as GatherND, rewritten to a Gather)
        begin_ops = quantized_ops(root / m.graphs["draft_begin"].file)
        assert ("GatherBlockQuantized" in begin_ops) == (weights == "int4")
    assert m.weights.embedding == ("int4" if weights == "int4" else "float32")
    agreement = m.weights.agreement
    assert agreement["positions"] > 0 and 0.0 <= agreement["top1"] <= 1.0


@pytest.mark.parametrize("weights", SCHEMES)
@pytest.mark.parametrize("arch", list(TREES))
def test_speculative_equals_plain_on_the_quantized_graphs(artifacts, arch, weights):
    root = artifacts[arch, weights]
    plain, speculative = load_runner(root, heads="none"), load_runner(root)
    tree = resolve_tree(TREES[arch])
    drafted = accepted = 0
    for p in PROMPTS:
        want, _ = run_tokens(plain, p, resolve_tree("plain"), N)
        got, steps = run_tokens(speculative, p, tree, N)
        assert_identical(got, want, f"ORT {arch} {weights} weights, {TREES[arch]}")
        drafted, accepted = drafted + len(steps), accepted + sum(steps)
    assert accepted > drafted, "no drafted token was ever accepted on the quantized graphs"


def test_unknown_scheme_is_refused_with_the_fix(artifacts, tmp_path):
    src = artifacts["clover2", "int4"]
    doc = json.loads((src / MANIFEST_FILE).read_text())
    doc["weights"]["scheme"] = "int3"
    copy = tmp_path / "int3"  # a copy: links out of the folder would be refused before the scheme is read
    shutil.copytree(src, copy)
    (copy / MANIFEST_FILE).write_text(json.dumps(doc))
    with pytest.raises(CloverError, match=r"stores 'int3' weights.*runs int8, int4.*--weights int4"):
        read_manifest(copy)
    with pytest.raises(CloverError, match="'int3'"):
        load_runner(copy)


def test_manifest_round_trips_the_scheme(artifacts):
    m = read_manifest(artifacts["medusa", "int8"])
    again = type(m).from_dict(json.loads(json.dumps(m.to_dict())))
    assert again.weights == m.weights and dataclasses.asdict(again.weights)["scheme"] == "int8"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"weights": "int2"}, "unknown --weights 'int2'"),
        ({"weights": "int4", "backend": "trt"}, "use it with --backend onnx --dtype float32"),
        ({"weights": "int4", "dtype": "float16"}, "use it with --backend onnx --dtype float32"),
        ({"weights": "int4", "draft_quant": "int8"}, "already quantizes the draft graphs: drop --draft-quant"),
        ({"weights": "int4", "block_size": 24}, "--block-size must be a power of two >= 16"),
        ({"weights": "int4", "block_size": 8}, "--block-size must be a power of two >= 16"),
    ],
)
def test_config_rejects(kwargs, message):
    with pytest.raises(CloverError, match=message):
        ExportConfig(**kwargs)


def test_embedding_lookup_becomes_a_gather():
    """weight[ids] exports as GatherND(W, Unsqueeze(ids, -1)); as Gather the quantizer can store W in 4 bits."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from clover.export.quantize import embedding_lookups_as_gather

    w = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Unsqueeze", ["ids", "axes"], ["idx"]), helper.make_node("GatherND", ["W", "idx"], ["y"])],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([-1], np.int64), "axes")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    assert embedding_lookups_as_gather(model) == 1
    assert [n.op_type for n in model.graph.node] == ["Gather"]
    onnx.checker.check_model(model)
    ids = np.array([7, 0, 7])
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
    np.testing.assert_array_equal(y, w[ids])
