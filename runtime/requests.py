"""One request's life, the same for the Engine's requests and the Generator's: its prompt encoded and its
options checked where it is submitted (`Request.make`, in the caller's thread: a bad request fails alone), its
sequence started when it joins a batch (`start`), each step's output taken in (`absorb`: exact stops, text that
can no longer change, log-probabilities), and its result at the end. `Stepper` is the loop's iteration over the
running requests, the same for both: the policy's trees, the step (or the one launched ahead), the policy's
observation, the next step launched ahead where it can be. numpy only."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from clover.errors import CloverError
from clover.runtime.backend import Runner, RunnerInfo, Slot
from clover.runtime.configure import Speculation
from clover.runtime.grammar import GrammarCompiler, GrammarState
from clover.runtime.logprobs import TokenLogprob, prompt_entries
from clover.runtime.loop import launch, step
from clover.runtime.output import OutputTracker, StopConditions
from clover.runtime.params import GenerationParams
from clover.runtime.processors import LogitsProcessors
from clover.runtime.results import GenerationResult, Progress, Step, StreamDelta
from clover.runtime.state import Decoding
from clover.runtime.tokenizer import Tokenizer

Prompt = str | Sequence[int] | list[dict[str, str]]


def encode_prompt(tokenizer: Tokenizer, prompt: Prompt, chat: bool = False) -> list[int]:
    """Token ids of a prompt: chat messages (rendered with the chat template), text (`chat`: as one user
    message), or ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        ids = tokenizer.encode_chat(prompt)
    elif isinstance(prompt, str):
        if not prompt.strip():
            raise CloverError("the prompt is empty: pass some text with --prompt or --prompt-file", param="prompt")
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
    else:
        ids = list(prompt)  # checked by check_token_ids: a float or a wrapped negative id is not a token
    if not ids:
        raise CloverError("the prompt is empty: pass some text with --prompt or --prompt-file", param="prompt")
    return ids


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Every id an int in [0, vocab_size): anything else would index outside the embedding table (or wrap)."""
    for i, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size:
            raise CloverError(
                f"token id {t!r} at position {i} of the prompt is not in the vocabulary: ids are ints "
                f"from 0 to {vocab_size - 1}",
                param="prompt",
            )


def grammar_state(compiler: GrammarCompiler, params: GenerationParams, ends: Sequence[int]) -> GrammarState | None:
    """The request's grammar compiled (an invalid grammar fails that request alone), or None without one. ends: the
    tokens that end the request (StopConditions.eos_token_ids)."""
    if params.grammar is None:
        return None
    try:
        state = compiler.state(params.grammar)
    except CloverError as e:
        raise CloverError(str(e), param="grammar") from None
    state.ends = frozenset(int(t) for t in ends)
    return state


@dataclass(eq=False)
class Request:
    """One generation request and its progress. `deliver` (the engine's) hands its stream deltas and its end to
    the caller."""

    prompt: np.ndarray  # [P] int64
    params: GenerationParams
    stop: StopConditions
    tracker: OutputTracker
    progress: Progress
    grammar: GrammarState | None = None  # what its output must match (compiled at submission)
    deliver: Callable[[StreamDelta | GenerationResult | BaseException], None] | None = None
    id: str | None = None  # the caller's name for it (a server's response id), for the engine's log
    cancelled: threading.Event = field(default_factory=threading.Event)
    decoding: Decoding | None = None  # set when it joins the batch
    done: bool = False  # its output has ended (absorb)
    sent: int = 0  # token ids handed out so far
    token_logprobs: list[TokenLogprob] | None = None  # one per kept token, when asked for
    logprobs_sent: int = 0  # log-probabilities handed out so far (with the text that shows their tokens)
    # another request of the same prompt whose prefill this one copies (Runner.fork) instead of running its own
    share: Request | None = None
    fork_at: int | None = None  # a follower forks this request's caches after this many prompt tokens
    prompt_steps: list = field(default_factory=list)  # its prompt log-probabilities (StepLogprobs), chunk by chunk

    @classmethod
    def make(
        cls,
        ids: Sequence[int],
        params: GenerationParams,
        tokenizer: Tokenizer,
        info: RunnerInfo,
        grammars: GrammarCompiler,
    ) -> Request:
        """The request of prompt `ids`, every option checked against the model (CloverError naming the field)."""
        if not isinstance(params, GenerationParams):
            raise CloverError(f"params must be a GenerationParams, got {type(params).__name__}")
        check_token_ids(ids, info.vocab_size)
        new = params.check(len(ids), info.max_context, info.vocab_size)
        stop = params.stop_conditions(new, tokenizer.eos_token_ids)
        if stop.min_tokens and len(set(stop.eos_token_ids)) >= info.vocab_size:
            raise CloverError(
                f"min_tokens masks the end-of-sequence and stop_token_ids until {stop.min_tokens} tokens are "
                f"generated, and they are all {info.vocab_size} tokens of the vocabulary: nothing could be generated",
                param="min_tokens",
            )
        return cls(
            np.array(ids, dtype=np.int64),
            params,
            stop,
            OutputTracker(tokenizer, stop, params.skip_special_tokens),
            Progress(len(ids)),
            grammar_state(grammars, params, stop.eos_token_ids),
            token_logprobs=None if params.logprobs is None else [],
        )

    def capacity(self, info: RunnerInfo, tree_nodes: int) -> int:
        """Cached tokens its slot needs at most: prompt, new tokens and one more tree."""
        return min(info.max_context, len(self.prompt) + self.stop.max_new_tokens + tree_nodes)

    def start(self, slot: Slot | None, tree, drafts, prefill_chunk: int, lookup_length, vocab_size: int) -> Decoding:
        """Its sequence, joining the batch on `slot` (None: a follower waiting for its leader's prompt caches)."""
        self.progress.admitted()
        sampling = self.params.sampling
        self.decoding = Decoding(
            slot=slot,
            prompt=self.prompt,
            tree=tree,
            sampling=sampling,
            rng=np.random.default_rng(sampling.seed),
            drafts=drafts,
            prefill_chunk=prefill_chunk,
            lookup_length=lookup_length,
            processors=LogitsProcessors.of(sampling, self.prompt, self.stop.eos_token_ids, vocab_size),
            logprobs=self.params.logprobs,
            grammar=self.grammar,
            fork_at=self.fork_at,
            prompt_logprobs=self.params.prompt_logprobs,
        )
        return self.decoding

    def absorb(self, st: Step) -> StreamDelta | None:
        """Take in one step of its sequence; the delta to hand out, if any. Sets `done` once the output ended (EOS,
        a stop, max tokens, or the context full)."""
        self.progress.add(st)
        if st.prompt_logprobs is not None:
            self.prompt_steps.append(st.prompt_logprobs)
        if not st.tokens:  # a prompt chunk
            return None
        tracker = self.tracker
        before = tracker.num_tokens
        text = tracker.add(st.tokens)
        if self.token_logprobs is not None and st.logprobs is not None:
            self.token_logprobs += st.logprobs.entries(tracker.text_offsets(before))
        ids = tracker.token_ids
        self.done = tracker.finished or self.decoding.full
        if self.done:
            tracker.finish("length")  # only reached with the context full
            text += tracker.flush()
        if not text and len(ids) <= self.sent:
            return None
        logprobs = ()
        if self.token_logprobs is not None:  # those of the tokens whose text is out
            released = tracker.released
            logprobs, self.logprobs_sent = tuple(self.token_logprobs[self.logprobs_sent : released]), released
        delta = StreamDelta(text, tuple(ids[self.sent :]), logprobs)
        self.sent = len(ids)
        return delta

    def result(self, tokenizer: Tokenizer, backend: str, heads: str, tree: str) -> GenerationResult:
        prompt_lp = None
        if self.params.prompt_logprobs is not None:
            prompt_lp = prompt_entries(self.prompt_steps, [tokenizer.token_bytes(int(i)) for i in self.prompt])
        return self.progress.result(self.tracker, backend, heads, tree, self.token_logprobs, self.grammar, prompt_lp)


class Stepper:
    """The loop's iteration over running requests, shared by the Engine and the Generator: the policy chooses each
    sequence's tree, the step runs (failures kept to their sequence), the policy observes it, and the next step can
    be launched before this one is taken in (`launch_next`: overlap), to be taken by the next `take`."""

    def __init__(self, runner: Runner, speculation: Speculation) -> None:
        self.runner, self.speculation = runner, speculation
        self.ahead: tuple[list[Request], Callable[[], list[Step]]] | None = None  # the step in flight, its requests

    def take(self, batch: Callable[[], list[Request]]) -> tuple[list[Request], list[Step]]:
        """The step launched ahead last time, with its requests as they were then; else a new step of `batch()`."""
        if self.ahead is not None:
            requests, wait = self.ahead
            self.ahead = None
            return requests, wait()
        requests = batch()
        if not requests:
            return [], []
        decodings = [r.decoding for r in requests]
        return requests, step(self.runner, decodings, self.speculation.policy.choose(decodings), isolate=True)

    def observe(self, requests: Sequence[Request], steps: Sequence[Step]) -> bool:
        """The policy learns from a step that failed nowhere (a failure ran forwards again: it teaches nothing)."""
        if any(st.error is not None for st in steps):
            return False
        self.speculation.policy.observe([r.decoding for r in requests], steps)
        return True

    def launch_next(self, requests: list[Request]) -> None:
        """Launch the requests' next step now, where every sequence's step runs on the device and none is full."""
        decodings = [r.decoding for r in requests]
        if not self.runner.can_decode or any(d.full for d in decodings):
            return
        wait = launch(self.runner, decodings, self.speculation.policy.choose(decodings))
        if wait is not None:
            self.ahead = (requests, wait)

    def finish(self) -> None:
        """The step in flight done, its tokens dropped (its requests ended while it ran)."""
        if self.ahead is not None:
            self.ahead[1]()
            self.ahead = None
