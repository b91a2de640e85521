"""What a verify forward costs on this backend and machine: a curve of milliseconds by new rows, measured at
start-up (`calibrate`) and cached across loads per artifact and machine (`verify_cost`). `--tree auto`
and dynamic trees (clover.runtime.policy, clover.runtime.proposers) size speculation by it. numpy only."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from clover import atomic
from clover.cache import cache_dir
from clover.errors import CloverError
from clover.runtime.backend import Runner

# "0" (or "off", "false", "no"): measure the curve at every load, never reading or writing the cache
COST_CACHE_ENV = "CLOVER_COST_CACHE"


class VerifyCost:
    """Milliseconds of one verify forward by the new rows it runs: a curve measured at start-up for this
    backend and machine (`points`: rows -> ms, one sequence), interpolated linearly (and extrapolated with the
    slope of its upper half), times a correction per batch size learned from the steps the engine runs (a batch of B
    sequences also runs B attention blocks, and the machine's speed drifts)."""

    def __init__(self, points: dict[int, float]) -> None:
        if not points:
            raise CloverError("a verify-cost curve needs at least one measured point")
        self.rows = np.array(sorted(points), dtype=np.float64)
        self.ms = np.array([points[int(r)] for r in self.rows])
        self.correction: dict[int, float] = {}
        self.source = "given"  # where the points came from (verify_cost): measured, this runner, or a cache file

    def curve(self, rows: float) -> float:
        r, m = self.rows, self.ms
        if len(r) == 1:
            return float(m[0] * rows / r[0])
        if rows > r[-1]:  # beyond the last point: the slope fitted over the upper half (one noisy point can't tilt it)
            upper = r >= r[-1] / 2
            slope = np.polyfit(r[upper], m[upper], 1)[0] if upper.sum() >= 2 else (m[-1] - m[-2]) / (r[-1] - r[-2])
            return float(m[-1] + max(slope, 0.0) * (rows - r[-1]))
        return float(np.interp(rows, r, m))

    def __call__(self, rows: int, sequences: int) -> float:
        return self.curve(rows) * self.correction.get(sequences, 1.0)

    def observe(self, rows: int, sequences: int, ms: float) -> None:
        ratio = ms / max(self.curve(rows), 1e-6)
        old = self.correction.get(sequences)
        self.correction[sequences] = ratio if old is None else 0.9 * old + 0.1 * ratio

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows_ms": {int(r): round(float(m), 3) for r, m in zip(self.rows, self.ms)},
            "correction_by_batch": {b: round(c, 3) for b, c in sorted(self.correction.items())},
        }


def calibrate(runner: Runner, max_rows: int, reps: int = 7) -> VerifyCost:
    """The verify-cost curve of this runner on this machine: ms of a forward of R new rows (one sequence, a chain,
    after a 32-token prompt) for R from 1 to `max_rows`. Each repetition measures every R in turn, so drift on a
    shared machine touches all points alike, and each point is its median run, made non-decreasing in R: the
    shape is what sizes drafts (the level is corrected from real steps, VerifyCost.observe). Runs taken point after
    point gave curves that fell and rose with the machine's drift, and each point's fastest run a curve too flat at
    few rows, so that prompt lookup verified too little (measured: docs/experiments.md, 2026-11-26 "measuring the
    verify-cost curve")."""
    rng = np.random.default_rng(0)
    V = runner.info.vocab_size
    rows = sorted(
        {r for r in (1, 2, 3, 4) if r < max_rows}
        | {max_rows}
        | {round(1.5**k) for k in range(4, 40) if 1.5**k < max_rows}
    )
    slot = runner.open_slot(min(runner.info.max_context, 32 + max_rows + 2))
    try:
        prompt = rng.integers(0, V, 32)
        runner.forward(prompt, np.arange(32), np.tri(32, dtype=bool), last_only=True, slot=slot)
        runner.commit(np.arange(32), prompt, slot=slot)
        times: dict[int, list[float]] = {r: [] for r in rows}
        for _ in range(reps):
            for r in rows:
                tokens = rng.integers(0, V, r)
                t0 = time.perf_counter()
                runner.forward(tokens, np.arange(r), np.tri(r, dtype=bool), slot=slot)
                times[r].append(time.perf_counter() - t0)
    finally:
        runner.release(slot)
    ms = np.maximum.accumulate([float(np.median(times[r])) * 1e3 for r in rows])
    return VerifyCost(dict(zip(rows, map(float, ms))))


