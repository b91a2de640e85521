"""How close two computations of the same float values must be: the one tolerance policy of the tests.

Two code paths that compute the same values (one row or six through a matmul, a cache filled in one call or in
chunks, ONNX Runtime against PyTorch) run different kernels: oneDNN, MKL and ONNX Runtime's MLAS pick theirs per CPU
(AMX, AVX-512, AVX2) and per row count, and each blocks its sums its own way. Each path rounds every partial sum
once, so two orders of a K-term sum differ by a random walk of roundings: about eps * sqrt(K) * the terms' size.
The allowed difference is therefore

    atol = k * eps(dtype) * sqrt(reduction) * magnitude

with eps the machine epsilon of the dtype the paths computed in (float32: 1.19e-7), `reduction` the longest
chain of terms summed into one value (a matmul's inner dimension; for L layers of them, their sum: a chain of L
reductions of length K drifts like one of L * K), `magnitude` the largest value compared (max |want|, at least 1: the
terms of a sum of values below 1 are not smaller than rounding at 1), and k = 8 (K_PATHS): the random walk's spread
at a few standard deviations, with room for the kernels' different blockings, and still 1e4-1e5 times smaller than
any real bug (a wrong mask or position moves values by O(magnitude)). A comparison against a value rounded once to
a storage dtype (fp16 features on disk) uses that dtype's eps with reduction 1.

Bit equality (`assert_exact`) only where the code guarantees the same kernel on the same rows: greedy tokens (the
lossless identity tests), or one call made twice.
"""

from __future__ import annotations

import math

import numpy as np
import torch

K_PATHS = 8.0  # the formula's k (module doc)
EPS = {
    torch.float32: float(np.finfo(np.float32).eps),
    torch.float16: float(np.finfo(np.float16).eps),
    torch.bfloat16: 2.0**-7,
    torch.float64: float(np.finfo(np.float64).eps),
}


def _dtype(x) -> torch.dtype:
    if isinstance(x, torch.Tensor):
        return x.dtype
    return torch.from_numpy(np.zeros(0, dtype=np.asarray(x).dtype)).dtype


def _numpy(x) -> np.ndarray:
    return x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)


def path_tolerance(dtype: torch.dtype, magnitude: float, reduction: int, k: float = K_PATHS) -> float:
    """k * eps(dtype) * sqrt(reduction) * max(magnitude, 1): the module doc's atol."""
    return k * EPS[dtype] * math.sqrt(max(reduction, 1)) * max(float(magnitude), 1.0)


def chain_reduction(cfg, layers: int | None = None, context: int = 0) -> int:
    """The terms summed along the longest chain of a decoder's forward (module doc): per layer the q/k/v and o
    projections' (hidden size each), attention's scores (head dim) and weighted sum (`context` keys), the MLP's up
    (hidden) and down (intermediate) projections; then the LM head (hidden)."""
    n = cfg.num_layers if layers is None else layers
    return n * (4 * cfg.hidden_size + cfg.intermediate_size + cfg.head_dim + context) + cfg.hidden_size


def assert_close_paths(
    got, want, *, reduction: int, dtype: torch.dtype | None = None, k: float = K_PATHS, msg: str = ""
) -> None:
    """got equals want up to `path_tolerance` (torch tensors or numpy arrays, same shape). dtype: what the paths
    computed in (default: want's, float32 for float64 arrays that hold float32 results)."""
    g, w = _numpy(got), _numpy(want)
    assert g.shape == w.shape, f"{msg}: shapes {g.shape} and {w.shape} differ"
    if dtype is None:
        dtype = _dtype(want)
        dtype = torch.float32 if dtype == torch.float64 else dtype
    finite = np.isfinite(w)
    assert np.array_equal(finite, np.isfinite(g)), f"{msg}: non-finite values in different places"
    magnitude = float(np.abs(w[finite]).max()) if finite.any() else 0.0
    atol = path_tolerance(dtype, magnitude, reduction, k)
    diff = float(np.abs(g[finite] - w[finite]).max()) if finite.any() else 0.0
    assert diff <= atol, (
        f"{msg}: max |got - want| = {diff:.3g} > {atol:.3g} = {k:g} x eps({str(dtype).removeprefix('torch.')}) "
        f"x sqrt({reduction}) x max(|want|={magnitude:.3g}, 1)"
    )


def assert_stored(stored, computed, msg: str = "") -> None:
    """A value stored in a narrower dtype (fp16 features on disk) against the fp32 one it was rounded from:
    one rounding in the stored dtype (reduction 1), on top of the paths' own differences (far smaller)."""
    dtype = _dtype(stored)
    assert_close_paths(_numpy(stored), computed, reduction=1, dtype=dtype, msg=msg)


def assert_exact(got, want, msg: str = "") -> None:
    """Bit equality: the same kernel on the same rows, or integers."""
    g, w = (x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x) for x in (got, want))
    assert g.shape == w.shape and np.array_equal(g, w, equal_nan=g.dtype.kind == "f"), (
        f"{msg}: not bit-identical (max diff {np.abs(g.astype(np.float64) - w.astype(np.float64)).max():.3g})"
    )
