"""Where each step's drafts come from: a proposer per draft source, behind one small interface.

    proposal = proposer.propose(inputs, tree, room)   # DraftInput -> Proposal: the tree to verify and its draft

A proposer reads only its typed inputs (`DraftInput`: the root token, the sequence's slot, sampling, grammar,
prompt-lookup index, and the policy's `LookupBudget`) and returns a `Proposal`; what the learners need of it once
it is verified travels beside the draft in its `Feedback`, to runtime/policy.learn_from_step.

`HeadsProposer` fills a fixed tree depth by depth from the runner's draft heads, or sizes a dynamic one by
confidence; `LookupProposer` verifies a chain of prompt-lookup tokens (runtime/lookup.py; no model call);
`MergedProposer` adds the lookup path to the heads' tree, or sends it alone where that has measured faster;
`ForcedProposer` wraps any of them for a sequence with a grammar: tokens the grammar forces go first, as drafts
it allows for sure. The step loop (runtime/loop.py) then prunes what the grammar forbids (`constrain`) and
verifies. On the CPU backends a proposal holds numpy arrays; a device-side proposer returns the same shape of
Proposal over device tensors. numpy only.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from clover.runtime.backend import Runner, Slot
from clover.runtime.grammar import GrammarState, MaskRows, PathMasks
from clover.runtime.lookup import PromptLookup
from clover.runtime.params import DraftSource
from clover.runtime.sampling import SamplingParams, probs_from_logits, sample_without_replacement, topk_tokens
from clover.runtime.tree import DynamicTree, Tree, compile_tree, resolve_tree

PLAIN = compile_tree([], name="plain")
# prompt-lookup tokens drafted per step at most: drafts="lookup" verifies a chain this deep by default (any chain
# caps it), "heads+lookup" adds a path this long to the heads' tree. A match of L tokens drafts up to 2L
# (runtime/lookup.py): a long repeat is right often enough to pay for its rows, LookupLength cuts the rest.
LOOKUP_DRAFTS = 12
# drafts from an answer served before (runtime/served_store.py) may go this far beyond the tree's depth: a repeated
# answer is right for long stretches, and the verify-cost curve (LookupLength) still decides how much of it is verified
SERVED_DRAFTS = 32
# tokens a grammar forces next (a JSON schema's keys and punctuation) drafted per step at most: always allowed and
# nearly always the model's choice, so they are worth their rows like a long prompt-lookup match
FORCED_DRAFTS = 16


@functools.cache
def chain(k: int) -> Tree:
    """The chain of k drafted tokens, plain for 0 (compiled once: lookup steps pick one per step)."""
    return resolve_tree(f"chain-{k}") if k else PLAIN


@dataclass(frozen=True)
class Draft:
    tokens: np.ndarray  # [T] int64, node 0 = root
    valid: np.ndarray  # [T] bool: a node (and its subtree) is invalid when its draft had too few tokens
    probs: np.ndarray | None  # [T, V] draft law each node's children were sampled from (sampling only)
    # drafts="heads+lookup": [T] bool, node i came from prompt lookup (a point-mass law, verified after its
    # parent's sampled children); `heads[i]` is node i's id in `heads_tree`, the tree the heads drafted (-1 for
    # lookup nodes)
    point: np.ndarray | None = None
    heads: np.ndarray | None = None
    heads_tree: Tree | None = None
    # a dynamic tree's nodes' cumulative draft probabilities [T] (node order; what DraftConfidence learns from)
    confidence: np.ndarray | None = None
    # a request with a grammar: the tokens the grammar allows after each node's path (a row's mask is computed
    # when the verify asks for it)
    allowed: MaskRows | None = None


def _grammar_rows(logits: np.ndarray, allowed: np.ndarray, vocab: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Draft logits [n, K] with the tokens the grammar forbids at -inf, and how many each row allows ([n]); a
    row that allows none of its columns is left at 0 (its children are all invalid)."""
    cols = allowed if vocab is None else allowed[:, vocab]
    counts = cols.sum(axis=1)
    return np.where(cols | (counts == 0)[:, None], logits, -np.inf), counts


