"""What the GPU path does on this GPU, measured: the rows `clover-doctor --full` adds (and `make gpu-check` runs).

Nothing here needs weights from anywhere: the models are random decoders of real shapes (SmolLM2-135M and a
Llama-3.2-1B-shaped one) and the doctor's tiny model, so the check runs unchanged on an air-gapped host with torch
and Triton alone. Each measurement returns a one-line detail for the doctor's table and a dict for its JSON report.

    kernel_rows        the Triton tree-attention kernel against the torch reference (fp16, bf16) on the runtime's
                       trees, at 135M / 1B / 8B attention shapes, and its time against SDPA with a dense mask
    identity           greedy speculative == plain, token for token: medusa / clover / clover2 random heads,
                       a chain and a branching tree, batch 1 and the engine at concurrency 8, eager and CUDA graphs
    verify_curve       ms per forward by verify rows (1 .. 64) at KV length 256 and 1024, eager and CUDA graphs:
                       the runner's wall time (what the loop waits for, logits to the host included) and the GPU's
    host_time          the step loop's ms per step, the GPU's busy time in it and the idle fraction between kernels
    projection         decode speedup per tree: GPU step times of these shapes times the tokens per step the
                       shipped heads reach on the CPU (benchmarks/results), labelled a projection
    tree_auto          the curve `tree="auto"` calibrates on the GPU runner and the levels it picks with it
    engine_step        the per-sequence runner, the stacked runner with the whole step on the device and
                       transformers' generate, side by side: plain tokens/s and GPU idle, speculative over plain step
                       cost (135M, 8B shapes), engine c32 over c1, identity at concurrency 1/8/32
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from clover.models.config import BaseConfig, RopeConfig
from clover.models.decoder import Decoder, rope_inv_freq
from clover.runtime.params import EngineOptions, GenerationParams
from clover.runtime.sampling import SamplingParams
from clover.tools.bench import first_difference

# Real models' shapes, random weights. SmolLM2-135M-Instruct's config, and Llama-3.2-1B's.
SHAPES: dict[str, BaseConfig] = {
    "135m": BaseConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=100000.0),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "1b": BaseConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
}
ATTENTION_SHAPES = {"135m": (9, 3, 64), "1b": (32, 8, 64), "8b": (32, 8, 128)}  # (Hq, Hkv, D)
KERNEL_TREES = ("plain", "chain-2", "small", "mc26", "chain-63")  # 1, 3, 10, 26, 64 nodes
KERNEL_TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2}  # max abs error vs the fp32 reference (unit-variance data)
CURVE_ROWS = (1, 2, 4, 8, 16, 32, 64)
CURVE_KV = (256, 1024)
ARCHS = ("medusa", "clover", "clover2")
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
# clover-bench runs of the shipped Clover-2 heads on the fp32 SmolLM2 artifact (CPU): tokens per step by tree
CPU_ACCEPTANCE = (
    "bench_fp32_2026-11-27_mtbench.json",
    "bench_fp32_2026-11-27_code.json",
    "bench_fp32_2026-11-27_dynamic_mtbench.json",
    "bench_fp32_2026-11-27_dynamic_code.json",
)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- models ----------------------------------------------------------------------------------------------------


def random_decoder(cfg: BaseConfig, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> Decoder:
    """A Decoder of `cfg`'s shape with random weights made on `device`: embeddings N(0, 1), matrices
    N(0, 2 / sqrt(fan_in)), norms 1. At SmolLM2's shape its greedy text varies (no loop on one token) and the top-2
    logit margin is ~3.6 at the median (fp32 rounding on a GPU is ~1e-4 there)."""
    with torch.device("meta"):
        model = Decoder(cfg)
    gen = torch.Generator(device).manual_seed(seed)
    state = {}
    for name, p in model.named_parameters():
        if p.ndim == 1:
            state[name] = torch.ones(p.shape, dtype=dtype, device=device)
        else:
            std = 1.0 if "embed" in name else 2.0 / p.shape[1] ** 0.5
            state[name] = (torch.randn(p.shape, generator=gen, device=device) * std).to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.rope_dim).to(device), persistent=False)
    return model.eval().requires_grad_(False)


def moved(module: torch.nn.Module, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `module` on `device` in `dtype`, RoPE frequencies kept in fp32 (as load_base keeps them)."""
    out = copy.deepcopy(module).to(device=device, dtype=dtype)
    for m in out.modules():
        if isinstance(getattr(m, "inv_freq", None), torch.Tensor):
            m.inv_freq = m.inv_freq.float()
    return out


def word_tokenizer(folder: Path, vocab: int):
    from clover.runtime.tokenizer import Tokenizer
    from clover.tools.doctor import tiny_tokenizer

    return Tokenizer.from_dir(tiny_tokenizer(folder, vocab))


