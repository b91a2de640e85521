"""TensorRT backend: binding tables and profile choice from real tiny artifacts' manifests (no TensorRT
needed), the no-TensorRT errors, lazy imports; and, on a GPU machine with TensorRT, greedy token identity
of engines built from a tiny artifact against ONNX Runtime."""

import argparse
import dataclasses
import shutil
import sys

import pytest

from clover.errors import CloverError
from clover.export.engines import EngineLimits, profiles_for
from clover.runtime.artifact import EngineSpec, read_manifest, uses_exported_heads
from clover.runtime.backend import backend_module
from clover.runtime.tensorrt import MISSING
from clover.runtime.trt_backend import (
    BindingTable, check_engine_io, graphs_used, load_runner, max_slots,
)
from clover.tools.cli import run_cli
from helpers import run_python, run_tokens
from ort_helpers import PROMPTS, assert_same_tokens, tiny_artifact

LIMITS = EngineLimits(max_prompt=48, max_tree=26, max_context=128, max_accepted=5, max_candidates=10)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    # The graphs of a TensorRT artifact: each keeps its LM head (one engine per graph).
    return {arch: tiny_artifact(root, arch, shared_lm_head=False) for arch in ("medusa", "clover", "clover2")}


def table(artifact, name, limits=LIMITS):
    m = read_manifest(artifact)
    return BindingTable.of(name, m.graphs[name], profiles_for(name, m.graphs[name], limits))


def test_binding_table_shapes_and_sizes(artifacts):
    m = read_manifest(artifacts["clover2"])
    cfg = m.base_config
    t = table(artifacts["clover2"], "base")
    sizes = {"batch": 1, "new": 7, "rows": 7, "past": 64}
    shapes = t.input_shapes(sizes)
    assert shapes["input_ids"] == (1, 7) and shapes["tree_mask"] == (1, 7, 7) and shapes["logit_rows"] == (7,)
    assert shapes["past_key_values.1.value"] == (1, cfg["num_kv_heads"], 64, cfg["head_dim"])
    out = t.output_shapes(sizes)
    assert out["logits"] == (1, 7, cfg["vocab_size"]) and out["hidden_states"] == (1, 7, cfg["hidden_size"])
    assert out["present.0.key"] == (1, cfg["num_kv_heads"], 7, cfg["head_dim"])
    nbytes = t.nbytes(sizes)
    assert nbytes["tree_mask"] == 49 and nbytes["input_ids"] == 56
    assert nbytes["logits"] == 7 * cfg["vocab_size"] * 4
    # draft_step of clover: the static depth [] input is bound but has no shape to set
    step = table(artifacts["clover"], "draft_step")
    assert "depth" not in step.input_shapes({"candidates": 3})
    assert step.nbytes({"candidates": 3})["depth"] == 8


def test_profile_choice_by_new_tokens(artifacts):
    t = table(artifacts["clover"], "base")
    assert [p.name for p in t.profiles] == ["prefill", "verify"]
    pick = lambda new, rows, past: t.profiles[t.profile({"batch": 1, "new": new, "rows": rows, "past": past})].name
    assert pick(1, 1, 64) == "verify"  # a plain decoding step
    assert pick(26, 26, 128) == "verify"  # a full tree at the end of the context
    assert pick(5, 1, 0) == "verify"  # a short prompt fits the tighter profile
    assert pick(27, 1, 0) == "prefill"  # longer than any tree: prefill (last row only)
    assert pick(48, 1, 0) == "prefill"
    with pytest.raises(CloverError) as e:
        pick(27, 27, 0)  # every row's logits for more tokens than a tree: no profile
    msg = str(e.value)
    assert "TensorRT engine base has no optimization profile for batch 1, new 27, rows 27, past 0" in msg
    assert "prefill batch 1..1, new 1..48, rows 1..1, past 0..128" in msg and "verify" in msg
    assert "clover-export --backend trt" in msg and "\n" not in msg
    with pytest.raises(CloverError, match="new 49"):
        pick(49, 1, 0)
    with pytest.raises(CloverError, match="past 129"):
        pick(1, 1, 129)


def test_draft_profiles_and_slot_limits(artifacts):
    step = table(artifacts["clover2"], "draft_step")
    assert step.profile({"candidates": 10}) == 0
    with pytest.raises(CloverError, match="candidates 11"):
        step.profile({"candidates": 11})
    begin = table(artifacts["clover2"], "draft_begin")
    assert begin.profile({"batch": 1, "accepted": 48, "past": 0}) == 0  # the prefill's commit
    assert max_slots(begin) == max_slots(table(artifacts["clover2"], "base")) == LIMITS.max_context
    assert max_slots(step) > 1 << 40  # no cache


