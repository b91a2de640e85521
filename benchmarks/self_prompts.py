"""Prompts written by the base itself (Magpie style, arXiv 2406.08464), for `clover-data grow --prompts FILE`.

The base samples the user turn that follows its chat template's system turn and user header; each prompt is seeded
by its index, so a rerun on the same artifact writes the same file. Kept: prompts that end (EOS) within
--max-new-tokens, at least 4 tokens long, not seen before. The question they serve: whether training the heads
on answers to such prompts, closer to what the base is tuned to answer than ShareGPT's, moves their MT-Bench
acceptance (benchmarks/head_variants.py --corpus ...; docs/experiments.md).

  python benchmarks/self_prompts.py --count 2400 --out prompts.jsonl
  clover-data grow --prompts prompts.jsonl --out data/smollm2-magpie --target-tokens 420000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import clover
from clover.artifact import tokenizer_dir
from clover.runtime.params import EngineOptions, GenerationParams
from clover.runtime.sampling import SamplingParams
from clover.runtime.tokenizer import Tokenizer
from clover.tools.demo import cached_artifact


def seed_of(i: int) -> int:
    """The sampling seed of prompt i (spread out, so neighbouring prompts' generators share no state)."""
    return 1_000_003 * i + 7


def user_header(tokenizer: Tokenizer) -> list[int]:
    """The chat template's ids up to where a user's text starts (its default system turn included)."""
    marker = "\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=False)
    return tokenizer.encode(text[: text.index(marker)], add_special_tokens=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=2400, help="prompts sampled (about 80%% are kept)")
    p.add_argument("--out", type=Path, required=True, help="JSONL file written (one {'messages': [user]} per line)")
    p.add_argument("--artifact", type=Path, default=None, help="artifact that writes them (default: the demo's int4)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.count < 1 or args.out.is_dir():
        raise SystemExit(f"self_prompts: --count must be at least 1 and --out a file, got {args.count} and {args.out}")
    art = args.artifact or cached_artifact("smollm2", "smollm2-clover2")
    tok = Tokenizer.from_dir(tokenizer_dir(art))
    header = user_header(tok)
    from tqdm import tqdm

    with clover.Engine.load(
        art, heads="none", backend="ort", log=sys.stderr, options=EngineOptions(max_batch=8, threads=args.threads)
    ) as eng:

        def sample(i: int):
            return eng.generate(
                header,
                GenerationParams(
                    max_new_tokens=args.max_new_tokens,
                    sampling=SamplingParams(args.temperature, args.top_p, seed=seed_of(i)),
                ),
            )

        seen, tokens, t0 = set(), 0, time.monotonic()
        tmp = args.out.with_name(args.out.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f, ThreadPoolExecutor(10) as pool:
            for i, r in enumerate(
                tqdm(pool.map(sample, range(args.count)), total=args.count, desc="prompts", unit="prompt")
            ):
                tokens += len(r.token_ids)
                text = tok.decode(r.token_ids).strip()
                if r.finish_reason != "stop" or len(r.token_ids) < 4 or text in seen:
                    continue
                seen.add(text)
                f.write(json.dumps({"messages": [{"role": "user", "content": text}], "seed": seed_of(i)}) + "\n")
        tmp.replace(args.out)  # whole or not at all
    secs = time.monotonic() - t0
    print(
        f"kept {len(seen)} of {args.count} prompts ({tokens} tokens sampled in {secs:.0f} s, {tokens / secs:.0f} "
        f"tokens/s) -> {args.out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
