"""ONNX Runtime execution providers (--providers): names and order checked, the CPU path unchanged, CUDA without
the CUDA provider (one-line error; cuda,cpu: one-line note and a CPU run), onnxruntime-gpu's silent CPU fallback
detected on a real session, and the CUDA path's binding by address and per-shape static buffers (CUDA graphs)
driven with torch CPU tensors. What needs a GPU (CUDA kernels, the stream, graph capture) is not run here."""

import json
import logging
import subprocess
import sys

import numpy as np
import pytest
from helpers import assert_identical, run_python, run_tokens
from ort_helpers import PROMPTS, tiny_artifact

from clover.artifact import open_artifact
from clover.errors import CloverError
from clover.runtime.backends import ort as ort_backend
from clover.runtime.backends.ort import (
    CPU,
    CUDA,
    CUDA_GRAPHS,
    OrtOptions,
    OrtRunner,
    Placement,
    check_session,
    load_runner,
    place,
)
from clover.runtime.tree import resolve_tree

ort = pytest.importorskip("onnxruntime")
N = 24
HAS_CUDA = CUDA in ort.get_available_providers()
needs_cpu_build = pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has the CUDA provider")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    return {arch: tiny_artifact(root, arch) for arch in ("medusa", "clover2")}


@pytest.fixture(scope="module")
def plain(artifacts):
    """Greedy tokens of plain decoding on the default (CPU) runner: the reference."""
    runner = load_runner(artifacts["clover2"], heads="none")
    return {tuple(p): run_tokens(runner, p, resolve_tree("plain"), N)[0] for p in PROMPTS}


def greedy(runner, tree=None):
    """Greedy tokens on `tree` (default: the artifact's own tree)."""
    tree = runner.info.default_tree if tree is None else resolve_tree(tree)
    return {tuple(p): run_tokens(runner, p, tree, N)[0] for p in PROMPTS}


def test_provider_names_are_checked():
    assert OrtOptions().providers == ("cpu",)
    assert OrtOptions(providers="cuda,cpu").providers == ("cuda", "cpu")
    assert OrtOptions(providers=" CUDA , cpu ").providers == ("cuda", "cpu")
    assert OrtOptions(providers=["cuda"]).providers == ("cuda",)
    for given, message in (
        ("gpu", "unknown execution provider 'gpu' in --providers 'gpu': choose from cuda, cpu"),
        ("cuda,tensorrt", "unknown execution provider 'tensorrt'"),
        ("", "unknown execution provider ''"),
        ("cuda,,cpu", "unknown execution provider ''"),
        ("cuda,cuda", "names a provider twice"),
        ("cpu,cuda", "lists cpu before cuda, which would then run nothing .* e.g. cuda,cpu"),
    ):
        with pytest.raises(CloverError, match=message):
            OrtOptions(providers=given)
    with pytest.raises(CloverError, match="CUDA graphs need the cuda provider"):
        OrtOptions(cuda_graphs=True)
    with pytest.raises(CloverError, match="CUDA device index >= 0"):
        OrtOptions(providers="cuda", device=-1)
    with pytest.raises(CloverError, match="unknown execution provider 'gpu'"):  # before the artifact is read
        load_runner("/nonexistent", providers="gpu")


def test_placement_from_what_onnxruntime_has():
    cuda_cpu = OrtOptions(providers="cuda,cpu")
    assert place(OrtOptions(), [CPU]) == Placement((CPU,), False)
    assert place(cuda_cpu, [CUDA, CPU]) == Placement((CUDA, CPU), True)
    assert place(OrtOptions(providers="cuda"), [CUDA, CPU]) == Placement((CUDA,), True)
    fallback = place(cuda_cpu, ["AzureExecutionProvider", CPU])
    assert fallback.providers == (CPU,) and not fallback.cuda
    assert fallback.note.startswith("--providers cuda,cpu: running on the CPU, as this onnxruntime")
    assert "has no CUDA execution provider (it has AzureExecutionProvider, CPUExecutionProvider)" in fallback.note
    assert "gpu extra" in fallback.note and "\n" not in fallback.note
    with pytest.raises(
        CloverError,
        match=r"no CUDA execution provider .*: for CUDA install the gpu extra in an "
        r"environment of its own \(onnxruntime-gpu cannot share one with onnxruntime\); "
        "or pass --providers cpu",
    ):
        place(OrtOptions(providers="cuda"), [CPU])


