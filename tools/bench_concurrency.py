"""clover-bench --concurrency 1,2,4,8,16: throughput and latency of clover.Engine under N closed-loop streams.

For each concurrency N and each mode (plain, each --tree, auto), N caller threads submit the prompts one after
another (each prompt once), so N requests are in flight until the prompts run out. The prompts are split in
rounds of at least 2N, and every mode runs each round in turn (order rotated), so slow drifts of these shared
machines hit every mode alike.
With --control, a second plain engine ("plain-2", A/A) runs beside the first: the spread of two identical setups
measured in the same run is the noise floor any difference between modes has to clear.
Reported per (N, mode): aggregate output tokens/s, per-request tokens/s, time to first token and inter-token
latency (p50, p95), mean acceptance length (tokens per verify step, bonus included), and whether every request's
greedy tokens equal its own solo plain decoding (Generator, plain tree, same graphs).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clover import atomic
from clover.errors import CloverError
from clover.runtime.params import EngineOptions, GenerationParams
from clover.tools.bench import first_difference, ort_placement
from clover.tools.machine import host

BANDWIDTH_GBS = 27.0  # memory read bandwidth of the first AMD EPYC AVX-512 2-vCPU hosts measured (docs/experiments.md)
CONTROL = "plain-2"  # --control: a second plain engine (A/A)


def parse_concurrency(spec: str) -> list[int]:
    try:
        levels = [int(c) for c in spec.split(",") if c.strip()]
    except ValueError:
        raise CloverError(f"--concurrency takes comma-separated ints (e.g. 1,2,4,8,16), got {spec!r}") from None
    if not levels or min(levels) < 1:
        raise CloverError(f"--concurrency needs levels >= 1, got {spec!r}")
    return levels


def closed_loop(
    engine, prompts: list[str], concurrency: int, max_new_tokens: int, chat: bool
) -> tuple[list, float, list]:
    """Run every prompt once with `concurrency` callers; returns (results in prompt order, wall seconds,
    inter-token gaps in seconds, one per token after each request's first)."""
    results: list[Any] = [None] * len(prompts)
    gaps: list[float] = []
    lock = threading.Lock()
    nxt = iter(range(len(prompts)))
    errors: list[BaseException] = []

    def caller() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            try:
                stream = engine.stream(prompts[i], GenerationParams(max_new_tokens=max_new_tokens), chat=chat)
                last, mine = None, []
                for delta in stream:
                    now = time.perf_counter()
                    if last is not None and delta.token_ids:
                        mine += [(now - last) / len(delta.token_ids)] * len(delta.token_ids)
                    last = now
                results[i] = stream.result
                with lock:
                    gaps.extend(mine)
            except BaseException as e:  # reported after the threads end
                errors.append(e)
                return

    threads = [threading.Thread(target=caller) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, time.perf_counter() - t0, gaps


def rounds(num_prompts: int, concurrency: int) -> list[list[int]]:
    """Prompt indices split into rounds of at least 2 x concurrency prompts (every mode runs each round in
    turn, so slow drifts of a shared machine hit all modes alike; the last round takes the remainder)."""
    size = max(2 * concurrency, 4)
    chunks = [list(range(i, min(i + size, num_prompts))) for i in range(0, num_prompts, size)]
    if len(chunks) > 1 and len(chunks[-1]) < size:
        tail = chunks.pop()
        chunks[-1] += tail
    return chunks


def summarize(
    mode: str, concurrency: int, results: list, seconds: float, gaps: list[float], reference: list[list[int]]
) -> dict[str, Any]:
    new = sum(r.new_tokens for r in results)
    steps = sum(r.steps for r in results)
    emitted = sum(sum(r.accepted_per_step) for r in results)
    ttft = np.array([r.time_to_first_token for r in results]) * 1e3
    itl = np.array(gaps) * 1e3 if gaps else np.zeros(1)
    same = [i for i, r in enumerate(results) if r.token_ids == reference[i]]
    first_diff = {i: first_difference(r.token_ids, reference[i]) for i, r in enumerate(results) if i not in same}
    return {
        "mode": mode,
        "concurrency": concurrency,
        "tokens_per_second": round(new / seconds, 2),
        "per_request_tokens_per_second": round(float(np.mean([r.tokens_per_second for r in results])), 2),
        "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1),
        "ttft_p95_ms": round(float(np.percentile(ttft, 95)), 1),
        "itl_p50_ms": round(float(np.percentile(itl, 50)), 2),
        "itl_p95_ms": round(float(np.percentile(itl, 95)), 2),
        "acceptance_length": round(emitted / steps, 3) if steps else 0.0,
        # of the prompt tokens, those the prefix cache served (--prefix-cache-mb)
        "cached_prompt_share": round(
            sum(r.cached_tokens for r in results) / max(sum(r.prompt_tokens for r in results), 1), 4
        ),
        "identical_to_solo_plain": f"{len(same)}/{len(results)}",
        "mismatches": first_diff,
        "new_tokens": new,
        "seconds": round(seconds, 2),
    }


def weight_bytes(artifact: Path | None) -> int:
    """Bytes of the base weights a decode step reads (the base graph's files and the LM head's)."""
    if artifact is None:
        return 0
    from clover.artifact import base_weight_files, read_manifest

    return sum(f.stat().st_size for f in base_weight_files(artifact, read_manifest(artifact)))


@dataclass(frozen=True)
class _Setup:
    """What every measured run of one clover-bench --concurrency shares, read and checked from its flags."""

    levels: list[int]
    backend: str
    source: Any  # the artifact (ort) or the base checkpoint (torch)
    heads: str | None
    modes: list[str]
    max_batch: int
    chat: bool
    threads: dict[str, int]  # Runner keyword arguments: empty for the backend's default
    providers: dict[str, str]


def _setup(args: argparse.Namespace) -> _Setup:
    """The backend, source, modes and engine sizes from the flags, refusing what --concurrency cannot run."""
    from clover.runtime.engine import AUTO

    levels = parse_concurrency(args.concurrency)
    backend = args.backend
    if backend not in ("ort", "torch"):
        raise CloverError(
            f"--concurrency runs clover.Engine on one backend: use --backend ort or torch, not {backend!r}"
        )
    source = args.artifact if backend == "ort" else args.base
    if backend == "ort" and source is None:
        raise CloverError("--concurrency with --backend ort needs --artifact DIR (make one with clover-export)")
    heads = None if backend == "ort" else args.heads
    trees = [t.strip() for t in (args.tree or "").split(",") if t.strip()]
    modes = ["plain"] + ([CONTROL] if args.control else []) + [t for t in trees if t not in ("plain", AUTO)] + [AUTO]
    max_batch = args.max_batch or max(levels)
    chat = not args.no_chat
    threads = {"threads": args.threads} if args.threads else {}
    providers = {"providers": args.providers} if args.providers is not None else {}
    if providers and backend != "ort":
        raise CloverError("--providers chooses ONNX Runtime's execution providers: use it with --backend ort")
    return _Setup(levels, backend, source, heads, modes, max_batch, chat, threads, providers)


def _solo_reference(args: argparse.Namespace, setup: _Setup, prompts: list[str]) -> tuple[Any, list[list[int]]]:
    """Each prompt's greedy tokens from solo plain decoding (a Generator, no heads): what every batched request
    must equal. Returns the Generator too, for its placement in the report."""
    from tqdm import tqdm

    from clover.runtime.backend import backend_module
    from clover.runtime.generator import Generator
    from clover.runtime.tokenizer import Tokenizer

    module = backend_module(setup.backend)
    tok = Tokenizer.from_dir(module.base_dir(setup.source))
    solo = Generator(module.load_runner(setup.source, heads="none", **setup.threads, **setup.providers), tok, "plain")
    reference = [
        solo.generate(p, GenerationParams(max_new_tokens=args.max_new_tokens), chat=setup.chat).token_ids
        for p in tqdm(prompts, desc="solo plain", unit="prompt", dynamic_ncols=True)
    ]
    return solo, reference


def _load_engines(args: argparse.Namespace, setup: _Setup, prompts: list[str]) -> dict[str, Any]:
    """One warmed-up engine per mode (CONTROL: a second plain one)."""
    from clover.runtime.engine import Engine

    engines = {}
    for mode in setup.modes:
        engines[mode] = Engine.load(
            setup.source,
            heads=setup.heads,
            backend=setup.backend,
            tree="plain" if mode == CONTROL else mode,
            options=EngineOptions(
                max_batch=setup.max_batch,
                threads=args.threads,
                prefix_cache_mb=args.prefix_cache_mb,
                **setup.providers,
            ),
            log=None,
        )
        engines[mode].generate(prompts[0], GenerationParams(max_new_tokens=4), chat=setup.chat)  # warm-up off the clock
    return engines


def _measure(
    args: argparse.Namespace, setup: _Setup, prompts: list[str], engines: dict[str, Any], reference: list[list[int]]
) -> list[dict[str, Any]]:
    """One summary row per (concurrency, mode), each mode running every round of the prompts in turn."""
    from tqdm import tqdm

    modes, rows = setup.modes, []
    plan = [(n, rounds(len(prompts), n)) for n in setup.levels]
    with tqdm(
        total=sum(len(r) for _, r in plan) * len(modes), desc="concurrency", unit="run", dynamic_ncols=True
    ) as bar:
        for n, chunks in plan:
            got = {m: ([None] * len(prompts), 0.0, []) for m in modes}
            for k, chunk in enumerate(chunks):  # modes interleaved per round, their order rotated
                for mode in modes[k % len(modes) :] + modes[: k % len(modes)]:
                    results, seconds, gaps = closed_loop(
                        engines[mode], [prompts[i] for i in chunk], n, args.max_new_tokens, setup.chat
                    )
                    out, total, all_gaps = got[mode]
                    for i, r in zip(chunk, results):
                        out[i] = r
                    got[mode] = (out, total + seconds, all_gaps + gaps)
                    bar.update()
            for mode in modes:
                out, total, gaps = got[mode]
                rows.append(summarize(mode, n, out, total, gaps, reference))
    return rows


def _add_speedups(rows: list[dict[str, Any]], levels: list[int]) -> None:
    """Each row's throughput over plain's at its concurrency and at the first level (None where plain made none)."""
    base = {r["concurrency"]: r["tokens_per_second"] for r in rows if r["mode"] == "plain"}
    for r in rows:
        r["vs_plain"] = (
            round(r["tokens_per_second"] / base[r["concurrency"]], 3) if base.get(r["concurrency"]) else None
        )
        r["vs_concurrency1_plain"] = round(r["tokens_per_second"] / base[levels[0]], 3) if base.get(levels[0]) else None


def _write_and_report(args: argparse.Namespace, setup: _Setup, rows: list[dict[str, Any]], doc: dict) -> int:
    """Write --json and its plot, then name every run whose tokens differ from solo plain decoding (exit 1)."""
    bad = [r for r in rows if r["mismatches"]]
    if args.json:
        atomic.write_text(args.json, json.dumps(doc, indent=2) + "\n")
        png = args.json.with_suffix(".png")
        title = f"clover.Engine on {setup.backend}: {Path(str(setup.source)).name}"
        plot(rows, setup.modes, setup.levels, png, title)
        print(f"wrote {args.json} and {png}")
    for r in bad:
        print(
            f"clover-bench: {r['mode']} at concurrency {r['concurrency']} differs from solo plain decoding: "
            f"{r['mismatches']}"
        )
    return 1 if bad else 0


def run(args: argparse.Namespace, prompts: list[str]) -> int:
    from clover.runtime.engine import AUTO

    setup = _setup(args)
    solo, reference = _solo_reference(args, setup, prompts)
    engines = _load_engines(args, setup, prompts)
    try:
        rows = _measure(args, setup, prompts, engines, reference)
    finally:
        for e in engines.values():
            e.close()
    _add_speedups(rows, setup.levels)
    wb = weight_bytes(args.artifact if setup.backend == "ort" else None)
    bound = BANDWIDTH_GBS * 1e9 / wb if wb else None
    print_table(rows, bound, wb)
    auto_policy = engines[AUTO].policy
    doc = {
        "host": host(),
        "backend": setup.backend,
        "source": str(setup.source),
        "prompts": args.prompts,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "max_batch": setup.max_batch,
        "threads": args.threads,
        "chat": setup.chat,
        "ort_placement": ort_placement([(setup.backend, "none", solo)]),
        "weight_bytes": wb,
        "batch1_bandwidth_bound_tokens_per_second": round(bound, 1) if bound else None,
        "note": "closed loop: N callers each submit the next prompt when their last one ends; aggregate = all "
        "output tokens / wall time; acceptance_length = tokens per verify step, bonus included; "
        "identity: each request's greedy tokens vs its own solo plain decoding",
        "control": f"{CONTROL}: a second plain engine measured beside the first (A/A): their spread is this run's "
        "noise floor"
        if args.control
        else None,
        "auto_verify_cost": auto_policy.cost.to_dict() if hasattr(auto_policy, "cost") else None,
        "results": rows,
    }
    return _write_and_report(args, setup, rows, doc)


def print_table(rows: list[dict], bound: float | None, wb: int) -> None:
    head = (
        f"{'conc':>4} {'mode':10} {'tok/s':>8} {'vs plain':>8} {'vs c1':>6} {'req tok/s':>9} {'ttft p50':>8} "
        f"{'ttft p95':>8} {'itl p50':>7} {'itl p95':>7} {'acc len':>7} {'cached':>6} {'identical':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['concurrency']:>4} {r['mode']:10} {r['tokens_per_second']:>8.1f} {r['vs_plain']:>7.2f}x "
            f"{r['vs_concurrency1_plain']:>5.2f}x {r['per_request_tokens_per_second']:>9.1f} {r['ttft_p50_ms']:>8.0f} "
            f"{r['ttft_p95_ms']:>8.0f} {r['itl_p50_ms']:>7.1f} {r['itl_p95_ms']:>7.1f} {r['acceptance_length']:>7.2f} "
            f"{r['cached_prompt_share']:>6.0%} {r['identical_to_solo_plain']:>9}"
        )
    print(
        "tok/s = aggregate output tokens per second; ms: ttft = time to first token (queueing + prefill), itl = "
        "inter-token latency; acc len = tokens per verify step, bonus token included; cached = prompt tokens the "
        "prefix cache served (--prefix-cache-mb)"
    )
    if bound:
        print(
            f"memory-bandwidth bound at batch 1: {bound:.0f} tok/s ({wb / 1e6:.0f} MB of weights per step at "
            f"{BANDWIDTH_GBS:.0f} GB/s); a batch of B reads them once per step"
        )


def plot(rows: list[dict], modes: list[str], levels: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mode in modes:
        pts = sorted((r["concurrency"], r["tokens_per_second"]) for r in rows if r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests (closed loop)")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic.replacing(path) as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
