"""The base decoder as ONNX Runtime's fused CPU operators (`clover-export --attention fused`).

The portable graph is what torch.onnx traces from `Decoder`: about 1,000 small nodes per step, and
attention split into a past part and a new part. On a 2-core CPU decoding SmolLM2 int4, that structure,
not the weights, costs most of a step. This builder writes the same decoder directly as the contrib
operators onnxruntime-genai's graphs use, one per job:

    Gather / RMSNormalization                       token embedding, first norm
    per layer:  MatMul (q, k, v packed)  ->  GroupQueryAttention (RoPE, KV cache, tree mask)
                MatMul (o)  ->  SkipSimplifiedLayerNormalization (residual + norm)
                MatMul (gate), MatMul (up), SiLU * up  ->  MatMul (down)  ->  SkipSimplifiedLayerNormalization
    Gather(logit_rows)  ->  MatMul (LM head)

About 13 nodes per layer (with the row gather and slice around attention, below); `clover-export --weights`
then turns every MatMul into MatMulNBits.

KV cache. GroupQueryAttention writes the new tokens' K/V into the cache buffer itself and attends over
that one buffer: `past_key_values.{i}.*` and `present.{i}.*` are bound to the same [batch, Hkv, slots, D]
array (onnxruntime shares them when the pointers are equal). Row s of a step sits at slot
past_length + s; after acceptance the runtime moves the accepted path's rows to contiguous slots
(nothing moves for a chain). Attending over one buffer, a chain's rows see exactly the keys a 1-token
step would, at the same slots; with attention always run on >= 2 rows (a 1-token step repeats its row,
below) a chain verify and plain steps compute the same sums bit for bit, and so (MatMulNBits being
row-invariant) the same logits. The buffers need one slot beyond a 1-token step for the repeat.

Tree mask. Row s attends causally (slots <= past + s) plus the additive `attention_bias` built once per
step from `tree_mask`: 0 for past slots and the row's ancestors, -inf for the other new rows. Positions
(RoPE) come from `position_ids` (past length + depth), not from slots.
A tree needs a non-empty past: with 0 cached slots GroupQueryAttention takes its prompt path, which
attends causally and ignores the bias (found by clover-compare: a branching tree over an empty cache gets
wrong logits). The runtime never sends one: a prompt is prefilled causally, and trees come after it.

Same inputs and outputs as the portable graph, except that present.{i}.* are the whole buffers.

Clover-2's draft_begin (`fused_begin_model`) is written with the same layer writer: its augmenting block is
decoder layers over the accepted tokens with a KV cache of its own, updated in place the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from onnx import TensorProto

from clover.errors import CloverError
from clover.models.decoder import Decoder

MS = "com.microsoft"
OPSET = 23  # RMSNormalization


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


class GraphWriter:
    """Collects ONNX nodes and initializers: `node` returns its output names (named after the node)."""

    def __init__(self) -> None:
        self.nodes: list = []
        self.inits: list = []

    def init(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.require(array, requirements="C"), name))  # keeps 0-d scalars 0-d
        return name

    def node(
        self, op: str, inputs: list[str], outputs: list[str] | int = 1, domain: str = "", name: str = "", **attrs
    ) -> list[str]:
        from onnx import helper

        name = name or f"{op}_{len(self.nodes)}"
        outs = [f"{name}/out{i}" for i in range(outputs)] if isinstance(outputs, int) else outputs
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain, **attrs))
        return outs


GQA_ATTRIBUTES = dict(do_rotary=1, rotary_interleaved=0, local_window_size=-1)


class AttentionRows(NamedTuple):
    """Per-step inputs of one sequence's GroupQueryAttention nodes (shared by every layer)."""

    rows: str  # [rows] int64: which packed rows attention runs on (>= 2: a 1-token step repeats its row)
    count: str  # [1] int64: its real rows (the output keeps these)
    seqlens_k: str  # [B] int32: past + rows - 1
    total_len: str  # [] int32
    position_ids: str  # [B, rows] ("" for chains: GroupQueryAttention derives them)
    bias: str  # [B, 1, rows, total] additive tree mask ("" for chains: causal)


