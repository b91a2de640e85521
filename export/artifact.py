"""Build an artifact directory (docs/design.md "Exported artifact") from a base model and draft heads.

    export_artifact("smollm2", "heads/", "out/", ExportConfig())        # from CLI-style specs
    artifact_from_modules(base, heads, tokenizer_dir, "out/", config)    # from loaded modules
    artifact_from_modules(..., config, ArtifactOptions(heads_name="random:clover2", progress=print))

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from clover.artifact import (
    MANIFEST_FILE,
    TOKENIZER_DIR,
    DraftVocabSpec,
    EngineSpec,
    GraphSpec,
    HeadsSpec,
    Manifest,
    NgramStoreSpec,
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
from clover.export.trace_cache import traced
from clover.models.clover2 import Clover2Heads
from clover.models.config import BaseConfig
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
    chat_template: str | None = None,
) -> Path:
    """Load `base` (an HF folder or 'smollm2') and `heads` (a folder, random:ARCH[:SEED] or none) in
    config.dtype and export them to the artifact directory `out` (config.draft_vocab: its tokens are the most
    frequent of `token_counts`; `ngram_store`: what prompt lookup drafts from, export/ngram_store.py;
    `calibration`: --quant gptq's sequences; `chat_template`: Jinja text stored as the artifact's chat template,
    replacing the base's or adding one to a base model that has none)."""
    from clover.models.head_io import pretrained_names, resolve_heads
    from clover.models.loading import load_base
    from clover.models.smollm2 import resolve_base

    say = progress or (lambda _: None)
    check_target(Path(out))
    base_path = resolve_base(base)
    config.check_base(BaseConfig.from_dir(base_path))  # before minutes of loading a large base
    say(f"loading base {base} ({config.dtype}) and heads {heads}")
    model = load_base(base_path, config.dtype)
    head_set = resolve_heads(heads, model)
    # Folders as absolute paths: the artifact may be used from elsewhere (e.g. to compare with torch).
    named = heads in ("none", "") or heads.startswith("random:") or heads in pretrained_names()
    sources = {
        "base": str(base) if str(base) == "smollm2" else str(base_path.resolve()),
        "heads": heads if named else str(Path(heads).resolve()),
    }
    options = ArtifactOptions(
        heads_name=heads,
        sources=sources,
        token_counts=token_counts,
        ngram_store=ngram_store,
        calibration=calibration,
        chat_template=chat_template,
        progress=progress,
    )
    return artifact_from_modules(model, head_set, base_path, out, config, options)


@dataclass(frozen=True)
class ArtifactOptions:
    """What artifact_from_modules takes besides the modules and the ExportConfig: what the manifest records of where
    they came from, the data some ExportConfig options read, and where the progress lines go. Not ExportConfig
    fields: that object is what clover-export's flags ask for, checked with no data loaded; these are loaded
    corpora and a callback."""

    heads_name: str = "none"  # the manifest's heads.name
    sources: Mapping[str, str] = field(default_factory=dict)  # what --base / --heads named (manifest sources)
    token_counts: TokenCounts | None = None  # config.draft_vocab: its tokens are the most frequent of these
    ngram_store: StoreSource | None = None  # what prompt lookup drafts from (export/ngram_store.py)
    calibration: CalibrationSet | None = None  # the sequences --quant gptq calibrates on
    chat_template: str | None = None  # Jinja text: the artifact's chat template, replacing the base's (if any)
    progress: Progress | None = None

    def say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(line)


def artifact_from_modules(
    base: Decoder,
    heads: DraftHeads | None,
    tokenizer_dir: Path,
    out: str | Path,
    config: ExportConfig,
    options: ArtifactOptions = ArtifactOptions(),
) -> Path:
    """Export `base` (+ `heads`) with the tokenizer files of `tokenizer_dir` into the artifact `out`."""
    out = Path(out)
    check_target(out)
    plan = plan_from_modules(base, heads, config, options)  # every check that needs no file, before one is written
    import_native_modules()
    with staging_folder(out) as tmp:
        # first: fail fast, before minutes of export
        tokenizer = copy_tokenizer(tokenizer_dir, tmp / TOKENIZER_DIR, options.chat_template)
        options.say(tokenizer_note(tokenizer.has_chat_template, options.chat_template is not None))
        specs, parity, embedding = onnx_from_modules(plan, tmp)
        weights = weights_spec_from_onnx(plan, tmp, specs, embedding)
        specs = shared_lm_head_from_onnx(plan, tmp, specs)
        specs, draft_vocab = draft_lm_head_from_onnx(plan, tmp, specs)
        specs, batch_started = batched_base_from_onnx(plan, tmp, specs)
        engines = engines_from_onnx(plan, tmp, specs)
        store = ngram_store_from_source(plan, tmp)
        manifest = manifest_from_parts(
            plan, specs, parity, engines=engines, weights=weights, draft_vocab=draft_vocab, store=store
        )
        manifest = dataclasses.replace(manifest, chat_template=tokenizer.has_chat_template)
        check_batched_base(plan, tmp, manifest, batch_started)
        manifest = timed_tree_from_onnx(plan, tmp, manifest)
        options.say(f"{plan.step(plan.steps)} checksums and manifest")
        manifest = dataclasses.replace(manifest, files=file_entries(tmp))
        write_manifest(tmp, manifest)  # last: the folder is an artifact from here on
        install(tmp, out)
    options.say(f"artifact written to {out}")
    return out


@dataclass(frozen=True)
class ArtifactPlan:
    """What one export writes, decided (and checked) from the modules and options before any file is: the graphs,
    which optional steps run, and their numbers in the progress lines."""

    base: Decoder
    heads: DraftHeads | None
    config: ExportConfig
    options: ArtifactOptions
    graphs: list[GraphDef]
    tree: Tree | None
    max_context: int
    fingerprint: dict[str, Any]  # BaseFingerprint.of(base), as the manifest records it
    draft_ids: np.ndarray | None  # config.draft_vocab: the tokens the heads draft over
    time_trees: bool
    share_lm_head: bool
    draft_head: bool
    batched: bool

    @property
    def steps(self) -> int:
        trt = self.config.backend == "trt"
        return len(self.graphs) + 1 + trt + self.time_trees + self.share_lm_head + self.batched + self.draft_head

    def step(self, i: int) -> str:
        return f"[{i}/{self.steps}]"


def plan_from_modules(
    base: Decoder, heads: DraftHeads | None, config: ExportConfig, options: ArtifactOptions
) -> ArtifactPlan:
    """The checks that need the modules and the options, and the plan of what the export writes."""
    dtype = str(base.lm_head.weight.dtype).removeprefix("torch.")
    if dtype != config.dtype:
        raise CloverError(
            f"the base model is {dtype} but the export asks for {config.dtype}: load it in {config.dtype}"
        )
    config.check_base(base.config)
    draft_ids = draft_vocab_ids(base, heads, config, options.token_counts)
    check_quantizer_inputs(base, config, options.calibration)
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
        and (heads is not None or options.ngram_store is not None)
        and config.backend == "onnx"
        and config.attention != "plugin"
    )
    # ONNX Runtime artifacts with heads: one LM head for all graphs (export/lm_head.py); TensorRT keeps one per
    # engine. float32 only: ONNX Runtime's CPU runs float16 matmuls in float32 between Casts it elides inside a
    # graph, so a float16 base cut before its LM head would round the rows it hands over (not bit-exact).
    share_lm_head = (  # (a soft-capped LM head stays in each graph: the cut takes the projection alone)
        config.shared_lm_head
        and heads is not None
        and config.backend == "onnx"
        and config.dtype == "float32"
        and base.config.final_softcap is None
    )
    return ArtifactPlan(
        base=base,
        heads=heads,
        config=config,
        options=options,
        graphs=graphs,
        tree=tree,
        max_context=max_context,
        fingerprint=dataclasses.asdict(BaseFingerprint.of(base)),
        draft_ids=draft_ids,
        time_trees=time_trees,
        share_lm_head=share_lm_head,
        # --draft-quant with the shared LM head: the drafts run a quantized copy of it (draft_lm_head.onnx), over
        # the draft vocabulary or, without one, over the whole vocabulary.
        draft_head=draft_ids is not None or (config.draft_quant is not None and share_lm_head),
        # Fused artifacts: a batched base for several sequences per forward (export/batch_graph.py).
        batched=config.attention == "fused" and config.max_batch > 1,
    )


