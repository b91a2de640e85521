"""TensorRT engine planning on tiny exported artifacts, without TensorRT: optimization profiles, limits,
the build-memory estimate, the engine compatibility check, and the no-TensorRT error of build_engines."""

import argparse
import dataclasses
import sys

import numpy as np
import pytest

from clover.errors import CloverError
from clover.export.engines import (
    EngineLimits, build_engines, build_memory, check_engine_compatible, estimate_build_memory, memory_note,
    profile_sizes, profiles_for,
)
from clover.artifact import EngineSpec, ProfileSpec, read_manifest
from clover.runtime.tensorrt import MISSING
from clover.runtime.tree import resolve_tree
from clover.tools.cli import run_cli
from ort_helpers import tiny_artifact

LIMITS = EngineLimits(max_prompt=48, max_tree=26, max_context=128, max_accepted=5, max_candidates=10)
ARCHS = ("medusa", "clover", "clover2")


@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    # The graphs TensorRT builds from: each keeps its LM head (no shared lm_head.onnx in a trt artifact).
    artifacts = {arch: tiny_artifact(root, arch, shared_lm_head=False) for arch in ARCHS}
    return {arch: (path, read_manifest(path)) for arch, path in artifacts.items()}


def all_graphs(manifests):
    return [(arch, name, g) for arch, (_, m) in manifests.items() for name, g in m.graphs.items()]


def test_profiles_cover_every_dynamic_input_with_ordered_shapes(manifests):
    for arch, name, graph in all_graphs(manifests):
        profiles = profiles_for(name, graph, LIMITS)
        assert profiles, (arch, name)
        for p in profiles:
            dynamic = {t.name for t in graph.inputs if any(isinstance(d, str) for d in t.shape)}
            assert set(p.shapes) == dynamic, (arch, name, p.name)
            for t in graph.inputs:
                if t.name not in dynamic:
                    continue
                lo, opt, hi = p.shapes[t.name]
                assert len(lo) == len(opt) == len(hi) == len(t.shape)
                for d, a, o, z in zip(t.shape, lo, opt, hi):
                    assert 0 <= a <= o <= z, (arch, name, p.name, t.name, d)
                    if not isinstance(d, str):
                        assert a == o == z == d  # static dims (Hkv, D, H) fixed
            # one size per dim name: inputs sharing a dim agree in every profile shape
            for which in range(3):
                sizes = {}
                for t in graph.inputs:
                    if t.name in p.shapes:
                        for d, v in zip(t.shape, p.shapes[t.name][which]):
                            if isinstance(d, str):
                                assert sizes.setdefault(d, v) == v, (arch, name, d)


def test_base_profiles_prefill_and_verify(manifests):
    _, m = manifests["clover2"]
    prefill, verify = profiles_for("base", m.graphs["base"], LIMITS)
    assert (prefill.name, verify.name) == ("prefill", "verify")
    assert prefill.shapes["input_ids"] == ((1, 1), (1, 24), (1, 48))  # new 1..max_prompt
    assert prefill.shapes["logit_rows"] == ((1,), (1,), (1,))  # the prefill returns the last row only
    assert prefill.shapes["tree_mask"][2] == (1, 48, 48)
    assert verify.shapes["input_ids"] == ((1, 1), (1, 26), (1, 26))  # new 1..max_tree, opt = a full tree
    assert verify.shapes["logit_rows"] == ((1,), (26,), (26,))
    for p in (prefill, verify):
        lo, _, hi = p.shapes["past_key_values.0.key"]  # [batch, Hkv, past (slots bound), D]
        assert (lo[2], hi[2]) == (0, LIMITS.max_context)
        assert p.shapes["past_lengths"] == ((1,), (1,), (1,))  # max_batch 1
    assert prefill.shapes["past_key_values.0.key"][1][2] == 0  # a prompt meets an empty cache


def test_draft_profiles(manifests):
    _, m = manifests["clover"]
    (begin,) = profiles_for("draft_begin", m.graphs["draft_begin"], LIMITS)
    assert begin.name == "draft"
    # the prefill's commit hands draft_begin the whole prompt
    assert begin.shapes["hidden_states"][2][1] == max(LIMITS.max_prompt, LIMITS.max_accepted)
    assert begin.shapes["hidden_states"][1][1] == LIMITS.max_accepted
    (step,) = profiles_for("draft_step", m.graphs["draft_step"], LIMITS)
    assert "depth" not in step.shapes  # a static [] input needs no profile
    assert step.shapes["tokens"] == ((1,), (10,), (10,))
    _, mm = manifests["medusa"]
    (heads,) = profiles_for("medusa_heads", mm.graphs["medusa_heads"], LIMITS)
    assert heads.shapes["hidden_states"][0][1] == 1 and heads.shapes["hidden_states"][2][1] == LIMITS.max_accepted


def test_unknown_graph_and_dim_are_clear_errors(manifests):
    _, m = manifests["clover"]
    with pytest.raises(CloverError, match="no TensorRT profiles are defined for graph 'extra'"):
        profiles_for("extra", m.graphs["base"], LIMITS)
    graph = m.graphs["draft_step"]
    odd = dataclasses.replace(graph, inputs=(dataclasses.replace(graph.inputs[1], shape=("nodes", 64)),))
    with pytest.raises(CloverError, match="dynamic dim 'nodes'"):
        profiles_for("draft_step", odd, LIMITS)


