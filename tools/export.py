"""clover-export: export a base model and draft heads to an artifact directory (ONNX graphs + manifest,
plus TensorRT engines with --backend trt)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from clover.errors import CloverError
from clover.export.config import DEFAULT_QUANT
from clover.tools.cli import run_cli
from clover.tools.data import DEFAULT_OUT as DEFAULT_CORPUS

DEFAULT_CALIBRATION = Path("data/smollm2-sharegpt-fp32")  # the fp32 base's own answers (a clone's data/)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clover-export",
        description="Export a base model and Clover draft heads to ONNX graphs in one artifact directory "
        "(run it with clover-generate --artifact DIR --backend ort), and with --backend trt build "
        "TensorRT engines from them (--backend trt at run time).",
    )
    p.add_argument("--base", default="smollm2", help="Hugging Face model folder, or 'smollm2' (embedded default)")
    p.add_argument(
        "--heads",
        default="none",
        help="head checkpoint folder, random:ARCH[:SEED] (medusa, clover, clover2), or none (plain decoding)",
    )
    p.add_argument(
        "--out", required=True, type=Path, help="artifact folder to write (new, empty, or an artifact to replace)"
    )
    p.add_argument(
        "--backend",
        default="onnx",
        help="onnx: ONNX graphs for ONNX Runtime; trt: the graphs plus TensorRT engines built with Polygraphy "
        "(needs the gpu extra: TensorRT 10.x/11.x, Polygraphy, and a CUDA GPU)",
    )
    p.add_argument(
        "--attention",
        default=None,
        help="fused (default for --backend onnx --dtype float32): the base as ONNX Runtime's fused CPU operators "
        "(GroupQueryAttention, in-place KV cache: ~2x faster decoding on CPU, and the batched graph that lets "
        "clover.Engine / clover-serve run concurrent requests in one forward); portable (default for --backend "
        "trt, the other dtypes and a base with a sliding window): standard ONNX ops that ONNX Runtime and "
        "TensorRT both run; plugin: one CloverTreeAttention node per layer for the TensorRT plugin (the graph is "
        "checked on ONNX Runtime through the node's ONNX reference function)",
    )
    p.add_argument(
        "--tree",
        default=None,
        help="default token tree recorded in the artifact (default: ONNX artifacts with heads or an n-gram store "
        "time plain decoding, the candidate trees and prompt lookup on their graphs and record the fastest tree "
        "and draft source; TensorRT and plugin exports: mc26, pruned to the heads' depth)",
    )
    p.add_argument("--dtype", default="float32", help="float32, float16, or bfloat16 (TensorRT)")
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="longest sequence the artifact serves (default: the base's max_position_embeddings)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="--attention fused: sequences the batched base graph runs in one forward (clover.Engine, "
        "clover-serve; default 8; 1: no batched graph)",
    )
    p.add_argument(
        "--max-prompt",
        type=int,
        default=None,
        help="--backend trt: longest prompt of the prefill optimization profile (default min(context, 2048))",
    )
    p.add_argument(
        "--timing-cache",
        default=None,
        help="--backend trt: TensorRT timing cache file (default: shared in the clover-deploy cache)",
    )
    p.add_argument(
        "--draft-quant",
        default=None,
        metavar="int8|int4",
        help="the draft graphs' linears (and a copy of the LM head they draft through) as ONNX Runtime's "
        "blockwise MatMulNBits: SmolLM2 fp32 drafts ~2x cheaper, int8 with the same acceptance; the "
        "base graph keeps --dtype, so the output is unchanged. --backend onnx --dtype float32 only",
    )
    p.add_argument(
        "--weights",
        default=None,
        metavar="int8|int4",
        help="quantize every linear of every graph, the LM head included (int4: the token embedding too), "
        "to ONNX Runtime's blockwise MatMulNBits: ~5x fewer bytes per token than "
        "float32 (int4). Speculative output equals plain output of these graphs; the export reports "
        "the error and the greedy agreement against float32. --backend onnx --dtype float32 only",
    )
    defaults = "; ".join(
        f"{w}: {q}{' symmetric' if sym else ''}, blocks of {b}" for w, (q, b, sym) in DEFAULT_QUANT.items()
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="--weights: input channels per quantization block (power of two >= 16; default: the scheme's, "
        "below --quant)",
    )
    p.add_argument(
        "--quant",
        default=None,
        metavar="rtn|hqq|gptq|kquant",
        help="--weights: which onnxruntime quantizer rounds the base graph's weights (the draft graphs take rtn): "
        "rtn round to nearest (int4, int8); hqq half-quadratic zero points, no data (int4; float zero points, "
        "no fast CPU kernel); gptq calibrated on --calibration (int4); kquant llama.cpp's k-quant search, no "
        f"data (int4, int8). Defaults ({defaults}): per scheme the fastest config at the quality the "
        "benchmarks ask for (int4: perplexity at most onnxruntime-genai int4's; int8: within 2%% of float32; "
        "benchmarks/quality.py, docs/export.md)",
    )
    p.add_argument(
        "--symmetric",
        action="store_true",
        default=None,
        help="--weights: blocks without a zero point (rtn, gptq; default: the scheme's, above)",
    )
    p.add_argument(
        "--calibration",
        default=None,
        type=Path,
        metavar="CORPUS",
        help="--quant gptq: a corpus of the base's own answers (clover-data grow) whose training-split prompts "
        f"and answers calibrate GPTQ (default {DEFAULT_CALIBRATION})",
    )
    p.add_argument(
        "--calibration-sequences",
        type=int,
        default=None,
        metavar="N",
        help="--quant gptq: calibration sequences to read, each at most 256 tokens (default 32, at most 512; "
        "onnxruntime's GPTQ runs the whole graph once per sequence for every distinct MatMul input, so its time "
        "grows with N: minutes for SmolLM2 on 2 cores)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="K",
        help="the heads draft over the K tokens the base emits most often (FR-Spec; counted in "
        "--draft-vocab-data): their LM head and top-k cost ~K/V as much, and the output is unchanged "
        "(the base verifies with its full LM head). --backend onnx --dtype float32, with --heads",
    )
    p.add_argument(
        "--draft-vocab-data",
        default=None,
        metavar="CORPUS[,CORPUS]",
        help="--draft-vocab: corpora of the base's own answers, comma-separated (clover-data grow; "
        f"default {DEFAULT_CORPUS})",
    )
    p.add_argument(
        "--ngram-store",
        nargs="?",
        const=str(DEFAULT_CORPUS),
        default=None,
        metavar="CORPUS[,CORPUS]|none",
        help="prompt lookup also drafts what the base wrote after the longest stored match of the sequence's "
        "last 2-24 tokens, over corpora of its own answers, comma-separated (clover-data grow; no model call, "
        f"same output; with no value: {DEFAULT_CORPUS}). Default: for --base smollm2 in a clone of the "
        "repository, the corpora it ships (data/smollm2-sharegpt and data/smollm2-sharegpt-fp32), else none; "
        "none: no store. Without --tree the export times plain decoding, the heads' trees and prompt lookup "
        "here and records the fastest as the default the runtime drafts with",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="store this chat template in the artifact, replacing the base's or adding one to a base model that "
        "ships none (chat requests need one): a file holding the Jinja template, or the template itself (as "
        "vLLM's --chat-template)",
    )
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default 20)")
    p.add_argument("--no-verify", action="store_true", help="skip the export-time ONNX Runtime vs PyTorch parity check")
    return p


def run(args: argparse.Namespace) -> int:
    from clover.export.config import CALIBRATION_SEQUENCES, DEFAULT_OPSET, ExportConfig

    config = ExportConfig(
        backend=args.backend,
        dtype=args.dtype,
        attention=args.attention or default_attention(args.backend, args.dtype, args.base),
        opset=args.opset or DEFAULT_OPSET,
        tree=args.tree,
        max_context=args.max_context,
        max_prompt=args.max_prompt,
        timing_cache=args.timing_cache,
        draft_quant=args.draft_quant,
        weights=args.weights,
        block_size=args.block_size,
        quant=args.quant,
        symmetric=args.symmetric,
        calibration_sequences=args.calibration_sequences or CALIBRATION_SEQUENCES,
        verify=not args.no_verify,
        max_batch=args.max_batch,
        draft_vocab=args.draft_vocab,
    )
    counts_from = corpus_list(args.draft_vocab_data or DEFAULT_CORPUS) if config.draft_vocab is not None else None
    store_from = ngram_store_corpora(args.ngram_store, args.base)
    if (
        counts_from is not None
        and store_from is not None
        and ([f.resolve() for f in counts_from] == [f.resolve() for f in store_from])
    ):
        store, counts = corpus_sources(store_from)  # one read for both
    else:
        counts = corpus_sources(counts_from, store=False)[1] if counts_from is not None else None
        store = corpus_sources(store_from, counts=False)[0] if store_from is not None else None
    calibration = calibration_for(config, args.calibration, args.calibration_sequences)
    chat_template = None
    if args.chat_template is not None:  # read and compiled before minutes of loading
        from clover.runtime.tokenizer import read_chat_template

        chat_template = read_chat_template(args.chat_template)
    if config.backend == "trt":  # at once: before minutes of loading and exporting
        from clover.export.engines import require_engine_builder

        require_engine_builder()  # TensorRT and Polygraphy
    from clover.export.artifact import export_artifact  # imports torch: after the cheap checks

    start = time.perf_counter()
    out = export_artifact(
        args.base,
        args.heads,
        args.out,
        config,
        token_counts=counts,
        ngram_store=store,
        calibration=calibration,
        chat_template=chat_template,
        progress=lambda msg: print(f"clover-export: {msg}", file=sys.stderr, flush=True),
    )
    took = f"clover-export: done in {time.perf_counter() - start:.0f} s"
    if config.backend == "onnx" and config.attention == "plugin":  # ONNX Runtime has no kernel for the plugin nodes
        print(f"{took}; its tree-attention nodes run on TensorRT: build engines with --backend trt", file=sys.stderr)
    else:
        backend = "trt" if config.backend == "trt" else "ort"
        print(
            f"{took}; run it with: clover-generate --artifact {out} --backend {backend} --prompt ...", file=sys.stderr
        )
    print(out)
    return 0


def ngram_store_corpora(spec: str | None, base: str) -> list[Path] | None:
    """--ngram-store's corpora: the ones named, none for "none", and by default the corpora a clone ships for the
    embedded SmolLM2 (where the lookup drafts pay most: benchmarks/peers.py)."""
    if spec is None:
        from clover.tools.demo import shipped_corpora

        corpora = shipped_corpora(base)
        if corpora:
            names = ", ".join(str(c) for c in corpora)
            print(f"clover-export: n-gram store from {names} (--ngram-store none: without)", file=sys.stderr)
        return corpora or None
    return None if spec.strip().lower() == "none" else corpus_list(spec)


def default_attention(backend: str, dtype: str, base: str | None = None) -> str:
    """--attention's default: the fused CPU graph where ONNX Runtime runs float32 (the fast path, batched), the
    portable one for TensorRT, the other dtypes, and a `base` folder the fused graph cannot write (a sliding
    window: Mistral), which is said in one line."""
    if backend != "onnx" or dtype != "float32":
        return "portable"
    if base is not None and (Path(base) / "config.json").is_file():
        from clover.export.config import fused_refusal
        from clover.models.config import BaseConfig

        why = fused_refusal(BaseConfig.from_dir(base))
        if why is not None:
            print(
                f"clover-export: --attention portable: the fused graph cannot write this base ({why})", file=sys.stderr
            )
            return "portable"
    return "fused"


def corpus_list(spec: str | Path | Sequence[str | Path]) -> list[Path]:
    """Corpus folders from a comma-separated list (or one path, or a list of them)."""
    items = spec.split(",") if isinstance(spec, str) else [spec] if isinstance(spec, Path) else list(spec)
    folders = [Path(f) for f in (str(i).strip() for i in items) if f]
    if not folders:
        raise CloverError("no corpus given: pass one or more corpus folders (clover-data grow), comma-separated")
    return folders


def corpus_sources(folders: str | Path | Sequence[str | Path], store: bool = True, counts: bool = True):
    """(n-gram store, token counts) of the answers of one or more corpora of the same base, for --ngram-store and
    --draft-vocab, from one read of their shards (each read checks every shard's sha256); either is None when not
    asked for. The store keeps each answer after the end of its prompt."""
    for folder in corpus_list(folders):  # before the imports below (torch): a wheel has no data/ folder
        if not folder.is_dir():
            raise CloverError(
                f"corpus folder {folder} does not exist: --ngram-store and --draft-vocab-data take corpus "
                f"folders grown by clover-data grow (their default, {DEFAULT_CORPUS}, is relative to the "
                "current folder and comes with a clone of the repository, not with an installed wheel)"
            )
    import numpy as np

    from clover.artifact import check_corpus_base
    from clover.export.draft_vocab import TokenCounts
    from clover.export.ngram_store import StoreSource
    from clover.runtime.lookup import NgramStore
    from clover.train.corpus import Corpus, answer_counts

    conversations, sources, fingerprint = [], [], None
    for folder in corpus_list(folders):
        corpus = Corpus.open(folder)
        fp = corpus.provenance.generator.base_fingerprint
        if fingerprint is None:
            fingerprint = fp
        check_corpus_base(fp, fingerprint, f"corpus {folder}")
        sources.append(f"{folder.name}: {corpus.provenance.totals['response_tokens']} answer tokens")
        conversations += corpus.conversations()
    vocab = int(fingerprint["vocab_size"])
    source = " + ".join(sources)
    sequences = ((np.concatenate([c.prompt, c.response]), len(c.prompt)) for c in conversations)
    return (
        StoreSource(NgramStore.build(sequences, vocab), source, fingerprint) if store else None,
        TokenCounts(answer_counts(conversations, vocab), source, fingerprint) if counts else None,
    )


def calibration_for(config, folder: Path | None, sequences: int | None):
    """--quant gptq's CalibrationSet from --calibration (default DEFAULT_CALIBRATION), else None; the options
    belong to gptq alone."""
    if config.weights is None or config.quantizer != "gptq":
        given = [f for f, v in (("--calibration", folder), ("--calibration-sequences", sequences)) if v is not None]
        if given:
            raise CloverError(f"{' and '.join(given)} calibrate --weights int4 --quant gptq: add those or drop them")
        return None
    folder = folder or DEFAULT_CALIBRATION
    if not folder.is_dir():
        raise CloverError(
            f"--quant gptq calibrates on a corpus of the base's own answers, and {folder} does not exist: pass "
            f"--calibration CORPUS (a folder grown by clover-data grow; the default, {DEFAULT_CALIBRATION}, is "
            "relative to the current folder and comes with a clone of the repository), or use --quant rtn, hqq or kquant"
        )
    return calibration_set(folder, config.calibration_sequences)


def calibration_set(folder: Path, sequences: int):
    """The first `sequences` greedy answers of the corpus at `folder` whose conversation is in the corpus's training
    split (the validation conversations stay held out for benchmarks/quality.py), each as prompt + answer cut to
    CALIBRATION_TOKENS tokens (prompts that leave fewer than 16 answer tokens are skipped)."""
    import numpy as np

    from clover.export.quantize import CALIBRATION_TOKENS, CalibrationSet
    from clover.train.corpus import Corpus

    corpus = Corpus.open(folder)
    held_out, picked = corpus.validation_indices(), []
    for c in corpus.conversations():
        if c.index in held_out or c.sample != 1 or len(c.prompt) > CALIBRATION_TOKENS - 16 or len(c.response) == 0:
            continue
        ids = np.concatenate([c.prompt, c.response])[:CALIBRATION_TOKENS].astype(np.int64)
        picked.append((ids, len(c.prompt)))
        if len(picked) == sequences:
            break
    if not picked:
        raise CloverError(f"--calibration {folder} has no training-split answer to calibrate on: grow it first")
    tokens = sum(len(i) for i, _ in picked)
    source = f"{folder.name}: {len(picked)} training-split sequences, {tokens} tokens"
    return CalibrationSet(tuple(picked), source, corpus.provenance.generator.base_fingerprint)


def main(argv: list[str] | None = None) -> int:
    return run_cli("clover-export", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