def attention_rows(node, new: str, past: str, mask: str, positions: str, tag: str, offset: str = "") -> AttentionRows:
    """The nodes that prepare one sequence's (or one batch's) attention for a step: `new` real rows ([] int64)
    after `past` ([B]) cached, starting at packed row `offset` ([] int64, "" for 0), with tree mask `mask`
    [B, new, new] and RoPE positions `positions` [B, new] ("" for chains).

    Attention runs on at least 2 rows: a 1-token step repeats its row. onnxruntime computes a 1-row attention
    with other matrix kernels than a multi-row one (results differ in the last bits), so without this a row
    of a chain verify would not equal the same row of a plain step bit for bit. The repeat writes its K/V to
    the slot after the step (the next step overwrites it); its output is dropped."""
    rows = node("Max", [new, "two_i64"], name=f"attention_rows{tag}")[0]
    last_row = node(
        "Max", [node("Sub", [new, "one_i64"], name=f"last_row_sub{tag}")[0], "zero_i64"], name=f"last_row{tag}"
    )[0]
    index = node(
        "Clip",
        [node("Range", ["zero_i64", rows, "one_i64"], name=f"row_range{tag}")[0], "zero_i64", last_row],
        name=f"row_index{tag}",
    )[0]  # [0, 1, ..., new - 1] or [0, 0]
    packed = node("Add", [index, offset], name=f"packed_rows{tag}")[0] if offset else index
    position_ids = node("Gather", [positions, packed], name=f"attention_positions{tag}", axis=1)[0] if positions else ""

    total = node("Add", [past, rows], name=f"totals{tag}")[0]  # [B]
    seqlens_k = node(
        "Cast",
        [node("Sub", [total, "one_i64"], name=f"seqlens_sub{tag}")[0]],
        name=f"seqlens_k{tag}",
        to=TensorProto.INT32,
    )[0]
    total_max = node("ReduceMax", [total], name=f"total_max{tag}", keepdims=0)[0]
    total_len = node("Cast", [total_max], name=f"total_sequence_length{tag}", to=TensorProto.INT32)[0]
    bias = ""
    if mask:
        # attention_bias [B, 1, rows, total]: key slot j of sequence b is a past slot (j < past_b) or new row
        # j - past_b, which row s may see iff mask[b, s, j - past_b].
        key_slots = node("Range", ["zero_i64", total_max, "one_i64"], name=f"key_slots{tag}")[0]  # [total]
        rel = node(
            "Sub",
            [
                node("Unsqueeze", [key_slots, "axis0"], name=f"slots_row{tag}")[0],
                node("Unsqueeze", [past, "axis1"], name=f"past_col{tag}")[0],
            ],
            name=f"rel{tag}",
        )[0]  # [B, total]
        clipped = node("Clip", [rel, "zero_i64", last_row], name=f"rel_clip{tag}")[0]  # [B, total]
        mask_shape = node("Shape", [mask], name=f"mask_shape{tag}")[0]  # [B, new, new]
        index_shape = node(
            "Concat",
            [
                node("Slice", [mask_shape, "zero_1d", "two"], name=f"bn{tag}")[0],
                node("Unsqueeze", [total_max, "axis0"], name=f"total_1d{tag}")[0],
            ],
            name=f"index_shape{tag}",
            axis=0,
        )[0]
        index_rows = node(
            "Expand",
            [node("Unsqueeze", [clipped, "axis1"], name=f"rel_rows{tag}")[0], index_shape],
            name=f"index_rows{tag}",
        )[0]
        seen = node("GatherElements", [mask, index_rows], name=f"tree_seen{tag}", axis=2)[0]  # [B, new, total]
        is_past = node("Less", [rel, "zero_i64"], name=f"is_past{tag}")[0]  # [B, total]
        is_new = node("Less", [rel, new], name=f"is_new{tag}")[0]
        row_cols = lambda t, name: node("Unsqueeze", [t, "axis1"], name=name)[0]  # noqa: E731 [B, total] -> [B, 1, total]
        allowed = node(
            "Or",
            [
                row_cols(is_past, f"is_past_rows{tag}"),
                node("And", [seen, row_cols(is_new, f"is_new_rows{tag}")], name=f"tree_seen_new{tag}")[0],
            ],
            name=f"allowed{tag}",
        )[0]
        rows_bias = node(
            "Gather",
            [node("Where", [allowed, "zero_f", "neg_inf"], name=f"bias{tag}")[0], index],
            name=f"bias_rows{tag}",
            axis=1,
        )[0]
        bias = node("Unsqueeze", [rows_bias, "axis1"], name=f"attention_bias{tag}")[0]  # [B, 1, rows, total]
    count = node("Unsqueeze", [new, "axis0"], name=f"new_1d{tag}")[0]
    return AttentionRows(packed, count, seqlens_k, total_len, position_ids, bias)


