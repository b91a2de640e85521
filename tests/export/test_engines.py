"""TensorRT engine planning on tiny exported artifacts, without TensorRT: optimization profiles, limits,
the build-memory estimate, the engine compatibility check, the Polygraphy loader chain an engine is built
with (inspected, not run), the timing cache's atomic replacement, and the errors without TensorRT or
Polygraphy. Building and running real engines: tests/runtime/test_runners.py and clover-doctor (GPU)."""

import argparse
import dataclasses
import os
import shutil
import sys
import types

import numpy as np
import pytest
from ort_helpers import no_tensorrt_gpu, tiny_artifact

from clover.artifact import EngineSpec, ProfileSpec, read_manifest
from clover.errors import CloverError
from clover.export import engines
from clover.export.engines import (
    DEFAULT_WORKSPACE_BYTES,
    POLYGRAPHY_MISSING,
    EngineLimits,
    build_engines,
    build_memory,
    check_engine_compatible,
    engine_loader,
    estimate_build_memory,
    memory_note,
    profile_sizes,
    profiles_for,
)
from clover.runtime.tree import resolve_tree
from clover.tools.cli import run_cli
from clover.trt import MISSING

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


@pytest.mark.parametrize(
    "change, match",
    [
        ({"max_prompt": 0}, "max_prompt must be a positive integer"),
        ({"max_batch": 2.0}, "max_batch must be a positive integer"),
        ({"max_prompt": 129}, r"max_prompt \(129\) exceeds max_context \(128\)"),
        ({"max_tree": 200}, r"max_tree \(200\) exceeds max_context"),
        ({"max_accepted": 27}, r"max_accepted \(27\) exceeds max_tree \(26\)"),
        ({"max_candidates": 30}, r"max_candidates \(30\) exceeds max_tree"),
    ],
)
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
    with pytest.raises(
        CloverError, match="has float32 tensors, but engines are asked for in float16: export with --dtype float16"
    ):
        estimate_build_memory(root, m.graphs["base"], profiles, "float16")


SPEC = EngineSpec(
    graph="base",
    file="engines/base.engine",
    profiles=(ProfileSpec("verify", {}),),
    precision="float16",
    tensorrt_version="10.7.0.post1",
    device_name="NVIDIA H100 80GB HBM3",
    compute_capability="9.0",
)


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


def test_build_engines_without_polygraphy_is_one_clear_error(manifests, monkeypatch):
    root, m = manifests["clover"]
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt("10.13.3.9"))
    monkeypatch.setitem(sys.modules, "polygraphy.backend.trt", None)
    with pytest.raises(CloverError) as e:
        build_engines(root, m.graphs, "float32", LIMITS, None, print)
    assert str(e.value) == POLYGRAPHY_MISSING and "gpu" in POLYGRAPHY_MISSING


# -- the Polygraphy loader chain, without TensorRT ----------------------------------------------------------


def fake_tensorrt(version: str) -> types.ModuleType:
    """What engine_loader reads of the tensorrt module: its version, MemoryPoolType.WORKSPACE, IProgressMonitor."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="MemoryPoolType.WORKSPACE")
    trt.IProgressMonitor = object
    return trt


@pytest.mark.parametrize("version, strongly_typed", [("10.13.3.9", True), ("11.1.0.12", False)])
def test_engine_loader_chain(manifests, tmp_path, version, strongly_typed):
    """EngineBytesFromNetwork(NetworkFromOnnxPath, CreateConfig): the graph parsed from its file, strongly typed
    by the flag on 10.x (11.x networks always are), one Profile per ProfileSpec in order, the workspace limit,
    TF32 off, the timing cache loaded when the file exists and saved into the given file."""
    pg = pytest.importorskip("polygraphy.backend.trt")
    root, m = manifests["clover2"]
    profiles = profiles_for("base", m.graphs["base"], LIMITS)
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"cache")
    lines = []
    with open(tmp_path / "out.cache", "w+b") as out:
        loader = engine_loader(
            fake_tensorrt(version),
            root / "base.onnx",
            profiles,
            workspace=1 << 30,
            timing_cache=cache,
            save_timing_cache=out,
            progress=lines.append,
        )
        assert isinstance(loader, pg.EngineBytesFromNetwork)
        assert loader.timing_cache_path is out
    network, config = loader._network, loader._config
    assert isinstance(network, pg.NetworkFromOnnxPath)
    assert network.path == str(root / "base.onnx") and network.strongly_typed is strongly_typed
    assert isinstance(config, pg.CreateConfig)
    assert config.tf32 is False and not (config.fp16 or config.bf16 or config.int8)  # the graph's own types
    assert config.memory_pool_limits == {"MemoryPoolType.WORKSPACE": 1 << 30}
    assert config.timing_cache_path == str(cache)
    assert [list(p) for p in config.profiles] == [list(p.shapes) for p in profiles]
    for p, spec in zip(config.profiles, profiles):
        assert isinstance(p, pg.Profile)
        for name, (lo, opt, hi) in spec.shapes.items():
            assert (p[name].min, p[name].opt, p[name].max) == (lo, opt, hi)
    # the progress monitor reports top-level phases only
    config.progress_monitor.phase_start("Building engine", None, 3)
    config.progress_monitor.phase_start("Tactic timing", "Building engine", 40)
    assert lines == ["      TensorRT: Building engine (3 steps)"] and config.progress_monitor.step_complete("x", 1)


def test_engine_loader_defaults(manifests):
    pytest.importorskip("polygraphy.backend.trt")
    root, m = manifests["clover"]
    loader = engine_loader(
        fake_tensorrt("10.13.3.9"),
        root / "draft_step.onnx",
        profiles_for("draft_step", m.graphs["draft_step"], LIMITS),
        timing_cache=root / "no-such.cache",
    )
    config = loader._config
    assert config.timing_cache_path is None  # a missing cache file is not read (it is created by the save)
    assert config.progress_monitor is None and loader.timing_cache_path is None
    assert config.memory_pool_limits == {"MemoryPoolType.WORKSPACE": DEFAULT_WORKSPACE_BYTES}


class FakeLoader:
    """Stands in for the loader chain: runs `during` (if given), writes `cache` into the timing-cache file it was
    given and returns `plan`, or raises `plan` if it is an exception. Records the cache folder's entries."""

    def __init__(self, plan, cache, seen, during=None):
        self.plan, self.cache, self.seen, self.during = plan, cache, seen, during

    def __call__(self, trt, onnx_path, profiles, *, workspace, timing_cache, save_timing_cache, progress):
        def run():
            if timing_cache is not None:
                self.seen.append(sorted(os.listdir(timing_cache.parent)))
            if self.during is not None:
                self.during()
            if isinstance(self.plan, Exception):
                raise self.plan
            if save_timing_cache is not None:
                save_timing_cache.write(self.cache)
            return self.plan

        return run


