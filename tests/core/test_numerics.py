"""clover.numerics, the project's tolerance policy: dtypes named any way (string, numpy, torch) give one eps, the
formula's bound, and assert_close_paths passes within it and fails beyond it with the numbers that decided; the tests'
tests/numerics.py gives the same bound for torch dtypes."""

import math

import numerics as test_numerics
import numpy as np
import pytest
import torch

from clover import numerics


def test_dtypes_named_any_way_and_tf32_for_a_gpus_float32_matmul():
    for name in ("float32", np.float32, np.dtype("float32"), torch.float32):
        assert numerics.dtype_name(name) == "float32"
    assert numerics.dtype_name(torch.bfloat16) == "bfloat16"
    assert numerics.EPS[numerics.GPU_FP32_MATMUL] == 2.0**-10 == numerics.EPS["float16"]
    with pytest.raises(ValueError, match="no tolerance for dtype 'int8'"):
        numerics.dtype_name(np.int8)


def test_the_bound_and_the_tests_share_it():
    assert numerics.path_tolerance("float32", 0.5, 64) == 8 * np.finfo(np.float32).eps * 8 * 1.0
    assert numerics.path_tolerance("tfloat32", 3.0, 3) == pytest.approx(8 * 2**-10 * math.sqrt(3) * 3)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        assert test_numerics.path_tolerance(dtype, 2.0, 100) == numerics.path_tolerance(dtype, 2.0, 100)


def test_assert_close_paths_within_and_beyond():
    want = np.linspace(-2, 2, 12).reshape(3, 4)
    atol = numerics.path_tolerance("float32", 2.0, 16)
    numerics.assert_close_paths(want + 0.9 * atol, want, reduction=16, dtype="float32")
    with pytest.raises(AssertionError, match=r"^x: max \|got - want\| = .* > .* = 8 x eps\(float32\) x sqrt\(16\)"):
        numerics.assert_close_paths(want + 1.1 * atol, want, reduction=16, dtype="float32", msg="x")
    with pytest.raises(AssertionError, match="non-finite values in different places"):
        numerics.assert_close_paths(np.where(want > 1, np.inf, want), want, reduction=16, dtype="float32")
