"""One LM head for the base and the draft graphs (`lm_head.onnx`), in memory once.

The heads draft through the base's own LM head (V x H, the largest weight of a small model: SmolLM2's is
113 MB in fp32, 16 MB in int4). Exported as they are, the base and each draft graph carry a copy, and
ONNX Runtime keeps one per session (plus a prepacked copy each: its Python API cannot share prepacked
weights across sessions). So after the graphs are exported, quantized and checked, the LM-head node is
cut out of every graph that uses the base's weights: such a graph outputs `lm_input` (the rows the LM
head would multiply, [..., H]) instead of `logits`, and `lm_head.onnx` (lm_input [n, H] -> logits [n, V])
holds the one copy, run by the runtime after each of them.

The cut moves the base's own node (same op, same weights, same attributes: for int4 its accuracy level)
into lm_head.onnx, and MatMul / MatMulNBits compute each row alike whatever the row count, so the base's
logits stay bit for bit what they were: `split_lm_head` checks exactly that, for the drafts too, unless a
draft graph ran its LM head at another accuracy level than the base (int4 portable graphs: int8 activations
for drafting, fp32 for the base); it now runs the base's, which only changes what is proposed.

A quantized base (--weights int4 / int8) keeps its own copy as well (`keep_base`): a separate lm_head.onnx session
costs every verify step a second ONNX Runtime call, ~0.2 ms of a ~4 ms int4 step (5% more tokens/s for plain
decoding, 3-4% for prompt lookup, measured side by side on SmolLM2 int4), for 16-30 MB more; a float32 base's copy
would be 113 MB for ~1.5% of its ~13 ms step, and is cut.

Not cut: a draft graph whose LM head differs from the base's (Medusa's own LM heads), float16 graphs (see
export/artifact.py), and TensorRT artifacts (one engine per graph). --draft-quant quantizes the draft graphs
but not the LM head they share: it is cut like any other, and the drafts then run their own quantized copy of
it, draft_lm_head.onnx (export/draft_vocab.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from clover.artifact import GraphSpec
from clover.errors import CloverError
from clover.export.graphs import GraphDef, Sizes
from clover.export.quantize import replace_graph

LM_HEAD = "lm_head"  # manifest key and file stem
LM_INPUT = "lm_input"  # what a cut graph outputs instead of logits
MATMULS = ("MatMul", "MatMulNBits")
# Ops that only move or stack the LM head's output on its way to `logits` (Medusa stacks one per head):
# they work on [..., H] rows as they did on [..., V] ones. Anything else (a bias, a dequantizing Mul) is
# not a plain LM head, and the graph keeps its own.
PASS_THROUGH = {"Identity": (0,), "Unsqueeze": (0,), "Squeeze": (0,), "Expand": (0,), "Concat": None}
# A draft graph whose MatMulNBits computed at another accuracy level than the base's (int8 activations) now
# gets the base's: its logits move by the rounding of int8 activations (SmolLM2-sized tests: 0.5% of the max).
DRAFT_RTOL = 2e-2


def lm_head_nodes(model) -> list | None:
    """The LM-head matmuls that feed the `logits` output through pass-through ops only, or None."""
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name for i in model.graph.initializer}
    found, todo, seen = [], ["logits"], set()
    while todo:
        node = producer.get(todo.pop())
        if node is None or id(node) in seen:
            return None  # a graph input or a shared tensor: not a plain LM head
        seen.add(id(node))
        if node.op_type in MATMULS and node.domain in ("", "com.microsoft"):
            weight = node.input[1]
            via = producer.get(weight)
            if weight not in inits and not (via is not None and via.op_type == "Transpose" and via.input[0] in inits):
                return None  # a matmul of two activations
            found.append(node)
        elif node.op_type in PASS_THROUGH and node.domain == "":
            which = PASS_THROUGH[node.op_type]
            todo.extend(node.input[i] for i in (which if which is not None else range(len(node.input))))
        else:
            return None
    return found or None


def _weights(model, node) -> list[np.ndarray]:
    """The node's weight tensors as the matmul sees them (a Transpose of an initializer folded)."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    out = []
    for name in node.input[1:]:
        if name in inits:
            out.append(numpy_helper.to_array(inits[name]))
        elif name and producer.get(name) is not None and producer[name].op_type == "Transpose":
            t = producer[name]
            perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), None)
            out.append(np.ascontiguousarray(np.transpose(numpy_helper.to_array(inits[t.input[0]]), perm)))
        else:
            out.append(np.zeros(0))  # an omitted optional input
    return out


