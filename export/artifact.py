"""Build an artifact directory (docs/design.md "Exported artifact") from a base model and draft heads.

    export_artifact("smollm2", "heads/", "out/", ExportConfig())        # from CLI-style specs
    artifact_from_modules(base, heads, tokenizer_dir, "out/", config)    # from loaded modules

Everything is written into a hidden temporary sibling of the target (`.tmp-<name>-*`); the manifest is
written last, then the folder is moved into place with renames. So a crash never leaves a directory
that looks like an artifact, and re-exporting into an existing artifact replaces it whole. A target
that exists, is not empty and is not an artifact is refused.
"""

from __future__ import annotations

import dataclasses
import platform
import shutil
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from clover.artifact import (
    MANIFEST_FILE,
    TOKENIZER_DIR,
    GraphSpec,
    HeadsSpec,
    Manifest,
    WeightsSpec,
    file_entries,
    is_artifact,
    open_artifact,
    write_manifest,
)
from clover.atomic import publish_folder, staging_folder
from clover.errors import CloverError
from clover.export.config import ExportConfig
from clover.export.draft_vocab import TokenCounts
from clover.export.graphs import GraphDef, Sizes, base_graph, draft_graphs, float32_twin
from clover.export.ngram_store import StoreSource
from clover.export.onnx_graph import check_onnx, graph_spec, onnx_from_torch
from clover.export.quantize import CalibrationSet
from clover.models.clover2 import Clover2Heads
from clover.models.decoder import Decoder
from clover.models.heads import BaseFingerprint, DraftHeads
from clover.runtime.tree import Tree, resolve_tree, tree_spec
from clover.runtime.tree import default_tree as runtime_default_tree

Progress = Callable[[str], None]
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
    "config.json",
)
# Export-time parity check: an edge case (no past, one new token) and a small tree over a past.
VERIFY_SIZES: list[Sizes] = [
    {"batch": 1, "new": 1, "past": 0, "rows": 1, "accepted": 1, "candidates": 1},
    {"batch": 1, "new": 6, "past": 5, "rows": 6, "accepted": 3, "candidates": 4},
]
DEFAULT_MAX_PROMPT = 2048  # TensorRT prefill profile when --max-prompt is not given
# The parity limits (per dtype, --weights, --draft-quant) are clover.export.compare's export_tolerance. For
# --weights they are blunt (SmolLM2 int4: up to half the logit range on random inputs): the greedy agreement
# with fp32 is the real check, and below BROKEN_AGREEMENT the graph is broken (a wrong block layout or zero point).
BROKEN_AGREEMENT = 0.5
# --weights: greedy agreement with fp32 PyTorch is measured on these texts (24 generated tokens each).
AGREEMENT_TEXTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "Here are three tips for staying productive:",
)
AGREEMENT_TOKENS = 24
TOOLS = ("clover-deploy", "torch", "onnx", "onnxscript", "onnxruntime")


def export_artifact(
    base: str | Path,
    heads: str,
    out: str | Path,
    config: ExportConfig,
    progress: Progress | None = None,
    token_counts: TokenCounts | None = None,
    ngram_store: StoreSource | None = None,
    calibration: CalibrationSet | None = None,
) -> Path:
    """Load `base` (an HF folder or 'smollm2') and `heads` (a folder, random:ARCH[:SEED] or none) in
    config.dtype and export them to the artifact directory `out` (config.draft_vocab: its tokens are the most
    frequent of `token_counts`; `ngram_store`: what prompt lookup drafts from, export/ngram_store.py;
    `calibration`: --quant gptq's sequences)."""
    from clover.models.head_io import pretrained_names, resolve_heads
    from clover.models.loading import load_base
    from clover.models.smollm2 import resolve_base

    say = progress or (lambda _: None)
    check_target(Path(out))
    base_path = resolve_base(base)
    say(f"loading base {base} ({config.dtype}) and heads {heads}")
    model = load_base(base_path, config.dtype)
    head_set = resolve_heads(heads, model)
    # Folders as absolute paths: the artifact may be used from elsewhere (e.g. to compare with torch).
    named = heads in ("none", "") or heads.startswith("random:") or heads in pretrained_names()
    sources = {
        "base": str(base) if str(base) == "smollm2" else str(base_path.resolve()),
        "heads": heads if named else str(Path(heads).resolve()),
    }
    return artifact_from_modules(
        model,
        head_set,
        base_path,
        out,
        config,
        heads_name=heads,
        sources=sources,
        progress=progress,
        token_counts=token_counts,
        ngram_store=ngram_store,
        calibration=calibration,
    )


