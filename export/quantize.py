"""Weight quantization for ONNX Runtime on CPU.

`clover-export --weights int8|int4`: every graph's linears, the LM head included, become ONNX Runtime's
blockwise MatMulNBits (and for int4 the token embedding GatherBlockQuantized). Decoding at batch 1 is
bound by the weight bytes read per token, and 4-bit weights are ~5x fewer bytes than fp32. The output
changes with the weights; losslessness is measured against plain decoding of the same graphs.

`clover-export --draft-quant int8|int4`: the same blockwise MatMulNBits weights (int8 compute) in the draft
graphs only. Drafting is op- and memory-bound on CPU (SmolLM2 fp32: Clover-2's two augmenting layers and
its LM head read ~140 MB per step); int8 blocks cut the fp32 artifact's drafting from 5.6 to 2.8 ms per
step with the same acceptance. The LM head the drafts share with the base stays out of it: the drafts get
their own quantized copy, draft_lm_head.onnx (export/draft_vocab.py). The base graph, which verifies every
token, keeps its precision, so the output stays token-identical to plain decoding: the drafts' rounding
only changes which candidates are proposed.

The exporter writes the tied LM head as MatMul(x, Transpose(W)) with W shared by the token embedding
(a Gather). onnxruntime's quantizer only takes MatMuls whose weight is an initializer, so the transposed
copy is materialised first (the Gather keeps W in fp32).

`--quant rtn|hqq|gptq|kquant` picks which of onnxruntime's weight-only quantizers rounds the base graph's
MatMul weights (`onnxruntime.quantization.matmul_nbits_quantizer`); every one writes MatMulNBits, so the
runtime is the same. What each takes (onnxruntime 1.32):

    rtn     DefaultWeightOnlyQuantConfig     round to nearest per block; 4 or 8 bits, symmetric or not;
                                             also stores the token embedding (Gather) in 4 bits
    hqq     HQQWeightOnlyQuantConfig         half-quadratic optimisation of each block's zero point, no
                                             data; asymmetric only (float zero points), and 4 bits only:
                                             MatMulNBits has no CPU kernel for 8 bits with float zero points
    kquant  KQuantWeightOnlyQuantConfig      llama.cpp's k-quant search of scale and minimum per block, no
                                             data; 4 or 8 bits (8 through its per-node config); asymmetric only
    gptq    GPTQWeightOnlyQuantConfig        GPTQ: rounds column by column, correcting the rest of the row
                                             with the Hessian of the layer's inputs on calibration sequences
                                             (the base's own answers); 4 bits only (at 8 bits onnxruntime
                                             keeps the rounded weights as float32 MatMuls); symmetric or not

hqq, kquant and gptq quantize MatMuls only: for int4 the token embedding is stored by rtn in a second pass.
The draft graphs always take rtn (their rounding only changes what is proposed). onnxruntime's GPTQ runs the
whole graph once per calibration sequence for each distinct MatMul input (121 on SmolLM2), so its time grows
with the calibration tokens: --calibration-sequences (default 32) of at most CALIBRATION_TOKENS tokens each.
kquant and asymmetric gptq pack two 4-bit zero points per byte across a whole column, which breaks when a
weight's input size is an odd number of blocks (SmolLM2's 576 is 9 blocks of 64, 4.5 of 128): the export
refuses those block sizes before it starts (check_block_layout).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clover.errors import CloverError


def fold_transposed_weights(model) -> int:
    """Replace Transpose(initializer) nodes by a transposed initializer; returns how many were folded."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    folded = 0
    for node in list(model.graph.node):
        if node.op_type != "Transpose" or node.input[0] not in inits:
            continue
        w = numpy_helper.to_array(inits[node.input[0]])
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        model.graph.initializer.append(
            numpy_helper.from_array(np.ascontiguousarray(np.transpose(w, perm)), node.output[0])
        )
        model.graph.node.remove(node)
        folded += 1
    return folded


