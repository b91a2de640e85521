"""The speculate -> verify loop. numpy only: backends adapt engines to the Runner interface.

One step: draft a tree from the heads (depth by depth), verify it with one base forward, accept the
longest valid path (greedy) or run recursive rejection sampling (sampling), commit the accepted
path's KV, and carry the bonus token to the next step as the new root. Plain decoding is the same
loop with the root-only tree. With drafts="lookup" the drafts come from prompt lookup instead of heads
(runtime/lookup.py): each step verifies a chain of as many of the matched tokens as `tree` is deep (none
when nothing matches), a one-hot draft law for sampling.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from clover.runtime.acceptance import Acceptance, accept_greedy, accept_sampling
from clover.runtime.backend import Runner
from clover.runtime.lookup import PromptLookup
from clover.runtime.sampling import SamplingParams, probs_from_logits, sample_without_replacement, topk_tokens
from clover.runtime.tree import Tree, compile_tree, resolve_tree

PLAIN = compile_tree([], name="plain")
DRAFT_SOURCES = ("heads", "lookup")


@functools.cache
def chain(k: int) -> Tree:
    """The chain of k drafted tokens, plain for 0 (compiled once: lookup steps pick one per step)."""
    return resolve_tree(f"chain-{k}") if k else PLAIN


@dataclass
class Step:
    """What one model step emitted (the prefill is step 0) and where its time went."""

    tokens: list[int]
    tree_nodes: int  # nodes verified (1 for plain steps and the prefill)
    # draft / verify / accept / commit (prefill for step 0), and "engine": the part of the step spent in the
    # engine's own calls (absent where the backend cannot tell); the rest of the step is host time.
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def wall(self) -> float:
        """The step's wall time (its phases; "engine" is a part of them)."""
        return sum(v for k, v in self.seconds.items() if k != "engine")


@dataclass(frozen=True)
class Draft:
    tokens: np.ndarray  # [T] int64, node 0 = root
    valid: np.ndarray  # [T] bool: a node (and its subtree) is invalid when its draft had too few tokens
    probs: np.ndarray | None  # [T, V] draft law each node's children were sampled from (sampling only)


def draft_tree(runner: Runner, tree: Tree, root_token: int, sampling: SamplingParams, rng: np.random.Generator) -> Draft:
    """Fill the tree depth by depth: greedy takes each node's top-k, sampling draws without replacement."""
    T = tree.num_nodes
    tokens = np.full(T, root_token, dtype=np.int64)
    valid = np.ones(T, dtype=bool)
    probs = None if sampling.greedy or T == 1 else np.zeros((T, runner.info.vocab_size))
    rows = np.zeros(1, dtype=np.int64)  # nodes whose children are drafted next: the root first
    logits = runner.draft_begin()[None] if tree.max_depth else None  # [n, V], row r for node rows[r]
    for depth in range(1, tree.max_depth + 1):
        if sampling.greedy:
            top = topk_tokens(logits, tree.max_children)  # [n, k]
        else:
            probs[rows] = probs_from_logits(logits, sampling)
        for r, node in enumerate(rows):
            kids = tree.children[node]
            if sampling.greedy:
                tokens[kids] = top[r, : len(kids)]
            else:
                drawn = sample_without_replacement(probs[node], len(kids), rng)
                tokens[kids[: len(drawn)]] = drawn
                valid[kids[len(drawn):]] = False
        valid[tree.levels[depth]] &= valid[tree.parent[tree.levels[depth]]]
        rows = np.array([n for n in tree.levels[depth] if len(tree.children[n])], dtype=np.int64)
        if depth == tree.max_depth or len(rows) == 0:
            break
        logits = runner.draft_step(depth, rows, tree.parent[rows].astype(np.int64), tokens[rows])
    return Draft(tokens, valid, probs)


def lookup_draft(root_token: int, proposal: np.ndarray, sampling: SamplingParams, vocab_size: int) -> Draft:
    """The chain root + proposal; for sampling each node's children law is a point mass on its drafted child."""
    tokens = np.concatenate(([root_token], proposal)).astype(np.int64)
    probs = None
    if not sampling.greedy and len(proposal):
        probs = np.zeros((len(tokens), vocab_size))
        probs[np.arange(len(proposal)), proposal] = 1.0
    return Draft(tokens, np.ones(len(tokens), dtype=bool), probs)


def accept(tree: Tree, draft: Draft, logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator) -> Acceptance:
    if sampling.greedy:
        return accept_greedy(tree, draft.tokens, logits)
    target = probs_from_logits(logits, sampling)
    draft_probs = draft.probs if draft.probs is not None else np.zeros_like(target)
    return accept_sampling(tree, draft.tokens, draft.valid, target, draft_probs, rng)


def speculative_steps(runner: Runner, prompt: np.ndarray, tree: Tree, sampling: SamplingParams,
                      rng: np.random.Generator, capacity: int, drafts: str = "heads") -> Iterator[Step]:
    """Yield the tokens of each step until the sequence is full; the caller stops iterating when done.
    drafts: "heads" (the runner's draft heads fill `tree`) or "lookup" (prompt lookup; `tree` is a chain
    whose depth caps the drafts per step)."""
    clock = time.perf_counter
    engine = runner.engine_clock
    runner.reset(capacity)
    t0 = clock()
    P = len(prompt)
    logits = runner.forward(prompt, np.arange(P), np.tri(P, dtype=bool), last_only=True)
    first = accept(PLAIN, Draft(prompt[-1:], np.ones(1, bool), None), logits, sampling, rng).bonus_token
    runner.commit(np.arange(P), np.append(prompt[1:], first))
    lookup = PromptLookup(list(prompt) + [first]) if drafts == "lookup" else None
    yield Step([first], 1, {"prefill": clock() - t0})
    root = first
    while runner.past_length + 1 <= runner.capacity:
        t0, e0 = clock(), engine.seconds if engine else 0.0
        room = runner.capacity - runner.past_length - 1  # drafted tokens that still fit
        if lookup is not None:                                                              # 1. draft
            proposal = lookup.propose(min(tree.max_depth, room))
            step_tree = chain(len(proposal))
            draft = lookup_draft(root, proposal, sampling, runner.info.vocab_size)
        else:
            step_tree = tree if tree.num_nodes - 1 <= room else PLAIN
            draft = draft_tree(runner, step_tree, root, sampling, rng)
        t1 = clock()
        logits = runner.forward(draft.tokens, step_tree.depth, step_tree.ancestor_mask)     # 2. verify
        t2 = clock()
        acc = accept(step_tree, draft, logits, sampling, rng)                               # 3. accept
        emitted = [int(t) for t in draft.tokens[acc.accepted_nodes]] + [acc.bonus_token]
        t3 = clock()
        runner.commit(acc.path, np.array(emitted, dtype=np.int64))                          # 4. commit KV
        if lookup is not None:
            lookup.extend(emitted)
        seconds = {"draft": t1 - t0, "verify": t2 - t1, "accept": t3 - t2, "commit": clock() - t3}
        yield Step(emitted, step_tree.num_nodes, seconds | ({"engine": engine.seconds - e0} if engine else {}))
        root = acc.bonus_token