def check_fusable(base: Decoder) -> None:
    """One-line errors for the decoders this builder does not write."""
    cfg = base.config
    if cfg.sliding_window is not None:
        raise CloverError(
            f"--attention fused has no sliding window, but this {cfg.architecture} uses a "
            f"{cfg.sliding_window}-token window: export it with --attention portable"
        )
    if next(base.parameters()).dtype != torch.float32:
        raise CloverError("--attention fused writes float32 graphs for ONNX Runtime's CPU kernels: use --dtype float32")


def rope_caches(inv_freq: torch.Tensor, max_context: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_context, D/2] in float32, computed as Decoder's rope_cos_sin does (same products), times
    `scale` (LongRoPE's attention factor)."""
    positions = torch.arange(max_context, dtype=torch.int64).float()[:, None]
    freqs = positions * inv_freq.float()
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.numpy(), sin.numpy()


def write_constants(init) -> None:
    """The small constants attention_rows and the layers read."""
    for name, value in (
        ("zero_i64", np.array(0, np.int64)),
        ("zero_1d", np.array([0], np.int64)),
        ("one_i64", np.array(1, np.int64)),
        ("axis0", np.array([0], np.int64)),
        ("axis1", np.array([1], np.int64)),
        ("two", np.array([2], np.int64)),
        ("two_i64", np.array(2, np.int64)),
        ("neg_inf", np.array(-np.inf, np.float32)),
        ("zero_f", np.array(0.0, np.float32)),
    ):
        init(name, value)


def linear_writer(w: GraphWriter):
    """linear(x, nn.Linear, name) -> MatMul (+ Add for a bias) with the weight as [in, out]: the form
    MatMulNBitsQuantizer takes (quant axis 0)."""

    def linear(x: str, layer: torch.nn.Linear, name: str) -> str:
        y = w.node("MatMul", [x, w.init(f"{name}.weight", _np(layer.weight).T)], name=name)[0]
        if layer.bias is not None:
            y = w.node("Add", [y, w.init(f"{name}.bias", _np(layer.bias))], name=f"{name}.bias_add")[0]
        return y

    return linear


def write_qk_norm(w: GraphWriter, attn, cfg, qkv: str, p: str) -> str:
    """Qwen3's per-head RMSNorm of the queries and keys in the packed q|k|v rows [B, T, (Hq + 2 Hkv) D]."""
    node, init = w.node, w.init
    Hq, Hkv, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, float(cfg.rms_norm_eps)
    heads = node(
        "Reshape", [qkv, init(f"{p}.heads_shape", np.array([0, 0, Hq + 2 * Hkv, D], np.int64))], name=f"{p}.heads"
    )
    split = init(f"{p}.qkv_split", np.array([Hq, Hkv, Hkv], np.int64))
    q, k, v = node("Split", [heads[0], split], 3, name=f"{p}.qkv_parts", axis=2)
    normed = [
        node("RMSNormalization", [x, init(f"{p}.{n}.weight", _np(norm.weight))], name=f"{p}.{n}", axis=-1, epsilon=eps)[
            0
        ]
        for x, n, norm in ((q, "q_norm", attn.q_norm), (k, "k_norm", attn.k_norm))
    ]
    joined = node("Concat", [*normed, v], name=f"{p}.qkv_normed", axis=2)[0]
    flat = init(f"{p}.rows_shape", np.array([0, 0, (Hq + 2 * Hkv) * D], np.int64))
    return node("Reshape", [joined, flat], name=f"{p}.qkv_packed")[0]


def write_layer(
    w: GraphWriter,
    layer,
    cfg,
    p: str,
    i: int,
    rows: AttentionRows,
    h: str,
    residual: str,
    next_norm: torch.nn.Module,
    next_name: str,
) -> tuple[str, str, str, str]:
    """One decoder layer `layer` (named `p`, KV cache index `i`) on the normed rows `h` with the residual
    stream `residual`, ending in the next layer's input norm (or the final one): (normed, residual, present
    key, present value)."""
    node, init, linear = w.node, w.init, linear_writer(w)
    H, Hq, Hkv, D, eps = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, float(cfg.rms_norm_eps)
    attn = layer.self_attn
    qkv = linear(h, attn.qkv_proj, f"{p}.self_attn.qkv_proj")
    if (
        cfg.qk_norm == "head"
    ):  # before the row Gather (a norm per row), so the attention block stays Gather -> GQA -> Slice
        qkv = write_qk_norm(w, attn, cfg, qkv, f"{p}.self_attn")
    qkv = node("Gather", [qkv, rows.rows], name=f"{p}.self_attn.rows", axis=1)[0]
    out, k_out, v_out = node(
        "GroupQueryAttention",
        [
            qkv,
            "",
            "",
            f"past_key_values.{i}.key",
            f"past_key_values.{i}.value",
            rows.seqlens_k,
            rows.total_len,
            "cos_cache",
            "sin_cache",
            rows.position_ids,
            rows.bias,
        ],
        [f"{p}.self_attn/out", f"present.{i}.key", f"present.{i}.value"],
        domain=MS,
        name=f"{p}.self_attn",
        **GQA_ATTRIBUTES,
        num_heads=Hq,
        kv_num_heads=Hkv,
        scale=float(D**-0.5),
    )
    out = node("Slice", [out, "zero_1d", rows.count, "axis1"], name=f"{p}.self_attn.unpad")[0]
    o = linear(out, attn.o_proj, f"{p}.self_attn.o_proj")
    normed, _, _, residual = node(
        "SkipSimplifiedLayerNormalization",
        [residual, o, init(f"{p}.post_attention_layernorm.weight", _np(layer.post_attention_layernorm.weight))],
        4,
        domain=MS,
        name=f"{p}.post_attention_layernorm",
        epsilon=eps,
    )
    mlp = layer.mlp
    inter = cfg.intermediate_size
    wgu, bgu = mlp.gate_up_proj.weight, mlp.gate_up_proj.bias
    gate_l = torch.nn.Linear(H, inter, bias=bgu is not None)
    up_l = torch.nn.Linear(H, inter, bias=bgu is not None)
    gate_l.weight.data, up_l.weight.data = wgu[:inter], wgu[inter:]
    if bgu is not None:
        gate_l.bias.data, up_l.bias.data = bgu[:inter], bgu[inter:]
    gate = linear(normed, gate_l, f"{p}.mlp.gate_proj")
    up = linear(normed, up_l, f"{p}.mlp.up_proj")
    act = node("Mul", [gate, node("Sigmoid", [gate], name=f"{p}.mlp.sigmoid")[0]], name=f"{p}.mlp.silu")[0]
    down = linear(node("Mul", [act, up], name=f"{p}.mlp.gated")[0], mlp.down_proj, f"{p}.mlp.down_proj")
    h, _, _, residual = node(
        "SkipSimplifiedLayerNormalization",
        [residual, down, init(f"{next_name}.weight", _np(next_norm.weight))],
        4,
        domain=MS,
        name=next_name,
        epsilon=eps,
    )
    return h, residual, k_out, v_out


def finish_model(w: GraphWriter, name: str, inputs: list, outputs: list):
    from onnx import helper

    from clover.onnx_ir import capped

    graph = helper.make_graph(w.nodes, name, inputs, outputs, w.inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)], producer_name="clover-deploy"
    )
    return capped(model)  # make_model stamps onnx's newest IR version, which onnxruntime may not read


