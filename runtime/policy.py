"""What learns online while sequences decode, in one place: which tree each sequence speculates (`FixedTrees`,
`AutoTrees` with `RankAcceptance`), how much of a prompt-lookup proposal to verify and whether heads+lookup drafts
the heads at all (`LookupLength`), and what a dynamic tree's draft probabilities are worth (`DraftConfidence`). Each
is shared by the sequences of one Engine or Generator; what is a sequence's own is keyed by its `Decoding` and
dropped by `forget`. The verify-cost curve they size speculation by is measured in clover.runtime.cost. numpy only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from clover.runtime.cost import VerifyCost
from clover.runtime.proposers import Proposal
from clover.runtime.results import Step
from clover.runtime.tree import DynamicTree, Tree, prune_tree


class Decoding(Protocol):
    """What the policy reads of a sequence (runtime/state.Decoding), its identity keying the sequence's own
    estimates."""

    tree: Tree | DynamicTree
    lookup_length: LookupLength | None

    @property
    def prefilling(self) -> bool: ...


class RankAcceptance:
    """Online acceptance by depth and rank: q[d, r] = P(the rank-r draft at depth d is the accepted token |
    its parent was accepted), counted over verified trees, with `prior` pseudo-counts of `prior_q`."""

    def __init__(self, depth: int, ranks: int, prior_q: float = 0.3, prior: float = 8.0) -> None:
        self.hits = np.zeros((depth + 1, ranks))
        self.trials = np.zeros((depth + 1, ranks))
        self.version = 0  # bumped by every observation
        self.prior_q, self.prior = prior_q, prior

    def q(self, base: RankAcceptance | None = None) -> np.ndarray:
        """[depth + 1, ranks] estimates; shrunk toward `base`'s (a sequence's own toward the engine's)."""
        prior = base.q() if base is not None else self.prior_q
        return (self.hits + self.prior * prior) / (self.trials + self.prior)

    def observe(self, tree: Tree, path: np.ndarray) -> None:
        """One verified tree and its accepted path (root first). Depths past the table's (a grammar's forced
        chain runs deeper than any tree the policy chooses) are not counted."""
        self.version += 1
        for d in range(1, min(tree.max_depth, self.trials.shape[0] - 1) + 1):
            if d - 1 >= len(path):
                break
            kids = tree.children[int(path[d - 1])]
            ranks = tree.rank[kids]
            ok = ranks < self.trials.shape[1]
            self.trials[d, ranks[ok]] += 1
            if d < len(path):
                r = int(tree.rank[int(path[d])])
                if r < self.hits.shape[1]:
                    self.hits[d, r] += 1


class FixedTrees:
    """Every sequence speculates its own tree at every step (the engine's `tree`)."""

    name = "fixed"

    def choose(self, batch: Sequence[Decoding]) -> list[Tree]:
        return [d.tree for d in batch]

    def observe(self, batch: Sequence[Decoding], steps: Sequence[Step]) -> None:
        pass

    def forget(self, d: Decoding) -> None:
        pass


EXPLORE_WITHIN = 0.85  # a sequence explores a deeper level only where the predicted rate keeps this share


