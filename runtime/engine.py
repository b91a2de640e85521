"""`Engine`: one model, many callers. A background thread runs the batched step loop; callers (threads, asyncio
tasks, a server) submit requests and read their outputs through per-request queues. The runner is only ever
touched by the engine's thread.

    import clover
    with clover.Engine.load("artifact/", options=clover.EngineOptions(max_batch=8)) as engine:
        print(engine.generate("Tell me a joke.", clover.GenerationParams(max_new_tokens=64), chat=True).text)
        for delta in engine.stream("Tell me a joke.", chat=True):
            print(delta.text, end="")

Each step: admit waiting requests into free slots, run one batched step over the running ones
(clover.runtime.loop.step: new requests' prompt chunks and the others' speculative steps in one forward), hand
every request its new text (Request.absorb), and retire the ones that ended (EOS, stop string, max tokens, full
context, cancellation), freeing their slots.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from collections import deque
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from clover.errors import CloverError
from clover.runtime.backend import Runner
from clover.runtime.configure import AUTO, Speculation, load_backend
from clover.runtime.grammar import GrammarCompiler
from clover.runtime.params import DraftSource, EngineOptions, GenerationParams
from clover.runtime.prefix_cache import PrefixCache, default_budget_mb
from clover.runtime.requests import Prompt, Request, Stepper, encode_prompt
from clover.runtime.results import GenerationResult, StreamDelta
from clover.runtime.scheduler import Cancelled, EngineUnavailable, QueueFull, Scheduler, kv_plan
from clover.runtime.served_store import ServedStore
from clover.runtime.served_store import default_budget_mb as default_store_mb
from clover.runtime.tokenizer import Tokenizer
from clover.runtime.tree import Tree

__all__ = ["AUTO", "Engine", "EngineStream", "QueueFull", "Cancelled", "EngineUnavailable", "StreamDelta"]


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

    @property
    def prompt_tokens(self) -> int:
        """The tokens of its prompt (0 before it is submitted)."""
        return 0 if self._request is None else len(self._request.prompt)

    @property
    def cached_tokens(self) -> int:
        """Of its prompt, the tokens restored from the prefix cache (0 before it joins the batch)."""
        return 0 if self._request is None else self._request.progress.cached_tokens

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


class Engine:
    """Batched, thread-safe generation on one runner (see the module doc). `tree`: "auto" (each step, each
    sequence's tree sized by its measured acceptance and the verify-cost curve, calibrated at start-up or read from
    the user cache: cost.verify_cost), a fixed tree for every step (a name or Tree), or None (the artifact's
    default); `drafts`: where drafts come from (DraftSource or its name); `options`: batch size, queue length,
    prefill chunk (EngineOptions); `log`: where start-up lines and failures are written (None: nowhere); `overlap`:
    launch each device-side step before taking in the last one where the runner can (the same tokens either way)."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: Tokenizer,
        tree: Tree | str | None = None,
        drafts: DraftSource | str = DraftSource.HEADS,
        options: EngineOptions = EngineOptions(),
        log: IO | None = sys.stderr,
        *,
        overlap: bool = True,
    ) -> None:
        self.runner, self.tokenizer, self.options, self.log = runner, tokenizer, options, log
        # On a runner whose device runs ahead of the host (Runner.decode_async), the next step of a batch that steps
        # on the device alone is launched before this one is taken in: detokenizing, stops and streaming run while
        # the device works. A request that ends meanwhile ran one step too many (dropped); its slot is released once
        # that step is done.
        self.overlap = overlap
        self._held: list[tuple[Request, bool]] = []  # ended requests whose slots the step in flight still writes, kept?
        self.scheduler = Scheduler(options.max_batch, options.max_waiting)
        self.speculation = Speculation.build(runner, tree, drafts, options, log)
        self.stepper = Stepper(self.runner, self.speculation)
        self.grammars = GrammarCompiler(tokenizer, runner.info.vocab_size)
        self.error: BaseException | None = None  # the last step's failure, or what stopped the loop
        self.step_sequences = 0  # sequences in the last forward (prefill chunks included); 0 while idle
        self.prefills_shared = 0  # requests that copied another's prompt caches instead of prefilling (share_prefill)
        mb = default_budget_mb() if options.prefix_cache_mb is None else options.prefix_cache_mb
        # ended requests' caches, for later prompts that begin with their tokens (None: off, or a runner without it)
        heads = self.speculation.drafts.heads
        self.prefix_cache = PrefixCache(runner, mb << 20, heads=heads) if mb and runner.can_cache_prefixes else None
        # finished answers prompt lookup drafts from (None: off, or drafts without prompt lookup)
        self.served = self._served_store(options)
        if log is not None and runner.info.kv_bytes_per_token:
            print(kv_plan(options.max_batch, runner.info.max_context, runner.info.kv_bytes_per_token), file=log)
        if log is not None:
            cache = f"{self.prefix_cache.budget >> 20} MiB" if self.prefix_cache is not None else "off"
            store = f"{self.served.budget >> 20} MiB" if self.served is not None else "off"
            print(f"Reuse of earlier requests: prefix cache {cache}, served-answers store {store}", file=log)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="clover-engine", daemon=True)
        self._thread.start()

    def _served_store(self, options: EngineOptions) -> ServedStore | None:
        mb = default_store_mb() if options.draft_store_mb is None else options.draft_store_mb
        if not mb or not self.speculation.drafts.lookup:
            return None
        vocab = self.runner.info.vocab_size
        return ServedStore(vocab, mb << 20, options.draft_store_shared, options.draft_store_dir)

    @classmethod
    def load(
        cls,
        base_or_artifact: str | Path,
        heads: str | None = None,
        backend: str = "ort",
        tree: str | None = AUTO,
        options: EngineOptions = EngineOptions(),
        log: IO | None = sys.stderr,
    ) -> Engine:
        """Mirrors Generator.load: `base_or_artifact` is an artifact folder (ort, trt) or an HF folder /
        'smollm2' (torch); heads "lookup": prompt-lookup drafts on the base alone; tree "auto" (default), a
        tree for every step, or None (the artifact's default); options: the engine's and the runner's
        (EngineOptions: max_batch, threads, providers ...)."""
        # a named tree is the heads'; auto or the artifact's default take the artifact's draft source
        runner, tokenizer, drafts = load_backend(base_or_artifact, heads, backend, options, tree in (None, AUTO))
        return cls(runner, tokenizer, tree, drafts, options, log)

    @property
    def tree(self) -> Tree:
        """The deepest tree a sequence speculates (tree "auto": the one it prunes)."""
        return self.speculation.tree

    @property
    def drafts(self) -> DraftSource:
        return self.speculation.drafts

    @property
    def policy(self):
        return self.speculation.policy

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
        if self.served is not None:
            self.served.close()
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
        prompt: Prompt,
        params: GenerationParams = GenerationParams(),
        *,
        chat: bool = False,
        request_id: str | None = None,
        share_prefill: EngineStream | None = None,
    ) -> EngineStream:
        """Submit a request; its output arrives through the returned stream. Everything it carries is checked
        here, in the caller's thread, so a bad request fails alone: CloverError at once for bad input (a token id
        outside the vocabulary, a prompt that fills the context, prompt + max_new_tokens past the context, bad
        options), QueueFull when the queue is full, EngineUnavailable once the engine is closed or its loop has
        died. chat: text is one user message, rendered with the chat template. request_id: names the request in
        the engine's log and in an internal failure's message (a server's response id). share_prefill: a stream
        of the same prompt submitted just before (another choice of one request): this request copies that one's
        prompt caches instead of prefilling again, where the backend can and both join the batch together; else it
        prefills on its own (so does a request asking for prompt_logprobs)."""
        ids = encode_prompt(self.tokenizer, prompt, chat)
        request = Request.make(ids, params, self.tokenizer, self.runner.info, self.grammars)
        out = EngineStream()
        request.deliver, request.id, out._request = out._deliver, request_id, request
        lead = share_prefill._request if share_prefill is not None else None
        same = lead is not None and np.array_equal(lead.prompt, request.prompt)
        if same and len(ids) > 1 and params.prompt_logprobs is None and self.runner.can_fork:
            request.share = lead
            # before the leader's decoding exists, or while it has not passed that point; else the follower prefills
            lead.fork_at = len(ids) - 1
            if lead.decoding is not None:
                lead.decoding.fork_at = lead.fork_at
        self.scheduler.submit(request)  # raises EngineUnavailable once closed or dead (under the scheduler's lock)
        return out

    def generate(
        self, prompt: Prompt, params: GenerationParams = GenerationParams(), *, chat: bool = False
    ) -> GenerationResult:
        """Submit a request and wait for its result."""
        return self.stream(prompt, params, chat=chat).wait()

    async def agenerate(
        self, prompt: Prompt, params: GenerationParams = GenerationParams(), *, chat: bool = False
    ) -> GenerationResult:
        """generate() for asyncio callers: awaits the result without blocking the event loop."""
        out = self.stream(prompt, params, chat=chat)
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
        sched, spec, stepper = self.scheduler, self.speculation, self.stepper
        ahead = stepper.ahead is not None
        try:
            batch, steps = stepper.take(self._joined)
        finally:
            if ahead:
                self._release_held()
        if ahead:  # the step launched last time: the requests that ended meanwhile have their tokens dropped
            live = [i for i, r in enumerate(batch) if r in sched.running]
            batch, steps = [batch[i] for i in live], [steps[i] for i in live]
        else:
            self.step_sequences = len(batch)
            if not batch:
                return
        if stepper.observe(batch, steps):
            self._launch_next(batch)
        for r, st in zip(batch, steps):  # a sequence whose part of the step failed ends alone
            try:
                if st.error is not None:
                    raise st.error
                delta = r.absorb(st)
                if delta is not None:
                    r.deliver(delta)
                if r.done:
                    info = self.runner.info
                    self._retire(r, r.result(self.tokenizer, info.backend, spec.label(info), spec.tree_name))
            except Exception as e:
                self._fail(r, e)
        if stepper.ahead is not None and not sched.running:  # nothing left to take in: finish it now, free the slots
            stepper.finish()
            self._release_held()

    def _joined(self) -> list[Request]:
        """The running requests after cancellations and admissions, those with a slot: this step's batch."""
        sched, runner, spec = self.scheduler, self.runner, self.speculation
        for r in list(sched.running):
            if r.cancelled.is_set():
                self._retire(r, Cancelled("the request was cancelled"))
        for r in sched.admit():  # joins this step: its prompt is prefilled in the same forward as the others' steps
            try:
                chunk, vocab = self.options.prefill_chunk, runner.info.vocab_size
                r.start(self._open(r), spec.tree, spec.drafts, chunk, spec.lookup_length, vocab)
                self._reuse(r)
            except Exception as e:
                self._fail(r, e)
        for r in list(sched.running):  # followers: fork their leader's prompt caches, or prefill on their own
            if r.decoding is not None and r.decoding.slot is None:
                try:
                    self._place(r)
                except Exception as e:
                    self._fail(r, e)
        return [r for r in sched.running if r.decoding.slot is not None]

    def _launch_next(self, batch: list[Request]) -> None:
        """Launch the batch's next step now (overlap) when nothing would change it: no request waiting for room or a
        slot, none cancelled, and every sequence's step on the device."""
        sched = self.scheduler
        if not self.overlap or len(batch) != len(sched.running):
            return
        if (sched.waiting and len(sched.running) < sched.max_batch) or any(r.cancelled.is_set() for r in batch):
            return
        self.stepper.launch_next(batch)

    def _release_held(self) -> None:
        for r, keep in self._held:
            if keep:
                self._keep(r)
            self.runner.release(r.decoding.slot)
        self._held.clear()

    def _capacity(self, r: Request) -> int:
        return r.capacity(self.runner.info, self.tree.num_nodes)

    def _open(self, r: Request):
        """A joining request's slot, or None for a follower that waits for its leader's prompt caches."""
        if r.share is not None and r.share in self.scheduler.running:
            return None
        return self.runner.open_slot(self._capacity(r))

    def _reuse(self, r: Request) -> None:
        """A joining request's prompt rows that an ended one computed, restored instead of prefilled (not with
        prompt_logprobs, which want every prompt row's logits)."""
        d = r.decoding
        if self.served is not None:
            d.served = self.served.store(r.params.scope)
        if self.prefix_cache is None or d.slot is None or r.params.prompt_logprobs is not None:
            return
        d.prefilled = r.progress.cached_tokens = self.prefix_cache.restore(d.slot, r.prompt, self._salt(r))

    def _keep(self, r: Request) -> None:
        """An ended request's rows into the prefix cache (a failed step may have left its caches half written)."""
        d = r.decoding
        if self.prefix_cache is None or d.slot is None or d.slot.pending or d.prefilling:
            return
        try:
            if self.prefix_cache.heads:  # rows the heads have not taken in (lookup-alone steps): now, so all are kept
                self.runner.draft_prepare(d.slot)
            tokens = np.concatenate([d.prompt, np.array(d.output, dtype=np.int64)])
            self.prefix_cache.store(d.slot, tokens, self._salt(r))
        except Exception as e:  # noqa: BLE001 - a prefix not kept costs a later prefill, never this request
            self._say(f"request {r.id or '(no id)'}: its caches were not kept for reuse ({e!r})")

    @staticmethod
    def _salt(r: Request) -> str | None:
        """Whose cached prefixes a request shares: its scope's, and within it its cache_salt's."""
        p = r.params
        return None if p.scope is None and p.cache_salt is None else f"{p.scope}\x00{p.cache_salt}"

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

    def _retire(self, r: Request, end: GenerationResult | BaseException) -> None:
        if self.served is not None and isinstance(end, GenerationResult) and end.token_ids:
            self.served.add(r.prompt, end.token_ids, r.params.scope)
        if r.decoding is not None and r.decoding.slot is not None:
            keep = not isinstance(end, BaseException) or isinstance(end, Cancelled)  # its caches are whole
            if self.stepper.ahead is not None and r in self.stepper.ahead[0]:
                self._held.append((r, keep))  # the step in flight writes its slot: released once it is done
            else:
                if keep:
                    self._keep(r)
                self.runner.release(r.decoding.slot)
            self.policy.forget(r.decoding)
        self.scheduler.retire(r)
        r.deliver(end)

    def _fail(self, r: Request, error: BaseException) -> None:
        """End one request with an error. An internal one reaches the caller as its type only (its message can
        carry a backend's internals and paths) with the request's id; the engine's log has it whole."""
        self.error = error
        self._say(f"request {r.id or '(no id)'} failed: {error!r}")
        if not isinstance(error, CloverError):  # a defect: where it happened, for whoever reads the log
            self._say("".join(traceback.format_exception(error)).rstrip())
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