def artifact_from_modules(
    base: Decoder,
    heads: DraftHeads | None,
    tokenizer_dir: Path,
    out: str | Path,
    config: ExportConfig,
    heads_name: str = "none",
    sources: dict[str, str] | None = None,
    progress: Progress | None = None,
    token_counts: TokenCounts | None = None,
    ngram_store: StoreSource | None = None,
    calibration: CalibrationSet | None = None,
) -> Path:
    """Export `base` (+ `heads`) with the tokenizer files of `tokenizer_dir` into the artifact `out`
    (`calibration`: the sequences --quant gptq calibrates on)."""
    say = progress or (lambda _: None)
    out = Path(out)
    check_target(out)
    dtype = str(base.lm_head.weight.dtype).removeprefix("torch.")
    if dtype != config.dtype:
        raise CloverError(
            f"the base model is {dtype} but the export asks for {config.dtype}: load it in {config.dtype}"
        )
    draft_ids = draft_vocab_ids(base, heads, config, token_counts)
    check_quantizer_inputs(base, config, calibration)
    tree = default_tree(heads, config.tree)
    max_context = resolve_max_context(base, config.max_context)
    # The fused base is written from the module's weights (export/fused_graph.py); the portable GraphDef is
    # its PyTorch reference and example maker all the same.
    traced = "portable" if config.attention == "fused" else config.attention
    graphs = [base_graph(base, traced, chains=fused_chains_only(config))] + (
        draft_graphs(heads) if heads is not None else []
    )
    # No --tree: time the candidate trees and draft sources on the graphs (ONNX Runtime on this machine) and keep
    # the fastest; without heads that is plain decoding against prompt lookup, when there is an n-gram store.
    time_trees = (
        config.tree is None
        and (heads is not None or ngram_store is not None)
        and config.backend == "onnx"
        and config.attention != "plugin"
    )
    # ONNX Runtime artifacts with heads: one LM head for all graphs (export/lm_head.py); TensorRT keeps one per
    # engine. float32 only: ONNX Runtime's CPU runs float16 matmuls in float32 between Casts it elides inside a
    # graph, so a float16 base cut before its LM head would round the rows it hands over (not bit-exact).
    share_lm_head = (
        config.shared_lm_head and heads is not None and config.backend == "onnx" and config.dtype == "float32"
    )
    # Fused artifacts: a batched base for several sequences per forward (export/batch_graph.py).
    batched = config.attention == "fused" and config.max_batch > 1
    # --draft-quant with the shared LM head: the drafts run a quantized copy of it (draft_lm_head.onnx), over the
    # draft vocabulary or, without one, over the whole vocabulary.
    draft_head = draft_ids is not None or (config.draft_quant is not None and share_lm_head)
    steps = len(graphs) + 1 + (config.backend == "trt") + time_trees + share_lm_head + batched + draft_head

    import_native_modules()
    with staging_folder(out) as tmp:
        copy_tokenizer(tokenizer_dir, tmp / TOKENIZER_DIR)  # first: fail fast, before minutes of export
        specs, parity, embedding, base_head = {}, {}, "float32", None
        for i, graph in enumerate(graphs, 1):
            t0 = time.perf_counter()
            say(f"[{i}/{steps}] {graph.name}: exporting {graph.name}.onnx")
            specs[graph.name], errors = checked_onnx_from_torch(graph, tmp, config, max_context)
            if errors is not None:
                parity[graph.name] = errors
            say(f"      {progress_note(errors, config.dtype)} ({time.perf_counter() - t0:.1f} s)")
            if config.draft_quant and graph.name == "base" and share_lm_head:
                from clover.export.lm_head import lm_head_key

                base_head = lm_head_key(tmp / specs["base"].file)
            if config.draft_quant and graph.name != "base":
                t0 = time.perf_counter()
                errors = quantized(graph, tmp / specs[graph.name].file, config, base_head)
                if errors is not None:
                    parity[f"{graph.name}.{config.draft_quant}"] = errors
                say(
                    f"      {config.draft_quant} weights: {progress_note(errors, config.dtype)} "
                    f"({time.perf_counter() - t0:.1f} s)"
                )
            if config.weights:
                t0 = time.perf_counter()
                stored, errors = weights_quantized(graph, tmp / specs[graph.name].file, config, calibration, say)
                embedding = stored if graph.name == "base" else embedding
                if errors is not None:
                    parity[f"{graph.name}.{config.weights}"] = errors
                rounded = config.quantizer if graph.name == "base" else "rtn"
                say(
                    f"      {config.weights} weights ({rounded}, MatMulNBits, blocks of {config.block}): "
                    f"{progress_note(errors, config.dtype)} ({time.perf_counter() - t0:.1f} s)"
                )
        weights = None
        if config.weights:
            agreement = {}
            if config.verify:
                say(f"      greedy agreement of the {config.weights} base with fp32 PyTorch")
                agreement = weights_agreement(base, tmp, specs["base"].file)
                say(f"      {agreement['top1']:.1%} of {agreement['positions']} greedy tokens agree")
                if not agreement["top1"] >= BROKEN_AGREEMENT:
                    raise CloverError(
                        f"the {config.weights} base graph picks fp32's greedy token at only {agreement['top1']:.0%} of "
                        f"positions (< {BROKEN_AGREEMENT:.0%}): this is a clover-export bug, please report it"
                    )
            from clover.export.quantize import DRAFT_ACCURACY_LEVEL, base_accuracy_level, quantizer_settings

            weights = WeightsSpec(
                config.weights,
                config.block,
                config.is_symmetric,
                base_accuracy_level(config.attention),
                DRAFT_ACCURACY_LEVEL,
                embedding,
                agreement,
                quantizer_settings(config.quantizer, config.weights, config.block, config.is_symmetric, calibration),
            )
        if share_lm_head:
            from clover.export.lm_head import LM_HEAD, LM_INPUT, split_lm_head

            t0 = time.perf_counter()
            keep_base = config.weights is not None  # one session call a step instead of two (export/lm_head.py)
            which = "the draft graphs" if keep_base else "the base and the draft graphs"
            say(f"[{len(graphs) + 1}/{steps}] {LM_HEAD}: one LM head for {which}")
            specs = split_lm_head(tmp, specs, graphs, VERIFY_SIZES[1], verify=config.verify, keep_base=keep_base)
            shared = [n for n, s in specs.items() if s.has_output(LM_INPUT)]
            say(
                f"      {LM_HEAD}.onnx serves {', '.join(shared)} ({time.perf_counter() - t0:.1f} s)"
                + ("; the base keeps its own copy" if keep_base else "")
                if shared
                else "      the draft graphs have their own LM head: nothing shared"
            )
        draft_vocab = None
        if draft_head:
            import numpy as np

            from clover.export.draft_vocab import WHOLE_VOCABULARY, add_draft_vocab, coverage
            from clover.export.lm_head import LM_HEAD, LM_INPUT

            t0 = time.perf_counter()
            step = f"[{len(graphs) + 1 + share_lm_head}/{steps}]"
            ids = None
            if draft_ids is not None:
                say(
                    f"{step} draft vocabulary: the {len(draft_ids)} tokens the base emits most often "
                    f"({token_counts.source})"
                )
                ids, source, covered = draft_ids, token_counts.source, coverage(token_counts.counts, draft_ids)
            elif LM_HEAD in specs and any(s.has_output(LM_INPUT) for n, s in specs.items() if n != "base"):
                say(f"{step} the drafts' {config.draft_quant} LM head")
                ids, source, covered = np.arange(base.config.vocab_size), WHOLE_VOCABULARY, 1.0
            else:
                say(f"{step} the draft graphs keep their own {config.draft_quant} LM heads")
            if ids is not None:
                specs, draft_vocab = add_draft_vocab(tmp, specs, ids, source, covered, quant=config.draft_quant)
                which = (
                    "over the whole vocabulary"
                    if source == WHOLE_VOCABULARY
                    else f"over {draft_vocab.coverage:.2%} of the tokens counted there"
                )
                say(
                    f"      draft_lm_head.onnx ({which}) serves {', '.join(draft_vocab.graphs)} "
                    f"({time.perf_counter() - t0:.1f} s)"
                )
        if batched:
            from clover.export.batch_graph import BATCH_GRAPH, write_batched_base

            t0 = time.perf_counter()
            say(
                f"[{len(graphs) + 1 + share_lm_head + draft_head}/{steps}] {BATCH_GRAPH}: "
                f"{config.max_batch} sequences per forward"
            )
            specs[BATCH_GRAPH] = graph_spec(write_batched_base(tmp, specs["base"].file, config.max_batch))
            check_onnx(tmp / specs[BATCH_GRAPH].file)
        engines = {}
        if config.backend == "trt":
            from clover.export.engines import build_engines

            say(f"[{steps - 1}/{steps}] TensorRT engines")
            engines = build_engines(
                tmp, specs, config.dtype, engine_limits(config, tree, max_context), timing_cache_path(config), say
            )
        fingerprint = dataclasses.asdict(BaseFingerprint.of(base))
        store = None
        if ngram_store is not None:
            from clover.export.ngram_store import add_ngram_store

            store = add_ngram_store(tmp, ngram_store, fingerprint)
            say(f"      n-gram store for prompt lookup: {store.contexts} contexts ({ngram_store.source})")
        manifest = Manifest(
            backend=config.backend,
            dtype=config.dtype,
            attention=config.attention,
            opset=config.opset,
            max_context=max_context,
            base_config=base.config.to_dict(),
            base_fingerprint=fingerprint,
            sources=dict(sources or {}),
            heads=heads_spec(heads, heads_name) if heads is not None else None,
            tree=tree_spec(tree) if tree is not None else None,
            graphs=specs,
            tokenizer=TOKENIZER_DIR,
            tools=tool_versions(),
            parity=parity,
            files={},
            engines=engines,
            draft_quant=config.draft_quant,
            weights=weights,
            draft_vocab=draft_vocab,
            ngram_store=store,
        )
        if batched and config.verify:
            from clover.export.batch_graph import check_batched

            check_batched(tmp, manifest)
            say(f"      every sequence's logits bit for bit the base graph's ({time.perf_counter() - t0:.1f} s)")
        if time_trees:
            from clover.export.tree_timing import fastest_tree

            say(f"[{steps - 1}/{steps}] default tree and drafts: timing plain, the trees and prompt lookup here")
            tree, drafts, timing = fastest_tree(tmp, manifest, say=say)
            manifest = dataclasses.replace(
                manifest, tree=tree_spec(tree) if tree is not None else None, drafts=drafts, tree_timing=timing
            )
        say(f"[{steps}/{steps}] checksums and manifest")
        manifest = dataclasses.replace(manifest, files=file_entries(tmp))
        write_manifest(tmp, manifest)  # last: the folder is an artifact from here on
        install(tmp, out)
    say(f"artifact written to {out}")
    return out