def onnx_from_modules(plan: ArtifactPlan, tmp: Path) -> tuple[dict[str, GraphSpec], dict[str, dict[str, float]], str]:
    """Every graph of the plan as checked (and --draft-quant / --weights quantized) ONNX in `tmp`: their specs,
    their parity errors, and how the base stores its token embedding."""
    config, say = plan.config, plan.options.say
    specs, parity, embedding, base_head = {}, {}, "float32", None
    for i, graph in enumerate(plan.graphs, 1):
        t0 = time.perf_counter()
        say(f"{plan.step(i)} {graph.name}: exporting {graph.name}.onnx")
        specs[graph.name], errors = checked_onnx_from_torch(graph, tmp, config, plan.max_context)
        if errors is not None:
            parity[graph.name] = errors
        say(f"      {progress_note(errors, config.dtype)} ({time.perf_counter() - t0:.1f} s)")
        if config.draft_quant and graph.name == "base" and plan.share_lm_head:
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
            calibration = plan.options.calibration
            stored, errors = weights_quantized(graph, tmp / specs[graph.name].file, config, calibration, say)
            embedding = stored if graph.name == "base" else embedding
            if errors is not None:
                parity[f"{graph.name}.{config.weights}"] = errors
            rounded = config.quantizer if graph.name == "base" else "rtn"
            say(
                f"      {config.weights} weights ({rounded}, MatMulNBits, blocks of {config.block}): "
                f"{progress_note(errors, config.dtype)} ({time.perf_counter() - t0:.1f} s)"
            )
    return specs, parity, embedding


