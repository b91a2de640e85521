"""The speculate -> verify loop. numpy only: backends adapt engines to the Runner interface.

One step (`step`, for a batch of sequences) runs four phases (on runners that can, sequences that need nothing of
the host in their step, greedy with a fixed tree of heads' drafts, run all four on the device in one `decode` call
instead: `_decoded`):
1. draft: each sequence's next prompt chunk while it prefills; else its proposer's proposal (runtime/proposers.py:
   heads, prompt lookup, both merged, a grammar's forced tokens) for the tree the policy chose, pruned to what its
   grammar allows (`constrain`);
2. verify: one base forward for every sequence's rows;
3. accept: each one's longest valid path (greedy) or recursive rejection sampling (sampling), its logits
   adjusted by its processors and masked by its grammar per tree row;
4. commit: the accepted path's KV, the emitted tokens, and the bonus token carried to the next step as the root.
Plain decoding is the same loop with the root-only tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from clover.runtime.acceptance import Acceptance, accept_greedy, accept_sampling
from clover.runtime.backend import Runner, SlotStep, Verify
from clover.runtime.logprobs import token_logprobs
from clover.runtime.lookup import PromptLookup
from clover.runtime.params import PREFILL_CHUNK, DraftSource, GenerationParams
from clover.runtime.policy import LookupLength, learn_from_step
from clover.runtime.processors import LogitsProcessors
from clover.runtime.proposers import (
    FORCED_DRAFTS,
    LOOKUP_DRAFTS,
    PLAIN,
    Draft,
    DraftInput,
    Proposal,
    chain,
    constrain,
    lookup_draft,
    proposer_for,
)
from clover.runtime.results import Step
from clover.runtime.sampling import SamplingParams, probs_from_logits
from clover.runtime.state import Decoding
from clover.runtime.tree import Tree

__all__ = [
    "LOOKUP_DRAFTS",
    "PLAIN",
    "PREFILL_CHUNK",
    "Decoding",
    "Step",
    "chain",
    "launch",
    "speculative_steps",
    "step",
]


@dataclass
class _Planned:
    """One sequence's part of a step, drafted: its forward rows, and for a speculative step its proposal."""

    verify: Verify
    proposal: Proposal | None = None  # None: a prompt chunk
    draft_seconds: float = 0.0


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
    trees = list(trees) if trees is not None else [d.tree for d in batch]
    steps: list[Step | None] = [None] * len(batch)
    for group in _device_groups(runner, batch, trees):  # the whole step on the device
        for i, st in zip(group, _decoded(runner, [batch[i] for i in group], trees[group[0]], isolate)):
            steps[i] = st
    rest = [i for i, st in enumerate(steps) if st is None]
    if rest:  # the others on the host, in its four phases
        host = _HostStep(runner, [batch[i] for i in rest])
        for i, st in zip(rest, host.run([trees[i] for i in rest])):
            steps[i] = st
        if host.failed is not None and not isolate:
            raise host.failed
    return steps


