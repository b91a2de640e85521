"""The exported artifact: `manifest.json` schema, reading and validation (json + hashlib, no torch).

`clover-export` writes an artifact directory and the runtime rebuilds everything from its manifest,
never from file names (docs/design.md, Conventions 2). The manifest is written last and atomically, so a directory
without one is never mistaken for an artifact; every file in it is listed with its sha256.

    manifest.json      format_version, base config and fingerprint, heads, tree, graphs, files
    base.onnx(.data)   the base decoder (prefill and tree verification)
    draft_*.onnx       the draft graphs of the heads (see clover.export.graphs)
    base_batch.onnx    (--attention fused) the base for several sequences per forward, its weights in base.onnx.data
                       (clover.export.batch_graph)
    lm_head.onnx       the base's LM head, run after the base and the draft graphs that output `lm_input`
                       instead of `logits` (ONNX Runtime artifacts with heads: clover.export.lm_head)
    draft_lm_head.onnx (--draft-vocab K) the LM head over the K draft-vocabulary tokens, run after the draft
    draft_vocab.npy    graphs instead of lm_head.onnx; the full id of each of its columns (clover.export.draft_vocab)
    ngram_store.npz    (--ngram-store) a suffix array over a corpus of the base's own answers (longest match of the tail, its most frequent continuation)
                       of its own answers, which prompt lookup drafts from (clover.runtime.lookup.NgramStore)
    tokenizer/         the base model's tokenizer files
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clover import atomic
from clover.errors import CloverError

FORMAT_VERSION = 3  # 2: the LM head may be a graph of its own (lm_head.onnx); 3: fused bases get base_batch.onnx
KIND = "clover-artifact"
MANIFEST_FILE = "manifest.json"
TOKENIZER_DIR = "tokenizer"
PROBE_RTOL = 5e-3  # as clover.models.heads.BaseFingerprint.matches
# The batched base graph (clover.export.batch_graph): its manifest key and file stem, its input of new rows per
# sequence slot (0: not in this step), and its per-slot KV I/O names.
BATCH_GRAPH = "base_batch"
DRAFT_LM_HEAD, DRAFT_VOCAB_FILE = "draft_lm_head", "draft_vocab.npy"  # --draft-vocab (clover.export.draft_vocab)
NGRAM_STORE_FILE = "ngram_store.npz"  # --ngram-store (clover.runtime.lookup.NgramStore)
ROW_COUNTS = "row_counts"


def slot_name(name: str, slot: int) -> str:
    """A per-sequence I/O name of the batched graph: past_key_values.0.key -> past_key_values.0.key.s3."""
    return f"{name}.s{slot}"


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: dims are ints (static) or names (dynamic: batch, new, past, ...)."""

    name: str
    dtype: str  # numpy name: float32, float16, int64, bool
    shape: tuple[int | str, ...]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(d["name"], d["dtype"], tuple(d["shape"]))


@dataclass(frozen=True)
class GraphSpec:
    """One ONNX graph of the artifact: its file, its external-data files and its I/O."""

    file: str
    external_data: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)

    def output(self, name: str) -> TensorSpec:
        return next(t for t in self.outputs if t.name == name)

    def has_input(self, name: str) -> bool:
        return any(t.name == name for t in self.inputs)

    def has_output(self, name: str) -> bool:
        return any(t.name == name for t in self.outputs)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GraphSpec:
        return cls(
            d["file"],
            tuple(d.get("external_data", ())),
            tuple(map(TensorSpec.from_dict, d["inputs"])),
            tuple(map(TensorSpec.from_dict, d["outputs"])),
        )


@dataclass(frozen=True)
class HeadsSpec:
    """The draft heads exported into the artifact (clover.models.heads.HeadConfig, minus the base config)."""

    name: str  # what --heads named at export (a folder or random:ARCH[:SEED])
    arch: str  # medusa | clover | clover2
    num_heads: int
    num_layers: int
    own_lm_head: bool
    max_depth: int | None  # deepest tree they draft (None: any)
    base: dict[str, Any]  # BaseFingerprint of the base they were trained for

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadsSpec:
        return cls(d["name"], d["arch"], d["num_heads"], d["num_layers"], d["own_lm_head"], d["max_depth"], d["base"])


