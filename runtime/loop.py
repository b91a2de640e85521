"""The speculate -> verify loop. numpy only: backends adapt engines to the Runner interface.

One step (`step`, for a batch of sequences): draft each sequence's tree from the heads (depth by depth),
verify all of them with one base forward, accept each one's
longest valid path (greedy) or run recursive rejection sampling (sampling), commit the accepted
path's KV, and carry the bonus token to the next step as the new root. Plain decoding is the same
loop with the root-only tree. With drafts="lookup" the drafts come from prompt lookup instead of heads
(runtime/lookup.py): each step verifies a chain of as many of the matched tokens as `tree` is deep (none
when nothing matches), a one-hot draft law for sampling.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from clover.runtime.acceptance import Acceptance, accept_greedy, accept_sampling
from clover.runtime.backend import Runner, Slot, Verify
from clover.runtime.grammar import GrammarState, MaskRows, PathMasks
from clover.runtime.logprobs import StepLogprobs, token_logprobs
from clover.runtime.lookup import LookupLength, PromptLookup
from clover.runtime.processors import LogitsProcessors
from clover.runtime.sampling import SamplingParams, probs_from_logits, sample_without_replacement, topk_tokens
from clover.runtime.tree import DynamicTree, Tree, compile_tree, resolve_tree

PLAIN = compile_tree([], name="plain")
DRAFT_SOURCES = ("heads", "lookup", "heads+lookup")
# prompt-lookup tokens drafted per step at most: drafts="lookup" verifies a chain this deep by default (any
# chain caps it; benchmarks/peers.py), "heads+lookup" adds a path this long to the heads' tree. A match of L
# tokens drafts up to 2L (runtime/lookup.py): a long repeat is right often enough to pay for its rows (a 13-row
# verify costs ~1.9x a 1-row one on SmolLM2 fp32, 2 threads).
LOOKUP_DRAFTS = 12
# tokens a grammar forces next (a JSON schema's keys and punctuation) drafted per step at most: always allowed and
# nearly always the model's choice, so they are worth their rows like a long prompt-lookup match
FORCED_DRAFTS = 16


@functools.cache
def chain(k: int) -> Tree:
    """The chain of k drafted tokens, plain for 0 (compiled once: lookup steps pick one per step)."""
    return resolve_tree(f"chain-{k}") if k else PLAIN


@dataclass
class Step:
    """What one model step emitted (the prefill is step 0) and where its time went."""

    tokens: list[int]
    tree_nodes: int  # nodes verified (1 for plain steps and the prefill)
    tree: Tree | None = None  # the tree verified (None for the prefill)
    rows: int = 1  # rows this sequence put in the step's forward (its tree's nodes, or its prompt chunk)
    path: np.ndarray | None = None  # its accepted node ids, root first
    # drafts="heads+lookup": the heads' own tree and the accepted path's part in it (what their acceptance
    # statistics count); None when the step's tree is the heads' tree
    heads_tree: Tree | None = None
    heads_path: np.ndarray | None = None
    draft_seconds: float = 0.0  # this sequence's share of the draft phase
    # draft / verify / accept / commit (prefill for step 0), and "engine": the part of the step spent in the
    # engine's own calls (absent where the backend cannot tell); the rest of the step is host time.
    seconds: dict[str, float] = field(default_factory=dict)
    error: BaseException | None = None  # step(isolate=True): this sequence's part failed (it emitted nothing)
    logprobs: StepLogprobs | None = None  # the emitted tokens' log-probabilities, when the sequence asks for them
    pruned: int = 0  # drafted nodes its grammar forbade, left out of the verify
    # its last token is the end its grammar allowed alone, emitted without a forward (not a verified token)
    free_end: bool = False
    # a prompt chunk's tokens' log-probabilities (each but the prompt's first), when the sequence asks for them
    prompt_logprobs: StepLogprobs | None = None

    @property
    def wall(self) -> float:
        """The step's wall time (its phases; "engine" is a part of them)."""
        return sum(v for k, v in self.seconds.items() if k != "engine")


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
) -> tuple[Tree, Draft]:
    """This step's tree, drafted by confidence (tree.DynamicTree): depth by depth the `width` drafted nodes of
    highest cumulative draft probability get `width` children each; greedy keeps the best nodes (by cumulative
    probability: ancestors first) up to the count that maximises expected tokens per verify millisecond,
    sampling keeps every drafted node. With a grammar the heads' logits are masked as in `draft_tree`. Returns the
    compiled tree and its draft."""
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
        # Another depth drafts at most `width` nodes worth no more than the best frontier node: stop when even
        # that could not raise the expected tokens per millisecond (verify + drafting so far + one more call).
        if spec.cost is not None:
            spent = (time.perf_counter() - t0) * 1e3
            step_ms = (
                spent / calls
                if spec.confidence is None or spec.confidence.draft_ms is None
                else spec.confidence.draft_ms
            )
            n, rate = _best_count(spec, worth, score, spent)
            top = float(worth(np.array([score[frontier[0]]]))[0])
            if all(
                (1 + rate[0] + k * top) / (spec.cost(1 + n + k) + spent + step_ms) <= rate[1]
                for k in range(1, spec.width + 1)
            ):
                break
        p = np.array(parent)[frontier]
        logits = runner.draft_step(depth, frontier, p, np.array(tokens)[frontier], slot)
        calls += 1
    if spec.confidence is not None and calls > 1:
        spec.confidence.observe_draft((time.perf_counter() - t0) * 1e3 / calls)
    kept = np.arange(len(tokens))
    if law is None:  # greedy: the best nodes, as many as pay for their rows
        n = _best_count(spec, worth, score, 0.0)[0] if spec.cost is not None else min(len(tokens) - 1, spec.budget)
        kept = np.array([0] + sorted(_by_score(score)[:n]), dtype=np.int64)
    return _compiled_draft(kept, tokens, parent, score, laws, runner.info.vocab_size, vocab, spec.name)


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


