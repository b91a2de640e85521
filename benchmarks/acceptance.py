"""Acceptance length and speedup of the shipped SmolLM2 heads on MT-Bench, the 26-node tree (the papers report
3+ tokens/step for Clover-2 there, and Clover-2 > Clover > Medusa at the same tree).

  python benchmarks/acceptance.py [--num-prompts N] [--max-new-tokens N] [clover-bench options...]

A thin preset over `clover-bench`: prints its table and writes benchmarks/results/acceptance.json.
"""

import sys
from pathlib import Path

from clover.tools.bench import main

DEFAULTS = [
    "--base",
    "smollm2",
    "--heads",
    "smollm2-medusa,smollm2-clover,smollm2-clover2",
    "--tree",
    "mc26",
    "--prompts",
    "mtbench",
    "--num-prompts",
    "16",
    "--max-new-tokens",
    "128",
    "--threads",
    "2",
    "--json",
    str(Path(__file__).parent / "results" / "acceptance.json"),
]

if __name__ == "__main__":
    sys.exit(main(DEFAULTS + sys.argv[1:]))  # later options override the defaults
