"""The ONNX IR version every model clover-deploy writes carries, and the opsets that fit under it.

onnxruntime refuses a model whose IR version is newer than the onnx release it was built with ("Unsupported model IR
version: 14, max supported IR version: 13"), while onnx stamps a new model with its own newest one (onnx.IR_VERSION:
14 for onnx 1.23) and the torch exporter with its ONNX IR library's choice. So every writer (the export's graphs, the
doctor's probes) passes its model through `capped` before saving: the IR version becomes at most `ir_version_cap()`,
the newest that

- the oldest onnxruntime the project supports reads (ORT_OLDEST, pyproject.toml's lowest onnxruntime bound; its
  maximum, ORT_OLDEST_IR, is the one fact here that no installed package can tell),
- the installed onnxruntime reads (probed once by loading a one-node model), and
- the installed onnx knows (onnx.IR_VERSION);

and never below what the model's opsets need (onnx.helper.VERSION_TABLE: the onnx release that introduced each
opset, and its IR version). `max_opset()` is the newest default-domain opset a model at the cap may import.

Imports onnx and onnxruntime inside the functions only (docs/design.md, Conventions 7).
"""

from __future__ import annotations

import functools
from typing import Any

from clover.errors import CloverError

ORT_OLDEST = "1.31.1"  # pyproject.toml: the gpu extra's onnxruntime-gpu>=1.31.1 (the onnx extra asks >= 1.32.0)
ORT_OLDEST_IR = 13  # what ORT_OLDEST reads: it refuses IR 14 with "max supported IR version: 13"


@functools.cache
def installed_ort_ir() -> int | None:
    """The newest IR version the installed onnxruntime loads (None: onnx or onnxruntime not installed), found by
    loading a one-node model at onnx.IR_VERSION, then each older one until a session opens."""
    try:
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return None
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "ir_probe", [x], [y])
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a refused IR version is the expected answer, not an error to log
    for ir in range(onnx.IR_VERSION, 6, -1):  # IR 7: opset 13's, the oldest this probe's model imports
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = ir
        try:
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception:  # onnxruntime's own exception types live in a private module
            continue
        return ir
    return None


def ir_version_cap() -> int:
    """The newest IR version a model clover-deploy writes may carry (module doc)."""
    import onnx

    caps = [ORT_OLDEST_IR, onnx.IR_VERSION]
    installed = installed_ort_ir()
    if installed is not None:
        caps.append(installed)
    return min(caps)


def max_opset(ir_version: int | None = None) -> int:
    """The newest default-domain opset whose onnx release's IR version is at most `ir_version` (default: the cap)."""
    from onnx import helper

    ir = ir_version_cap() if ir_version is None else ir_version
    return max(opset for _, release_ir, opset, *_ in helper.VERSION_TABLE if release_ir <= ir)


def needed_ir_version(model: Any) -> int:
    """The IR version `model`'s opset imports need, from onnx's table (domains it does not know need nothing)."""
    from onnx import helper

    return helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)


def capped(model: Any) -> Any:
    """`model` (an onnx.ModelProto, changed in place and returned) with its IR version at most `ir_version_cap()`;
    a model already below the cap keeps its own. Raises CloverError when its opsets need a newer IR version."""
    cap = ir_version_cap()
    need = needed_ir_version(model)
    if need > cap:
        opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in model.opset_import)
        raise CloverError(
            f"an ONNX model importing opsets {opsets} needs IR version {need}, newer than {cap}, the newest that "
            f"onnxruntime {ORT_OLDEST} and the installed onnx and onnxruntime read: use default-domain opset "
            f"{max_opset(cap)} or older"
        )
    if not model.ir_version or model.ir_version > cap:
        model.ir_version = cap
    return model