def fused_base_model(base: Decoder, max_context: int, trees: bool = True):
    """The base decoder as an onnx.ModelProto of fused ONNX Runtime operators (see the module doc).
    trees=False: chains only (tree_mask and position_ids are then unused: a chain's positions are its
    slots, which GroupQueryAttention derives itself, and causal attention is its mask)."""
    from onnx import helper

    check_fusable(base)
    cfg = base.config
    H, Hkv, D, L = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    w = GraphWriter()
    init, node, linear = w.init, w.node, linear_writer(w)
    eps = float(cfg.rms_norm_eps)
    cos, sin = rope_caches(base.inv_freq, max_context, base.config.rope.attention_factor)
    init("cos_cache", cos)
    init("sin_cache", sin)
    write_constants(init)
    new = node("Gather", [node("Shape", ["input_ids"], name="ids_shape")[0], "one_i64"], name="new_len", axis=0)[0]
    solo = attention_rows(node, new, "past_lengths", "tree_mask" if trees else "", "position_ids" if trees else "", "")
    x = node(
        "Gather", [init("embed_tokens.weight", _np(base.embed_tokens.weight)), "input_ids"], name="embed_tokens", axis=0
    )[0]
    residual = x
    h = node(
        "RMSNormalization",
        [x, init("layers.0.input_layernorm.weight", _np(base.layers[0].input_layernorm.weight))],
        name="layers.0.input_layernorm",
        axis=-1,
        epsilon=eps,
    )[0]
    for i, layer in enumerate(base.layers):
        last = i + 1 == L
        h, residual, _, _ = write_layer(
            w,
            layer,
            cfg,
            f"layers.{i}",
            i,
            solo,
            h,
            residual,
            base.norm if last else base.layers[i + 1].input_layernorm,
            "norm" if last else f"layers.{i + 1}.input_layernorm",
        )
    node("Identity", [residual], ["hidden_states"], name="hidden_states")
    rows = node("Gather", [h, "logit_rows"], name="logit_rows_gather", axis=1)[0]
    lm = torch.nn.Linear(H, cfg.vocab_size, bias=False)
    lm.weight = base.lm_head.weight
    node("Identity", [linear(rows, lm, "lm_head")], ["logits"], name="logits")

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    kv = lambda name: helper.make_tensor_value_info(name, f32, ["batch", Hkv, "slots", D])  # noqa: E731
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, ["batch", "new"]),
        helper.make_tensor_value_info("position_ids", i64, ["batch", "new"]),
        helper.make_tensor_value_info("tree_mask", TensorProto.BOOL, ["batch", "new", "new"]),
        helper.make_tensor_value_info("past_lengths", i64, ["batch"]),
        helper.make_tensor_value_info("logit_rows", i64, ["rows"]),
        *[kv(f"past_key_values.{i}.{n}") for i in range(L) for n in ("key", "value")],
    ]
    outputs = [
        helper.make_tensor_value_info("logits", f32, ["batch", "rows", cfg.vocab_size]),
        helper.make_tensor_value_info("hidden_states", f32, ["batch", "new", H]),
        *[kv(f"present.{i}.{n}") for i in range(L) for n in ("key", "value")],
    ]
    return finish_model(w, "base", inputs, outputs)


