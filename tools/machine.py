"""The machine beside speed results: the CPU and its vector ISA, memory read bandwidth and the ceiling it puts on
plain decoding.

Decoding one sequence reads every weight once per forward, so on a CPU plain decoding is bound by bytes of weights
over read bandwidth (SmolLM2 fp32: ~540 MB per token). The bandwidth is measured in the run that reports speeds
(shared machines differ from run to run), by summing a float32 array in 1..N processes that start together.
The bytes a step reads are its graphs' initializers less the tables it only gathers from (`weight_bytes_per_token`).
Used by clover-bench and benchmarks/peers.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# /proc/cpuinfo flag -> the name results give it. oneDNN, MKL and ONNX Runtime's MLAS pick their kernels by these,
# so the last bits of a float result (and the speed) depend on them.
ISA_FLAGS = {
    "avx2": "AVX2",
    "fma": "FMA",
    "avx512f": "AVX-512",
    "avx512_vnni": "AVX512-VNNI",
    "avx_vnni": "AVX-VNNI",
    "avx512_bf16": "AVX512-BF16",
    "amx_tile": "AMX",
    "amx_int8": "AMX-INT8",
    "amx_bf16": "AMX-BF16",
}


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """{"model", "cores", "isa": [...]}: the CPU's model name, logical cores and vector ISA extensions (of ISA_FLAGS),
    from /proc/cpuinfo (Linux; elsewhere the model from platform and no ISA list)."""
    import os
    import platform

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "model": fields.get("model name") or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "isa": [name for flag, name in ISA_FLAGS.items() if flag in flags],
    }


def host() -> dict[str, Any]:
    """What results record beside themselves: the CPU (model, cores, vector ISA), the OS and Python, and the versions
    of the numeric libraries whose kernels produced them (None where not installed)."""
    import importlib
    import platform

    out: dict[str, Any] = {"cpu": cpu_info(), "platform": platform.platform(), "python": platform.python_version()}
    for name in ("numpy", "torch", "onnxruntime", "triton"):
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            out[name] = None
    return out


@dataclass(frozen=True)
class Bandwidth:
    """Read bandwidth of summing a float32 array (GB/s = 1e9 bytes/s), by the number of parallel readers."""

    array_bytes: int
    repeats: int
    samples_gbps: dict[int, tuple[float, ...]]  # readers -> one figure per repeat

    def best(self, threads: int) -> float:
        return max(self.samples_gbps[threads])


def bandwidth_limit(bandwidth_gbps: float, weight_bytes: int) -> float | None:
    """Tokens/s of plain decoding if every forward streamed the weights once at the measured bandwidth."""
    return bandwidth_gbps * 1e9 / weight_bytes if weight_bytes > 0 else None


def _timed_sums(n: int, repeats: int, barrier, queue) -> None:
    a = np.ones(n, dtype=np.float32)
    a.sum()  # pages touched before timing
    times = []
    for _ in range(repeats):
        barrier.wait()
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    queue.put(times)


def measure_bandwidth(array_bytes: int, repeats: int, readers: Sequence[int] = (1, 2)) -> Bandwidth:
    """Sum `array_bytes` of float32 `repeats` times, split over each of `readers` processes that start each sum together
    (processes, not threads: no GIL question); a sample is the bytes over the slowest reader's time."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    samples = {}
    for k in readers:
        barrier, queue = ctx.Barrier(k), ctx.Queue()
        procs = [
            ctx.Process(target=_timed_sums, args=(array_bytes // 4 // k, repeats, barrier, queue)) for _ in range(k)
        ]
        for proc in procs:
            proc.start()
        times = [queue.get(timeout=600) for _ in procs]
        for proc in procs:
            proc.join()
        samples[k] = tuple(round((array_bytes // 4 // k) * 4 * k / max(ts) / 1e9, 2) for ts in zip(*times))
    return Bandwidth(array_bytes, repeats, samples)


BANDWIDTH_BYTES = 1 << 29  # summed per bandwidth sample: well past the caches (~20 ms at 27 GB/s)


def read_bandwidth(readers: int) -> float:
    """GB/s read now by `readers` processes together (the best of 5 sums of BANDWIDTH_BYTES): what a step's weights
    stream at, beside the speeds of the same run."""
    return measure_bandwidth(BANDWIDTH_BYTES, repeats=5, readers=(readers,)).best(readers)


GATHERS = ("Gather", "GatherBlockQuantized")  # input 1: the indices; the others: the table (and its scales)


def weight_bytes_per_token(graphs: Sequence[Path]) -> int:
    """Bytes of weights one decode step reads from these ONNX graphs (their external data left on disk): every
    initializer, less the tables that are only gathered from, as a token embedding is (a step reads one row of it)."""
    import onnx

    total = 0
    for path in graphs:
        graph = onnx.load(str(path), load_external_data=False).graph
        uses: dict[str, list[tuple[str, int]]] = {}
        for node in graph.node:
            for i, name in enumerate(node.input):
                uses.setdefault(name, []).append((node.op_type, i))
        for t in graph.initializer:
            used = uses.get(t.name, [])
            if used and all(op in GATHERS and i != 1 for op, i in used):
                continue
            total += _tensor_bytes(t)
    return total


def _tensor_bytes(t) -> int:
    from onnx import helper

    external = {e.key: e.value for e in t.external_data}
    if "length" in external:
        return int(external["length"])
    if t.raw_data:
        return len(t.raw_data)
    count = 1
    for d in t.dims:
        count *= d
    return count * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize


def artifact_weight_bytes(artifact: Path) -> int:
    """Weights a plain decode step of an exported artifact reads: its base graph and the LM head it runs."""
    from clover.artifact import base_weight_files, read_manifest

    return weight_bytes_per_token(
        [f for f in base_weight_files(artifact, read_manifest(artifact)) if f.suffix == ".onnx"]
    )


def plain_limit_line(artifact: Path, readers: int) -> str:
    """One line: the artifact's plain decoding ceiling at the read bandwidth measured now with `readers` processes."""
    weights = artifact_weight_bytes(artifact)
    gbps = read_bandwidth(readers)
    return (
        f"plain decoding's memory-bandwidth limit here: {weights / 1e6:.0f} MB of weights per token at {gbps:.1f} GB/s "
        f"({readers} reader(s)) -> <= {bandwidth_limit(gbps, weights):.1f} tok/s; speculation verifies several "
        "tokens per read and can pass it"
    )


def relative_paths(doc: Any, root: Path | None = None) -> Any:
    """`doc` (a result or record about to be written as JSON) with every absolute path under `root` (default: the
    working directory) written relative to it, also inside strings that join several paths with commas: results
    that travel with the repository name no machine's folders."""
    base = str((root or Path.cwd()).resolve()) + "/"

    def rel(value: Any) -> Any:
        if isinstance(value, str):
            return ",".join(part.removeprefix(base) for part in value.split(","))
        if isinstance(value, dict):
            return {rel(k): rel(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [rel(v) for v in value]
        return value

    return rel(doc)
