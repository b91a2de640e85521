"""clover.tools.machine: the weights a decode step reads, and the bandwidth ceiling they put on plain decoding."""

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from clover.tools.machine import bandwidth_limit, measure_bandwidth, weight_bytes_per_token


def test_a_step_reads_every_weight_but_the_tables_it_only_gathers_from(tmp_path):
    table = numpy_helper.from_array(np.zeros((50, 8), np.float32), "embed")  # gathered only: one row a step
    tied = numpy_helper.from_array(np.zeros((50, 8), np.float32), "tied")  # gathered and multiplied: read whole
    w = numpy_helper.from_array(np.zeros((8, 8), np.float32), "w")
    nodes = [
        helper.make_node("Gather", ["embed", "ids"], ["e"]),
        helper.make_node("Gather", ["tied", "ids"], ["t"]),
        helper.make_node("MatMul", ["e", "w"], ["h"]),
        helper.make_node("Add", ["h", "t"], ["s"]),
        helper.make_node("MatMul", ["s", "tied_t"], ["y"]),
        helper.make_node("Transpose", ["tied"], ["tied_t"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [table, tied, w],
    )
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph), str(path))
    assert weight_bytes_per_token([path]) == (50 * 8 + 8 * 8) * 4
    external = tmp_path / "x.onnx"  # weights in an external data file: counted from its recorded lengths
    onnx.save(
        helper.make_model(graph),
        str(external),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="x.onnx.data",
        size_threshold=0,
    )
    assert weight_bytes_per_token([external]) == (50 * 8 + 8 * 8) * 4
    assert weight_bytes_per_token([path, external]) == 2 * (50 * 8 + 8 * 8) * 4


def test_bandwidth_is_measured_and_bounds_plain_decoding():
    bw = measure_bandwidth(1 << 24, repeats=2, readers=(1,))
    assert len(bw.samples_gbps[1]) == 2 and bw.best(1) > 0
    assert bandwidth_limit(27.0, 540_000_000) == pytest.approx(50.0)


def test_results_name_paths_relative_to_the_working_directory(tmp_path):
    """Results and training records travel with the repository: absolute paths under it become relative, also
    inside comma-joined lists; other paths and other values stay as they are."""
    from clover.tools.machine import relative_paths

    root = tmp_path / "repo"
    doc = {
        "heads": f"{root}/models/a,{root}/b",
        "runs": [{"data": f"{root}/data/c", "other": "/usr/lib/x", "n": 3}],
        f"{root}/k": None,
        "near": f"{root}x/y",
    }
    assert relative_paths(doc, root) == {
        "heads": "models/a,b",
        "runs": [{"data": "data/c", "other": "/usr/lib/x", "n": 3}],
        "k": None,
        "near": f"{root}x/y",
    }