def accept(
    tree: Tree,
    draft: Draft,
    logits: np.ndarray,
    sampling: SamplingParams,
    rng: np.random.Generator,
    processors: LogitsProcessors | None = None,
) -> Acceptance:
    """Verify one drafted tree on its logits rows [T, V]: each row adjusted by `processors` with its own path's
    history first (runtime/processors.py), the tokens its grammar forbids set to -inf last, then greedy or
    rejection sampling."""
    if processors is not None:
        logits = processors.apply(logits, tree, draft.tokens)
    if sampling.greedy:  # masks only where the walk goes
        return accept_greedy(tree, draft.tokens, logits, draft.allowed)
    if draft.allowed is not None:
        logits = np.where(draft.allowed.dense(), logits, -np.inf)
    target = probs_from_logits(logits, sampling)
    draft_probs = draft.probs if draft.probs is not None else np.zeros_like(target)
    return accept_sampling(tree, draft.tokens, draft.valid, target, draft_probs, rng, draft.point)


PREFILL_CHUNK = 256  # prompt rows a sequence adds to one forward: a long prompt does not stall the batch for long


@dataclass(eq=False)
class Decoding:
    """One sequence being decoded: its runner slot, its prompt (prefilled `prefill_chunk` rows per step), its
    tree (the deepest it may speculate; `step` picks a smaller one when the sequence is nearly full), sampling,
    and the token the next step starts from."""

    slot: Slot
    prompt: np.ndarray  # [P] int64
    tree: Tree
    sampling: SamplingParams
    rng: np.random.Generator
    drafts: str = "heads"
    prefill_chunk: int = PREFILL_CHUNK
    prefilled: int = 0  # prompt tokens in the cache
    root: int = -1  # the last emitted token (the bonus token of the last step)
    lookup: PromptLookup | None = None
    # how many of each lookup proposal to verify (shared by the runner's sequences); None: all of it
    lookup_length: LookupLength | None = None
    processors: LogitsProcessors | None = None  # this request's logits processors (None: none, no work)
    logprobs: int | None = None  # alternatives per emitted token's log-probability (None: no log-probabilities)
    grammar: GrammarState | None = None  # what the output must match (runtime/grammar.py; None: anything)
    # a prompt chunk ends here (the prompt's last token alone after it): other sequences of the same prompt fork
    # this one's caches at that point and each runs the last token itself (its own first token, its own draft state)
    fork_at: int | None = None
    prompt_logprobs: int | None = None  # alternatives per prompt token's log-probability (None: none)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    @property
    def full(self) -> bool:
        return self.slot.past + 1 > self.slot.capacity


