"""What generation hands back: a request's `StreamDelta`s as it runs and its `GenerationResult` at the end, and the
per-step bookkeeping (`Progress`) that makes the result. Imported by the engine and the Generator alike. numpy only."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from clover.runtime.grammar import GrammarState
from clover.runtime.logprobs import StepLogprobs, TokenLogprob
from clover.runtime.output import OutputTracker
from clover.runtime.tree import Tree


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
    # a lookup proposal's part in the step: its source (LOOKUP_SOURCES), its tokens verified and accepted
    lookup: tuple[str, int, int] | None = None

    @property
    def wall(self) -> float:
        """The step's wall time (its phases; "engine" is a part of them)."""
        return sum(v for k, v in self.seconds.items() if k != "engine")


# where a lookup draft came from: the sequence itself, the shipped n-gram store, this engine's served answers
LOOKUP_SOURCES = ("sequence", "store", "served")


@dataclass(frozen=True)
class StreamDelta:
    """What one step added to a request's output: text that can no longer change, and the new token ids; with
    log-probabilities asked for, those of the tokens whose text this delta completes (`logprobs`: text that is held
    back, a possible stop string or an incomplete character, holds back its tokens' log-probabilities too, so
    they may lag `token_ids`; all of them are out once the stream ends)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass
class GenerationResult:
    """One generation. `tokens_per_step` is the acceptance length: tokens emitted per verify step,
    the bonus token included (the prefill's first token is not a verify step and is not counted, nor is an end
    token a grammar allowed alone, emitted without a forward)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    new_tokens: int
    steps: int
    tokens_per_step: float
    accepted_per_step: list[int]
    step_seconds: list[float]  # wall time of each verify step (draft + verify + accept + commit)
    seconds: float
    tokens_per_second: float
    timings: dict[str, float] = field(default_factory=dict)
    backend: str = ""
    heads: str = "none"
    tree: str = "plain"
    time_to_first_token: float = 0.0  # seconds from the request to its first token (queueing and prefill)
    queue_seconds: float = 0.0  # seconds from the request to joining the batch
    cached_tokens: int = 0  # prompt tokens whose caches came from an earlier request (the prefix cache)
    drafted_tokens: int = 0  # drafted tokens verified, over all steps
    accepted_tokens: int = 0  # drafted tokens accepted (tokens emitted minus one bonus token per step)
    draft_steps: int = 0  # verify steps that checked drafted tokens (plain steps draft none)
    pruned_tokens: int = 0  # drafted tokens the request's grammar forbade, left out of the verify
    # drafted and accepted tokens by where they came from: "heads" and LOOKUP_SOURCES (only sources that drafted)
    drafts_by_source: dict[str, tuple[int, int]] = field(default_factory=dict)
    # one per token of token_ids when the request asked for log-probabilities (runtime/logprobs.py), else None
    logprobs: list[TokenLogprob] | None = None
    # one per prompt token but the first (which has none) when the request asked for them, else None
    prompt_logprobs: list[TokenLogprob] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Progress:
    """Per-step bookkeeping of one generation, turned into its GenerationResult at the end."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.start = time.perf_counter()
        self.queued = 0.0  # seconds from start to joining the batch (admitted)
        self.first_token: float | None = None  # seconds from start to the first token
        self.cached_tokens = 0  # prompt tokens restored from the prefix cache instead of prefilled
        self.lookup: dict[str, list[int]] = {}  # lookup source -> [verified, accepted] tokens
        self.accepted: list[int] = []  # tokens emitted per verify step
        self.drafted = 0  # drafted tokens verified (tree nodes but the root)
        self.draft_steps = 0  # verify steps with drafted tokens
        self.pruned = 0  # drafted tokens its grammar forbade before the verify
        self.step_seconds: list[float] = []
        self.timings: dict[str, float] = {}

    def admitted(self) -> None:
        """It joins the batch: its time in the queue ends."""
        self.queued = time.perf_counter() - self.start

    def add(self, step: Step) -> None:
        """One step of this sequence: a prompt chunk (no tokens), the prefill's first token, or a verify step."""
        for k, v in step.seconds.items():
            self.timings[k] = self.timings.get(k, 0.0) + v
        if not step.tokens:
            return
        if self.first_token is None:
            self.first_token = time.perf_counter() - self.start
        else:
            self.accepted.append(len(step.tokens) - step.free_end)
            self.drafted += step.tree_nodes - 1
            self.draft_steps += step.tree_nodes > 1
            self.pruned += step.pruned
            self.step_seconds.append(step.wall)
            if step.lookup is not None:
                counts = self.lookup.setdefault(step.lookup[0], [0, 0])
                counts[0] += step.lookup[1]
                counts[1] += step.lookup[2]

    def _by_source(self, accepted: int) -> dict[str, tuple[int, int]]:
        """Drafted and accepted tokens per source: the lookup's as counted, the heads' the rest."""
        out = {k: (v[0], v[1]) for k, v in self.lookup.items()}
        heads = (self.drafted - sum(v[0] for v in out.values()), accepted - sum(v[1] for v in out.values()))
        return {"heads": heads, **out} if heads[0] > 0 else out

    def result(
        self,
        tracker: OutputTracker,
        backend: str,
        heads: str,
        tree: str,
        logprobs: list[TokenLogprob] | None = None,
        grammar: GrammarState | None = None,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> GenerationResult:
        """grammar: the request's, whose state and mask time joins the timings ("grammar", a part of the draft and
        accept phases)."""
        seconds = time.perf_counter() - self.start
        if grammar is not None:
            self.timings["grammar"] = grammar.seconds
        n, acc = tracker.num_tokens, self.accepted
        return GenerationResult(
            token_ids=list(tracker.token_ids),
            text=tracker.text,
            finish_reason=tracker.finish_reason or "length",
            prompt_tokens=self.prompt_tokens,
            new_tokens=n,
            steps=len(acc),
            tokens_per_step=float(np.mean(acc)) if acc else 0.0,
            accepted_per_step=acc,
            step_seconds=self.step_seconds,
            seconds=seconds,
            tokens_per_second=n / seconds if seconds > 0 else 0.0,
            timings=self.timings,
            backend=backend,
            heads=heads,
            tree=tree,
            time_to_first_token=self.first_token or 0.0,
            queue_seconds=self.queued,
            cached_tokens=self.cached_tokens,
            drafted_tokens=self.drafted,
            accepted_tokens=sum(acc) - len(acc),
            draft_steps=self.draft_steps,
            pruned_tokens=self.pruned,
            drafts_by_source=self._by_source(sum(acc) - len(acc)),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