def draft_tree(
    runner: Runner,
    tree: Tree,
    root_token: int,
    sampling: SamplingParams,
    rng: np.random.Generator,
    slot: Slot | None = None,
    grammar: PathMasks | None = None,
) -> Draft:
    """Fill the tree depth by depth (from `slot`'s heads, the solo one by default): greedy takes each node's
    top-k, sampling draws without replacement. With a draft vocabulary the heads' logits cover its K tokens
    only: their columns map back to token ids, and the draft law is zero elsewhere. With a grammar, each node's
    children come from the heads' logits masked by the grammar after its path: drafts are always allowed, and
    children a node's mask has no room for are invalid."""
    T = tree.num_nodes
    vocab = runner.info.draft_vocab  # [K] token id of each logit column, or None (column = token id)
    tokens = np.full(T, root_token, dtype=np.int64)
    valid = np.ones(T, dtype=bool)
    probs = None if sampling.greedy or T == 1 else np.zeros((T, runner.info.vocab_size))
    rows = np.zeros(1, dtype=np.int64)  # nodes whose children are drafted next: the root first
    logits = runner.draft_begin(slot)[None] if tree.max_depth else None  # [n, K], row r for node rows[r]
    paths: list[tuple[int, ...]] = [()] * T  # grammar: each node's drafted tokens after the root
    for depth in range(1, tree.max_depth + 1):
        room = None  # grammar: how many children each row's mask allows
        if grammar is not None:
            logits, room = _grammar_rows(logits, grammar.rows([paths[n] for n in rows]), vocab)
        if sampling.greedy:
            top = topk_tokens(logits, tree.max_children)  # [n, k] columns
            top = top if vocab is None else vocab[top]
        else:
            law = probs_from_logits(logits, sampling)  # [n, K]
            if room is not None:
                law[room == 0] = 0.0
            if vocab is None:
                probs[rows] = law
            else:
                probs[np.ix_(rows, vocab)] = law
        for r, node in enumerate(rows):
            kids = tree.children[node]
            if sampling.greedy:
                tokens[kids] = top[r, : len(kids)]
                if room is not None:
                    valid[kids[room[r] :]] = False
            else:
                drawn = sample_without_replacement(law[r], len(kids), rng)
                drawn = drawn if vocab is None else vocab[drawn]
                tokens[kids[: len(drawn)]] = drawn
                valid[kids[len(drawn) :]] = False
        valid[tree.levels[depth]] &= valid[tree.parent[tree.levels[depth]]]
        if grammar is not None:
            for n in tree.levels[depth]:
                paths[n] = paths[tree.parent[n]] + (int(tokens[n]),)
        rows = np.array(
            [n for n in tree.levels[depth] if len(tree.children[n]) and (grammar is None or valid[n])], dtype=np.int64
        )
        if depth == tree.max_depth or len(rows) == 0:
            break
        logits = runner.draft_step(depth, rows, tree.parent[rows].astype(np.int64), tokens[rows], slot)
    return Draft(tokens, valid, probs)


