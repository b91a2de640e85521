"""`make demo`: the embedded default end to end: export, then speculative decoding next to plain decoding.

With the ONNX Runtime backend (default) the base model and heads are exported once to an artifact
cached under CLOVER_CACHE/artifacts (re-exported only if missing or invalid), then the answer is
streamed from the artifact's graphs. It prints whether the output is token-identical to plain
decoding, the acceptance length and the speed ratio, both measured in this run on the same backend.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from clover.errors import CloverError
from clover.runtime.params import GenerationParams
from clover.tools.cli import run_cli


def heads_digest(heads: str) -> str:
    """sha256 of a head checkpoint's weights (shipped name or folder), so retrained heads get a new artifact;
    '' for none / random:ARCH (fully named by the spec)."""
    from clover.models.head_io import heads_folder

    folder = heads_folder(heads)
    weights = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    return hashlib.sha256(b"".join(w.read_bytes() for w in weights)).hexdigest() if weights else ""


SHIPPED_CORPUS = Path(__file__).resolve().parents[1] / "data" / "smollm2-sharegpt"  # in a clone, not in a wheel
# what the demo's extras are counted over: the int4 graph's answers, and the fp32 graph's to the same prompts (an
# n-gram store over both: prompt lookup replayed on the fp32 graph's MT-Bench outputs, up to 12 drafts a step, makes
# 1.79 tokens per step from the first alone, 1.83 from both)
SHIPPED_CORPORA = (SHIPPED_CORPUS, SHIPPED_CORPUS.parent / "smollm2-sharegpt-fp32")
DRAFT_QUANT_REVISION = 2  # --draft-quant artifacts: 2 = MatMulNBits drafts with their own quantized LM head
FUSED_REVISION = 2  # --attention fused artifacts: 2 = Clover-2's draft_begin fused too (export/fused_graph.py)
QUANT_LAYOUT = 2  # --weights artifacts: 2 = the base keeps its own LM head beside lm_head.onnx (export/lm_head.py)
DEMO_DRAFT_VOCAB = (
    8192  # 99.2% of the corpus's answer tokens; drafting ~25% cheaper on int4 (benchmarks/draft_vocab.py)
)


def cached_artifact(
    base: str,
    heads: str,
    weights: str | None = "int4",
    draft_quant: str | None = None,
    attention: str = "fused",
    corpus: Path | Sequence[Path] | None = None,
) -> Path:
    """The artifact for (base, heads) in the cache, exported first if it is missing or invalid. int4 weights
    and the fused base graph by default: on CPU the fastest artifact that keeps the heads' acceptance
    (SmolLM2, benchmarks/peers.py); weights=None, draft_quant="int8": the fp32 base graph. `corpus` (the base's
    own answers, clover-data grow; one or several): a copy that also drafts from them, see `with_corpus`."""
    exported = exported_artifact(base, heads, weights, draft_quant, attention)
    return exported if corpus is None else with_corpus(exported, corpus)


def shipped_corpora(base: str) -> list[Path]:
    """The corpora of the embedded SmolLM2's own answers that a clone of the repository ships (none for another
    base, or where they are absent: an installed wheel)."""
    from clover.train.corpus import is_corpus

    return [c for c in SHIPPED_CORPORA if is_corpus(c)] if base == "smollm2" else []


def demo_artifact(base: str = "smollm2", heads: str = "smollm2-clover2") -> Path:
    """The demo's artifact: int4, fused, plus the shipped corpora's draft vocabulary and n-gram store when the
    base is SmolLM2 and the corpora are there (a clone of the repository)."""
    return cached_artifact(base, heads, corpus=shipped_corpora(base) or None)


def with_corpus(exported: Path, corpora: Path | Sequence[Path]) -> Path:
    """A cached copy of `exported` whose prompt lookup also drafts from the n-gram store of `corpora` (one corpus
    folder or several; clover-export --ngram-store) and whose heads, if any, draft over their DEMO_DRAFT_VOCAB most
    frequent tokens (--draft-vocab): both change only what is proposed. Keyed by the corpora's digests and the
    store's format, so a grown corpus gets a new copy (seconds: no re-export)."""
    import dataclasses

    from clover.artifact import open_artifact
    from clover.export.artifact import derived_artifact
    from clover.export.draft_vocab import draft_vocab_change
    from clover.export.ngram_store import add_ngram_store
    from clover.models.smollm2 import cache_dir
    from clover.runtime.lookup import STORE_FORMAT
    from clover.tools.export import corpus_list, corpus_sources
    from clover.train.corpus import Corpus

    folders = corpus_list(corpora)
    digests = "|".join(Corpus.open(c).digest() for c in folders)
    key = hashlib.sha256(f"{exported.name}|{digests}|store {STORE_FORMAT}".encode()).hexdigest()[:12]
    out = cache_dir() / "artifacts" / f"{exported.name}-{folders[0].name}-{key}"
    try:
        open_artifact(out)
        return out
    except CloverError:
        pass
    names = ", ".join(str(c) for c in folders)
    print(f"adding the draft vocabulary and n-gram store of {names} to a copy of {exported.name}", file=sys.stderr)
    store, counts = corpus_sources(folders)
    draft_vocab = draft_vocab_change(counts, DEMO_DRAFT_VOCAB)

    def change(tmp: Path, m):
        m = dataclasses.replace(m, ngram_store=add_ngram_store(tmp, store, m.base_fingerprint))
        vocab = m.base_config["vocab_size"]
        if (
            m.heads is None
            or "lm_head" not in m.graphs
            or vocab <= DEMO_DRAFT_VOCAB
            or (m.draft_vocab is not None and m.draft_vocab.size < vocab)
        ):  # the export chose one
            return m
        return draft_vocab(tmp, m)

    return derived_artifact(exported, out, set(), change)