class _HostStep:
    """The host path's step of a batch, phase by phase (draft, verify, accept, commit), each phase per sequence: a
    sequence that fails keeps its error and skips the phases after, the others go on. Then the phases' times are
    given to every sequence's Step, and what the verified proposals teach goes to the policy's one learner."""

    def __init__(self, runner: Runner, batch: Sequence[Decoding]) -> None:
        self.runner, self.batch = runner, batch
        self.errors: list[BaseException | None] = [None] * len(batch)

    @property
    def failed(self) -> BaseException | None:
        return next((e for e in self.errors if e is not None), None)

    def run(self, trees: Sequence[Tree]) -> list[Step]:
        clock, engine = time.perf_counter, self.runner.engine_clock
        t0, e0 = clock(), engine.seconds if engine else 0.0
        planned = self._each(lambda i, d: _plan(self.runner, d, trees[i]))
        t1 = clock()
        logits = self._verify(planned)
        t2 = clock()
        accepted = self._each(lambda i, d: _accept(d, planned[i], logits[i]))
        t3 = clock()
        committed = self._each(lambda i, d: _committed(self.runner, d, planned[i], accepted[i], logits[i]))
        steps = [st if e is None else Step([], 0, error=e) for st, e in zip(committed, self.errors)]
        seconds = {"draft": t1 - t0, "verify": t2 - t1, "accept": t3 - t2, "commit": clock() - t3}
        if engine:
            seconds["engine"] = engine.seconds - e0
        for st in steps:
            # the batch's step: every sequence waited for all of it; a prompt chunk's step is prefill time
            prefill = {"prefill": sum(seconds.values()) - seconds.get("engine", 0.0)}
            st.seconds = dict(seconds) if st.tree is not None else prefill
        shared = (t3 - t1 + seconds["commit"]) / len(self.batch)  # verify, accept, commit: a share per sequence
        for d, st, p in zip(self.batch, steps, planned):
            if st.error is None and p.proposal is not None:
                learn_from_step(d, p.proposal, st, (p.draft_seconds + shared) * 1e3)
        return steps

    def _each(self, work: Callable[[int, Decoding], object]) -> list:
        """work(i, d) for each sequence that has not failed yet; a failure is kept as its error (its result None)."""
        out = [None] * len(self.batch)
        for i, d in enumerate(self.batch):
            if self.errors[i] is None:
                try:
                    out[i] = work(i, d)
                except Exception as e:
                    self.errors[i] = e
        return out

    def _verify(self, planned: list[_Planned | None]) -> list[np.ndarray | None]:
        """Every live sequence's rows in one forward; if it fails, each sequence on its own (whose rows failed)."""
        logits: list[np.ndarray | None] = [None] * len(planned)
        live = [i for i, e in enumerate(self.errors) if e is None]
        try:
            for i, lg in zip(live, self.runner.forward_batch([planned[i].verify for i in live]) if live else ()):
                logits[i] = lg
        except Exception as e:
            if len(live) == 1:
                self.errors[live[0]] = e
            for i in live if len(live) > 1 else ():
                try:
                    logits[i] = self.runner.forward_batch([planned[i].verify])[0]
                except Exception as e_i:
                    self.errors[i] = e_i
        return logits


def _device_groups(runner: Runner, batch: Sequence[Decoding], trees: Sequence[Tree]) -> list[list[int]]:
    """The sequences whose step runs on the device (`Runner.decode`), grouped by tree: greedy or unseeded sampling (with
    any logits processors, log-probabilities, grammar), the heads' drafts (or none) for a fixed tree that fits."""
    if not runner.can_decode:
        return []
    groups: dict[int, list[int]] = {}
    for i, (d, t) in enumerate(zip(batch, trees)):
        if (
            not d.prefilling
            and (d.sampling.greedy or d.sampling.seed is None)  # a seeded request draws from its own generator
            and isinstance(t, Tree)
            and (d.drafts is DraftSource.HEADS or t.num_nodes == 1)
            and d.slot.past + t.num_nodes <= d.slot.capacity
            and (d.processors is None or not d.processors.sequence_dependent)  # longer bad words: the host's
        ):
            groups.setdefault(id(t), []).append(i)
    return list(groups.values())


def _decoded(runner: Runner, batch: Sequence[Decoding], tree: Tree, isolate: bool) -> list[Step]:
    """One device-side step (draft, verify, accept, commit in one `decode` call) for sequences sharing `tree`."""
    try:
        return _launched(runner, batch, tree)()
    except Exception as e:
        if not isolate:
            raise
        return [Step([], 0, error=e) for _ in batch]


def _launched(runner: Runner, batch: Sequence[Decoding], tree: Tree) -> Callable[[], list[Step]]:
    """The device-side step of `batch` launched; a call that waits for it and says what each sequence emitted."""
    engine = runner.engine_clock
    t0, e0 = time.perf_counter(), engine.seconds if engine else 0.0
    asks = [SlotStep(d.sampling, d.processors, d.logprobs, d.grammar) for d in batch]
    wait = runner.decode_async([d.slot for d in batch], tree, asks)

    def steps() -> list[Step]:
        results = wait()
        seconds = {"verify": time.perf_counter() - t0}
        if engine:
            seconds["engine"] = engine.seconds - e0
        out = []
        for d, r in zip(batch, results):
            tokens = [int(t) for t in r.emitted]
            _extend(d, tokens)
            d.root = tokens[-1]
            end = _free_end(d)  # as on the host path: the request ends with it, the device never sees it
            st = Step(
                tokens if end is None else [*tokens, end],
                tree.num_nodes,
                tree=tree,
                rows=tree.num_nodes,
                path=r.path,
                seconds=dict(seconds),
                free_end=end is not None,
                logprobs=r.logprobs,
            )
            out.append(st)
        return out

    return steps


