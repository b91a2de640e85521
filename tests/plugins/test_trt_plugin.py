"""The TensorRT tree-attention plugin's pure parts (launch grid, type combinations, kernel ABI check,
CUDA array views) and its clear error without TensorRT; registration itself needs TensorRT."""

import sys

import pytest
from helpers import run_python

from clover.errors import CloverError
from clover.plugins import trt_plugin
from clover.plugins.trt_plugin import (
    INPUTS,
    KERNEL_ARGS,
    PLUGIN_ID,
    check_kernel_args,
    cuda_array_interface,
    io_types,
    launch_grid,
    threads_per_block,
)
from clover.trt import MISSING


def test_plugin_id_matches_the_onnx_node():
    onnx_node = pytest.importorskip("clover.plugins.onnx_node")
    assert PLUGIN_ID == f"{onnx_node.PLUGIN_NAMESPACE}::{onnx_node.OP_TYPE}"
    assert INPUTS == onnx_node.INPUTS


def test_register_without_tensorrt_is_the_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setattr(trt_plugin, "_registered", False)
    with pytest.raises(CloverError) as e:
        trt_plugin.register()
    assert str(e.value) == MISSING


@pytest.mark.parametrize(
    "batch, heads, new, block, grid",
    [
        (1, 4, 1, 16, (1, 4, 1)),  # one token: one program per (sequence, query head)
        (1, 4, 16, 16, (1, 4, 1)),
        (1, 4, 17, 16, (2, 4, 1)),  # ceil(T / BLOCK_M)
        (2, 32, 64, 16, (4, 64, 1)),
        (1, 8, 65, 64, (2, 8, 1)),
    ],
)
def test_launch_grid(batch, heads, new, block, grid):
    assert launch_grid(batch, heads, new, block) == grid


def test_launch_grid_composes_symbolic_dims():
    """tensorrt.plugin passes ShapeExprs: the grid must only use *, and the given ceil division."""

    class Sym:
        def __init__(self, text):
            self.text = text

        def __mul__(self, other):
            return Sym(f"({self.text} * {getattr(other, 'text', other)})")

    gx, gy, gz = launch_grid(Sym("B"), Sym("HQ"), Sym("T"), 16, ceil_div=lambda a, b: Sym(f"cdiv({a.text}, {b})"))
    assert (gx.text, gy.text, gz) == ("cdiv(T, 16)", "(B * HQ)", 1)


def test_threads_per_block():
    assert threads_per_block(4) == 128


def test_io_types_one_float_type_for_q_kv_and_output():
    positions = [p.strip() for p in io_types().split(",")]
    assert len(positions) == len(INPUTS) + 1  # seven inputs and the output
    floats = positions[:5] + positions[7:]
    assert all(p == "FP32|FP16|BF16" for p in floats)  # dependent: the same choice everywhere
    assert positions[5:7] == ["INT32", "INT32"]  # past_lengths, packed_mask


def test_kernel_argument_order_check():
    check_kernel_args(KERNEL_ARGS)
    with pytest.raises(CloverError) as e:
        check_kernel_args(("Q", "K", "V", "PK", "PV", "LENS", "MASK", "OUT", "T", "P"))
    msg = str(e.value)
    assert "takes (Q, K, V, PK, PV, LENS, MASK, OUT, T, P)" in msg and "inputs, scalars, outputs" in msg


def test_triton_kernel_has_the_aot_argument_order():
    tta = pytest.importorskip("clover.plugins.triton_tree_attention")
    fn = tta.tree_attention_kernel
    params = getattr(fn, "params", None)
    if params is None:
        pytest.skip("Triton runs in interpreter mode here")
    check_kernel_args([p.name for p in params if not p.is_constexpr])


def test_cuda_array_interface_for_bfloat16_views():
    ai = cuda_array_interface(0x7F0000001000, (1, 4, 3, 16), (192, 48, 16, 1), "<i2", 2)
    assert ai == {
        "shape": (1, 4, 3, 16),
        "typestr": "<i2",
        "data": (0x7F0000001000, False),
        "strides": (384, 96, 32, 2),
        "version": 3,
    }


def test_module_imports_without_tensorrt_torch_or_triton():
    code = (
        "import sys\nsys.modules['tensorrt'] = None\nimport clover.plugins.trt_plugin\n"
        "assert not [m for m in ('torch', 'triton') if m in sys.modules]\nprint('ok')\n"
    )
    assert run_python(code).strip() == "ok"


def test_plugin_does_not_import_the_runtime():
    """The plugin reaches TensorRT through clover.trt, not clover.runtime (which would be a cycle: the runtime
    registers the plugin for JIT engines)."""
    code = (
        "import sys\nimport clover.plugins.trt_plugin\n"
        "print(sorted(m for m in sys.modules if m.startswith('clover.')))\n"
    )
    assert run_python(code).strip() == "['clover.errors', 'clover.plugins', 'clover.plugins.trt_plugin']"