_MEASURED: weakref.WeakKeyDictionary[Runner, dict[int, float]] = weakref.WeakKeyDictionary()


def verify_cost(runner: Runner, max_rows: int) -> VerifyCost:
    """This runner's verify-cost curve up to `max_rows`: measured once per runner (`calibrate`: seconds on a small
    model, tens of seconds on a real one; docs/experiments.md, 2026-11-27 "the verify-cost curve cached") and
    measured again only when a longer curve is asked for. A measured curve is kept in the user cache under the
    runner's `cost_key`, this machine and `max_rows`, and a later load with the same key reads it instead of
    measuring (COST_CACHE_ENV=0: never). The level of the curve is corrected online from the engine's real steps
    either way (VerifyCost.observe). Each caller gets its own VerifyCost, so the per-batch corrections one engine
    learns stay its own; `source` says where the points came from."""
    points = _MEASURED.get(runner)
    source = "measured earlier on this runner"
    if points is None or max(points) < max_rows:
        points, source = _cached_or_measured(runner, max_rows)
        _MEASURED[runner] = points
    cost = VerifyCost(points)
    cost.source = source
    return cost


def cost_cache_enabled() -> bool:
    return os.environ.get(COST_CACHE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def machine() -> dict[str, Any]:
    """What a forward's speed depends on in the machine: the CPU model, the logical CPUs this process may use, the
    architecture and the OS."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cpus": cpus, "arch": platform.machine(), "os": platform.system()}


def cost_cache_file(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir() / "verify-cost" / f"{digest}.json"


def _cached_or_measured(runner: Runner, max_rows: int) -> tuple[dict[int, float], str]:
    if runner.info.cost_key is None or not cost_cache_enabled():
        t0 = time.perf_counter()
        return calibrate(runner, max_rows).to_dict()["rows_ms"], f"calibrated in {time.perf_counter() - t0:.1f} s"
    key = {"runner": runner.info.cost_key, "machine": machine(), "max_rows": max_rows}
    path = cost_cache_file(key)
    points = _read_curve(path, key)
    if points is not None:
        return points, f"read from {path}"
    t0 = time.perf_counter()
    points = calibrate(runner, max_rows).to_dict()["rows_ms"]
    took = time.perf_counter() - t0
    doc = {"key": key, "rows_ms": {str(r): m for r, m in points.items()}, "calibration_seconds": round(took, 2)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, json.dumps(doc, indent=1) + "\n")
        return points, f"calibrated in {took:.1f} s, cached in {path}"
    except (OSError, CloverError) as e:  # a read-only or full cache costs the next load a calibration, nothing more
        return points, f"calibrated in {took:.1f} s (not cached: {e})"


def _read_curve(path: Path, key: dict[str, Any]) -> dict[int, float] | None:
    """The points cached at `path` for exactly `key`; None if missing, another key's, or not a sane curve."""
    try:
        doc = json.loads(path.read_text())
        if doc["key"] != key:
            return None
        points = {int(r): float(m) for r, m in doc["rows_ms"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    rows = sorted(points)
    ms = [points[r] for r in rows]
    sane = rows and rows[0] >= 1 and max(rows) >= key["max_rows"] and all(math.isfinite(m) and m > 0 for m in ms)
    return points if sane and all(a <= b for a, b in zip(ms, ms[1:])) else None
