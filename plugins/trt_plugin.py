"""The TensorRT plugin behind the `clover::CloverTreeAttention` ONNX node (clover.plugins.onnx_node), written
with TensorRT's Python "quickly deployable plugins" (`tensorrt.plugin`, TensorRT >= 10.7; AOT >= 10.9).

    register()   # idempotent; clover.export.engines calls it before parsing a `plugin` graph

How the ONNX parser finds it: a node whose op_type has no built-in importer falls back to the plugin
registry, looked up by name = op_type, version = the node's `plugin_version` attribute (default "1") and
namespace = its `plugin_namespace` attribute (default ""). The node's ONNX domain is not consulted. Only
attributes that the plugin declares (here `scale`) are passed to it, as plugin fields.
(onnx-tensorrt FallbackPluginImporter; NVIDIA/TensorRT samples/python/quickly_deployable_plugins/README.md,
"ONNX model with a plugin".)

One implementation is registered, so the parser has nothing to choose (with both, it needs the network
flag PREFER_AOT_PYTHON_PLUGINS, which Polygraphy's network loaders cannot set, or an `aot` node attribute):
- @trtp.aot_impl, on TensorRT >= 10.9: returns the Triton kernel compiled to PTX, its launch grid as
  symbolic expressions of the input shapes, and the int32 scalars T and P. TensorRT embeds the PTX in the
  engine and launches it itself, so running an engine needs neither Python nor this module.
- @trtp.impl (JIT, a Python callback per launch), on 10.7 and 10.8 only: the same Triton kernel through
  its PyTorch launcher; engines built with it need this module registered where they run
  (clover.runtime.backends.trt does that for `plugin` artifacts).

Kernel ABI: TensorRT launches an AOT kernel with the input pointers, then the extra scalar arguments,
then the output pointers ("extra_args: symbolic expressions for scalar inputs to the kernel, located
after the tensor inputs and before the tensor outputs",
https://docs.nvidia.com/deeplearning/tensorrt/latest/_static/python-api/infer/tensorrt.plugin/trt_plugin_aot_impl/index.html).
So the kernel's runtime arguments must be Q, K, V, PK, PV, LENS, MASK, T, P, OUT; `check_kernel_args`
refuses any other order rather than let a build produce an engine that writes through T.

No `from __future__ import annotations` here: tensorrt.plugin validates the decorated functions'
annotations with issubclass at registration, which string annotations would fail.
"""

from collections.abc import Callable, Sequence

from clover.errors import CloverError

PLUGIN_NAMESPACE = "clover"  # as clover.plugins.onnx_node (kept literal: that module imports torch)
PLUGIN_NAME = "CloverTreeAttention"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
INPUTS = ("q", "k", "v", "past_k", "past_v", "past_lengths", "packed_mask")
KERNEL_ARGS = ("Q", "K", "V", "PK", "PV", "LENS", "MASK", "T", "P", "OUT")  # TensorRT's AOT launch order
FLOAT_TYPES = ("FP32", "FP16", "BF16")  # tensorrt.plugin type strings; trt.DataType FLOAT / HALF / BF16
COMPILE_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16"}  # trt.DataType name -> kernel dtype

_registered = False


# -- pure parts (tested without TensorRT) ---------------------------------------------------------------


def io_types() -> str:
    """The AutoTuneCombination type string: q, k, v, past_k, past_v and the output share one float type
    ("a|b|c" in several positions is a *dependent* choice: all take the first, or all the second, ...);
    past_lengths and packed_mask are int32. Formats are LINEAR (row-major) only."""
    floats = "|".join(FLOAT_TYPES)
    return ", ".join([floats] * 5 + ["INT32", "INT32", floats])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_grid(batch, num_q_heads, new_tokens, block_m: int, ceil_div: Callable = cdiv) -> tuple:
    """(grid_x, grid_y, grid_z) = (ceil(T / BLOCK_M), B * HQ, 1): one program per BLOCK_M new tokens of one
    (sequence, query head). Works on ints and, with ceil_div=trtp.cdiv, on tensorrt.plugin ShapeExprs."""
    return ceil_div(new_tokens, block_m), batch * num_q_heads, 1


def threads_per_block(num_warps: int) -> int:
    return 32 * num_warps


def check_kernel_args(runtime_args: Sequence[str]) -> None:
    """The kernel's non-constexpr arguments must be in TensorRT's AOT launch order (module docstring)."""
    if tuple(runtime_args) != KERNEL_ARGS:
        raise CloverError(
            f"the Triton tree-attention kernel takes ({', '.join(runtime_args)}), but a TensorRT AOT plugin launches "
            f"kernels as inputs, scalars, outputs: ({', '.join(KERNEL_ARGS)}); reorder the kernel's arguments in "
            "clover.plugins.triton_tree_attention (this is a clover bug, please report it)"
        )


def cuda_array_interface(ptr: int, shape: Sequence[int], strides: Sequence[int], typestr: str, itemsize: int) -> dict:
    """__cuda_array_interface__ (v3) of a device buffer; strides in elements, as TensorRT gives them."""
    return {
        "shape": tuple(int(s) for s in shape),
        "typestr": typestr,
        "data": (int(ptr), False),
        "strides": tuple(int(s) * itemsize for s in strides),
        "version": 3,
    }


class _CudaArray:
    """Carries a __cuda_array_interface__ dict for torch.as_tensor."""

    def __init__(self, interface: dict) -> None:
        self.__cuda_array_interface__ = interface


# -- registration --------------------------------------------------------------------------------------