def step(
    runner: Runner, batch: Sequence[Decoding], trees: Sequence[Tree] | None = None, isolate: bool = False
) -> list[Step]:
    """One step of every sequence in `batch`, all verified in one forward. A sequence still prefilling runs
    its next prompt chunk (and emits its first token after the last one); the others draft their tree, have it
    verified, accept their tokens and commit their KV. `trees`: this step's tree per sequence (default: each
    one's own; ignored while prefilling); a sequence too full for its tree steps plain. Returns what each
    sequence emitted (nothing for a prompt chunk that is not the last).

    A failure is kept to the sequence it belongs to: drafting, accepting and committing are per sequence, and a
    batched forward that fails is run again one sequence at a time (a forward only writes the rows after a
    slot's cached tokens, so running it again changes nothing already committed). isolate: a failed
    sequence's Step carries its `error` and the others step normally (the engine fails that request alone);
    otherwise the first error is raised after the others have stepped."""
    clock = time.perf_counter
    engine = runner.engine_clock
    t0, e0 = clock(), engine.seconds if engine else 0.0
    n = len(batch)
    errors: list[BaseException | None] = [None] * n
    planned: list[_Planned | None] = [None] * n
    for i, d in enumerate(batch):  # 1. draft
        try:
            planned[i] = _plan(runner, d, trees[i] if trees is not None else d.tree)
        except Exception as e:
            errors[i] = e
    t1 = clock()
    logits: list[np.ndarray | None] = [None] * n  # 2. verify
    live = [i for i in range(n) if errors[i] is None]
    try:
        for i, lg in zip(live, runner.forward_batch([planned[i].verify for i in live]) if live else ()):
            logits[i] = lg
    except Exception as e:
        if len(live) == 1:
            errors[live[0]] = e
        for i in live if len(live) > 1 else ():  # whose rows failed: each sequence on its own
            try:
                logits[i] = runner.forward_batch([planned[i].verify])[0]
            except Exception as e_i:
                errors[i] = e_i
    t2 = clock()
    accepted: list[Acceptance | None] = [None] * n  # 3. accept
    for i, (d, p) in enumerate(zip(batch, planned)):
        if errors[i] is None and p.tree is not None:
            try:
                accepted[i] = accept(p.tree, p.draft, logits[i], d.sampling, d.rng, d.processors)
            except Exception as e:
                errors[i] = e
    t3 = clock()
    steps = []
    for i, (d, p) in enumerate(zip(batch, planned)):  # 4. commit
        try:
            if errors[i] is None:
                steps.append(_committed(runner, d, p, accepted[i], logits[i]))
                continue
        except Exception as e:  # this slot's state is now unknown: its sequence ends, the others go on
            errors[i] = e
        steps.append(Step([], 0, error=errors[i]))
    seconds = {"draft": t1 - t0, "verify": t2 - t1, "accept": t3 - t2, "commit": clock() - t3}
    if engine:
        seconds["engine"] = engine.seconds - e0
    for st in steps:
        # the batch's step: every sequence waited for all of it; a prompt chunk's step is prefill time
        st.seconds = (
            dict(seconds) if st.tree is not None else {"prefill": sum(seconds.values()) - seconds.get("engine", 0.0)}
        )
    shared = (t3 - t1 + seconds["commit"]) / n  # verify, accept, commit: a share per sequence
    for d, st, p in zip(batch, steps, planned):
        if st.error is None and p.use is not None:  # what this kind of step gave and took, the lookup alone or merged
            d.lookup_length.observe_step(p.use[1], p.use[0], len(st.tokens), (p.draft_seconds + shared) * 1e3)
    failed = next((e for e in errors if e is not None), None)
    if failed is not None and not isolate:
        raise failed
    return steps


