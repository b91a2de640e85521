"""clover-bench's replay: the deployed draft graphs' accuracy per depth, teacher-forced on this run's outputs.

clover-train's held-out accuracy comes from other prompts (its validation split) and every answer position, up
to several hundred tokens in: the late positions of long answers are the easy ones, so it reads well above what
a 128-token MT-Bench run can accept even without any skew. The replay removes those differences. Along each
prompt's plain greedy output it drafts exactly as a chain would after every token (begin graph, then each
depth's step graph fed the true tokens) and counts where the draft's top-1 / top-k is the base's next token.
So, beside live acceptance:
- held-out >> replay: the bench's prompts or positions are harder than the training split's (data);
- replay >> live d1: the loop feeds the heads something else than token-by-token decoding (a skew).
Depth 1 is also split by the base's own probability of the token drafted for: misses where the base is nearly
sure (p >= 0.9) are the heads' (what two layers cannot compute from the last hidden state and one token), misses
where it is unsure (p < 0.5) are hard for any draft.

It costs one plain step per output token plus the drafting, on the heads' own runner (lossless: the heads'
rows produce the plain output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from clover.runtime.backend import Runner
from clover.runtime.sampling import topk_tokens

REPLAY_TOPK = 3  # as clover-train's accuracy@k: a tree with 3 candidates at a depth catches these
CONFIDENCE_EDGES = (0.5, 0.9)  # depth 1 by the base's probability of its token: < 0.5, 0.5-0.9, >= 0.9


@dataclass
class ReplayCounts:
    """Per depth d: positions scored, drafts whose top-1 / top-REPLAY_TOPK held the base's next token, and
    positions whose top-1 drafts were right at every depth up to d (a chain of d drafts accepts them all)."""

    depths: int
    positions: list[int] = field(default_factory=list)
    top1: list[int] = field(default_factory=list)
    topk: list[int] = field(default_factory=list)
    chain: list[int] = field(default_factory=list)
    # depth 1 per bin of the base's probability of the token (CONFIDENCE_EDGES): positions, top-1 drafts right
    by_confidence: list[int] = field(default_factory=lambda: [0] * (len(CONFIDENCE_EDGES) + 1))
    top1_by_confidence: list[int] = field(default_factory=lambda: [0] * (len(CONFIDENCE_EDGES) + 1))

    def __post_init__(self) -> None:
        for name in ("positions", "top1", "topk", "chain"):
            if not getattr(self, name):
                setattr(self, name, [0] * self.depths)

    def add_confidence(self, p: float, right: bool) -> None:
        """Depth 1's draft for a token the base gave probability `p`."""
        b = int(np.searchsorted(CONFIDENCE_EDGES, p, side="right"))
        self.by_confidence[b] += 1
        self.top1_by_confidence[b] += int(right)

    def summary(self) -> dict:
        n = [max(1, p) for p in self.positions]
        share = lambda counts: [round(a / b, 4) for a, b in zip(counts, n)]  # noqa: E731
        edges = (0.0, *CONFIDENCE_EDGES, 1.0)
        bins = [
            {
                "p": [edges[i], edges[i + 1]],
                "share": round(c / max(1, sum(self.by_confidence)), 4),
                "top1": round(r / c, 4) if c else None,
            }
            for i, (c, r) in enumerate(zip(self.by_confidence, self.top1_by_confidence))
        ]
        return {
            "positions": self.positions,
            "top1": share(self.top1),
            f"top{REPLAY_TOPK}": share(self.topk),
            "chain": share(self.chain),
            "top1_by_base_probability": bins,
        }


def replay(runner: Runner, prompt: Sequence[int], output: Sequence[int], depths: int, counts: ReplayCounts) -> None:
    """Add to `counts` the heads' teacher-forced accuracy at depths 1..`depths` along `output`, the base's
    greedy continuation of `prompt` on this runner's graph. Depth d after output[i] drafts output[i + d]."""
    prompt, output = np.asarray(prompt, dtype=np.int64), np.asarray(output, dtype=np.int64)
    P, n = len(prompt), len(output)
    if n < 2:
        return
    vocab = runner.info.draft_vocab  # [K] full id of each draft logit column, or None
    runner.reset(P + n + 1)
    runner.forward(prompt, np.arange(P), np.tri(P, dtype=bool), last_only=True)
    runner.commit(np.arange(P), np.append(prompt[1:], output[0]))
    for i in range(n - 1):  # output[i] is the root: emitted, not yet in the cache
        logits, alive, first_right = runner.draft_begin()[None], True, False
        for d in range(1, min(depths, n - 1 - i) + 1):
            top = topk_tokens(logits, REPLAY_TOPK)[0]
            top = top if vocab is None else vocab[top]
            truth = output[i + d]
            alive = alive and bool(top[0] == truth)
            counts.positions[d - 1] += 1
            counts.top1[d - 1] += int(top[0] == truth)
            counts.topk[d - 1] += int(truth in top)
            counts.chain[d - 1] += int(alive)
            if d == 1:
                first_right = alive
            if d < depths and i + d < n - 1:  # the chain node at depth d holds the true token: draft its child
                logits = runner.draft_step(d, np.array([d]), np.array([d - 1]), np.array([truth]))
        base = runner.forward(
            output[i : i + 1], np.zeros(1, dtype=np.int64), np.ones((1, 1), dtype=bool), last_only=True
        )
        counts.add_confidence(token_probability(base[-1], int(output[i + 1])), first_right)  # depth 1 drafted it
        runner.commit(np.zeros(1, dtype=np.int64), output[i + 1 : i + 2])


def token_probability(logits: np.ndarray, token: int) -> float:
    """softmax(logits)[token], computed stably."""
    z = logits.astype(np.float64) - float(logits.max())
    return float(np.exp(z[token]) / np.exp(z).sum())