def save_model(model, path: Path) -> None:
    """Write a fused graph to `path` with its weights as external data (`<name>.data`)."""
    import onnx

    onnx.save(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=f"{path.name}.data",
        size_threshold=1024,
    )


def write_fused_base(base: Decoder, path: Path, max_context: int, trees: bool = True) -> None:
    save_model(fused_base_model(base, max_context, trees), path)


# -- Clover-2's draft_begin -----------------------------------------------------------------------------------


def fused_begin_model(heads, max_context: int):
    """Clover-2's draft_begin (export/graphs.BeginGraph, heads.begin) as fused ONNX Runtime operators: the
    gated fusion of each accepted token's hidden state with the next token's embedding, the augmenting block's
    decoder layers written as the base's are (GroupQueryAttention over the heads' own KV cache, in place), and
    the depth-1 head on the last row. Traced, the same graph is ~190 small nodes (decomposed norms, attention,
    RoPE); written this way, ~60 (SmolLM2, int8 drafts: 0.30-0.45 ms a call back to back instead of 0.40-0.60).

    Accepted tokens form a chain, so attention is causal with positions from the slots (no mask or position
    input is read), and, as in the base, rows are written at slots past_length + row: the runtime keeps one
    slot of room beyond a 1-row call (attention_rows repeats a lone row)."""
    from clover.models.clover2 import Clover2Heads

    if not isinstance(heads, Clover2Heads):
        raise CloverError(f"the fused draft_begin is written for Clover-2 heads, not {type(heads).__name__}")
    w = GraphWriter()
    _begin_constants(w, heads, max_context)
    node = w.node
    new = node("Gather", [node("Shape", ["next_tokens"], name="tokens_shape")[0], "one_i64"], name="new_len", axis=0)[0]
    rows = attention_rows(node, new, "past_lengths", "", "", "")
    x = _write_fuse(w, heads)
    h = _write_augment(w, heads, rows, x)
    _write_begin_head(w, heads, new, h)
    inputs, outputs = _begin_io(heads)
    return finish_model(w, "draft_begin", inputs, outputs)


