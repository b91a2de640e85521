"""The decoding step on a GPU, side by side in one run: clover's per-sequence torch runner (TorchRunner, the base's
forward in CUDA graphs), its stacked runner with the whole step on the device (BatchedTorchRunner, draft -> verify ->
accept -> commit in one CUDA graph), and transformers' `generate` (eager, and with its static cache, compiled) on the
same random weights of real shapes.

Rows, each written to the JSON report as soon as it is measured (a run cut short keeps what it measured):
  plain, batch 1        tokens/s, ms per step, the GPU's idle share of the step loop (135M shape)
  speculative, batch 1  ms per step of the default tree over the plain step's (135M; the 8B shape with mc26), and the
                        8B speedup projected with the shipped heads' tokens per step on the CPU
  engine                tokens/s at concurrency 1 and 32 (135M, the default tree), tokens identical
  identity              greedy speculative == plain for every head type on the stacked runner, batch 1 and the
                        engine at concurrency 8 and 32
  transformers          generate's tokens/s on the same weights, and clover's plain over its compiled one

    python benchmarks/gpu_step.py [--device cuda] [--json PATH]     # a GPU: bf16, CUDA graphs
    python benchmarks/gpu_step.py --device cpu --quick              # the same code on a tiny model (tests run it)

The summary's keys are the GPU report's `data.engine` (clover-doctor --full adds them there).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from clover.models.head_io import build_heads, random_heads
from clover.runtime.engine import Engine
from clover.runtime.generator import Generator
from clover.runtime.params import EngineOptions, GenerationParams
from clover.runtime.torch_backend import TorchRunner
from clover.runtime.torch_batch import BatchedTorchRunner
from clover.runtime.tree import default_tree, prune_tree, resolve_tree
from clover.tools import gpu_profile as gp
from clover.tools.machine import host

RESULTS = Path(__file__).parent / "results"
LLAMA_8B = dataclasses.replace(
    gp.SHAPES["1b"],
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
)
TINY = dataclasses.replace(
    gp.SHAPES["135m"], vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=512,
)  # fmt: skip


class Report:
    """The JSON report, rewritten after every row."""

    def __init__(self, path: Path, device: str) -> None:
        self.path = path
        gpu = torch.cuda.get_device_name() if device == "cuda" else None
        self.data: dict = {
            "date": datetime.date.today().isoformat(),
            "gpu": gpu,
            "host": host(),
            "rows": {},
            "engine": {},
        }

    def row(self, name: str, value) -> None:
        self.data["rows"][name] = value
        print(f"{name}: {json.dumps(value)[:300]}", flush=True)
        self.write()

    def figure(self, key: str, value: float) -> None:
        self.data["engine"][key] = round(float(value), 3)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def make_runner(kind: str, base, heads, graphs: bool):
    name = "random:clover2:0" if heads is not None else "none"
    if kind == "batched":
        return BatchedTorchRunner(base, heads, name, cuda_graphs=graphs)
    return TorchRunner(base, heads, name, cuda_graphs=graphs)


def decode(gen: Generator, prompt: list[int], tokens: int, busy: bool) -> dict:
    """One generate call after a warm-up: tokens/s, ms per step, tokens per step, and the GPU's idle share."""
    params = GenerationParams(max_new_tokens=tokens, ignore_eos=True)
    gen.generate(prompt, dataclasses.replace(params, max_new_tokens=8))  # graphs recorded, kernels compiled
    gp.sync()
    t0 = time.perf_counter()
    result = gen.generate(prompt, params)
    gp.sync()
    wall = time.perf_counter() - t0
    out = {
        "tok_s": round(len(result.token_ids) / wall, 1),
        "step_ms": round(1e3 * float(np.mean(result.step_seconds)), 3),
        "tokens_per_step": round(result.tokens_per_step, 3),
        "token_ids": result.token_ids,
    }
    if busy:  # the profiler slows launches: it only counts the kernels' time, against the wall time above
        _, _, busy_ms = gp.gpu_busy_ms(lambda: gen.generate(prompt, params))
        out["gpu_idle"] = round(max(0.0, 1 - busy_ms / (1e3 * wall)), 3)
    return out


