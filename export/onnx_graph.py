"""Loaders for one graph: ONNX from a torch GraphDef, its checks, and the CPU session the checks run it in.

    spec = onnx_from_torch(graph, out_dir, opset)      # <name>.onnx + <name>.onnx.data, IR version capped
    check_onnx(out_dir / spec.file)                    # onnx.checker (by path) + strict shape inference
    outputs = run_checked(checking_session(out_dir / spec.file), names, feeds)
Parity with PyTorch runs through Polygraphy: clover.export.compare.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import numpy as np
import torch

from clover.artifact import GraphSpec, TensorSpec
from clover.errors import CloverError
from clover.export.graphs import EXPORT_SIZES, GraphDef, kv_names
from clover.models.decoder import Decoder, causal_mask


@contextlib.contextmanager
def _quiet_exporter():
    """torch.onnx prints progress lines and warns about optional packages (torchvision) and about dim
    names shared by several inputs (intended here); clover-export prints its own progress."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def onnx_from_torch(graph: GraphDef, out_dir: Path, opset: int) -> GraphSpec:
    """Export `graph` with torch.onnx.export(dynamo=True) to out_dir/<name>.onnx, weights as external data, its IR
    version capped to what every supported onnxruntime reads (clover.onnx_ir: the exporter picks its own)."""
    path = out_dir / f"{graph.name}.onnx"
    args = graph.example(EXPORT_SIZES, torch.Generator().manual_seed(0))
    try:
        with _quiet_exporter(), torch.inference_mode(False), torch.no_grad():
            torch.onnx.export(
                graph.module,
                args,
                str(path),
                input_names=list(graph.inputs),
                output_names=list(graph.outputs),
                dynamic_shapes=graph.dynamic_shapes(),
                opset_version=opset,
                dynamo=True,
                external_data=True,
                verbose=False,
            )
    except Exception as e:  # the exporter raises many types; keep the first line of its summary
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CloverError(f"torch.onnx.export failed for the {graph.name} graph: {first}") from e
    finish_exported(path)
    return graph_spec(path)


def plugin_nodes(model) -> list:
    """The tree-attention plugin nodes of an ONNX model, in graph (= layer) order."""
    from clover.plugins.onnx_node import DOMAIN, OP_TYPE

    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]


def finish_exported(path: Path) -> None:
    """Rewrite the exported graph proto at `path` (the external weight files stay as they are) where it needs it:
    its IR version capped (clover.onnx_ir), and each tree-attention node given a unique, readable name
    (`layers.{i}.self_attn.tree_attention`): the exporter names them all after the symbolic op, and TensorRT
    reports errors by node name."""
    import onnx

    from clover.onnx_ir import capped

    model = onnx.load(str(path), load_external_data=False)
    ir_version = model.ir_version
    nodes = plugin_nodes(model)
    for i, node in enumerate(nodes):
        node.name = f"layers.{i}.self_attn.tree_attention"
    if capped(model).ir_version != ir_version or nodes:
        onnx.save(model, str(path))


def graph_spec(path: Path) -> GraphSpec:
    """File names and I/O (names, dtypes, dims) of an exported graph, read from the ONNX file itself."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    model = onnx.load(str(path), load_external_data=False)

    def specs(values) -> tuple[TensorSpec, ...]:
        out = []
        for v in values:
            t = v.type.tensor_type
            dims = tuple(d.dim_param if d.dim_param else int(d.dim_value) for d in t.shape.dim)
            out.append(TensorSpec(v.name, np.dtype(tensor_dtype_to_np_dtype(t.elem_type)).name, dims))
        return tuple(out)

    data = sorted({e.value for init in model.graph.initializer for e in init.external_data if e.key == "location"})
    return GraphSpec(path.name, tuple(data), specs(model.graph.input), specs(model.graph.output))


def check_onnx(path: Path) -> None:
    """onnx.checker with full_check (strict shape inference), by path so external data and >2 GB work."""
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise CloverError(f"{path.name} fails the ONNX checker: {str(e).strip().splitlines()[0]}") from e


@contextlib.contextmanager
def runnable_by_ort(path: Path):
    """`path`, or for a plugin-variant graph a temporary copy of its graph proto with the plugin's ONNX
    reference function attached (ONNX Runtime has no kernel for the custom node). The copy sits next
    to `path`, so its external-data locations resolve; it is deleted on exit."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    if not plugin_nodes(model):
        yield path
        return
    from clover.plugins.onnx_reference import with_reference_function

    tmp = path.with_name(f".{path.stem}.reference.onnx")
    try:
        onnx.save(with_reference_function(model), str(tmp))
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


