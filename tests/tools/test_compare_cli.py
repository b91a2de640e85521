"""clover-compare on an artifact exported by clover-export from a tiny HF folder: torch vs ONNX Runtime
passes on every graph; a deliberately perturbed graph exits 1 naming its output; user errors exit 2."""

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from clover.tools.compare import main as compare_main

pytest.importorskip("transformers")


def scale_output(path, output, factor=1.05):
    """Scale what the graph at `path` returns as `output` (nodes inside the graph keep the raw value)."""
    model = onnx.load(str(path), load_external_data=False)
    for node in model.graph.node:
        node.output[:] = [f"{output}.raw" if o == output else o for o in node.output]
        node.input[:] = [f"{output}.raw" if i == output else i for i in node.input]
    model.graph.initializer.append(numpy_helper.from_array(np.array(factor, np.float32), "factor"))
    model.graph.node.append(helper.make_node("Mul", [f"{output}.raw", "factor"], [output]))
    onnx.save(model, str(path))


@pytest.fixture
def artifact(cli_artifact):
    return cli_artifact


def cli(capsys, *args):
    code = compare_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_torch_vs_ort_passes_on_every_graph(artifact, tmp_path, capsys):
    code, out, err = cli(capsys, artifact, "--json", tmp_path / "rows.json")
    assert code == 0, err
    for graph in ("base/prefill", "base/verify", "draft_begin", "draft_step"):
        assert f"\n{graph} " in out
    assert "FAIL" not in out and "ort vs torch" in out and "present.* (4)" in out
    assert "[1/3] base" in err and "[3/3] draft_step" in err and "within tolerance of torch" in err
    doc = json.loads((tmp_path / "rows.json").read_text())
    assert doc["passed"] and doc["backends"] == ["torch", "ort"]
    rows = doc["rows"]
    assert {(r["graph"], r["output"]) for r in rows} >= {
        ("base/verify", "logits"),
        ("base/verify", "present.1.value"),
        ("draft_step", "state"),
    }
    assert all(r["passed"] and r["max_abs"] < 1e-3 and r["tolerance"]["rtol"] == 1e-3 for r in rows)


def test_a_perturbed_graph_fails_with_the_output_named(artifact, tmp_path, capsys):
    broken = shutil.copytree(artifact, tmp_path / "broken")
    scale_output(broken / "draft_step.onnx", "state")
    code, out, err = cli(capsys, broken)
    assert code == 1
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("clover-compare: mismatch: draft_step output state (ort vs torch): max abs")
    )
    lines = {tuple(line.split()[:2]): line for line in out.splitlines() if line.startswith("draft_step")}
    assert lines[("draft_step", "state")].endswith("FAIL") and lines[("draft_step", "logits")].endswith("pass")


def test_tolerances_override_the_exports(artifact, capsys):
    code, out, err = cli(capsys, artifact, "--atol", "1e-12", "--rtol", "0", "--backends", "ort,torch")
    assert code == 1 and "torch vs ort" in out and "tolerance from --atol 1e-12 / --rtol 0" in out
    assert "clover-compare: mismatch:" in err


def test_tensorrt_where_present(artifact, capsys):
    code, out, err = cli(capsys, artifact, "--backends", "torch,ort,trt")
    assert code == 0, err
    assert "trt: not available: the artifact has no TensorRT engine for base (exported with --backend onnx)" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--backends", "torch,tensorflow"],
            "unknown backend 'tensorflow' in --backends torch,tensorflow: choose from torch, ort, trt",
        ),
        (["--backends", "ort"], "--backends ort: name two or more distinct backends"),
        (["--atol", "-1"], "tolerances must be >= 0"),
        (["--backends", "trt,torch"], "nothing to compare: only torch can run"),
    ],
)
def test_user_errors_are_one_line(artifact, capsys, args, message):
    code, out, err = cli(capsys, artifact, *args)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()  # before loading anything
    assert line.startswith("clover-compare: error: ") and message in line


def test_a_missing_artifact_is_one_line(tmp_path, capsys):
    code, out, err = cli(capsys, tmp_path / "nope")
    assert code == 2 and err.strip() == (
        f"clover-compare: error: artifact {tmp_path / 'nope'} does not exist: pass a folder written by clover-export"
    )