@dataclass
class _Planned:
    """One sequence's part of a step, drafted: its forward rows, and for a speculative step its tree and draft,
    its lookup proposal (match length, whole proposal) and, for heads+lookup with learned lengths, whether the
    lookup went alone (and its kind), to be learned from."""

    verify: Verify
    tree: Tree | None = None  # None: a prompt chunk
    draft: Draft | None = None
    proposal: tuple[int, np.ndarray] | None = None
    use: tuple[bool, int] | None = None
    draft_seconds: float = 0.0
    pruned: int = 0  # drafted nodes the grammar forbade (or that were invalid), left out of the verify
    heads_idle: bool = False  # a sequence that drafts with heads verifies a chain they did not draft


def _plan(runner: Runner, d: Decoding, tree: Tree) -> _Planned:
    """Draft one sequence's step (its next prompt chunk while prefilling)."""
    td = time.perf_counter()
    if d.prefilling:
        end = d.prefilled + d.prefill_chunk
        if d.fork_at is not None and d.prefilled < d.fork_at < end:
            end = d.fork_at
        chunk = d.prompt[d.prefilled : end]
        n = len(chunk)
        every_row = d.prompt_logprobs is not None  # each row gives the next prompt token's log-probability
        return _Planned(Verify(d.slot, chunk, np.arange(n), np.tri(n, dtype=bool), last_only=not every_row))
    room = d.slot.capacity - d.slot.past - 1  # drafted tokens that still fit
    whole, use, heads_idle = None, None, False
    masks = d.grammar.paths() if d.grammar is not None else None
    speculating = d.drafts == "lookup" or 0 < tree.num_nodes - 1 <= room  # (a plain step stays plain)
    forced = np.asarray(d.grammar.forced(min(FORCED_DRAFTS, room)) if d.grammar and speculating else [], np.int64)
    only = len(forced)  # the tokens the grammar allows alone
    if only and d.lookup is not None:  # a lookup proposal that starts with the forced tokens goes on further
        more = _lookup(d, min(LOOKUP_DRAFTS, room))
        if len(more) > len(forced) and np.array_equal(more[: len(forced)], forced):
            forced = more
    if len(forced):
        # the grammar's forced tokens take the place of the lookup proposal: they are drafts it allows for sure.
        # The heads' nodes no deeper than the forced tokens are those tokens or forbidden, so a tree no deeper
        # than them would only cost its draft and its masks: the forced chain goes alone
        if d.drafts == "lookup" or tree.max_depth <= only:
            heads_idle = d.drafts != "lookup"
            tree, draft = chain(len(forced)), lookup_draft(d.root, forced, d.sampling, runner.info.vocab_size)
        else:
            draft = (
                draft_dynamic(runner, tree, d.root, d.sampling, d.rng, d.slot, masks)
                if isinstance(tree, DynamicTree)
                else (tree, draft_tree(runner, tree, d.root, d.sampling, d.rng, d.slot, masks))
            )
            tree, draft = merge_lookup(*draft, forced[: max(0, room - draft[0].num_nodes + 1)], runner.info.chains_only)
    elif d.drafts == "lookup":
        whole = _lookup(d, min(tree.max_depth, room))
        proposal = _worth_verifying(d, whole, 1)
        tree = chain(len(proposal))
        draft = lookup_draft(d.root, proposal, d.sampling, runner.info.vocab_size)
    else:
        tree = tree if tree.num_nodes - 1 <= room else PLAIN
        if d.lookup is not None:  # heads+lookup
            whole = _lookup(d, min(LOOKUP_DRAFTS, room))
        # steps learned from (heads drafted or not): not the first after the prompt (its heads draft over all of it)
        learn = whole is not None and d.lookup_length is not None and tree.num_nodes > 1 and d.slot.past > len(d.prompt)
        kind = LookupLength.kind(d.lookup.match, len(whole)) if learn else -1
        if learn and d.lookup_length.alone(d.lookup.match, len(whole)):
            proposal = _worth_verifying(d, whole, 1)  # measured faster without the heads, for such proposals
            use, heads_idle = (True, kind), True
            tree = chain(len(proposal))
            draft = lookup_draft(d.root, proposal, d.sampling, runner.info.vocab_size)
        else:
            use = (False, kind) if learn else None
            if isinstance(tree, DynamicTree):
                tree, draft = draft_dynamic(runner, tree, d.root, d.sampling, d.rng, d.slot, masks)
            else:
                draft = draft_tree(runner, tree, d.root, d.sampling, d.rng, d.slot, masks)
            if whole is not None:  # the lookup path joins the heads' tree, in the rows left
                whole = whole[: max(0, room - tree.num_nodes + 1)]
                proposal = _worth_verifying(d, whole, tree.num_nodes)
                tree, draft = merge_lookup(tree, draft, proposal, runner.info.chains_only)
    # under a grammar, the lookup draft it forbade part of was cut or replaced before drafting: counted as pruned
    pruned = d.lookup.forbidden if whole is not None and d.grammar is not None else 0
    if masks is not None:
        drafted = tree.num_nodes
        tree, draft = constrain(tree, draft, masks)
        pruned += drafted - tree.num_nodes
        if d.drafts == "lookup" and tree.num_nodes > 1:  # point-mass drafts: the forced tokens after them join
            more = masks.forced_after(
                tuple(int(t) for t in draft.tokens[1:]), min(FORCED_DRAFTS, room - tree.num_nodes + 1)
            )
            if more:
                whole_chain = np.concatenate((draft.tokens[1:], more))
                tree, draft = constrain(
                    chain(len(whole_chain)),
                    lookup_draft(d.root, whole_chain, d.sampling, runner.info.vocab_size),
                    masks,
                )
    return _Planned(
        Verify(d.slot, draft.tokens, tree.depth, tree.ancestor_mask),
        tree,
        draft,
        (d.lookup.match, whole) if whole is not None and d.lookup_length is not None else None,
        use,
        time.perf_counter() - td,
        pruned,
        heads_idle,
    )


