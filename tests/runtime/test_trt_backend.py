"""TensorRT backend: binding tables and profile choice from real tiny artifacts' manifests (no TensorRT
needed), the no-TensorRT errors, lazy imports, and the runner's profiles on the CPU (ort_helpers.cpu_runner).
Token identity on every runner, real TensorRT engines included: tests/runtime/test_runners.py."""

import argparse
import dataclasses
import sys

import pytest
from helpers import assert_identical, run_python, run_tokens
from ort_helpers import PROMPTS, TRT_LIMITS, cpu_runner, tiny_artifact

from clover.artifact import read_manifest, uses_exported_heads
from clover.errors import CloverError
from clover.export.engines import profiles_for
from clover.runtime.backend import backend_module
from clover.runtime.backends import trt as trt_backend
from clover.runtime.backends.trt import (
    BindingTable,
    check_engine_io,
    graphs_used,
    load_runner,
    max_slots,
)
from clover.runtime.tree import resolve_tree
from clover.tools.cli import run_cli
from clover.trt import MISSING

LIMITS = TRT_LIMITS  # cpu_runner's engines


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
    monkeypatch.setattr(
        trt_backend, "require_tensorrt", lambda: None
    )  # past the install check, before any TensorRT call
    with pytest.raises(
        CloverError,
        match=r"has no TensorRT engines \(exported with --backend onnx\): export it with "
        "clover-export --backend trt",
    ):
        load_runner(artifacts["clover"])
    with pytest.raises(CloverError, match="holds float32 engines, not float16"):
        load_runner(artifacts["clover"], dtype="float16")


def test_importing_the_backend_needs_neither_tensorrt_nor_torch():
    code = (
        "import sys\n"
        "sys.modules['tensorrt'] = None\n"
        "import clover.runtime.backends.trt, clover.runtime.backends.tensorrt, clover.export.engines, clover.plugins.trt_plugin\n"
        "from clover.runtime.backend import backend_module\n"
        "assert backend_module('trt').__name__ == 'clover.runtime.backends.trt'\n"
        "bad = [m for m in ('torch', 'onnxruntime', 'triton') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    assert run_python(code).strip() == "ok"


def test_tensorrt_imports_form_no_loop():
    """clover.trt is the bottom of the TensorRT import graph (it imports nothing of clover but clover.errors), and
    the runtime's TensorRT module imports no plugin and no export code."""
    code = (
        "import sys\n"
        "import clover.trt\n"
        "print(sorted(m for m in sys.modules if m.startswith('clover.')))\n"
        "import clover.runtime.backends.tensorrt\n"
        "print(sorted(m for m in sys.modules if m.startswith(('clover.plugins', 'clover.export'))))\n"
    )
    assert run_python(code).split("\n")[:2] == ["['clover.errors', 'clover.trt']", "[]"]


def test_no_tensorrt_builder_code_in_the_runtime():
    """The runtime loads and runs engines; building them is clover.export.engines' (Polygraphy)."""
    import pathlib

    import clover.runtime

    builder_api = (
        "Builder(",
        "create_network",
        "OnnxParser",
        "build_serialized_network",
        "create_builder_config",
        "create_optimization_profile",
        "timing_cache",
        "IProgressMonitor",
        "import polygraphy",
        "from polygraphy",
    )
    for path in sorted(pathlib.Path(clover.runtime.__file__).parent.glob("*.py")):
        text = path.read_text()
        assert not [a for a in builder_api if a in text], path.name


def test_backend_is_registered():
    assert backend_module("trt").__name__ == "clover.runtime.backends.trt"


# -- the runner's profiles on the CPU ------------------------------------------------------------------------


def test_runner_profiles_by_prompt_length(artifacts):
    """A short prompt and plain steps fit the tighter verify profile; a prompt longer than any tree runs the
    prefill profile, then verify; a tree larger than the engines' max_tree has no profile. The engines' slot
    limit is the runner's context."""
    from clover.runtime.backends.ort import load_runner as load_ort

    plain, plain_engines = cpu_runner(artifacts["clover2"], use_heads=False)
    assert plain.info.backend == "trt" and plain.info.max_context == LIMITS.max_context
    run_tokens(plain, PROMPTS[0], resolve_tree("plain"), 12)
    assert set(plain_engines["base"].calls) == {"verify"}  # the 5-token prompt too
    limits = dataclasses.replace(LIMITS, max_tree=8, max_accepted=4, max_candidates=4)
    runner, engines = cpu_runner(artifacts["clover2"], limits=limits)
    prompt = list(range(10, 40))  # 30 tokens: more than max_tree, so the prefill profile
    want, _ = run_tokens(load_ort(artifacts["clover2"], heads="none"), prompt, resolve_tree("plain"), 12)
    got, _ = run_tokens(runner, prompt, resolve_tree("chain-3"), 12)
    assert_identical(got, want, "long prompt")
    assert engines["base"].calls[0] == "prefill" and set(engines["base"].calls[1:]) == {"verify"}
    with pytest.raises(CloverError, match="has no optimization profile"):
        run_tokens(runner, prompt, resolve_tree("mc26"), 4)  # a 26-node tree exceeds max_tree 8