@dataclass(frozen=True)
class ProfileSpec:
    """One TensorRT optimization profile: per dynamic input, its (min, opt, max) shape."""

    name: str  # "prefill" / "verify" for the base; "draft" for the head graphs
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProfileSpec:
        return cls(d["name"], {k: tuple(tuple(int(x) for x in s) for s in v) for k, v in d["shapes"].items()})


@dataclass(frozen=True)
class EngineSpec:
    """A TensorRT engine built from one graph of the artifact. An engine only runs on the GPU model and
    TensorRT version it was built with: the runtime compares these before deserializing."""

    graph: str  # the graph (key of Manifest.graphs) it was built from
    file: str  # relative path, e.g. engines/base.engine
    profiles: tuple[ProfileSpec, ...]  # in the engine's profile index order
    precision: str  # float32 | float16 | bfloat16
    tensorrt_version: str
    device_name: str  # e.g. "NVIDIA H100 80GB HBM3"
    compute_capability: str  # e.g. "9.0"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineSpec:
        return cls(
            d["graph"],
            d["file"],
            tuple(map(ProfileSpec.from_dict, d["profiles"])),
            d["precision"],
            d["tensorrt_version"],
            d["device_name"],
            d["compute_capability"],
        )


KNOWN_WEIGHTS = ("int8", "int4")  # the weight-only schemes this runtime runs


@dataclass(frozen=True)
class WeightsSpec:
    """Weight-only quantization of every graph (clover-export --weights): ONNX Runtime's MatMulNBits."""

    scheme: str  # int8 | int4
    block_size: int  # input channels per block, one scale (and zero point) each
    symmetric: bool
    accuracy_level: int  # the base graph's MatMulNBits accuracy_level: 0 = fp32 compute, 4 = activations in int8
    draft_accuracy_level: int  # the draft graphs' (their rounding only changes what is proposed)
    embedding: str  # "int4": GatherBlockQuantized, "float32": the token embedding kept as it was
    agreement: dict[str, float]  # greedy top-1 agreement with fp32 PyTorch: prompts, positions, top1
    # the base graph's quantizer (clover-export --quant) and its settings: name, onnxruntime config, bits, block
    # size, symmetric, how the embedding and the draft graphs were rounded, GPTQ's calibration; {}: older
    # artifacts, rounded to nearest
    quantizer: dict[str, Any] = field(default_factory=dict)

    @property
    def quantizer_name(self) -> str:
        return self.quantizer.get("name", "rtn")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WeightsSpec:
        return cls(
            d["scheme"],
            int(d["block_size"]),
            bool(d["symmetric"]),
            int(d["accuracy_level"]),
            int(d["draft_accuracy_level"]),
            d["embedding"],
            dict(d.get("agreement", {})),
            dict(d.get("quantizer") or {}),
        )


@dataclass(frozen=True)
class DraftVocabSpec:
    """The draft vocabulary (clover-export --draft-vocab): the heads score only these tokens."""

    size: int  # K tokens
    file: str  # int64 [K] .npy: the full-vocabulary id of each draft logit column, most frequent first
    source: str  # what the token frequencies were counted over
    coverage: float  # share of the source's tokens inside the K
    graphs: tuple[str, ...]  # the draft graphs whose logits it gives (through draft_lm_head.onnx)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftVocabSpec:
        return cls(int(d["size"]), d["file"], d["source"], float(d["coverage"]), tuple(d["graphs"]))


@dataclass(frozen=True)
class NgramStoreSpec:
    """The n-gram store (clover-export --ngram-store) that prompt lookup drafts from."""

    file: str
    source: str  # the corpus it counts, and its answer tokens
    contexts: int  # contexts stored

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NgramStoreSpec:
        return cls(d["file"], d["source"], int(d["contexts"]))