def import_native_modules() -> None:
    """Import the compiled packages an export loads on first use before its staging folder exists. Inside it,
    Ctrl-C / SIGTERM raise at once (clover.atomic), and an exception raised while such a package initialises
    (onnx's protobuf descriptors, via torch.onnx's exporter) aborts the interpreter instead of unwinding."""
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401
    import onnxscript  # noqa: F401  (torch.onnx.export(dynamo=True) imports it on its first call)


def derived_artifact(src: Path, out: Path, drop: set[str], change: Callable[[Path, Manifest], Manifest]) -> Path:
    """A copy of the artifact `src` at `out`, without its files `drop`, after `change(folder, manifest)` added
    what it adds to the folder and returned the new manifest (checksums are redone): no re-export. Written like
    an export: in a staging folder, manifest last, moved into place."""
    src, out = Path(src), Path(out)
    manifest = open_artifact(src)
    check_target(out)
    import_native_modules()
    with staging_folder(out) as tmp:
        for rel in manifest.files:
            if rel not in drop | {MANIFEST_FILE}:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src / rel, tmp / rel)
        manifest = change(tmp, manifest)
        write_manifest(tmp, dataclasses.replace(manifest, files=file_entries(tmp)))
        publish_folder(tmp, out)
    return out


# -- steps ---------------------------------------------------------------------------------------------


