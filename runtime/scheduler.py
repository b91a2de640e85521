"""Continuous batching: which requests run in the next step, and what each one speculates.

Requests wait in a bounded queue, join the running batch whenever a slot is free (at any step: their
prompts are prefilled, then they decode with the others) and leave as soon as they end (EOS, stop string,
max tokens, a full context, or cancellation), freeing their slot for the next one. numpy only, no engine
calls: `clover.runtime.engine` runs the steps this module plans.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from clover.errors import CloverError
from clover.runtime.cost import VerifyCost
from clover.runtime.generator import GenerationResult, Progress
from clover.runtime.grammar import GrammarState
from clover.runtime.logprobs import TokenLogprob
from clover.runtime.loop import Decoding, Step
from clover.runtime.output import OutputTracker, StopConditions
from clover.runtime.sampling import SamplingParams
from clover.runtime.tree import Tree, prune_tree


class QueueFull(CloverError):
    """The waiting queue is full: retry later (a server answers 429 / 503 with Retry-After)."""


class Cancelled(CloverError):
    """The request was cancelled before it finished."""


class EngineUnavailable(CloverError):
    """The engine takes no more requests: it was closed, or its loop stopped on an error (a server answers 503)."""


@dataclass(frozen=True)
class StreamDelta:
    """What one step added to a request's output: text that can no longer change, and the new token ids; with
    log-probabilities asked for, those of the tokens whose text this delta completes (`logprobs`: text that is held
    back, a possible stop string or an incomplete character, holds back its tokens' log-probabilities too, so
    they may lag `token_ids`; all of them are out once the stream ends)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(eq=False)
class Request:
    """One generation request and its progress; `deliver` hands its stream deltas and its end to the caller."""

    prompt: np.ndarray  # [P] int64
    stop: StopConditions
    sampling: SamplingParams
    tracker: OutputTracker
    deliver: Callable[[StreamDelta | GenerationResult | BaseException], None]
    progress: Progress
    cancelled: threading.Event = field(default_factory=threading.Event)
    decoding: Decoding | None = None  # set when it joins the batch
    sent: int = 0  # token ids delivered so far
    id: str | None = None  # the caller's name for it (a server's response id), for the engine's log
    logprobs: int | None = None  # alternatives per token's log-probability (None: no log-probabilities)
    token_logprobs: list[TokenLogprob] | None = None  # one per kept token, when asked for
    logprobs_sent: int = 0  # log-probabilities delivered so far (with the text that shows their tokens)
    grammar: GrammarState | None = None  # what its output must match (compiled at submission)
    # another request of the same prompt whose prefill this one copies (Runner.fork) instead of running its own
    share: Request | None = None
    fork_at: int | None = None  # a follower forks this request's caches after this many prompt tokens
    prompt_logprobs: int | None = None  # alternatives per prompt token's log-probability (None: none)
    prompt_steps: list = field(default_factory=list)  # their StepLogprobs, chunk by chunk


def check_max_batch(max_batch: int) -> None:
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise CloverError(f"max_batch must be an int >= 1 (sequences decoded at once), got {max_batch!r}")


class Scheduler:
    """The waiting queue (bounded) and the running batch (at most `max_batch`). Thread-safe: callers submit
    from any thread; the engine's loop thread plans and retires."""

    def __init__(self, max_batch: int, max_waiting: int) -> None:
        check_max_batch(max_batch)
        if max_waiting < 0:
            raise CloverError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.lock = threading.Condition()
        self.refusing: EngineUnavailable | None = None  # set once the engine closes or dies: every submit raises it

    def submit(self, request: Request) -> None:
        with self.lock:
            if self.refusing is not None:
                raise self.refusing
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(
                    f"the engine's queue is full ({self.max_waiting} requests waiting, {len(self.running)} "
                    "running): retry later, or raise max_waiting / max_batch"
                )
            self.waiting.append(request)
            self.lock.notify_all()

    def admit(self) -> list[Request]:
        """Move waiting requests into the batch while there is room (first come, first served); cancelled
        ones are dropped here."""
        with self.lock:
            joined = []
            while self.waiting and len(self.running) < self.max_batch:
                r = self.waiting.popleft()
                if r.cancelled.is_set():
                    r.deliver(Cancelled("the request was cancelled"))
                    continue
                self.running.append(r)
                joined.append(r)
            return joined

    def retire(self, request: Request) -> None:
        with self.lock:
            self.running.remove(request)
            self.lock.notify_all()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running


def kv_plan(max_batch: int, context: int, bytes_per_token: int) -> str:
    """One line: the KV memory the engine may use at most (every slot at full context)."""
    total = max_batch * context * bytes_per_token
    return (
        f"KV cache plan: up to {max_batch} sequences x {context} tokens x {bytes_per_token / 1024:.1f} KiB/token "
        f"= {total / 2**20:.0f} MiB at most (allocated as sequences grow)"
    )


# -- what each sequence speculates ------------------------------------------------------------------------


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
        """One verified tree and its accepted path (root first)."""
        self.version += 1
        for d in range(1, tree.max_depth + 1):
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
        self.mine: dict[int, RankAcceptance] = {}
        self._cache: dict[int, tuple[tuple[int, int], np.ndarray]] = {}
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
        hit = self._cache.get(id(d))
        if hit is None or hit[0] != key:
            hit = self._cache[id(d)] = (key, self.expected_tokens(mine.q(self.engine)))
        return hit[1]

    def _acceptance(self, d: Decoding) -> RankAcceptance:
        a = self.mine.get(id(d))
        if a is None:
            a = self.mine[id(d)] = RankAcceptance(self.engine.hits.shape[0] - 1, self.engine.hits.shape[1])
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
        self.mine.pop(id(d), None)
        self._cache.pop(id(d), None)
