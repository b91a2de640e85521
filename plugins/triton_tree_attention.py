"""Tree attention as one Triton kernel: run from PyTorch, or compiled ahead of time to PTX for the TensorRT
plugin.

Flash-attention style: each program owns BLOCK_M query rows of one (sequence, query head); it streams the
valid cache prefix and then the new tokens in BLOCK_N tiles through an online softmax in fp32. The kernel's
argument list is the ABI the TensorRT plugin launches against, so its order and types are fixed: TensorRT's
AOT plugins pass the input pointers, then the extra scalars, then the output pointers, hence
Q, K, V, PK, PV, LENS (int32), MASK (int32), T (int32), P (int32), OUT, then constexprs.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import triton
import triton.language as tl
from torch import Tensor

from clover.errors import CloverError


@triton.jit
def _dot(a, b):
    # Triton's default for fp32 operands is tf32 on tensor cores (~1e-3 error); fp32 callers asked for fp32.
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc):
    """Folds one tile of base-2 scores s [BLOCK_M, BLOCK_N] (-inf where masked) and values v [BLOCK_N, D]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row can see nothing yet (an all-masked tile before any allowed column): shift by 0 instead of -inf
    # so that p and alpha come out as 0 rather than NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def tree_attention_kernel(
    Q,
    K,
    V,
    PK,
    PV,
    LENS,
    MASK,
    T,
    P,
    OUT,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_M), B * HQ). Q, OUT [B, HQ, T, D]; K, V [B, HKV, T, D]; PK, PV [B, HKV, P, D];
    LENS [B] int32; MASK [B, T, cdiv(T, 32)] int32. All contiguous."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    kv_h = h // (HQ // HKV)  # transformers' repeat_kv order

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, D)  # [D]
    row_ok = offs_m < T

    # int64 bases: B * H * P * D passes 2**31 for long caches.
    q_base = (b * HQ + h).to(tl.int64) * T * D
    new_base = (b * HKV + kv_h).to(tl.int64) * T * D
    past_base = (b * HKV + kv_h).to(tl.int64) * P * D

    q = tl.load(Q + q_base + offs_m[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
    qk_scale = SCALE * 1.4426950408889634  # times log2(e): the softmax runs on exp2

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)

    # 1) The cache prefix: the loop bound is the sequence's length, so tiles past it are never read.
    past_len = tl.load(LENS + b)
    for start in range(0, past_len, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < past_len
        kv_offs = past_base + cols[:, None] * D + offs_d[None, :]
        k = tl.load(PK + kv_offs, mask=col_ok[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(PV + kv_offs, mask=col_ok[:, None], other=0.0)  # [BLOCK_N, D]
        s = _dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc)

    # 2) The new tokens, masked by the packed tree bits: word MASK[b, m, n // 32], bit n % 32.
    W = (T + 31) // 32
    mask_rows = MASK + (b * T + offs_m).to(tl.int64) * W  # [BLOCK_M] pointers to row starts
    for start in range(0, T, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < T
        kv_offs = new_base + cols[:, None] * D + offs_d[None, :]
        k = tl.load(K + kv_offs, mask=col_ok[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(V + kv_offs, mask=col_ok[:, None], other=0.0)  # [BLOCK_N, D]
        words = tl.load(
            mask_rows[:, None] + cols[None, :] // 32, mask=row_ok[:, None] & col_ok[None, :], other=0
        )  # [BLOCK_M, BLOCK_N] int32
        allowed = ((words >> (cols[None, :] % 32)) & 1) != 0
        s = _dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(allowed, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc)

    # Padding rows (offs_m >= T) saw nothing, so l_i == 0 there; they are not stored anyway.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(OUT + q_base + offs_m[:, None] * D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and warps for one head dim; shared by the PyTorch launcher and the AOT compile."""

    block_m: int
    block_n: int
    num_warps: int


def launch_config(head_dim: int, num_new_tokens: int | None = None) -> LaunchConfig:
    """Trees are small (T <= 64 or so), so BLOCK_M stays at 16 (tl.dot's minimum) unless T is larger: more
    programs keep the SMs busy at batch 1. BLOCK_N shrinks for D = 256 to bound registers."""
    block_m = 16 if num_new_tokens is None or num_new_tokens <= 64 else 64
    block_n = 64 if head_dim <= 128 else 32
    return LaunchConfig(block_m=block_m, block_n=block_n, num_warps=4)


def _check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise CloverError(
            f"the Triton tree-attention kernel needs a head dim that is a power of two >= 16 "
            f"(tl.dot tiles and tl.arange), but got {head_dim}; use tree_attention_reference"
        )


def tree_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    past_k: Tensor,
    past_v: Tensor,
    past_lengths: Tensor,
    packed_mask: Tensor,
    scale: float,
) -> Tensor:
    """Runs `tree_attention_kernel`; same arguments and result as `tree_attention_reference`.

    Tensors must be on CUDA, or on the CPU under TRITON_INTERPRET=1 (tests).
    """
    B, Hq, T, D = q.shape
    Hkv, P = past_k.shape[1], past_k.shape[2]
    _check_head_dim(D)
    if (
        Hq % Hkv
        or k.shape != (B, Hkv, T, D)
        or v.shape != k.shape
        or past_v.shape != past_k.shape
        or past_k.shape != (B, Hkv, P, D)
        or past_lengths.shape != (B,)
        or packed_mask.shape != (B, T, (T + 31) // 32)
    ):
        raise CloverError(
            f"tree attention expects q [B, Hq, T, D], k/v [B, Hkv, T, D], past_k/past_v [B, Hkv, P, D], "
            f"past_lengths [B], packed_mask [B, T, ceil(T/32)] with Hq % Hkv == 0; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, past_k {tuple(past_k.shape)}, past_v {tuple(past_v.shape)}, "
            f"past_lengths {tuple(past_lengths.shape)}, packed_mask {tuple(packed_mask.shape)}"
        )
    dtype = q.dtype
    k, v, past_k, past_v = (x.to(dtype).contiguous() for x in (k, v, past_k, past_v))
    q = q.contiguous()
    lens = past_lengths.to(device=q.device, dtype=torch.int32).contiguous()
    mask = packed_mask.to(device=q.device, dtype=torch.int32).contiguous()
    out = torch.empty_like(q)  # [B, Hq, T, D]
    cfg = launch_config(D, T)
    grid = (triton.cdiv(T, cfg.block_m), B * Hq)
    tree_attention_kernel[grid](
        q,
        k,
        v,
        past_k,
        past_v,
        lens,
        mask,
        T,
        P,
        out,
        HQ=Hq,
        HKV=Hkv,
        D=D,
        SCALE=float(scale),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
    )
    return out


@dataclasses.dataclass(frozen=True)
class AotKernel:
    """A tree-attention kernel compiled ahead of time for one (dtype, heads, head dim, scale, GPU arch).

    The PTX entry `kernel_name` takes exactly Q, K, V, PK, PV, LENS, MASK (device pointers), T, P (int32),
    OUT (device pointer): TensorRT's AOT order. Launch it with grid (ceil(T / block_m), B * num_q_heads, 1),
    num_warps * 32 threads per block and shared_mem bytes of dynamic shared memory (above 48 KiB the plugin
    must raise CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES first). The PTX declares ISA AOT_PTX_VERSION.
    """

    kernel_name: str
    ptx: str
    num_warps: int
    shared_mem: int
    block_m: int


# Triton would stamp the PTX with the ISA of its bundled ptxas (9.4 from CUDA 13.4 for sm_90+), which only
# drivers that new can JIT. 8.0 is the lowest ISA for sm_90a and loads on any CUDA 12 driver; the compile's ptxas stage
# proves the code fits it.
AOT_PTX_VERSION = 80

_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}


def compile_for_tensorrt(
    dtype: str, num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float, compute_capability: tuple[int, int]
) -> AotKernel:
    """Compiles `tree_attention_kernel` to PTX for the TensorRT plugin; needs no GPU (Triton bundles ptxas).

    Args:
        dtype: element type of Q, K, V, PK, PV and OUT: "float16", "bfloat16" or "float32" (or fp16/bf16/fp32).
        num_q_heads, num_kv_heads: HQ and HKV, num_q_heads % num_kv_heads == 0.
        head_dim: D, a power of two >= 16.
        scale: softmax scale baked into the kernel.
        compute_capability: the target GPU's (major, minor), e.g. (9, 0) for H100.

    Returns:
        The PTX and the launch parameters the plugin needs.
    """
    if dtype not in _DTYPES:
        raise CloverError(
            f"tree-attention AOT compile: dtype {dtype!r} is not supported; available: {', '.join(_DTYPES)}"
        )
    if num_q_heads % num_kv_heads:
        raise CloverError(
            f"tree attention needs num_q_heads divisible by num_kv_heads, got {num_q_heads} and {num_kv_heads}"
        )
    _check_head_dim(head_dim)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = tree_attention_kernel
    if not isinstance(fn, JITFunction):
        raise CloverError(
            "tree-attention AOT compile: this process imported Triton with TRITON_INTERPRET=1, "
            "which leaves nothing to compile; compile in a process without it"
        )
    ty = "*" + _DTYPES[dtype]
    cfg = launch_config(head_dim)
    signature = {
        "Q": ty,
        "K": ty,
        "V": ty,
        "PK": ty,
        "PV": ty,
        "LENS": "*i32",
        "MASK": "*i32",
        "T": "i32",
        "P": "i32",
        "OUT": ty,
        "HQ": "constexpr",
        "HKV": "constexpr",
        "D": "constexpr",
        "SCALE": "constexpr",
        "BLOCK_M": "constexpr",
        "BLOCK_N": "constexpr",
    }
    constexprs = {
        "HQ": num_q_heads,
        "HKV": num_kv_heads,
        "D": head_dim,
        "SCALE": float(scale),
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
    }
    # 16-byte alignment of every buffer lets Triton vectorize loads; CUDA and TensorRT allocations give it.
    attrs = {
        (fn.arg_names.index(name),): [["tt.divisibility", 16]]
        for name in ("Q", "K", "V", "PK", "PV", "LENS", "MASK", "OUT")
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    major, minor = compute_capability
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", major * 10 + minor, 32),
        options={"num_warps": cfg.num_warps, "ptx_version": AOT_PTX_VERSION},
    )
    name = compiled.metadata.name
    num_args = sum(kind != "constexpr" for kind in signature.values())
    ptx = _drop_scratch_params(compiled.asm["ptx"], name, num_args, compiled.metadata)
    return AotKernel(
        kernel_name=name, ptx=ptx, num_warps=cfg.num_warps, shared_mem=compiled.metadata.shared, block_m=cfg.block_m
    )


def _drop_scratch_params(ptx: str, name: str, num_args: int, metadata) -> str:
    """Removes the global / profile scratch pointers that Triton 3.x appends to every kernel's parameters.

    TensorRT launches an AOT kernel with exactly its tensors and extra scalars, so the extra parameters would
    read past the argument list. This kernel needs no scratch, so they are unused and can go.
    """
    if getattr(metadata, "global_scratch_size", 0) or getattr(metadata, "profile_scratch_size", 0):
        raise CloverError(
            f"the tree-attention kernel now needs Triton scratch memory (global "
            f"{metadata.global_scratch_size} B, profile {metadata.profile_scratch_size} B), which "
            "TensorRT's AOT launch cannot provide (this is a clover bug, please report it)"
        )
    entry = re.search(r"(\.entry\s+" + re.escape(name) + r"\s*\()([^)]*)\)", ptx)
    assert entry is not None, f"no .entry {name} in the PTX"
    params = [p.strip() for p in entry.group(2).split(",")]
    assert len(params) >= num_args, params
    dropped = [p.split()[-1] for p in params[num_args:]]
    assert not any(re.search(re.escape(d) + r"\b", ptx[entry.end() :]) for d in dropped), (
        f"the kernel body reads Triton's scratch parameters {dropped}"
    )
    kept = ",\n\t".join(params[:num_args])
    return ptx[: entry.start()] + entry.group(1) + "\n\t" + kept + "\n)" + ptx[entry.end() :]