def runners(base: Decoder, heads, name: str, graphs: bool):
    from clover.runtime.backends.torch_runner import TorchRunner

    return TorchRunner(base, heads, name, cuda_graphs=graphs), TorchRunner(base, cuda_graphs=graphs)


# -- the tree-attention kernel ---------------------------------------------------------------------------------


def kernel_inputs(
    Hq: int, Hkv: int, D: int, mask: np.ndarray, P: int, dtype: torch.dtype, device: str, seed: int = 0
) -> dict:
    """B=1, the whole cache of P valid (the kernel's worst case: it skips only slots past the length)."""
    from clover.plugins.tree_attention import pack_tree_mask

    T = mask.shape[0]
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    return dict(
        q=rnd(1, Hq, T, D),
        k=rnd(1, Hkv, T, D),
        v=rnd(1, Hkv, T, D),
        past_k=rnd(1, Hkv, P, D),
        past_v=rnd(1, Hkv, P, D),
        past_lengths=torch.tensor([P], dtype=torch.int32, device=device),
        packed_mask=pack_tree_mask(torch.from_numpy(np.array(mask))[None]).to(device),
        scale=D**-0.5,
    )


def sdpa_dense(inputs: dict) -> Callable[[], torch.Tensor]:
    """The portable graphs' attention: SDPA over concat(past, new) with a dense boolean mask (built once per step,
    outside the timed call, as a graph shares it across layers)."""
    from clover.plugins.tree_attention import unpack_tree_mask

    q = inputs["q"]
    P, T = inputs["past_k"].shape[2], q.shape[2]
    past_ok = torch.arange(P, device=q.device) < inputs["past_lengths"].view(-1, 1)  # [B, P]
    tree = unpack_tree_mask(inputs["packed_mask"], T)  # [B, T, T]
    dense = torch.cat([past_ok.unsqueeze(1).expand(-1, T, P), tree], dim=-1).unsqueeze(1)  # [B, 1, T, P + T]

    def run():
        keys = torch.cat([inputs["past_k"], inputs["k"]], dim=2)  # [B, Hkv, P + T, D]
        values = torch.cat([inputs["past_v"], inputs["v"]], dim=2)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=dense, scale=inputs["scale"], enable_gqa=True)

    return run


