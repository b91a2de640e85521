"""The torch backend's interface (runtime/backend.py `BACKENDS`): a runner from CLI-style specs, the per-sequence
TorchRunner (runtime/backends/torch_runner.py) on the CPU or the stacked BatchedTorchRunner
(runtime/backends/torch_batch.py) on a device."""

from __future__ import annotations

from pathlib import Path

import torch

from clover.errors import CloverError
from clover.runtime.backend import Runner, RunnerSpec
from clover.runtime.backends.torch_runner import TorchRunner


def base_dir(base: str | Path) -> Path:
    """The HF folder a base spec names (tokenizer files live there)."""
    from clover.models.smollm2 import resolve_base

    return resolve_base(base)


def load_runner(
    base: str | Path, heads: str = "none", dtype: str = "float32", threads: int | None = None, device: str | None = None
) -> Runner:
    """Build a runner from CLI-style specs: base = folder or 'smollm2'; heads = folder, random:ARCH[:SEED] or none;
    threads: torch's intra-op threads (process-wide; None leaves torch's default); device: given, the stacked runner
    on that device (runtime/backends/torch_batch.py; CUDA graphs on a GPU), else the per-sequence TorchRunner on the CPU."""
    from clover.models.head_io import resolve_heads
    from clover.models.loading import load_base
    from clover.models.smollm2 import resolve_base

    if threads is not None:
        torch.set_num_threads(threads)
    model = load_base(resolve_base(base), dtype)
    if device is None:
        return TorchRunner(model, resolve_heads(heads, model), heads_name=heads)
    from clover.runtime.backends.torch_batch import BatchedTorchRunner

    try:
        place = torch.device(device)
        torch.empty(0, device=place)
    except (RuntimeError, AssertionError) as e:
        raise CloverError(f"device {device!r} is not usable here ({str(e).splitlines()[0]}): use cpu") from e
    head_set = resolve_heads(heads, model)
    model = model.to(place)
    head_set = None if head_set is None else head_set.to(place)
    return BatchedTorchRunner(model, head_set, heads_name=heads, cuda_graphs=place.type == "cuda")


def from_spec(base: str | Path, spec: RunnerSpec) -> Runner:
    """load_runner with the RunnerSpec fields the torch backend has."""
    return load_runner(
        base,
        heads="none" if spec.heads is None else spec.heads,
        dtype=spec.dtype or "float32",
        threads=spec.threads,
        device=spec.device,
    )
