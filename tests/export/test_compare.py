"""clover.export.compare: the exported graphs against the PyTorch modules through Polygraphy's runners and
Comparator, the one path of the export's parity check and of clover-compare (tests/tools/test_compare_cli.py)."""

import shutil

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from ort_helpers import tiny_artifact, tiny_modules

from clover.artifact import ProfileSpec, read_manifest
from clover.errors import CloverError
from clover.export.artifact import VERIFY_SIZES, verified_parity
from clover.export.compare import (
    Case,
    OrtRunner,
    Tolerance,
    TorchRunner,
    compare,
    compare_artifact,
    export_tolerance,
    feeds,
    fitting_profile,
    parity,
)
from clover.export.graphs import base_graph, draft_graphs

FP32 = Tolerance(1e-3, 1e-3)
PROMPT = {"batch": 1, "new": 9, "past": 0, "rows": 1}
TREE = {"batch": 1, "new": 7, "past": 11, "rows": 7}


def perturb_output(path, output, factor=1.05):
    """Scale one output of the ONNX graph at `path` by `factor` (a Mul after its producer); the rest is unchanged."""
    model = onnx.load(str(path), load_external_data=False)
    raw = f"{output}.unperturbed"
    for node in model.graph.node:  # the producer, and the nodes that read it inside the graph, keep the raw value
        node.output[:] = [raw if o == output else o for o in node.output]
        node.input[:] = [raw if i == output else i for i in node.input]
    model.graph.initializer.append(numpy_helper.from_array(np.array(factor, np.float32), "perturbation"))
    model.graph.node.append(helper.make_node("Mul", [raw, "perturbation"], [output]))
    onnx.save(model, str(path))


def graph_copy(root, name, dest):
    """The graph `name` of the artifact at `root`, with its weights, copied into `dest`."""
    spec = read_manifest(root).graphs[name]
    dest.mkdir(exist_ok=True)
    for f in (spec.file, *spec.external_data):
        shutil.copyfile(root / f, dest / f)
    return dest / spec.file


@pytest.fixture(scope="module")
def clover2(tmp_path_factory):
    return tiny_artifact(tmp_path_factory.getbasetemp(), "clover2")


def test_every_graph_and_output_through_polygraphy(clover2):
    base, heads = tiny_modules("clover2")
    manifest = read_manifest(clover2)
    lm_head = clover2 / manifest.graphs["lm_head"].file
    prompt = base_graph(base, chains=True)
    for graph in [base_graph(base)] + draft_graphs(heads):
        spec = manifest.graphs[graph.name]
        cut = spec.has_output("lm_input")  # the shared LM head: its logits come through lm_head.onnx
        assert cut != spec.has_output("logits")
        runners = [TorchRunner(graph), OrtRunner(clover2 / spec.file, graph.outputs, lm_head if cut else None)]
        cases = (
            [Case("base/prefill", prompt, (PROMPT,)), Case("base/verify", graph, (TREE,))]
            if graph.name == "base"
            else [Case(graph.name, graph, tuple(VERIFY_SIZES))]
        )
        rows = compare(runners, cases, FP32)
        assert [(r.graph, r.output) for r in rows] == [(c.label, o) for c in cases for o in graph.outputs]
        assert all(r.passed and r.backend == "ort" and r.reference == "torch" for r in rows), rows
        assert all(
            0 <= r.mean_abs <= r.max_abs < 1e-3 and r.scale > 0 and r.max_rel == r.max_abs / r.scale for r in rows
        )


def test_in_place_kv_graph_returns_the_new_rows(tmp_path_factory):
    """The fused base binds its KV cache as past and present: the runner hands back the new rows, as PyTorch."""
    root = tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", attention="fused")
    base, _ = tiny_modules("clover2")
    manifest = read_manifest(root)
    graph = base_graph(base)
    assert manifest.graphs["base"].output("present.0.key").shape[2] == "slots"
    ort = OrtRunner(root / manifest.graphs["base"].file, graph.outputs, root / manifest.graphs["lm_head"].file)
    rows = compare(
        [TorchRunner(graph), ort],
        [Case("base/prefill", base_graph(base, chains=True), (PROMPT,)), Case("base/verify", graph, (TREE,))],
        FP32,
    )
    assert len(rows) == 2 * len(graph.outputs) and all(r.passed for r in rows), [r for r in rows if not r.passed]