def time_ms(fn: Callable[[], Any], iters: int, graph: bool = True) -> float:
    """Mean GPU milliseconds per call: CUDA events around `iters` calls replayed from one CUDA graph (no launch
    overhead, as in an engine), or launched eagerly (graph=False)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: Triton compiles, SDPA picks its kernels
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        g.replay()
        run = g.replay
    else:

        def run():
            for _ in range(iters):
                fn()

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernel_rows(
    device: str = "cuda",
    shapes: Sequence[str] = tuple(ATTENTION_SHAPES),
    trees: Sequence[str] = KERNEL_TREES,
    pasts: Sequence[int] = CURVE_KV,
    iters: int = 30,
    timed_past: int | None = max(CURVE_KV),
    dtypes: Sequence[torch.dtype] = (torch.float16, torch.bfloat16),
) -> list[dict]:
    """The Triton kernel against the fp32 torch reference at every cache length, and at `timed_past` (None: none)
    its time against SDPA with a dense mask."""
    from clover.plugins.tree_attention import tree_attention_reference
    from clover.plugins.triton_tree_attention import tree_attention_triton
    from clover.runtime.tree import resolve_tree

    rows = []
    for shape in shapes:
        Hq, Hkv, D = ATTENTION_SHAPES[shape]
        for dtype in dtypes:
            for name in trees:
                tree = resolve_tree(name)
                for P in pasts:
                    x = kernel_inputs(Hq, Hkv, D, tree.ancestor_mask, P, dtype, device, seed=tree.num_nodes + P)
                    ref = tree_attention_reference(**x).float()
                    err = (tree_attention_triton(**x).float() - ref).abs().max().item()
                    row = {
                        "shape": shape,
                        "num_q_heads": Hq,
                        "num_kv_heads": Hkv,
                        "head_dim": D,
                        "dtype": str(dtype).removeprefix("torch."),
                        "tree": name,
                        "new_tokens": tree.num_nodes,
                        "past": P,
                        "max_abs_err": err,
                        "tolerance": KERNEL_TOL[dtype],
                        "correct": bool(err <= KERNEL_TOL[dtype]),
                    }
                    if P == timed_past:
                        triton_us = 1e3 * time_ms(lambda: tree_attention_triton(**x), iters)  # noqa: B023
                        sdpa_us = 1e3 * time_ms(sdpa_dense(x), iters)
                        row.update(
                            triton_us=round(triton_us, 2),
                            sdpa_dense_us=round(sdpa_us, 2),
                            speedup=round(sdpa_us / triton_us, 3),
                        )
                    rows.append(row)
    return rows


# -- greedy identity -------------------------------------------------------------------------------------------


def prompts(vocab: int, n: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(8, vocab, length).tolist() for _ in range(n)]


def identity(
    cpu_base: Decoder,
    tokenizer,
    device: str,
    graphs: bool,
    tokens: int = 32,
    concurrency: int = 8,
    archs: Sequence[str] = ARCHS,
    seed: int = 0,
) -> dict:
    """Greedy speculative tokens against plain greedy tokens of the same runner kind, per head type and tree
    (a chain and a branching tree, as deep as the heads draft): batch 1 (Generator) and `concurrency` requests at
    once through one Engine, on `device` in fp32. `cpu_base`: the model, on the CPU (heads are made from it there).
    Returns {"cases": [...], "ok": bool}."""
    from clover.models.head_io import random_heads
    from clover.runtime.engine import Engine
    from clover.runtime.generator import Generator
    from clover.runtime.loop import chain
    from clover.runtime.tree import default_tree

    cases = []
    plain_cache: dict[tuple[int, ...], list[int]] = {}
    base = moved(cpu_base, device, torch.float32)
    work = prompts(base.config.vocab_size, concurrency, seed=seed)
    for arch in archs:
        heads = moved(random_heads(cpu_base, arch, seed=seed), device, torch.float32)
        spec, plain = runners(base, heads, f"random:{arch}:{seed}", graphs)
        depth = heads.config.max_depth or 4
        for tree in (chain(min(3, depth)), default_tree(depth)):
            gen_spec, gen_plain = Generator(spec, tokenizer, tree), Generator(plain, tokenizer)
            for p in work:
                if tuple(p) not in plain_cache:
                    plain_cache[tuple(p)] = gen_plain.generate(
                        p, GenerationParams(max_new_tokens=tokens, ignore_eos=True)
                    ).token_ids
            t0 = time.perf_counter()
            one = gen_spec.generate(work[0], GenerationParams(max_new_tokens=tokens, ignore_eos=True))
            solo_s = time.perf_counter() - t0
            with Engine(spec, tokenizer, tree=tree, log=None, options=EngineOptions(max_batch=concurrency)) as engine:
                t0 = time.perf_counter()
                streams = [engine.stream(p, GenerationParams(max_new_tokens=tokens, ignore_eos=True)) for p in work]
                many = [s.wait() for s in streams]
                engine_s = time.perf_counter() - t0
            want = [plain_cache[tuple(p)] for p in work]
            diffs = [first_difference(r.token_ids, w) if r.token_ids != w else None for r, w in zip(many, want)]
            margins = [None if d is None else margin_at(plain, p + w, len(p) + d) for p, w, d in zip(work, want, diffs)]
            cases.append(
                {
                    "arch": arch,
                    "tree": tree.name,
                    "nodes": tree.num_nodes,
                    "graphs": graphs,
                    "batch1_identical": one.token_ids == want[0],
                    "batch1_first_difference": None
                    if one.token_ids == want[0]
                    else first_difference(one.token_ids, want[0]),
                    "batch1_margin_there": None
                    if one.token_ids == want[0]
                    else margin_at(plain, work[0] + want[0], len(work[0]) + first_difference(one.token_ids, want[0])),
                    "batch1_tokens_per_step": round(one.tokens_per_step, 3),
                    "batch1_seconds": round(solo_s, 3),
                    "engine_identical": f"{sum(d is None for d in diffs)}/{len(diffs)}",
                    "engine_first_differences": diffs,
                    "engine_margins_there": margins,
                    "engine_seconds": round(engine_s, 3),
                    "engine_tokens_per_step": round(float(np.mean([r.tokens_per_step for r in many])), 3),
                }
            )
    ok = all(
        c["batch1_identical"] and c["engine_identical"].split("/")[0] == c["engine_identical"].split("/")[1]
        for c in cases
    )
    return {"tokens": tokens, "concurrency": concurrency, "cases": cases, "ok": ok}


def margin_at(runner, ids: list[int], index: int) -> float:
    """The top-2 logit margin of plain greedy decoding where token `index` of `ids` was chosen (a mismatch report's
    second number: how near a tie the diverging token was)."""
    runner.reset(len(ids) + 1)
    logits = runner.forward(np.array(ids[:index]), np.arange(index), np.tri(index, dtype=bool), last_only=True)
    top = np.sort(logits[-1])
    return round(float(top[-1] - top[-2]), 6)


def identity_line(result: dict) -> str:
    cases = result["cases"]
    n1 = sum(c["batch1_identical"] for c in cases)
    ne = sum(int(c["engine_identical"].split("/")[0]) for c in cases)
    te = sum(int(c["engine_identical"].split("/")[1]) for c in cases)
    tps = max(c["batch1_tokens_per_step"] for c in cases)
    return (
        f"{len(cases)} cases ({', '.join(dict.fromkeys(c['arch'] for c in cases))} x chain + tree): batch 1 "
        f"{n1}/{len(cases)} identical, engine x{result['concurrency']} {ne}/{te}; up to {tps:.2f} tokens/step"
    )


# -- the verify-cost curve -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CurvePoint:
    rows: int
    runner_ms: float  # median wall time of runner.forward: what the loop waits for (logits to the host included)
    gpu_ms: float  # mean GPU time of the forward alone (CUDA events)


def curve(base: Decoder, graphs: bool, kv: int, rows: Sequence[int] = CURVE_ROWS, reps: int = 7) -> list[CurvePoint]:
    """ms per verify forward of R new rows (a chain) after `kv` cached tokens, one sequence."""
    from clover.runtime.backends.torch_runner import ForwardGraph, TorchRunner, row_bucket

    runner = TorchRunner(base, cuda_graphs=graphs)
    V, rng = base.config.vocab_size, np.random.default_rng(0)
    slot = runner.open_slot(kv + max(rows) + 2)
    chunk = 256  # a long prompt in chunks: eager forwards of a bounded size
    for start in range(0, kv, chunk):
        n = min(chunk, kv - start)
        ids = rng.integers(0, V, n)
        runner.forward(ids, np.arange(n), np.tri(n, dtype=bool), last_only=True, slot=slot)
        runner.commit(np.arange(n), ids, slot=slot)
    points = []
    for R in rows:
        tokens, depths, mask = rng.integers(0, V, R), np.arange(R), np.tri(R, dtype=bool)
        runner.forward(tokens, depths, mask, slot=slot)  # warm-up (and the graph's capture)
        walls = []
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.forward(tokens, depths, mask, slot=slot)
            walls.append(time.perf_counter() - t0)
        seq = slot.state
        if not torch.cuda.is_available():
            gpu = float("nan")
        elif graphs and R <= runner.max_graph_rows:
            graph: ForwardGraph = seq.graphs[row_bucket(R)]
            gpu = time_ms(graph.graph.replay, reps, graph=False)
        else:
            keys, values = seq.cache
            P = slot.past
            args = (
                torch.as_tensor(tokens, device=base.lm_head.weight.device)[None],
                torch.as_tensor(P + depths, device=base.lm_head.weight.device)[None],
                torch.as_tensor(mask, device=base.lm_head.weight.device)[None],
                torch.tensor([P], device=base.lm_head.weight.device),
            )
            with torch.inference_mode():
                gpu = time_ms(
                    lambda: runner.base(*args, [k[:, :, :P] for k in keys], [v[:, :, :P] for v in values]),  # noqa: B023
                    reps,
                    graph=False,
                )
        points.append(CurvePoint(R, round(1e3 * statistics.median(walls), 4), round(gpu, 4)))
    runner.release(slot)
    runner.close()
    return points


def curve_line(curves: dict[str, list[CurvePoint]]) -> str:
    parts = []
    for key, pts in curves.items():
        one, top = pts[0], pts[-1]
        parts.append(
            f"{key}: 1 row {one.runner_ms:.2f} ms, {top.rows} rows {top.runner_ms:.2f} ms "
            f"({top.runner_ms / one.runner_ms:.2f}x)"
        )
    return "; ".join(parts)


# -- the step loop's host time ---------------------------------------------------------------------------------


def gpu_busy_ms(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(fn's result, wall ms, ms of GPU kernels) of one call, the kernels summed from torch's profiler (CUPTI)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # kernels only: CPU-op records would slow the loop
        t0 = time.perf_counter()
        out = fn()
        sync()
        wall = time.perf_counter() - t0
    # kernels and copies on the device (one stream here, so they never overlap)
    busy_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return out, 1e3 * wall, busy_us / 1e3


def host_time(base: Decoder, heads, tokenizer, trees: Sequence[str], graphs: bool, tokens: int = 40) -> list[dict]:
    """Per tree: the loop's ms per step (Generator, batch 1), the GPU's kernel time in it and the idle share."""
    from clover.runtime.generator import Generator
    from clover.runtime.tree import resolve_tree

    spec, plain = runners(base, heads, "random:clover2:0", graphs)
    prompt = prompts(base.config.vocab_size, 1, length=32, seed=1)[0]
    out = []
    for name in trees:
        tree = resolve_tree(name)
        gen = Generator(plain if tree.num_nodes == 1 else spec, tokenizer, None if tree.num_nodes == 1 else tree)
        run = lambda: gen.generate(prompt, GenerationParams(max_new_tokens=tokens, ignore_eos=True))  # noqa: E731, B023
        gen.generate(
            prompt, GenerationParams(max_new_tokens=8, ignore_eos=True)
        )  # warm-up: graphs recorded, kernels compiled
        sync()
        t0 = time.perf_counter()
        result = run()
        sync()
        wall_ms = 1e3 * (time.perf_counter() - t0)
        # The profiler slows every launch down, so it only counts the kernels' time; the wall time is the run above.
        _, _, busy_ms = gpu_busy_ms(run) if torch.cuda.is_available() else (None, 0.0, float("nan"))
        steps = max(result.steps, 1)
        out.append(
            {
                "tree": name,
                "nodes": tree.num_nodes,
                "graphs": graphs,
                "steps": result.steps,
                "step_ms": round(1e3 * float(np.mean(result.step_seconds)), 3),
                "gpu_busy_ms_per_step": round(busy_ms / steps, 3),
                "gpu_idle_fraction": round(max(0.0, 1 - busy_ms / wall_ms), 3),
                "tokens_per_step": round(result.tokens_per_step, 3),
                "phase_ms_per_step": {k: round(1e3 * v / steps, 3) for k, v in result.timings.items()},
            }
        )
    return out


def host_line(rows: list[dict]) -> str:
    parts = []
    for r in rows:
        mode = "graphs" if r["graphs"] else "eager"
        parts.append(f"{r['tree']} {mode} {r['step_ms']:.2f} ms/step, GPU idle {100 * r['gpu_idle_fraction']:.0f}%")
    return "; ".join(parts)


# -- projection from the CPU's acceptance ----------------------------------------------------------------------


def cpu_acceptance(results: Path = RESULTS) -> list[dict]:
    """Tokens per step (bonus included) the shipped Clover-2 heads reached on the CPU per fixed tree and draft
    source, from clover-bench's JSON (fp32 SmolLM2, 16 prompts each of MT-Bench and code)."""
    rows, seen = [], set()
    for name in CPU_ACCEPTANCE:
        doc = json.loads((results / name).read_text())
        prompts_name = "code" if "code" in name else "mtbench"
        for r in doc["results"]:
            # heads' trees of a fixed shape (a dynamic tree's shape follows the heads' confidence, which random
            # weights lack; lookup alone runs without heads)
            key = (prompts_name, r["heads"], r["tree"])
            if r["heads"].startswith("smollm2-clover2") and not r["tree"].startswith("dynamic") and key not in seen:
                seen.add(key)
                rows.append(
                    {
                        "prompts": prompts_name,
                        "drafts": r["heads"],
                        "tree": r["tree"],
                        "tokens_per_step": r["acceptance_length"],
                        "cpu_speedup": r["speedup"],
                        "source": name,
                    }
                )
    return rows


