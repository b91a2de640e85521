"""`Engine`: one model, many callers. A background thread runs the batched step loop; callers (threads, asyncio
tasks, a server) submit requests and read their outputs through per-request queues. The runner is only ever
touched by the engine's thread.

    import clover
    with clover.Engine.load("artifact/", max_batch=8) as engine:
        print(engine.generate("Tell me a joke.", chat=True, max_new_tokens=64).text)
        for delta in engine.stream("Tell me a joke.", chat=True):
            print(delta.text, end="")

Each step: admit waiting requests into free slots, run one batched step over the running ones
(clover.runtime.loop.step: new requests' prompt chunks and the others' speculative steps in one forward), hand
every request its new text, and retire the ones that ended (EOS, stop string, max tokens, full context,
cancellation), freeing their slots.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clover.errors import CloverError
from clover.runtime.backend import Runner
from clover.runtime.cost import verify_cost
from clover.runtime.generator import (
    GenerationResult,
    Progress,
    check_prompt_fits,
    check_token_ids,
    check_token_options,
    choose_tree,
    drafts_label,
    encode_prompt,
    grammar_state,
    load_backend,
    lookup_length,
    stop_conditions,
    with_cost,
)
from clover.runtime.grammar import Grammar, GrammarCompiler
from clover.runtime.logprobs import check_logprobs, prompt_entries
from clover.runtime.loop import LOOKUP_DRAFTS, PREFILL_CHUNK, Decoding, chain, step
from clover.runtime.output import OutputTracker
from clover.runtime.processors import LogitsProcessors
from clover.runtime.sampling import SamplingParams
from clover.runtime.scheduler import (
    AutoTrees,
    Cancelled,
    EngineUnavailable,
    FixedTrees,
    QueueFull,
    Request,
    Scheduler,
    StreamDelta,
    check_max_batch,
    kv_plan,
)
from clover.runtime.tokenizer import Tokenizer
from clover.runtime.tree import Tree, default_tree

__all__ = ["Engine", "EngineStream", "QueueFull", "Cancelled", "EngineUnavailable", "StreamDelta"]


class EngineStream:
    """The output of one request, as it is produced: iterate it (sync or async) for `StreamDelta`s; `result`
    is set once it ends. `cancel()` ends it early and frees its slot."""

    def __init__(self) -> None:
        self._items: deque[StreamDelta | GenerationResult | BaseException] = deque()
        self._ready = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self.result: GenerationResult | None = None
        self._request: Request | None = None

    # called on the engine's thread
    def _deliver(self, item: StreamDelta | GenerationResult | BaseException) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify_all()
            loop, event = self._loop, self._event
        if loop is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the caller's event loop has closed: nobody reads this stream any more
                self.cancel()

    def cancel(self) -> None:
        if self._request is not None:
            self._request.cancelled.set()

    def _take(self, item: StreamDelta | GenerationResult | BaseException) -> StreamDelta | None:
        """The next delta, or None at the end (the result is kept; an error is raised)."""
        if isinstance(item, GenerationResult):
            self.result = item
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Iterator[StreamDelta]:
        while True:
            with self._ready:
                while not self._items:
                    self._ready.wait()
                item = self._items.popleft()
            delta = self._take(item)
            if delta is None:
                return
            yield delta

    async def _anext(self) -> StreamDelta | None:
        while True:
            self._event.clear()
            with self._ready:
                item = self._items.popleft() if self._items else None
            if item is not None:
                return self._take(item)
            await self._event.wait()

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        with self._ready:
            self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
        return self._agen()

    async def _agen(self) -> AsyncIterator[StreamDelta]:
        try:
            while (delta := await self._anext()) is not None:
                yield delta
        finally:
            if self.result is None:  # the caller stopped reading (a disconnect): free the slot
                self.cancel()

    def wait(self) -> GenerationResult:
        for _ in self:
            pass
        assert self.result is not None
        return self.result


AUTO = "auto"


def auto_full_tree(info, drafts: str) -> Tree:
    """The deepest tree --tree auto may pick (it prunes it by depth down to plain): chain-4 for prompt lookup
    and chains-only graphs, else mc26 (pruned to the heads' depth); plain without heads."""
    if drafts == "lookup":
        return chain(max(LOOKUP_DRAFTS, 4))
    if info.heads is None:
        return chain(0)
    if info.chains_only:
        return chain(min(4, info.heads_max_depth or 4))
    return default_tree(info.heads_max_depth)


class Engine:
    """Batched, thread-safe generation on one runner (see the module doc). `tree`: "auto" (each step, each
    sequence's tree sized by its measured acceptance and the verify-cost curve, calibrated at start-up or read from
    the user cache: cost.verify_cost), a fixed tree for every step (a name or Tree), or None (the artifact's
    default); `max_batch`: sequences decoded at once; `max_waiting`: queued requests beyond those (more raise
    QueueFull); `prefill_chunk`: prompt rows a joining request adds to one step (a long prompt is prefilled over
    several steps)."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: Tokenizer,
        tree: Tree | str | None = None,
        drafts: str = "heads",
        max_batch: int = 8,
        max_waiting: int = 256,
        log=sys.stderr,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        if prefill_chunk < 1:
            raise CloverError(f"prefill_chunk must be >= 1 prompt rows per step, got {prefill_chunk}")
        self.runner, self.tokenizer, self.drafts, self.prefill_chunk = runner, tokenizer, drafts, prefill_chunk
        self.scheduler = Scheduler(max_batch, max_waiting)
        if tree == AUTO:
            self.tree = auto_full_tree(runner.info, drafts)
            # up to a full batch of full trees plus a prompt chunk: the rows a step may run (measured once per
            # artifact, machine and batch setting, then read from the user cache: cost.verify_cost)
            cost = verify_cost(
                runner, max(1, min(runner.info.max_context - 40, max_batch * self.tree.num_nodes + prefill_chunk))
            )
            self.policy: AutoTrees | FixedTrees = AutoTrees(self.tree, cost)
            self.lookup_length = lookup_length(runner, self.tree.num_nodes, drafts, cost)
            if log is not None:
                print(
                    f"tree auto: plain up to {self.tree.name}; verify cost {cost.source}: "
                    + ", ".join(f"{r} rows {m:.1f} ms" for r, m in cost.to_dict()["rows_ms"].items()),
                    file=log,
                )
        else:
            self.tree = with_cost(runner, choose_tree(runner.info, tree, drafts))
            self.policy = FixedTrees()
            self.lookup_length = lookup_length(runner, self.tree.num_nodes, drafts)
        self.grammars = GrammarCompiler(tokenizer, runner.info.vocab_size)
        self.error: BaseException | None = None  # the last step's failure, or what stopped the loop
        self.log = log
        self.step_sequences = 0  # sequences in the last forward (prefill chunks included); 0 while idle
        self.prefills_shared = 0  # requests that copied another's prompt caches instead of prefilling (share_prefill)
        if log is not None and runner.info.kv_bytes_per_token:
            print(kv_plan(max_batch, runner.info.max_context, runner.info.kv_bytes_per_token), file=log)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="clover-engine", daemon=True)
        self._thread.start()

    @classmethod
    def load(
        cls,
        base_or_artifact: str | Path,
        heads: str | None = None,
        backend: str = "ort",
        tree: str | None = AUTO,
        max_batch: int = 8,
        threads: int | None = None,
        max_waiting: int = 256,
        log=sys.stderr,
        providers: str | Sequence[str] | None = None,
    ) -> Engine:
        """Mirrors Generator.load: `base_or_artifact` is an artifact folder (ort, trt) or an HF folder /
        'smollm2' (torch); heads "lookup": prompt-lookup drafts on the base alone; tree "auto" (default), a
        tree for every step, or None (the artifact's default); providers: the ort backend's execution
        providers, e.g. "cuda,cpu" (None: the CPU)."""
        check_max_batch(max_batch)  # before minutes of loading
        batch = {"batch": max_batch > 1} if backend == "ort" else {}  # the artifact's batched base graph, if any
        runner, tokenizer, drafts = load_backend(
            base_or_artifact,
            heads,
            backend,
            threads=threads,
            providers=providers,
            default_drafts=tree in (None, AUTO),  # a named tree is the heads'
            **batch,
        )
        return cls(runner, tokenizer, tree, drafts, max_batch, max_waiting, log)

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self, drain: bool = False, timeout: float | None = 60.0) -> None:
        """Stop the loop (idempotent). drain: finish the running and waiting requests first; otherwise they
        end with Cancelled. timeout: seconds to wait for the step under way (None: as long as it takes); a loop
        still busy after it is left to end on its own, and the runner stays open for it."""
        with self.scheduler.lock:
            self._stopping = True
            if self.scheduler.refusing is None:
                self.scheduler.refusing = EngineUnavailable("the engine is closed: load a new one")
            if not drain:
                for r in [*self.scheduler.waiting, *self.scheduler.running]:
                    r.cancelled.set()
            self.scheduler.lock.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._say(f"close: the engine's step did not end within {timeout} s; leaving it to finish")
            return
        self.runner.close()

    @property
    def alive(self) -> bool:
        """The loop runs and takes requests (False once closed, or once the loop died on an error)."""
        return self._thread.is_alive() and self.scheduler.refusing is None

    def _say(self, message: str) -> None:
        if self.log is not None:
            print(f"clover.Engine: {message}", file=self.log, flush=True)

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    # -- requests ---------------------------------------------------------------------------------
    def stream(
        self,
        prompt: str | Sequence[int] | list[dict[str, str]],
        *,
        max_new_tokens: int | None = 128,
        sampling: SamplingParams = SamplingParams(),
        stop: Sequence[str] = (),
        chat: bool = False,
        ignore_eos: bool = False,
        request_id: str | None = None,
        stop_token_ids: Sequence[int] = (),
        logprobs: int | None = None,
        grammar: Grammar | None = None,
        share_prefill: EngineStream | None = None,
        prompt_logprobs: int | None = None,
    ) -> EngineStream:
        """Submit a request; its output arrives through the returned stream. Everything it carries is checked
        here, in the caller's thread, so a bad request fails alone: CloverError at once for bad input (a token id
        outside the vocabulary, a prompt that fills the context, prompt + max_new_tokens past the context, bad
        sampling values), QueueFull when the queue is full, EngineUnavailable once the engine is closed or its loop
        has died. max_new_tokens None: up to the end of the context. request_id: names the request in the engine's
        log and in an internal failure's message (a server's response id). stop_token_ids: ids that end the request
        like EOS. logprobs: every token's log-probability with this many alternatives (0-20), in the deltas and
        the result (None: none). grammar: what the output must match (clover.Grammar), compiled here.
        share_prefill: a stream of the same prompt submitted just before (another choice of one request): this
        request copies that one's prompt caches instead of prefilling again, where the backend can and both join
        the batch together; else it prefills on its own. prompt_logprobs: each prompt token's log-probability (the
        first has none) with this many alternatives, in the result (None: none; such a request does not copy
        another's prefill). Penalties, logit_bias and min_tokens come with `sampling`."""
        if not isinstance(sampling, SamplingParams):
            raise CloverError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        info = self.runner.info
        ids = encode_prompt(self.tokenizer, prompt, chat)
        check_token_ids(ids, info.vocab_size)
        check_prompt_fits(ids, info.max_context)
        room = info.max_context - len(ids)
        if max_new_tokens is None:
            max_new_tokens = room
        elif isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) and max_new_tokens > room:
            raise CloverError(
                f"the prompt has {len(ids)} tokens and max_new_tokens is {max_new_tokens}: together they "
                f"exceed the model's context of {info.max_context} tokens; ask for at most {room}",
                param="max_new_tokens",
            )
        room = max_new_tokens if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) else room
        stop_ids = check_token_options(info.vocab_size, sampling, stop_token_ids, logprobs, room)
        conditions = stop_conditions(self.tokenizer, max_new_tokens, stop, ignore_eos, stop_ids, sampling.min_tokens)
        state = grammar_state(self.grammars, grammar, sampling, conditions.eos_token_ids)
        check_logprobs(prompt_logprobs, "prompt_logprobs")
        out = EngineStream()
        request = Request(
            np.array(ids, dtype=np.int64),
            conditions,
            sampling,
            OutputTracker(self.tokenizer, conditions),
            out._deliver,
            Progress(len(ids)),
            id=request_id,
            logprobs=logprobs,
            token_logprobs=None if logprobs is None else [],
            grammar=state,
            prompt_logprobs=prompt_logprobs,
        )
        out._request = request
        lead = share_prefill._request if share_prefill is not None else None
        same = lead is not None and np.array_equal(lead.prompt, request.prompt)
        if same and len(ids) > 1 and prompt_logprobs is None and self.runner.can_fork:
            request.share = lead
            # before the leader's decoding exists, or while it has not passed that point; else the follower prefills
            lead.fork_at = len(ids) - 1
            if lead.decoding is not None:
                lead.decoding.fork_at = lead.fork_at
        self.scheduler.submit(request)  # raises EngineUnavailable once closed or dead (under the scheduler's lock)
        return out

    def generate(
        self,
        prompt: str | Sequence[int] | list[dict[str, str]],
        *,
        max_new_tokens: int | None = 128,
        sampling: SamplingParams = SamplingParams(),
        stop: Sequence[str] = (),
        chat: bool = False,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        logprobs: int | None = None,
        grammar: Grammar | None = None,
        prompt_logprobs: int | None = None,
    ) -> GenerationResult:
        """Submit a request and wait for its result."""
        return self.stream(
            prompt,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop=stop,
            chat=chat,
            ignore_eos=ignore_eos,
            stop_token_ids=stop_token_ids,
            logprobs=logprobs,
            grammar=grammar,
            prompt_logprobs=prompt_logprobs,
        ).wait()

    async def agenerate(self, prompt: str | Sequence[int] | list[dict[str, str]], **kwargs: Any) -> GenerationResult:
        """generate() for asyncio callers: awaits the result without blocking the event loop."""
        out = self.stream(prompt, **kwargs)
        async for _ in out:
            pass
        assert out.result is not None
        return out.result

    # -- the loop (engine thread) -------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # the loop itself broke: nothing will serve the pending requests again
            self._die(e)

    def _serve(self) -> None:
        sched = self.scheduler
        while True:
            with sched.lock:
                while sched.idle and not self._stopping:
                    self.step_sequences = 0
                    sched.lock.wait()
                if sched.idle and self._stopping:
                    return
            try:
                self._iteration()
            except Exception as e:  # a failed step fails the requests in it; the engine keeps serving
                self._fail_running(e)

    def _die(self, error: BaseException) -> None:
        """Every waiting and running request ends with an error now, and new ones are refused."""
        self.error = error
        self._say(f"the loop stopped: {error!r}")
        failure = EngineUnavailable(f"the engine stopped ({type(error).__name__}): restart the service")
        with self.scheduler.lock:
            self.scheduler.refusing = failure
            pending = [*self.scheduler.waiting, *self.scheduler.running]
            self.scheduler.waiting.clear()
            self.scheduler.running.clear()
        for r in pending:
            r.deliver(failure)

    def _iteration(self) -> None:
        sched, runner = self.scheduler, self.runner
        for r in list(sched.running):
            if r.cancelled.is_set():
                self._retire(r, Cancelled("the request was cancelled"))
        for r in sched.admit():  # joins this step: its prompt is prefilled in the same forward as the others' steps
            try:
                r.decoding = Decoding(
                    self._open(r),
                    r.prompt,
                    self.tree,
                    r.sampling,
                    np.random.default_rng(r.sampling.seed),
                    self.drafts,
                    self.prefill_chunk,
                    lookup_length=self.lookup_length,
                    processors=LogitsProcessors.of(r.sampling, r.prompt, r.stop.eos_token_ids, runner.info.vocab_size),
                    logprobs=r.logprobs,
                    grammar=r.grammar,
                    fork_at=r.fork_at,
                    prompt_logprobs=r.prompt_logprobs,
                )
            except Exception as e:
                self._fail(r, e)
        for r in list(sched.running):  # followers: fork their leader's prompt caches, or prefill on their own
            if r.decoding is not None and r.decoding.slot is None:
                try:
                    self._place(r)
                except Exception as e:
                    self._fail(r, e)
        batch = [r for r in sched.running if r.decoding.slot is not None]
        self.step_sequences = len(batch)
        if not batch:
            return
        decodings = [r.decoding for r in batch]
        # a sequence whose part of the step failed ends alone (loop.step keeps failures to their sequence)
        steps = step(runner, decodings, self.policy.choose(decodings), isolate=True)
        if all(st.error is None for st in steps):  # a step with a failure (and forwards run again) teaches nothing
            self.policy.observe(decodings, steps)
        for r, st in zip(batch, steps):
            try:
                if st.error is not None:
                    raise st.error
                self._emit(r, st)
            except Exception as e:
                self._fail(r, e)

    def _prompt_entries(self, r: Request):
        if r.prompt_logprobs is None:
            return None
        return prompt_entries(r.prompt_steps, [self.tokenizer.token_bytes(int(i)) for i in r.prompt])

    def _capacity(self, r: Request) -> int:
        return min(self.runner.info.max_context, len(r.prompt) + r.stop.max_new_tokens + self.tree.num_nodes)

    def _open(self, r: Request):
        """A joining request's slot, or None for a follower that waits for its leader's prompt caches."""
        if r.share is not None and r.share in self.scheduler.running:
            return None
        return self.runner.open_slot(self._capacity(r))

    def _place(self, r: Request) -> None:
        """A waiting follower's slot. It waits while its leader's caches hold fewer than all but the last prompt
        token; at that point it forks them and runs the last token itself (its own first token and draft state);
        once the leader is past that point or gone, it opens its own slot and prefills."""
        assert r.share is not None
        d, lead = r.decoding, r.share
        at = len(r.prompt) - 1
        ld = lead.decoding if lead in self.scheduler.running else None
        if ld is not None and ld.slot is not None and ld.prefilled < at:
            return  # the leader's prompt is not there yet
        if ld is not None and ld.slot is not None and ld.prefilled == at and ld.fork_at == at:
            d.slot, d.prefilled = self.runner.fork(ld.slot, self._capacity(r)), at
            self.prefills_shared += 1
        else:
            d.slot = self.runner.open_slot(self._capacity(r))

    def _emit(self, r: Request, st) -> None:
        r.progress.add(st)
        if st.prompt_logprobs is not None:
            r.prompt_steps.append(st.prompt_logprobs)
        if not st.tokens:  # a prompt chunk
            return
        before = r.tracker.num_tokens
        text = r.tracker.add(st.tokens)
        if r.token_logprobs is not None and st.logprobs is not None:
            r.token_logprobs += st.logprobs.entries(r.tracker.text_offsets(before))
        ids = r.tracker.token_ids
        done = r.tracker.finished or r.decoding.full
        if done:
            r.tracker.finish("length")  # only reached with the context full
            text += r.tracker.flush()
        if text or len(ids) > r.sent:
            logprobs = ()
            if r.token_logprobs is not None:  # those of the tokens whose text is out
                released = r.tracker.released
                logprobs, r.logprobs_sent = tuple(r.token_logprobs[r.logprobs_sent : released]), released
            r.deliver(StreamDelta(text, tuple(ids[r.sent :]), logprobs))
            r.sent = len(ids)
        if done:
            info = self.runner.info
            self._retire(
                r,
                r.progress.result(
                    r.tracker,
                    info.backend,
                    drafts_label(self.drafts, info),
                    AUTO if isinstance(self.policy, AutoTrees) else self.tree.name,
                    r.token_logprobs,
                    r.grammar,
                    self._prompt_entries(r),
                ),
            )

    def _retire(self, r: Request, end: GenerationResult | BaseException) -> None:
        if r.decoding is not None and r.decoding.slot is not None:
            self.runner.release(r.decoding.slot)
            self.policy.forget(r.decoding)
        self.scheduler.retire(r)
        r.deliver(end)

    def _fail(self, r: Request, error: BaseException) -> None:
        """End one request with an error. An internal one reaches the caller as its type only (its message can
        carry a backend's internals and paths) with the request's id; the engine's log has it whole."""
        self.error = error
        self._say(f"request {r.id or '(no id)'} failed: {error!r}")
        if not isinstance(error, CloverError):
            ref = f" (request {r.id})" if r.id else ""
            error = CloverError(
                f"the engine's step failed{ref} ({type(error).__name__}); the server log has the details"
            )
        if r in self.scheduler.running:
            self._retire(r, error)
        else:
            r.deliver(error)

    def _fail_running(self, error: BaseException) -> None:
        """The step failed outside any one request's part (the engine's own bookkeeping): all in it fail."""
        for r in list(self.scheduler.running):
            self._fail(r, error)