def _committed(runner: Runner, d: Decoding, p: _Planned, acc: Acceptance | None, logits: np.ndarray) -> Step:
    """Commit one sequence's accepted path (or prompt chunk) and say what it emitted."""
    if p.tree is None:
        return _prefilled(runner, d, p.verify.tokens, logits)
    t, dr = p.tree, p.draft
    if dr.confidence is not None and isinstance(d.tree, DynamicTree) and d.tree.confidence is not None:
        d.tree.confidence.observe(dr.confidence[1:], np.isin(np.arange(1, t.num_nodes), acc.path))
    emitted = [int(x) for x in dr.tokens[acc.accepted_nodes]] + [acc.bonus_token]
    runner.commit(acc.path, np.array(emitted, dtype=np.int64), slot=d.slot)
    if d.processors is not None:
        d.processors.extend(emitted)
    if d.grammar is not None:
        d.grammar.extend(emitted)
    if d.lookup is not None:
        d.lookup.extend(emitted)
    if p.proposal is not None:
        d.lookup_length.observe(*p.proposal, emitted)
    d.root = acc.bonus_token
    end = _free_end(d)
    st = Step(
        emitted if end is None else [*emitted, end],  # a grammar that allows only the end: no forward for it
        t.num_nodes,
        tree=t,
        rows=t.num_nodes,
        path=acc.path,
        draft_seconds=p.draft_seconds,
        pruned=p.pruned,
        free_end=end is not None,
    )
    if d.logprobs is not None:  # emitted token k was drawn from row path[k]: the accepted path's rows, in order
        st.logprobs = token_logprobs(logits[acc.path], emitted, d.logprobs)
    if dr.heads is not None:  # a merged tree: below a lookup node there are only lookup nodes
        in_heads = dr.heads[acc.path]
        st.heads_tree, st.heads_path = dr.heads_tree, in_heads[in_heads >= 0]
    elif p.heads_idle:  # the heads drafted nothing: their statistics see a plain step
        st.heads_tree, st.heads_path = PLAIN, acc.path[:1]
    return st


def _free_end(d: Decoding) -> int | None:
    """The token that ends the request when its grammar now allows only that (emitted without a forward), or None;
    never with log-probabilities, which want that forward's row."""
    return d.grammar.the_end() if d.grammar is not None and d.logprobs is None else None