def register() -> None:
    """Register the plugin with TensorRT's plugin registry (once per process; later calls do nothing)."""
    global _registered
    if _registered:
        return
    from clover.trt import require_tensorrt

    trt = require_tensorrt()
    try:
        import tensorrt.plugin as trtp
    except ImportError as e:
        raise CloverError(
            f"TensorRT {trt.__version__} has no tensorrt.plugin module (Python plugins need TensorRT "
            ">= 10.7, AOT plugins >= 10.9): pip install -U 'tensorrt>=10.9,<12', or export with "
            "--attention portable"
        ) from e
    if not _already_defined(trtp):
        _define(trt, trtp)
    _registered = True


def _already_defined(trtp) -> bool:
    # trtp.register refuses a second definition; another copy of this module may have made it.
    return hasattr(trtp.op, PLUGIN_NAMESPACE) and hasattr(getattr(trtp.op, PLUGIN_NAMESPACE), PLUGIN_NAME)


def _define(trt, trtp) -> None:
    """Register the op's descriptions, then one implementation (AOT where TensorRT has it; module docstring)."""
    _define_descriptions(trtp)
    if not hasattr(trtp, "aot_impl"):  # TensorRT < 10.9: the JIT implementation alone
        _define_jit(trt, trtp)
        return
    _define_aot(trtp)


def _define_descriptions(trtp) -> None:
    """Register the output description (q's shape and dtype) and the I/O type and format combinations."""

    @trtp.register(PLUGIN_ID)
    def describe(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        v: trtp.TensorDesc,
        past_k: trtp.TensorDesc,
        past_v: trtp.TensorDesc,
        past_lengths: trtp.TensorDesc,
        packed_mask: trtp.TensorDesc,
        scale: float,
    ) -> trtp.TensorDesc:
        return q.like()  # [B, Hq, T, D] in q's dtype; B and T stay symbolic (dynamic)

    @trtp.autotune(PLUGIN_ID)
    def formats(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        v: trtp.TensorDesc,
        past_k: trtp.TensorDesc,
        past_v: trtp.TensorDesc,
        past_lengths: trtp.TensorDesc,
        packed_mask: trtp.TensorDesc,
        outputs: tuple[trtp.TensorDesc],
    ) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(io_types(), "LINEAR")]


def _define_jit(trt, trtp) -> None:
    """Register the JIT implementation: a Python callback per launch, running the kernel through PyTorch."""

    @trtp.impl(PLUGIN_ID)
    def run_jit(
        q: trtp.Tensor,
        k: trtp.Tensor,
        v: trtp.Tensor,
        past_k: trtp.Tensor,
        past_v: trtp.Tensor,
        past_lengths: trtp.Tensor,
        packed_mask: trtp.Tensor,
        scale: float,
        outputs: tuple[trtp.Tensor],
        stream: int,
    ) -> None:
        import torch

        from clover.plugins.triton_tree_attention import tree_attention_triton

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):  # TensorRT's stream, not torch's
            args = [_as_torch(trt, t) for t in (q, k, v, past_k, past_v, past_lengths, packed_mask)]
            _as_torch(trt, outputs[0]).copy_(tree_attention_triton(*args, scale))


def _define_aot(trtp) -> None:
    """Register the AOT implementation: the kernel as PTX with its launch grid, launched by TensorRT itself."""

    @trtp.aot_impl(PLUGIN_ID)
    def compile_aot(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        v: trtp.TensorDesc,
        past_k: trtp.TensorDesc,
        past_v: trtp.TensorDesc,
        past_lengths: trtp.TensorDesc,
        packed_mask: trtp.TensorDesc,
        scale: float,
        outputs: tuple[trtp.TensorDesc],
        tactic: int,
    ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
        import torch

        from clover.plugins import triton_tree_attention as tta

        check_kernel_args([p.name for p in tta.tree_attention_kernel.params if not p.is_constexpr])
        B, HQ, T, D = q.shape_expr  # [B, Hq, T, D]
        P = past_k.shape_expr[2]  # [B, Hkv, P, D]
        kernel = tta.compile_for_tensorrt(
            COMPILE_DTYPES[q.dtype.name],
            _static(HQ, "query heads"),
            _static(k.shape_expr[1], "kv heads"),
            _static(D, "head dim"),
            scale,
            torch.cuda.get_device_capability(),
        )
        grid_x, grid_y, grid_z = launch_grid(B, HQ, T, kernel.block_m, ceil_div=trtp.cdiv)
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y, params.grid_z = grid_x, grid_y, grid_z
        params.block_x = threads_per_block(kernel.num_warps)
        params.shared_mem = kernel.shared_mem
        scalars = trtp.SymIntExprs.from_tuple([trtp.SymInt32(T), trtp.SymInt32(P)])  # the kernel's T, P (int32)
        return kernel.kernel_name, kernel.ptx, params, scalars


def _static(expr, what: str) -> int:
    """The build-time value of a static dim (head counts and head dim are static in exported graphs)."""
    if not expr.is_constant:
        raise CloverError(f"the tree-attention plugin needs a static number of {what}, but the graph has a dynamic one")
    return int(expr.constant_value())


def _as_torch(trt, t):
    """A torch view (no copy) of a tensorrt.plugin.Tensor on the GPU. bfloat16 has no __cuda_array_interface__
    type string, so it is viewed through int16 (same width) and reinterpreted."""
    import torch

    if t.dtype == trt.DataType.BF16:
        raw = _CudaArray(cuda_array_interface(t.data_ptr, tuple(t.shape), tuple(t.strides), "<i2", 2))
        return torch.as_tensor(raw, device="cuda").view(torch.bfloat16)
    return torch.as_tensor(t, device="cuda")