def exported_artifact(base: str, heads: str, weights: str | None, draft_quant: str | None, attention: str) -> Path:
    """The export of (base, heads) in the cache, made first if it is missing or invalid."""
    from clover.artifact import open_artifact
    from clover.export.artifact import export_artifact
    from clover.export.config import ExportConfig
    from clover.models.smollm2 import cache_dir, resolve_base

    base_path = resolve_base(base).resolve()
    config = ExportConfig(weights=weights, draft_quant=draft_quant, attention=attention)
    # an older export is not reused
    revision = (f"|draft-quant {DRAFT_QUANT_REVISION}" if draft_quant else "") + (
        f"|fused {FUSED_REVISION}" if attention == "fused" else ""
    )
    # the resolved quantizer too: a new --weights default makes a new artifact; and the LM-head layout (a quantized
    # base keeps its own copy since QUANT_LAYOUT 2)
    rounding = f"|{config.quantizer} {config.block} {config.is_symmetric}|layout {QUANT_LAYOUT}" if weights else ""
    key = hashlib.sha256(
        f"{base_path}|{heads}|{heads_digest(heads)}|{config}{rounding}{revision}".encode()
    ).hexdigest()[:12]
    out = cache_dir() / "artifacts" / f"{base_path.name}-{heads.replace(':', '-').replace('/', '_')}-{key}"
    try:
        open_artifact(out)
        print(f"artifact {out} (cached)", file=sys.stderr)
        return out
    except CloverError:
        pass
    print(f"exporting {base} + {heads} to {out} (once; 2-3 minutes for SmolLM2 on 2 cores)", file=sys.stderr)
    return export_artifact(base, heads, out, config, progress=lambda s: print(f"  {s}", file=sys.stderr))


def demo_tree(artifact: Path) -> str | None:
    """The artifact's default tree (the fastest of plain and the candidates, timed at export), said aloud;
    when that is plain, the fastest speculative tree, so the demo still shows speculation."""
    from clover.artifact import read_manifest

    m = read_manifest(artifact)
    timing = (m.tree_timing or {}).get("tokens_per_second", {})
    if timing:
        print(
            "export-time timing on this machine: "
            + ", ".join(f"{k} {v:.1f}" for k, v in timing.items())
            + f" tok/s; default tree {m.tree.name}, drafts {m.drafts or 'heads'}",
            file=sys.stderr,
        )
    if m.tree is None or m.tree.name != "plain" or not timing:
        return None
    fastest = max((k for k in timing if k != "plain"), key=timing.get)
    print(
        f"the heads' drafts do not pay on this artifact here (its default is {m.drafts or 'heads'}: "
        f"{'prompt lookup' if m.drafts == 'lookup' else 'plain decoding'}); the demo speculates with {fastest}, "
        "the heads' fastest tree, to show that the output does not change",
        file=sys.stderr,
    )
    return fastest


