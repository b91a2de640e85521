"""One sequence's state on the step loop (`Decoding`): what runtime/loop.py steps, runtime/requests.py makes and
the policy (runtime/policy.py) reads. Built with keywords; the loop alone advances it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from clover.runtime.backend import Slot
from clover.runtime.grammar import GrammarState
from clover.runtime.lookup import NgramStore, PromptLookup
from clover.runtime.params import PREFILL_CHUNK, DraftSource
from clover.runtime.policy import LookupLength
from clover.runtime.processors import LogitsProcessors
from clover.runtime.proposers import Proposer
from clover.runtime.sampling import SamplingParams
from clover.runtime.tree import Tree


@dataclass(eq=False, kw_only=True)
class Decoding:
    """One sequence being decoded: its runner slot, its prompt (prefilled `prefill_chunk` rows per step), its
    tree (the deepest it may speculate; `step` picks a smaller one when the sequence is nearly full), sampling,
    where its drafts come from, and the token the next step starts from."""

    slot: Slot
    prompt: np.ndarray  # [P] int64
    tree: Tree
    sampling: SamplingParams
    rng: np.random.Generator
    drafts: DraftSource = DraftSource.HEADS
    prefill_chunk: int = PREFILL_CHUNK
    prefilled: int = 0  # prompt tokens in the cache
    root: int = -1  # the last emitted token (the bonus token of the last step)
    # every token emitted after the prompt, the root last: the slot caches the prompt and all of them but the root
    output: list[int] = field(default_factory=list)
    lookup: PromptLookup | None = None
    served: NgramStore | None = None  # the engine's served answers its lookup drafts from (runtime/served_store.py)
    # how many of each lookup proposal to verify (shared by the runner's sequences); None: all of it
    lookup_length: LookupLength | None = None
    processors: LogitsProcessors | None = None  # this request's logits processors (None: none, no work)
    logprobs: int | None = None  # alternatives per emitted token's log-probability (None: no log-probabilities)
    grammar: GrammarState | None = None  # what the output must match (runtime/grammar.py; None: anything)
    # a prompt chunk ends here (the prompt's last token alone after it): other sequences of the same prompt fork
    # this one's caches at that point and each runs the last token itself (its own first token, its own draft state)
    fork_at: int | None = None
    prompt_logprobs: int | None = None  # alternatives per prompt token's log-probability (None: none)
    proposer: Proposer | None = None  # made by the first step that drafts (runtime/proposers.proposer_for)

    def __post_init__(self) -> None:
        self.drafts = DraftSource.of(self.drafts)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    @property
    def full(self) -> bool:
        return self.slot.past + 1 > self.slot.capacity
