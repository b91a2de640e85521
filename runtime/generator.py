"""`Generator`: load once, `generate()` many times; streaming text deltas; per-step statistics.

from clover.runtime.generator import Generator
gen = Generator.load(base="smollm2", heads="random:clover2", backend="torch")
result = gen.generate("Tell me a joke.", chat=True, max_new_tokens=64)
for delta in gen.stream("Tell me a joke.", chat=True):
    print(delta, end="")
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from clover.artifact import read_manifest
from clover.errors import CloverError
from clover.runtime.backend import Runner, RunnerInfo, backend_module
from clover.runtime.cost import DraftConfidence, VerifyCost, verify_cost
from clover.runtime.grammar import Grammar, GrammarCompiler, GrammarState
from clover.runtime.logprobs import TokenLogprob, check_logprobs, prompt_entries
from clover.runtime.lookup import LookupLength
from clover.runtime.loop import DRAFT_SOURCES, LOOKUP_DRAFTS, PLAIN, Step, chain, speculative_steps
from clover.runtime.output import OutputTracker, StopConditions
from clover.runtime.processors import LogitsProcessors
from clover.runtime.sampling import SamplingParams
from clover.runtime.tokenizer import Tokenizer
from clover.runtime.tree import DynamicTree, Tree, default_tree, dynamic_tree, resolve_tree

LOOKUP_SUFFIX = "+lookup"  # heads "NAME+lookup": prompt-lookup drafts merged into the heads' tree


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
    drafted_tokens: int = 0  # drafted tokens verified, over all steps
    accepted_tokens: int = 0  # drafted tokens accepted (tokens emitted minus one bonus token per step)
    draft_steps: int = 0  # verify steps that checked drafted tokens (plain steps draft none)
    pruned_tokens: int = 0  # drafted tokens the request's grammar forbade, left out of the verify
    # one per token of token_ids when the request asked for log-probabilities (runtime/logprobs.py), else None
    logprobs: list[TokenLogprob] | None = None
    # one per prompt token but the first (which has none) when the request asked for them, else None
    prompt_logprobs: list[TokenLogprob] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_tree(info: RunnerInfo, tree: Tree | str | None, drafts: str) -> Tree:
    """The tree a runner speculates with, checked against its heads. drafts "lookup": a chain (default
    chain-12, LOOKUP_DRAFTS) capping the prompt-lookup drafts per step; "heads": `tree`, else the artifact's, else mc26."""
    if drafts not in DRAFT_SOURCES:
        raise CloverError(f"unknown draft source {drafts!r}: use one of {', '.join(DRAFT_SOURCES)}")
    if drafts == "lookup":
        chosen = chain(LOOKUP_DRAFTS) if tree is None else resolve_tree(tree) if isinstance(tree, str) else tree
        if not chosen.is_chain:
            raise CloverError(
                f"prompt lookup drafts one continuation, but tree {chosen.name} branches: use "
                "chain-N (N = most drafted tokens per step)"
            )
        return chosen
    if info.heads is None:
        if tree not in (None, "plain") and not (isinstance(tree, Tree) and tree.num_nodes == 1):
            raise CloverError("a token tree needs draft heads: pass --heads (e.g. random:clover2) or --tree plain")
        return PLAIN
    if isinstance(tree, str) and (dynamic := dynamic_tree(tree, info.heads_max_depth)) is not None:
        # a chains-only base verifies dynamic chains: `dynamic` picks the chain's length each step
        tree = dataclasses.replace(dynamic, width=1) if info.chains_only and "-w" not in tree else dynamic
    chosen = (
        (info.default_tree or default_tree(info.heads_max_depth))
        if tree is None
        else (resolve_tree(tree) if isinstance(tree, str) else tree)
    )
    info.check_tree(chosen)
    if info.heads_max_depth is not None and chosen.max_depth > info.heads_max_depth:
        raise CloverError(
            f"tree {chosen.name} has depth {chosen.max_depth} but {info.heads} heads draft at most "
            f"{info.heads_max_depth} tokens: choose a shallower tree (e.g. chain-{info.heads_max_depth}) "
            "or heads with more depth (clover2 drafts any depth)"
        )
    return chosen


def with_cost(runner: Runner, tree: Tree | DynamicTree) -> Tree | DynamicTree:
    """A dynamic tree sized by this runner's verify-cost curve (measured here, once: one to a few seconds)."""
    if not isinstance(tree, DynamicTree) or tree.cost is not None:
        return tree
    return dataclasses.replace(
        tree,
        cost=verify_cost(runner, min(tree.budget + 1, runner.info.max_context - 40)).curve,
        confidence=tree.confidence or DraftConfidence(),
    )


