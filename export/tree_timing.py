"""Export-time choice of an artifact's default tree, by timing: each candidate tree (plain included) decodes
a few chat prompts greedily on the exported graphs, on ONNX Runtime on this machine, and the one with the
most tokens per second becomes the manifest's default tree.

A tree pays only if its extra accepted tokens outweigh its cost (drafting plus a wider verify): on a
2-core CPU a 26-node verify costs ~3x a plain step, so mc26 halves speed there, while on a GPU it is
nearly free. Measuring on the graphs themselves settles it for the machine that exports; a default that
is slower than plain decoding is never recorded, since plain is a candidate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from clover.artifact import Manifest
from clover.runtime.tree import Tree, compile_tree, resolve_tree

CANDIDATES = ("chain-1", "chain-2", "chain-3", "small", "mc26")
PROMPTS = (
    "Give me three tips for staying healthy.",
    "Explain how a rainbow forms.",
    "Write a short poem about the sea.",
)
NEW_TOKENS = 40  # per prompt and tree, prefill excluded
ROUNDS = 2  # interleaved, so machine noise hits every tree alike


def candidate_trees(max_depth: int | None, chains_only: bool = False) -> list[Tree]:
    """Plain decoding and the named trees the heads can draft (Medusa / Clover heads have a fixed depth) and
    the base verifies exactly (RunnerInfo.chains_only)."""
    trees = [compile_tree([], name="plain")]
    return trees + [
        t
        for t in map(resolve_tree, CANDIDATES)
        if (max_depth is None or t.max_depth <= max_depth) and (t.is_chain or not chains_only)
    ]


def decode_seconds(runner, prompt: list[int], tree: Tree, new_tokens: int) -> tuple[int, float]:
    """Tokens emitted after the prefill (at least `new_tokens`) and the seconds their steps took."""
    from clover.runtime.loop import speculative_steps
    from clover.runtime.sampling import SamplingParams

    tokens, seconds = 0, 0.0
    capacity = len(prompt) + new_tokens + tree.num_nodes + 1
    steps = speculative_steps(
        runner, np.array(prompt, dtype=np.int64), tree, SamplingParams(), np.random.default_rng(0), capacity
    )
    next(steps)  # the prefill
    for step in steps:
        tokens, seconds = tokens + len(step.tokens), seconds + step.wall
        if tokens >= new_tokens:
            break
    return tokens, seconds


def fastest_tree(
    root: Path, manifest: Manifest, threads: int = 0, say: Callable[[str], None] | None = None
) -> tuple[Tree, dict]:
    """Time every candidate tree on the artifact's graphs in `root` (its manifest given, not yet written);
    returns the fastest and the record of the timing for the manifest."""
    from clover.runtime.ort_backend import OrtOptions, OrtRunner
    from clover.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(root / manifest.tokenizer)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    runner = OrtRunner(root, manifest, use_heads=True, options=OrtOptions(threads=threads, checksums=False))
    trees = candidate_trees(manifest.heads.max_depth if manifest.heads else None, runner.info.chains_only)
    decode_seconds(runner, prompts[0], trees[-1], 4)  # warm-up: first-run allocations off the clock
    totals = {t.name: [0, 0.0] for t in trees}
    for r in range(ROUNDS):
        for prompt in prompts:
            for tree in trees[r % len(trees) :] + trees[: r % len(trees)]:  # rotated per round
                tokens, seconds = decode_seconds(runner, prompt, tree, NEW_TOKENS)
                totals[tree.name][0] += tokens
                totals[tree.name][1] += seconds
    runner.close()
    speed = {name: round(n / s, 2) if s else 0.0 for name, (n, s) in totals.items()}
    best = max(trees, key=lambda t: speed[t.name])
    if say:
        say(
            "      "
            + ", ".join(f"{name} {tps:.1f}" for name, tps in speed.items())
            + f" tok/s: default tree {best.name}"
        )
    return best, {
        "tokens_per_second": speed,
        "chosen": best.name,
        "prompts": len(prompts),
        "new_tokens": NEW_TOKENS,
        "rounds": ROUNDS,
        "threads": threads,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