def test_graphs_used_and_heads_selection(artifacts):
    clover, medusa = read_manifest(artifacts["clover"]), read_manifest(artifacts["medusa"])
    assert graphs_used(clover, True) == ("base", "draft_begin", "draft_step")
    assert graphs_used(medusa, True) == ("base", "medusa_heads")
    assert graphs_used(clover, False) == ("base",)
    assert uses_exported_heads("a", clover, "artifact") and not uses_exported_heads("a", clover, "none")
    assert uses_exported_heads("a", clover, clover.heads.name)
    with pytest.raises(CloverError, match="cannot be added to an exported artifact"):
        uses_exported_heads("a", clover, "random:medusa")


def test_engine_io_must_match_the_manifest(artifacts):
    t = table(artifacts["clover2"], "draft_step")
    io = {b.name: (True, b.dtype) for b in t.inputs} | {b.name: (False, b.dtype) for b in t.outputs}
    check_engine_io(t, io, "engines/draft_step.engine")
    with pytest.raises(CloverError, match="engines/draft_step.engine does not match graph draft_step .* logits"):
        check_engine_io(t, io | {"logits": (False, "float16")}, "engines/draft_step.engine")


@pytest.fixture
def no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` now raises ImportError


def test_load_runner_without_tensorrt_is_one_clear_cli_error(artifacts, no_tensorrt, capsys):
    with pytest.raises(CloverError) as e:
        load_runner(artifacts["clover"])
    assert str(e.value) == MISSING
    assert "TensorRT is not installed" in MISSING and "--backend ort" in MISSING

    def run(_args):
        load_runner(artifacts["clover"], heads="none")
        return 0

    assert run_cli("clover-generate", argparse.ArgumentParser(), run, []) == 2
    assert capsys.readouterr().err == f"clover-generate: error: {MISSING}\n"


def test_load_runner_refuses_an_artifact_without_engines(artifacts, monkeypatch):
    import clover.runtime.tensorrt as rt

    monkeypatch.setattr(rt, "require_tensorrt", lambda: None)  # past the install check, before any TensorRT call
    with pytest.raises(CloverError, match=r"has no TensorRT engines \(exported with --backend onnx\): export it with "
                                          "clover-export --backend trt"):
        load_runner(artifacts["clover"])
    with pytest.raises(CloverError, match="holds float32 engines, not float16"):
        load_runner(artifacts["clover"], dtype="float16")


def test_importing_the_backend_needs_neither_tensorrt_nor_torch():
    code = (
        "import sys\n"
        "sys.modules['tensorrt'] = None\n"
        "import clover.runtime.trt_backend, clover.runtime.tensorrt, clover.export.engines, clover.plugins.trt_plugin\n"
        "from clover.runtime.backend import backend_module\n"
        "assert backend_module('trt').__name__ == 'clover.runtime.trt_backend'\n"
        "bad = [m for m in ('torch', 'onnxruntime', 'triton') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    assert run_python(code).strip() == "ok"


def test_backend_is_registered():
    assert backend_module("trt").__name__ == "clover.runtime.trt_backend"


# -- the runner's bookkeeping on the CPU -------------------------------------------------------------------

class OrtEngine:
    """Stands in for a TensorRT engine in the runner's bookkeeping tests, and says so: the same
    run(inputs, sizes) contract computed by ONNX Runtime on CPU torch tensors. It checks that every call
    fits one of the engine's optimization profiles and records which. TensorRT numerics are the GPU test's."""

    def __init__(self, root, name, graph, limits):
        ort = pytest.importorskip("onnxruntime")
        from clover.runtime.trt_backend import torch_dtype

        self.table = BindingTable.of(name, graph, profiles_for(name, graph, limits))
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(root / graph.file), opts, providers=["CPUExecutionProvider"])
        self.out_dtypes = {b.name: torch_dtype(b.dtype) for b in self.table.outputs}
        self.calls = []

    def has_input(self, name):
        return any(b.name == name for b in self.table.inputs)

    def run(self, inputs, sizes):
        import torch

        self.calls.append(self.table.profiles[self.table.profile(sizes)].name)
        for b in self.table.inputs:
            assert tuple(inputs[b.name].shape) == b.shape(sizes), (b.name, inputs[b.name].shape, sizes)
        names = [b.name for b in self.table.outputs]
        outs = self.session.run(names, {n: t.contiguous().numpy() for n, t in inputs.items()})
        shapes = self.table.output_shapes(sizes)
        assert all(o.shape == shapes[n] for n, o in zip(names, outs))
        return {n: torch.from_numpy(o) for n, o in zip(names, outs)}


def cpu_runner(artifact, use_heads=True, limits=LIMITS, cache_block=8):
    from clover.runtime.backend import Runner
    from clover.runtime.trt_backend import TrtRunner, graphs_used

    m = read_manifest(artifact)
    engines = {n: OrtEngine(artifact, n, m.graphs[n], limits) for n in graphs_used(m, use_heads)}
    runner = TrtRunner.__new__(TrtRunner)
    Runner.__init__(runner)
    runner._setup(m, use_heads, engines, "cpu", None, cache_block)
    return runner, engines


@pytest.mark.parametrize("arch", ["medusa", "clover", "clover2"])
def test_runner_bookkeeping_matches_the_ort_backend(artifacts, arch):
    """Same tokens and accepted lengths as OrtRunner with the same graphs: the cache growth, the 0-slot
    prefill past, on-device compaction, and draft states of TrtRunner (small cache_block: many doublings)."""
    from clover.runtime.ort_backend import load_runner as load_ort
    from clover.runtime.tree import resolve_tree
    plain, plain_engines = cpu_runner(artifacts[arch], use_heads=False)
    spec, engines = cpu_runner(artifacts[arch])
    assert spec.info.backend == "trt" and spec.info.heads == arch and spec.info.max_context == LIMITS.max_context
    ort_plain, ort_spec = load_ort(artifacts[arch], heads="none"), load_ort(artifacts[arch])
    tree = resolve_tree("chain-3") if arch == "clover" else resolve_tree("small")
    for p in PROMPTS:
        want, _ = run_tokens(ort_plain, p, resolve_tree("plain"), 30)
        assert_same_tokens(run_tokens(plain, p, resolve_tree("plain"), 30)[0], want, f"plain {arch}")
        got, steps = run_tokens(spec, p, tree, 30)
        assert_same_tokens(got, want, f"speculative {arch}")
        assert steps == run_tokens(ort_spec, p, tree, 30)[1]  # the same drafts: the same acceptance
    assert plain_engines["base"].calls[0] == "verify"  # a 5-token prompt fits the tighter profile
    assert set(plain_engines["base"].calls) == {"verify"}
    assert {"prefill", "verify"} >= set(engines["base"].calls)


def test_runner_prefill_profile_for_a_long_prompt(artifacts):
    from clover.runtime.tree import resolve_tree
    from clover.runtime.ort_backend import load_runner as load_ort
    limits = dataclasses.replace(LIMITS, max_tree=8, max_accepted=4, max_candidates=4)
    runner, engines = cpu_runner(artifacts["clover2"], limits=limits)
    prompt = list(range(10, 40))  # 30 tokens: more than max_tree, so the prefill profile
    want, _ = run_tokens(load_ort(artifacts["clover2"], heads="none"), prompt, resolve_tree("plain"), 12)
    got, _ = run_tokens(runner, prompt, resolve_tree("chain-3"), 12)
    assert_same_tokens(got, want, "long prompt")
    assert engines["base"].calls[0] == "prefill" and engines["base"].calls[1] == "verify"
    with pytest.raises(CloverError, match="has no optimization profile"):
        run_tokens(runner, prompt, resolve_tree("mc26"), 4)  # a 26-node tree exceeds max_tree 8


# -- on a GPU with TensorRT ---------------------------------------------------------------------------------

def _tensorrt_gpu() -> str | None:
    """Why the TensorRT tests cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        return "needs TensorRT (pip install tensorrt on a GPU machine)"
    try:
        import torch
    except ImportError as e:
        return f"needs torch ({e})"
    return None if torch.cuda.is_available() else "needs a CUDA GPU"


@pytest.mark.gpu
@pytest.mark.skipif(_tensorrt_gpu() is not None, reason=str(_tensorrt_gpu()))
@pytest.mark.parametrize("arch", ["medusa", "clover", "clover2"])
def test_trt_greedy_identity_with_onnx_runtime(artifacts, tmp_path, arch):
    from clover.export.engines import build_engines
    from clover.runtime.artifact import file_entries, write_manifest
    from clover.runtime.ort_backend import load_runner as load_ort
    from clover.runtime.tree import resolve_tree
    root = tmp_path / arch
    shutil.copytree(artifacts[arch], root)
    m = read_manifest(root)
    limits = EngineLimits(max_prompt=32, max_tree=26, max_context=m.max_context, max_accepted=6, max_candidates=10)
    engines = build_engines(root, m.graphs, m.dtype, limits, tmp_path / "timing.cache", lambda _: None)
    assert all(isinstance(e, EngineSpec) for e in engines.values())
    write_manifest(root, dataclasses.replace(m, backend="trt", engines=engines, files=file_entries(root)))
    ort_plain = load_ort(artifacts[arch], heads="none")
    with load_runner(root, heads="none") as plain, load_runner(root) as spec:
        assert spec.info.backend == "trt" and spec.info.heads == arch
        for p in PROMPTS:
            want, _ = run_tokens(ort_plain, p, resolve_tree("plain"), 24)
            got, _ = run_tokens(plain, p, resolve_tree("plain"), 24)
            assert_same_tokens(got, want, f"TRT plain {arch} vs ORT plain")
            tree = resolve_tree("chain-3") if arch == "clover" else resolve_tree("small")
            got, steps = run_tokens(spec, p, tree, 24)
            assert_same_tokens(got, want, f"TRT {arch} speculative vs ORT plain")
            assert all(1 <= s <= tree.max_depth + 1 for s in steps)