def projection(step_ms: dict[tuple[str, bool], float], acceptance: list[dict]) -> list[dict]:
    """Projected decode speedup per (tree, draft source, prompts): tokens per step on the CPU times the GPU's plain
    step time over its step time for that tree (same loop, same shapes, random weights)."""
    out = []
    for a in acceptance:
        for graphs in (False, True):
            plain, tree = step_ms.get(("plain", graphs)), step_ms.get((a["tree"], graphs))
            if plain is None or tree is None:
                continue
            out.append(
                {
                    **a,
                    "graphs": graphs,
                    "gpu_plain_step_ms": plain,
                    "gpu_tree_step_ms": tree,
                    "projected_speedup": round(a["tokens_per_step"] * plain / tree, 3),
                }
            )
    return out


def projection_line(rows: list[dict]) -> str:
    best = {}
    for r in rows:
        key = (r["prompts"], r["graphs"])
        if key not in best or r["projected_speedup"] > best[key]["projected_speedup"]:
            best[key] = r
    return "; ".join(
        f"{p} {'graphs' if g else 'eager'}: {r['drafts']} {r['tree']} {r['projected_speedup']:.2f}x"
        for (p, g), r in sorted(best.items())
    )


# -- tree auto -------------------------------------------------------------------------------------------------


def cpu_depth_rates(results: Path = RESULTS) -> dict[str, list[float]]:
    """The shipped Clover-2 heads' replay on MT-Bench (CPU, fp32 SmolLM2): per depth, how often the base's token
    is the heads' top-1 and within their top-3, the prefix being the base's own tokens (so: given the parent
    was accepted)."""
    doc = json.loads((results / CPU_ACCEPTANCE[0]).read_text())
    replay = doc["replay"]["smollm2-clover2"]["ort"]
    return {"top1": replay["top1"], "top3": replay["top3"]}