def _begin_constants(w: GraphWriter, heads, max_context: int) -> None:
    """The RoPE caches of the augmenting block and the constants draft_begin's nodes read."""
    cfg = heads.config.base_config
    init = w.init
    cos, sin = rope_caches(heads.augment.inv_freq, max_context, heads.augment.rope_scale)
    init("cos_cache", cos)
    init("sin_cache", sin)
    write_constants(init)
    init("heads_shape", np.array([0, 0, cfg.num_heads, -1], np.int64))
    init("hidden_shape", np.array([0, 0, cfg.hidden_size], np.int64))
    init("norm_eps", np.array(heads.fuse.eps, np.float32))
    init("minus_one", np.array([-1], np.int64))


def _write_fuse(w: GraphWriter, heads) -> str:
    """The gated fusion (GatedAttentionDecoder): x = h + v(e) * cos(q(norm(h)), k(e)) per attention head."""
    init, node, linear = w.init, w.node, linear_writer(w)
    fuse = heads.fuse
    e = node("Gather", [init("embedding.weight", _np(heads.lm_weight)), "next_tokens"], name="embedding", axis=0)[0]
    normed = node(
        "RMSNormalization",
        ["hidden_states", init("fuse.norm.weight", _np(fuse.norm.weight))],
        name="fuse.norm",
        axis=-1,
        epsilon=float(fuse.norm.eps),
    )[0]
    per_head = lambda t, name: node("Reshape", [t, "heads_shape"], name=name)[0]  # noqa: E731 [B, N, nh, H/nh]

    def unit(t: str, name: str) -> str:  # t / max(|t|, eps) over the last axis (F.cosine_similarity's clamp)
        norm = node("ReduceL2", [t, "minus_one"], name=f"{name}.l2", keepdims=1)[0]
        return node("Div", [t, node("Max", [norm, "norm_eps"], name=f"{name}.clamp")[0]], name=f"{name}.unit")[0]

    q = unit(per_head(linear(normed, fuse.q, "fuse.q"), "fuse.q.heads"), "fuse.q")
    k = unit(per_head(linear(e, fuse.k, "fuse.k"), "fuse.k.heads"), "fuse.k")
    gate = node("ReduceSum", [node("Mul", [q, k], name="fuse.qk")[0], "minus_one"], name="fuse.gate", keepdims=1)[0]
    v = per_head(linear(e, fuse.v, "fuse.v"), "fuse.v.heads")
    gated = node("Reshape", [node("Mul", [v, gate], name="fuse.gated")[0], "hidden_shape"], name="fuse.flat")[0]
    return node("Add", ["hidden_states", gated], name="fuse.out")[0]


