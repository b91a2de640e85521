"""The `plugin` attention variant: one CloverTreeAttention node per layer, everything else as `portable`.

ONNX Runtime has no kernel for the custom node; the node's ONNX reference function
(clover.plugins.onnx_reference) lets it run the plugin graph, which must then give the portable graph's
outputs and PyTorch's.
"""

import numpy as np
import onnx
import pytest
import torch
from numerics import assert_close_paths, chain_reduction
from ort_helpers import tiny_modules

from clover.export.graphs import base_graph, random_tree, reference_outputs
from clover.export.onnx_graph import check_onnx, onnx_from_torch, plugin_nodes, runnable_by_ort
from clover.models.decoder import PluginMask, causal_mask, plugin_mask, with_attention
from clover.plugins.onnx_node import DOMAIN, OP_TYPE
from clover.runtime.tree import resolve_tree

ort = pytest.importorskip("onnxruntime")
SIZES = [  # past 0 and one new token, a 26-node tree over a past, 64 and 33 new tokens (2 packed words per row)
    {"batch": 1, "new": 1, "past": 0, "rows": 1},
    {"batch": 2, "new": 26, "past": 9, "rows": 26},
    {"batch": 1, "new": 64, "past": 5, "rows": 2},
    {"batch": 1, "new": 33, "past": 40, "rows": 33},
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    base, _ = tiny_modules("none")
    graphs = {}
    for variant in ("portable", "plugin"):
        out = tmp_path_factory.mktemp(variant)
        graph = base_graph(base, variant)
        spec = onnx_from_torch(graph, out, 20)
        graphs[variant] = (graph, out / spec.file, spec)
    return base, graphs


def test_one_plugin_node_per_layer(exported):
    base, graphs = exported
    _, path, _ = graphs["plugin"]
    model = onnx.load(str(path), load_external_data=False)
    nodes = plugin_nodes(model)
    L = base.config.num_layers
    assert len(nodes) == L
    assert {(o.domain, o.version) for o in model.opset_import} >= {(DOMAIN, 1)}
    assert len({n.name for n in model.graph.node}) == len(model.graph.node)  # unique node names
    for i, node in enumerate(nodes):
        assert (node.domain, node.op_type, node.name) == (DOMAIN, OP_TYPE, f"layers.{i}.self_attn.tree_attention")
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {
            "plugin_namespace": b"clover",
            "plugin_version": b"1",
            "scale": pytest.approx(base.config.head_dim**-0.5),
        }
        # k, v are this layer's new K/V (also graph outputs); the past is this layer's cache input
        assert list(node.input[1:5]) == [
            f"present.{i}.key",
            f"present.{i}.value",
            f"past_key_values.{i}.key",
            f"past_key_values.{i}.value",
        ]
    ops = {n.op_type for n in model.graph.node}
    assert "Softmax" not in ops and "Attention" not in ops  # the attention itself is only in the nodes
    check_onnx(path)


def test_same_io_and_weights_as_portable(exported):
    _, graphs = exported
    specs = {v: g[2] for v, g in graphs.items()}
    assert specs["plugin"].inputs == specs["portable"].inputs
    assert specs["plugin"].outputs == specs["portable"].outputs
    models = {v: onnx.load(str(g[1])) for v, g in graphs.items()}
    # the model's parameters (named base.*; the exporter also stores folded constants)
    weights = {
        v: {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer if i.name.startswith("base.")}
        for v, m in models.items()
    }
    assert weights["plugin"].keys() == weights["portable"].keys() and weights["plugin"]
    for name, w in weights["plugin"].items():
        np.testing.assert_array_equal(w, weights["portable"][name])


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"new{s['new']}-past{s['past']}")
def test_plugin_graph_matches_portable_and_torch(exported, sizes):
    _, graphs = exported
    sessions = {}
    for variant, (_, path, _) in graphs.items():
        with runnable_by_ort(path) as runnable:
            sessions[variant] = ort.InferenceSession(str(runnable), providers=["CPUExecutionProvider"])
    graph = graphs["portable"][0]
    inputs = graph.example(sizes, torch.Generator().manual_seed(sizes["new"]))
    feeds = {n: t.numpy() for n, t in zip(graph.inputs, inputs)}
    plugin = sessions["plugin"].run(None, feeds)
    portable = sessions["portable"].run(None, feeds)
    torch_out = reference_outputs(graph, inputs)
    for name, a, b, c in zip(graph.outputs, plugin, portable, torch_out):
        assert np.abs(a - b).max() < 1e-4, name
        assert np.abs(a - c.numpy()).max() < 1e-4, name
    assert not any(p.name.startswith(".") for p in graphs["plugin"][1].parent.iterdir())  # temp copy removed


def test_eager_plugin_decoder_equals_portable():
    base, _ = tiny_modules("none")
    plugin = with_attention(base, "plugin")
    assert base.attention == "portable" and plugin.attention == "plugin" and plugin.lm_head is base.lm_head
    g = torch.Generator().manual_seed(1)
    for sizes in SIZES:
        inputs = base_graph(base).example(sizes, g)
        a = reference_outputs(base_graph(base), inputs)
        b = reference_outputs(base_graph(base, "plugin"), inputs)
        for x, y in zip(a, b):  # two attention paths over the decoder's chain (numerics.py)
            assert_close_paths(x, y, reduction=chain_reduction(base.config, context=sizes["past"] + sizes["new"]))


def test_plugin_mask_matches_runtime_tree_packing():
    tree = resolve_tree("mc26")
    mask = torch.tensor(tree.ancestor_mask)[None]
    packed = plugin_mask(mask, torch.tensor([7]))
    assert isinstance(packed, PluginMask) and packed.past_lengths.dtype == torch.int32
    np.testing.assert_array_equal(packed.packed[0].numpy(), tree.packed_mask)
    depth, tree_mask = random_tree(70, torch.Generator().manual_seed(0))
    assert plugin_mask(tree_mask[None], torch.tensor([0])).packed.shape == (1, 70, 3)
    assert plugin_mask(causal_mask(5), torch.tensor([0])).packed[0, :, 0].tolist() == [1, 3, 7, 15, 31]


def test_plugin_variant_refuses_sliding_window():
    from dataclasses import replace

    from clover.errors import CloverError

    base, _ = tiny_modules("none")
    base.config = replace(base.config, sliding_window=16)
    with pytest.raises(CloverError, match="sliding window.*--attention portable"):
        with_attention(base, "plugin")