def weights_spec_from_onnx(
    plan: ArtifactPlan, tmp: Path, specs: dict[str, GraphSpec], embedding: str
) -> WeightsSpec | None:
    """--weights: the manifest's record of the quantized graphs, after (config.verify) the base graph's greedy
    agreement with fp32 PyTorch, which fails the export below BROKEN_AGREEMENT; None without --weights."""
    config, say = plan.config, plan.options.say
    if not config.weights:
        return None
    agreement = {}
    if config.verify:
        say(f"      greedy agreement of the {config.weights} base with fp32 PyTorch")
        agreement = weights_agreement(plan.base, tmp, specs["base"].file)
        say(f"      {agreement['top1']:.1%} of {agreement['positions']} greedy tokens agree")
        if not agreement["top1"] >= BROKEN_AGREEMENT:
            raise CloverError(
                f"the {config.weights} base graph picks fp32's greedy token at only {agreement['top1']:.0%} of "
                f"positions (< {BROKEN_AGREEMENT:.0%}): this is a clover-export bug, please report it"
            )
    from clover.export.quantize import DRAFT_ACCURACY_LEVEL, base_accuracy_level, quantizer_settings

    calibration = plan.options.calibration
    return WeightsSpec(
        config.weights,
        config.block,
        config.is_symmetric,
        base_accuracy_level(config.attention),
        DRAFT_ACCURACY_LEVEL,
        embedding,
        agreement,
        quantizer_settings(config.quantizer, config.weights, config.block, config.is_symmetric, calibration),
    )


def shared_lm_head_from_onnx(plan: ArtifactPlan, tmp: Path, specs: dict[str, GraphSpec]) -> dict[str, GraphSpec]:
    """plan.share_lm_head: the graphs' LM head cut out into one lm_head.onnx (export/lm_head.py); else `specs`."""
    if not plan.share_lm_head:
        return specs
    from clover.export.lm_head import LM_HEAD, LM_INPUT, split_lm_head

    config, say = plan.config, plan.options.say
    t0 = time.perf_counter()
    keep_base = config.weights is not None  # one session call a step instead of two (export/lm_head.py)
    which = "the draft graphs" if keep_base else "the base and the draft graphs"
    say(f"{plan.step(len(plan.graphs) + 1)} {LM_HEAD}: one LM head for {which}")
    specs = split_lm_head(tmp, specs, plan.graphs, VERIFY_SIZES[1], verify=config.verify, keep_base=keep_base)
    shared = [n for n, s in specs.items() if s.has_output(LM_INPUT)]
    say(
        f"      {LM_HEAD}.onnx serves {', '.join(shared)} ({time.perf_counter() - t0:.1f} s)"
        + ("; the base keeps its own copy" if keep_base else "")
        if shared
        else "      the draft graphs have their own LM head: nothing shared"
    )
    return specs