def test_default_and_explicit_cpu_provider_give_the_same_greedy_tokens(artifacts, plain):
    for arch, path in artifacts.items():
        for providers in (None, "cpu", ("cpu",)):
            runner = load_runner(path) if providers is None else load_runner(path, providers=providers)
            assert runner.placement == Placement((CPU,), False) and runner.stream is None
            assert all(g.session.get_providers() == [CPU] for g in (runner.base, *runner.drafter.graphs))
            got = greedy(runner)
            for p in PROMPTS:
                assert_identical(got[tuple(p)], plain[tuple(p)], f"{arch}, providers {providers}")


@needs_cpu_build
def test_cuda_without_the_cuda_provider_is_one_clear_line(artifacts):
    with pytest.raises(CloverError) as e:
        load_runner(artifacts["clover2"], providers="cuda")
    assert "has no CUDA execution provider" in str(e.value) and "gpu extra" in str(e.value)
    assert "\n" not in str(e.value)


@needs_cpu_build
def test_cuda_then_cpu_runs_on_the_cpu_and_says_so_once(artifacts, plain, caplog):
    with caplog.at_level(logging.WARNING, logger="clover.runtime.backends.ort"):
        runner = load_runner(artifacts["clover2"], providers="cuda,cpu")
    notes = [r.getMessage() for r in caplog.records if r.name == "clover.runtime.backends.ort"]
    assert notes == [runner.placement.note] and "running on the CPU" in notes[0] and "\n" not in notes[0]
    assert runner.placement.providers == (CPU,) and not runner.placement.cuda
    got = greedy(runner)
    for p in PROMPTS:
        assert_identical(got[tuple(p)], plain[tuple(p)], "cuda,cpu on a CPU build")


@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")
def test_silent_cpu_fallback_of_a_real_session_is_detected(artifacts):
    """A session asked for CUDA that got only the CPU (here: the CPU build, which warns and falls back, as
    onnxruntime-gpu does without the CUDA / cuDNN libraries) is flagged: cuda,cpu -> a note, cuda -> an error."""
    path = artifacts["clover2"] / open_artifact(artifacts["clover2"]).graphs["base"].file
    session = ort.InferenceSession(str(path), providers=[CUDA, CPU])
    assert session.get_providers() == [CPU]
    after = check_session(Placement((CUDA, CPU), True), session, "base.onnx")
    note = after.note
    assert after.providers == (CPU,) and not after.cuda
    assert "lists the CUDA execution provider, but created the session for base.onnx with CPUExecutionProvider" in note
    assert "CUDA 12/13 runtime or cuDNN 9 libraries were not found" in note and "onnxruntime.preload_dlls()" in note
    assert note.endswith("running on the CPU") and "\n" not in note
    with pytest.raises(CloverError, match="cuDNN 9 libraries were not found"):
        check_session(Placement((CUDA,), True), session, "base.onnx")
    cpu = ort.InferenceSession(str(path), providers=[CPU])
    assert check_session(Placement((CPU,), False), cpu, "base.onnx") == Placement((CPU,), False)


class FakeCuda:
    """Stands in for CudaDevice where torch has no CUDA: provider options only (no stream)."""

    def __init__(self, index):
        self.index, self.stream = index, None

    def provider_options(self, cuda_graph):
        return {"device_id": str(self.index)}


@pytest.mark.skipif(HAS_CUDA, reason="needs a CUDA provider that cannot start")
@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")
def test_the_runner_detects_the_silent_fallback(artifacts, plain, monkeypatch, caplog):
    """The whole path, as onnxruntime-gpu without its libraries: CUDA listed, sessions created on the CPU."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(ort_backend, "CudaDevice", FakeCuda)
    with caplog.at_level(logging.WARNING, logger="clover.runtime.backends.ort"):
        runner = load_runner(artifacts["clover2"], providers="cuda,cpu")
    assert runner.placement.providers == (CPU,) and "cuDNN 9 libraries were not found" in runner.placement.note
    assert [r.getMessage() for r in caplog.records if r.name == "clover.runtime.backends.ort"] == [
        runner.placement.note
    ]
    got = greedy(runner)
    for p in PROMPTS:
        assert_identical(got[tuple(p)], plain[tuple(p)], "silent fallback")
    with pytest.raises(CloverError, match="created the session for base.onnx with CPUExecutionProvider only"):
        load_runner(artifacts["clover2"], providers="cuda")


def test_cuda_needs_torch_with_cuda(artifacts, monkeypatch):
    """The CUDA path keeps its tensors in torch: a torch without CUDA is one line, before any session."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch has CUDA here")
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
    with pytest.raises(
        CloverError,
        match=r"torch .* sees no CUDA device .*: install torch with CUDA \(the gpu extra\), "
        "or pass --providers cpu",
    ):
        load_runner(artifacts["clover2"], providers="cuda,cpu")


