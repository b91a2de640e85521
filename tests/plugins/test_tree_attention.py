"""Tree attention: mask packing, the PyTorch reference against a plain dense-mask SDPA, and the Triton kernel
(CPU interpreter here, CUDA when present) against the reference."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors run the interpreter

from numerics import assert_close_paths

from clover.plugins.tree_attention import pack_tree_mask, tree_attention, tree_attention_reference, unpack_tree_mask

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cpu" if INTERPRET else "cuda" if torch.cuda.is_available() else None
# (atol, rtol) vs the fp32 truth; bf16 keeps 8 significant bits, so one rounding of an output near 3 is 1.6e-2.


def random_tree_mask(T: int, gen: torch.Generator) -> torch.Tensor:
    """bool [T, T]: self + ancestors of a random forest whose parents come before their children."""
    mask = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):
        parent = int(torch.randint(-1, i, (), generator=gen))  # -1: a new root, so some rows skip early tiles
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def make_case(B, Hq, Hkv, T, P, lengths, D, dtype, seed=0):
    """Random inputs; cache slots at or past each sequence's length hold large junk that must be ignored."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v = rnd(B, Hq, T, D), rnd(B, Hkv, T, D), rnd(B, Hkv, T, D)
    past_k, past_v = rnd(B, Hkv, P, D), rnd(B, Hkv, P, D)  # [B, Hkv, P, D]
    lens = torch.tensor(lengths, dtype=torch.int64)
    junk = torch.arange(P) >= lens[:, None]  # [B, P]
    past_k[junk.view(B, 1, P, 1).expand_as(past_k)] = 3e3
    past_v[junk.view(B, 1, P, 1).expand_as(past_v)] = -5e3
    mask = torch.stack([random_tree_mask(T, gen) for _ in range(B)])  # [B, T, T]
    cast = lambda x: x.to(dtype)  # noqa: E731
    return dict(
        q=cast(q),
        k=cast(k),
        v=cast(v),
        past_k=cast(past_k),
        past_v=cast(past_v),
        past_lengths=lens,
        packed_mask=pack_tree_mask(mask),
        scale=D**-0.5,
    ), mask


def dense_truth(case, mask):
    """Per sequence: fp32 SDPA over concat(valid past, new) with the boolean tree mask; GQA by repeat."""
    q, k, v = (case[n].float() for n in ("q", "k", "v"))
    pk, pv = case["past_k"].float(), case["past_v"].float()
    group = q.shape[1] // k.shape[1]
    outs = []
    for b, L in enumerate(case["past_lengths"].tolist()):
        keys = torch.cat([pk[b, :, :L], k[b]], dim=1).repeat_interleave(group, dim=0)  # [Hq, L + T, D]
        values = torch.cat([pv[b, :, :L], v[b]], dim=1).repeat_interleave(group, dim=0)
        allowed = torch.cat([torch.ones(q.shape[2], L, dtype=torch.bool), mask[b]], dim=1)  # [T, L + T]
        outs.append(F.scaled_dot_product_attention(q[b], keys, values, attn_mask=allowed, scale=case["scale"]))
    return torch.stack(outs)  # [B, Hq, T, D]


def assert_close(out, expected, case):
    """Two tree-attention paths (numerics.py): fp32 ones sum D score terms and P + T weighted values; fp16 / bf16
    ones accumulate in fp32 too (kernel and reference) or in the dtype itself (SDPA on the CPU), so they differ by
    roundings in the dtype over those sums."""
    T, D, P = case["q"].shape[2], case["q"].shape[3], case["past_k"].shape[2]
    assert_close_paths(out.float().cpu(), expected.float().cpu(), reduction=D + P + T, dtype=out.dtype)


# (B, Hq, Hkv, T, P, lengths, D)
CASES = {
    "gqa": (2, 4, 2, 5, 40, [17, 33], 16),
    "mha": (2, 2, 2, 7, 24, [24, 3], 32),
    "no_past": (1, 4, 2, 6, 8, [0], 16),
    "one_token": (2, 4, 1, 1, 70, [69, 5], 16),
    "many_tiles": (2, 4, 2, 70, 150, [0, 130], 16),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---- packing ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 5, 31, 32, 33, 64, 70])