def draft_vocab_ids(base: Decoder, heads: DraftHeads | None, config: ExportConfig, token_counts: TokenCounts | None):
    """config.draft_vocab: the K most frequent tokens of `token_counts` (checked against the base), else None."""
    if config.draft_vocab is None:
        return None
    from clover.artifact import check_corpus_base
    from clover.export.draft_vocab import check_size, ranked_ids

    if heads is None:
        raise CloverError("--draft-vocab sizes what the draft heads score: use it with --heads")
    vocab = base.config.vocab_size
    check_size(config.draft_vocab, vocab)
    if token_counts is None:
        raise CloverError(
            "--draft-vocab needs token counts of the base's own output: pass --draft-vocab-data CORPUS "
            "(a folder grown by clover-data grow)"
        )
    check_corpus_base(
        token_counts.base_fingerprint,
        dataclasses.asdict(BaseFingerprint.of(base)),
        f"--draft-vocab-data ({token_counts.source})",
    )
    if len(token_counts.counts) != vocab:
        raise CloverError(
            f"--draft-vocab-data counts {len(token_counts.counts)} tokens, the base has {vocab}: grow a "
            "corpus with this base (clover-data grow)"
        )
    return ranked_ids(token_counts.counts)[: config.draft_vocab]


def check_quantizer_inputs(base: Decoder, config: ExportConfig, calibration: CalibrationSet | None) -> None:
    """--quant gptq has its calibration sequences, written by this base; the block size suits the quantizer."""
    if config.weights is None:
        return
    from clover.artifact import check_corpus_base
    from clover.export.quantize import check_block_layout

    c = base.config
    sizes = {"hidden": c.hidden_size, "attention": c.num_heads * c.head_dim, "intermediate": c.intermediate_size}
    check_block_layout(config.quantizer, config.weights, config.is_symmetric, config.block, sizes)
    if config.quantizer != "gptq":
        return
    if calibration is None or not calibration.sequences:
        raise CloverError(
            "--quant gptq needs calibration sequences of the base's own answers: pass --calibration CORPUS (a folder "
            "grown by clover-data grow, e.g. data/smollm2-sharegpt-fp32), or use --quant rtn, hqq or kquant"
        )
    check_corpus_base(
        calibration.base_fingerprint,
        dataclasses.asdict(BaseFingerprint.of(base)),
        f"--calibration ({calibration.source})",
    )
    if max(int(ids.max()) for ids, _ in calibration.sequences) >= c.vocab_size:
        raise CloverError(f"--calibration ({calibration.source}) holds token ids beyond the base's vocabulary")


