"""The decoding step on a GPU, side by side in one run: clover's per-sequence torch runner (TorchRunner, the base's
forward in CUDA graphs), its stacked runner with the whole step on the device (BatchedTorchRunner, draft -> verify ->
accept -> commit in one CUDA graph), and transformers' `generate` (eager, and with its static cache, compiled) on the
same random weights of real shapes.

Rows, each written to the JSON report as soon as it is measured (a run cut short keeps what it measured):
  plain, batch 1        tokens/s, ms per step, the GPU's idle share of the step loop (135M shape)
  speculative, batch 1  ms per step of the default tree over the plain step's (135M; the 8B shape with mc26), and the
                        8B speedup projected with the shipped heads' tokens per step on the CPU
  engine                tokens/s at concurrency 1 and 32 (135M, the default tree), tokens identical
  identity              greedy speculative == plain for every head type on the stacked runner, batch 1 and the
                        engine at concurrency 8 and 32
  transformers          generate's tokens/s on the same weights, and clover's plain over its compiled one

    python benchmarks/gpu_step.py [--device cuda] [--json PATH]     # a GPU: bf16, CUDA graphs
    python benchmarks/gpu_step.py --device cpu --quick              # the same code on a tiny model (tests run it)

The summary's keys are the GPU report's `data.engine` (clover-doctor --full adds them there).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from clover.tools import gpu_profile as gp
from clover.tools.machine import host

RESULTS = Path(__file__).parent / "results"


class Report:
    """The JSON report, rewritten after every row."""

    def __init__(self, path: Path, device: str) -> None:
        self.path = path
        gpu = torch.cuda.get_device_name() if device == "cuda" else None
        self.data: dict = {
            "date": datetime.date.today().isoformat(),
            "gpu": gpu,
            "host": host(),
            "rows": {},
            "engine": {},
        }

    def row(self, name: str, value) -> None:
        self.data["rows"][name] = value
        print(f"{name}: {json.dumps(value)[:300]}", flush=True)
        self.write()

    def figure(self, key: str, value) -> None:
        self.data["engine"][key] = value if isinstance(value, bool) else round(float(value), 3)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="a tiny model, few tokens (the CPU test)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    stamp = datetime.date.today().isoformat()
    report = Report(args.json or RESULTS / f"gpu_step_{stamp}.json", args.device)
    gp.engine_step(args.device, args.quick, args.tokens, report.row, report.figure)
    return report.data


if __name__ == "__main__":
    main()