def weights_key(model, node) -> str:
    """A digest of what the LM head computes with: its op, matmul shape attributes and weight bytes (not its
    accuracy level: a draft's level only changes what is proposed)."""
    h = hashlib.sha256(node.op_type.encode())
    for a in node.attribute:
        if a.name in ("K", "N", "bits", "block_size"):
            h.update(f"{a.name}={a.i}".encode())
    for w in _weights(model, node):
        h.update(str(w.dtype).encode() + str(w.shape).encode() + w.tobytes())
    return h.hexdigest()


def lm_head_model(model, node, hidden: int):
    """lm_head.onnx: lm_input [n, H] -> logits [n, V] through a copy of `node` (its weights as initializers)."""
    from onnx import helper, numpy_helper

    names = [f"{LM_HEAD}.{i}" if name else "" for i, name in enumerate(node.input[1:], 1)]
    weights = [numpy_helper.from_array(w, n) for w, n in zip(_weights(model, node), names) if n]
    copy = helper.make_node(node.op_type, [LM_INPUT, *names], ["logits"], name=LM_HEAD, domain=node.domain)
    copy.attribute.extend(node.attribute)
    out = next(o for o in model.graph.output if o.name == "logits")
    elem = out.type.tensor_type.elem_type
    vocab = out.type.tensor_type.shape.dim[-1].dim_value
    graph = helper.make_graph(
        [copy],
        LM_HEAD,
        [helper.make_tensor_value_info(LM_INPUT, elem, ["n", hidden])],
        [helper.make_tensor_value_info("logits", elem, ["n", vocab])],
        weights,
    )
    lm = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name="clover-deploy")
    lm.ir_version = model.ir_version
    return lm


def cut_lm_head(model, nodes, hidden: int) -> None:
    """Replace each LM-head matmul by an Identity of its input and rename the `logits` output `lm_input`
    ([..., V] -> [..., H]); drop initializers nothing reads any more."""
    from onnx import helper

    g = model.graph
    for node in nodes:
        i = list(g.node).index(node)
        g.node.remove(node)
        g.node.insert(i, helper.make_node("Identity", [node.input[0]], list(node.output), name=node.name))
    for n in g.node:
        n.output[:] = [LM_INPUT if o == "logits" else o for o in n.output]
    out = next(o for o in g.output if o.name == "logits")
    out.name = LM_INPUT
    out.type.tensor_type.shape.dim[-1].dim_value = hidden
    # Shapes inferred along the cut path still say V: let shape inference recompute them.
    moved = {o for n in g.node if n.op_type in ("Identity", *PASS_THROUGH) for o in n.output}
    kept = [v for v in g.value_info if v.name not in moved]
    del g.value_info[:]
    g.value_info.extend(kept)
    outputs = {o.name for o in g.output}
    used = {i for n in g.node for i in n.input} | outputs
    for n in [n for n in g.node if n.op_type == "Transpose" and not any(o in used for o in n.output)]:
        g.node.remove(n)  # a Transpose that fed only the LM head
    used = {i for n in g.node for i in n.input} | outputs
    for t in [t for t in g.initializer if t.name not in used]:
        g.initializer.remove(t)


def lm_head_key(path: Path) -> str | None:
    """weights_key of the one plain LM head of the graph at `path` (the base's), or None."""
    import onnx

    model = onnx.load(str(path))
    nodes = lm_head_nodes(model)
    return weights_key(model, nodes[0]) if nodes is not None and len(nodes) == 1 else None


def lm_head_names(model, key: str | None) -> tuple[str, ...]:
    """Names of the LM-head matmuls of `model` that compute with the weights `key` names: what split_lm_head
    will cut out (--draft-quant leaves them unquantized for that)."""
    nodes = lm_head_nodes(model) if key is not None else None
    if not nodes or any(not n.name or weights_key(model, n) != key for n in nodes):
        return ()
    return tuple(n.name for n in nodes)