@dataclass(frozen=True)
class TreeSpec:
    """The artifact's default token tree as stored: rank paths with the root implicit (Medusa / EAGLE
    `choices`). clover.runtime.tree.compile_spec is the one place that compiles it."""

    name: str
    choices: tuple[tuple[int, ...], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "choices": [list(p) for p in self.choices]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TreeSpec:
        choices = d.get("choices") if isinstance(d, dict) else None
        if (
            not isinstance(d, dict)
            or not isinstance(d.get("name"), str)
            or not isinstance(choices, list)
            or not all(isinstance(p, list) and all(isinstance(r, int) and r >= 0 for r in p) for p in choices)
        ):
            raise CloverError(
                f"the manifest's tree is malformed ({str(d)[:80]}): expected "
                '{"name": str, "choices": [[rank, ...], ...]}; export the artifact again'
            )
        return cls(d["name"], tuple(tuple(p) for p in choices))


@dataclass(frozen=True)
class Manifest:
    backend: str  # "onnx" | "trt" (ONNX graphs plus TensorRT engines built from them)
    dtype: str  # float32 | float16 | bfloat16
    attention: str  # portable | plugin | fused
    opset: int
    max_context: int  # longest sequence the artifact serves
    base_config: dict[str, Any]  # clover.models.config.BaseConfig.to_dict()
    base_fingerprint: dict[str, Any]  # clover.models.heads.BaseFingerprint of the exported base
    sources: dict[str, str]  # what --base / --heads named at export, for provenance and torch comparisons
    heads: HeadsSpec | None
    tree: TreeSpec | None  # the default tree (None: no heads)
    graphs: dict[str, GraphSpec]  # "base", "draft_begin", "draft_step", "medusa_heads", "lm_head"
    tokenizer: str  # folder inside the artifact
    tools: dict[str, str]  # package versions that made it
    parity: dict[str, dict[str, float]]  # export-time max abs error per graph output vs PyTorch
    files: dict[str, dict[str, Any]]  # relative path -> {"sha256", "bytes"}
    engines: dict[str, EngineSpec] = field(default_factory=dict)  # graph name -> engine (backend "trt")
    draft_quant: str | None = None  # "int8": the draft graphs' matmul weights are int8 (clover-export --draft-quant)
    draft_vocab: DraftVocabSpec | None = None  # None: the heads draft over the whole vocabulary
    ngram_store: NgramStoreSpec | None = None  # None: prompt lookup drafts from the sequence alone
    weights: WeightsSpec | None = None  # weight-only quantized graphs (clover-export --weights); None: `dtype`
    tree_timing: dict[str, Any] | None = None  # how `tree` was chosen: tokens/s of each candidate at export
    # what the runtime drafts with when --heads is not given, chosen with `tree` by timing: "heads" (the
    # artifact's heads on `tree`), "lookup" (prompt lookup alone), "heads+lookup"; None: "heads"
    drafts: str | None = None
    # the tokenizer has a chat template (an instruct model's, or one clover-export --chat-template stored): chat
    # prompts render with it; False: a base model's tokenizer, plain text only unless the runtime is given one
    # (--chat-template); None: manifests older than this field, where the tokenizer files alone tell
    chat_template: bool | None = None
    format_version: int = FORMAT_VERSION
    kind: str = KIND

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        return cls(
            backend=d["backend"],
            dtype=d["dtype"],
            attention=d["attention"],
            opset=int(d["opset"]),
            max_context=int(d["max_context"]),
            base_config=dict(d["base_config"]),
            base_fingerprint=dict(d["base_fingerprint"]),
            sources=dict(d.get("sources", {})),
            heads=HeadsSpec.from_dict(d["heads"]) if d.get("heads") else None,
            tree=TreeSpec.from_dict(d["tree"]) if d.get("tree") else None,
            graphs={k: GraphSpec.from_dict(g) for k, g in d["graphs"].items()},
            tokenizer=d["tokenizer"],
            tools=dict(d.get("tools", {})),
            parity=dict(d.get("parity", {})),
            files=dict(d["files"]),
            engines={k: EngineSpec.from_dict(e) for k, e in d.get("engines", {}).items()},
            draft_quant=d.get("draft_quant"),
            draft_vocab=DraftVocabSpec.from_dict(d["draft_vocab"]) if d.get("draft_vocab") else None,
            ngram_store=NgramStoreSpec.from_dict(d["ngram_store"]) if d.get("ngram_store") else None,
            weights=WeightsSpec.from_dict(d["weights"]) if d.get("weights") else None,
            tree_timing=d.get("tree_timing"),
            drafts=_drafts(d.get("drafts"), d.get("heads") is not None),
            chat_template=_optional_bool(d.get("chat_template"), "chat_template"),
            format_version=d["format_version"],
            kind=d["kind"],
        )


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_pin(path: str | Path, sha256: str) -> None:
    """CloverError unless `path/manifest.json` has this sha256 (hex). The manifest lists every file's sha256 and
    loading checks them, so pinning it pins the whole artifact (what a deployment reviewed is what it runs)."""
    want = sha256.strip().lower()
    if len(want) != 64 or any(c not in "0123456789abcdef" for c in want):
        raise CloverError(
            f"--manifest-sha256 must be 64 hex digits (sha256sum ARTIFACT/{MANIFEST_FILE}), got {sha256!r}"
        )
    mfile = Path(path) / MANIFEST_FILE
    if not mfile.is_file():
        raise CloverError(f"{Path(path)} is not a clover artifact: it has no {MANIFEST_FILE}")
    got = sha256_file(mfile)
    if got != want:
        raise CloverError(
            f"{mfile} has sha256 {got}, not the pinned {want}: this is not the artifact that was pinned "
            "(export or copy the reviewed one, or pin this one after reviewing it)"
        )


def file_entries(root: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under `root` (the manifest excluded), by POSIX relative path."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel != MANIFEST_FILE:
            out[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return out


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Write manifest.json atomically: it is the artifact's commit record."""
    atomic.write_text(root / MANIFEST_FILE, json.dumps(manifest.to_dict(), indent=1))


def is_artifact(path: Path) -> bool:
    """True when `path` holds a manifest written by clover-export (of any format version)."""
    try:
        doc = json.loads((Path(path) / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("kind") == KIND


def read_manifest(path: str | Path) -> Manifest:
    """Parse and version-check `path/manifest.json`, and check the paths it names stay inside the artifact (the
    files themselves are not read: see `verify_files`)."""
    root = Path(path)
    if not root.is_dir():
        raise CloverError(
            f"artifact {root} does not exist: make one with clover-export --base B --heads H --out {root}"
        )
    mfile = root / MANIFEST_FILE
    if not mfile.is_file():
        raise CloverError(
            f"{root} is not a clover artifact: it has no {MANIFEST_FILE} (make one with clover-export; an "
            "interrupted export leaves none)"
        )
    try:
        doc = json.loads(mfile.read_text())
    except ValueError as e:
        raise CloverError(f"{mfile} is not valid JSON ({e}): the artifact is corrupt, export it again") from e
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise CloverError(f'{mfile} was not written by clover-export (no "kind": "{KIND}"): pass an artifact folder')
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise CloverError(
            f"artifact {root} has manifest format version {version}, this clover-deploy reads version "
            f"{FORMAT_VERSION}: export it again with this clover-deploy's clover-export"
        )
    try:
        manifest = Manifest.from_dict(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CloverError(f"{mfile} is incomplete or malformed ({e!r}): export the artifact again") from e
    check_names(root, manifest)
    if manifest.weights is not None and manifest.weights.scheme not in KNOWN_WEIGHTS:
        raise CloverError(
            f"artifact {root} stores {manifest.weights.scheme!r} weights, which this clover-deploy cannot run (it "
            f"runs {', '.join(KNOWN_WEIGHTS)}): export it again with clover-export --weights int4 (or int8)"
        )
    return manifest


def member(root: Path, rel: Any, what: str) -> Path:
    """`root / rel` for a path the manifest names, refused unless it is a relative POSIX path that stays inside the
    artifact once symlinks are resolved: an artifact is a trust boundary, and its manifest must not make the
    runtime read (or hash) anything outside its folder."""
    from pathlib import PurePosixPath

    parts = PurePosixPath(rel).parts if isinstance(rel, str) else ()
    if (
        not parts
        or PurePosixPath(rel).is_absolute()
        or ".." in parts
        or "\\" in rel
        or ":" in rel
        or any(ord(c) < 32 for c in rel)
    ):  # control characters: no real file, and they would break messages
        raise CloverError(
            f"artifact {root}: {MANIFEST_FILE} names {rel!r} for {what}, which is not a relative path "
            "inside the artifact: the manifest was edited or crafted; export the artifact again"
        )
    inside = root.resolve()
    try:
        full = (root / rel).resolve()
    except (OSError, ValueError) as e:  # a name the filesystem cannot hold (a lone surrogate, too long)
        raise CloverError(
            f"artifact {root}: {MANIFEST_FILE} names {rel!r} for {what}, which is not a file name "
            f"({type(e).__name__}): export the artifact again"
        ) from None
    if not full.is_relative_to(inside):
        raise CloverError(
            f"artifact {root}: {what} ({rel}) resolves outside the artifact (a symbolic link?): "
            "export the artifact again"
        )
    return full


def named_files(manifest: Manifest) -> list[tuple[str, str]]:
    """(what, path) of every file the manifest names outside its file list: graphs, engines, tables."""
    out = [(f"graph {n}", f) for n, g in manifest.graphs.items() for f in (g.file, *g.external_data)]
    out += [(f"engine {n}", e.file) for n, e in manifest.engines.items()]
    if manifest.draft_vocab is not None:
        out.append(("the draft vocabulary", manifest.draft_vocab.file))
    if manifest.ngram_store is not None:
        out.append(("the n-gram store", manifest.ngram_store.file))
    return out


def check_names(root: Path, manifest: Manifest) -> None:
    """Every path the manifest names stays inside the artifact (`member`), and every graph, engine and table it
    names is in its file list (so it is checksummed)."""
    for rel in manifest.files:
        member(root, rel, "a listed file")
    for what, rel in named_files(manifest):
        member(root, rel, what)
        if rel not in manifest.files:
            raise CloverError(
                f"artifact {root}: {what} needs {rel}, which {MANIFEST_FILE} does not list: export it again"
            )


def verify_files(root: Path, manifest: Manifest, checksums: bool = True) -> None:
    """Every listed file exists, with its size and (optionally) sha256 (names were checked by read_manifest)."""
    for rel, entry in manifest.files.items():
        p = root / rel
        if not p.is_file():
            raise CloverError(
                f"artifact {root} is missing {rel} (listed in {MANIFEST_FILE}): the artifact is incomplete, "
                "export it again"
            )
        if p.stat().st_size != entry["bytes"] or (checksums and sha256_file(p) != entry["sha256"]):
            raise CloverError(
                f"artifact {root}: {rel} does not match its checksum in {MANIFEST_FILE} (changed or corrupted "
                "since export): export the artifact again"
            )


def read_draft_vocab(root: Path, manifest: Manifest):
    """The draft vocabulary's token ids (int64 [K], numpy), or None when the heads draft over every token."""
    spec = manifest.draft_vocab
    if spec is None:
        return None
    import numpy as np

    try:
        ids = np.load(Path(root) / spec.file, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise CloverError(f"artifact {root}: cannot read {spec.file} ({e}): export the artifact again") from None
    vocab = int(manifest.base_config.get("vocab_size", 0))
    if ids.shape != (spec.size,) or ids.dtype.kind != "i" or (len(ids) and (ids.min() < 0 or ids.max() >= vocab)):
        raise CloverError(f"artifact {root}: {spec.file} is not {spec.size} token ids below {vocab}: export it again")
    return ids.astype(np.int64, copy=False)


def fingerprints_match(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The rule of clover.models.heads.BaseFingerprint.matches, on its JSON form (no torch here)."""
    keys = ("architecture", "hidden_size", "vocab_size")
    if any(a.get(k) != b.get(k) for k in keys):
        return False
    if a.get("lm_head_sha256") == b.get("lm_head_sha256"):
        return True
    pa, pb = list(a.get("lm_head_probe", ())), list(b.get("lm_head_probe", ()))
    return len(pa) == len(pb) > 0 and all(math.isclose(x, y, rel_tol=PROBE_RTOL, abs_tol=0) for x, y in zip(pa, pb))


def check_corpus_base(corpus_base: dict[str, Any], base: dict[str, Any], what: str) -> None:
    """One-line error unless `what`, counted over a corpus of answers (clover-data grow), was written by the base
    `base` (fingerprints as dicts)."""
    if not fingerprints_match(corpus_base, base) or corpus_base.get("vocab_size") != base.get("vocab_size"):
        raise CloverError(
            f"{what} comes from answers of another base model: grow a corpus with this base "
            "(clover-data grow) and use that"
        )


def check_heads_match_base(root: Path, manifest: Manifest) -> None:
    heads = manifest.heads
    if heads is None or fingerprints_match(heads.base, manifest.base_fingerprint):
        return
    h, b = heads.base, manifest.base_fingerprint
    raise CloverError(
        f"artifact {root}: its {heads.arch} heads ({heads.name}) were trained for another base model (theirs: "
        f"{h.get('architecture')}, hidden {h.get('hidden_size')}, vocab {h.get('vocab_size')}, lm_head "
        f"{h.get('lm_head_sha256')}; the artifact's base: {b.get('architecture')}, hidden {b.get('hidden_size')}, "
        f"vocab {b.get('vocab_size')}, lm_head {b.get('lm_head_sha256')}): export heads trained for this base"
    )


def _drafts(value: Any, heads: bool) -> str | None:
    """The manifest's default draft source, checked (a ValueError reads as a malformed manifest)."""
    if value not in (None, "heads", "lookup", "heads+lookup") or (value == "heads+lookup" and not heads):
        raise ValueError(f"drafts {value!r}")
    return value


def _optional_bool(value: Any, name: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} {value!r}")
    return value


ARTIFACT_HEADS = "artifact"  # --heads value meaning "the heads exported into the artifact"


def uses_exported_heads(root: str | Path, manifest: Manifest, heads: str) -> bool:
    """The artifact backends' --heads rule: "artifact" (or the name the heads were exported from) drafts
    with the artifact's heads, "none" decodes plainly; any other heads cannot be added after export."""
    exported = manifest.heads
    if heads == "none":
        return False
    if heads == ARTIFACT_HEADS or (exported is not None and heads == exported.name):
        return exported is not None
    have = f"{exported.arch} heads from {exported.name}" if exported else "no heads"
    raise CloverError(
        f"artifact {root} carries {have}; --heads {heads} cannot be added to an exported artifact: "
        "omit --heads to use the artifact's, pass --heads none for plain decoding, or export these heads"
    )


def tokenizer_dir(root: str | Path) -> Path:
    """The folder of the artifact's tokenizer files (the artifact backends' `base_dir`)."""
    return Path(root) / read_manifest(root).tokenizer


def base_weight_files(root: Path, manifest: Manifest) -> list[Path]:
    """The files of the base graph and of the LM head it runs (lm_head.onnx where the artifact shares one),
    from the manifest (never from file names): what one decode step reads."""
    return [Path(root) / f for f in _base_files(manifest)]


def _base_files(manifest: Manifest) -> list[str]:
    graphs = manifest.graphs
    return [
        f for name in ("base", "lm_head") if name in graphs for f in (graphs[name].file, *graphs[name].external_data)
    ]


def base_graph_sha256(manifest: Manifest) -> str:
    """Names the base graph (and the LM head it runs) by its files' checksums: equal names, equal plain output."""
    return hashlib.sha256("".join(manifest.files[f]["sha256"] for f in _base_files(manifest)).encode()).hexdigest()


def open_artifact(path: str | Path, checksums: bool = True) -> Manifest:
    """Read and fully validate an artifact: manifest version, files and checksums, heads vs base."""
    root = Path(path)
    manifest = read_manifest(root)
    verify_files(root, manifest, checksums)
    check_heads_match_base(root, manifest)
    return manifest