def draft_lm_head_from_onnx(
    plan: ArtifactPlan, tmp: Path, specs: dict[str, GraphSpec]
) -> tuple[dict[str, GraphSpec], DraftVocabSpec | None]:
    """plan.draft_head: the drafts' own LM head, draft_lm_head.onnx (export/draft_vocab.py), over the draft
    vocabulary or, --draft-quant alone, a quantized copy over the whole vocabulary; else `specs` and None."""
    if not plan.draft_head:
        return specs, None
    from clover.export.draft_vocab import WHOLE_VOCABULARY, add_draft_vocab, coverage
    from clover.export.lm_head import LM_HEAD, LM_INPUT

    config, counts, say = plan.config, plan.options.token_counts, plan.options.say
    t0 = time.perf_counter()
    step = plan.step(len(plan.graphs) + 1 + plan.share_lm_head)
    if plan.draft_ids is not None:
        say(f"{step} draft vocabulary: the {len(plan.draft_ids)} tokens the base emits most often ({counts.source})")
        ids, source, covered = plan.draft_ids, counts.source, coverage(counts.counts, plan.draft_ids)
    elif LM_HEAD in specs and any(s.has_output(LM_INPUT) for n, s in specs.items() if n != "base"):
        say(f"{step} the drafts' {config.draft_quant} LM head")
        ids, source, covered = np.arange(plan.base.config.vocab_size), WHOLE_VOCABULARY, 1.0
    else:
        say(f"{step} the draft graphs keep their own {config.draft_quant} LM heads")
        return specs, None
    specs, draft_vocab = add_draft_vocab(tmp, specs, ids, source, covered, quant=config.draft_quant)
    which = (
        "over the whole vocabulary"
        if source == WHOLE_VOCABULARY
        else f"over {draft_vocab.coverage:.2%} of the tokens counted there"
    )
    served = ", ".join(draft_vocab.graphs)
    say(f"      draft_lm_head.onnx ({which}) serves {served} ({time.perf_counter() - t0:.1f} s)")
    return specs, draft_vocab


def batched_base_from_onnx(
    plan: ArtifactPlan, tmp: Path, specs: dict[str, GraphSpec]
) -> tuple[dict[str, GraphSpec], float]:
    """plan.batched: base_batch.onnx, the fused base over config.max_batch sequences per forward
    (export/batch_graph.py); else `specs`. With the time it started: its check, once the manifest exists, reports
    the time of both (unused without a batched base)."""
    if not plan.batched:
        return specs, time.perf_counter()
    from clover.export.batch_graph import BATCH_GRAPH, write_batched_base

    started = time.perf_counter()
    step = plan.step(len(plan.graphs) + 1 + plan.share_lm_head + plan.draft_head)
    plan.options.say(f"{step} {BATCH_GRAPH}: {plan.config.max_batch} sequences per forward")
    batched = graph_spec(write_batched_base(tmp, specs["base"].file, plan.config.max_batch))
    check_onnx(tmp / batched.file)
    return {**specs, BATCH_GRAPH: batched}, started


def engines_from_onnx(plan: ArtifactPlan, tmp: Path, specs: dict[str, GraphSpec]) -> dict[str, EngineSpec]:
    """backend "trt": a TensorRT engine per graph (export/engines.py); else none."""
    if plan.config.backend != "trt":
        return {}
    from clover.export.engines import build_engines

    config, say = plan.config, plan.options.say
    say(f"{plan.step(plan.steps - 1)} TensorRT engines")
    limits = engine_limits(config, plan.tree, plan.max_context)
    return build_engines(tmp, specs, config.dtype, limits, timing_cache_path(config), say)