def launch(
    runner: Runner, batch: Sequence[Decoding], trees: Sequence[Tree] | None = None
) -> Callable[[], list[Step]] | None:
    """The next step of `batch` launched without waiting for it, when every sequence's step runs on the device
    (`Runner.decode_async`): a call that waits and returns what `step` would have. None: step it with `step`.
    The caller's overlap: while the device runs this step, the host takes in the last one (detokenizes, checks
    stops, streams); a sequence found finished then has run one step more, whose tokens are dropped."""
    trees = list(trees) if trees is not None else [d.tree for d in batch]
    groups = _device_groups(runner, batch, trees)
    if len(groups) != 1 or len(groups[0]) != len(batch):
        return None
    return _launched(runner, batch, trees[0])


def _plan(runner: Runner, d: Decoding, tree: Tree) -> _Planned:
    """Draft one sequence's step (its next prompt chunk while prefilling): propose, then constrain."""
    td = time.perf_counter()
    if d.prefilling:
        end = d.prefilled + d.prefill_chunk
        if d.fork_at is not None and d.prefilled < d.fork_at < end:
            end = d.fork_at
        chunk = d.prompt[d.prefilled : end]
        n = len(chunk)
        every_row = d.prompt_logprobs is not None  # each row gives the next prompt token's log-probability
        return _Planned(Verify(d.slot, chunk, np.arange(n), np.tri(n, dtype=bool), last_only=not every_row))
    if d.proposer is None:
        d.proposer = proposer_for(runner, d.drafts, d.grammar is not None)
    room = d.slot.capacity - d.slot.past - 1  # drafted tokens that still fit
    p = d.proposer.propose(draft_input(d), tree, room)
    if d.grammar is not None:
        p = _constrained(d, p, room, runner.info.vocab_size)
    return _Planned(Verify(d.slot, p.draft.tokens, p.tree.depth, p.tree.ancestor_mask), p, time.perf_counter() - td)


def draft_input(d: Decoding) -> DraftInput:
    """What the sequence's proposer drafts its next step from."""
    return DraftInput(
        root=d.root,
        slot=d.slot,
        sampling=d.sampling,
        rng=d.rng,
        grammar=d.grammar,
        lookup=d.lookup,
        budget=d.lookup_length,
        measured=d.slot.past > len(d.prompt),
    )


def _constrained(d: Decoding, p: Proposal, room: int, vocab_size: int) -> Proposal:
    """The proposal without the nodes the grammar forbids, each kept row with its mask; a chain of point-mass
    lookup drafts goes on with the tokens the grammar forces after it."""
    masks = d.grammar.paths()
    tree, draft = constrain(p.tree, p.draft, masks)
    p.feedback.pruned += p.tree.num_nodes - tree.num_nodes
    if p.extend_forced and tree.num_nodes > 1:
        more = masks.forced_after(
            tuple(int(t) for t in draft.tokens[1:]), min(FORCED_DRAFTS, room - tree.num_nodes + 1)
        )
        if more:
            whole = np.concatenate((draft.tokens[1:], more))
            tree, draft = constrain(chain(len(whole)), lookup_draft(d.root, whole, d.sampling, vocab_size), masks)
    p.tree, p.draft = tree, draft
    return p


def _accept(d: Decoding, p: _Planned, logits: np.ndarray) -> Acceptance | None:
    if p.proposal is None:
        return None  # a prompt chunk
    return accept(p.proposal.tree, p.proposal.draft, logits, d.sampling, d.rng, d.processors)


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


def _committed(runner: Runner, d: Decoding, planned: _Planned, acc: Acceptance | None, logits: np.ndarray) -> Step:
    """Commit one sequence's accepted path (or prompt chunk) and say what it emitted."""
    p = planned.proposal
    if p is None:
        return _prefilled(runner, d, planned.verify.tokens, logits)
    t, dr = p.tree, p.draft
    emitted = [int(x) for x in dr.tokens[acc.accepted_nodes]] + [acc.bonus_token]
    runner.commit(acc.path, np.array(emitted, dtype=np.int64), slot=d.slot)
    _extend(d, emitted)
    d.root = acc.bonus_token
    end = _free_end(d)
    st = Step(
        emitted if end is None else [*emitted, end],  # a grammar that allows only the end: no forward for it
        t.num_nodes,
        tree=t,
        rows=t.num_nodes,
        path=acc.path,
        draft_seconds=planned.draft_seconds,
        pruned=p.feedback.pruned,
        free_end=end is not None,
    )
    if d.logprobs is not None:  # emitted token k was drawn from row path[k]: the accepted path's rows, in order
        st.logprobs = token_logprobs(logits[acc.path], emitted, d.logprobs)
    if p.feedback.lookup is not None:
        st.lookup = _lookup_part(p, acc.path)
    if dr.heads is not None:  # a merged tree: below a lookup node there are only lookup nodes
        in_heads = dr.heads[acc.path]
        st.heads_tree, st.heads_path = dr.heads_tree, in_heads[in_heads >= 0]
    elif p.feedback.heads_idle:  # the heads drafted nothing: their statistics see a plain step
        st.heads_tree, st.heads_path = PLAIN, acc.path[:1]
    return st