def lookup_length(runner: Runner, tree_rows: int, drafts: str, cost: VerifyCost | None = None) -> LookupLength | None:
    """For prompt-lookup drafts: what sizes their chains, on `cost` (default: this runner's verify-cost curve,
    measured once per runner, one to a few seconds); None for heads alone."""
    if drafts not in ("lookup", "heads+lookup"):
        return None
    if cost is None:
        rows = tree_rows + (LOOKUP_DRAFTS if drafts == "heads+lookup" else 0)
        cost = verify_cost(runner, max(1, min(rows, runner.info.max_context - 40)))
    return LookupLength(cost.curve)


def encode_prompt(
    tokenizer: Tokenizer, prompt: str | Sequence[int] | list[dict[str, str]], chat: bool = False
) -> list[int]:
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


def drafts_label(drafts: str, info: RunnerInfo) -> str:
    """What drafted, for results and reports: lookup, the heads' name, or NAME+lookup."""
    return "lookup" if drafts == "lookup" else info.heads_name + (LOOKUP_SUFFIX if drafts == "heads+lookup" else "")


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Every id an int in [0, vocab_size): anything else would index outside the embedding table (or wrap)."""
    for i, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size:
            raise CloverError(
                f"token id {t!r} at position {i} of the prompt is not in the vocabulary: ids are ints "
                f"from 0 to {vocab_size - 1}",
                param="prompt",
            )


def check_token_options(
    vocab_size: int, sampling: SamplingParams, stop_token_ids: Sequence[int], logprobs: int | None, room: int
) -> tuple[int, ...]:
    """A request's token-level options against the model (CloverError with the param at fault): logit_bias keys
    and stop_token_ids in the vocabulary, logprobs None or 0..20, min_tokens at most `room` (the tokens the request
    may generate). Returns the stop-token ids as a tuple."""
    if not isinstance(sampling, SamplingParams):
        raise CloverError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    check_logprobs(logprobs)
    if isinstance(stop_token_ids, (str, bytes)):
        raise CloverError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}", param="stop_token_ids")
    ids = tuple(stop_token_ids)
    for what, tokens in (("stop_token_ids", ids), ("logit_bias", [t for t, _ in sampling.logit_bias])):
        for t in tokens:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size:
                raise CloverError(
                    f"{what}: {t!r} is not a token id of this model: ids are ints from 0 to {vocab_size - 1}",
                    param=what,
                )
    if sampling.min_tokens > room:
        raise CloverError(
            f"min_tokens is {sampling.min_tokens} but at most {room} tokens may be generated (max_tokens, or what "
            "the context leaves)",
            param="min_tokens",
        )
    return tuple(int(t) for t in ids)


def stop_conditions(
    tokenizer: Tokenizer,
    max_new_tokens: int,
    stop: Sequence[str],
    ignore_eos: bool,
    stop_token_ids: Sequence[int],
    min_tokens: int,
) -> StopConditions:
    """When a request ends: the EOS ids (none with ignore_eos) and the stop-token ids end it like EOS (kept in
    token_ids, no text), stop strings cut its text, and neither ends it before min_tokens."""
    eos = () if ignore_eos else tokenizer.eos_token_ids
    return StopConditions(
        max_new_tokens=max_new_tokens,
        eos_token_ids=tuple(dict.fromkeys((*eos, *stop_token_ids))),
        stop_strings=tuple(stop),
        min_tokens=min_tokens,
    )


def grammar_state(
    compiler: GrammarCompiler, grammar: Grammar | None, sampling: SamplingParams, ends: Sequence[int] = ()
) -> GrammarState | None:
    """A request's grammar compiled (in the caller's thread: an invalid grammar fails that request alone), or
    None without one. ends: the tokens that end the request (StopConditions.eos_token_ids)."""
    if grammar is None:
        return None
    if sampling.min_tokens:
        raise CloverError(
            "min_tokens cannot be combined with a grammar (the grammar may allow only the end of the output before "
            "min_tokens is reached): leave one of them out",
            param="min_tokens",
        )
    try:
        state = compiler.state(grammar)
    except CloverError as e:
        raise CloverError(str(e), param="grammar") from None
    state.ends = frozenset(int(t) for t in ends)
    return state


def check_prompt_fits(ids: Sequence[int], context: int) -> None:
    if len(ids) >= context:
        raise CloverError(
            f"the prompt has {len(ids)} tokens but the model's context is {context}: shorten the prompt "
            "to leave room for at least one generated token",
            param="prompt",
        )


def load_backend(
    base: str | Path,
    heads: str | None,
    backend: str,
    dtype: str | None = None,
    threads: int | None = None,
    providers: str | Sequence[str] | None = None,
    default_drafts: bool = True,
    **options: Any,
) -> tuple[Runner, Tokenizer, str]:
    """The backend's runner, the base's tokenizer and the draft source, from CLI-style specs (Generator.load,
    Engine.load): heads "lookup" is prompt lookup on the base alone, "NAME+lookup" (or "+lookup" for the
    backend's default heads) adds its drafts to the heads' tree; heads and dtype left None take the
    backend's defaults; `threads` reaches the torch and ort backends, `providers` (e.g. "cuda,cpu") the ort
    backend; `options` go to load_runner as they are. default_drafts: heads left None on an artifact take its
    manifest's `drafts` (timed at export); False (the caller named a tree for the heads): its heads."""
    module = backend_module(backend)
    if heads is None and default_drafts and backend in ("ort", "trt"):  # the artifact's default, timed at export
        heads = {"lookup": "lookup", "heads+lookup": LOOKUP_SUFFIX}.get(read_manifest(base).drafts)
    drafts = "lookup" if heads == "lookup" else "heads"
    heads = "none" if drafts == "lookup" else heads
    if heads is not None and heads.endswith(LOOKUP_SUFFIX):  # NAME+lookup, or +lookup: the default heads
        drafts, heads = "heads+lookup", heads.removesuffix(LOOKUP_SUFFIX) or None
    given = {k: v for k, v in (("heads", heads), ("dtype", dtype)) if v is not None} | options
    if threads is not None and backend in ("torch", "ort"):
        given["threads"] = threads
    if providers is not None:
        if backend != "ort":
            raise CloverError(
                f"--providers chooses ONNX Runtime's execution providers: use it with --backend ort, not {backend}"
            )
        given["providers"] = providers
    return module.load_runner(base, **given), Tokenizer.from_dir(module.base_dir(base)), drafts


class Progress:
    """Per-step bookkeeping of one generation, turned into its GenerationResult at the end."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.start = time.perf_counter()
        self.first_token: float | None = None  # seconds from start to the first token
        self.accepted: list[int] = []  # tokens emitted per verify step
        self.drafted = 0  # drafted tokens verified (tree nodes but the root)
        self.draft_steps = 0  # verify steps with drafted tokens
        self.pruned = 0  # drafted tokens its grammar forbade before the verify
        self.step_seconds: list[float] = []
        self.timings: dict[str, float] = {}

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
            drafted_tokens=self.drafted,
            accepted_tokens=sum(acc) - len(acc),
            draft_steps=self.draft_steps,
            pruned_tokens=self.pruned,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class Generator:
    """drafts: "heads" (the runner's draft heads fill `tree`) or "lookup" (prompt lookup, no model: `tree`
    is a chain whose depth caps the drafts per step, chain-12 by default; any runner, heads or not)."""

    def __init__(self, runner: Runner, tokenizer: Tokenizer, tree: Tree | str | None = None, drafts: str = "heads"):
        self.runner, self.tokenizer, self.drafts = runner, tokenizer, drafts
        self.tree = with_cost(runner, choose_tree(runner.info, tree, drafts))
        # what sizes lookup drafts on this runner's verify cost (None: every proposed token is verified)
        self.lookup_length = lookup_length(runner, self.tree.num_nodes, drafts)
        self.grammars = GrammarCompiler(tokenizer, runner.info.vocab_size)

    @classmethod
    def load(
        cls,
        base: str | Path,
        heads: str | None = None,
        backend: str = "torch",
        tree: str | None = None,
        dtype: str | None = None,
        threads: int | None = None,
        providers: str | Sequence[str] | None = None,
    ) -> Generator:
        """Build the backend's runner and the base's tokenizer from CLI-style specs. `base` is an HF folder
        or 'smollm2' for torch, an artifact folder for ort and trt; heads and dtype left None take the
        backend's defaults (torch: none, float32; ort, trt: the artifact's); heads "lookup": prompt-lookup
        drafts on the base alone. `threads`: CPU threads of the torch and ort backends (None: their defaults).
        `providers`: the ort backend's execution providers, e.g. "cuda,cpu" (None: the CPU)."""
        runner, tokenizer, drafts = load_backend(base, heads, backend, dtype, threads, providers, tree is None)
        return cls(runner, tokenizer, tree, drafts)

    # -- public API -----------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int] | list[dict[str, str]], chat: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat)

    def generate(
        self,
        prompt: str | Sequence[int] | list[dict[str, str]],
        *,
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        stop: Sequence[str] = (),
        chat: bool = False,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        logprobs: int | None = None,
        grammar: Grammar | None = None,
        prompt_logprobs: int | None = None,
    ) -> GenerationResult:
        stream = self.stream(
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
        )
        for _ in stream:
            pass
        return stream.result

    def stream(
        self,
        prompt: str | Sequence[int] | list[dict[str, str]],
        *,
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        stop: Sequence[str] = (),
        chat: bool = False,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        logprobs: int | None = None,
        grammar: Grammar | None = None,
        prompt_logprobs: int | None = None,
    ) -> GenerationStream:
        """An iterator of text deltas; its `.result` is set once it is exhausted. stop_token_ids: ids that end
        generation like EOS; logprobs: each token's log-probability with this many alternatives (0-20) in
        `result.logprobs` (None: none); grammar: what the output must match (clover.Grammar: a JSON object or
        schema, a regex, a Lark grammar, a choice); prompt_logprobs: each prompt token's log-probability (the first
        has none) with this many alternatives in `result.prompt_logprobs` (None: none). Penalties, logit_bias and
        min_tokens come with `sampling`."""
        info = self.runner.info
        ids = self.encode_prompt(prompt, chat)
        check_token_ids(ids, info.vocab_size)
        check_prompt_fits(ids, info.max_context)
        room = info.max_context - len(ids)
        if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool):
            room = min(room, max_new_tokens)
        stop_ids = check_token_options(info.vocab_size, sampling, stop_token_ids, logprobs, room)
        conditions = stop_conditions(self.tokenizer, max_new_tokens, stop, ignore_eos, stop_ids, sampling.min_tokens)
        state = grammar_state(self.grammars, grammar, sampling, conditions.eos_token_ids)
        check_logprobs(prompt_logprobs, "prompt_logprobs")
        return GenerationStream(self, ids, conditions, sampling, logprobs, state, prompt_logprobs)