def test_a_perturbed_output_fails_and_is_named(clover2, tmp_path):
    _, heads = tiny_modules("clover2")
    step = next(g for g in draft_graphs(heads) if g.name == "draft_step")
    path = graph_copy(clover2, "draft_step", tmp_path)
    perturb_output(path, "state")
    lm_head = graph_copy(clover2, "lm_head", tmp_path)
    runners = [TorchRunner(step), OrtRunner(path, step.outputs, lm_head)]
    rows = compare(runners, [Case("draft_step", step, ({"candidates": 5},))], FP32)
    by_output = {r.output: r for r in rows}
    assert not by_output["state"].passed and by_output["logits"].passed  # the LM head reads the raw state
    assert by_output["state"].max_rel == pytest.approx(0.05, rel=1e-3)


def test_the_export_check_is_the_same_path(tmp_path_factory, tmp_path):
    """verified_parity (every clover-export check) runs compare.parity and names the output beyond tolerance."""
    root = tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", shared_lm_head=False)  # graphs as traced
    _, heads = tiny_modules("clover2")
    begin = next(g for g in draft_graphs(heads) if g.name == "draft_begin")
    errors = verified_parity(begin, root / "draft_begin.onnx", "float32")
    assert list(errors) == list(begin.outputs) and max(errors.values()) < 1e-3
    path = graph_copy(root, "draft_begin", tmp_path)
    perturb_output(path, "present.1.value", 1.5)
    with pytest.raises(CloverError, match=r"draft_begin.onnx does not match PyTorch: output present.1.value differs"):
        verified_parity(begin, path, "float32")
    (row,) = [r for r in parity(begin, path, VERIFY_SIZES, FP32) if not r.passed]
    assert row.output == "present.1.value"


def test_tolerance_rule():
    t = Tolerance(1e-3, 1e-3)
    assert t.bound(0.5) == 1e-3 and t.bound(50.0) == pytest.approx(0.05)  # max(1, scale) x limit, as the export
    assert Tolerance(0.0, 0.1).bound(0.5) == pytest.approx(0.05)
    with pytest.raises(CloverError, match="tolerances must be >= 0"):
        Tolerance(-1.0, 0.0)
    assert export_tolerance("base", "float32").rtol == 1e-3
    assert export_tolerance("draft_step", "float16").atol == 5e-2
    assert export_tolerance("base", "float32", weights="int4").rtol == 1.0
    assert export_tolerance("base", "float32", draft_quant="int8").rtol == 1e-3  # the base keeps its dtype
    assert export_tolerance("draft_step", "float32", draft_quant="int8").rtol == 0.2
    with pytest.raises(CloverError, match="pass --atol and --rtol"):
        export_tolerance("base", "bfloat16")


def test_inputs_are_seeded():
    _, heads = tiny_modules("clover2")
    begin = draft_graphs(heads)[0]
    sizes = [{"batch": 2, "accepted": 3, "past": 4}]
    a, b, c = feeds(begin, sizes, 7), feeds(begin, sizes, 7), feeds(begin, sizes, 8)
    assert list(a[0]) == list(begin.inputs)
    assert all(np.array_equal(a[0][n], b[0][n]) for n in begin.inputs)
    assert not np.array_equal(a[0]["hidden_states"], c[0]["hidden_states"])


def test_torch_runner_is_a_polygraphy_runner():
    base, _ = tiny_modules("none")
    graph = base_graph(base)
    with TorchRunner(graph) as runner:
        meta = runner.get_input_metadata(use_numpy_dtypes=False)
        assert list(meta) == list(graph.inputs)
        assert meta["input_ids"].shape == [None, None] and meta["past_key_values.0.key"].shape == [None, 2, None, 16]
        out = runner.infer(feeds(graph, [TREE])[0])
    assert list(out) == list(graph.outputs) and out["logits"].shape == (1, 7, 96)


def test_engine_profile_per_input():
    profiles = [
        ProfileSpec("prefill", {"input_ids": ((1, 1), (1, 8), (1, 16)), "logit_rows": ((1,), (1,), (1,))}),
        ProfileSpec("verify", {"input_ids": ((1, 1), (1, 4), (1, 4)), "logit_rows": ((1,), (4,), (4,))}),
    ]
    assert fitting_profile(profiles, {"input_ids": (1, 12), "logit_rows": (1,)}) == 0
    assert fitting_profile(profiles, {"input_ids": (1, 3), "logit_rows": (3,)}) == 1
    with pytest.raises(CloverError, match="fit none of the engine's optimization profiles"):
        fitting_profile(profiles, {"input_ids": (1, 30), "logit_rows": (30,)})


def test_an_artifact_without_sources_cannot_be_compared(clover2):
    with pytest.raises(CloverError, match="does not record its source model"):
        compare_artifact(clover2)
    with pytest.raises(CloverError, match="expected distinct names from torch, ort, trt"):
        compare_artifact(clover2, ("torch", "onnx"))
