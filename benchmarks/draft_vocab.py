"""Draft vocabulary sizes side by side: the demo's int4 artifact as exported (the heads draft
over all 49,152 tokens) and copies of it whose heads draft over the K tokens the base emits most often in
data/smollm2-sharegpt, for several K, in one clover-bench run (every artifact interleaved per prompt; the copies
share the original's base graph, so one plain run is every artifact's reference).

  python benchmarks/draft_vocab.py [--sizes 2048,4096,8192,16384] [--tree chain-2] [--num-prompts 16]

Writes benchmarks/results/draft_vocab_int4.json. K trades acceptance (a token outside the K is never drafted)
against draft cost (the draft LM head and its top-k scale with K): pick the K with the most tokens/s.
"""

import argparse
import sys
from pathlib import Path

from clover.export.draft_vocab import with_draft_vocab
from clover.models.smollm2 import cache_dir
from clover.tools.bench import main
from clover.tools.demo import cached_artifact
from clover.tools.export import DEFAULT_CORPUS, corpus_sources

HERE = Path(__file__).parent

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2048,4096,8192,16384")
    p.add_argument("--tree", default="chain-2")
    p.add_argument("--prompts", default="mtbench")
    p.add_argument("--num-prompts", default="16")
    p.add_argument("--max-new-tokens", default="128")
    p.add_argument("--data", type=Path, default=HERE.parent / DEFAULT_CORPUS)
    a = p.parse_args()
    base = cached_artifact("smollm2", "smollm2-clover2")
    counts = corpus_sources(a.data, store=False)[1]
    artifacts = [base]
    for k in (int(x) for x in a.sizes.split(",")):
        out = cache_dir() / "artifacts" / f"{base.name}-dv{k}"
        print(f"draft vocabulary {k}: {out}", file=sys.stderr, flush=True)
        artifacts.append(with_draft_vocab(base, out, counts, k))
    sys.exit(
        main(
            [
                "--artifact",
                ",".join(map(str, artifacts)),
                "--backend",
                "ort",
                "--tree",
                a.tree,
                "--prompts",
                a.prompts,
                "--num-prompts",
                a.num_prompts,
                "--max-new-tokens",
                a.max_new_tokens,
                "--threads",
                "2",
                "--json",
                str(HERE / "results" / "draft_vocab_int4.json"),
            ]
        )
    )