class TorchCpuRunner(OrtRunner):
    """The CUDA path's tensors and bindings with the CPU standing in for the device: torch CPU tensors
    (TorchArrays) bound by address with device type "cpu"; `captured`: the head graphs run on per-shape static
    buffers as with CUDA graphs (the capture itself is the GPU's)."""

    def __init__(self, path, captured=False, options=OrtOptions()):
        self.captured = captured
        super().__init__(path, open_artifact(path), options=options)

    def _arrays(self, sessions):
        torch = pytest.importorskip("torch")
        from clover.runtime.backends.trt import TorchArrays

        arrays = sessions.bind_by_address("cpu", 0, TorchArrays(torch.device("cpu"), None))
        for graph in sessions.graphs:
            graph.cuda_graph = self.captured and graph.spec.file.removesuffix(".onnx") in CUDA_GRAPHS
        return arrays


@pytest.mark.parametrize("captured", [False, True], ids=["bound-by-address", "static-shapes"])
def test_binding_by_address_gives_the_same_greedy_tokens(artifacts, plain, captured):
    torch = pytest.importorskip("torch")
    for arch, path in artifacts.items():
        runner = TorchCpuRunner(path, captured)
        for tree in (None, "chain-3"):
            got = greedy(runner, tree)
            for p in PROMPTS:
                assert_identical(got[tuple(p)], plain[tuple(p)], f"{arch} {tree} by address, captured={captured}")
        assert isinstance(runner.cache.buffers[0], torch.Tensor)
        heads = runner.drafter.graphs[-1]  # medusa_heads / draft_step
        assert heads.device == ("cpu", 0)
        shapes = len(heads._captured)
        assert shapes == 0 if not captured else 1 <= shapes <= ort_backend.CUDA_GRAPH_SHAPES
        if captured:  # the uncaptured graphs bind by address as usual
            assert runner.base._captured == {} and not runner.base.cuda_graph


def test_cuda_graph_shapes_are_capped(artifacts, plain, monkeypatch):
    """Past CUDA_GRAPH_SHAPES shapes a graph's calls run uncaptured (and still right)."""
    pytest.importorskip("torch")
    monkeypatch.setattr(ort_backend, "CUDA_GRAPH_SHAPES", 1)
    runner = TorchCpuRunner(artifacts["clover2"], captured=True)
    got = greedy(runner, "small")
    for p in PROMPTS:
        assert_identical(got[tuple(p)], plain[tuple(p)], "one captured shape")
    assert len(runner.drafter.step_graph._captured) == 1


def test_fused_batched_forward_by_address_equals_numpy(tmp_path_factory):
    """The fused graph's in-place KV cache (its buffers bound as outputs too) and the batched graph's packed
    slots, bound by address: the same logits as with numpy arrays, at prefill and at a tree step."""
    pytest.importorskip("torch")
    from clover.runtime.backend import Verify

    path = tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", attention="fused")
    runners = [load_runner(path, batch=True), TorchCpuRunner(path, options=OrtOptions(batch=True))]
    assert all(r.batch is not None for r in runners)
    logits = []
    calls = []
    for runner in runners:
        run = runner.batch.run
        runner.batch.run = lambda *args, run=run: calls.append(1) or run(*args)
        slots = [runner.open_slot(64) for _ in PROMPTS]
        prefill = runner.forward_batch(
            [
                Verify(s, np.array(p), np.arange(len(p)), np.tri(len(p), dtype=bool), True)
                for s, p in zip(slots, PROMPTS)
            ]
        )
        for s, p, out in zip(slots, PROMPTS, prefill):
            runner.commit(np.arange(len(p)), np.array([*p[1:], int(out[-1].argmax())]), s)
        tree = resolve_tree("small")
        step = runner.forward_batch(
            [
                Verify(s, np.array([p[-1]] * tree.num_nodes), tree.depth, tree.ancestor_mask)
                for s, p in zip(slots, PROMPTS)
            ]
        )
        logits.append(prefill + step)
    assert len(calls) == 4  # prefill and the step, both slots in one call, on each runner
    for a, b in zip(*logits):
        np.testing.assert_array_equal(a, b)