def tree_auto(base: Decoder, heads, tokenizer, graphs: bool, top1: Sequence[float], top3: Sequence[float]) -> dict:
    """The verify-cost curve `tree="auto"` calibrates on this runner at start-up, and the level its policy rates
    best (expected tokens over verify and drafting time) for a sequence whose per-depth acceptance is the shipped
    heads' on the CPU: rank 0 accepted at top1[d], ranks 1 and 2 at half of top3[d] - top1[d] each, others never."""
    from clover.runtime.engine import Engine
    from clover.runtime.policy import AutoTrees

    spec, _ = runners(base, heads, "random:clover2:0", graphs)
    with Engine(spec, tokenizer, tree="auto", log=None, options=EngineOptions(max_batch=1)) as engine:
        policy: AutoTrees = engine.policy
        rows_ms = policy.cost.to_dict()["rows_ms"]
        q = np.zeros(policy.engine.hits.shape)
        q[0] = 1.0
        for d in range(1, q.shape[0]):
            i = min(d - 1, len(top1) - 1)
            q[d, 0] = top1[i]
            q[d, 1:3] = (top3[i] - top1[i]) / 2
        expected = policy.expected_tokens(q)
        nodes = np.array([t.num_nodes for t in policy.levels])
        cost = np.array([policy.cost.curve(int(n)) for n in nodes]) + np.maximum.accumulate(policy.draft_ms)
        level = int(np.argmax(expected / cost))
    return {
        "rows_ms": rows_ms,
        "levels": [t.name for t in policy.levels],
        "nodes": nodes.tolist(),
        "expected_tokens": np.round(expected, 3).tolist(),
        "step_ms": np.round(cost, 3).tolist(),
        "picked_level": level,
        "picked_tree": policy.levels[level].name,
        "picked_nodes": int(nodes[level]),
        "top1": list(top1),
        "top3": list(top3),
    }


