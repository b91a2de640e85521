"""clover-serve under closed-loop load, beside the same engine called in-process, against its targets (below).

    python benchmarks/serve_load.py [--clients 1,2,4,8,16] [--seconds 30] [--rounds 2] [--artifact DIR]
    python benchmarks/serve_load.py --soak [--soak-minutes 10]
    python benchmarks/serve_load.py --against REF [--clients 8] [--rounds 3]
    python benchmarks/serve_load.py --abuse [--rounds 5]

Load: starts `clover-serve` (the `make demo` artifact unless --artifact) on 127.0.0.1 and, for each client count
N, runs N streaming chat clients (the official `openai` client) in a closed loop over MT-Bench first turns
(greedy, 128 new tokens) for --seconds; then the same N closed-loop callers on a clover.Engine loaded in this
process (what `clover-bench --concurrency N` measures); the two alternate for --rounds rounds on the same
prompts. Reported per N: requests/s, output tokens/s (server and in-process, and their ratio), TTFT and
inter-token latency (gaps between streamed chunks) p50 / p95 / p99, errors. Writes
benchmarks/results/serve_load.json and .png. Target: at 8 clients the server keeps >= 85% of the in-process
output tokens/s (the HTTP layer costs little).

Against: the same load on this tree's clover-serve and on the clover-serve of git revision REF (a worktree of it,
imported by this interpreter), interleaved, same prompts: what a change costs requests that use none of its
options. Target: at 8 clients this tree keeps >= 95% of REF's output tokens/s. Writes
benchmarks/results/serve_load_against.json.

Soak: --soak-minutes of mixed traffic from 8 workers: short and long requests, streaming and not, random
disconnects mid-stream, bad requests. Reported: status counts, the server's RSS at the end of the first minute
and at the end (growth), and whether every request's slot was freed (running and waiting 0 at the end).
Targets: no 5xx, RSS growth under 10%, every slot freed. Writes benchmarks/results/serve_soak.json.

Abuse: a streaming canary (greedy, 200 tokens) alone and beside another process sending the abuse cases (token ids
outside the vocabulary, max_tokens past a field, 10,000 stop strings, a 50 MB body, JSON nested 100,000 deep, 100,000
and 20,000 messages) in a loop as fast as the server answers, and beside the same flood of GET /health (the control:
on a small machine any flood takes cores from the streams), interleaved for --rounds rounds. Reported: the canary's
inter-token p50 / p99 / max each way, the abuse answers' statuses. Targets: the canary's text is the same each time,
every abuse answer is 400 or 413, and its p99 beside the abuse is at most 2x its p99 beside the /health flood
(refusing a body costs about what answering the cheapest request does; parsing a refused body holds the GIL, so it
pauses the streams, never for long). Writes benchmarks/results/serve_abuse.json.
Exit status 0 when the targets hold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from clover import atomic
from clover.runtime.params import EngineOptions, GenerationParams
from clover.tools.machine import host
from clover.tools.serve import free_port, wait_healthy

RESULTS = Path(__file__).parent / "results"
MODEL = "clover"
HTTP_TARGET = 0.85
AGAINST_TARGET = 0.95
RSS_TARGET = 0.10
ABUSE_TARGET = 2.0  # the canary's p99 beside the abuse flood over its p99 beside a /health flood

# Sends the abuse cases to clover-serve (argv[1]: its /v1 URL) from its own process, so that a client's work and its
# copies of the bodies do not count as the server's. argv[3] "loop": over and over until stdin closes, printing each
# answer's status; "health": the same loop of GET /health instead (a flood of the cheapest request, the control);
# "once": each case once, printing each answer as JSON (status, seconds, its error message).
ABUSER = """
import json, sys, threading, time, httpx
base, model, mode = sys.argv[1:4]
msgs = lambda n: json.dumps({"model": model, "messages": [{"role": "user", "content": "w1"}] * n})
cases = [("/completions", json.dumps({"model": model, "prompt": [1, 2, 99999999], "max_tokens": 4})),
         ("/completions", json.dumps({"model": model, "prompt": "w1", "max_tokens": 10**30})),
         ("/completions", json.dumps({"model": model, "prompt": "w1", "stop": ["w"] * 10_000})),
         ("/completions", b"x" * (50 * 2**20)), ("/completions", "[" * 100_000 + "]" * 100_000),
         ("/chat/completions", msgs(100_000)), ("/chat/completions", msgs(20_000))]
