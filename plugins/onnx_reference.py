"""`clover::CloverTreeAttention` written as an ONNX function of standard ops.

Attached to a `plugin`-variant graph (`with_reference_function`), it lets ONNX Runtime (which inlines
model-local functions) run that graph: the export checks the plugin graph numerically against PyTorch
this way, and the tests compare it with the `portable` graph. TensorRT ignores it and uses the plugin.
Masked (invalid) cache slots get probability 0; like the portable graph, this assumes they hold finite
values (the runtimes zero-initialise their caches).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from clover.plugins.onnx_node import DOMAIN, INPUTS, OP_TYPE


def _const(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(values)], values)
    )


def reference_function(opset: int) -> onnx.FunctionProto:
    """The op as an ONNX function (inputs and attributes as in clover.plugins.onnx_node), importing the
    default-domain `opset` of the model it joins (the checker wants them equal); needs 18 or newer."""
    nodes = _constants() + _scores() + _past_mask() + _tree_mask() + _attend()
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        list(INPUTS),
        ["out"],
        nodes,
        [helper.make_opsetid("", opset)],
        attributes=["scale", "plugin_namespace", "plugin_version"],
    )


def _constants() -> list[onnx.NodeProto]:
    """The shared int64 constants and `scale`, read from the function's attribute of that name."""
    scale = helper.make_node("Constant", [], ["scale"])
    scale.attribute.append(
        onnx.AttributeProto(name="value_float", ref_attr_name="scale", type=onnx.AttributeProto.FLOAT)
    )
    return [
        _const("c0", [0]),
        _const("c1", [1]),
        _const("c2", [2]),
        _const("c3", [3]),
        _const("cm1", [-1]),
        _const("two32", [1 << 32]),
        _const("two", [2]),
        scale,
    ]


def _scores() -> list[onnx.NodeProto]:
    """The dims, and the scaled float32 scores of q against cache and new keys, per kv-head group."""
    n = helper.make_node
    return [
        # dims: B, Hq, T, D from q; Hkv, P from past_k
        n("Shape", ["q"], ["q_shape"]),
        n("Shape", ["past_k"], ["pk_shape"]),
        n("Gather", ["q_shape", "c0"], ["B"]),
        n("Gather", ["q_shape", "c1"], ["Hq"]),
        n("Gather", ["q_shape", "c2"], ["T"]),
        n("Gather", ["q_shape", "c3"], ["D"]),
        n("Gather", ["pk_shape", "c1"], ["Hkv"]),
        n("Gather", ["pk_shape", "c2"], ["P"]),
        # GQA: q [B, Hq, T, D] -> [B, Hkv, G, T, D]; keys/values [B, Hkv, 1, P + T, D]
        n("Concat", ["B", "Hkv", "cm1", "T", "D"], ["q5_shape"], axis=0),
        n("Reshape", ["q", "q5_shape"], ["q5"]),
        n("Concat", ["past_k", "k"], ["keys"], axis=2),
        n("Concat", ["past_v", "v"], ["values"], axis=2),
        n("Unsqueeze", ["keys", "c2"], ["keys5"]),
        n("Unsqueeze", ["values", "c2"], ["values5"]),
        n("Cast", ["q5"], ["q5f"], to=TensorProto.FLOAT),
        n("Cast", ["keys5"], ["keys5f"], to=TensorProto.FLOAT),
        n("Cast", ["values5"], ["values5f"], to=TensorProto.FLOAT),
        n("Transpose", ["keys5f"], ["keys5t"], perm=[0, 1, 2, 4, 3]),
        n("MatMul", ["q5f", "keys5t"], ["raw_scores"]),
        n("Mul", ["raw_scores", "scale"], ["scores"]),  # [B, Hkv, G, T, P+T]
    ]


def _past_mask() -> list[onnx.NodeProto]:
    """The cache part of the mask: slot j < past_lengths[b] -> [B, T, P]."""
    n = helper.make_node
    return [
        n("Squeeze", ["P", "c0"], ["P0"]),
        n("Squeeze", ["c0"], ["c0_s"]),
        n("Squeeze", ["c1"], ["c1_s"]),
        n("Range", ["c0_s", "P0", "c1_s"], ["slots"]),
        n("Cast", ["past_lengths"], ["lengths64"], to=TensorProto.INT64),
        n("Unsqueeze", ["lengths64", "c1"], ["lengths_col"]),
        n("Less", ["slots", "lengths_col"], ["past_ok"]),  # [B, P]
        n("Unsqueeze", ["past_ok", "c1"], ["past_ok3"]),
        n("Concat", ["B", "T", "P"], ["btp"], axis=0),
        n("Expand", ["past_ok3", "btp"], ["past_mask"]),
    ]


def _tree_mask() -> list[onnx.NodeProto]:
    """The tree part of the mask: bits of the packed int32 words (bit 31 is the sign) -> [B, T, T]."""
    n = helper.make_node
    return [
        n("Cast", ["packed_mask"], ["words"], to=TensorProto.INT64),
        n("Less", ["words", "c0"], ["negative"]),
        n("Add", ["words", "two32"], ["words_u"]),
        n("Where", ["negative", "words_u", "words"], ["unsigned"]),
        n("Unsqueeze", ["unsigned", "cm1"], ["unsigned4"]),
        _const("powers", [1 << b for b in range(32)]),
        n("Div", ["unsigned4", "powers"], ["shifted"]),
        n("Mod", ["shifted", "two"], ["bits"]),  # [B, T, W, 32]
        n("Concat", ["B", "T", "cm1"], ["bt_flat"], axis=0),
        n("Reshape", ["bits", "bt_flat"], ["bits_flat"]),
        n("Slice", ["bits_flat", "c0", "T", "cm1"], ["tree_bits"]),
        n("Cast", ["tree_bits"], ["tree_mask"], to=TensorProto.BOOL),
    ]


def _attend() -> list[onnx.NodeProto]:
    """The masked softmax over both parts, applied to the values and cast back to q's shape and dtype."""
    n = helper.make_node
    return [
        n("Concat", ["past_mask", "tree_mask"], ["mask"], axis=-1),  # [B, T, P + T]
        _const("axes12", [1, 2]),
        n("Unsqueeze", ["mask", "axes12"], ["mask5"]),
        n("Constant", [], ["neg_inf"], value=helper.make_tensor("neg_inf", TensorProto.FLOAT, [], [float("-inf")])),
        n("Where", ["mask5", "scores", "neg_inf"], ["masked"]),
        n("Softmax", ["masked"], ["probs"], axis=-1),
        n("MatMul", ["probs", "values5f"], ["out5"]),  # [B, Hkv, G, T, D]
        n("Shape", ["q"], ["out_shape"]),
        n("Reshape", ["out5", "out_shape"], ["out_f"]),
        n("CastLike", ["out_f", "q"], ["out"]),
    ]


def with_reference_function(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (a plugin-variant graph, modified in place and returned) made runnable by ONNX Runtime."""
    if not any(f.domain == DOMAIN and f.name == OP_TYPE for f in model.functions):
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        model.functions.append(reference_function(opset))
    return model