def draft_dynamic(
    runner: Runner,
    spec: DynamicTree,
    root_token: int,
    sampling: SamplingParams,
    rng: np.random.Generator,
    slot: Slot | None = None,
    grammar: PathMasks | None = None,
) -> tuple[Tree, Draft, float | None]:
    """This step's tree, drafted by confidence (tree.DynamicTree): depth by depth the `width` drafted nodes of
    highest cumulative draft probability get `width` children each; greedy keeps the best nodes (by cumulative
    probability: ancestors first) up to the count that maximises expected tokens per verify millisecond,
    sampling keeps every drafted node. With a grammar the heads' logits are masked as in `draft_tree`. Returns the
    compiled tree, its draft and the milliseconds a draft call took (None: one call only), for DraftConfidence."""
    vocab = runner.info.draft_vocab
    law = probs_from_logits if not sampling.greedy else None
    greedy_law = SamplingParams(temperature=1.0)  # greedy ranks nodes by the heads' plain softmax
    worth = spec.confidence if spec.confidence is not None else (lambda p: np.asarray(p, dtype=np.float64))
    tokens, parent, score, laws = [root_token], [-1], [1.0], {}
    paths: list[tuple[int, ...]] = [()]  # grammar: each drafted node's tokens after the root
    frontier = np.zeros(1, dtype=np.int64)  # drafted nodes expanded at this depth (draft-order ids)
    t0 = time.perf_counter()
    logits = runner.draft_begin(slot)[None]  # [n, K]
    calls = 1
    for depth in range(1, spec.depth + 1):
        fits = None  # grammar: how many tokens each frontier node's mask allows
        if grammar is not None:
            logits, fits = _grammar_rows(logits, grammar.rows([paths[i] for i in frontier]), vocab)
        probs = (law or probs_from_logits)(logits, sampling if law else greedy_law)  # [n, K]
        if fits is not None:
            probs[fits == 0] = 0.0
        # Greedy drafts `width` children per expanded node and picks the budget after; sampling verifies all it
        # draws, so it spreads the budget over the depths left (decided before drawing: sampling stays exact).
        room = (
            len(frontier) * spec.width
            if law is None
            else -(-(spec.budget - len(tokens) + 1) // (spec.depth - depth + 1))
        )
        per_node = max(1, min(spec.width, room // len(frontier)))
        new = []
        for r, node in enumerate(frontier):
            k = min(per_node, room - len(new))
            if k <= 0:
                break
            if law is None:
                cols = topk_tokens(logits[r : r + 1], k)[0]
                cols = cols if fits is None else cols[: fits[r]]
            else:
                cols = sample_without_replacement(probs[r], k, rng)
                laws[int(node)] = (probs[r], len(cols))
            for c in cols:
                new.append(len(tokens))
                tokens.append(int(c if vocab is None else vocab[c]))
                paths.append(paths[node] + (tokens[-1],))
                parent.append(int(node))
                score.append(score[node] * float(probs[r, c]))
        if depth == spec.depth or not new or (law is not None and len(tokens) - 1 >= spec.budget):
            break
        frontier = np.array(sorted(new, key=lambda i: -score[i])[: spec.width], dtype=np.int64)
        if spec.cost is not None and not _deeper_pays(
            spec, worth, score, frontier, (time.perf_counter() - t0) * 1e3, calls
        ):
            break
        p = np.array(parent)[frontier]
        logits = runner.draft_step(depth, frontier, p, np.array(tokens)[frontier], slot)
        calls += 1
    call_ms = (time.perf_counter() - t0) * 1e3 / calls if calls > 1 else None
    kept = np.arange(len(tokens))
    if law is None:  # greedy: the best nodes, as many as pay for their rows
        n = _best_count(spec, worth, score, 0.0)[0] if spec.cost is not None else min(len(tokens) - 1, spec.budget)
        kept = np.array([0] + sorted(_by_score(score)[:n]), dtype=np.int64)
    return (*_compiled_draft(kept, tokens, parent, score, laws, runner.info.vocab_size, vocab, spec.name), call_ms)


def _deeper_pays(spec: DynamicTree, worth, score: list[float], frontier: np.ndarray, spent: float, calls: int) -> bool:
    """Whether drafting one more depth could pay: it drafts at most `width` nodes worth no more than the best
    frontier node, so it pays only if even that could raise the expected tokens per millisecond (verify + drafting
    so far (`spent` ms over `calls` draft calls) + one more call)."""
    step_ms = spent / calls if spec.confidence is None or spec.confidence.draft_ms is None else spec.confidence.draft_ms
    n, rate = _best_count(spec, worth, score, spent)
    top = float(worth(np.array([score[frontier[0]]]))[0])
    return not all(
        (1 + rate[0] + k * top) / (spec.cost(1 + n + k) + spent + step_ms) <= rate[1] for k in range(1, spec.width + 1)
    )


def _by_score(score: list[float]) -> list[int]:
    """Drafted nodes (root excluded) by cumulative draft probability; a parent precedes its children."""
    return sorted(range(1, len(score)), key=lambda i: (-score[i], i))


def _best_count(spec: DynamicTree, worth, score: list[float], spent_ms: float) -> tuple[int, tuple[float, float]]:
    """How many of the best drafted nodes to verify (at most the budget), with (their expected accepted drafts,
    the expected tokens per ms) at that count."""
    order = _by_score(score)[: spec.budget]
    gain = np.concatenate(([0.0], np.cumsum(worth(np.array([score[i] for i in order])) if order else [])))
    rate = (1.0 + gain) / (np.array([spec.cost(1 + m) for m in range(len(gain))]) + spent_ms)
    n = int(np.argmax(rate))
    return n, (float(gain[n]), float(rate[n]))


def _compiled_draft(
    kept: np.ndarray,
    tokens: list[int],
    parent: list[int],
    score: list[float],
    laws: dict,
    vocab_size: int,
    vocab: np.ndarray | None,
    name: str,
) -> tuple[Tree, Draft]:
    """The kept drafted nodes (draft-order ids, root first, parents before children) as a compiled tree: sibling
    ranks renumbered in their draw order, the draft laws of sampled nodes and every node's cumulative probability."""
    path = {0: ()}
    next_rank: dict[int, int] = {}
    for i in sorted(int(x) for x in kept[1:]):  # draft order: siblings in rank order
        j = next_rank.get(parent[i], 0)
        next_rank[parent[i]] = j + 1
        path[i] = path[parent[i]] + (j,)
    tree = _merged_tree(tuple(sorted((path[i] for i in path if i), key=lambda c: (len(c), c))), name)
    at = {c: n + 1 for n, c in enumerate(tree.choices)} | {(): 0}
    ids = np.empty(tree.num_nodes, dtype=np.int64)
    confidence = np.empty(tree.num_nodes)
    probs = np.zeros((tree.num_nodes, vocab_size)) if laws else None
    for i, c in path.items():
        ids[at[c]], confidence[at[c]] = tokens[i], score[i]
        if i in laws and probs is not None:
            q, _ = laws[i]
            if vocab is None:
                probs[at[c]] = q
            else:
                probs[at[c], vocab] = q
    return tree, Draft(ids, np.ones(tree.num_nodes, dtype=bool), probs, confidence=confidence)


def lookup_draft(root_token: int, proposal: np.ndarray, sampling: SamplingParams, vocab_size: int) -> Draft:
    """The chain root + proposal; for sampling each node's children law is a point mass on its drafted child."""
    tokens = np.concatenate(([root_token], proposal)).astype(np.int64)
    probs = None
    if not sampling.greedy and len(proposal):
        probs = np.zeros((len(tokens), vocab_size))
        probs[np.arange(len(proposal)), proposal] = 1.0
    return Draft(tokens, np.ones(len(tokens), dtype=bool), probs)


@functools.lru_cache(maxsize=1024)
def _merged_tree(choices: tuple[tuple[int, ...], ...], name: str) -> Tree:
    return compile_tree([list(c) for c in choices], name=name)


def merge_lookup(tree: Tree, draft: Draft, proposal: np.ndarray, chains_only: bool = False) -> tuple[Tree, Draft]:
    """The heads' drafted tree with the prompt-lookup proposal added as a path from the root: the path follows
    drafted nodes while their tokens match and goes on as new nodes, each after its parent's drafted children
    (rank = their count). Lookup thus costs only the rows the heads did not already draft. `chains_only` (a
    graph that verifies chains only): where the two disagree, the heads' chain is cut there and the lookup
    continuation kept (a matched n-gram is right more often than a head's deep guess)."""
    if not len(proposal):
        return tree, draft
    paths = [()] + list(tree.choices)
    node, j = 0, 0
    while j < len(proposal):
        kid = next((int(c) for c in tree.children[node] if draft.valid[c] and draft.tokens[c] == proposal[j]), None)
        if kid is None:
            break
        node, j = kid, j + 1
    if j == len(proposal):  # the heads drafted the whole proposal already
        return tree, draft
    # the heads' nodes kept: all, or on a chain the ones up to the divergence
    keep = np.arange(int(tree.depth[node]) + 1 if chains_only else tree.num_nodes)
    rank = 0 if chains_only else len(tree.children[node])
    extra = [paths[node] + (rank,) + (0,) * i for i in range(len(proposal) - j)]
    old = [paths[i] for i in keep]
    new = _merged_tree(tuple(sorted(old[1:] + extra, key=lambda c: (len(c), c))), f"{tree.name}+lookup")
    index = {c: i + 1 for i, c in enumerate(new.choices)} | {(): 0}
    T = new.num_nodes
    at_old = np.array([index[c] for c in old], dtype=np.int64)
    at_new = np.array([index[c] for c in extra], dtype=np.int64)
    tokens = np.empty(T, dtype=np.int64)
    tokens[at_old], tokens[at_new] = draft.tokens[keep], proposal[j:]
    valid = np.ones(T, dtype=bool)
    valid[at_old] = draft.valid[keep]
    point = np.zeros(T, dtype=bool)
    point[at_new] = True
    heads = np.full(T, -1, dtype=np.int64)
    heads[at_old] = keep
    probs = None
    if draft.probs is not None:
        probs = np.zeros((T, draft.probs.shape[1]))
        probs[at_old] = draft.probs[keep]
    return new, Draft(tokens, valid, probs, point, heads, tree)


def constrain(tree: Tree, draft: Draft, grammar: PathMasks) -> tuple[Tree, Draft]:
    """The drafted tree without the nodes the grammar forbids (with their subtrees) and its invalid nodes, and each
    kept node's mask: verify then runs only rows that can be accepted. Sibling ranks keep their order (a sampled
    node's siblings stay in draw order); pruned lookup nodes are point masses on tokens of target probability 0,
    whose rejection would leave the residual law as it was."""
    T = tree.num_nodes
    paths: list[tuple[int, ...]] = [()] * T
    keep = np.array(draft.valid, dtype=bool)
    for n in range(1, T):  # parents come before their children
        p = int(tree.parent[n])
        paths[n] = paths[p] + (int(draft.tokens[n]),)
        keep[n] = keep[n] and keep[p] and grammar.permits(paths[n])
    if keep.all():
        return tree, replace(draft, allowed=grammar.lazy(paths))
    kept = np.flatnonzero(keep)
    rank: dict[int, int] = {}  # new rank of each kept node among its kept siblings
    choice = {0: ()}
    for n in kept[1:]:
        p = int(tree.parent[n])
        r = rank[p] = rank.get(p, -1) + 1
        choice[int(n)] = choice[p] + (r,)
    new = _merged_tree(tuple(sorted((choice[int(n)] for n in kept[1:]), key=lambda c: (len(c), c))), tree.name)
    at = {c: i + 1 for i, c in enumerate(new.choices)} | {(): 0}
    order = np.empty(new.num_nodes, dtype=np.int64)  # old node id of each new node
    for n in kept:
        order[at[choice[int(n)]]] = n

    def pick(a):
        return None if a is None else a[order]

    pruned = Draft(
        draft.tokens[order],
        np.ones(new.num_nodes, dtype=bool),
        pick(draft.probs),
        pick(draft.point),
        pick(draft.heads),
        draft.heads_tree,
        pick(draft.confidence),
        grammar.lazy([paths[n] for n in order]),
    )
    return new, pruned


class LookupBudget(Protocol):
    """The policy's say on prompt lookup (runtime/policy.LookupLength): how many of a proposal's tokens are worth
    their verify rows, and whether heads+lookup leaves the heads out for such a proposal."""

    def choose(self, match: int, n: int, rows: int = 1, served: bool = False) -> int: ...

    def alone(self, match: int, n: int) -> bool: ...

    @staticmethod
    def kind(match: int, n: int) -> int: ...


@dataclass(frozen=True, kw_only=True)
class DraftInput:
    """Everything a proposer drafts one sequence's step from."""

    root: int  # the token the step starts from (the last one emitted)
    slot: Slot  # the sequence's runner slot: its heads' state
    sampling: SamplingParams
    rng: np.random.Generator
    grammar: GrammarState | None = None  # what the output must match (None: anything)
    lookup: PromptLookup | None = None  # the sequence's prompt-lookup index over its context so far
    budget: LookupBudget | None = None  # the policy's lookup lengths (None: verify every proposed token)
    measured: bool = True  # the policy may learn heads+lookup's arms from this step (not the first after the prompt)


@dataclass(frozen=True)
class LookupOutcome:
    """A lookup proposal to learn acceptance from once verified: its match length (< 0: a store's), the whole
    proposal, and whether it came from the served answers."""

    match: int
    proposal: np.ndarray
    served: bool = False


@dataclass(frozen=True)
class Arm:
    """heads+lookup: a step whose arm LookupLength measures (lookup alone or beside the heads), by proposal kind."""

    alone: bool
    kind: int


@dataclass(kw_only=True)
class Feedback:
    """What the learners and the step's statistics need of a proposal once it is verified."""

    lookup: LookupOutcome | None = None
    arm: Arm | None = None
    heads_idle: bool = False  # a sequence that drafts with heads verifies a chain they did not draft
    pruned: int = 0  # drafted nodes its grammar forbade (or that were invalid), left out of the verify
    draft_call_ms: float | None = None  # a dynamic tree's milliseconds per draft call (DraftConfidence learns it)


@dataclass
class Proposal:
    """One sequence's drafts for one step: the tree to verify and its draft, and its feedback."""

    tree: Tree
    draft: Draft
    feedback: Feedback = field(default_factory=Feedback)
    # point-mass lookup drafts: under a grammar the tokens it forces after the chain join it (runtime/loop.constrain)
    extend_forced: bool = False


class Proposer(Protocol):
    """Drafts one sequence's step. `tree`: the deepest tree the step may verify (the policy's choice); `room`:
    drafted tokens that still fit in the sequence's cache."""

    source: DraftSource

    def propose(self, x: DraftInput, tree: Tree, room: int) -> Proposal: ...


def _lookup(x: DraftInput, k: int) -> np.ndarray:
    """Up to k prompt-lookup drafts; under a grammar, the kept match whose continuation it allows furthest."""
    return x.lookup.propose(k) if x.grammar is None else x.lookup.propose_valid(k, x.grammar.valid_prefix)


def _worth_verifying(x: DraftInput, proposal: np.ndarray, rows: int) -> np.ndarray:
    """The part of a lookup proposal worth its verify rows (the policy's budget), beside `rows` other rows."""
    if x.budget is None or not len(proposal):
        return proposal
    return proposal[: x.budget.choose(x.lookup.match, len(proposal), rows, x.lookup.from_served)]


def _outcome(x: DraftInput, whole: np.ndarray) -> LookupOutcome | None:
    return LookupOutcome(x.lookup.match, whole, x.lookup.from_served) if x.budget is not None else None


def _forbidden(x: DraftInput) -> int:
    """Of the lookup draft, what the grammar forbade (cut or replaced before drafting): counted as pruned."""
    return x.lookup.forbidden if x.grammar is not None else 0


class HeadsProposer:
    """The runner's draft heads fill the tree (a fixed one depth by depth, a dynamic one by confidence), their
    logits masked by the sequence's grammar where it has one."""

    source = DraftSource.HEADS

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def propose(self, x: DraftInput, tree: Tree, room: int) -> Proposal:
        return self.draft(x, tree if tree.num_nodes - 1 <= room else PLAIN)

    def draft(self, x: DraftInput, tree: Tree | DynamicTree) -> Proposal:
        masks = x.grammar.paths() if x.grammar is not None else None
        if isinstance(tree, DynamicTree):
            t, draft, call_ms = draft_dynamic(self.runner, tree, x.root, x.sampling, x.rng, x.slot, masks)
            return Proposal(t, draft, Feedback(draft_call_ms=call_ms))
        return Proposal(tree, draft_tree(self.runner, tree, x.root, x.sampling, x.rng, x.slot, masks))


def served_drafts(runner: Runner) -> int:
    """Drafts from a served answer one step may verify: SERVED_DRAFTS, within the rows a forward takes (TensorRT's
    profiles) with the root."""
    rows = runner.info.max_rows
    return SERVED_DRAFTS if rows is None else max(0, min(SERVED_DRAFTS, rows - 1))


class LookupProposer:
    """A chain of prompt-lookup tokens, as long as `tree` is deep and as the policy's budget judges worth its rows."""

    source = DraftSource.LOOKUP

    def __init__(self, runner: Runner) -> None:
        self.vocab_size = runner.info.vocab_size
        self.served_drafts = served_drafts(runner)

    def propose(self, x: DraftInput, tree: Tree, room: int) -> Proposal:
        whole = _lookup(x, min(tree.max_depth, room))
        longer = min(self.served_drafts, room)
        if x.lookup.from_served and len(whole) == tree.max_depth < longer:  # the tree's depth cut a served answer short
            whole = _lookup(x, longer)
        tokens = _worth_verifying(x, whole, 1)
        draft = lookup_draft(x.root, tokens, x.sampling, self.vocab_size)
        feedback = Feedback(lookup=_outcome(x, whole), pruned=_forbidden(x))
        return Proposal(chain(len(tokens)), draft, feedback, extend_forced=True)


class MergedProposer:
    """heads+lookup: the lookup path joins the heads' tree in the rows left; for a kind of proposal where steps
    without the heads have measured faster (LookupBudget.alone), the lookup chain goes alone."""

    source = DraftSource.MERGED

    def __init__(self, runner: Runner) -> None:
        self.heads, self.chains_only = HeadsProposer(runner), runner.info.chains_only
        self.vocab_size = runner.info.vocab_size
        self.served_drafts, self.max_rows = served_drafts(runner), runner.info.max_rows

    def propose(self, x: DraftInput, tree: Tree, room: int) -> Proposal:
        tree = tree if tree.num_nodes - 1 <= room else PLAIN
        whole = _lookup(x, min(LOOKUP_DRAFTS, room))
        longer = min(self.served_drafts, room)
        if x.lookup.from_served and len(whole) == LOOKUP_DRAFTS < longer:  # a served answer goes on: draft it further
            whole = _lookup(x, longer)
        # steps learned from (heads drafted or not): not the first after the prompt (its heads draft over all of it)
        learn = x.budget is not None and tree.num_nodes > 1 and x.measured
        kind = x.budget.kind(x.lookup.match, len(whole)) if learn else -1
        pruned = _forbidden(x)
        if learn and x.budget.alone(x.lookup.match, len(whole)):
            tokens = _worth_verifying(x, whole, 1)  # measured faster without the heads, for such proposals
            draft = lookup_draft(x.root, tokens, x.sampling, self.vocab_size)
            feedback = Feedback(lookup=_outcome(x, whole), arm=Arm(True, kind), heads_idle=True, pruned=pruned)
            return Proposal(chain(len(tokens)), draft, feedback)
        p = self.heads.draft(x, tree)
        left = room if self.max_rows is None else min(room, self.max_rows - 1)
        whole = whole[: max(0, left - p.tree.num_nodes + 1)]  # the lookup path joins the heads' tree, in the rows left
        tree, draft = merge_lookup(p.tree, p.draft, _worth_verifying(x, whole, p.tree.num_nodes), self.chains_only)
        p.feedback.lookup, p.feedback.pruned = _outcome(x, whole), pruned
        p.feedback.arm = Arm(False, kind) if learn else None
        return Proposal(tree, draft, p.feedback)


class ForcedProposer:
    """A sequence with a grammar: the tokens it forces next (a JSON schema's keys and punctuation; a lookup
    proposal that starts with them goes on further) are drafted first. A tree no deeper than them would draft
    only those tokens or forbidden ones, so the forced chain goes alone; a deeper heads' tree takes them as a
    lookup path. Nothing forced: the wrapped proposer drafts."""

    def __init__(self, inner: HeadsProposer | LookupProposer | MergedProposer, runner: Runner) -> None:
        self.inner, self.source = inner, inner.source
        self.heads = getattr(inner, "heads", inner if isinstance(inner, HeadsProposer) else None)
        self.chains_only, self.vocab_size = runner.info.chains_only, runner.info.vocab_size

    def propose(self, x: DraftInput, tree: Tree, room: int) -> Proposal:
        speculating = self.heads is None or 0 < tree.num_nodes - 1 <= room  # (a plain step stays plain)
        forced = np.asarray(x.grammar.forced(min(FORCED_DRAFTS, room)) if speculating else [], np.int64)
        if not len(forced):
            return self.inner.propose(x, tree, room)
        only = len(forced)
        if x.lookup is not None:  # a lookup proposal that starts with the forced tokens goes on further
            more = _lookup(x, min(LOOKUP_DRAFTS, room))
            if len(more) > len(forced) and np.array_equal(more[: len(forced)], forced):
                forced = more
        if self.heads is None or tree.max_depth <= only:
            draft = lookup_draft(x.root, forced, x.sampling, self.vocab_size)
            idle = self.heads is not None
            return Proposal(chain(len(forced)), draft, Feedback(heads_idle=idle), extend_forced=not idle)
        p = self.heads.draft(x, tree)
        tree, draft = merge_lookup(p.tree, p.draft, forced[: max(0, room - p.tree.num_nodes + 1)], self.chains_only)
        return Proposal(tree, draft, Feedback(draft_call_ms=p.feedback.draft_call_ms))


def proposer_for(runner: Runner, source: DraftSource, grammar: bool) -> Proposer:
    """The proposer of a sequence drafting from `source` (with a grammar: its forced tokens first)."""
    inner = {DraftSource.HEADS: HeadsProposer, DraftSource.LOOKUP: LookupProposer, DraftSource.MERGED: MergedProposer}
    p = inner[DraftSource.of(source)](runner)
    return ForcedProposer(p, runner) if grammar else p