with httpx.Client(timeout=10) as c:
    if mode == "once":
        cases.append(("/completions", json.dumps({"model": model, "prompt": "w1 " * 100_000})))
        for path, body in cases:
            t0 = time.perf_counter()
            r = c.post(base + path, content=body, headers={"content-type": "application/json"})
            message = (r.json().get("error") or {}).get("message")
            print(json.dumps({"status": r.status_code, "seconds": time.perf_counter() - t0, "message": message}))
        sys.exit()
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    health = base.removesuffix("/v1") + "/health"
    while not done.is_set():
        for path, body in cases:
            try:
                if mode == "health":
                    code = c.get(health).status_code
                else:
                    code = c.post(base + path, content=body, headers={"content-type": "application/json"}).status_code
            except httpx.HTTPError as e:
                code = type(e).__name__
            print(code, flush=True)
"""


# Runs clover-serve from another source tree (argv[1]): its folders mapped to the clover packages ahead of the
# installed (editable) ones, as pyproject's package-dir maps them.
FROM_TREE = """
import importlib.util, os, runpy, sys
root = sys.argv.pop(1)
dirs = {"clover": "clover", "clover.models": "models", "clover.runtime": "runtime", "clover.plugins": "plugins",
        "clover.export": "export", "clover.train": "train", "clover.tools": "tools", "clover.serve": "serve"}
class Tree:
    def find_spec(self, name, path=None, target=None):
        if name in dirs:
            d = os.path.join(root, dirs[name])
            return importlib.util.spec_from_file_location(
                name, os.path.join(d, "__init__.py"), submodule_search_locations=[d])
