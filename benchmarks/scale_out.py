"""clover-serve in one process against Ray Serve replicas of it, on the same machine, under closed-loop load.

    python benchmarks/scale_out.py [--clients 1,2,4,8,16] [--seconds 20] [--rounds 2] [--artifact DIR] [--threads 2]

Three servers of one artifact (the `make demo` artifact unless --artifact), all up at once and loaded in turn:
`single` (clover-serve, --threads T), `ray-1x{T}` (Ray Serve, 1 replica of T threads) and `ray-2x{T/2}` (2 replicas
of T/2 threads), on a local Ray cluster on 127.0.0.1. For each client count N (1-16), each server gets N streaming
chat clients (benchmarks/serve_load.py's client: the official `openai` client, MT-Bench first turns, greedy, 128 new
tokens) for --seconds, the servers interleaved at every N, for --rounds rounds (the order rotated at every N and every
round; a server's windows at one N are pooled). Reported per server and N: requests/s, output tokens/s,
TTFT and inter-token latency p50 / p95 / p99, errors. Cold start: from launching the server process (single) or
deploying the application (Ray: its replica processes start then) to the first streamed token of a first request,
with the verify-cost curve not yet cached, then again with it cached (the cache is a fresh folder for the run, emptied
before each server's first start).

Targets: at 8 clients Ray with 1 replica keeps >= 90% of the single process's output tokens/s (the proxy costs
little); at 16 clients 2 replicas of T/2 threads reach >= 1.3x the single process's; no errors.
Writes benchmarks/results/scale_out.json and .png. Exit status 0 when the targets hold.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serve_load import MODEL, http_load, start_server, summary, write  # noqa: E402

from clover.tools.machine import host  # noqa: E402
from clover.tools.serve import free_port  # noqa: E402

RESULTS = Path(__file__).parent / "results"
RAY_VS_SINGLE_AT_8 = 0.90
TWO_REPLICAS_AT_16 = 1.30


async def first_token(url: str, prompt: str, seconds: float = 600) -> float:
    """perf_counter() when the first content chunk of a streamed request arrives (retried while the server says it
    is not ready)."""
    import openai

    deadline = time.perf_counter() + seconds
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) as c:
        while True:
            try:
                stream = await c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8, stream=True
                )
                first = None
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter()
                if first is not None:
                    return first
            except (openai.APIStatusError, openai.APIConnectionError):
                if time.perf_counter() > deadline:
                    raise
                await asyncio.sleep(0.05)


def single_cold_start(artifact: Path, threads: int, max_batch: int, prompt: str, servers: list):
    """Launch clover-serve (kept in `servers`, for the caller to stop): its URL and seconds to a first token."""
    port = free_port()
    t0 = time.perf_counter()
    servers.append(start_server(artifact, port, threads, max_batch))
    url = f"http://127.0.0.1:{port}/v1"
    return url, asyncio.run(first_token(url, prompt)) - t0


def ray_cold_start(options, name: str, port: int, prompt: str) -> float:
    from ray import serve

    from clover.serve.ray import application

    t0 = time.perf_counter()
    serve.run(application(options), name=name, route_prefix=f"/{name}", blocking=False)
    return asyncio.run(first_token(f"http://127.0.0.1:{port}/{name}/v1", prompt)) - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, default=None, help="default: the make demo artifact")
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--seconds", type=float, default=20.0, help="per client count, per server, per round")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds, pooled")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="the single process's threads (even: split over 2 replicas)")
    ap.add_argument("--max-batch", type=int, default=8)
    args = ap.parse_args()
    if args.artifact is None:
        from clover.tools.demo import cached_artifact

        args.artifact = cached_artifact("smollm2", "smollm2-clover2")
    import ray
    from ray import serve
    from tqdm import tqdm

    from clover.serve.ray import RayServeOptions, local_cluster_env
    from clover.tools.bench import load_prompts

    prompts = load_prompts("mtbench", 80)
    levels = [int(c) for c in args.clients.split(",")]
    half = max(args.threads // 2, 1)
    names = {"single": "single", "one": f"ray-1x{args.threads}", "two": f"ray-2x{half}"}
    cache = tempfile.TemporaryDirectory(prefix="clover-cost-cache-")
    os.environ["CLOVER_CACHE"] = cache.name  # a cold verify-cost cache (inherited by the server and the cluster)
    os.environ["CLOVER_COST_CACHE"] = "1"
    cold: dict[str, dict[str, float]] = {}
    servers = []

    def forget() -> None:
        shutil.rmtree(Path(cache.name) / "verify-cost", ignore_errors=True)

    try:
        # single process: launched twice (curve measured, then read from the cache); the second one stays up
        _, cold_s = single_cold_start(args.artifact, args.threads, args.max_batch, prompts[0], servers)
        first = servers.pop()
        first.terminate()
        first.wait(60)
        single_url, warm_s = single_cold_start(args.artifact, args.threads, args.max_batch, prompts[0], servers)
        cold["single"] = {"uncached_s": round(cold_s, 2), "cached_s": round(warm_s, 2)}
        port = free_port()
        # as clover-serve --ray starts a local cluster: workers at nice 0 (Ray's default 15 would have the replicas
        # yield the cores to this process's clients, which the single process does not), the HAProxy ingress
        args.ingress = local_cluster_env()
        ray.init(
            address="local",
            num_cpus=2 * args.threads,  # both Ray applications up at once; one is loaded at a time
            include_dashboard=False,
            logging_level="WARNING",
            log_to_driver=False,
        )
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        urls = {"single": single_url}
        for key, replicas, threads in (("one", 1, args.threads), ("two", 2, half)):
            options = RayServeOptions(
                artifact=str(args.artifact),
                model=MODEL,
                max_batch=args.max_batch,
                threads=threads,
                replicas=replicas,
            )
            forget()  # this configuration's first start measures its curve
            first = ray_cold_start(options, key, port, prompts[0])
            serve.delete(key)
            again = ray_cold_start(options, key, port, prompts[0])
            cold[names[key]] = {"uncached_s": round(first, 2), "cached_s": round(again, 2)}
            urls[key] = f"http://127.0.0.1:{port}/{key}/v1"
        rows = []
        with tqdm(total=len(levels) * 3 * args.rounds, desc="scale out", unit="run", dynamic_ncols=True) as bar:
            for i, n in enumerate(levels):
                runs: dict[str, list] = {key: [] for key in names}
                for r in range(args.rounds):
                    order = ["single", "one", "two"]
                    order = order[(i + r) % 3 :] + order[: (i + r) % 3]  # rotated at every client count and round
                    for key in order:
                        runs[key].append(asyncio.run(http_load(urls[key], prompts, n, args.seconds, args.max_tokens)))
                        bar.update()
                rows.append({"clients": n, **{names[key]: summary(runs[key]) for key in names}})
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        for proc in servers:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
        cache.cleanup()
    return report(args, rows, cold, names)


def report(args, rows: list[dict], cold: dict, names: dict) -> int:
    single, one, two = names["single"], names["one"], names["two"]
    head = (
        f"{'clients':>7} {'server':>9} {'req/s':>6} {'tok/s':>7} {'vs single':>9} {'ttft p50':>8} {'p95':>6} "
        f"{'p99':>6} {'itl p50':>7} {'p95':>6} {'p99':>6} {'errors':>6}"
    )
    print(head + "\n" + "-" * len(head))
    for row in rows:
        base = row[single]["output_tokens_per_second"]
        for name in (single, one, two):
            s = row[name]
            print(
                f"{row['clients']:>7} {name:>9} {s['requests_per_second']:>6.2f} {s['output_tokens_per_second']:>7.1f} "
                f"{s['output_tokens_per_second'] / base:>8.2f}x {s['ttft_p50_ms']:>8.0f} {s['ttft_p95_ms']:>6.0f} "
                f"{s['ttft_p99_ms']:>6.0f} {s['itl_p50_ms']:>7.1f} {s['itl_p95_ms']:>6.1f} {s['itl_p99_ms']:>6.1f} "
                f"{s['errors']:>6}"
            )
    print("cold start to the first token (verify-cost curve measured / read from the cache):")
    for name, c in cold.items():
        print(f"  {name:>9}: {c['uncached_s']:.1f} s / {c['cached_s']:.1f} s")
    ratio = lambda n, name: next(  # noqa: E731
        (
            r[name]["output_tokens_per_second"] / r[single]["output_tokens_per_second"]
            for r in rows
            if r["clients"] == n
        ),
        None,
    )
    failed = []
    at8, at16 = ratio(8, one), ratio(16, two)
    if at8 is not None and at8 < RAY_VS_SINGLE_AT_8:
        failed.append(
            f"8 clients: Ray with 1 replica keeps {at8:.0%} of the single process, target {RAY_VS_SINGLE_AT_8:.0%}"
        )
    if at16 is not None and at16 < TWO_REPLICAS_AT_16:
        failed.append(f"16 clients: 2 replicas reach {at16:.2f}x the single process, target {TWO_REPLICAS_AT_16}x")
    if any(r[name]["errors"] for r in rows for name in (single, one, two)):
        failed.append("errors under load")
    doc = {
        "host": host(),
        "artifact": str(args.artifact),
        "threads": args.threads,
        "max_batch": args.max_batch,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "tree": "auto",
        "servers": {single: "clover-serve, one process", one: "Ray Serve, 1 replica", two: "Ray Serve, 2 replicas"},
        "ray_ingress": args.ingress,
        "cold_start_to_first_token_s": cold,
        "results": rows,
        "ratios": {"ray_1_replica_vs_single_at_8": at8, "ray_2_replicas_vs_single_at_16": at16},
        "targets": {
            "ray_1_replica_vs_single_at_8": RAY_VS_SINGLE_AT_8,
            "ray_2_replicas_vs_single_at_16": TWO_REPLICAS_AT_16,
            "failed": failed,
        },
    }
    write(RESULTS / "scale_out.json", doc)
    plot(rows, (single, one, two), RESULTS / "scale_out.png")
    print("; ".join(failed) or "all targets met")
    return 1 if failed else 0


def plot(rows: list[dict], names: tuple[str, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    n = [r["clients"] for r in rows]
    for name in names:
        a.plot(n, [r[name]["output_tokens_per_second"] for r in rows], marker="o", label=name)
        b.plot(n, [r[name]["itl_p50_ms"] for r in rows], marker="o", label=f"{name} ITL p50")
    a.set_ylabel("output tokens/s")
    b.set_ylabel("inter-token latency p50, ms")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(c) for c in n])
        ax.set_xlabel("concurrent streaming clients (closed loop)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