def test_cuda_then_cpu_without_torch(artifacts, plain):
    """The CPU fallback of --providers cuda,cpu is the torch-free ORT path."""
    prompt = PROMPTS[0]
    code = (
        "import json, sys\n"
        "for name in ('torch', 'transformers', 'tensorrt'):\n"
        "    sys.modules[name] = None  # any import of them now raises ImportError\n"
        "import onnxruntime\n"
        f"onnxruntime.get_available_providers = lambda: {[CPU]!r}  # the CPU build, whatever is installed\n"
        "from clover.runtime.generator import Generator\n"
        "from clover.runtime.params import EngineOptions, GenerationParams\n"
        f"gen = Generator.load({str(artifacts['clover2'])!r}, backend='ort', options=EngineOptions(providers='cuda,cpu'))\n"
        f"print(json.dumps(gen.generate({prompt!r}, GenerationParams(max_new_tokens={N}, ignore_eos=True)).token_ids))\n"
    )
    assert json.loads(run_python(code)) == plain[tuple(prompt)]


# -- the CLIs ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,message",
    [
        (["--providers", "gpu"], "unknown execution provider 'gpu' in --providers 'gpu': choose from cuda, cpu"),
        (["--providers", "cpu,cuda"], "lists cpu before cuda"),
        (["--backend", "torch", "--base", "smollm2", "--providers", "cpu"], "use it with --backend ort, not torch"),
    ],
)
def test_generate_refuses_bad_providers_in_one_line(artifacts, capsys, args, message):
    from clover.tools.generate import main

    artifact = [] if "--base" in args else ["--artifact", str(artifacts["clover2"])]
    assert main([*artifact, "--prompt", "w7 w8", "--max-new-tokens", "2", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("clover-generate: error: ") and message in err and "\n" not in err


@needs_cpu_build
def test_generate_with_cuda_on_a_cpu_build(artifacts):
    """--providers cuda: exit 2 with one line; cuda,cpu: the run, and one line on stderr saying it is on the CPU."""

    def generate(providers):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "clover.tools.generate",
                "--artifact",
                str(artifacts["clover2"]),
                "--prompt",
                "w7 w8 w9",
                "--max-new-tokens",
                "6",
                "--json",
                "--providers",
                providers,
            ],
            capture_output=True,
            text=True,
        )

    failed = generate("cuda")
    assert failed.returncode == 2 and failed.stdout == ""
    assert failed.stderr.count("\n") == 1 and "clover-generate: error: this onnxruntime" in failed.stderr
    assert "has no CUDA execution provider" in failed.stderr
    ran = generate("cuda,cpu")
    assert ran.returncode == 0, ran.stderr
    lines = ran.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("--providers cuda,cpu: running on the CPU, as this onnxruntime")
    assert json.loads(ran.stdout)["new_tokens"] == 6


@needs_cpu_build
def test_bench_records_where_ort_ran(artifacts, tmp_path, capsys):
    from clover.tools.bench import main as bench_main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w10 w20 w30"}) + "\n")
    out = tmp_path / "bench.json"
    common = [
        "--artifact",
        str(artifacts["clover2"]),
        "--heads",
        "artifact",
        "--tree",
        "chain-2",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "6",
        "--no-chat",
    ]
    assert bench_main([*common, "--backend", "ort", "--providers", "cuda,cpu", "--json", str(out)]) == 0
    placement = json.loads(out.read_text())["ort_placement"]
    assert placement["providers"] == [CPU] and "running on the CPU" in placement["note"]
    assert bench_main([*common, "--backend", "torch", "--providers", "cpu"]) == 2
    assert "use it with --backend ort" in capsys.readouterr().err