def _write_augment(w: GraphWriter, heads, rows: AttentionRows, x: str) -> str:
    """The augmenting block: the base's decoder layers over the accepted rows `x`, then its norm."""
    cfg = heads.config.base_config
    L = heads.num_cache_layers
    layers = heads.augment.layers
    h = w.node(
        "RMSNormalization",
        [x, w.init("augment.layers.0.input_layernorm.weight", _np(layers[0].input_layernorm.weight))],
        name="augment.layers.0.input_layernorm",
        axis=-1,
        epsilon=float(cfg.rms_norm_eps),
    )[0]
    residual = x
    for i, layer in enumerate(layers):
        last = i + 1 == L
        h, residual, _, _ = write_layer(
            w,
            layer,
            cfg,
            f"augment.layers.{i}",
            i,
            rows,
            h,
            residual,
            heads.augment.norm if last else layers[i + 1].input_layernorm,
            "augment.norm" if last else f"augment.layers.{i + 1}.input_layernorm",
        )
    return h


def _write_begin_head(w: GraphWriter, heads, new: str, h: str) -> None:
    """The outputs: `state`, the last accepted row of `h`, and the depth-1 head's logits on it."""
    init, node, linear = w.init, w.node, linear_writer(w)
    cfg = heads.config.base_config
    state_row = node("Sub", [new, "one_i64"], name="state_row")[0]
    node("Gather", [h, state_row], ["state"], name="state", axis=1)  # [B, H]
    head = node(
        "RMSNormalization",
        [linear("state", heads.fc0, "fc0"), init("head_norm.weight", _np(heads.head_norm.weight))],
        name="head_norm",
        axis=-1,
        epsilon=float(heads.head_norm.eps),
    )[0]
    lm = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    lm.weight = torch.nn.Parameter(heads.lm_weight.detach(), requires_grad=False)
    node("Identity", [linear(head, lm, "lm_head")], ["logits"], name="logits")


def _begin_io(heads) -> tuple[list, list]:
    """draft_begin's inputs and outputs (the KV cache: one [batch, Hkv, slots, D] buffer per cache layer)."""
    from onnx import helper

    cfg = heads.config.base_config
    H, Hkv, D, V = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
    L = heads.num_cache_layers
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    kv = lambda name: helper.make_tensor_value_info(name, f32, ["batch", Hkv, "slots", D])  # noqa: E731
    inputs = [
        helper.make_tensor_value_info("hidden_states", f32, ["batch", "accepted", H]),
        helper.make_tensor_value_info("next_tokens", i64, ["batch", "accepted"]),
        helper.make_tensor_value_info("position_ids", i64, ["batch", "accepted"]),
        helper.make_tensor_value_info("past_lengths", i64, ["batch"]),
        *[kv(f"past_key_values.{i}.{n}") for i in range(L) for n in ("key", "value")],
    ]
    outputs = [
        helper.make_tensor_value_info("state", f32, ["batch", H]),
        helper.make_tensor_value_info("logits", f32, ["batch", V]),
        *[kv(f"present.{i}.{n}") for i in range(L) for n in ("key", "value")],
    ]
    return inputs, outputs


def write_fused_begin(heads, path: Path, max_context: int) -> None:
    save_model(fused_begin_model(heads, max_context), path)