def ngram_store_from_source(plan: ArtifactPlan, tmp: Path) -> NgramStoreSpec | None:
    """options.ngram_store: the store prompt lookup drafts from, written into `tmp`; else None."""
    source = plan.options.ngram_store
    if source is None:
        return None
    from clover.export.ngram_store import add_ngram_store

    store = add_ngram_store(tmp, source, plan.fingerprint)
    plan.options.say(f"      n-gram store for prompt lookup: {store.contexts} contexts ({source.source})")
    return store


def manifest_from_parts(
    plan: ArtifactPlan,
    specs: dict[str, GraphSpec],
    parity: dict[str, dict[str, float]],
    *,
    engines: dict[str, EngineSpec],
    weights: WeightsSpec | None,
    draft_vocab: DraftVocabSpec | None,
    store: NgramStoreSpec | None,
) -> Manifest:
    """The manifest of what the steps wrote, its file checksums still to be taken."""
    config, heads, tree = plan.config, plan.heads, plan.tree
    return Manifest(
        backend=config.backend,
        dtype=config.dtype,
        attention=config.attention,
        opset=config.opset,
        max_context=plan.max_context,
        base_config=plan.base.config.to_dict(),
        base_fingerprint=plan.fingerprint,
        sources=dict(plan.options.sources or {}),
        heads=heads_spec(heads, plan.options.heads_name) if heads is not None else None,
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


def check_batched_base(plan: ArtifactPlan, tmp: Path, manifest: Manifest, started: float) -> None:
    """plan.batched and config.verify: every sequence of base_batch.onnx bit for bit the base graph's."""
    if not (plan.batched and plan.config.verify):
        return
    from clover.export.batch_graph import check_batched

    check_batched(tmp, manifest)
    took = time.perf_counter() - started
    plan.options.say(f"      every sequence's logits bit for bit the base graph's ({took:.1f} s)")


def timed_tree_from_onnx(plan: ArtifactPlan, tmp: Path, manifest: Manifest) -> Manifest:
    """plan.time_trees: the manifest with the default tree and drafts that ran fastest on the graphs in `tmp`
    (export/tree_timing.py); else `manifest`."""
    if not plan.time_trees:
        return manifest
    from clover.export.tree_timing import fastest_tree

    say = plan.options.say
    chat = "chat" if manifest.chat_template else "plain-text"  # a base model's tokenizer has no template
    say(
        f"{plan.step(plan.steps - 1)} default tree and drafts: timing plain, the trees and prompt lookup here, "
        f"on {chat} prompts"
    )
    tree, drafts, timing = fastest_tree(tmp, manifest, say=say)
    return dataclasses.replace(
        manifest, tree=tree_spec(tree) if tree is not None else None, drafts=drafts, tree_timing=timing
    )


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
        spec = traced(graph, out_dir, config.opset, onnx_from_torch)  # a trace seen before comes from the cache
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


def copy_tokenizer(src: Path, dst: Path, chat_template: str | None = None):
    """Copy the files clover.runtime.tokenizer.Tokenizer.from_dir reads, with `chat_template` (Jinja text) as the
    chat template where given, and check that they load; returns the copy's Tokenizer."""
    from clover.runtime.tokenizer import Tokenizer, write_chat_template

    if not (src / "tokenizer.json").is_file():
        raise CloverError(f"base folder {src} has no tokenizer.json: the artifact needs the base's fast tokenizer file")
    dst.mkdir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    if chat_template is not None:
        write_chat_template(dst, chat_template)
    return Tokenizer.from_dir(dst)


def tokenizer_note(has_template: bool, given: bool) -> str:
    """The progress line on the artifact's chat template: whether chat prompts can be rendered, and how to add a
    template to a base model's tokenizer."""
    if given:
        return "tokenizer: with the chat template given (--chat-template)"
    if has_template:
        return "tokenizer: with the base's chat template"
    return (
        "tokenizer: no chat template (a base model): the export's prompts are plain text, and chat requests need "
        "one (clover-export --chat-template, or --chat-template at run time)"
    )


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
