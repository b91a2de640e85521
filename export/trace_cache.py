"""Traced graphs kept across exports: torch.onnx's trace of a graph is most of an export's time (about 70 s for
SmolLM2-135M's 30-layer base on 2 CPU cores, where quantizing it takes 4 s), and exports of one model that differ only
in what is done to the fp32 graphs afterwards (--weights, --draft-quant, --draft-vocab, --tree, --max-batch) trace
the same graphs. Each trace is kept under CLOVER_CACHE/traces/<key>/ and copied out when the key comes again.

The key is a digest of everything the trace reads: the graph's name, I/O names and dynamic dims, the opset, its
example inputs, every parameter and buffer of its module (names, dtypes, shapes and bytes; tied ones as ties), every
submodule's class and plain attributes (configs, the attention variant), the versions of torch, onnx and onnxscript,
and the source of the packages that build and trace graphs. A module with an attribute whose repr names a memory
address is not cached. Entries are written in a staging folder and renamed into place (a crash leaves no half entry),
one process traces a key while the others wait for it (a file lock), and the least recently used entries go once the
cache passes its size limit.

CLOVER_TRACE_CACHE: "0" (or off, false, no) traces every time; a folder: the cache lives there.
CLOVER_TRACE_CACHE_GB: the size limit (default 8); a trace larger than half of it is not kept.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from clover import atomic
from clover.artifact import GraphSpec
from clover.cache import cache_dir
from clover.errors import CloverError
from clover.export.graphs import EXPORT_SIZES, GraphDef

TRACE_CACHE_ENV = "CLOVER_TRACE_CACHE"
TRACE_CACHE_GB_ENV = "CLOVER_TRACE_CACHE_GB"
OFF = {"0", "off", "false", "no"}
# The packages whose code decides what a trace holds (a wheel install keeps them all under clover/)
TRACED_BY = ("clover", "clover.models", "clover.plugins", "clover.export")


def trace_folder() -> Path | None:
    """Where traces are kept, or None when the cache is off."""
    value = os.environ.get(TRACE_CACHE_ENV, "").strip()
    if value.lower() in OFF:
        return None
    return Path(value) if value else cache_dir() / "traces"


def traced(graph: GraphDef, out_dir: Path, opset: int, trace: Callable[[GraphDef, Path, int], GraphSpec]) -> GraphSpec:
    """`trace(graph, out_dir, opset)`'s files in out_dir (<name>.onnx and its external data), from the cache when
    this graph was traced before; the files are copies, free to be rewritten (quantized) in place. The cache is
    best-effort: one that cannot be written (a full disk, a path that is not a folder) costs a trace, not the
    export."""
    from clover.export.onnx_graph import graph_spec

    out_dir.mkdir(parents=True, exist_ok=True)
    folder = trace_folder()
    key = trace_key(graph, opset) if folder is not None else None
    lock = _cache_lock(folder, key) if key is not None else None
    if lock is None:
        return trace(graph, out_dir, opset)
    entry = folder / key
    with lock:
        if entry.is_dir():
            _copy_files(entry, out_dir)
            os.utime(entry)  # the most recently used
        else:
            _trace_and_keep(graph, out_dir, opset, trace, entry)
    try:
        _evict(folder, keep=entry)
    except OSError:  # an entry another process is deleting, say: the next export evicts
        pass
    return graph_spec(out_dir / f"{graph.name}.onnx")


def _copy_files(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        shutil.copyfile(f, dest / f.name)


def _cache_lock(folder: Path, key: str) -> _Locked | None:
    """The key's lock in the cache folder, taken; None where the folder cannot be made or written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return _Locked(folder / f".{key}.lock")
    except OSError:
        return None


