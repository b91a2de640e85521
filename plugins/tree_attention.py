"""Tree attention: T new tokens (a token tree under verification) attend to the valid KV-cache prefix plus
their own tree ancestors.

The tree mask travels packed, ceil(T/32) int32 words per row (docs/design.md "Trees"), so the same buffer feeds
the PyTorch reference, the Triton kernel, the ONNX node and the TensorRT plugin. This module imports torch
only; the Triton kernel is imported lazily by `tree_attention` when it can run.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

# Bit b of a word has weight 2**b, except bit 31, which two's complement makes -2**31; the weighted sum of
# 32 bits then lies in int32 range and the int64 -> int32 cast is exact.
_BIT_WEIGHTS = [1 << b for b in range(31)] + [-(1 << 31)]


def pack_tree_mask(mask: Tensor) -> Tensor:
    """Packs a boolean tree mask into int32 words, 32 columns per word, LSB first.

    Only pad / reshape / multiply / sum / cast, so the ONNX dynamo exporter keeps T dynamic (W becomes
    (T + 31) // 32). The padded width is written as 32 * W so the symbolic-shape solver sees it divide by 32
    (`-T % 32` makes it specialize T). Plain torch.export also needs backed_size_oblivious=True, as W can be 1.

    Args:
        mask: bool [..., T, T]; mask[..., i, j] says new token i attends to new token j.

    Returns:
        int32 [..., T, W], W = ceil(T / 32): bit (j % 32) of word j // 32 in row i is mask[..., i, j].
    """
    T = mask.shape[-1]
    W = (T + 31) // 32
    bits = F.pad(mask.to(torch.int64), (0, 32 * W - T))  # [..., T, 32 * W]
    bits = bits.reshape(*mask.shape[:-1], W, 32)  # [..., T, W, 32]
    # On CUDA the weights are made once per device: a host-to-device copy cannot run inside CUDA-graph capture.
    weights = (
        _bit_weights(mask.device) if mask.is_cuda else torch.tensor(_BIT_WEIGHTS, dtype=torch.int64, device=mask.device)
    )  # [32]
    return (bits * weights).sum(-1).to(torch.int32)  # [..., T, W]


@functools.cache
def _bit_weights(device: torch.device) -> Tensor:
    return torch.tensor(_BIT_WEIGHTS, dtype=torch.int64, device=device)


def unpack_tree_mask(packed: Tensor, T: int) -> Tensor:
    """Inverse of `pack_tree_mask`: int32 [..., T, W] -> bool [..., T, T]."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)  # [32]
    # The arithmetic shift of a negative word copies bit 31 upwards; `& 1` keeps only the bit asked for.
    bits = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [..., T, W, 32]
    return bits.flatten(-2)[..., :T].bool()  # [..., T, T]


def tree_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    past_k: Tensor,
    past_v: Tensor,
    past_lengths: Tensor,
    packed_mask: Tensor,
    scale: float,
) -> Tensor:
    """Tree attention in plain PyTorch (dense scores, fp32 softmax): the ground truth for the kernel.

    Args:
        q: [B, Hq, T, D] queries of the new tokens.
        k, v: [B, Hkv, T, D] keys / values of the new tokens (RoPE already applied); Hq % Hkv == 0, query
            head h reads kv head h // (Hq // Hkv) (transformers' repeat_kv order).
        past_k, past_v: [B, Hkv, P, D] the cache buffer; only slots j < past_lengths[b] are read.
        past_lengths: int32 or int64 [B] valid cache length per sequence.
        packed_mask: int32 [B, T, ceil(T / 32)] from `pack_tree_mask`; each row must attend to itself.
        scale: softmax scale, usually D ** -0.5.

    Returns:
        [B, Hq, T, D] in q.dtype.
    """
    B, Hq, T, D = q.shape
    Hkv, P = past_k.shape[1], past_k.shape[2]
    group = Hq // Hkv
    past_ok = torch.arange(P, device=q.device) < past_lengths.to(q.device).view(-1, 1)  # [B, P]
    allowed = torch.cat([past_ok.unsqueeze(1).expand(B, T, P), unpack_tree_mask(packed_mask, T)], dim=-1)
    allowed = allowed.unsqueeze(1)  # [B, 1, T, P + T]

    keys = torch.cat([past_k, k], dim=2).float().repeat_interleave(group, dim=1)  # [B, Hq, P + T, D]
    # Unused cache slots may hold anything; zeroing them keeps junk (even inf) out of probs @ values.
    slot_ok = torch.cat([past_ok, past_ok.new_ones(B, T)], dim=-1)  # [B, P + T]
    values = torch.cat([past_v, v], dim=2).float().masked_fill(~slot_ok[:, None, :, None], 0.0)
    values = values.repeat_interleave(group, dim=1)  # [B, Hq, P + T, D]

    scores = torch.matmul(q.float(), keys.transpose(-1, -2)) * scale  # [B, Hq, T, P + T]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).to(q.dtype)  # [B, Hq, T, D]


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def tree_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    past_k: Tensor,
    past_v: Tensor,
    past_lengths: Tensor,
    packed_mask: Tensor,
    scale: float,
) -> Tensor:
    """Tree attention: the Triton kernel for CUDA tensors when triton is installed, else the reference.

    Same arguments and result as `tree_attention_reference`.
    """
    if q.is_cuda and _triton_available():
        from clover.plugins.triton_tree_attention import tree_attention_triton

        return tree_attention_triton(q, k, v, past_k, past_v, past_lengths, packed_mask, scale)
    return tree_attention_reference(q, k, v, past_k, past_v, past_lengths, packed_mask, scale)
