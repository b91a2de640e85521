"""Exported graphs against the PyTorch modules: parity per graph on random inputs at several sizes,
edge sizes included (no past, one new token, one candidate) up to the largest tree (mc26, 26 nodes),
through the export's comparison (clover.export.compare: Polygraphy's runners and Comparator).

docs/design.md: fp32 max abs logit error < 1e-3. The errors are printed (pytest -s) for the report.
"""

import numpy as np
import onnx
import pytest
from ort_helpers import tiny_artifact, tiny_modules

from clover.artifact import read_manifest
from clover.export.compare import Tolerance, parity
from clover.export.graphs import EXPORT_SIZES, base_graph, draft_graphs, float32_twin
from clover.export.onnx_graph import check_onnx, graph_spec, onnx_from_torch
from clover.models.head_io import build_heads
from clover.runtime.tree import resolve_tree

LARGEST_TREE = resolve_tree("mc26").num_nodes
BASE_SIZES = [
    {"batch": 1, "new": 1, "past": 0, "rows": 1},  # first token of an empty cache
    {"batch": 1, "new": 1, "past": 9, "rows": 1},  # plain decoding step
    {"batch": 1, "new": 12, "past": 0, "rows": 1},  # prefill, last row only
    {"batch": 1, "new": LARGEST_TREE, "past": 0, "rows": LARGEST_TREE},
    {"batch": 1, "new": LARGEST_TREE, "past": 31, "rows": LARGEST_TREE},  # tree verification
    {"batch": 3, "new": 4, "past": 6, "rows": 2},  # batch with ragged past lengths
]
BEGIN_SIZES = [
    {"batch": 1, "accepted": 1, "past": 0},
    {"batch": 1, "accepted": 12, "past": 0},  # after the prefill
    {"batch": 1, "accepted": 1, "past": 20},
    {"batch": 1, "accepted": 6, "past": 14},  # a long accepted path
    {"batch": 2, "accepted": 3, "past": 5},
]
STEP_SIZES = [{"candidates": n} for n in (1, 4, LARGEST_TREE)]
FP32_LIMIT = 1e-3  # docs/design.md, on logits
FP16_LIMITS = {"logits": 0.02, "state": 0.01}  # fp16 graph vs fp32 PyTorch, relative to the outputs' magnitude


def sizes_for(name, heads):
    if name == "base":
        return BASE_SIZES
    if name in ("draft_begin", "medusa_heads"):
        return BEGIN_SIZES
    depths = range(1, heads.config.num_heads) if heads.config.arch == "clover" else [1]
    return [dict(s, depth=d) for s in STEP_SIZES for d in depths]


def graph_defs(base, heads):
    return [base_graph(base)] + (draft_graphs(heads) if heads is not None else [])


@pytest.mark.parametrize("arch", ["medusa", "clover", "clover2"])
def test_fp32_parity_every_graph(tmp_path_factory, arch):
    root = tiny_artifact(tmp_path_factory.getbasetemp(), arch, shared_lm_head=False)  # the graphs as traced
    base, heads = tiny_modules(arch)
    graphs = graph_defs(base, heads)
    assert {g.name for g in graphs} == set(read_manifest(root).graphs)
    for graph in graphs:
        if graph.name == "base" and arch != "medusa":
            continue  # the same base graph: checked once
        # hidden states, head states and K/V: same bound, relative to their magnitude
        rows = parity(
            graph, root / f"{graph.name}.onnx", sizes_for(graph.name, heads), Tolerance(FP32_LIMIT, FP32_LIMIT)
        )
        print(f"\nfp32 {arch} {graph.name}: " + ", ".join(f"{r.output} {r.max_abs:.2e}" for r in rows))
        assert [r.output for r in rows] == list(graph.outputs)
        assert all(r.passed for r in rows), rows
        assert next(r for r in rows if r.output == "logits").max_abs < FP32_LIMIT


def test_fp16_parity(tmp_path_factory):
    root = tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", "float16")
    base, heads = tiny_modules("clover2", "float16")
    manifest = read_manifest(root)
    assert manifest.dtype == "float16"
    assert manifest.graphs["base"].input("past_key_values.0.key").dtype == "float16"
    for graph in graph_defs(base, heads):
        rows = parity(
            graph,
            root / f"{graph.name}.onnx",
            sizes_for(graph.name, heads),
            Tolerance(0.01, 0.01),
            reference=float32_twin(graph),
        )
        print(
            f"\nfp16 clover2 {graph.name} vs fp32 PyTorch: "
            + ", ".join(f"{r.output} {r.max_abs:.2e} (|max| {r.scale:.1f})" for r in rows)
        )
        for r in rows:
            assert np.isfinite(r.max_abs)
            assert r.max_abs <= FP16_LIMITS.get(r.output, 0.01) * max(1.0, r.scale), (r.output, r.max_abs)


def test_medusa_with_own_lm_heads(tmp_path):
    base, _ = tiny_modules("none")
    import torch

    heads = build_heads(base, "medusa", num_heads=3, own_lm_head=True)
    heads.init_weights(base, torch.Generator().manual_seed(1))
    for p in heads.lm_heads.parameters():
        p.data += 0.01 * torch.randn_like(p)  # differ from the base's LM head
    (graph,) = draft_graphs(heads.eval())
    spec = onnx_from_torch(graph, tmp_path, opset=20)
    assert spec.output("logits").shape == ("batch", 3, base.config.vocab_size)
    (row,) = parity(graph, tmp_path / spec.file, BEGIN_SIZES, Tolerance(FP32_LIMIT, FP32_LIMIT))
    assert row.output == "logits" and row.passed and row.max_abs < FP32_LIMIT


def test_graph_io_names_dims_and_checker(tmp_path_factory):
    root = tiny_artifact(tmp_path_factory.getbasetemp(), "clover", shared_lm_head=False)  # the graphs as traced
    graphs = read_manifest(root).graphs
    base = graphs["base"]
    assert [t.name for t in base.inputs[:5]] == ["input_ids", "position_ids", "tree_mask", "past_lengths", "logit_rows"]
    assert base.input("tree_mask").dtype == "bool" and base.input("tree_mask").shape == ("batch", "new", "new")
    assert base.input("past_key_values.1.value").shape == ("batch", 2, "past", 16)
    assert base.output("present.1.key").shape == ("batch", 2, "new", 16)
    assert base.output("hidden_states").shape == ("batch", "new", 64)
    assert base.output("logits").shape == ("batch", "rows", 96)
    begin, step = graphs["draft_begin"], graphs["draft_step"]
    assert begin.input("hidden_states").shape == ("batch", "accepted", 64)
    assert begin.output("present.0.key").shape == ("batch", 2, "accepted", 16)
    assert [t.name for t in step.inputs] == ["depth", "parent_state", "tokens"]
    assert step.input("depth").shape == () and step.output("logits").shape == ("candidates", 96)
    for name, spec in graphs.items():
        assert spec.external_data == (f"{name}.onnx.data",)
        check_onnx(root / spec.file)
        assert graph_spec(root / spec.file) == spec
        model = onnx.load(str(root / spec.file), load_external_data=False)
        assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)  # portable: standard ONNX ops only
        assert all(a.name != "is_causal" for n in model.graph.node for a in n.attribute)


def test_export_sizes_avoid_specialisation():
    values = list(EXPORT_SIZES.values())
    assert min(values) > 1 and len(set(values)) == len(values)