def test_pack_unpack_round_trip(T):
    gen = torch.Generator().manual_seed(T)
    mask = torch.rand(3, T, T, generator=gen) < 0.5
    packed = pack_tree_mask(mask)
    assert packed.dtype == torch.int32 and packed.shape == (3, T, (T + 31) // 32)
    assert torch.equal(unpack_tree_mask(packed, T), mask)
    # bit j % 32 of word j // 32, LSB first, by hand
    i, j = T // 2, T - 1
    assert bool((int(packed[0, i, j // 32]) >> (j % 32)) & 1) == bool(mask[0, i, j])


def test_pack_bit_31_is_the_int32_sign_bit():
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0, 31] = True
    mask[1, :32] = True
    mask[1, 32] = True
    packed = pack_tree_mask(mask)
    assert packed.tolist() == [[-(2**31), 0], [-1, 1]]
    assert torch.equal(unpack_tree_mask(packed, 40), mask)


def _pack_module():
    class Pack(torch.nn.Module):
        def forward(self, mask):
            return pack_tree_mask(mask)

    return Pack().eval()


def test_pack_exports_with_dynamic_T():
    # W = ceil(T/32) can be 1, and plain torch.export guards every size it checks against 1, which would
    # specialize T to one side of 32; backed_size_oblivious (what the ONNX exporter relies on) avoids that.
    import torch.fx.experimental._config as fx_config

    T = torch.export.Dim("T", min=2, max=1024)
    with fx_config.patch(backed_size_oblivious=True):
        ep = torch.export.export(
            _pack_module(), (torch.ones(1, 20, 20, dtype=torch.bool),), dynamic_shapes={"mask": {1: T, 2: T}}
        )
    for n in (2, 32, 33, 70):
        mask = torch.rand(1, n, n) < 0.5
        assert torch.equal(ep.module()(mask), pack_tree_mask(mask))


def test_pack_exports_to_onnx_with_dynamic_T():
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    prog = torch.onnx.export(
        _pack_module(),
        (torch.ones(1, 20, 20, dtype=torch.bool),),
        dynamo=True,
        dynamic_shapes={"mask": {1: "T", 2: "T"}},
        verbose=False,
    )
    sess = ort.InferenceSession(prog.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in (2, 32, 33, 70):
        mask = torch.rand(1, n, n) < 0.5
        (out,) = sess.run(None, {sess.get_inputs()[0].name: mask.numpy()})
        assert (out == pack_tree_mask(mask).numpy()).all()


# ---- reference ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES) + ["long_tree"])
def test_reference_matches_dense_sdpa(name, dtype):
    spec = CASES.get(name, (2, 4, 2, 64, 100, [50, 99], 32))
    case, mask = make_case(*spec, dtype)
    out = tree_attention_reference(**case)
    assert out.dtype == dtype and out.shape == case["q"].shape
    assert_close(out, dense_truth(case, mask), case)


def test_reference_ignores_nonfinite_junk_and_int32_lengths():
    case, mask = make_case(2, 4, 2, 5, 40, [17, 33], 16, torch.float32)
    truth = dense_truth(case, mask)
    case["past_k"][0, :, 17:] = float("nan")
    case["past_v"][1, :, 33:] = float("inf")
    case["past_lengths"] = case["past_lengths"].to(torch.int32)
    assert_close(tree_attention_reference(**case), truth, case)


def test_dispatch_on_cpu_is_the_reference():
    case, _ = make_case(*CASES["gqa"], torch.float32)
    assert torch.equal(tree_attention(**case), tree_attention_reference(**case))


# ---- Triton kernel --------------------------------------------------------------------------------------


@pytest.fixture
def interpreter_bf16_dot(monkeypatch):
    """Triton 3.9's interpreter keeps bf16 as raw uint16 bits and its tl.dot multiplies those bits; widen bf16
    operands to fp32 first (exact, like the GPU's bf16 MMA with fp32 accumulation)."""
    if not INTERPRET:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(x):
        if x.dtype != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    monkeypatch.setattr(
        interpreter.InterpreterBuilder,
        "create_dot",
        lambda self, a, b, *args: create_dot(self, widen(a), widen(b), *args),
    )


def on(case, device):
    return {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in case.items()}


@pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_matches_reference(name, dtype, interpreter_bf16_dot):
    from clover.plugins.triton_tree_attention import tree_attention_triton

    case, mask = make_case(*CASES[name], dtype)
    out = tree_attention_triton(**on(case, KERNEL_DEVICE)).cpu()
    assert out.dtype == dtype and out.shape == case["q"].shape
    assert_close(out, tree_attention_reference(**case), case)
    assert_close(out, dense_truth(case, mask), case)


def test_triton_rejects_head_dim_that_is_not_a_power_of_two():
    from clover.errors import CloverError
    from clover.plugins.triton_tree_attention import tree_attention_triton

    case, _ = make_case(1, 2, 2, 3, 8, [4], 24, torch.float32)
    with pytest.raises(CloverError, match="power of two >= 16.*got 24"):
        tree_attention_triton(**case)


AOT_SCRIPT = r"""
import re, subprocess, sys
from triton.backends.nvidia.compiler import get_ptxas
from clover.plugins.triton_tree_attention import compile_for_tensorrt

for dtype, (major, minor), d in [("float16", (9, 0), 64), ("bfloat16", (8, 0), 128)]:
    a = compile_for_tensorrt(dtype, 32, 8, d, d ** -0.5, (major, minor))
    params = re.search(r"\.entry " + a.kernel_name + r"\(([^)]*)\)", a.ptx).group(1).split(",")
    kinds = [p.split()[1] for p in params]
    # Q K V PK PV LENS MASK (pointers), T P (int32), OUT (pointer): TensorRT's AOT argument order
    assert kinds == [".u64"] * 7 + [".u32"] * 2 + [".u64"], kinds
    assert ".version 8.0" in a.ptx and f".target sm_{major}{minor}" in a.ptx
    assert a.num_warps == 4 and a.block_m == 16 and a.shared_mem > 0
    arch = major * 10 + minor
    path = f"{sys.argv[1]}/{a.kernel_name}_{arch}.ptx"
    open(path, "w").write(a.ptx)
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    subprocess.run([get_ptxas(arch).path, f"--gpu-name={gpu}", path, "-o", path + ".cubin"], check=True)
print("ok")
"""


def test_aot_compile_to_ptx_without_a_gpu(tmp_path):
    # Its own process: AOT compiling needs the real @triton.jit, which TRITON_INTERPRET=1 replaces here.
    # Triton bundles ptxas, so the final PTX (scratch params stripped) is assembled too, as TensorRT will.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's warning; fusion on is its default
    proc = subprocess.run(
        [sys.executable, "-c", AOT_SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA device without TRITON_INTERPRET")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("D", [64, 128])
def test_triton_on_cuda_matches_reference(dtype, D):
    case, mask = make_case(2, 32, 8, 26, 2048, [1900, 37], D, dtype)
    case = on(case, "cuda")
    out = tree_attention(**case)
    assert_close(out, tree_attention_reference(**case), case)