def fused_chains_only(config: ExportConfig) -> bool:
    """A fused base with int8 compute (--weights) verifies only chains exactly (quantize.py): its graph skips
    the tree mask, and its parity check runs chains."""
    from clover.export.quantize import base_accuracy_level

    return config.attention == "fused" and config.weights is not None and base_accuracy_level(config.attention) != 0


def checked_onnx_from_torch(
    graph: GraphDef, out_dir: Path, config: ExportConfig, max_context: int
) -> tuple[GraphSpec, dict[str, float] | None]:
    """Export one graph (fused: the base and Clover-2's draft_begin are written from their weights), run the
    ONNX checker on it, and (config.verify) its parity check. bfloat16 graphs get the checker only: ONNX
    Runtime's CPU provider has no bf16 kernels for most ops."""
    if graph.name == "base" and config.attention == "fused":
        from clover.export.fused_graph import write_fused_base

        write_fused_base(graph.module.base, out_dir / "base.onnx", max_context, trees=not fused_chains_only(config))
        spec = graph_spec(out_dir / "base.onnx")
    elif graph.name == "draft_begin" and config.attention == "fused" and isinstance(graph.module.heads, Clover2Heads):
        from clover.export.fused_graph import write_fused_begin

        write_fused_begin(graph.module.heads, out_dir / "draft_begin.onnx", max_context)
        spec = graph_spec(out_dir / "draft_begin.onnx")
    else:
        spec = onnx_from_torch(graph, out_dir, config.opset)
    check_onnx(out_dir / spec.file)
    verify = config.verify and config.dtype != "bfloat16"
    return spec, verified_parity(graph, out_dir / spec.file, config.dtype) if verify else None