class GenerationStream:
    def __init__(
        self,
        gen: Generator,
        ids: list[int],
        stop: StopConditions,
        sampling: SamplingParams,
        logprobs: int | None = None,
        grammar: GrammarState | None = None,
        prompt_logprobs: int | None = None,
    ):
        self._gen, self._ids, self._stop, self._sampling, self._logprobs = gen, ids, stop, sampling, logprobs
        self._grammar, self._prompt_logprobs = grammar, prompt_logprobs
        self.result: GenerationResult | None = None
        self._it = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._it

    def __next__(self) -> str:
        return next(self._it)

    def _run(self) -> Iterator[str]:
        gen, runner = self._gen, self._gen.runner
        tracker = OutputTracker(gen.tokenizer, self._stop)
        progress = Progress(len(self._ids))
        rng = np.random.default_rng(self._sampling.seed)
        capacity = min(runner.info.max_context, len(self._ids) + self._stop.max_new_tokens + gen.tree.num_nodes)
        prompt = np.array(self._ids, dtype=np.int64)
        processors = LogitsProcessors.of(self._sampling, prompt, self._stop.eos_token_ids, runner.info.vocab_size)
        logprobs: list[TokenLogprob] | None = None if self._logprobs is None else []
        prompt_steps: list = []
        for step in speculative_steps(
            runner,
            prompt,
            gen.tree,
            self._sampling,
            rng,
            capacity,
            gen.drafts,
            gen.lookup_length,
            processors,
            self._logprobs,
            self._grammar,
            self._prompt_logprobs,
        ):
            if step.prompt_logprobs is not None:
                prompt_steps.append(step.prompt_logprobs)
            progress.add(step)
            before = tracker.num_tokens
            delta = tracker.add(step.tokens)
            if logprobs is not None and step.logprobs is not None:
                logprobs += step.logprobs.entries(tracker.text_offsets(before))
            if delta:
                yield delta
            if tracker.finished:
                break
        tracker.finish("length")  # the loop only ends early when the context is full
        tail = tracker.flush()
        if tail:
            yield tail
        self.result = progress.result(
            tracker, runner.info.backend, drafts_label(gen.drafts, runner.info), gen.tree.name, logprobs, self._grammar
        )
        if self._prompt_logprobs is not None:
            self.result.prompt_logprobs = prompt_entries(
                prompt_steps, [gen.tokenizer.token_bytes(i) for i in self._ids]
            )
