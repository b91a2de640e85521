"""ONNX Runtime speculative vs plain decoding on the embedded default, CPU (the target: SmolLM2 +
smollm2-clover2 at least 2x faster than ORT plain decoding; ORT plain faster than torch plain).

  python benchmarks/ort_speedup.py [--fp32-drafts] [clover-bench options...]

Exports SmolLM2 + smollm2-clover2 once (the `make demo` artifact: int8 draft graphs, cached), then runs
`clover-bench --artifact` on ORT over several trees and torch plain, all in one run; prints the table
and writes benchmarks/results/ort_speedup.json. --fp32-drafts uses an artifact with fp32 draft graphs.
"""

import sys
from pathlib import Path

from clover.tools.bench import main
from clover.tools.demo import cached_artifact

if __name__ == "__main__":
    argv = sys.argv[1:]
    fp32 = "--fp32-drafts" in argv
    argv = [a for a in argv if a != "--fp32-drafts"]
    artifact = cached_artifact("smollm2", "smollm2-clover2", weights=None, draft_quant=None if fp32 else "int8")
    name = "ort_speedup_fp32_drafts.json" if fp32 else "ort_speedup.json"
    defaults = [
        "--artifact",
        str(artifact),
        "--backend",
        "ort,torch:plain",
        "--tree",
        "chain-1,chain-2,chain-3,small,mc26",
        "--prompts",
        "mtbench",
        "--num-prompts",
        "16",
        "--max-new-tokens",
        "128",
        "--threads",
        "2",
        "--json",
        str(Path(__file__).parent / "results" / name),
    ]
    sys.exit(main(defaults + argv))  # later options override the defaults