sys.meta_path.insert(0, Tree())
sys.argv[0] = "clover-serve"
runpy.run_module("clover.tools.serve", run_name="__main__")
"""


def start_server(
    artifact: Path, port: int, threads: int, max_batch: int, tree: Path | None = None, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    """clover-serve on 127.0.0.1:port; `tree`: from that source tree instead of the installed one; `extra`: more
    flags."""
    launch = ["-m", "clover.tools.serve"] if tree is None else ["-c", FROM_TREE, str(tree)]
    proc = subprocess.Popen(
        [
            sys.executable,
            *launch,
            "--artifact",
            str(artifact),
            "--port",
            str(port),
            "--threads",
            str(threads),
            "--max-batch",
            str(max_batch),
            "--model",
            MODEL,
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "CLOVER_API_KEY": ""},
    )
    if wait_healthy(port, 300, alive=lambda: proc.poll() is None):
        return proc
    if proc.poll() is not None:
        raise SystemExit(f"clover-serve exited: {proc.stderr.read()}")
    proc.kill()
    raise SystemExit("clover-serve was not healthy within 300 s")


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1e3, 1) if values else 0.0


# -- load ---------------------------------------------------------------------------------------------------


async def http_load(url: str, prompts: list[str], clients: int, seconds: float, max_tokens: int) -> dict:
    import openai

    c = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    ttft, gaps, tokens, done, errors = [], [], [0], [0], [0]
    counter = iter(range(1 << 30))
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < deadline:
            prompt = prompts[next(counter) % len(prompts)]
            t0 = last = time.perf_counter()
            try:
                stream = await c.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": prompt}],
                    temperature=0,
                    max_tokens=max_tokens,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                first = True
                async for chunk in stream:
                    now = time.perf_counter()
                    if chunk.choices and chunk.choices[0].delta.content:
                        (ttft.append(now - t0) if first else gaps.append(now - last))
                        first, last = False, now
                    if chunk.usage is not None:
                        tokens[0] += chunk.usage.completion_tokens
                done[0] += 1
            except openai.APIError:
                errors[0] += 1

    start = time.perf_counter()
    async with c:  # closes its connections before asyncio.run closes the loop
        await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - start
    return {"requests": done[0], "errors": errors[0], "tokens": tokens[0], "seconds": wall, "ttft": ttft, "gaps": gaps}


def engine_load(engine, prompts: list[str], clients: int, seconds: float, max_tokens: int) -> dict:
    ttft, gaps, tokens, done = [], [], [0], [0]
    lock = threading.Lock()
    counter = iter(range(1 << 30))
    deadline = time.perf_counter() + seconds

    def caller() -> None:
        while time.perf_counter() < deadline:
            with lock:
                prompt = prompts[next(counter) % len(prompts)]
            t0 = last = time.perf_counter()
            stream = engine.stream(prompt, GenerationParams(max_new_tokens=max_tokens), chat=True)
            first = True
            for delta in stream:
                now = time.perf_counter()
                if delta.text:
                    (ttft.append(now - t0) if first else gaps.append(now - last))
                    first, last = False, now
            with lock:
                tokens[0] += stream.result.new_tokens
                done[0] += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=caller) for _ in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return {
        "requests": done[0],
        "errors": 0,
        "tokens": tokens[0],
        "seconds": time.perf_counter() - start,
        "ttft": ttft,
        "gaps": gaps,
    }


def summary(runs: list[dict]) -> dict:
    seconds = sum(r["seconds"] for r in runs)
    ttft = [t for r in runs for t in r["ttft"]]
    gaps = [g for r in runs for g in r["gaps"]]
    return {
        "requests": sum(r["requests"] for r in runs),
        "errors": sum(r["errors"] for r in runs),
        "requests_per_second": round(sum(r["requests"] for r in runs) / seconds, 3),
        "output_tokens_per_second": round(sum(r["tokens"] for r in runs) / seconds, 2),
        **{f"ttft_p{q}_ms": pct(ttft, q) for q in (50, 95, 99)},
        **{f"itl_p{q}_ms": pct(gaps, q) for q in (50, 95, 99)},
    }


def load(args: argparse.Namespace, artifact: Path) -> int:
    from tqdm import tqdm

    from clover.runtime.engine import Engine
    from clover.tools.bench import load_prompts

    levels = [int(c) for c in args.clients.split(",")]
    prompts = load_prompts("mtbench", 80)
    port = free_port()
    server = start_server(artifact, port, args.threads, args.max_batch, extra=("--allow-ignore-eos",))
    url = f"http://127.0.0.1:{port}/v1"
    engine = Engine.load(
        artifact, tree="auto", log=None, options=EngineOptions(max_batch=args.max_batch, threads=args.threads)
    )
    rows = []
    try:
        with tqdm(total=len(levels) * args.rounds * 2, desc="serve load", unit="run", dynamic_ncols=True) as bar:
            for n in levels:
                http, local = [], []
                for r in range(args.rounds):  # alternate, order flipped each round
                    for side in ("http", "engine") if r % 2 == 0 else ("engine", "http"):
                        if side == "http":
                            http.append(asyncio.run(http_load(url, prompts, n, args.seconds, args.max_tokens)))
                        else:
                            local.append(engine_load(engine, prompts, n, args.seconds, args.max_tokens))
                        bar.update()
                s, e = summary(http), summary(local)
                rows.append(
                    {
                        "clients": n,
                        "server": s,
                        "engine": e,
                        "server_vs_engine": round(s["output_tokens_per_second"] / e["output_tokens_per_second"], 3),
                    }
                )
        base = url[: -len("/v1")]
        queried, hits = (
            metric(base, "clover:prefix_cache_queries_total"),
            metric(base, "clover:prefix_cache_hits_total"),
        )
        cache = {
            "queried_tokens": queried,
            "hit_tokens": hits,
            "hit_rate": round(hits / queried, 4) if queried else 0.0,
        }
    finally:
        engine.close()
        server.terminate()
        server.wait(60)
    head = (
        f"{'clients':>7} {'req/s':>6} {'tok/s':>7} {'engine':>7} {'ratio':>6} {'ttft p50':>8} {'p95':>6} {'p99':>6} "
        f"{'itl p50':>7} {'p95':>6} {'p99':>6} {'errors':>6}"
    )
    print(head + "\n" + "-" * len(head))
    for row in rows:
        s = row["server"]
        print(
            f"{row['clients']:>7} {s['requests_per_second']:>6.2f} {s['output_tokens_per_second']:>7.1f} "
            f"{row['engine']['output_tokens_per_second']:>7.1f} {row['server_vs_engine']:>5.2f}x {s['ttft_p50_ms']:>8.0f} "
            f"{s['ttft_p95_ms']:>6.0f} {s['ttft_p99_ms']:>6.0f} {s['itl_p50_ms']:>7.1f} {s['itl_p95_ms']:>6.1f} "
            f"{s['itl_p99_ms']:>6.1f} {s['errors']:>6}"
        )
    print(
        "tok/s: output tokens/s through HTTP; engine: the same load on clover.Engine in-process (clover-bench "
        "--concurrency); ms: ttft = time to first token, itl = gap between streamed chunks"
    )
    print(f"prefix cache: {cache['hit_rate']:.1%} of the server's prompt tokens reused ({hits:.0f} of {queried:.0f})")
    at8 = next((r for r in rows if r["clients"] == 8), None)
    failed = []
    if at8 is not None and at8["server_vs_engine"] < HTTP_TARGET:
        failed.append(
            f"8 clients: the server keeps {at8['server_vs_engine']:.0%} of the engine's tokens/s, target "
            f"{HTTP_TARGET:.0%}"
        )
    if any(r["server"]["errors"] for r in rows):
        failed.append("errors under load")
    doc = {
        "host": host(),
        "artifact": str(artifact),
        "threads": args.threads,
        "max_batch": args.max_batch,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "tree": "auto",
        "results": rows,
        "prefix_cache": cache,
        "targets": {"http_vs_engine_at_8": HTTP_TARGET, "failed": failed},
    }
    write(RESULTS / "serve_load.json", doc)
    plot(rows, RESULTS / "serve_load.png")
    print("; ".join(failed) or "all targets met")
    return 1 if failed else 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    n = [r["clients"] for r in rows]
    a.plot(n, [r["server"]["output_tokens_per_second"] for r in rows], marker="o", label="clover-serve (HTTP)")
    a.plot(n, [r["engine"]["output_tokens_per_second"] for r in rows], marker="o", label="clover.Engine in-process")
    a.set_ylabel("output tokens/s")
    for q, style in ((50, "-"), (95, "--"), (99, ":")):
        b.plot(n, [r["server"][f"ttft_p{q}_ms"] for r in rows], style, marker="o", label=f"TTFT p{q}")
    b.set_ylabel("ms")
    b.set_yscale("log")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(c) for c in n])
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- soak ----------------------------------------------------------------------------------------------------


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


BAD = [
    ("{not json", 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400),
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 0}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "go " * 9000}]}, 400),
]


def soak(args: argparse.Namespace, artifact: Path) -> int:
    from clover.tools.bench import load_prompts

    prompts = load_prompts("mtbench", 80)
    port = free_port()
    server = start_server(artifact, port, args.threads, args.max_batch)
    base = f"http://127.0.0.1:{port}"
    statuses: dict[str, int] = {}
    counts = {"requests": 0, "disconnects": 0}
    lock = threading.Lock()
    end = time.time() + args.soak_minutes * 60
    rss = {"start": None, "samples": []}

    def note(key: str, disconnect: bool = False) -> None:
        with lock:
            statuses[key] = statuses.get(key, 0) + 1
            counts["requests"] += 1
            counts["disconnects"] += disconnect

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=600) as h:
            while time.time() < end:
                roll = rng.random()
                if roll < 0.1:
                    body, _ = rng.choice(BAD)
                    r = h.post(
                        base + "/v1/chat/completions",
                        content=body if isinstance(body, str) else json.dumps(body),
                        headers={"content-type": "application/json"},
                    )
                    note(str(r.status_code))
                    continue
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": rng.choice(prompts)}],
                    "max_tokens": rng.choice((8, 32, 128)),
                    "temperature": rng.choice((0, 0.8)),
                    "stream": rng.random() < 0.5,
                }
                if body["stream"] and roll < 0.25:  # disconnect after the first event
                    with h.stream("POST", base + "/v1/chat/completions", json=body) as r:
                        note(str(r.status_code), disconnect=True)
                        next(r.iter_lines(), None)
                    continue
                if body["stream"]:
                    with h.stream("POST", base + "/v1/chat/completions", json=body) as r:
                        lines = list(r.iter_lines())
                        note(str(r.status_code) if "data: [DONE]" in lines else f"{r.status_code} (no [DONE])")
                else:
                    note(str(h.post(base + "/v1/chat/completions", json=body).status_code))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]
    t0 = time.time()
    [t.start() for t in threads]
    while any(t.is_alive() for t in threads):
        time.sleep(5)
        kb = rss_kb(server.pid)
        rss["samples"].append((round(time.time() - t0), kb))
        if rss["start"] is None and time.time() - t0 >= 60:
            rss["start"] = kb
        print(
            f"\rsoak: {time.time() - t0:5.0f} s, {counts['requests']} requests, RSS {kb / 1024:.0f} MB, statuses {statuses}",
            end="",
            file=sys.stderr,
            flush=True,
        )
    print(file=sys.stderr)
    time.sleep(1)
    running, waiting = metric(base, "clover:num_requests_running"), metric(base, "clover:num_requests_waiting")
    end_kb = rss_kb(server.pid)
    server.terminate()
    code = server.wait(60)
    growth = (end_kb - rss["start"]) / rss["start"] if rss["start"] else float("nan")
    failed = []
    if any(k.startswith("5") for k in statuses):
        failed.append(f"5xx responses: {statuses}")
    if any("no [DONE]" in k for k in statuses):
        failed.append("streams without [DONE]")
    if not growth < RSS_TARGET:
        failed.append(f"RSS grew {growth:.1%} (target < {RSS_TARGET:.0%})")
    if running or waiting:
        failed.append(f"slots not freed: running {running}, waiting {waiting}")
    if code != 0:
        failed.append(f"clover-serve exited {code} on SIGTERM")
    doc = {
        "host": host(),
        "artifact": str(artifact),
        "minutes": args.soak_minutes,
        "workers": 8,
        "requests": counts["requests"],
        "disconnects": counts["disconnects"],
        "statuses": statuses,
        "rss_kb_after_1_min": rss["start"],
        "rss_kb_end": end_kb,
        "rss_growth": round(growth, 4),
        "running_at_end": running,
        "waiting_at_end": waiting,
        "exit_code": code,
        "rss_samples": rss["samples"],
        "targets": {"failed": failed},
    }
    write(RESULTS / "serve_soak.json", doc)
    print(
        f"soak: {counts['requests']} requests ({counts['disconnects']} disconnects), statuses {statuses}, RSS "
        f"{rss['start']} -> {end_kb} kB ({growth:+.1%}), running {running}, waiting {waiting}, exit {code}"
    )
    print("; ".join(failed) or "all targets met")
    return 1 if failed else 0


def abuse(args: argparse.Namespace, artifact: Path) -> int:
    import openai

    from clover.tools.bench import load_prompts

    prompt = load_prompts("mtbench", 1)[0]
    port = free_port()
    server = start_server(artifact, port, args.threads, args.max_batch, extra=("--allow-ignore-eos",))
    url = f"http://127.0.0.1:{port}/v1"
    c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    def canary() -> tuple[str, list[float]]:
        stream = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        times, text = [], ""
        for chunk in stream:
            times.append(time.perf_counter())
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        return text, list(np.diff(times))

    gaps: dict[str, list[float]] = {"alone": [], "beside_health_flood": [], "beside_abuse_flood": []}
    texts, statuses = set(), {}
    try:
        canary()  # warm
        for r in range(args.rounds):  # interleaved: whatever else loads the machine weighs on all alike
            for side, mode in (("alone", None), ("beside_health_flood", "health"), ("beside_abuse_flood", "loop")):
                if mode is None:
                    text, g = canary()
                else:
                    flood = subprocess.Popen(
                        [sys.executable, "-c", ABUSER, url, MODEL, mode],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    try:
                        flood.stdout.readline()  # the loop under way
                        text, g = canary()
                    finally:
                        out, _ = flood.communicate("", timeout=120)
                    if mode == "loop":
                        for code in out.split():
                            statuses[code] = statuses.get(code, 0) + 1
                texts.add(text)
                gaps[side] += g
            print(f"round {r + 1}: p99 " + ", ".join(f"{k} {pct(v, 99)} ms" for k, v in gaps.items()), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    ratio = round(pct(gaps["beside_abuse_flood"], 99) / max(pct(gaps["beside_health_flood"], 99), 1e-3), 2)
    failed = []
    if len(texts) != 1:
        failed.append(f"the canary's text changed ({len(texts)} different texts)")
    if not set(statuses) <= {"400", "413"}:
        failed.append(f"abuse answered {statuses}")
    if ratio > ABUSE_TARGET:
        failed.append(
            f"the canary's p99 beside abuse is {ratio}x its p99 beside a /health flood (target <= {ABUSE_TARGET})"
        )
    doc = {
        "host": host(),
        "artifact": str(artifact),
        "rounds": args.rounds,
        "tokens_per_canary": 200,
        "itl_ms": {k: {"p50": pct(v, 50), "p99": pct(v, 99), "max": pct(v, 100)} for k, v in gaps.items()},
        "abuse_over_health_flood_p99": ratio,
        "abuse_statuses": statuses,
        "targets": {"abuse_over_health_flood_p99_at_most": ABUSE_TARGET, "failed": failed},
    }
    write(RESULTS / "serve_abuse.json", doc)
    print(f"{'canary':>20} {'itl p50':>8} {'p99':>6} {'max':>6}")
    for name, row in doc["itl_ms"].items():
        print(f"{name:>20} {row['p50']:>8.1f} {row['p99']:>6.1f} {row['max']:>6.1f}")
    print(f"abuse answers {statuses}; p99 beside abuse / beside a /health flood: {ratio}x")
    print("; ".join(failed) or "all targets met")
    return 1 if failed else 0


def against(args: argparse.Namespace, artifact: Path) -> int:
    import shutil
    import tempfile

    from tqdm import tqdm

    from clover.tools.bench import load_prompts

    here = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(here), "rev-parse", args.against], capture_output=True, text=True)
    if commit.returncode != 0:
        raise SystemExit(f"--against: {args.against!r} is not a revision of {here}: {commit.stderr.strip()}")
    ref = commit.stdout.strip()
    head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="clover-against-"))
    subprocess.run(
        ["git", "-C", str(here), "worktree", "add", "--detach", str(work / "tree"), ref],
        check=True,
        capture_output=True,
    )
    levels = [int(c) for c in args.clients.split(",")]
    prompts = load_prompts("mtbench", 80)
    ports = {"this": free_port(), "ref": free_port()}
    servers = {}
    rows = []
    try:
        servers["this"] = start_server(artifact, ports["this"], args.threads, args.max_batch)
        servers["ref"] = start_server(artifact, ports["ref"], args.threads, args.max_batch, work / "tree")
        with tqdm(total=len(levels) * args.rounds * 2, desc="serve load against", unit="run") as bar:
            for n in levels:
                runs = {"this": [], "ref": []}
                for r in range(args.rounds):  # alternate, order flipped each round
                    for side in ("this", "ref") if r % 2 == 0 else ("ref", "this"):
                        url = f"http://127.0.0.1:{ports[side]}/v1"
                        runs[side].append(asyncio.run(http_load(url, prompts, n, args.seconds, args.max_tokens)))
                        bar.update()
                s, b = summary(runs["this"]), summary(runs["ref"])
                ratio = round(s["output_tokens_per_second"] / b["output_tokens_per_second"], 3)
                rows.append({"clients": n, "this": s, "ref": b, "this_vs_ref": ratio})
    finally:
        for proc in servers.values():
            proc.terminate()
            proc.wait(60)
        subprocess.run(
            ["git", "-C", str(here), "worktree", "remove", "--force", str(work / "tree")], capture_output=True
        )
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'clients':>7} {'this tok/s':>10} {'ref tok/s':>9} {'ratio':>6} {'itl p50':>7} {'ref':>6} {'errors':>6}")
    for row in rows:
        s, b = row["this"], row["ref"]
        print(
            f"{row['clients']:>7} {s['output_tokens_per_second']:>10.1f} {b['output_tokens_per_second']:>9.1f} "
            f"{row['this_vs_ref']:>5.2f}x {s['itl_p50_ms']:>7.1f} {b['itl_p50_ms']:>6.1f} {s['errors'] + b['errors']:>6}"
        )
    at8 = next((r for r in rows if r["clients"] == 8), None)
    failed = []
    if at8 is not None and at8["this_vs_ref"] < AGAINST_TARGET:
        failed.append(f"8 clients: {at8['this_vs_ref']:.0%} of {args.against}'s tokens/s, target {AGAINST_TARGET:.0%}")
    if any(r["this"]["errors"] or r["ref"]["errors"] for r in rows):
        failed.append("errors under load")
    doc = {
        "host": host(),
        "artifact": str(artifact),
        "this": head + (" (with uncommitted changes)" if dirty else ""),
        "ref": ref,
        "threads": args.threads,
        "max_batch": args.max_batch,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "results": rows,
        "targets": {"this_vs_ref_at_8": AGAINST_TARGET, "failed": failed},
    }
    write(RESULTS / "serve_load_against.json", doc)
    print("; ".join(failed) or "all targets met")
    return 1 if failed else 0


def write(path: Path, doc: dict) -> None:
    atomic.write_text(path, json.dumps(doc, indent=2) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, default=None, help="default: the make demo artifact")
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--seconds", type=float, default=30.0, help="per client count, per side, per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--soak", action="store_true")
    ap.add_argument("--soak-minutes", type=float, default=10.0)
    ap.add_argument("--against", default=None, help="a git revision: its clover-serve beside this tree's")
    ap.add_argument("--abuse", action="store_true", help="a canary's inter-token latency beside abusive requests")
    args = ap.parse_args()
    if args.artifact is None:
        from clover.tools.demo import cached_artifact

        args.artifact = cached_artifact("smollm2", "smollm2-clover2")
    if args.against:
        return against(args, args.artifact)
    if args.abuse:
        return abuse(args, args.artifact)
    return soak(args, args.artifact) if args.soak else load(args, args.artifact)


if __name__ == "__main__":
    sys.exit(main())