def quantized(graph: GraphDef, path: Path, config: ExportConfig, base_head: str | None) -> dict[str, float] | None:
    """--draft-quant: rewrite the checked fp32 draft graph with quantized weights, all but the LM head it shares
    with the base (`base_head`: its weights key; None: nothing shared), then (config.verify) measure how far the
    quantized graph is from PyTorch."""
    from clover.export.quantize import quantize_draft_graph

    quantize_draft_graph(path, config.draft_quant, keep_lm_head=base_head)
    check_onnx(path)
    if not config.verify:
        return None
    return verified_parity(graph, path, config.dtype, draft_quant=config.draft_quant)


def weights_quantized(
    graph: GraphDef,
    path: Path,
    config: ExportConfig,
    calibration: CalibrationSet | None = None,
    progress: Progress | None = None,
) -> tuple[str, dict[str, float] | None]:
    """--weights: rewrite the checked fp32 graph with MatMulNBits weights (the base rounded by --quant, the draft
    graphs by rtn), then (config.verify) measure how far it is from fp32 PyTorch. Returns how the token embedding
    is stored, and the errors."""
    from clover.export.quantize import DRAFT_ACCURACY_LEVEL, base_accuracy_level, quantize_weights

    base = graph.name == "base"
    level = base_accuracy_level(config.attention) if base else DRAFT_ACCURACY_LEVEL
    # The draft graphs' Gemms too (rows through a Linear): they only change what is proposed.
    embedding = quantize_weights(
        path,
        config.weights,
        config.block,
        level,
        gemms=not base,
        quant=config.quantizer if base else "rtn",
        symmetric=config.is_symmetric,
        calibration=calibration if base else None,
        progress=progress,
    )
    check_onnx(path)
    if not config.verify:
        return embedding, None
    return embedding, verified_parity(graph, path, config.dtype, weights=config.weights)


def weights_agreement(base: Decoder, folder: Path, graph_file: str) -> dict[str, float]:
    """Greedy top-1 agreement of the quantized base graph with fp32 PyTorch on AGREEMENT_TEXTS."""
    from clover.export.onnx_graph import greedy_agreement
    from clover.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(folder / TOKENIZER_DIR)
    prompts = [ids for ids in (tokenizer.encode(t) for t in AGREEMENT_TEXTS) if ids]
    return greedy_agreement(base, folder / graph_file, prompts, AGREEMENT_TOKENS)


def engine_limits(config: ExportConfig, tree: Tree | None, max_context: int):
    """The shapes TensorRT's optimization profiles must cover: prompts up to --max-prompt, verify steps
    up to the artifact's tree (any tree with at most that many nodes and that depth runs)."""
    from clover.export.engines import EngineLimits

    nodes = tree.num_nodes if tree is not None else 1
    return EngineLimits(
        max_batch=1,
        max_prompt=config.max_prompt or min(max_context, DEFAULT_MAX_PROMPT),
        max_tree=nodes,
        max_context=max_context,
        max_accepted=(tree.max_depth + 1) if tree is not None else 1,
        max_candidates=nodes,
    )


def timing_cache_path(config: ExportConfig) -> Path:
    """--timing-cache, else one shared file in the user cache: kernel timings carry across exports."""
    if config.timing_cache:
        return Path(config.timing_cache)
    from clover.models.smollm2 import cache_dir

    return cache_dir() / "tensorrt" / "timing.cache"