# -- the stacked runner's step against the others -------------------------------------------------------------

LLAMA_8B = dataclasses.replace(
    SHAPES["1b"],
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
    SHAPES["135m"], vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=512,
)  # fmt: skip


def make_runner(kind: str, base, heads, graphs: bool):
    from clover.runtime.backends.torch_batch import BatchedTorchRunner
    from clover.runtime.backends.torch_runner import TorchRunner

    name = "random:clover2:0" if heads is not None else "none"
    if kind == "batched":
        return BatchedTorchRunner(base, heads, name, cuda_graphs=graphs)
    return TorchRunner(base, heads, name, cuda_graphs=graphs)


def decode(gen, prompt: list[int], tokens: int, busy: bool) -> dict:
    """One generate call after a warm-up: tokens/s, ms per step, tokens per step, and the GPU's idle share."""
    params = GenerationParams(max_new_tokens=tokens, ignore_eos=True)
    gen.generate(prompt, dataclasses.replace(params, max_new_tokens=8))  # graphs recorded, kernels compiled
    sync()
    t0 = time.perf_counter()
    result = gen.generate(prompt, params)
    sync()
    wall = time.perf_counter() - t0
    out = {
        "tok_s": round(len(result.token_ids) / wall, 1),
        "step_ms": round(1e3 * float(np.mean(result.step_seconds)), 3),
        "tokens_per_step": round(result.tokens_per_step, 3),
        "token_ids": result.token_ids,
    }
    if busy:  # the profiler slows launches: it only counts the kernels' time, against the wall time above
        _, _, busy_ms = gpu_busy_ms(lambda: gen.generate(prompt, params))
        out["gpu_idle"] = round(max(0.0, 1 - busy_ms / (1e3 * wall)), 3)
    return out


def engine_rate(
    runner, tokenizer, tree, prompts: list[list[int]], tokens: int, sampling: SamplingParams | None = None
) -> tuple[float, list[list[int]]]:
    """Tokens/s of len(prompts) requests at once through one Engine, and their tokens; `sampling`: their logits
    processors (and then their log-probabilities too: 5 alternatives each)."""
    from clover.runtime.engine import Engine

    params = GenerationParams(max_new_tokens=tokens, ignore_eos=True)
    if sampling is not None:
        params = dataclasses.replace(params, sampling=sampling, logprobs=5)
    options = EngineOptions(max_batch=len(prompts))
    with Engine(runner, tokenizer, tree=tree, log=None, options=options) as engine:
        engine.stream(prompts[0], dataclasses.replace(params, max_new_tokens=8)).wait()  # warm-up
        sync()
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
    sync()
    t0 = time.perf_counter()
    out = run(tokens)
    sync()
    return tokens / (time.perf_counter() - t0), out[0, len(prompt) :].tolist()