def _lookup_part(p: Proposal, path: np.ndarray) -> tuple[str, int, int]:
    """A step's lookup proposal: its source, its tokens verified (a merged tree's lookup nodes, else the chain's)
    and those accepted."""
    f, heads = p.feedback.lookup, p.draft.heads
    source = "sequence" if f.match > 0 else "served" if f.served else "store"
    if heads is None:
        return source, p.tree.num_nodes - 1, len(path) - 1
    return source, int((heads < 0).sum()), int((heads[path] < 0).sum())


def _extend(d: Decoding, emitted: list[int]) -> None:
    """What follows the sequence's output: its processors' counts, its grammar's state, its lookup index."""
    d.output += emitted
    for follower in (d.processors, d.grammar, d.lookup):
        if follower is not None:
            follower.extend(emitted)


def _free_end(d: Decoding) -> int | None:
    """The token that ends the request when its grammar now allows only that (emitted without a forward), or None;
    never with log-probabilities, which want that forward's row."""
    return d.grammar.the_end() if d.grammar is not None and d.logprobs is None else None


def _prefilled(runner: Runner, d: Decoding, chunk: np.ndarray, logits: np.ndarray) -> Step:
    """Commit a prompt chunk; after the last one, emit the first token (from the last prompt row's logits)."""
    start, n = d.prefilled, len(chunk)
    d.prefilled += n
    prompt_lp = None
    if d.prompt_logprobs is not None:  # row i: the distribution of prompt token start + i + 1
        after = d.prompt[start + 1 : start + n + 1]
        prompt_lp = token_logprobs(logits[: len(after)], after, d.prompt_logprobs, ranks=True)
    if d.prefilling:
        runner.commit(np.arange(n), d.prompt[start + 1 : start + n + 1], slot=d.slot)
        return Step([], 0, rows=n, prompt_logprobs=prompt_lp)
    logits = logits[-1:]  # the prompt's last row
    allowed = None if d.grammar is None else d.grammar.paths().lazy([()])
    first = accept(
        PLAIN, Draft(chunk[-1:], np.ones(1, bool), None, allowed=allowed), logits, d.sampling, d.rng, d.processors
    ).bonus_token
    runner.commit(np.arange(n), np.append(d.prompt[start + 1 :], first), slot=d.slot)
    if d.drafts.heads and d.tree.num_nodes > 1:  # the heads' pass over the prompt: part of the prefill
        runner.draft_prepare(d.slot)
    d.root = first
    d.output.append(first)
    for follower in (d.processors, d.grammar):
        if follower is not None:
            follower.extend([first])
    d.lookup = (
        PromptLookup(
            list(d.prompt) + [first],
            store=runner.info.ngram_store,
            texts=d.grammar.token_bytes if d.grammar is not None else None,  # a grammar's drafts match text too
            served=d.served,
        )
        if d.drafts.lookup
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
    params: GenerationParams = GenerationParams(),
    drafts: DraftSource | str = DraftSource.HEADS,
    *,
    capacity: int | None = None,
    lookup_length: LookupLength | None = None,
) -> Iterator[Step]:
    """One sequence on the runner's solo slot, with room for prompt + params.max_new_tokens (the rest of the
    context for None) + the tree, or `capacity`: yield each step that emitted tokens (or prompt log-probabilities) until the
    sequence is full; the caller stops iterating when done. `drafts`: where drafts come from ("lookup": `tree`
    is a chain whose depth caps them); `lookup_length`: how much of each lookup proposal to verify (None: all). Its
    random draws come from a generator seeded by params.sampling.seed."""
    prompt = np.asarray(prompt, dtype=np.int64)
    context = runner.info.max_context
    new = context - len(prompt) if params.max_new_tokens is None else params.max_new_tokens
    runner.reset(min(context, len(prompt) + new + tree.num_nodes) if capacity is None else capacity)
    d = Decoding(
        slot=runner.solo,
        prompt=prompt,
        tree=tree,
        sampling=params.sampling,
        rng=np.random.default_rng(params.sampling.seed),
        drafts=drafts,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        lookup_length=lookup_length,
    )
    while not d.full:
        for st in step(runner, [d]):
            if st.tokens or st.prompt_logprobs is not None:
                yield st