def engine_rate(runner, tokenizer, tree, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """Tokens/s of len(prompts) requests at once through one Engine, and their tokens."""
    params = GenerationParams(max_new_tokens=tokens, ignore_eos=True)
    options = EngineOptions(max_batch=len(prompts))
    with Engine(runner, tokenizer, tree=tree, log=None, options=options) as engine:
        engine.stream(prompts[0], dataclasses.replace(params, max_new_tokens=8)).wait()  # warm-up
        gp.sync()
        t0 = time.perf_counter()
        results = [s.wait() for s in [engine.stream(p, params) for p in prompts]]
        wall = time.perf_counter() - t0
    return sum(len(r.token_ids) for r in results) / wall, [r.token_ids for r in results]


def hf_twin(base):
    """transformers' Llama with `base`'s weights (its fused projections split back)."""
    import transformers

    c = base.config
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope.theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
    )  # fmt: skip
    state = {}
    for name, t in base.state_dict().items():
        if ".qkv_proj." in name:
            q, k, v = t.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim])
            for part, w in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
                state["model." + name.replace("qkv_proj", part)] = w
        elif ".gate_up_proj." in name:
            for part, w in zip(("gate_proj", "up_proj"), t.chunk(2)):
                state["model." + name.replace("gate_up_proj", part)] = w
        elif name != "lm_head.weight" or not c.tie_word_embeddings:
            state[name if name.startswith("lm_head") else "model." + name] = t
    w = base.lm_head.weight
    with torch.device(w.device):
        model = transformers.LlamaForCausalLM(cfg).to(w.dtype)
    model.load_state_dict(state, strict=False)
    return model.eval()


