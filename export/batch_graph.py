"""The batched base graph (`base_batch.onnx`): one forward for the new rows of up to N sequences.

ONNX Runtime's GroupQueryAttention runs a batch of sequences only when each brings one row (token
generation) or none has a past (a first prompt): "batch_size must be 1 when sequence_length > 1 and past
context is given". The fused base runs attention on >= 2 rows per step (export/fused_graph.py: so chains
verify bit for bit like plain steps), so it cannot batch in GroupQueryAttention's batch dimension.

So the batched graph packs every sequence's new rows into one batch row ([1, rows]: every matmul, norm and
the LM head run once over all of them) and gives each sequence slot its own GroupQueryAttention node per
layer, over that sequence's own KV buffer (`past_key_values.{i}.key.s{b}`, shared with `present...s{b}` as
in the fused base). Sequence b owns packed rows start_b .. start_b + n_b (n = `row_counts` [N], in slot
order; 0 = not in this step). Each sequence's attention is then the very computation of the solo graph,
and MatMul / MatMulNBits / the norms compute each row alike whatever the row count, so every sequence's
outputs are bit for bit what the solo graph gives it: `check_batched` verifies exactly that at export.

The graph is made from the finished base graph (after quantization and the LM-head cut): its attention
nodes are swapped for the per-slot ones, every other node and every weight is kept, and the weights stay
in the base's external-data file (one copy on disk).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from clover.artifact import BATCH_GRAPH, ROW_COUNTS, slot_name
from clover.errors import CloverError
from clover.export.fused_graph import MS, AttentionRows, GraphWriter, attention_rows
from clover.onnx_ir import capped

PAST, PRESENT = "past_key_values", "present"


def slot_attention_rows(node, init, slots: int, trees: bool) -> list[AttentionRows]:
    """The batched graph's per-sequence attention inputs: sequence b owns packed rows start_b .. start_b + n_b
    (n = row_counts, in slot order). A sequence without rows in this step (n_b = 0) still runs its nodes on
    2 dummy rows over its idle 2-slot buffer (past 0): a graph cannot skip nodes, and these cost a few us."""
    starts = node("Sub", [node("CumSum", [ROW_COUNTS, "zero_i64"], name="row_ends")[0], ROW_COUNTS], name="row_starts")[
        0
    ]
    packed = node("Gather", [node("Shape", ["input_ids"], name="ids_shape")[0], "one_i64"], name="packed_len", axis=0)[
        0
    ]
    last_packed = node("Sub", [packed, "one_i64"], name="last_packed")[0]
    out = []
    for b in range(slots):
        at = init(f"slot{b}", np.array([b], np.int64))
        n = node(
            "Squeeze", [node("Gather", [ROW_COUNTS, at], name=f"count{b}", axis=0)[0], "axis0"], name=f"new_len{b}"
        )[0]
        start = node(
            "Squeeze", [node("Gather", [starts, at], name=f"start{b}", axis=0)[0], "axis0"], name=f"start_s{b}"
        )[0]
        start = node("Min", [start, last_packed], name=f"start_in{b}")[
            0
        ]  # an idle sequence at the end reads row 0.. as dummies
        past = node("Gather", ["past_lengths", at], name=f"past{b}", axis=0)[0]  # [1]
        mask = ""
        if trees:  # its diagonal block of the packed mask (one dummy row when idle)
            lo = node("Unsqueeze", [start, "axis0"], name=f"mask_lo{b}")[0]
            hi = node(
                "Add",
                [
                    lo,
                    node("Unsqueeze", [node("Max", [n, "one_i64"], name=f"n_eff{b}")[0], "axis0"], name=f"n_eff1{b}")[
                        0
                    ],
                ],
                name=f"mask_hi{b}",
            )[0]
            mask = node(
                "Slice",
                [
                    node("Slice", ["tree_mask", lo, hi, "axis1"], name=f"mask_rows{b}")[0],
                    lo,
                    hi,
                    init(f"axis2_{b}", np.array([2], np.int64)),
                ],
                name=f"mask{b}",
            )[0]
        # its rows start + 0..n-1 (start + [0, 0] when idle) stay inside the packed rows: start is clamped above
        out.append(attention_rows(node, n, past, mask, "position_ids" if trees else "", f".s{b}", offset=start))
    return out


def batched_base_model(solo: onnx.ModelProto, slots: int) -> onnx.ModelProto:
    """The batched graph for `slots` sequences from the fused base `solo` (loaded without its external data)."""
    if slots < 2:
        raise CloverError(f"a batched graph needs at least 2 sequence slots, got {slots}")
    g = solo.graph
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention" and n.domain == MS]
    if not gqa:
        raise CloverError(
            "the batched graph is made from a fused base (--attention fused); this base has no GroupQueryAttention node"
        )
    trees = bool(gqa[0].input[10]) if len(gqa[0].input) > 10 else False
    w = GraphWriter()
    nodes, inits = w.nodes, w.inits

    per_slot = slot_attention_rows(w.node, w.init, slots, trees)
    body = _swap_attention(w, g, gqa, per_slot)
    graph_outputs = {o.name for o in g.output}
    body = live_nodes(body, graph_outputs)

    inputs, outputs = _batched_io(g, slots)
    used = {i for n in nodes + body for i in n.input}
    graph = helper.make_graph(
        nodes + body, BATCH_GRAPH, inputs, outputs, [t for t in g.initializer if t.name in used] + inits
    )
    model = helper.make_model(graph, opset_imports=list(solo.opset_import), producer_name="clover-deploy")
    model.ir_version = solo.ir_version
    return capped(model)


def _swap_attention(w: GraphWriter, g: onnx.GraphProto, gqa: list, per_slot: list[AttentionRows]) -> list:
    """The solo graph's nodes in order, each attention block (row Gather, GroupQueryAttention, unpad Slice)
    replaced by its per-slot nodes."""
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    skip: set[int] = set()
    replaced: dict[int, list] = {}
    for att in gqa:
        rows = producer[att.input[0]]  # Gather(qkv, row_index)
        (unpad,) = consumers[att.output[0]]  # Slice(out, 0, new)
        assert rows.op_type == "Gather" and unpad.op_type == "Slice", "unexpected fused attention block"
        skip |= {id(rows), id(unpad)}
        replaced[id(att)] = _slot_attention(w, att, rows.input[0], unpad.output[0], per_slot)
    body = []
    for n in g.node:
        if id(n) in skip:
            continue
        body += replaced.get(id(n), [n])
    return body


def _slot_attention(w: GraphWriter, att, qkv: str, out: str, per_slot: list[AttentionRows]) -> list:
    """One layer's attention per sequence slot, over that slot's rows of `qkv` and its own KV buffer, the
    outputs joined into `out`: the nodes, taken back out of `w` (they go where `att` was, not first)."""
    nodes, node = w.nodes, w.node
    nodes_before = len(nodes)
    outs = []
    for b, sl in enumerate(per_slot):
        q = node("Gather", [qkv, sl.rows], name=f"{att.name}.rows{b}", axis=1)[0]
        o = node(
            "GroupQueryAttention",
            [
                q,
                "",
                "",
                slot_name(att.input[3], b),
                slot_name(att.input[4], b),
                sl.seqlens_k,
                sl.total_len,
                att.input[7],
                att.input[8],
                sl.position_ids,
                sl.bias,
            ],
            [f"{att.name}/out{b}", slot_name(att.output[1], b), slot_name(att.output[2], b)],
            domain=MS,
            name=f"{att.name}{b}",
        )[0]
        nodes[-1].attribute.extend(att.attribute)
        outs.append(node("Slice", [o, "zero_1d", sl.count, "axis1"], name=f"{att.name}.unpad{b}")[0])
    node("Concat", outs, [out], name=f"{att.name}.concat", axis=1)
    block, nodes[nodes_before:] = nodes[nodes_before:], []
    return block


def _batched_io(g: onnx.GraphProto, slots: int) -> tuple[list, list]:
    """The batched graph's inputs and outputs: the packed ones with batch 1, per-slot past lengths and row
    counts, and one KV buffer per layer and slot."""
    kv_in = [i for i in g.input if i.name.startswith(PAST + ".")]
    kv_out = [o for o in g.output if o.name.startswith(PRESENT + ".")]
    kv = lambda t, b: helper.make_tensor_value_info(  # noqa: E731 [1, Hkv, slots_b, D]
        slot_name(t.name, b),
        t.type.tensor_type.elem_type,
        [1, t.type.tensor_type.shape.dim[1].dim_value, f"slots{b}", t.type.tensor_type.shape.dim[3].dim_value],
    )
    packed = {"input_ids", "position_ids", "tree_mask", "hidden_states", "logits", "lm_input"}

    def one_batch(t):
        t = onnx.ValueInfoProto.FromString(t.SerializeToString())
        if t.name in packed:
            t.type.tensor_type.shape.dim[0].ClearField("dim_param")
            t.type.tensor_type.shape.dim[0].dim_value = 1
        return t

    inputs = [one_batch(i) for i in g.input if not i.name.startswith(PAST + ".") and i.name != "past_lengths"]
    inputs += [
        helper.make_tensor_value_info("past_lengths", TensorProto.INT64, [slots]),
        helper.make_tensor_value_info(ROW_COUNTS, TensorProto.INT64, [slots]),
    ]
    inputs += [kv(t, b) for b in range(slots) for t in kv_in]
    outputs = [one_batch(o) for o in g.output if not o.name.startswith(PRESENT + ".")]
    outputs += [kv(t, b) for b in range(slots) for t in kv_out]
    return inputs, outputs


def live_nodes(nodes: list, outputs: set[str]) -> list:
    """The nodes that some graph output depends on, in their order (the solo graph's attention-row nodes drop)."""
    needed, keep = set(outputs), []
    for n in reversed(nodes):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed |= set(n.input)
    return keep[::-1]


def write_batched_base(folder: Path, base_file: str, slots: int) -> Path:
    """Write base_batch.onnx next to the fused base `base_file`, its weights in the base's external data."""
    solo = onnx.load(str(folder / base_file), load_external_data=False)
    path = folder / f"{BATCH_GRAPH}.onnx"
    onnx.save(batched_base_model(solo, slots), str(path))
    return path


def check_batched(folder: Path, manifest, sequences: int = 3, seed: int = 0) -> None:
    """Run a few sequences through the batched graph (joined in one forward) and each through the solo base;
    every logit and hidden state must be bit for bit the same: prompts of different lengths, then a step
    with chains of different lengths, then a plain step."""
    from clover.runtime.backend import Verify
    from clover.runtime.backends.ort import OrtOptions, OrtRunner

    runner = OrtRunner(folder, manifest, use_heads=False, options=OrtOptions(spin=False, checksums=False, batch=True))
    n = min(sequences, runner.batch_slots)
    rng = np.random.default_rng(seed)
    batched = [runner.open_slot(64) for _ in range(n)]
    solo = [runner.open_slot(64) for _ in range(n)]
    steps = [[3 + 4 * i for i in range(n)], [1 + (i % 3) for i in range(n)], [1] * n]
    for lengths in steps:
        tokens = [rng.integers(0, runner.vocab_size, t) for t in lengths]
        verify = [Verify(s, t, np.arange(len(t)), np.tri(len(t), dtype=bool)) for s, t in zip(batched, tokens)]
        got = runner.forward_batch(verify)
        hidden = [s.state.last["hidden_states"] for s in batched]
        for i, (v, g, h) in enumerate(zip(verify, got, hidden)):
            want = runner.forward(v.tokens, v.depths, v.mask, slot=solo[i])
            if not (np.array_equal(g, want) and np.array_equal(h, solo[i].state.last["hidden_states"])):
                raise CloverError(
                    f"the batched base graph differs from the base graph for sequence {i} of {n} (max |diff| "
                    f"{np.abs(g - want).max():.3g}): this is a clover-export bug, please report it; export with "
                    "--max-batch 1 meanwhile"
                )
        for s, t in zip(batched + solo, tokens + tokens):
            runner.commit(np.arange(len(t)), t, slot=s)
    runner.close()