def _trace_and_keep(graph: GraphDef, out_dir: Path, opset: int, trace: Callable, entry: Path) -> None:
    """Trace into a folder of its own beside the export's files, keep a copy in the cache (a larger one than half
    its limit is used once and not kept), then move the files into out_dir."""
    tmp = Path(tempfile.mkdtemp(prefix=f".trace-{graph.name}-", dir=out_dir))
    try:
        trace(graph, tmp, opset)
        if _size(tmp) <= _limit_bytes() / 2:
            try:
                with atomic.staging_folder(entry) as staged:
                    _copy_files(tmp, staged)
                    atomic.publish_folder(staged, entry)
            except (OSError, CloverError):  # no room for the cache: the next export traces again, nothing more
                pass
        for f in tmp.iterdir():
            os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def trace_key(graph: GraphDef, opset: int) -> str | None:
    """The digest of everything the trace of `graph` reads (module docstring), or None if it cannot be keyed."""
    h = hashlib.blake2b(digest_size=20)

    def add(*parts: object) -> None:
        for p in parts:
            h.update(repr(p).encode())
            h.update(b"\0")

    add(_versions(), _code_digest(), opset, graph.name, graph.inputs, graph.outputs, graph.dims)
    for name, module in graph.module.named_modules(remove_duplicate=False):
        add(name, type(module).__module__, type(module).__qualname__)
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("_") or attr == "training":
                continue
            if isinstance(value, torch.Tensor | np.ndarray):  # a tensor kept outside the buffers: by its bytes
                add(attr, value.dtype, tuple(value.shape))
                h.update(_bytes(torch.as_tensor(value)))
                continue
            if callable(value) and hasattr(value, "__qualname__"):  # a function: by its name (its code is hashed)
                value = f"{getattr(value, '__module__', '')}.{value.__qualname__}"
            text = repr(value)
            if " at 0x" in text or "..." in text:  # no value repr, or a summarized one: nothing to key it by
                return None
            add(attr, text)
    seen: dict[tuple, str] = {}
    tensors = [
        *graph.module.named_parameters(remove_duplicate=False),
        *graph.module.named_buffers(remove_duplicate=False),
    ]
    for name, t in tensors:
        tie = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if tie in seen:
            add(name, "tied", seen[tie])
            continue
        seen[tie] = name
        add(name, t.dtype, tuple(t.shape))
        h.update(_bytes(t))
    for t in graph.example(EXPORT_SIZES, torch.Generator().manual_seed(0)):
        add(t.dtype, tuple(t.shape))
        h.update(_bytes(t))
    return h.hexdigest()


def _bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


@functools.cache
def _versions() -> tuple[str, ...]:
    import onnx

    try:
        import onnxscript

        script = onnxscript.__version__
    except ImportError:
        script = "-"
    return (torch.__version__, onnx.__version__, script, f"{sys.version_info[0]}.{sys.version_info[1]}")


@functools.cache
def _code_digest() -> str:
    h = hashlib.blake2b(digest_size=20)
    for package in TRACED_BY:
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()


class _Locked:
    """An exclusive lock on `path` (fcntl), taken when made, released at the end of a `with` block."""

    def __init__(self, path: Path) -> None:
        import fcntl

        self.file = open(path, "w")  # noqa: SIM115 (held open until released)
        fcntl.flock(self.file, fcntl.LOCK_EX)

    def __enter__(self) -> _Locked:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()  # closing releases the lock


def _limit_bytes() -> float:
    try:
        return float(os.environ.get(TRACE_CACHE_GB_ENV, "8")) * 2**30
    except ValueError:
        return 8 * 2**30


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def _evict(folder: Path, keep: Path) -> None:
    """Delete the least recently used entries until the cache is within its limit: never `keep`, nor an entry another
    process holds (its lock taken without waiting)."""
    import fcntl

    entries = [e for e in folder.iterdir() if e.is_dir() and not e.name.startswith(".")]
    sizes = {e: _size(e) for e in entries}
    total = sum(sizes.values())
    for e in sorted(entries, key=lambda e: e.stat().st_mtime):
        if total <= _limit_bytes():
            break
        if e == keep:
            continue
        with open(folder / f".{e.name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(e, ignore_errors=True)
            total -= sizes[e]
