"""What one request asks for (`GenerationParams`), how an engine is built (`EngineOptions`), and where drafts come
from (`DraftSource`): frozen objects, each checked once where it is made; what depends on the model (the context,
the vocabulary) is checked against it by `GenerationParams.check`. numpy only.

    from clover import GenerationParams, SamplingParams
    params = GenerationParams(max_new_tokens=64, sampling=SamplingParams(temperature=0.7, seed=1), stop=("\\n\\n",))
    engine.generate("Tell me a joke.", params, chat=True)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from os import PathLike
from typing import Any

import numpy as np

from clover.errors import CloverError
from clover.runtime.grammar import Grammar
from clover.runtime.logprobs import check_logprobs
from clover.runtime.output import StopConditions
from clover.runtime.sampling import SamplingParams

PREFILL_CHUNK = 256  # prompt rows a sequence adds to one forward: a long prompt does not stall the batch for long


class DraftSource(enum.StrEnum):
    """Where a sequence's drafts come from: the runner's draft heads, prompt lookup (no model), or both merged
    into one tree. A str enum: "heads", "lookup" and "heads+lookup" name them."""

    HEADS = "heads"
    LOOKUP = "lookup"
    MERGED = "heads+lookup"

    @classmethod
    def of(cls, value: DraftSource | str) -> DraftSource:
        try:
            return cls(value)
        except ValueError:
            raise CloverError(f"unknown draft source {value!r}: use one of {', '.join(s.value for s in cls)}") from None

    @property
    def heads(self) -> bool:
        """The draft heads run (alone or merged)."""
        return self is not DraftSource.LOOKUP

    @property
    def lookup(self) -> bool:
        """Prompt lookup proposes (alone or merged)."""
        return self is not DraftSource.HEADS


def _token_id(t: Any) -> bool:
    return not isinstance(t, (bool, np.bool_)) and isinstance(t, (int, np.integer)) and t >= 0


@dataclass(frozen=True)
class GenerationParams:
    """One request's options, the same for `Engine`, `Generator`, the step loop and the server.

    max_new_tokens: at most this many generated tokens; None: up to the end of the context. More than the
        context leaves after the prompt is an error (CloverError naming max_new_tokens), everywhere.
    sampling: temperature, top-p, seed, penalties, logit_bias, min_tokens (SamplingParams).
    stop: strings that end the output (cut before them; include_stop_str: after them). stop_token_ids: ids that end
        it like EOS (kept in token_ids, no text). ignore_eos: go on past the model's EOS tokens. skip_special_tokens:
        special tokens add no text (False: their text is written).
    logprobs: each generated token's log-probability with this many alternatives (0-20; None: none).
    prompt_logprobs: each prompt token's log-probability (the first has none) with this many alternatives.
    grammar: what the output must match (clover.Grammar: JSON object / schema, regex, Lark, choice).
    cache_salt: the prefix cache's scope (as vLLM's field): the request reuses, and leaves, cached prefixes only among
        requests of the same salt (None: the unsalted ones).
    scope: whose past answers the request may draft from and whose store its answer joins (the served-answers store,
        runtime/served_store.py), and whose cached prefixes it shares; clover-serve sets its API key's digest. None:
        the unscoped requests'.
    """

    max_new_tokens: int | None = 128
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: Grammar | None = None
    cache_salt: str | None = None
    scope: str | None = None

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1):
            raise CloverError(
                f"max_new_tokens must be an int >= 1 or None (up to the end of the context), got {n!r}",
                param="max_new_tokens",
            )
        if not isinstance(self.sampling, SamplingParams):
            raise CloverError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if isinstance(self.stop, (str, bytes)):
            raise CloverError(
                f"stop must be a sequence of strings, got the string {self.stop!r}; write ({self.stop!r},)",
                param="stop",
            )
        stop = tuple(self.stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise CloverError(f"stop strings must be non-empty strings, got {s!r} in {stop!r}", param="stop")
        if isinstance(self.stop_token_ids, (str, bytes)):
            raise CloverError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}", param="stop_token_ids"
            )
        ids = tuple(self.stop_token_ids)
        for t in ids:
            if not _token_id(t):
                raise CloverError(f"stop_token_ids: {t!r} is not a token id (an int >= 0)", param="stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            raise CloverError(f"ignore_eos must be a bool, got {self.ignore_eos!r}", param="ignore_eos")
        check_logprobs(self.logprobs)
        check_logprobs(self.prompt_logprobs, "prompt_logprobs")
        if self.grammar is not None:
            if not isinstance(self.grammar, Grammar):
                raise CloverError(
                    f"grammar must be a clover.Grammar, got {type(self.grammar).__name__}", param="grammar"
                )
            if self.sampling.min_tokens:
                raise CloverError(
                    "min_tokens cannot be combined with a grammar (the grammar may allow only the end of the output "
                    "before min_tokens is reached): leave one of them out",
                    param="min_tokens",
                )
        object.__setattr__(self, "max_new_tokens", None if n is None else int(n))
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))

    def replace(self, **changes: Any) -> GenerationParams:
        """A copy with some fields changed (checked again)."""
        return replace(self, **changes)

    def check(self, prompt_tokens: int, context: int, vocab_size: int) -> int:
        """Check what depends on the model, for a prompt of `prompt_tokens`; returns the tokens the request may
        generate (max_new_tokens, or the rest of the context for None). One CloverError per field at fault."""
        if prompt_tokens >= context:
            raise CloverError(
                f"the prompt has {prompt_tokens} tokens but the model's context is {context}: shorten the prompt "
                "to leave room for at least one generated token",
                param="prompt",
            )
        room = context - prompt_tokens
        if self.max_new_tokens is not None and self.max_new_tokens > room:
            raise CloverError(
                f"the prompt has {prompt_tokens} tokens and max_new_tokens is {self.max_new_tokens}: together they "
                f"exceed the model's context of {context} tokens; ask for at most {room}",
                param="max_new_tokens",
            )
        new = room if self.max_new_tokens is None else self.max_new_tokens
        for what, tokens in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", [t for t, _ in self.sampling.logit_bias]),
            ("allowed_token_ids", self.sampling.allowed_token_ids),
            ("bad_words", [t for w in self.sampling.bad_words for t in w]),
        ):
            for t in tokens:
                if not (_token_id(t) and t < vocab_size):
                    raise CloverError(
                        f"{what}: {t!r} is not a token id of this model: ids are ints from 0 to {vocab_size - 1}",
                        param=what,
                    )
        if self.sampling.min_tokens > new:
            raise CloverError(
                f"min_tokens is {self.sampling.min_tokens} but at most {new} tokens may be generated (max_new_tokens,"
                " or what the context leaves)",
                param="min_tokens",
            )
        return new

    def stop_conditions(self, max_new_tokens: int, eos_token_ids: Sequence[int]) -> StopConditions:
        """When the request ends: the model's EOS ids (none with ignore_eos) and stop_token_ids end it like EOS,
        stop strings cut its text, and neither ends it before min_tokens."""
        eos = () if self.ignore_eos else tuple(eos_token_ids)
        return StopConditions(
            max_new_tokens=max_new_tokens,
            eos_token_ids=tuple(dict.fromkeys((*eos, *self.stop_token_ids))),
            stop_strings=self.stop,
            min_tokens=self.sampling.min_tokens,
            include_stop_str=self.include_stop_str,
        )


@dataclass(frozen=True)
class EngineOptions:
    """How an engine (or a Generator: the runner fields only) is built and schedules.

    max_batch: sequences decoded at once; max_waiting: requests queued beyond those (more raise QueueFull);
    prefill_chunk: prompt rows a joining request adds to one step (a long prompt is prefilled over several steps).
    dtype: the torch backend's weights ("float32", "bfloat16", ...; None: the backend's default); threads: CPU
    threads of the torch and ort backends (None: their defaults); providers: the ort backend's execution
    providers, e.g. "cuda,cpu" (None: the CPU).
    device: the torch backend's device ("cuda", "cuda:1", "cpu"); given, the backend runs the stacked runner there
    (runtime/backends/torch_batch.py: every sequence in one forward, the step on the device, CUDA graphs on a GPU); None: the
    per-sequence runner on the CPU.
    draft_store_mb: memory for the served-answers store prompt lookup drafts from (runtime/served_store.py: every finished
    answer joins it, oldest out first; drafts only, the same output); None: 64; 0: off. Used where the drafts include
    prompt lookup. draft_store_shared: one store for every request scope (GenerationParams.scope) instead of one per
    scope. draft_store_dir: keep the store across restarts in this folder (written atomically, checked on load).
    prefix_cache_mb: memory for the prefix cache across requests (runtime/prefix_cache.py: a prompt that begins with
    tokens an ended request computed reuses them, the same output); None: 1/16 of the machine's memory, at most 1 GiB;
    0: off.
    chat_template: the chat template chat prompts render with, replacing the model's own or adding one to a base
    model that has none: the Jinja text, or the path of a file holding it (a Path, or a str without "{", as vLLM's
    --chat-template); read and compiled at load. None: the model's own, if any.
    """

    max_batch: int = 8
    max_waiting: int = 256
    prefill_chunk: int = PREFILL_CHUNK
    dtype: str | None = None
    threads: int | None = None
    providers: str | tuple[str, ...] | None = None
    chat_template: str | PathLike[str] | None = None
    device: str | None = None
    prefix_cache_mb: int | None = None
    draft_store_mb: int | None = None
    draft_store_shared: bool = False
    draft_store_dir: str | PathLike[str] | None = None

    def __post_init__(self) -> None:
        for name, low, what in (
            ("max_batch", 1, "sequences decoded at once"),
            ("max_waiting", 0, "requests queued"),
            ("prefill_chunk", 1, "prompt rows per step"),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise CloverError(f"{name} must be an int >= {low} ({what}), got {v!r}")
        if self.draft_store_mb is not None and (
            isinstance(self.draft_store_mb, bool) or not isinstance(self.draft_store_mb, int) or self.draft_store_mb < 0
        ):
            raise CloverError(f"draft_store_mb must be an int >= 0 (0: off) or None, got {self.draft_store_mb!r}")
        if self.prefix_cache_mb is not None and (
            isinstance(self.prefix_cache_mb, bool)
            or not isinstance(self.prefix_cache_mb, int)
            or self.prefix_cache_mb < 0
        ):
            raise CloverError(f"prefix_cache_mb must be an int >= 0 (0: off) or None, got {self.prefix_cache_mb!r}")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise CloverError(f"threads must be an int >= 1 or None, got {self.threads!r}")
        if self.device is not None and (not isinstance(self.device, str) or not self.device.strip()):
            raise CloverError(
                f'device must be a torch device name ("cuda", "cuda:1", "cpu") or None, got {self.device!r}'
            )
        if self.chat_template is not None and not isinstance(self.chat_template, (str, PathLike)):
            raise CloverError(
                "chat_template must be the Jinja template (a str) or the path of a file holding it, got "
                f"{type(self.chat_template).__name__}"
            )
        if self.providers is not None and not isinstance(self.providers, str):
            object.__setattr__(self, "providers", tuple(self.providers))

    def replace(self, **changes: Any) -> EngineOptions:
        return replace(self, **changes)