def public_run(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "token_ids"}


def engine_step(
    device: str, quick: bool, tokens: int, row: Callable[[str, Any], None], figure: Callable[[str, Any], None]
) -> None:
    """The decoding step side by side in one run (benchmarks/gpu_step.py, and clover-doctor --full's engine row):
    TorchRunner (the base's forward in CUDA graphs), BatchedTorchRunner (the whole step on the device, one graph) and
    transformers' `generate` on the same random weights; `row(name, value)` takes each measurement as it is made,
    `figure(key, value)` the summary figures (the GPU report's `data.engine`). quick: a tiny model (the CPU test)."""
    from clover.models.head_io import random_heads
    from clover.runtime.tree import default_tree

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens = 12 if quick else tokens
    shape, small = (TINY, "tiny") if quick else (SHAPES["135m"], "135m")
    tokenizer = word_tokenizer(Path(tempfile.mkdtemp()), shape.vocab_size)
    work = prompts(shape.vocab_size, 32, length=32, seed=1)
    step = _StepRun(device, dtype, tokens, work, tokenizer, small, row, figure)

    # -- 135M: batch 1, plain and speculative, per runner; the engine; transformers; identity ------------------------
    cpu_base = random_decoder(shape, torch.float32, "cpu")
    base = moved(cpu_base, device, dtype)
    heads = moved(random_heads(cpu_base, "clover2", 0), device, dtype)
    tree = default_tree(None)
    best = _batch_one(step, base, heads, tree)
    _engine_concurrency(step, base, heads, tree)
    _transformers_generate(step, base, best)
    _stacked_identity(step, cpu_base, base, tree)
    del base, heads, cpu_base

    _big_step(step, quick)


class _StepRun(NamedTuple):
    """What engine_step's parts share: where and how long they decode, the 135M shape's prompts, tokenizer and
    name in the rows, and where the measurements go."""

    device: str
    dtype: torch.dtype
    tokens: int
    work: list[list[int]]
    tokenizer: Any
    small: str
    row: Callable[[str, Any], None]
    figure: Callable[[str, Any], None]

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def _batch_one(step: _StepRun, base, heads, tree) -> dict:
    """Batch 1, plain and speculative, on both runners: the rows and figures, and the stacked runner's plain run
    (the reference the transformers rows compare with)."""
    from clover.runtime.generator import Generator

    cuda, row, figure = step.cuda, step.row, step.figure
    runs = {}
    for kind in ("per-sequence", "batched"):
        for spec in (False, True):
            runner = make_runner(kind, base, heads if spec else None, cuda)
            gen = Generator(runner, step.tokenizer, tree if spec else None)
            runs[kind, spec] = decode(gen, step.work[0], step.tokens, cuda)
            if kind == "batched" and cuda:  # a step that could not be recorded ran eagerly: say why
                runs[kind, spec]["graphs"] = runner.graphs_error or "recorded"
            row(f"{step.small} {kind} {'spec ' + tree.name if spec else 'plain'} batch 1", public_run(runs[kind, spec]))
    best = runs["batched", False]
    same = all(r["token_ids"] == best["token_ids"] for r in runs.values())
    row(f"{step.small} batch 1 tokens identical (plain, speculative, both runners)", same)
    figure("plain_tok_s_135m", best["tok_s"])
    if cuda:
        figure("gpu_idle_plain", best["gpu_idle"])
    figure("spec_over_plain_135m", runs["batched", True]["step_ms"] / best["step_ms"])
    return best


def _engine_concurrency(step: _StepRun, base, heads, tree) -> None:
    """The engine at concurrency 1 and 32 on the stacked runner: both rates and whether the first request's
    tokens agree."""
    runner = make_runner("batched", base, heads, step.cuda)
    one, one_ids = engine_rate(runner, step.tokenizer, tree, step.work[:1], step.tokens)
    many, many_ids = engine_rate(runner, step.tokenizer, tree, step.work[:32], step.tokens)
    step.row(
        f"{step.small} engine c1 / c32 tokens/s",
        {"c1": round(one, 1), "c32": round(many, 1), "same": many_ids[0] == one_ids[0]},
    )
    step.figure("c32_over_c1_135m", many / one)