def _lookup(d: Decoding, k: int) -> np.ndarray:
    """Up to k prompt-lookup drafts; under a grammar, the kept match whose continuation it allows furthest."""
    return d.lookup.propose(k) if d.grammar is None else d.lookup.propose_valid(k, d.grammar.valid_prefix)


def _worth_verifying(d: Decoding, proposal: np.ndarray, rows: int) -> np.ndarray:
    """The part of a lookup proposal worth its verify rows (d.lookup_length), beside `rows` other rows."""
    if d.lookup_length is None or not len(proposal):
        return proposal
    return proposal[: d.lookup_length.choose(d.lookup.match, len(proposal), rows)]


def _prefilled(runner: Runner, d: Decoding, chunk: np.ndarray, logits: np.ndarray) -> Step:
    """Commit a prompt chunk; after the last one, emit the first token (from the last prompt row's logits)."""
    start, n = d.prefilled, len(chunk)
    d.prefilled += n
    prompt_lp = None
    if d.prompt_logprobs is not None:  # row i: the distribution of prompt token start + i + 1
        after = d.prompt[start + 1 : start + n + 1]
        prompt_lp = token_logprobs(logits[: len(after)], after, d.prompt_logprobs)
    if d.prefilling:
        runner.commit(np.arange(n), d.prompt[start + 1 : start + n + 1], slot=d.slot)
        return Step([], 0, rows=n, prompt_logprobs=prompt_lp)
    logits = logits[-1:]  # the prompt's last row
    allowed = None if d.grammar is None else d.grammar.paths().lazy([()])
    first = accept(
        PLAIN, Draft(chunk[-1:], np.ones(1, bool), None, allowed=allowed), logits, d.sampling, d.rng, d.processors
    ).bonus_token
    runner.commit(np.arange(n), np.append(d.prompt[start + 1 :], first), slot=d.slot)
    if d.drafts != "lookup" and d.tree.num_nodes > 1:  # the heads' pass over the prompt: part of the prefill
        runner.draft_prepare(d.slot)
    d.root = first
    if d.processors is not None:
        d.processors.extend([first])
    if d.grammar is not None:
        d.grammar.extend([first])
    d.lookup = (
        PromptLookup(
            list(d.prompt) + [first],
            store=runner.info.ngram_store,
            texts=d.grammar.token_bytes if d.grammar is not None else None,  # a grammar's drafts match text too
        )
        if d.drafts in ("lookup", "heads+lookup")
        else None
    )
    end = _free_end(d)
    st = Step([first] if end is None else [first, end], 1, rows=n, prompt_logprobs=prompt_lp, free_end=end is not None)
    if d.logprobs is not None:  # the prompt's last row
        st.logprobs = token_logprobs(logits, [first], d.logprobs)
    return st


def speculative_steps(
    runner: Runner,
    prompt: np.ndarray,
    tree: Tree,
    sampling: SamplingParams,
    rng: np.random.Generator,
    capacity: int,
    drafts: str = "heads",
    lookup_length: LookupLength | None = None,
    processors: LogitsProcessors | None = None,
    logprobs: int | None = None,
    grammar: GrammarState | None = None,
    prompt_logprobs: int | None = None,
) -> Iterator[Step]:
    """One sequence (the runner's solo slot): yield the tokens of each step until the sequence is full; the
    caller stops iterating when done. drafts: "heads" (the runner's draft heads fill `tree`) or "lookup"
    (prompt lookup; `tree` is a chain whose depth caps the drafts per step); `lookup_length`: how much of each
    lookup proposal to verify (None: all); `processors`: the request's logits processors; `logprobs`: each step's
    tokens' log-probabilities with this many alternatives (None: none); `grammar`: what the output must match."""
    runner.reset(capacity)
    d = Decoding(
        runner.solo,
        np.asarray(prompt, dtype=np.int64),
        tree,
        sampling,
        rng,
        drafts,
        lookup_length=lookup_length,
        processors=processors,
        logprobs=logprobs,
        grammar=grammar,
        prompt_logprobs=prompt_logprobs,
    )
    while not d.full:
        for st in step(runner, [d]):
            if st.tokens or st.prompt_logprobs is not None:
                yield st
