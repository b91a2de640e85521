"""The tree-attention op as one custom ONNX node, for the `plugin` attention variant of the export.

Under `torch.onnx.export(dynamo=True)` the op is emitted with `torch.onnx.ops.symbolic` as a single
node that TensorRT's ONNX parser hands to the plugin registered in `clover.plugins.trt_plugin`;
in eager PyTorch it computes (Triton on CUDA, the torch reference elsewhere), so a module using it
runs, and is tested, like any other.

Node contract (the TensorRT plugin and `reference_function` implement exactly this):
    domain `clover`, op_type `CloverTreeAttention` (not `Attention`: that name is a standard op in
    opset 23 and parsers would claim it), attributes plugin_namespace="clover", plugin_version="1",
    scale (float).
    inputs   q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, D] (RoPE applied),
             past_k [B, Hkv, P, D], past_v [B, Hkv, P, D] (slots >= past_lengths[b] ignored),
             past_lengths [B] int32, packed_mask [B, T, ceil(T/32)] int32 (bit j%32 of word j//32 of
             row i: new token i attends to new token j)
    output   [B, Hq, T, D], the dtype of q
"""

from __future__ import annotations

import torch

DOMAIN = "clover"
OP_TYPE = "CloverTreeAttention"
PLUGIN_NAMESPACE = "clover"
PLUGIN_VERSION = "1"
INPUTS = ("q", "k", "v", "past_k", "past_v", "past_lengths", "packed_mask")


def tree_attention_node(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    past_lengths: torch.Tensor,
    packed_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[B, Hq, T, D]: one `clover::CloverTreeAttention` node under ONNX export, the op itself otherwise."""
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic(
            f"{DOMAIN}::{OP_TYPE}",
            (q, k, v, past_k, past_v, past_lengths, packed_mask),
            {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION, "scale": float(scale)},
            dtype=q.dtype,
            shape=q.shape,
            version=1,
        )
    from clover.plugins.tree_attention import tree_attention

    return tree_attention(q, k, v, past_k, past_v, past_lengths, packed_mask, scale)