def _transformers_generate(step: _StepRun, base, best: dict) -> None:
    """transformers' generate on the same weights (eager, and with a compiled static cache on CUDA) against the
    stacked runner's plain run `best`; a row saying why when transformers is not installed."""
    cuda, row, work, tokens, small = step.cuda, step.row, step.work, step.tokens, step.small
    try:
        model = hf_twin(base)
        hf = {"eager": hf_rate(model, work[0], tokens, static=False)}
        if cuda:
            hf["static compiled"] = hf_rate(model, work[0], tokens, static=True)
        row(f"{small} transformers generate tokens/s", {k: round(v[0], 1) for k, v in hf.items()})
        row(f"{small} transformers tokens == clover plain", {k: v[1] == best["token_ids"] for k, v in hf.items()})
        step.figure("over_hf_compiled", best["tok_s"] / hf["static compiled" if cuda else "eager"][0])
        del model
    except ImportError as e:
        row(f"{small} transformers generate tokens/s", f"not run: {e}")


def _stacked_identity(step: _StepRun, cpu_base, base, tree) -> None:
    """Speculative == plain through the engine on the stacked runner: every head type at concurrency 1, 8 and
    32, then Clover-2 with logits processors and log-probabilities."""
    from clover.models.head_io import random_heads
    from clover.runtime.backends.torch_batch import BatchedTorchRunner
    from clover.runtime.tree import prune_tree, resolve_tree

    device, dtype, cuda = step.device, step.dtype, step.cuda
    tokenizer, work, tokens = step.tokenizer, step.work, step.tokens
    cases = []
    for arch in ARCHS:
        h = moved(random_heads(cpu_base, arch, 0), device, dtype)
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
    # logits processors on every tree row and log-probabilities in the step's copy back (their own graphs)
    h = moved(random_heads(cpu_base, "clover2", 0), device, dtype)
    procs = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, logit_bias={5: 2.0, 7: -1.0})
    _, got = engine_rate(BatchedTorchRunner(base, h, cuda_graphs=cuda), tokenizer, tree, work[:8], tokens, procs)
    _, want = engine_rate(BatchedTorchRunner(base, cuda_graphs=cuda), tokenizer, None, work[:8], tokens, procs)
    cases.append(
        {
            "arch": "clover2",
            "tree": f"{tree.name}, penalties, logit bias, log-probabilities",
            "concurrency": 8,
            "identical": f"{sum(g == w for g, w in zip(got, want))}/8",
        }
    )
    step.row("identity, stacked runner", cases)
    step.figure("identity_ok", all(c["identical"].split("/")[0] == c["identical"].split("/")[1] for c in cases))


def _big_step(step: _StepRun, quick: bool) -> None:
    """The 8B shape: one speculative step (mc26, full and 32k draft vocabulary) against a plain one, and the
    speedup that projects with the shipped heads' tokens per step on the CPU."""
    from clover.models.head_io import build_heads
    from clover.runtime.backends.torch_batch import BatchedTorchRunner
    from clover.runtime.generator import Generator
    from clover.runtime.tree import resolve_tree

    device, cuda, work = step.device, step.cuda, step.work
    big, large = (TINY, "tiny") if quick else (LLAMA_8B, "8b")
    base = random_decoder(big, step.dtype, device)
    with torch.device(device):  # untrained weights: its step time, not its drafts, is measured
        heads = build_heads(base, "clover2").to(step.dtype).eval().requires_grad_(False)
    mc26, n = resolve_tree("mc26"), min(step.tokens, 64)
    tokenizer = word_tokenizer(Path(tempfile.mkdtemp()), big.vocab_size)
    plain = decode(Generator(BatchedTorchRunner(base, cuda_graphs=cuda), tokenizer), work[1], n, cuda)
    spec = decode(Generator(BatchedTorchRunner(base, heads, cuda_graphs=cuda), tokenizer, mc26), work[1], n, cuda)
    # the heads' LM head over a 32k draft vocabulary (EAGLE-3's size for Llama 3): a quarter of its weight read
    vocab = np.arange(min(32768, big.vocab_size), dtype=np.int64)
    small = BatchedTorchRunner(base, heads, draft_vocab=vocab, cuda_graphs=cuda)
    spec_k = decode(Generator(small, tokenizer, mc26), work[1], n, cuda)
    step.row(
        f"{large} batch 1 ms per step: plain, mc26, mc26 with a {len(vocab)}-token draft vocabulary",
        {"plain": plain["step_ms"], "mc26": spec["step_ms"], "mc26 draft vocab": spec_k["step_ms"]},
    )
    step.figure("spec_over_plain_8b_full_vocab", spec["step_ms"] / plain["step_ms"])
    ratio = spec_k["step_ms"] / plain["step_ms"]
    step.figure("spec_over_plain_8b", ratio)
    cpu = {r["tree"]: r["tokens_per_step"] for r in cpu_acceptance() if r["prompts"] == "mtbench"}
    if mc26.name in cpu:  # the shipped heads' tokens per step on the CPU (MT-Bench) over the step's cost
        step.figure("projected_speedup_8b", cpu[mc26.name] / ratio)
