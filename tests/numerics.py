"""How close two computations of the same float values must be: the tests' side of the project's one tolerance
policy, clover.numerics (its module doc derives the formula

    atol = k * eps(dtype) * sqrt(reduction) * magnitude

and says why k = 8). Here: torch tensors as well as arrays, the default dtype taken from `want`, a decoder's chain
length (`chain_reduction`), a value stored in a narrower dtype (`assert_stored`), and bit equality (`assert_exact`)
only where the code guarantees the same kernel on the same rows: greedy tokens (the lossless identity tests), or one
call made twice.
"""

from __future__ import annotations

import numpy as np
import torch

from clover import numerics
from clover.numerics import K_PATHS

EPS = {dtype: numerics.EPS[numerics.dtype_name(dtype)] for dtype in (torch.float32, torch.float16, torch.bfloat16)}
EPS[torch.float64] = numerics.EPS["float64"]


def _dtype(x) -> torch.dtype:
    if isinstance(x, torch.Tensor):
        return x.dtype
    return torch.from_numpy(np.zeros(0, dtype=np.asarray(x).dtype)).dtype


def _numpy(x) -> np.ndarray:
    return x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)


def path_tolerance(dtype: torch.dtype, magnitude: float, reduction: int, k: float = K_PATHS) -> float:
    """k * eps(dtype) * sqrt(reduction) * max(magnitude, 1): clover.numerics' atol."""
    return numerics.path_tolerance(dtype, magnitude, reduction, k)


def chain_reduction(cfg, layers: int | None = None, context: int = 0) -> int:
    """The terms summed along the longest chain of a decoder's forward (clover.numerics): per layer the q/k/v and o
    projections' (hidden size each), attention's scores (head dim) and weighted sum (`context` keys), the MLP's up
    (hidden) and down (intermediate) projections; then the LM head (hidden)."""
    n = cfg.num_layers if layers is None else layers
    return n * (4 * cfg.hidden_size + cfg.intermediate_size + cfg.head_dim + context) + cfg.hidden_size


def assert_close_paths(
    got, want, *, reduction: int, dtype: torch.dtype | None = None, k: float = K_PATHS, msg: str = ""
) -> None:
    """got equals want up to `path_tolerance` (torch tensors or numpy arrays, same shape). dtype: what the paths
    computed in (default: want's, float32 for float64 arrays that hold float32 results)."""
    if dtype is None:
        dtype = _dtype(want)
        dtype = torch.float32 if dtype == torch.float64 else dtype
    numerics.assert_close_paths(_numpy(got), _numpy(want), reduction=reduction, dtype=dtype, k=k, msg=msg)


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
