"""Export-time choice of an artifact's default tree and draft source, by timing: each candidate (plain decoding,
the heads' trees, prompt lookup alone, and the fastest tree with prompt lookup merged in) decodes a few chat prompts
greedily on the exported graphs, on ONNX Runtime on this machine, and the one with the most tokens per second
becomes the manifest's default tree and `drafts` (what the runtime drafts with when --heads is not given).

A tree pays only if its extra accepted tokens outweigh its cost (drafting plus a wider verify): on a
2-core CPU a 26-node verify costs ~3x a plain step, so mc26 halves speed there, while on a GPU it is
nearly free. Measuring on the graphs themselves settles it for the machine that exports; a default that
is slower than plain decoding is never recorded, since plain is a candidate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
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


def decode_seconds(
    runner, prompt: list[int], tree: Tree, new_tokens: int, drafts: str = "heads", lookup_length=None
) -> tuple[int, float]:
    """Tokens emitted after the prefill (at least `new_tokens`) and the seconds their steps took."""
    from clover.runtime.loop import LOOKUP_DRAFTS, speculative_steps
    from clover.runtime.params import GenerationParams

    tokens, seconds = 0, 0.0
    capacity = len(prompt) + new_tokens + tree.num_nodes + 1 + (LOOKUP_DRAFTS if drafts != "heads" else 0)
    prompt = np.array(prompt, dtype=np.int64)
    steps = speculative_steps(
        runner, prompt, tree, GenerationParams(), drafts, capacity=capacity, lookup_length=lookup_length
    )
    next(steps)  # the prefill
    for step in steps:
        tokens, seconds = tokens + len(step.tokens), seconds + step.wall
        if tokens >= new_tokens:
            break
    return tokens, seconds


@dataclass(frozen=True)
class Mode:
    """A candidate: a tree (plain, or the heads'), drafted by the heads, by prompt lookup, or both."""

    tree: Tree
    drafts: str = "heads"
    lookup_length: object = None

    @property
    def name(self) -> str:
        return {"heads": self.tree.name, "lookup": "lookup", "heads+lookup": f"{self.tree.name}+lookup"}[self.drafts]


def time_modes(runner, prompts: list[list[int]], modes: list[Mode]) -> dict[str, float]:
    """Tokens per second of each mode, over ROUNDS interleaved rounds (the order rotated per round)."""
    first = modes[-1]
    decode_seconds(runner, prompts[0], first.tree, 4, first.drafts, first.lookup_length)  # warm-up, off the clock
    totals = {m.name: [0, 0.0] for m in modes}
    for r in range(ROUNDS):
        for prompt in prompts:
            for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
                tokens, seconds = decode_seconds(runner, prompt, m.tree, NEW_TOKENS, m.drafts, m.lookup_length)
                totals[m.name][0] += tokens
                totals[m.name][1] += seconds
    return {name: round(n / s, 2) if s else 0.0 for name, (n, s) in totals.items()}


def fastest_tree(
    root: Path, manifest: Manifest, threads: int = 0, say: Callable[[str], None] | None = None
) -> tuple[Tree | None, str, dict]:
    """Time plain decoding, every candidate tree (with heads), prompt lookup alone, and (with heads) the fastest
    tree with prompt lookup merged in, on the artifact's graphs in `root` (its manifest given, not yet written,
    with its n-gram store if any); returns the default tree (None without heads), the default draft source
    ("heads", "lookup" or "heads+lookup") and the record of the timing for the manifest."""
    from clover.runtime.backends.ort import OrtOptions, OrtRunner
    from clover.runtime.configure import lookup_length
    from clover.runtime.loop import LOOKUP_DRAFTS, chain
    from clover.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(root / manifest.tokenizer)
    chat = tokenizer.has_chat_template  # a base model's tokenizer has none: its prompts are plain text
    prompts = [
        tokenizer.encode_chat([{"role": "user", "content": p}]) if chat else tokenizer.encode(p) for p in PROMPTS
    ]
    heads = manifest.heads is not None
    runner = OrtRunner(root, manifest, use_heads=heads, options=OrtOptions(threads=threads, checksums=False))
    try:
        trees = candidate_trees(manifest.heads.max_depth if heads else 0, runner.info.chains_only)
        speed = time_modes(runner, prompts, [Mode(t) for t in trees])
        best = max(trees, key=lambda t: speed[t.name])
        lookups = [Mode(chain(LOOKUP_DRAFTS), "lookup", lookup_length(runner, LOOKUP_DRAFTS, "lookup"))]
        if best.num_nodes > 1:
            lookups.append(Mode(best, "heads+lookup", lookup_length(runner, best.num_nodes, "heads+lookup")))
        # the fastest tree again, beside the lookups: one interleaved run decides between them
        versus = time_modes(runner, prompts, [Mode(best), *lookups])
    finally:
        runner.close()
    winner = max([Mode(best), *lookups], key=lambda m: versus[m.name])
    if say:
        for timed, what in ((speed, f"tree {best.name}"), (versus, f"default {winner.name}")):
            say("      " + ", ".join(f"{name} {tps:.1f}" for name, tps in timed.items()) + f" tok/s: {what}")
    return (
        (best if heads else None),
        winner.drafts,
        {
            "tokens_per_second": speed,
            "versus_lookup": versus,
            "chosen": winner.name,
            "drafts": winner.drafts,
            "prompts": len(prompts),
            "new_tokens": NEW_TOKENS,
            "rounds": ROUNDS,
            "threads": threads,
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
    )