def save_model(model, path: Path) -> None:
    """Write `model` to `path` with its weights in `<name>.data`, replacing any old files whole; its IR version
    capped (clover.onnx_ir)."""
    import onnx

    from clover.onnx_ir import capped

    replace_graph(
        path,
        lambda out: onnx.save(
            capped(model),
            str(out),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=f"{path.name}.data",
            size_threshold=1024,
        ),
    )


def split_lm_head(
    folder: Path,
    specs: dict[str, GraphSpec],
    graphs: list[GraphDef],
    sizes: Sizes,
    verify: bool = True,
    keep_base: bool = False,
) -> dict[str, GraphSpec]:
    """Cut the base's LM head out of the base and of every draft graph that shares its weights, into
    folder/lm_head.onnx; returns the updated specs (with "lm_head"), or `specs` unchanged when no draft
    graph shares it. keep_base: the base keeps its own copy (only the draft graphs are cut). verify: the cut
    graphs + lm_head.onnx give the logits of the whole graphs."""
    import onnx

    from clover.export.onnx_graph import check_onnx, graph_spec

    models = {g.name: onnx.load(str(folder / specs[g.name].file)) for g in graphs}
    heads = {name: lm_head_nodes(m) for name, m in models.items()}
    if heads.get("base") is None or len(heads["base"]) != 1:
        return specs
    base_node = heads["base"][0]
    key = weights_key(models["base"], base_node)
    cut = ["base"] + [
        n
        for n, nodes in heads.items()
        if n != "base" and nodes and all(weights_key(models[n], x) == key for x in nodes)
    ]
    if len(cut) == 1:
        return specs  # no draft graph shares the base's LM head: splitting would only add a call per step
    if keep_base:
        cut.remove("base")
    hidden = int(specs["base"].output("hidden_states").shape[-1])
    before = _logits_of(folder, specs, graphs, cut, sizes) if verify else None
    save_model(lm_head_model(models["base"], base_node, hidden), folder / f"{LM_HEAD}.onnx")
    check_onnx(folder / f"{LM_HEAD}.onnx")
    out = dict(specs)
    out[LM_HEAD] = graph_spec(folder / f"{LM_HEAD}.onnx")
    for name in cut:
        cut_lm_head(models[name], heads[name], hidden)
        save_model(models[name], folder / specs[name].file)
        check_onnx(folder / specs[name].file)
        out[name] = graph_spec(folder / specs[name].file)
    if before is not None:
        after = _logits_of(folder, out, graphs, cut, sizes)
        for name in cut:
            a, b = before[name], after[name]
            # The base's logit rows meet the head in the same product before and after the cut: bit for bit. A draft
            # graph's heads may each have run a 1-row product of their own, which some kernels round otherwise
            # (MatMulNBits on AVX2): within the drafts' tolerance.
            exact = name == "base"
            if a.shape != b.shape or (
                not np.array_equal(a, b)
                if exact
                else not np.abs(a - b).max() <= DRAFT_RTOL * max(1.0, float(np.abs(a).max()))
            ):
                raise CloverError(
                    f"{name}.onnx without its LM head + lm_head.onnx does not give the graph's own "
                    "logits: this is a clover-export bug, please report it"
                )
    return out


def _logits_of(
    folder: Path, specs: dict[str, GraphSpec], graphs: list[GraphDef], names: list[str], sizes: Sizes
) -> dict[str, np.ndarray]:
    """Each graph's logits on its example inputs: its own output, or lm_input through lm_head.onnx."""
    import torch

    from clover.export.onnx_graph import checking_session, run_checked

    lm = checking_session(folder / specs[LM_HEAD].file) if LM_HEAD in specs else None
    got = {}
    for graph in graphs:
        if graph.name not in names:
            continue
        inputs = graph.example(sizes, torch.Generator().manual_seed(0))
        session = checking_session(folder / specs[graph.name].file)
        feeds = {n: t.numpy() for n, t in zip(graph.inputs, inputs) if n in {i.name for i in session.get_inputs()}}
        if lm is None or not specs[graph.name].has_output(LM_INPUT):
            got[graph.name] = run_checked(session, ["logits"], feeds)[0]
            continue
        x = run_checked(session, [LM_INPUT], feeds)[0]
        logits = lm.run(["logits"], {LM_INPUT: x.reshape(-1, x.shape[-1])})[0]
        got[graph.name] = logits.reshape(*x.shape[:-1], logits.shape[-1])
    return got
