"""clover.onnx_ir: the IR version cap follows pyproject.toml's oldest onnxruntime, the installed onnxruntime and onnx;
every model the export writes (a portable artifact, a fused one, an int4 one) and the doctor's probe carries an IR
version at or below it and loads in the installed onnxruntime; derived models (the LM head, the draft vocabulary's,
the batched base) are capped even when their source is not; a newer onnx default (a higher onnx.IR_VERSION) still
yields models the installed onnxruntime reads; opsets that need a newer IR version are refused in one line."""

import re
import tomllib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from ort_helpers import tiny_artifact
from packaging.version import Version

from clover import onnx_ir
from clover.errors import CloverError
from clover.export import config, fused_graph
from clover.export.batch_graph import batched_base_model
from clover.export.draft_vocab import draft_lm_head_model
from clover.export.lm_head import LM_HEAD
from clover.tools.doctor import write_matmul_probe

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_probe():
    """The installed onnxruntime probed again (a test changes what onnx stamps), and again after the test."""
    onnx_ir.installed_ort_ir.cache_clear()
    yield
    onnx_ir.installed_ort_ir.cache_clear()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Tiny artifacts other tests export too (same folders): portable, fused, fused with int4 weights."""
    root = tmp_path_factory.getbasetemp()
    return [
        tiny_artifact(root, "clover2"),
        tiny_artifact(root, "clover2", attention="fused"),
        tiny_artifact(root, "clover2", tree="chain-3", weights="int4", attention="fused"),
    ]


def one_node_model(opset: int = 17):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def loads(model_or_path) -> None:
    source = model_or_path.SerializeToString() if hasattr(model_or_path, "SerializeToString") else str(model_or_path)
    ort.InferenceSession(source, providers=["CPUExecutionProvider"])


def test_the_oldest_onnxruntime_is_pyprojects_lowest_bound():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    bounds = [
        Version(m.group(1))
        for deps in extras.values()
        for dep in deps
        if (m := re.fullmatch(r"onnxruntime(?:-gpu)?>=([\d.]+)", dep.replace(" ", "")))
    ]
    assert bounds and min(bounds) == Version(onnx_ir.ORT_OLDEST)


def test_the_cap_is_the_smallest_of_the_three_and_the_installed_onnxruntime_reads_it():
    installed = onnx_ir.installed_ort_ir()
    assert installed is not None
    assert onnx_ir.ir_version_cap() == min(onnx_ir.ORT_OLDEST_IR, onnx.IR_VERSION, installed)
    if Version(ort.__version__) >= Version(onnx_ir.ORT_OLDEST):  # newer onnxruntimes read at least as much
        assert installed >= onnx_ir.ORT_OLDEST_IR
    model = one_node_model()
    model.ir_version = installed + 1
    with pytest.raises(Exception, match="IR version"):
        loads(model)  # the probe found the real limit: one more is refused


def test_the_projects_opsets_fit_under_the_oldest_onnxruntimes_ir_version():
    newest = onnx_ir.max_opset(onnx_ir.ORT_OLDEST_IR)
    assert max(config.OPSETS) <= newest and config.DEFAULT_OPSET <= newest and fused_graph.OPSET <= newest
    for opset in config.OPSETS:
        assert onnx_ir.needed_ir_version(one_node_model(opset)) <= onnx_ir.ir_version_cap()


def test_every_graph_an_export_writes_is_capped_and_loads(artifacts):
    cap = onnx_ir.ir_version_cap()
    for artifact in artifacts:
        files = sorted(artifact.rglob("*.onnx"))
        assert files
        for path in files:
            assert onnx.load(str(path), load_external_data=False).ir_version <= cap, path
            loads(path)


def test_the_doctors_probe_is_capped_and_loads(tmp_path):
    path = tmp_path / "matmul.onnx"
    x, w = write_matmul_probe(path)
    assert onnx.load(str(path)).ir_version == onnx_ir.ir_version_cap() < onnx.IR_VERSION  # make_model's 14 capped
    (y,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(y, x @ w, rtol=1e-6)


def test_derived_models_are_capped_when_their_source_is_not(artifacts):
    portable, fused, _ = artifacts
    cap = onnx_ir.ir_version_cap()
    lm = onnx.load(str(portable / f"{LM_HEAD}.onnx"))
    lm.ir_version = onnx.IR_VERSION + 1
    assert draft_lm_head_model(lm, np.arange(64)).ir_version <= cap
    solo = onnx.load(str(fused / "base.onnx"), load_external_data=False)
    solo.ir_version = onnx.IR_VERSION + 1
    assert batched_base_model(solo, 2).ir_version <= cap


def test_a_newer_onnx_default_still_yields_models_the_installed_onnxruntime_reads(tmp_path, monkeypatch, fresh_probe):
    newer = onnx.IR_VERSION + 1
    monkeypatch.setattr(onnx, "IR_VERSION", newer)  # what helper.make_model stamps
    assert one_node_model().ir_version == newer
    path = tmp_path / "matmul.onnx"
    write_matmul_probe(path)
    assert onnx.load(str(path)).ir_version <= onnx_ir.ORT_OLDEST_IR
    loads(path)
    # Were the oldest supported onnxruntime newer, the installed one would still cap what is written.
    monkeypatch.setattr(onnx_ir, "ORT_OLDEST_IR", newer + 10)
    assert onnx_ir.ir_version_cap() == onnx_ir.installed_ort_ir() < newer
    write_matmul_probe(path)
    loads(path)
    model = fused_graph.finish_model(fused_graph.GraphWriter(), "empty", [], [])
    assert model.ir_version == onnx_ir.installed_ort_ir()


def test_a_model_keeps_an_older_ir_version_and_is_refused_when_its_opsets_need_more(monkeypatch):
    model = one_node_model()
    model.ir_version = 8
    assert onnx_ir.capped(model).ir_version == 8
    monkeypatch.setattr(onnx_ir, "ORT_OLDEST_IR", 9)  # IR 9: onnx 1.15, opset 20
    with pytest.raises(CloverError, match=r"opsets ai.onnx 23 needs IR version 11, newer than 9.*opset 20 or older"):
        onnx_ir.capped(one_node_model(23))