def generators(args: argparse.Namespace):
    """(speculative, plain, prompt lookup) generators on the chosen backend (the last two share one model), and the
    artifact they run (None on torch)."""
    from clover.runtime.generator import Generator

    if args.backend == "ort":
        from clover.runtime.backends import ort as ort_backend
        from clover.runtime.tokenizer import Tokenizer

        artifact = demo_artifact(args.base, args.heads)
        tok = Tokenizer.from_dir(ort_backend.base_dir(artifact))
        spec = Generator(ort_backend.load_runner(artifact), tok, args.tree or demo_tree(artifact))
        plain = Generator(
            ort_backend.load_runner(artifact, heads="none", options=ort_backend.OrtOptions(checksums=False)), tok
        )
        return spec, plain, Generator(plain.runner, tok, drafts="lookup"), artifact
    from clover.runtime.backends.torch_runner import TorchRunner

    spec = Generator.load(args.base, args.heads, "torch", args.tree)
    plain = Generator(TorchRunner(spec.runner.base), spec.tokenizer)  # same weights, no heads
    return spec, plain, Generator(plain.runner, spec.tokenizer, drafts="lookup"), None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="clover-demo", description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="smollm2")
    ap.add_argument("--heads", default="smollm2-clover2")
    ap.add_argument("--backend", default="ort", choices=("ort", "torch"))
    ap.add_argument("--tree", default=None)
    ap.add_argument("--prompt", default="Give me three tips for staying healthy.")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    return ap


def run(args: argparse.Namespace) -> int:
    spec, plain, lookup, artifact = generators(args)
    print(
        f"base {args.base}, heads {args.heads}, tree {spec.tree.name} ({spec.tree.num_nodes} nodes), "
        f"{args.backend} backend\n"
    )
    stream = spec.stream(args.prompt, GenerationParams(max_new_tokens=args.max_new_tokens), chat=True)
    for delta in stream:
        print(delta, end="", flush=True)
    fast = stream.result
    ref = plain.generate(args.prompt, GenerationParams(max_new_tokens=args.max_new_tokens), chat=True)
    looked = lookup.generate(args.prompt, GenerationParams(max_new_tokens=args.max_new_tokens), chat=True)
    same = lambda r: "identical to" if r.token_ids == ref.token_ids else "DIFFERENT from"  # noqa: E731
    print(f"\n\nspeculative output is {same(fast)} plain greedy decoding ({fast.new_tokens} tokens)")
    print(f"acceptance length {fast.tokens_per_step:.2f} tokens/step (bonus token included)")
    print(
        f"speculative {fast.tokens_per_second:.1f} tok/s, plain {ref.tokens_per_second:.1f} tok/s: "
        f"{fast.tokens_per_second / ref.tokens_per_second:.2f}x ({args.backend}, measured in this run)"
    )
    print(
        f"prompt-lookup drafts ({lookup.tree.name} at most): {looked.tokens_per_second:.1f} tok/s, "
        f"{looked.tokens_per_step:.2f} tokens/step, output {same(looked)} plain greedy decoding"
    )
    if artifact is not None:  # ONNX Runtime on the CPU, its default threads: one per core
        from clover.tools.machine import plain_limit_line

        print(plain_limit_line(artifact, os.cpu_count() or 1))
    if args.heads.startswith("random:"):
        print(
            "(untrained heads accept almost nothing, so this shows losslessness, not speed; trained heads "
            "come with clover-train)"
        )
    return 0 if fast.token_ids == ref.token_ids == looked.token_ids else 1


def main(argv: list[str] | None = None) -> int:
    return run_cli("clover-demo", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