def checking_session(path: Path):
    """A CPU InferenceSession on `path` (plugin graphs through runnable_by_ort) for the export-time checks and
    clover-compare (the session loader of its Polygraphy OnnxrtRunner). Not Polygraphy's SessionFromOnnx: it
    takes no SessionOptions, and ONNX Runtime's warnings (a chains-only fused graph's unused initializers) would
    print into clover-export's progress."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise CloverError(
            "checking graphs against PyTorch needs onnxruntime: pip install onnxruntime, or pass --no-verify"
        ) from e
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    with runnable_by_ort(path) as runnable:
        return ort.InferenceSession(str(runnable), opts, providers=["CPUExecutionProvider"])


def shares_kv_buffers(session) -> bool:
    """Whether a graph writes its KV cache in place (--attention fused: the base, Clover-2's draft_begin): its
    present outputs are the whole [batch, Hkv, slots, D] buffers bound as the past inputs, not the new rows."""
    return any(o.name.startswith("present.") and o.shape[2] == "slots" for o in session.get_outputs())


def run_checked(session, outputs: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """session.run, with the portable graphs' output convention for in-place KV graphs: each past input is
    copied into a buffer with room for the new rows, bound as both past and present, and present.* is
    returned as the new rows of each sequence ([batch, Hkv, new, D], what the portable graph returns)."""
    if not shares_kv_buffers(session):
        return session.run(outputs, feeds)
    import onnxruntime as ort

    binding = session.io_binding()
    new, lengths = feeds["input_ids" if "input_ids" in feeds else "next_tokens"].shape[1], feeds["past_lengths"]
    buffers = {}
    for name, value in feeds.items():
        if name.startswith("past_key_values."):
            B, H, P, D = value.shape
            buf = np.zeros((B, H, P + max(new, 2), D), value.dtype)  # the fused graph attends on >= 2 rows
            buf[:, :, :P] = value
            buffers[name] = buf
            kv = ort.OrtValue.ortvalue_from_numpy(buf)
            binding.bind_ortvalue_input(name, kv)
            binding.bind_ortvalue_output("present." + name.removeprefix("past_key_values."), kv)
        else:
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
    plain = [o for o in outputs if not o.startswith("present.")]
    for name in plain:
        binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding)
    got = dict(zip(plain, binding.copy_outputs_to_cpu()[-len(plain) :] if plain else []))
    for name in outputs:
        if name.startswith("present."):
            buf = buffers["past_key_values." + name.removeprefix("present.")]
            got[name] = np.stack([buf[b, :, int(p) : int(p) + new] for b, p in enumerate(lengths)])
    return [got[o] for o in outputs]


def greedy_agreement(base: Decoder, path: Path, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """How often the base graph at `path` picks fp32 PyTorch's greedy token: PyTorch decodes each prompt
    greedily, then the graph reads the same sequence in one prefill (teacher forcing) and its argmax is
    compared with PyTorch's choice at every generated position."""
    session = checking_session(path)
    c = base.config
    agree = total = 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            for _ in range(new_tokens):  # no cache: a few dozen short forwards
                T = ids.shape[1]
                out = base(
                    ids,
                    torch.arange(T)[None],
                    causal_mask(T),
                    torch.zeros(1, dtype=torch.int64),
                    *base.empty_cache(1, 0),
                    logit_rows=torch.tensor([T - 1]),
                )
                ids = torch.cat((ids, out.logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        T, P = ids.shape[1], len(prompt)
        empty = np.zeros((1, c.num_kv_heads, 0, c.head_dim), np.float32)
        feeds = {
            "input_ids": ids.numpy(),
            "position_ids": np.arange(T)[None],
            "tree_mask": np.tri(T, dtype=bool)[None],
            "past_lengths": np.zeros(1, np.int64),
            "logit_rows": np.arange(P - 1, T - 1),
            **{n: empty for n in kv_names("past_key_values", c.num_layers)},
        }
        logits = run_checked(session, ["logits"], feeds)[0][0]  # [new_tokens, V]: the choice of each generated token
        agree += int((logits.argmax(-1) == ids[0, P:].numpy()).sum())
        total += new_tokens
    return {"prompts": len(prompts), "positions": total, "top1": agree / total if total else 1.0}
