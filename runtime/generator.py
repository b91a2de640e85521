"""`Generator`: load once, `generate()` many times, one sequence at a time; streaming text deltas; per-step
statistics. It drives the same step loop and the same request path as `Engine` (a one-sequence engine without a
thread), so its outputs are the engine's.

    from clover import GenerationParams, Generator
    gen = Generator.load("smollm2", heads="random:clover2", backend="torch")
    result = gen.generate("Tell me a joke.", GenerationParams(max_new_tokens=64), chat=True)
    for delta in gen.stream("Tell me a joke.", chat=True):
        print(delta, end="")
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from clover.runtime.backend import Runner
from clover.runtime.configure import Speculation, load_backend
from clover.runtime.grammar import GrammarCompiler
from clover.runtime.params import PREFILL_CHUNK, DraftSource, EngineOptions, GenerationParams
from clover.runtime.policy import LookupLength
from clover.runtime.requests import Prompt, Request, Stepper, encode_prompt
from clover.runtime.results import GenerationResult
from clover.runtime.tokenizer import Tokenizer
from clover.runtime.tree import Tree

__all__ = ["GenerationResult", "GenerationStream", "Generator"]


class Generator:
    """One sequence at a time on `runner`. `tree`: the tree every step speculates (a name or Tree; None: the
    artifact's default, or the heads' default; "auto": sized each step as Engine's); `drafts`: where drafts come
    from ("heads", "lookup": prompt lookup, no model, `tree` a chain capping the drafts per step, chain-12 by
    default; "heads+lookup": both in one tree); `overlap`: on a runner whose device runs ahead of the host (the
    stacked torch runner), each step is launched before the last one is taken in (detokenized, checked for stops,
    streamed), so that host work hides behind the device's; the tokens are the same either way."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: Tokenizer,
        tree: Tree | str | None = None,
        drafts: DraftSource | str = DraftSource.HEADS,
        overlap: bool = True,
    ) -> None:
        self.runner, self.tokenizer = runner, tokenizer
        # launch each device-side step before taking in the last one (runtime/loop.launch), where the runner can
        self.overlap = overlap
        self.speculation = Speculation.build(runner, tree, drafts, EngineOptions(max_batch=1), log=None)
        self.grammars = GrammarCompiler(tokenizer, runner.info.vocab_size)

    @classmethod
    def load(
        cls,
        base: str | Path,
        heads: str | None = None,
        backend: str = "torch",
        tree: str | None = None,
        options: EngineOptions = EngineOptions(),
    ) -> Generator:
        """Build the backend's runner and the base's tokenizer from CLI-style specs. `base` is an HF folder
        or 'smollm2' for torch, an artifact folder for ort and trt; heads left None take the backend's defaults
        (torch: none; ort, trt: the artifact's); heads "lookup": prompt-lookup drafts on the base alone.
        `options`: the runner's (EngineOptions' dtype, threads, providers; a Generator decodes one sequence)."""
        runner, tokenizer, drafts = load_backend(base, heads, backend, options.replace(max_batch=1), tree is None)
        return cls(runner, tokenizer, tree, drafts)

    @property
    def tree(self) -> Tree:
        return self.speculation.tree

    @property
    def drafts(self) -> DraftSource:
        return self.speculation.drafts

    @property
    def lookup_length(self) -> LookupLength | None:
        """What sizes prompt-lookup drafts (None: every proposed token is verified; settable)."""
        return self.speculation.lookup_length

    @lookup_length.setter
    def lookup_length(self, value: LookupLength | None) -> None:
        self.speculation.lookup_length = value

    def encode_prompt(self, prompt: Prompt, chat: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat)

    def generate(
        self, prompt: Prompt, params: GenerationParams = GenerationParams(), *, chat: bool = False
    ) -> GenerationResult:
        stream = self.stream(prompt, params, chat=chat)
        for _ in stream:
            pass
        return stream.result

    def stream(
        self, prompt: Prompt, params: GenerationParams = GenerationParams(), *, chat: bool = False
    ) -> GenerationStream:
        """An iterator of text deltas; its `.result` is set once it is exhausted. Everything the request carries
        is checked here (CloverError naming the field), before any step runs."""
        request = Request.make(
            self.encode_prompt(prompt, chat), params, self.tokenizer, self.runner.info, self.grammars
        )
        return GenerationStream(self, request)


class GenerationStream:
    """The text deltas of one Generator request; `result` once exhausted."""

    def __init__(self, gen: Generator, request: Request) -> None:
        self._gen, self._request = gen, request
        self.result: GenerationResult | None = None
        self._it = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._it

    def __next__(self) -> str:
        return next(self._it)

    def _run(self) -> Iterator[str]:
        gen, r, runner = self._gen, self._request, self._gen.runner
        spec, info = gen.speculation, runner.info
        runner.reset(r.capacity(info, spec.tree.num_nodes))
        r.start(runner.solo, spec.tree, spec.drafts, PREFILL_CHUNK, spec.lookup_length, info.vocab_size)
        stepper = Stepper(runner, spec)  # the Engine's iteration, for one request
        try:
            while not r.done:
                batch, steps = stepper.take(lambda: [r])
                if steps[0].error is not None:
                    raise steps[0].error
                stepper.observe(batch, steps)
                if gen.overlap:
                    stepper.launch_next(batch)
                delta = r.absorb(steps[0])
                if delta is not None and delta.text:
                    yield delta.text
            stepper.finish()  # the output ended with a step in flight: it finishes, its tokens are dropped
        finally:
            spec.policy.forget(r.decoding)
        self.result = r.result(gen.tokenizer, info.backend, spec.label(info), spec.tree_name)
