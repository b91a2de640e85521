"""Tree-attention kernel vs the portable path on one GPU: the Triton kernel (what the TensorRT plugin runs)
against torch SDPA with a dense boolean mask over concat(past, new) (what the `portable` graphs compute).

Shapes: 1B-class (Hq=32, Hkv=8, D=64) and 8B-class (Hq=32, Hkv=8, D=128), fp16 and bf16, T new tokens in
{1, 26, 64}, a full cache of P in {512, 2048, 8192}, B=1. Each case is checked against the fp32 reference
first, then timed with CUDA events over CUDA-graph replays (no Python launch overhead, as in an engine).
Prints a table and writes JSON (default benchmarks/results/tree_attention_kernel.json).

    python benchmarks/tree_attention_kernel.py [--quick] [--iters 200] [--eager] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch

from clover.tools.gpu_profile import KERNEL_TOL as TOL
from clover.tools.gpu_profile import kernel_inputs, sdpa_dense, time_ms
from clover.tools.machine import host

MODELS = {"1b": (32, 8, 64), "8b": (32, 8, 128)}  # name -> (Hq, Hkv, D)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def random_tree_mask(T: int, gen: torch.Generator) -> np.ndarray:
    """bool [T, T]: self + ancestors of a random tree rooted at token 0, parents before children."""
    mask = np.eye(T, dtype=bool)
    for i in range(1, T):
        mask[i] |= mask[int(torch.randint(0, i, (), generator=gen))]
    return mask


def run_case(model: str, dtype_name: str, T: int, P: int, iters: int, graph: bool) -> dict:
    from clover.plugins.tree_attention import tree_attention_reference
    from clover.plugins.triton_tree_attention import tree_attention_triton

    Hq, Hkv, D = MODELS[model]
    dtype = DTYPES[dtype_name]
    # B=1, the whole cache valid (the kernel's worst case: it skips only slots past the length)
    mask = random_tree_mask(T, torch.Generator().manual_seed(T * 100003 + P))
    inputs = kernel_inputs(Hq, Hkv, D, mask, P, dtype, "cuda", seed=T * 100003 + P)
    portable = sdpa_dense(inputs)
    triton_fn = lambda: tree_attention_triton(**inputs)  # noqa: E731
    ref = tree_attention_reference(**inputs).float()
    err_triton = (triton_fn().float() - ref).abs().max().item()
    err_portable = (portable().float() - ref).abs().max().item()
    t_triton, t_portable = time_ms(triton_fn, iters, graph), time_ms(portable, iters, graph)
    return {
        "model": model,
        "num_q_heads": Hq,
        "num_kv_heads": Hkv,
        "head_dim": D,
        "dtype": dtype_name,
        "new_tokens": T,
        "past": P,
        "triton_us": 1e3 * t_triton,
        "portable_us": 1e3 * t_portable,
        "speedup": t_portable / t_triton,
        "max_abs_err_triton": err_triton,
        "max_abs_err_portable": err_portable,
        "correct": err_triton <= TOL[dtype],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T in {1, 26}, P in {512, 2048}, fewer iterations")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case (default 200, quick 50)")
    ap.add_argument("--eager", action="store_true", help="time eager launches instead of CUDA-graph replays")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "tree_attention_kernel.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tree_attention_kernel: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    import triton

    new_tokens, pasts = ([1, 26], [512, 2048]) if args.quick else ([1, 26, 64], [512, 2048, 8192])
    iters = args.iters or (50 if args.quick else 200)
    rows = [
        run_case(m, d, T, P, iters, not args.eager) for m in MODELS for d in DTYPES for T in new_tokens for P in pasts
    ]

    device = torch.cuda.get_device_name()
    timing = "eager launches" if args.eager else "CUDA-graph replays"
    print(
        f"\ntree attention, B=1, {device}, mean of {iters} {timing}; portable = SDPA + dense mask over "
        "concat(past, new)"
    )
    print(
        f"{'model':<6}{'dtype':<6}{'T':>4}{'P':>6}{'triton us':>11}{'portable us':>13}{'speedup':>9}"
        f"{'err triton':>12}{'err portable':>14}"
    )
    for r in rows:
        flag = "" if r["correct"] else "  WRONG"
        print(
            f"{r['model']:<6}{r['dtype']:<6}{r['new_tokens']:>4}{r['past']:>6}{r['triton_us']:>11.1f}"
            f"{r['portable_us']:>13.1f}{r['speedup']:>8.2f}x{r['max_abs_err_triton']:>12.1e}"
            f"{r['max_abs_err_portable']:>14.1e}{flag}"
        )
    doc = {
        "host": host(),
        "benchmark": "tree_attention_kernel",
        "device": device,
        "timing": timing,
        "iters": iters,
        "batch": 1,
        "results": rows,
        "all_correct": all(r["correct"] for r in rows),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.json}")
    return 0 if doc["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