def gemms_as_matmul(model) -> int:
    """Rewrite Gemm(x, W, b) with W an initializer (how a Linear on 2-D rows exports) as MatMul(x, W') + b, which
    onnxruntime's weight quantizer takes (it skips Gemm); returns how many were rewritten."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    rewritten = 0
    for node in list(model.graph.node):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (
            node.op_type != "Gemm"
            or node.input[1] not in inits
            or attrs.get("transA", 0)
            or attrs.get("alpha", 1.0) != 1.0
            or attrs.get("beta", 1.0) != 1.0
        ):
            continue
        w = numpy_helper.to_array(inits[node.input[1]])
        name = f"{node.input[1]}.matmul"
        model.graph.initializer.append(
            numpy_helper.from_array(np.ascontiguousarray(w.T if attrs.get("transB", 0) else w), name)
        )
        bias = len(node.input) > 2 and node.input[2]
        product = f"{node.output[0]}.matmul" if bias else node.output[0]
        i = list(model.graph.node).index(node)
        new = [helper.make_node("MatMul", [node.input[0], name], [product], name=node.name)]
        if bias:
            new.append(helper.make_node("Add", [product, node.input[2]], list(node.output), name=f"{node.name}.bias"))
        model.graph.node.remove(node)
        for k, n in enumerate(new):
            model.graph.node.insert(i + k, n)
        rewritten += 1
    used = {i for n in model.graph.node for i in n.input}
    for t in [t for t in model.graph.initializer if t.name not in used]:
        model.graph.initializer.remove(t)
    return rewritten


BITS = {"int8": 8, "int4": 4}
# MatMulNBits accuracy_level 0: fp32 compute on the de-quantized blocks. Level 4 (int8 activations, VNNI)
# decodes SmolLM2 int4 ~1.35x faster (78 vs 58 tok/s, 2 threads) but breaks losslessness: SmolLM2's
# residual stream carries massive activations (~1e3), so a block's int8 scale is coarse and the last-bit
# differences between a 1-token step and a tree verify (attention sums split differently) flip whole
# quantization steps. Greedy speculative output then left plain decoding on 6 of 6 MT-Bench prompts
# (top-2 margins 0.07-0.3 at the divergence); with level 0 it matched on 6 of 6.
ACCURACY_LEVEL = 0
# The fused base graph (--attention fused) attends over one KV buffer on >= 2 rows (export/fused_graph.py), and
# MatMulNBits at level 4 is row-invariant (1 row or many, bit for bit), so every row of a chain verify is
# computed exactly as the same row of a plain step: there level 4 keeps greedy speculation exact for chains.
FUSED_ACCURACY_LEVEL = 4
# The draft graphs only propose tokens (the base verifies them), so their rounding cannot change the output:
# they take the faster int8 compute.
DRAFT_ACCURACY_LEVEL = 4
DRAFT_BLOCK_SIZE = 32  # --draft-quant: onnxruntime-genai's default block
# Asymmetric blocks (a zero point each): the embedded default's GGUF is Q4_1, itself asymmetric 4-bit in
# blocks of 32, and greedy decoding followed fp32 for longer than with symmetric blocks.
SYMMETRIC = False
DEFAULT_QUANTIZER = "rtn"  # --quant: the quantizers and what each writes are clover.export.config's QUANTIZERS
CALIBRATION_TOKENS = 256  # --quant gptq: prompt + answer tokens per calibration sequence, at most
GPTQ_SETTINGS = {"percdamp": 0.01, "block_size": 128, "actorder": False, "mse": False, "perchannel": True}


@dataclass(frozen=True)
class CalibrationSet:
    """GPTQ's calibration data: token sequences of the base's own answers, each with its prompt.

    sequences: (ids int64 [T], prompt length P) each, T <= CALIBRATION_TOKENS and P < T.
    source: what they were read from (corpus folder and how many), for the manifest.
    base_fingerprint: the base that wrote the answers (checked against the exported base).
    """

    sequences: tuple[tuple[np.ndarray, int], ...]
    source: str
    base_fingerprint: dict

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.sequences)


def _onnx_quantization():
    try:
        import onnx
        from onnxruntime import quantization
    except ImportError as e:
        raise CloverError("quantizing graphs needs onnx and onnxruntime: pip install 'clover-deploy[onnx]'") from e
    return onnx, quantization


def quantize_weights(
    path: Path,
    scheme: str,
    block_size: int,
    accuracy_level: int,
    gemms: bool = False,
    keep_lm_head: str | None = None,
    quant: str = DEFAULT_QUANTIZER,
    symmetric: bool = SYMMETRIC,
    calibration: CalibrationSet | None = None,
    progress: Callable[[str], None] | None = None,
) -> str:
    """Rewrite the fp32 graph at `path` with MatMulNBits weights computing at `accuracy_level`, rounded by the
    quantizer `quant` (QUANTIZERS; gptq reads `calibration`), except Gemm nodes (unless `gemms`) and the LM head
    whose weights `keep_lm_head` names (lm_head.weights_key: the base's, which the draft graphs share); returns how
    the token embedding is stored ("int4" or "float32": onnxruntime quantizes Gather to 4 bits only)."""
    from clover.export.lm_head import lm_head_names
    from clover.onnx_ir import capped

    onnx, _ = _onnx_quantization()
    with quiet_root_logger():  # importing it calls logging.basicConfig(level=INFO) for the whole process
        from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    model = onnx.load(str(path))
    fold_transposed_weights(model)  # the quantizer takes MatMuls whose weight is an initializer
    if gemms:
        gemms_as_matmul(model)  # ... and no Gemm (a Linear on rows: Clover's draft_step, Medusa's ResBlocks)
    embedding_lookups_as_gather(model)  # ... and Gathers (the heads' embedding rows, 113 MB in fp32 for SmolLM2)
    bits = BITS[scheme]
    gather = scheme == "int4"  # GatherBlockQuantized stores 4 bits only
    excluded = list(lm_head_names(model, keep_lm_head))
    if quant == DEFAULT_QUANTIZER:
        ops = ("MatMul", "Gather") if gather else ("MatMul",)
        model = _quantized(model, mnq, rtn_config(mnq, bits, block_size, symmetric, accuracy_level, ops), excluded)
    else:
        unused = unused_inputs(model)  # onnxruntime's kquant / gptq writer cannot sort a graph with unused inputs
        config = algo_config(mnq, quant, model, bits, block_size, calibration, progress)
        model = _quantized(model, mnq, config, excluded, bits, block_size, symmetric, accuracy_level)
        for index, value in unused:  # the graph's I/O stays as it was (a chains-only fused base takes no tree mask)
            model.graph.input.insert(index, value)
        if not any(o.domain == "com.microsoft" for o in model.opset_import):  # the kquant / gptq writer adds none
            model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
        if gather:  # the embedding: hqq / kquant / gptq take MatMuls only
            model = _quantized(model, mnq, rtn_config(mnq, 4, block_size, symmetric, 0, ("Gather",)), excluded)
        set_accuracy_level(model, accuracy_level)  # HQQ writes none
    capped(model)  # the quantizers keep the source's IR version, or stamp onnx's newest
    replace_graph(
        path, lambda out: onnx.save_model(model, str(out), save_as_external_data=True, location=out.name + ".data")
    )
    return "int4" if gather and "GatherBlockQuantized" in quantized_ops(path) else "float32"


def check_block_layout(quant: str, scheme: str, symmetric: bool, block_size: int, input_sizes: dict[str, int]) -> None:
    """Refuse, before any work, a block size at which onnxruntime's kquant / asymmetric gptq int4 writer cannot
    pack the zero points: it packs them two per byte over the whole weight, so every weight's input size must
    be an even number of blocks (`input_sizes`: what each kind of weight takes, e.g. hidden, intermediate)."""
    if quant not in ("kquant", "gptq") or scheme != "int4" or (symmetric and quant == "gptq"):
        return
    odd = {name: k for name, k in input_sizes.items() if -(-k // block_size) % 2}
    if odd:
        sizes = ", ".join(f"{name} {k} = {k / block_size:g} blocks" for name, k in odd.items())
        fits = [b for b in (16, 32, 64, 128, 256) if all(-(-k // b) % 2 == 0 for k in input_sizes.values())]
        raise CloverError(
            f"--quant {quant} --weights int4 --block-size {block_size}: onnxruntime packs its zero points two per "
            f"byte across each weight, which needs an even number of blocks per input ({sizes}): use --block-size "
            f"{' or '.join(map(str, fits)) or '(none fits this model)'}"
            + (", or --symmetric (no zero points)" if quant == "gptq" else ", or --quant rtn or hqq")
        )


def unused_inputs(model) -> list[tuple[int, object]]:
    """Remove the graph inputs no node reads; returns them with their positions, to be put back."""
    used = {i for n in model.graph.node for i in n.input}
    unused = [(k, v) for k, v in enumerate(model.graph.input) if v.name not in used]
    for _, v in reversed(unused):
        model.graph.input.remove(v)
    return [(k, type(v).FromString(v.SerializeToString())) for k, v in unused]


def rtn_config(mnq, bits: int, block_size: int, symmetric: bool, accuracy_level: int, ops: tuple[str, ...]):
    return mnq.DefaultWeightOnlyQuantConfig(
        block_size=block_size,
        is_symmetric=symmetric,
        accuracy_level=accuracy_level or None,
        bits=bits,
        op_types_to_quantize=ops,
        quant_axes=(("MatMul", 0), ("Gather", 1)),
    )


def algo_config(mnq, quant: str, model, bits: int, block_size: int, calibration, progress):
    """The onnxruntime config of quantizer `quant` (not rtn) for the MatMuls of `model`."""
    if quant == "hqq":
        return mnq.HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits, op_types_to_quantize=("MatMul",))
    if quant == "kquant":
        # its bits come from a per-node template of 4 bits; 8 is set per node through customized_weight_config
        nodes = {n.name: {"bits": bits} for n in model.graph.node if n.op_type == "MatMul"} if bits != 4 else None
        return mnq.KQuantWeightOnlyQuantConfig(op_types_to_quantize=("MatMul",), customized_weight_config=nodes)
    if quant == "gptq":
        if calibration is None:
            raise CloverError("--quant gptq needs calibration sequences: pass --calibration CORPUS")
        reader = CalibrationReader(model, calibration, progress)
        return mnq.GPTQWeightOnlyQuantConfig(
            calibration_data_reader=reader, op_types_to_quantize=("MatMul",), **GPTQ_SETTINGS
        )
    raise CloverError(f"unknown --quant {quant!r}: use rtn, hqq, gptq or kquant")


def _quantized(model, mnq, config, excluded, bits=4, block_size=128, symmetric=False, accuracy_level=0):
    """`model` after one MatMulNBitsQuantizer pass with `config` (bits, block size, symmetry and accuracy level
    are the quantizer's own arguments for the gptq and kquant configs, which do not carry them)."""
    quantizer = mnq.MatMulNBitsQuantizer(
        model,
        bits=bits,
        block_size=block_size,
        is_symmetric=symmetric,
        accuracy_level=accuracy_level or None,
        nodes_to_exclude=excluded,
        algo_config=config,
    )
    with quiet_root_logger(), np.errstate(invalid="ignore", divide="ignore"):  # all-zero blocks: scale 0, handled
        with contextlib.redirect_stdout(None):  # the neural-compressor quantizers print a progress bar
            quantizer.process()
    return quantizer.model.model


def set_accuracy_level(model, accuracy_level: int) -> None:
    """Every MatMulNBits node computes at `accuracy_level` (0: the attribute unset, fp32 compute)."""
    from onnx import helper

    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        kept = [a for a in node.attribute if a.name != "accuracy_level"]
        del node.attribute[:]
        node.attribute.extend(kept)
        if accuracy_level:
            node.attribute.append(helper.make_attribute("accuracy_level", accuracy_level))


class CalibrationReader:
    """onnxruntime's CalibrationDataReader over a CalibrationSet: one prefill feed per sequence (empty KV cache,
    causal mask, logits only at the rows that predict answer tokens, so the LM head is calibrated on answers)."""

    def __init__(self, model, calibration: CalibrationSet, progress: Callable[[str], None] | None = None):
        inputs = {i.name: i for i in model.graph.input}
        self.inputs = set(inputs)  # a chains-only fused base takes no position_ids or tree_mask
        self.cache = {}
        for name, value in inputs.items():
            if name.startswith("past_key_values."):
                dims = value.type.tensor_type.shape.dim
                self.cache[name] = (dims[1].dim_value, dims[3].dim_value)  # [batch, Hkv, slots, D]
        self.sequences = calibration.sequences
        self.progress = progress
        self.next = 0

    def feed(self, ids: np.ndarray, prompt: int) -> dict[str, np.ndarray]:
        T = len(ids)
        feed = {
            "input_ids": ids[None].astype(np.int64),
            "position_ids": np.arange(T, dtype=np.int64)[None],
            "tree_mask": np.tri(T, dtype=bool)[None],
            "past_lengths": np.zeros(1, np.int64),
            "logit_rows": np.arange(prompt - 1, T - 1, dtype=np.int64),
            **{n: np.zeros((1, h, 0, d), np.float32) for n, (h, d) in self.cache.items()},
        }
        return {n: v for n, v in feed.items() if n in self.inputs}

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.next >= len(self.sequences):
            return None
        self.next += 1
        return self.feed(*self.sequences[self.next - 1])

    def __iter__(self):
        return self

    def __next__(self):
        feed = self.get_next()
        if feed is None:
            raise StopIteration
        return feed


def quantizer_settings(
    quant: str, scheme: str, block_size: int, symmetric: bool, calibration: CalibrationSet | None
) -> dict:
    """What the manifest records of the quantizer of the base graph (clover.artifact.WeightsSpec.quantizer)."""
    config = {
        "rtn": "DefaultWeightOnlyQuantConfig",
        "hqq": "HQQWeightOnlyQuantConfig",
        "kquant": "KQuantWeightOnlyQuantConfig",
        "gptq": "GPTQWeightOnlyQuantConfig",
    }[quant]
    settings = {
        "name": quant,
        "config": f"onnxruntime.quantization.matmul_nbits_quantizer.{config}",
        "bits": BITS[scheme],
        "block_size": block_size,
        "symmetric": symmetric,
        "embedding": "rtn" if scheme == "int4" else None,
        "draft_graphs": "rtn",
    }
    if quant == "gptq" and calibration is not None:
        settings["gptq"] = dict(GPTQ_SETTINGS)
        settings["calibration"] = {
            "source": calibration.source,
            "sequences": len(calibration.sequences),
            "tokens": calibration.tokens,
            "max_tokens_per_sequence": CALIBRATION_TOKENS,
        }
    return settings


def embedding_lookups_as_gather(model) -> int:
    """Rewrite GatherND(W, Unsqueeze(ids, -1)) with W an initializer, which is how `weight[ids]` exports, as
    the equivalent Gather(W, ids); returns how many were rewritten."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    rewritten = 0
    for node in list(model.graph.node):
        if node.op_type != "GatherND" or node.input[0] not in inits or any(a.i for a in node.attribute):
            continue  # batch_dims != 0 is another lookup
        unsqueeze = producer.get(node.input[1])
        if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or unsqueeze.input[1] not in inits:
            continue
        if numpy_helper.to_array(inits[unsqueeze.input[1]]).tolist() != [-1]:
            continue
        gather = helper.make_node(
            "Gather", [node.input[0], unsqueeze.input[0]], list(node.output), name=node.name, axis=0
        )
        model.graph.node.insert(list(model.graph.node).index(node), gather)
        model.graph.node.remove(node)
        if not any(unsqueeze.output[0] in n.input for n in model.graph.node):
            model.graph.node.remove(unsqueeze)
        rewritten += 1
    return rewritten


def replace_graph(path: Path, write) -> None:
    """Let `write(tmp_path)` write a graph (and its external data) next to `path`, then replace the old files
    (same names), so a failed write leaves the old graph whole."""
    with tempfile.TemporaryDirectory(prefix=".quant-", dir=path.parent) as scratch:
        write(Path(scratch) / path.name)
        for f in Path(scratch).iterdir():  # the graph and <name>.data: same names as the fp32 files they replace
            shutil.move(str(f), path.parent / f.name)
            (path.parent / f.name).chmod(0o644)  # the quantizers create their data files private


def quantize_draft_graph(path: Path, scheme: str, keep_lm_head: str | None = None) -> None:
    """Rewrite the fp32 draft graph at `path` (and its external data) with `scheme` MatMulNBits weights, except
    the LM head it shares with the base (`keep_lm_head`: that head's weights_key; None: nothing shared)."""
    quantize_weights(path, scheme, DRAFT_BLOCK_SIZE, DRAFT_ACCURACY_LEVEL, gemms=True, keep_lm_head=keep_lm_head)


@contextlib.contextmanager
def quiet_root_logger():
    """Errors only from the root logger during the body, and its level and handlers as they were after it
    (onnxruntime's quantizers log hints meant for CNNs, and one module calls logging.basicConfig on import)."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers


def base_accuracy_level(attention: str) -> int:
    """MatMulNBits accuracy level of the base graph exported with `attention`."""
    return FUSED_ACCURACY_LEVEL if attention == "fused" else ACCURACY_LEVEL


QUANTIZED_OPS = ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulNBits", "GatherBlockQuantized")


def quantized_ops(path: Path) -> list[str]:
    """The quantized-weight nodes of a graph (empty: nothing was quantized)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return [n.op_type for n in model.graph.node if n.op_type in QUANTIZED_OPS]