def hf_rate(model, prompt: list[int], tokens: int, static: bool) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt], device=model.device)
    extra = {"cache_implementation": "static"} if static else {}
    run = lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **extra)  # noqa: E731
    run(tokens)  # warm-up (the static cache's compile)
    gp.sync()
    t0 = time.perf_counter()
    out = run(tokens)
    gp.sync()
    return tokens / (time.perf_counter() - t0), out[0, len(prompt) :].tolist()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="a tiny model, few tokens (the CPU test)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens = 12 if args.quick else args.tokens
    stamp = datetime.date.today().isoformat()
    report = Report(args.json or RESULTS / f"gpu_step_{stamp}.json", args.device)
    shape, small, large = (TINY, "tiny", "tiny") if args.quick else (gp.SHAPES["135m"], "135m", "8b")
    tokenizer = gp.word_tokenizer(Path(tempfile.mkdtemp()), shape.vocab_size)
    work = gp.prompts(shape.vocab_size, 32, length=32, seed=1)

    # -- 135M: batch 1, plain and speculative, per runner ------------------------------------------------------------
    cpu_base = gp.random_decoder(shape, torch.float32, "cpu")
    base = gp.moved(cpu_base, args.device, dtype)
    heads = gp.moved(random_heads(cpu_base, "clover2", 0), args.device, dtype)
    tree = default_tree(None)
    runs = {}
    for kind in ("per-sequence", "batched"):
        for spec in (False, True):
            runner = make_runner(kind, base, heads if spec else None, cuda)
            gen = Generator(runner, tokenizer, tree if spec else None)
            runs[kind, spec] = decode(gen, work[0], tokens, cuda)
            report.row(f"{small} {kind} {'spec ' + tree.name if spec else 'plain'} batch 1", _public(runs[kind, spec]))
    best = runs["batched", False]
    same = all(r["token_ids"] == best["token_ids"] for r in runs.values())
    report.row(f"{small} batch 1 tokens identical (plain, speculative, both runners)", same)
    report.figure("plain_tok_s_135m", best["tok_s"])
    if cuda:
        report.figure("gpu_idle_plain", best["gpu_idle"])
    report.figure("spec_over_plain_135m", runs["batched", True]["step_ms"] / best["step_ms"])

    # -- the engine: concurrency 1 and 32 --------------------------------------------------------------------------
    runner = make_runner("batched", base, heads, cuda)
    one, one_ids = engine_rate(runner, tokenizer, tree, work[:1], tokens)
    many, many_ids = engine_rate(runner, tokenizer, tree, work[:32], tokens)
    report.row(
        f"{small} engine c1 / c32 tokens/s",
        {"c1": round(one, 1), "c32": round(many, 1), "same": many_ids[0] == one_ids[0]},
    )
    report.figure("c32_over_c1_135m", many / one)

    # -- transformers' generate on the same weights ---------------------------------------------------------------
    try:
        model = hf_twin(base)
        hf = {"eager": hf_rate(model, work[0], tokens, static=False)}
        if cuda:
            hf["static compiled"] = hf_rate(model, work[0], tokens, static=True)
        report.row(f"{small} transformers generate tokens/s", {k: round(v[0], 1) for k, v in hf.items()})
        report.row(
            f"{small} transformers tokens == clover plain", {k: v[1] == best["token_ids"] for k, v in hf.items()}
        )
        report.figure("over_hf_compiled", best["tok_s"] / hf["static compiled" if cuda else "eager"][0])
        del model
    except ImportError as e:
        report.row(f"{small} transformers generate tokens/s", f"not run: {e}")

    # -- identity on the stacked runner -----------------------------------------------------------------------------
    cases = []
    for arch in gp.ARCHS:
        h = gp.moved(random_heads(cpu_base, arch, 0), args.device, dtype)
        t = prune_tree(resolve_tree("small"), h.config.max_depth or 99)
        spec_runner = BatchedTorchRunner(base, h, f"random:{arch}:0", cuda_graphs=cuda)
        plain_runner = BatchedTorchRunner(base, cuda_graphs=cuda)
        for c in (1, 8, 32):
            _, got = engine_rate(spec_runner, tokenizer, t, work[:c], tokens)
            _, want = engine_rate(plain_runner, tokenizer, None, work[:c], tokens)
            cases.append(
                {
                    "arch": arch,
                    "tree": t.name,
                    "concurrency": c,
                    "identical": f"{sum(g == w for g, w in zip(got, want))}/{c}",
                }
            )
    report.row("identity, stacked runner", cases)
    report.data["engine"]["identity_ok"] = all(
        c["identical"].split("/")[0] == c["identical"].split("/")[1] for c in cases
    )
    report.write()
    del base, heads, runner, cpu_base

    # -- 8B shape: one speculative step against a plain one -------------------------------------------------------
    big = TINY if args.quick else LLAMA_8B
    base = gp.random_decoder(big, dtype, args.device)
    with torch.device(args.device):  # untrained weights: its step time, not its drafts, is measured
        heads = build_heads(base, "clover2").to(dtype).eval().requires_grad_(False)
    mc26 = resolve_tree("mc26")
    plain = decode(Generator(BatchedTorchRunner(base, cuda_graphs=cuda), tokenizer), work[1], min(tokens, 64), cuda)
    spec = decode(
        Generator(BatchedTorchRunner(base, heads, cuda_graphs=cuda), tokenizer, mc26), work[1], min(tokens, 64), cuda
    )
    report.row(f"{large} batch 1 plain / spec mc26 ms per step", {"plain": plain["step_ms"], "mc26": spec["step_ms"]})
    ratio = spec["step_ms"] / plain["step_ms"]
    report.figure("spec_over_plain_8b", ratio)
    cpu = {r["tree"]: r["tokens_per_step"] for r in gp.cpu_acceptance() if r["prompts"] == "mtbench"}
    if mc26.name in cpu:  # the shipped heads' tokens per step on the CPU (MT-Bench) over the step's cost
        report.figure("projected_speedup_8b", cpu[mc26.name] / ratio)
    return report.data


def _public(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "token_ids"}


if __name__ == "__main__":
    main()