def progress_note(errors: dict[str, float] | None, dtype: str) -> str:
    if errors is None:
        return "checker ok"
    against = "PyTorch" if dtype == "float32" else "PyTorch fp32"
    shown = ", ".join(f"{k} {v:.1e}" for k, v in errors.items() if not k.startswith("present."))
    return f"checker ok, max |ONNX - {against}| {shown}"


def check_target(out: Path) -> None:
    """The target may be absent, an empty folder, or an artifact (replaced whole); nothing else."""
    if out.exists() and not out.is_dir():
        raise CloverError(f"--out {out} is a file: pass a folder path for the artifact")
    if out.is_dir() and any(out.iterdir()) and not is_artifact(out):
        raise CloverError(
            f"--out {out} is a non-empty folder that is not a clover artifact (no manifest.json from clover-export): "
            "choose a new folder or empty this one; clover-export only ever replaces artifacts"
        )


def default_tree(heads: DraftHeads | None, spec: str | None) -> Tree | None:
    """The tree recorded as the artifact's default: --tree, else mc26 pruned to the heads' depth (ONNX
    artifacts then replace it with the fastest tree measured on their graphs: clover.export.tree_timing)."""
    if heads is None:
        if spec not in (None, "plain"):
            raise CloverError("a token tree needs draft heads: pass --heads (e.g. random:clover2) or drop --tree")
        return None
    depth = heads.config.max_depth
    tree = resolve_tree(spec) if spec is not None else runtime_default_tree(depth)
    if depth is not None and tree.max_depth > depth:
        raise CloverError(
            f"tree {tree.name} has depth {tree.max_depth} but {heads.config.arch} heads draft at most {depth} "
            f"tokens: choose a shallower tree (e.g. chain-{depth})"
        )
    return tree


def resolve_max_context(base: Decoder, requested: int | None) -> int:
    limit = base.config.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise CloverError(f"--max-context {requested} exceeds the base model's max_position_embeddings ({limit})")
    return requested


def verified_parity(
    graph: GraphDef, path: Path, dtype: str, weights: str | None = None, draft_quant: str | None = None
) -> dict[str, float]:
    """Max abs error per output of the graph at `path` on ONNX Runtime against PyTorch (float32 PyTorch for a
    float16 or quantized graph) on VERIFY_SIZES, through Polygraphy (clover.export.compare, as clover-compare);
    an output beyond the export's tolerance (compare.export_tolerance) is a bug, not noise, and fails the export."""
    from clover.export.compare import export_tolerance, parity

    tolerance = export_tolerance(graph.name, dtype, weights, draft_quant)
    rows = parity(graph, path, VERIFY_SIZES, tolerance, reference=float32_twin(graph) if dtype != "float32" else None)
    for r in rows:
        if not r.passed:
            found = r.note or f"differs by {r.max_abs:.3g} (relative to its largest value {r.max_rel:.2g})"
            raise CloverError(
                f"{path.name} does not match PyTorch: output {r.output} {found}, beyond atol "
                f"{tolerance.atol:g} / rtol {tolerance.rtol:g}: this is a clover-export bug, please "
                "report it"
            )
    return {r.output: r.max_abs for r in rows}


def heads_spec(heads: DraftHeads, name: str) -> HeadsSpec:
    c = heads.config
    return HeadsSpec(
        name=name,
        arch=c.arch,
        num_heads=c.num_heads,
        num_layers=c.num_layers,
        own_lm_head=c.own_lm_head,
        max_depth=c.max_depth,
        base=dataclasses.asdict(c.base),
    )


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Copy the files clover.runtime.tokenizer.Tokenizer.from_dir reads, and check that they load."""
    from clover.runtime.tokenizer import Tokenizer

    if not (src / "tokenizer.json").is_file():
        raise CloverError(f"base folder {src} has no tokenizer.json: the artifact needs the base's fast tokenizer file")
    dst.mkdir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    Tokenizer.from_dir(dst)


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in TOOLS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def install(tmp: Path, out: Path) -> None:
    """Move the finished folder to `out`; an old artifact there is moved aside first, then deleted."""
    check_target(out)  # again: the target may have changed during a long export
    publish_folder(tmp, out)
