"""Graphs against PyTorch through Polygraphy: its runners, its Comparator, one tolerance rule.

    rows = parity(graph, out_dir / "base.onnx", sizes, export_tolerance("base", "float32"))   # export's check
    result = compare_artifact("artifacts/smollm2-clover2", ("torch", "ort"))                     # clover-compare

Runners (Polygraphy `BaseRunner`s, one per backend, activated once per graph):
    TorchRunner       the PyTorch modules, called as the runtime calls them (graphs.reference_outputs); a
                      float16 graph's reference is its float32 twin
    OrtRunner         Polygraphy's OnnxrtRunner on a CPU session (onnx_graph.checking_session), with the
                      artifact's conventions: an in-place KV graph's present.* come back as the new rows
                      (onnx_graph.run_checked), a graph cut before the shared LM head gets its logits
                      through lm_head.onnx
    ProfileTrtRunner  Polygraphy's TrtRunner on the graph's engine, switching to the profile each input fits
Inputs: seeded feed dicts from GraphDef.example at each size. `Comparator.run` runs them through every
runner and `Comparator.compare_accuracy` (SimpleCompareFunc, check_error_stat "max") judges each output of
each backend against the first (the reference).

The rule is the export's: an output passes when max |a - ref| <= atol or
max |a - ref| / max |ref| <= rtol. Relative errors are taken against the output's largest reference
value, not element by element: logits near 0 make elementwise relative errors meaningless. Polygraphy
checks it as an absolute tolerance per output, max(atol, rtol x max |ref|).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from clover.artifact import Manifest, ProfileSpec, read_manifest
from clover.errors import CloverError

try:  # Polygraphy imports TensorRT and ONNX Runtime lazily, when a runner is activated
    from polygraphy.backend.base import BaseRunner
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.backend.trt import TrtRunner
    from polygraphy.common import TensorMetadata
    from polygraphy.comparator import Comparator, RunResults, SimpleCompareFunc
    from polygraphy.exception import PolygraphyException
    from polygraphy.logger import G_LOGGER
except ImportError as e:
    raise CloverError(
        "comparing graphs with PyTorch needs polygraphy: pip install 'clover-deploy[onnx]' (or "
        "polygraphy==0.53.6); clover-export skips the check with --no-verify"
    ) from e
from clover.export.graphs import EXPORT_SIZES, GraphDef, Sizes, float32_twin, reference_outputs
from clover.export.onnx_graph import checking_session, run_checked

BACKENDS = ("torch", "ort", "trt")
COMPARED = ("base", "draft_begin", "draft_step", "medusa_heads")  # lm_head runs inside the others' ORT runner;
# base_batch is checked bit for bit against base at export (export/batch_graph.py)
# Relative error (max |ONNX - torch| / max(1, max |torch|)) above which an export is broken, not noisy.
BROKEN_RELATIVE_ERROR = {"float32": 1e-3, "float16": 5e-2}
# --weights (and --draft-quant, the draft graphs only): the same test for blockwise weight-only graphs; a sign or
# scale bug moves the logits by 100%. Quantized drafts only change which candidates are drafted, never what is
# accepted. The max over 49k logits is a blunt measure for 4 bits (SmolLM2 int4: up to half the logit range on
# random inputs), so for --weights the greedy agreement with fp32 is the export's real check (export/artifact.py);
# this limit only catches a wrong block layout or zero point.
BROKEN_WEIGHTS_RELATIVE_ERROR = {"int8": 0.2, "int4": 1.0}
# clover-compare's inputs: a prompt, then a tree over a past (the artifact's tree; the runtime's default when plain).
PREFILL_TOKENS = 16
PAST = 16
Progress = Callable[[str], None]


# -- tolerances and results ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """An output passes when max |a - ref| <= atol or max |a - ref| / max |ref| <= rtol."""

    atol: float
    rtol: float
    why: str = ""  # where the limits come from, for the report

    def __post_init__(self) -> None:
        if not (self.atol >= 0 and self.rtol >= 0):  # NaN included
            raise CloverError(f"tolerances must be >= 0, got atol {self.atol} and rtol {self.rtol}")

    def bound(self, scale: float) -> float:
        """The largest max |a - ref| that passes for an output whose largest |ref| is `scale`."""
        return max(self.atol, self.rtol * scale)


def export_tolerance(graph: str, dtype: str, weights: str | None = None, draft_quant: str | None = None) -> Tolerance:
    """The export's limit for `graph` of an artifact in `dtype` (with --weights / --draft-quant), against
    float32 PyTorch: beyond it the export is broken, not noisy. err / max(1, scale) <= limit is
    atol = rtol = limit."""
    if weights is not None:
        limit, why = BROKEN_WEIGHTS_RELATIVE_ERROR[weights], f"{weights} weights vs float32"
    elif draft_quant is not None and graph != "base":
        limit, why = BROKEN_WEIGHTS_RELATIVE_ERROR[draft_quant], f"{draft_quant} draft weights vs float32"
    elif dtype in BROKEN_RELATIVE_ERROR:
        limit, why = BROKEN_RELATIVE_ERROR[dtype], dtype if dtype == "float32" else f"{dtype} vs float32"
    else:
        raise CloverError(
            f"the export sets no tolerance for {dtype} graphs (ONNX Runtime cannot run them, so it "
            "does not check them): pass --atol and --rtol"
        )
    return Tolerance(limit, limit, why)


@dataclass(frozen=True)
class OutputError:
    """One output of one graph (at one case) on one backend against the reference backend."""

    graph: str  # the graph, with its case where it has several: base/prefill, base/verify, draft_step
    output: str
    backend: str
    reference: str
    max_abs: float  # max |a - ref| over the case's inputs
    mean_abs: float
    scale: float  # max |ref|
    tolerance: Tolerance
    passed: bool
    note: str = ""  # why there are no errors (shapes differ)

    @property
    def max_rel(self) -> float:
        return _relative(self.max_abs, self.scale)

    @property
    def mean_rel(self) -> float:
        return _relative(self.mean_abs, self.scale)

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), max_rel=self.max_rel, mean_rel=self.mean_rel)


def _relative(err: float, scale: float) -> float:
    return err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))


# -- runners ------------------------------------------------------------------------------------------


class TorchRunner(BaseRunner):
    """The PyTorch modules behind `graph`, called as the runtime calls them (graphs.reference_outputs).
    `reference`: run this module instead (a float16 graph's float32 twin), on float32 copies of the inputs."""

    def __init__(self, graph: GraphDef, reference: GraphDef | None = None, name: str = "torch"):
        super().__init__(name=name, prefix="torch-runner")
        self.graph = graph
        self.reference = reference

    def activate_impl(self) -> None:
        # dtypes and ranks from small example inputs (no past: no forward pass); dynamic dims as None
        probe = self.graph.example(dict(dict.fromkeys(EXPORT_SIZES, 1), past=0), torch.Generator().manual_seed(0))
        self.inputs = [
            (name, tensor.dtype, [None if i in dims else n for i, n in enumerate(tensor.shape)])
            for name, tensor, dims in zip(self.graph.inputs, probe, self.graph.dims)
        ]

    def get_input_metadata_impl(self) -> TensorMetadata:
        meta = TensorMetadata()  # a new one each call: get_input_metadata() converts its dtypes in place
        for name, dtype, shape in self.inputs:
            meta.add(name, dtype, shape)
        return meta

    def infer_impl(self, feed_dict):
        inputs = tuple(torch.from_numpy(np.array(feed_dict[name])) for name in self.graph.inputs)
        if self.reference is not None:
            inputs = tuple(t.float() if t.is_floating_point() else t for t in inputs)
        start = time.perf_counter()
        outputs = reference_outputs(self.reference or self.graph, inputs)
        self.inference_time = time.perf_counter() - start
        return OrderedDict((name, np.ascontiguousarray(t.numpy())) for name, t in zip(self.graph.outputs, outputs))

    def deactivate_impl(self) -> None:
        del self.inputs


class OrtRunner(OnnxrtRunner):
    """Polygraphy's ONNX Runtime runner on the graph at `path`, returning `outputs` (the PyTorch graph's):
    an in-place KV graph's present.* as the new rows (onnx_graph.run_checked), and for a graph cut before the
    shared LM head (it outputs lm_input), logits through the LM-head graph at `lm_head`."""

    def __init__(self, path: Path, outputs: Sequence[str], lm_head: Path | None = None, name: str = "ort"):
        super().__init__(functools.partial(checking_session, Path(path)), name=name)
        self.outputs = tuple(outputs)
        self._lm_head = lm_head

    def activate_impl(self) -> None:
        super().activate_impl()
        self.lm = checking_session(self._lm_head) if self._lm_head is not None else None

    def infer_impl(self, feed_dict):
        from clover.export.lm_head import LM_INPUT

        cut = self.lm is not None and "logits" in self.outputs
        wanted = [LM_INPUT if cut and name == "logits" else name for name in self.outputs]
        feeds = {name: np.asarray(value) for name, value in feed_dict.items()}
        start = time.perf_counter()
        got = dict(zip(self.outputs, run_checked(self.sess, wanted, feeds)))
        if cut:
            x = got["logits"]  # [..., H]
            logits = self.lm.run(["logits"], {LM_INPUT: x.reshape(-1, x.shape[-1])})[0]  # [n, V]
            got["logits"] = logits.reshape(*x.shape[:-1], logits.shape[-1])
        self.inference_time = time.perf_counter() - start
        return OrderedDict((name, got[name]) for name in self.outputs)

    def deactivate_impl(self) -> None:
        del self.lm
        super().deactivate_impl()


def fitting_profile(profiles: Sequence[ProfileSpec], shapes: dict[str, tuple[int, ...]]) -> int:
    """The index of the first optimization profile whose [min, max] ranges hold every input shape."""
    for index, profile in enumerate(profiles):
        if all(
            name not in shapes or all(lo <= s <= hi for lo, s, hi in zip(r[0], shapes[name], r[2]))
            for name, r in profile.shapes.items()
        ):
            return index
    raise CloverError(
        f"input shapes {shapes} fit none of the engine's optimization profiles ({', '.join(p.name for p in profiles)})"
    )


class ProfileTrtRunner(TrtRunner):
    """Polygraphy's TensorRT runner, switching to the optimization profile each input fits (`profiles`, in the
    engine's order: prefill and verify shapes of the base are in different profiles)."""

    def __init__(self, engine, profiles: Sequence[ProfileSpec], name: str = "trt"):
        super().__init__(engine, name=name, optimization_profile=0)
        self.profiles = tuple(profiles)

    def activate_impl(self) -> None:
        super().activate_impl()
        self.profile = 0

    def infer_impl(self, feed_dict, *args, **kwargs):
        index = fitting_profile(self.profiles, {name: tuple(np.shape(v)) for name, v in feed_dict.items()})
        if index != self.profile:
            self.set_profile(index)
            self.profile = index
        return super().infer_impl(feed_dict, *args, **kwargs)

    def deactivate_impl(self) -> None:
        del self.profile
        super().deactivate_impl()


def trt_runner(root: Path, manifest: Manifest, graph: str, name: str = "trt") -> ProfileTrtRunner:
    """A ProfileTrtRunner on `graph`'s engine (EngineFromBytes). CloverError saying why when it cannot run here:
    no engine, no TensorRT or GPU, or an engine built for another GPU or TensorRT."""
    spec = manifest.engines.get(graph)
    if spec is None:
        raise CloverError(
            f"the artifact has no TensorRT engine for {graph} (exported with --backend {manifest.backend})"
        )
    from clover.trt import check_engine_compatible, device_info, require_tensorrt

    trt = require_tensorrt()
    here = device_info()
    check_engine_compatible(spec, trt.__version__, here.name, here.compute_capability)
    if manifest.attention == "plugin":
        from clover.plugins.trt_plugin import register

        register()  # engines with a JIT (Python) plugin need it registered, as in the trt backend
    from polygraphy.backend.common import BytesFromPath
    from polygraphy.backend.trt import EngineFromBytes

    return ProfileTrtRunner(EngineFromBytes(BytesFromPath(str(Path(root) / spec.file))), spec.profiles, name)


# -- inputs and comparison -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """Inputs of one kind for a graph (a prompt, a tree over a past), judged together."""

    label: str  # base/prefill, base/verify; the graph's name where it has one case
    inputs: GraphDef  # draws them (GraphDef.example): the compared graph, or one with its I/O (a prompt: a chain)
    sizes: tuple[Sizes, ...]  # one input per size


def feeds(graph: GraphDef, sizes: Sequence[Sizes], seed: int = 0) -> list[OrderedDict[str, np.ndarray]]:
    """Polygraphy's data loader: one feed dict per size, from one generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [OrderedDict((name, t.numpy()) for name, t in zip(graph.inputs, graph.example(s, g))) for s in sizes]


def compare(
    runners: Sequence[BaseRunner], cases: Sequence[Case], tolerance: Tolerance, seed: int = 0
) -> list[OutputError]:
    """Run every case's inputs through `runners` (Comparator.run) and judge each output of each runner against
    runners[0] (Comparator.compare_accuracy), one row per case, runner and output."""
    loader = [feed for i, c in enumerate(cases) for feed in feeds(c.inputs, c.sizes, seed + i)]
    try:
        with G_LOGGER.verbosity(G_LOGGER.CRITICAL + 1):  # the rows are the report
            results = Comparator.run(list(runners), data_loader=loader)
            rows, start = [], 0
            for case in cases:
                stop = start + len(case.sizes)
                rows += _judge(results, start, stop, case.label, tolerance)
                start = stop
    except PolygraphyException as e:
        raise CloverError(f"{cases[0].label}: Polygraphy failed: {str(e).strip().splitlines()[0]}") from e
    return rows


def _judge(results: RunResults, start: int, stop: int, label: str, tolerance: Tolerance) -> list[OutputError]:
    """The rows of iterations [start, stop) of `results`: each runner after the first against the first."""
    case = RunResults()
    for runner, iterations in results:
        case.append((runner, iterations[start:stop]))
    (reference, ref_iters), *others = list(case)
    names = list(ref_iters[0].keys())
    scale = {n: max((float(np.abs(r[n]).max()) if r[n].size else 0.0) for r in ref_iters) for n in names}
    count = {n: [r[n].size for r in ref_iters] for n in names}
    compare_func = SimpleCompareFunc(
        atol={n: tolerance.bound(scale[n]) for n in names},
        rtol=0.0,
        check_error_stat="max",
        find_output_func=lambda name, index, result: [name] if name in result else None,
    )
    accuracy = Comparator.compare_accuracy(
        case, comparisons=[(0, i) for i in range(1, len(case))], compare_func=compare_func
    )[0]
    rows = []
    for backend, iters in others:
        per_iteration = accuracy[(reference, backend)]  # [iteration] -> {output: OutputCompareResult or False}
        for n in names:
            found = [it.get(n) for it in per_iteration]
            if any(r is None for r in found):
                rows.append(
                    OutputError(
                        label,
                        n,
                        backend,
                        reference,
                        float("nan"),
                        float("nan"),
                        scale[n],
                        tolerance,
                        False,
                        f"{backend} has no output {n}",
                    )
                )
            elif not all(hasattr(r, "max_absdiff") for r in found):  # Polygraphy's verdict without statistics
                shapes = {np.shape(it[n]) for it in iters if n in it}
                rows.append(
                    OutputError(
                        label,
                        n,
                        backend,
                        reference,
                        float("nan"),
                        float("nan"),
                        scale[n],
                        tolerance,
                        False,
                        f"shapes differ: {backend} {sorted(shapes)}, {reference} "
                        f"{sorted({r[n].shape for r in ref_iters})}",
                    )
                )
            else:
                weights = count[n] if sum(count[n]) else [1] * len(found)
                rows.append(
                    OutputError(
                        label,
                        n,
                        backend,
                        reference,
                        max(r.max_absdiff for r in found),
                        float(np.average([r.mean_absdiff for r in found], weights=weights)),
                        scale[n],
                        tolerance,
                        all(bool(r) for r in found),
                    )
                )
    return rows


def parity(
    graph: GraphDef,
    path: Path,
    sizes: Sequence[Sizes],
    tolerance: Tolerance,
    reference: GraphDef | None = None,
    seed: int = 0,
) -> list[OutputError]:
    """ONNX Runtime (CPU) on the graph at `path` against PyTorch on random inputs of each of `sizes`, judged
    together (one row per output): the export's parity check. `reference`: for float16 graphs,
    graphs.float32_twin(graph)."""
    runners = [TorchRunner(graph, reference), OrtRunner(path, graph.outputs)]
    return compare(runners, [Case(graph.name, graph, tuple(sizes))], tolerance, seed)


# -- an artifact ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArtifactComparison:
    """What clover-compare reports: every graph's outputs on every backend that ran, against the first."""

    artifact: str
    backends: tuple[str, ...]  # that ran; the first is the reference
    unavailable: dict[str, str]  # backend -> why it did not run
    notes: tuple[str, ...]  # how to read the errors of this artifact
    rows: tuple[OutputError, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    @property
    def failures(self) -> list[OutputError]:
        return [r for r in self.rows if not r.passed]

    def to_dict(self) -> dict:
        return {
            "artifact": self.artifact,
            "backends": list(self.backends),
            "unavailable": self.unavailable,
            "notes": list(self.notes),
            "passed": self.passed,
            "rows": [r.to_dict() for r in self.rows],
        }


def compare_artifact(
    root: str | Path,
    backends: Sequence[str] = ("torch", "ort"),
    tolerance: Tolerance | None = None,
    seed: int = 0,
    say: Progress | None = None,
) -> ArtifactComparison:
    """Compare the artifact's graphs (base at a prefill and at a tree verify, the draft graphs) on `backends`
    (torch, ort, trt; the first is the reference) on seeded inputs. The PyTorch modules are rebuilt from the
    sources the manifest records. `tolerance`: None for the export's own, per graph (export_tolerance)."""
    say = say or (lambda _: None)
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or len(set(backends)) != len(backends):
        raise CloverError(f"backends {', '.join(backends)}: expected distinct names from {', '.join(BACKENDS)}")
    root = Path(root)
    manifest = read_manifest(root)  # no checksums: a graph edited to debug it compares as it is now
    for spec in manifest.graphs.values():
        for f in (spec.file, *spec.external_data):
            if not (root / f).is_file():
                raise CloverError(f"artifact {root} is missing {f} (listed in its manifest): export it again")
    unavailable = {}
    if "ort" in backends and manifest.dtype == "bfloat16":
        unavailable["ort"] = "ONNX Runtime's CPU provider has no bfloat16 kernels"
    if "trt" in backends:
        try:
            for name in (n for n in COMPARED if n in manifest.graphs):
                trt_runner(root, manifest, name)  # raises when it cannot run here
        except CloverError as e:
            unavailable["trt"] = str(e)
    ran = tuple(b for b in backends if b not in unavailable)
    if len(ran) < 2:
        why = "; ".join(f"{b}: {w}" for b, w in unavailable.items())
        raise CloverError(
            f"nothing to compare: only {', '.join(ran) or 'no backend'} can run {root} here"
            + (f" ({why})" if why else "")
            + ": pass two or more of --backends torch,ort,trt"
        )
    say(
        f"loading the PyTorch modules from {manifest.sources.get('base', '?')} and {manifest.sources.get('heads', '?')}"
    )
    graphs = source_graphs(root, manifest)
    cases = artifact_cases(manifest, graphs)
    rows = []
    for i, (name, graph) in enumerate(graphs.items(), 1):
        tol = tolerance or export_tolerance(
            name, manifest.dtype, manifest.weights and manifest.weights.scheme, manifest.draft_quant
        )
        say(
            f"[{i}/{len(graphs)}] {name}: {' vs '.join(ran[1:])} vs {ran[0]} on "
            + ", ".join(f"{c.label} ({describe(c.sizes[0])})" for c in cases[name])
        )
        t0 = time.perf_counter()
        runners = [artifact_runner(root, manifest, graph, b) for b in ran]
        rows += compare(runners, cases[name], tol, seed)
        say(f"      {time.perf_counter() - t0:.1f} s")
    return ArtifactComparison(str(root), ran, unavailable, artifact_notes(manifest, tolerance), tuple(rows))


def source_graphs(root: Path, manifest: Manifest) -> dict[str, GraphDef]:
    """The artifact's graphs as the PyTorch modules it was exported from (manifest.sources), by graph name:
    base, then the draft graphs."""
    from clover.artifact import fingerprints_match
    from clover.export.graphs import base_graph, draft_graphs
    from clover.models.head_io import resolve_heads
    from clover.models.heads import BaseFingerprint
    from clover.models.loading import load_base
    from clover.models.smollm2 import resolve_base

    base_spec, heads_spec = manifest.sources.get("base"), manifest.sources.get("heads", "none")
    if not base_spec:
        raise CloverError(
            f"artifact {root} does not record its source model (manifest.json has no sources): "
            "export it again with clover-export"
        )
    base = load_base(resolve_base(base_spec), manifest.dtype)
    if not fingerprints_match(dataclasses.asdict(BaseFingerprint.of(base)), manifest.base_fingerprint):
        raise CloverError(
            f"the base model at {base_spec} is not the one artifact {root} was exported from (its LM "
            "head differs): export the artifact again, or restore that model"
        )
    heads = resolve_heads(heads_spec, base) if manifest.heads is not None else None
    graphs = [base_graph(base, traced_attention(manifest), chains=verifies_chains(manifest))]
    graphs += draft_graphs(heads) if heads is not None else []
    return {g.name: g for g in graphs if g.name in manifest.graphs and g.name in COMPARED}


def traced_attention(manifest: Manifest) -> str:
    """The attention of the base's PyTorch reference: the fused graph is written from the portable one's weights."""
    return "portable" if manifest.attention == "fused" else manifest.attention


def verifies_chains(manifest: Manifest) -> bool:
    """A fused base with int8 activations (MatMulNBits accuracy_level != 0) verifies chains only (export/quantize.py)."""
    return manifest.attention == "fused" and manifest.weights is not None and manifest.weights.accuracy_level != 0


def artifact_cases(manifest: Manifest, graphs: dict[str, GraphDef]) -> dict[str, tuple[Case, ...]]:
    """The inputs clover-compare draws for each graph: a prompt (causal, no past) and a tree verify over a past for
    the base, a tree's worth for the draft graphs; within the max context and, for an engine, its profiles."""
    from clover.export.graphs import base_graph
    from clover.runtime.tree import compile_spec, default_tree

    tree = compile_spec(manifest.tree) if manifest.tree is not None else None
    if tree is None or tree.num_nodes < 2:  # no heads, or plain: the tree the runtime would use
        tree = default_tree(manifest.heads.max_depth if manifest.heads is not None else None)
    nodes, accepted = tree.num_nodes, tree.max_depth + 1
    past = max(0, min(PAST, manifest.max_context - nodes))
    out = {}
    for name, graph in graphs.items():
        if name == "base":
            chain = base_graph(graph.module.base, traced_attention(manifest), chains=True)
            prompt = dataclasses.replace(graph, example=chain.example)  # a prompt attends causally
            cases = (
                Case(
                    "base/prefill",
                    prompt,
                    ({"batch": 1, "new": min(PREFILL_TOKENS, manifest.max_context), "past": 0, "rows": 1},),
                ),
                Case("base/verify", graph, ({"batch": 1, "new": nodes, "past": past, "rows": nodes},)),
            )
        elif name == "draft_begin":
            cases = (Case(name, graph, ({"batch": 1, "accepted": accepted, "past": past},)),)
        elif name == "draft_step":
            cases = (Case(name, graph, ({"candidates": nodes},)),)
        else:  # medusa_heads
            cases = (Case(name, graph, ({"batch": 1, "accepted": 1},)),)
        out[name] = within_profiles(manifest, name, cases)
    return out


def within_profiles(manifest: Manifest, graph: str, cases: tuple[Case, ...]) -> tuple[Case, ...]:
    """`cases` with every size clamped into the graph's engine profile of the same name (prefill, verify; the
    first for the draft graphs); as they are without an engine."""
    engine = manifest.engines.get(graph)
    if engine is None:
        return cases
    from clover.export.engines import profile_sizes

    spec = manifest.graphs[graph]
    by_name = {p.name: p for p in engine.profiles}
    out = []
    for case in cases:
        profile = by_name.get(case.label.rpartition("/")[2], engine.profiles[0])
        lo, hi = profile_sizes(spec, profile, 0), profile_sizes(spec, profile, 2)
        out.append(
            dataclasses.replace(
                case,
                sizes=tuple({k: min(max(v, lo.get(k, v)), hi.get(k, v)) for k, v in s.items()} for s in case.sizes),
            )
        )
    return tuple(out)


def artifact_runner(root: Path, manifest: Manifest, graph: GraphDef, backend: str) -> BaseRunner:
    if backend == "torch":
        return TorchRunner(graph, float32_twin(graph) if manifest.dtype != "float32" else None)
    if backend == "ort":
        from clover.export.lm_head import LM_HEAD, LM_INPUT

        spec = manifest.graphs[graph.name]
        lm_head = root / manifest.graphs[LM_HEAD].file if spec.has_output(LM_INPUT) else None
        return OrtRunner(root / spec.file, graph.outputs, lm_head)
    return trt_runner(root, manifest, graph.name)


def artifact_notes(manifest: Manifest, tolerance: Tolerance | None) -> tuple[str, ...]:
    """How to read this artifact's errors: what differs from PyTorch by design, and the tolerances."""
    from clover.export.artifact import BROKEN_AGREEMENT

    notes = []
    w = manifest.weights
    if w is not None:
        agreement = w.agreement
        measured = (
            f" (this artifact: {agreement['top1']:.1%} of {int(agreement['positions'])} tokens)"
            if agreement.get("positions")
            else ""
        )
        notes.append(
            f"{w.scheme} weights (MatMulNBits, blocks of {w.block_size}, base accuracy_level {w.accuracy_level}): the "
            f"ONNX graphs compute with {w.scheme} weights and PyTorch with the float32 ones, so the errors below are "
            f"quantization, not export error. The export's {w.scheme} limit (rel "
            f"{BROKEN_WEIGHTS_RELATIVE_ERROR[w.scheme]}) only catches a broken block layout or zero point; its real check "
            f"is greedy agreement with float32 PyTorch, at least {BROKEN_AGREEMENT:.0%}{measured}."
        )
    if manifest.draft_quant is not None:
        notes.append(
            f"--draft-quant {manifest.draft_quant}: the draft graphs' weights are {manifest.draft_quant}, "
            f"compared with float32 PyTorch at the export's limit (rel "
            f"{BROKEN_WEIGHTS_RELATIVE_ERROR[manifest.draft_quant]}); the base "
            f"keeps {manifest.dtype}."
        )
    if manifest.dtype != "float32":
        notes.append(
            f"{manifest.dtype} graphs against float32 PyTorch (float16 PyTorch on the CPU rounds at other "
            "places than ONNX Runtime, so neither is the truth)."
        )
    if verifies_chains(manifest):
        notes.append(
            "the fused base computes with int8 activations and verifies chains only: base/verify runs a chain."
        )
    if "lm_head" in manifest.graphs:
        notes.append("graphs that output lm_input are compared on their logits through lm_head.onnx (one LM head).")
    if tolerance is not None:
        notes.append(f"tolerance from --atol {tolerance.atol:g} / --rtol {tolerance.rtol:g} (the export's replaced).")
    return tuple(notes)


def describe(sizes: Sizes) -> str:
    return " ".join(f"{k} {v}" for k, v in sizes.items() if k != "batch" or v != 1)