@pytest.mark.parametrize("change, match", [
    ({"max_prompt": 0}, "max_prompt must be a positive integer"),
    ({"max_batch": 2.0}, "max_batch must be a positive integer"),
    ({"max_prompt": 129}, r"max_prompt \(129\) exceeds max_context \(128\)"),
    ({"max_tree": 200}, r"max_tree \(200\) exceeds max_context"),
    ({"max_accepted": 27}, r"max_accepted \(27\) exceeds max_tree \(26\)"),
    ({"max_candidates": 30}, r"max_candidates \(30\) exceeds max_tree"),
])
def test_limits_validation(change, match):
    with pytest.raises(CloverError, match=match):
        dataclasses.replace(LIMITS, **change)


def test_limits_for_tree():
    tree = resolve_tree("mc26")
    limits = EngineLimits.for_tree(tree.num_nodes, tree.max_depth, max(len(lv) for lv in tree.levels), 4096)
    assert (limits.max_tree, limits.max_accepted, limits.max_prompt) == (tree.num_nodes, tree.max_depth + 1, 2048)
    assert limits.max_candidates == max(len(lv) for lv in tree.levels)


def kv_bytes(m, slots, tokens):
    """Bytes of the base's past inputs (slots) and present outputs (tokens), by hand."""
    cfg = m.base_config
    per_token = 2 * cfg["num_layers"] * cfg["num_kv_heads"] * cfg["head_dim"] * 4  # float32 K and V
    return per_token * (slots + tokens)


def test_memory_estimate_formula_and_monotonic(manifests):
    root, m = manifests["clover2"]
    graph = m.graphs["base"]
    weights = sum((root / f).stat().st_size for f in (graph.file, *graph.external_data))
    profiles = profiles_for("base", graph, LIMITS)
    est = build_memory(root, graph, profiles, workspace=1 << 20)
    # the prefill profile is the larger one here: its max new tokens (48) exceed the tree's (26)
    assert est.io_profile == "prefill"
    sizes = profile_sizes(graph, profiles[0])
    assert sizes == {"batch": 1, "new": 48, "rows": 1, "past": 128}
    V, H = m.base_config["vocab_size"], m.base_config["hidden_size"]
    io = kv_bytes(m, 128, 48) + 48 * (8 + 8 + 48) + 8 + 8 + 1 * V * 4 + 48 * H * 4
    assert est.io == io
    total = estimate_build_memory(root, graph, profiles, "float32", workspace=1 << 20)
    assert total == weights + io + (1 << 20)
    bigger = dataclasses.replace(LIMITS, max_context=256)
    assert estimate_build_memory(root, graph, profiles_for("base", graph, bigger), "float32", workspace=1 << 20) > total
    longer = dataclasses.replace(LIMITS, max_prompt=96)
    assert estimate_build_memory(root, graph, profiles_for("base", graph, longer), "float32", workspace=1 << 20) > total
    note = memory_note("base", est)
    assert note.startswith("base: weights ") and "at least" in note and "GPU memory" in note


def test_memory_estimate_refuses_another_precision(manifests):
    root, m = manifests["clover"]
    profiles = profiles_for("base", m.graphs["base"], LIMITS)
    with pytest.raises(CloverError, match="has float32 tensors, but engines are asked for in float16: export with --dtype float16"):
        estimate_build_memory(root, m.graphs["base"], profiles, "float16")


SPEC = EngineSpec(graph="base", file="engines/base.engine", profiles=(ProfileSpec("verify", {}),), precision="float16",
                  tensorrt_version="10.7.0.post1", device_name="NVIDIA H100 80GB HBM3", compute_capability="9.0")


def test_check_engine_compatible():
    check_engine_compatible(SPEC, "10.7.0", "NVIDIA H100 80GB HBM3", "9.0")  # same release, other wheel suffix
    with pytest.raises(CloverError) as e:
        check_engine_compatible(SPEC, "11.1.0.12", "NVIDIA H100 80GB HBM3", "9.0")
    msg = str(e.value)
    assert "built with TensorRT 10.7.0 but TensorRT 11.1.0 is installed" in msg
    assert "clover-export --backend trt" in msg and "\n" not in msg
    with pytest.raises(CloverError) as e:
        check_engine_compatible(SPEC, "10.7.0", "NVIDIA A100-SXM4-80GB", "8.0")
    msg = str(e.value)
    assert "built for NVIDIA H100 80GB HBM3 (compute capability 9.0)" in msg
    assert "this GPU is NVIDIA A100-SXM4-80GB (compute capability 8.0)" in msg and "clover-export --backend trt" in msg


@pytest.fixture
def no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` now raises ImportError


def test_build_engines_without_tensorrt_is_one_clear_cli_error(manifests, no_tensorrt, tmp_path, capsys):
    root, m = manifests["clover"]
    with pytest.raises(CloverError) as e:
        build_engines(root, m.graphs, "float32", LIMITS, None, print)
    assert str(e.value) == MISSING
    assert "--backend onnx" in MISSING and "10.x or 11.x" in MISSING
    assert not (root / "engines").exists()  # nothing written before the check

    def run(_args):
        build_engines(root, m.graphs, "float32", LIMITS, tmp_path / "cache", print)
        return 0

    assert run_cli("clover-export", argparse.ArgumentParser(), run, []) == 2
    err = capsys.readouterr().err
    assert err == f"clover-export: error: {MISSING}\n"


def test_build_memory_of_draft_graphs_is_positive(manifests):
    for arch, name, graph in all_graphs(manifests):
        root = manifests[arch][0]
        est = build_memory(root, graph, profiles_for(name, graph, LIMITS), workspace=0)
        assert est.weights > 0 and est.io > 0, (arch, name)
        assert np.isfinite(est.total)
