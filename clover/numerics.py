"""How close two computations of the same float values must be: the project's one tolerance policy, used by the
tests (tests/numerics.py adds torch conveniences) and by clover-doctor's probes (tools/ cannot import tests/).

Two code paths that compute the same values (one row or six through a matmul, a cache filled in one call or in
chunks, ONNX Runtime against PyTorch, a GPU against numpy) run different kernels: oneDNN, MKL and ONNX Runtime's
MLAS pick theirs per CPU (AMX, AVX-512, AVX2) and per row count, cuBLAS per GPU and shape, and each blocks its sums
its own way. Each path rounds every partial sum once, so two orders of a K-term sum differ by a random walk of
roundings: about eps * sqrt(K) * the terms' size. The allowed difference is therefore

    atol = k * eps(dtype) * sqrt(reduction) * magnitude

with eps the machine epsilon of the dtype the paths computed in (float32: 1.19e-7), `reduction` the longest
chain of terms summed into one value (a matmul's inner dimension; for L layers of them, their sum: a chain of L
reductions of length K drifts like one of L * K), `magnitude` the largest value compared (max |want|, at least 1: the
terms of a sum of values below 1 are not smaller than rounding at 1), and k = 8 (K_PATHS): the random walk's spread
at a few standard deviations, with room for the kernels' different blockings, and still 1e4-1e5 times smaller than
any real bug (a wrong mask or position moves values by O(magnitude)). A comparison against a value rounded once to
a storage dtype (fp16 features on disk) uses that dtype's eps with reduction 1.

A float32 matmul on an NVIDIA GPU may compute in TF32 (Ampere and newer: cuBLAS tensor cores with the inputs rounded
to a 10-bit mantissa; ONNX Runtime's CUDA provider allows it unless its `use_tf32` option is off, torch when
`allow_tf32` is on), so a GPU's float32 matmul is compared with TF32's eps (GPU_FP32_MATMUL): exact float32 rounding
would reject a healthy GPU, while a real bug still moves values by their own size.

Bit equality only where the code guarantees the same kernel on the same rows: greedy tokens (the lossless identity
tests), or one call made twice. numpy only: no torch import (dtypes may be given as torch dtypes all the same).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

K_PATHS = 8.0  # the formula's k (module doc)
EPS: dict[str, float] = {
    "float64": float(np.finfo(np.float64).eps),
    "float32": float(np.finfo(np.float32).eps),
    "tfloat32": 2.0**-10,  # TF32: float32's range, a 10-bit mantissa
    "float16": float(np.finfo(np.float16).eps),
    "bfloat16": 2.0**-7,
}
GPU_FP32_MATMUL = "tfloat32"  # what a float32 matmul on a CUDA GPU may compute in (module doc)


def dtype_name(dtype: Any) -> str:
    """'float32', 'bfloat16', ... for a name, a numpy dtype or scalar type, or a torch dtype (without importing
    torch)."""
    if isinstance(dtype, str):
        name = dtype
    elif str(dtype).startswith("torch."):
        name = str(dtype).removeprefix("torch.")
    else:
        name = np.dtype(dtype).name
    if name not in EPS:
        raise ValueError(f"no tolerance for dtype {name!r}: one of {', '.join(EPS)}")
    return name


def path_tolerance(dtype: Any, magnitude: float, reduction: int, k: float = K_PATHS) -> float:
    """k * eps(dtype) * sqrt(reduction) * max(magnitude, 1): the module doc's atol."""
    return k * EPS[dtype_name(dtype)] * math.sqrt(max(reduction, 1)) * max(float(magnitude), 1.0)


def assert_close_paths(
    got: np.ndarray, want: np.ndarray, *, reduction: int, dtype: Any, k: float = K_PATHS, msg: str = ""
) -> None:
    """got equals want up to `path_tolerance` (arrays of the same shape; `dtype`: what the paths computed in).
    Raises AssertionError naming the difference and the tolerance (raised, not asserted: it holds under -O)."""
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if g.shape != w.shape:
        raise AssertionError(f"{msg}: shapes {g.shape} and {w.shape} differ")
    finite = np.isfinite(w)
    if not np.array_equal(finite, np.isfinite(g)):
        raise AssertionError(f"{msg}: non-finite values in different places")
    magnitude = float(np.abs(w[finite]).max()) if finite.any() else 0.0
    atol = path_tolerance(dtype, magnitude, reduction, k)
    diff = float(np.abs(g[finite] - w[finite]).max()) if finite.any() else 0.0
    if not diff <= atol:
        raise AssertionError(
            f"{msg}: max |got - want| = {diff:.3g} > {atol:.3g} = {k:g} x eps({dtype_name(dtype)}) "
            f"x sqrt({reduction}) x max(|want|={magnitude:.3g}, 1)"
        )