class AutoTrees:
    """--tree auto: each step, every sequence's tree, from plain up to `full` pruned by depth, chosen to
    maximise the tokens the whole batch emits per second: expected tokens from acceptance measured online
    (per depth and rank; each sequence's own, shrunk toward the engine's), cost from the verify-cost curve
    plus each level's measured drafting time. Plain is always a candidate and a deeper level is taken only
    when it raises the predicted rate, so speculation does not cost throughput. Every `explore`-th step one
    sequence (in turn) tries one level deeper than chosen if that is predicted to keep at least EXPLORE_WITHIN
    of the rate, so acceptance stays measured near the break-even point at a bounded cost. Unmeasured drafting
    costs start at a tenth of a 1-row verify per drafted depth."""

    name = "auto"

    def __init__(self, full: Tree, cost: VerifyCost, explore: int = 32) -> None:
        self.levels = [prune_tree(full, d) for d in range(full.max_depth + 1)]
        self.cost, self.explore = cost, explore
        ranks = max(full.max_children, 1)
        self.engine = RankAcceptance(full.max_depth, ranks)
        self.mine: dict[Decoding, RankAcceptance] = {}
        self._cache: dict[Decoding, tuple[tuple[int, int], np.ndarray]] = {}
        self.clock = 0
        # per level: [n, depth] rank paths of its nodes (root excluded), -1 padded: expected tokens are
        # 1 + sum over nodes of the product of q[d, rank at depth d] along the node's path
        self._paths = []
        for t in self.levels:
            paths = np.full((t.num_nodes - 1, max(t.max_depth, 1)), -1, dtype=np.int64)
            for i, c in enumerate(t.choices):
                paths[i, : len(c)] = c
            self._paths.append(paths)
        one_row = cost.curve(1)
        self.draft_ms = np.array([0.1 * one_row * lv for lv in range(len(self.levels))])  # per sequence, by level
        self._draft_seen = np.zeros(len(self.levels))

    def expected_tokens(self, q: np.ndarray) -> np.ndarray:
        """[levels] tokens one step emits at each level for acceptance estimates q [depth + 1, ranks]."""
        out = np.ones(len(self.levels))
        for lv, paths in enumerate(self._paths):
            if len(paths):
                d = np.arange(1, paths.shape[1] + 1)
                probs = np.where(paths >= 0, q[np.minimum(d, q.shape[0] - 1)[None], np.maximum(paths, 0)], 1.0)
                out[lv] += probs.prod(axis=1).sum()
        return out

    def choose(self, batch: Sequence[Decoding]) -> list[Tree]:
        B = len(batch)
        # Sequences still prefilling step plain, and their prompt rows are left out of the choice: a step made
        # long by a prompt would make any drafting look cheap beside it, for that one step.
        decoding = [i for i, d in enumerate(batch) if not d.prefilling]
        level = np.zeros(B, dtype=np.int64)
        if not decoding:
            return [self.levels[0]] * B
        tokens = np.zeros((B, len(self.levels)))
        for i in decoding:
            tokens[i] = self._expected(batch[i])  # [levels]
        nodes = np.array([t.num_nodes for t in self.levels])
        draft_ms = np.maximum.accumulate(self.draft_ms)  # a deeper tree drafts at least as long as a shallower one
        n = len(decoding)  # the cost curve's batch: the sequences decoding
        rows, drafted, emitted = n, 0.0, float(n)
        rate = emitted / (self.cost(rows, n) + drafted)
        while True:  # greedy: the one change (a sequence to a deeper level) that raises the rate most
            best = None
            for i in decoding:
                for lv in range(level[i] + 1, len(self.levels)):
                    r = rows + nodes[lv] - nodes[level[i]]
                    dr = drafted + draft_ms[lv] - draft_ms[level[i]]
                    new = (emitted + tokens[i, lv] - tokens[i, level[i]]) / (self.cost(r, n) + dr)
                    if new > rate * 1.001 and (best is None or new > best[0]):
                        best = (new, i, lv, r, dr)
            if best is None:
                break
            rate, i, lv, rows, drafted = best
            emitted += tokens[i, lv] - tokens[i, level[i]]
            level[i] = lv
        # exploration: every `explore` steps one sequence (in turn) tries one level deeper, where that is
        # predicted to keep most of the rate
        self.clock += 1
        if self.clock % self.explore == 0:
            i = decoding[(self.clock // self.explore) % len(decoding)]
            lv = level[i] + 1
            if lv < len(self.levels):
                r, dr = rows + nodes[lv] - nodes[level[i]], drafted + draft_ms[lv] - draft_ms[level[i]]
                if (emitted + tokens[i, lv] - tokens[i, level[i]]) / (self.cost(r, n) + dr) >= EXPLORE_WITHIN * rate:
                    level[i] = lv
        return [self.levels[lv] for lv in level]

    def _expected(self, d: Decoding) -> np.ndarray:
        """Expected tokens per level for `d`, recomputed only after its or the engine's counts changed."""
        mine = self._acceptance(d)
        key = (mine.version, self.engine.version)
        hit = self._cache.get(d)
        if hit is None or hit[0] != key:
            hit = self._cache[d] = (key, self.expected_tokens(mine.q(self.engine)))
        return hit[1]

    def _acceptance(self, d: Decoding) -> RankAcceptance:
        a = self.mine.get(d)
        if a is None:
            a = self.mine[d] = RankAcceptance(self.engine.hits.shape[0] - 1, self.engine.hits.shape[1])
        return a

    def observe(self, batch: Sequence[Decoding], steps: Sequence[Step]) -> None:
        rows = sum(st.rows for st in steps)
        verify = next((st.seconds["verify"] for st in steps if "verify" in st.seconds), None)
        if verify is not None:
            self.cost.observe(rows, len(batch), verify * 1e3)
        for d, st in zip(batch, steps):
            tree, path = (st.heads_tree, st.heads_path) if st.heads_tree is not None else (st.tree, st.path)
            if tree is None or tree.max_depth == 0:  # heads+lookup: only the heads' part counts here
                continue
            self.engine.observe(tree, path)
            self._acceptance(d).observe(tree, path)
            lv = min(tree.max_depth, len(self.levels) - 1)
            seen = self._draft_seen[lv]
            ms = st.draft_seconds * 1e3
            self.draft_ms[lv] = ms if seen == 0 else 0.9 * self.draft_ms[lv] + 0.1 * ms
            self._draft_seen[lv] += 1

    def forget(self, d: Decoding) -> None:
        self.mine.pop(d, None)
        self._cache.pop(d, None)


class LookupLength:
    """How many tokens of a lookup proposal to verify: as many as maximise expected tokens per verify millisecond
    on `cost` (rows -> ms: the runner's measured verify-cost curve, clover.runtime.cost). Extra rows are cheap on
    a bandwidth-bound base (fp32) and dear on a quantized one (int4), so one fixed length loses on one of them
    (the curves: docs/experiments.md). The chance that the next drafted token is accepted, given that the
    repeat so far is l tokens long (a match of L whose first j drafts were accepted is a repeat of L + j), is
    learned online from every verified proposal, starting from PRIOR; the store's drafts (match < 0) have their
    own estimates, by the length of the store's match plus the drafts before (an answer elsewhere that went on so).
    One per Generator or Engine: every sequence it decodes shares what it learns."""

    PRIOR, STRENGTH = 0.6, 4.0  # prior acceptance and its weight in pseudo-trials
    LONGEST = 24  # repeats this long and longer share one estimate
    # drafts="heads+lookup": whether to draft the heads beside the lookup path is learned from measured steps
    EXPLORE = 16  # every 16th choice of a kind takes the other arm, so both rates stay current
    WARMUP = 4  # steps each arm is tried first, per kind
    MARGIN = 1.05  # alone only when clearly faster: near-ties are within the rates' noise

    def __init__(self, cost: Callable[[int], float]) -> None:
        self.cost = cost
        # index l: repeats of l tokens in the sequence; LONGEST + 1 + l: the shipped store's, l tokens matched so far;
        # 2 (LONGEST + 1) + l: the served answers' (runtime/served_store.py)
        self.hits = np.zeros(3 * (self.LONGEST + 1))
        self.trials = np.zeros(3 * (self.LONGEST + 1))
        # [kind, arm (0: heads and lookup merged, 1: lookup alone), (tokens, ms, steps)]: running sums of what
        # steps of each kind of proposal (`kind`) emitted and took, per arm
        self.arms = np.zeros((4, 2, 3))
        self.choices = [0] * 4  # decisions per kind, after the warm-up

    def _repeats(self, match: int, n: int, served: bool = False) -> np.ndarray:
        at = np.minimum(abs(match) + np.arange(n), self.LONGEST)
        return at if match >= 0 else at + (2 if served else 1) * (self.LONGEST + 1)

    def choose(self, match: int, n: int, rows: int = 1, served: bool = False) -> int:
        """Tokens to verify of a proposal of n from a match of `match` tokens (< 0: a store's; `served`: the served
        answers'), beside `rows` other rows (the root, and a merged tree's head nodes)."""
        if n == 0:
            return 0
        at = self._repeats(match, n, served)
        q = (self.hits[at] + self.STRENGTH * self.PRIOR) / (self.trials[at] + self.STRENGTH)
        expected = 1.0 + np.concatenate(([0.0], np.cumsum(np.cumprod(q))))  # tokens per step verifying k = 0..n
        ms = np.array([self.cost(rows + k) for k in range(n + 1)])
        return int(np.argmax(expected / ms))

    @staticmethod
    def kind(match: int, n: int) -> int:
        """What the heads add depends on what the lookup offers: nothing, the store's drafts, a short repeat,
        a long one."""
        return 0 if n == 0 else 1 if match <= 0 else 2 if match < 4 else 3

    def alone(self, match: int, n: int) -> bool:
        """drafts="heads+lookup": whether this step should verify the lookup proposal (n tokens from a match of
        `match`; none: a plain step) alone, without drafting the heads. Decided by the tokens per millisecond
        measured so far on steps with this kind of proposal, each way: a long repeat (code, quoting) is right so
        often, and on a quantized base a step is so short, that the heads' drafting time can buy fewer tokens
        than it costs; on fp32 SmolLM2 they pay. A model of it (the verify-cost curve, the heads' time and
        their tokens beyond the lookup's) was tried first and went alone too often there."""
        k = self.kind(match, n)
        (tm, msm, nm), (ta, msa, na) = self.arms[k]
        if nm < self.WARMUP or na < self.WARMUP:
            return bool(nm >= self.WARMUP)  # the merged arm first, then the lone one
        self.choices[k] += 1
        go = bool(ta / msa > self.MARGIN * tm / msm)
        return go != (self.choices[k] % self.EXPLORE == 0)

    def observe_step(self, kind: int, alone: bool, tokens: int, ms: float) -> None:
        """A heads+lookup step with a proposal of `kind`: lookup `alone` or merged, its tokens and time."""
        self.arms[kind, int(alone)] += (tokens, ms, 1)

    def observe(self, match: int, proposal: Sequence[int], emitted: Sequence[int], served: bool = False) -> None:
        """A step's whole proposal (before `choose` cut it) beside the tokens the step emitted. The base's next
        tokens say whether each proposed token would have been accepted as far as the step emitted, so the
        tokens left out are learned from too (a repeat length once judged not worth a row is not judged so
        forever)."""
        n = min(len(proposal), len(emitted))
        right = next((j for j in range(n) if proposal[j] != emitted[j]), n)
        at = self._repeats(match, n, served)
        np.add.at(self.trials, at[: min(right + 1, n)], 1.0)
        np.add.at(self.hits, at[:right], 1.0)


class DraftConfidence:
    """What a dynamic tree's cumulative draft probabilities are worth (tree.DynamicTree): P(a verified node is
    accepted | its cumulative draft probability p), learned online in bins of log10 p (each bin starting from p
    itself, `prior` pseudo-trials), and the measured milliseconds of one draft call. Heads trained on little
    data are far from calibrated (SmolLM2's Clover-2 accepts more than its softmax says), so sizing trees by
    the raw probabilities verifies too little."""

    EDGES = np.linspace(-4.0, 0.0, 17)  # log10 p bins; below 1e-4 is the first

    def __init__(self, prior: float = 4.0) -> None:
        self.hits = np.zeros(len(self.EDGES) + 1)
        self.trials = np.zeros(len(self.EDGES) + 1)
        self.prior = prior
        self.draft_ms: float | None = None

    def _bins(self, p: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.EDGES, np.log10(np.maximum(p, 1e-12)))

    def __call__(self, p: np.ndarray) -> np.ndarray:
        """Calibrated acceptance probabilities of nodes with cumulative draft probabilities p."""
        p = np.asarray(p, dtype=np.float64)
        b = self._bins(p)
        return (self.hits[b] + self.prior * p) / (self.trials[b] + self.prior)

    def observe(self, p: np.ndarray, accepted: np.ndarray) -> None:
        """Verified nodes' cumulative draft probabilities and whether each was accepted."""
        b = self._bins(np.asarray(p, dtype=np.float64))
        np.add.at(self.trials, b, 1.0)
        np.add.at(self.hits, b, np.asarray(accepted, dtype=np.float64))

    def observe_draft(self, ms: float) -> None:
        self.draft_ms = ms if self.draft_ms is None else 0.9 * self.draft_ms + 0.1 * ms


def learn_from_step(d: Decoding, p: Proposal, st: Step, ms: float) -> None:
    """What one verified step of sequence `d` teaches the learners it shares: a dynamic tree's confidence (which
    nodes were accepted), prompt lookup's acceptance by repeat length (the whole proposal against what the step
    emitted), and heads+lookup's arms (the step's tokens and its `ms`)."""
    if p.draft.confidence is not None and isinstance(d.tree, DynamicTree) and d.tree.confidence is not None:
        d.tree.confidence.observe(p.draft.confidence[1:], np.isin(np.arange(1, p.tree.num_nodes), st.path))
    f = p.feedback
    if f.draft_call_ms is not None and isinstance(d.tree, DynamicTree) and d.tree.confidence is not None:
        d.tree.confidence.observe_draft(f.draft_call_ms)
    if f.lookup is not None:
        d.lookup_length.observe(
            f.lookup.match, f.lookup.proposal, st.tokens[: len(st.tokens) - st.free_end], f.lookup.served
        )
    if f.arm is not None:
        d.lookup_length.observe_step(f.arm.kind, f.arm.alone, len(st.tokens), ms)
