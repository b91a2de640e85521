"""Draft sources side by side: the artifact's Clover-2 heads, prompt lookup alone, and both in one
tree (heads "+lookup"), against plain decoding of the same graph, on MT-Bench and on a code prompt set
(benchmarks/prompts/code.jsonl: completions and edits, where answers repeat their prompt); each on the export
as it is and on its copy with the shipped corpora's extras (tools/demo.with_corpus over SHIPPED_CORPORA, as the
demo: the n-gram store prompt lookup falls back to, and the heads' 8192-token draft vocabulary).

  python benchmarks/drafts.py [--artifact DIR] [--tree chain-2] [--num-prompts 16] [--max-new-tokens 128]

Each prompt set is one clover-bench run (every mode of both artifacts interleaved per prompt, same machine; they
share one plain run, their base graphs being the same files); greedy identity with plain decoding is checked for
every request. Writes benchmarks/results/drafts_{int4,fp32}_{mtbench,code}.json.
Default artifact: the demo's export (int4, fused attention: chains only, so a merged tree stays a chain).
"""

import argparse
import sys
from pathlib import Path

from clover.tools.bench import main
from clover.tools.demo import SHIPPED_CORPORA, cached_artifact, with_corpus

HERE = Path(__file__).parent
SETS = {"mtbench": "mtbench", "code": str(HERE / "prompts" / "code.jsonl")}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--artifact", default=None, help="default: the demo's (int4); --precision fp32: the fp32 graph with int8 drafts"
    )
    p.add_argument("--precision", choices=("int4", "fp32"), default="int4")
    p.add_argument("--tree", default="chain-2")
    p.add_argument("--num-prompts", default="16")
    p.add_argument("--max-new-tokens", default="128")
    p.add_argument("--sets", default="mtbench,code")
    a = p.parse_args()
    artifact = a.artifact or str(
        cached_artifact(
            "smollm2", "smollm2-clover2", **({} if a.precision == "int4" else {"weights": None, "draft_quant": "int8"})
        )
    )
    artifacts = f"{artifact},{with_corpus(Path(artifact), SHIPPED_CORPORA)}"
    worst = 0
    for name in a.sets.split(","):
        print(f"\n== {name}", flush=True)
        worst = max(
            worst,
            main(
                [
                    "--artifact",
                    artifacts,
                    "--backend",
                    "ort",
                    "--heads",
                    "artifact,lookup,+lookup",
                    "--tree",
                    a.tree,
                    "--prompts",
                    SETS[name],
                    "--num-prompts",
                    a.num_prompts,
                    "--max-new-tokens",
                    a.max_new_tokens,
                    "--threads",
                    "2",
                    "--json",
                    str(HERE / "results" / f"drafts_{a.precision}_{name}.json"),
                ]
            ),
        )
    sys.exit(worst)