def test_build_engine_replaces_the_timing_cache_atomically(tmp_path, monkeypatch):
    """Each build writes the timing cache into a temporary sibling of its own, renamed over the shared file once
    its engine is built: two exports at once never share a temporary file and the last to finish leaves a whole
    file. A failed build leaves the cache as it was and no temporary behind. Polygraphy's errors become one
    CloverError line."""
    pytest.importorskip("polygraphy")
    from polygraphy.exception import PolygraphyException

    cache = tmp_path / "tensorrt" / "timing.cache"
    seen = []
    build = lambda: engines.build_engine(None, tmp_path / "base.onnx", (), cache, print)  # noqa: E731
    inner = FakeLoader(b"plan-inner", b"timings-inner", seen)

    def other_export():  # a second export sharing the cache, started and finished during the first one's build
        monkeypatch.setattr(engines, "engine_loader", inner)
        assert build() == b"plan-inner"
        assert cache.read_bytes() == b"timings-inner"

    monkeypatch.setattr(engines, "engine_loader", FakeLoader(b"plan-outer", b"timings-outer", seen, other_export))
    assert build() == b"plan-outer"
    assert cache.read_bytes() == b"timings-outer"  # the last to finish, whole
    outer_tmp, both_tmp = seen
    assert len(outer_tmp) == 1 and outer_tmp[0].startswith(".timing.cache.") and outer_tmp[0].endswith(".tmp")
    assert len([n for n in both_tmp if n.endswith(".tmp")]) == 2  # two temporaries side by side
    failed = PolygraphyException("Invalid Engine. Please ensure the engine was built correctly\nmore")
    monkeypatch.setattr(engines, "engine_loader", FakeLoader(failed, b"never", seen))
    with pytest.raises(CloverError) as e:
        build()
    assert str(e.value).startswith("TensorRT could not build an engine from base.onnx: Invalid Engine. Please ensure")
    assert "\n" not in str(e.value) and "--backend onnx" in str(e.value)
    assert cache.read_bytes() == b"timings-outer"
    assert sorted(os.listdir(cache.parent)) == ["timing.cache"]  # no temporary left


def test_build_engine_without_a_timing_cache(tmp_path, monkeypatch):
    pytest.importorskip("polygraphy")
    monkeypatch.setattr(engines, "engine_loader", FakeLoader(b"plan", b"", []))
    assert engines.build_engine(None, tmp_path / "base.onnx", (), None, print) == b"plan"
    assert list(tmp_path.iterdir()) == []


# -- on a GPU with TensorRT (make test-gpu) ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(no_tensorrt_gpu() is not None, reason=str(no_tensorrt_gpu()))
@pytest.mark.parametrize("attention", ["portable", "plugin"])
def test_build_engines_on_a_gpu(tmp_path_factory, tmp_path, attention):
    """The loader chain run for real: an engine with the artifact's profiles and I/O, the timing cache written
    (no temporary left), the builder's phases reported; with the tree-attention plugin too."""
    from clover.runtime.backends import tensorrt as rt

    src = tiny_artifact(tmp_path_factory.getbasetemp(), "clover", attention=attention, shared_lm_head=False)
    root = tmp_path / "artifact"
    shutil.copytree(src, root)
    m = read_manifest(root)
    lines = []
    built = build_engines(root, {"base": m.graphs["base"]}, "float32", LIMITS, tmp_path / "timing.cache", lines.append)
    spec = built["base"]
    assert spec.profiles == profiles_for("base", m.graphs["base"], LIMITS) and spec.file == "engines/base.engine"
    assert (tmp_path / "timing.cache").stat().st_size > 0
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    engine = rt.deserialize_engine(root / spec.file)
    assert engine.num_optimization_profiles == 2
    assert rt.engine_io(engine) == (
        {t.name: (True, t.dtype) for t in m.graphs["base"].inputs}
        | {t.name: (False, t.dtype) for t in m.graphs["base"].outputs}
    )
    assert any(line.startswith("      TensorRT: ") for line in lines)  # the progress monitor reported phases
