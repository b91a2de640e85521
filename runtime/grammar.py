"""Structured output: a request's grammar (any JSON object, a JSON schema, a regex, a Lark grammar, a choice of
strings) as token masks over a drafted tree's rows, computed by llguidance (chosen by measurement:
benchmarks/grammar_engines.py; docs/design.md says how the masks keep speculation exact).

A request's `GrammarState` holds an llguidance matcher in the state after its generated tokens. Each step a
`PathMasks` over it gives, for any drafted path (the tokens after the step's root), the tokens allowed after that
path, or None when the grammar forbids the path itself. A path's state depends on its tokens only, so a tree row is
masked exactly as plain constrained decoding masks its row once that path has been generated.

llguidance is imported here only, and only when a request has a grammar: without the `structured` extra, such a
request gets one error naming it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from clover.errors import CloverError

KINDS = ("json_object", "json_schema", "regex", "lark", "choice")
# JSON laid out as Python's json.dumps writes it (", " and ": ", no other whitespace): a small model left free to
# emit whitespace can loop on it until max_tokens (a known failure of JSON modes), and this is the layout models
# saw most, so their drafts and prompt lookup match it (benchmarks/structured.py: more tokens per step than
# compact JSON).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 1 << 20  # a grammar's source text at most (a schema, a regex, a Lark grammar)
CACHED_GRAMMARS = 64  # compiled grammars kept per engine (a request with a cached one skips the ~1 ms compile)


# the keywords under which a JSON schema holds schemas: one, a list of them, or a name -> schema map
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_json_schema(schema: Any) -> Any:
    """`schema` as strict structured output reads it (OpenAI's strict functions, xgrammar's default): an object
    schema that does not say `additionalProperties` admits no property it does not list, at every depth. Without
    that, JSON Schema admits any other property, and a small model invents properties until max_tokens."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = strict_json_schema(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_json_schema(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_json_schema(s) for k, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict_json_schema(out["additionalProperties"])
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    if is_object and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match. kind: "json_object" (any JSON object), "json_schema" (value: the
    schema, a dict), "regex" (value: a pattern, Rust regex syntax, matched whole), "lark" (value: a Lark grammar
    in llguidance's dialect, from `start`), "choice" (value: a list of strings, output one of them exactly)."""

    kind: str
    value: Any = None

    @classmethod
    def json_object(cls) -> Grammar:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> Grammar:
        return cls("json_schema", schema)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        return cls("lark", grammar)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Grammar:
        return cls("choice", tuple(options))

    def key(self) -> str:
        """A stable text of the grammar (the compile cache's key)."""
        return self.kind + "\0" + json.dumps(self.value, sort_keys=True, default=list)

    def source(self, llguidance) -> str:
        """llguidance's grammar text for this grammar; CloverError when the value has the wrong type."""
        v, kind = self.value, self.kind
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "json_schema":
            if not isinstance(v, dict):
                raise CloverError(f"a JSON schema must be an object, got {type(v).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(v, defaults=JSON_OPTIONS)
        if kind == "regex":
            if not isinstance(v, str) or not v:
                raise CloverError("a regex grammar must be a non-empty string")
            return llguidance.LLMatcher.grammar_from_regex(v)
        if kind == "lark":
            if not isinstance(v, str) or not v.strip():
                raise CloverError("a Lark grammar must be a non-empty string")
            return llguidance.LLMatcher.grammar_from_lark(v)
        if kind == "choice":
            if not v or not all(isinstance(s, str) and s for s in v):
                raise CloverError("a choice needs a non-empty list of non-empty strings")
            # Lark string literals take JSON's escapes
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in v))
        raise CloverError(f"unknown grammar kind {kind!r}: use one of {', '.join(KINDS)}")


def _llguidance():
    try:
        import llguidance
    except ImportError as e:
        raise CloverError(
            "structured output needs llguidance: pip install 'clover-deploy[structured]' (or make install)"
        ) from e
    return llguidance


class GrammarCompiler:
    """Compiles grammars for one tokenizer (an engine's): the llguidance tokenizer is built on first use (~0.3 s
    for a 49k vocabulary), compiled grammars are cached by their text (a request starts from a copy)."""

    def __init__(self, tokenizer, vocab_size: int, check_spelling: bool = True) -> None:
        """check_spelling: refuse a tokenizer without a token for every printable ASCII character (a word-level
        one), for which llguidance would force tokens it cannot spell."""
        self._tokenizer, self.vocab_size, self.check_spelling = tokenizer, vocab_size, check_spelling
        self._lltok = None
        self._lock = threading.Lock()
        self._compiled: dict[str, Any] = {}  # grammar key -> pristine matcher, least recently used first

    def _llt(self):
        with self._lock:
            if self._lltok is None:
                llg = _llguidance()
                spelled = {self._tokenizer.token_bytes(i) for i in range(self._tokenizer.vocab_size)}
                missing = (
                    [chr(c) for c in range(0x20, 0x7F) if bytes([c]) not in spelled] if self.check_spelling else []
                )
                if missing:  # a word-level vocabulary: llguidance would force tokens it cannot spell
                    raise CloverError(
                        f"structured output needs a tokenizer that can spell any text, and this model's has no token "
                        f"for {len(missing)} printable characters (e.g. {''.join(missing[:8])!r})"
                    )
                self._lltok = llg.LLTokenizer(
                    llg.TokenizerWrapper(_Wrapped(self._tokenizer)),
                    n_vocab=self.vocab_size,
                    eos_token=list(self._tokenizer.eos_token_ids),
                )
            return self._lltok

    def _cached(self, grammar: Grammar):
        key = grammar.key()
        with self._lock:
            hit = self._compiled.pop(key, None)
        if hit is None:
            hit = self._compile(grammar)
        with self._lock:
            self._compiled[key] = hit
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.pop(next(iter(self._compiled)))
        return hit

    def _compile(self, grammar: Grammar):
        llg = _llguidance()
        try:
            source = grammar.source(llg)
        except CloverError:
            raise
        except Exception as e:  # llguidance's own message says what is wrong
            raise CloverError(f"the {grammar.kind} grammar is not valid: {_one_line(e)}") from None
        if len(source) > MAX_GRAMMAR_CHARS:
            raise CloverError(f"the grammar is too large ({len(source)} characters, at most {MAX_GRAMMAR_CHARS})")
        matcher = llg.LLMatcher(self._llt(), source, log_level=0)
        if matcher.is_error():
            raise CloverError(f"the {grammar.kind} grammar is not valid: {_one_line(matcher.get_error())}")
        return matcher

    def state(self, grammar: Grammar) -> GrammarState:
        """A new request's state (before any generated token). CloverError when the grammar cannot compile."""
        if not isinstance(grammar, Grammar):
            raise CloverError(f"grammar must be a clover.Grammar, got {type(grammar).__name__}")
        if grammar.kind not in KINDS:
            raise CloverError(f"unknown grammar kind {grammar.kind!r}: use one of {', '.join(KINDS)}")
        matcher = self._cached(grammar).deep_copy()
        return GrammarState(
            matcher, self.vocab_size, grammar.kind, self._tokenizer.eos_token_ids, self._tokenizer.token_bytes
        )


def _one_line(error: object, limit: int = 500) -> str:
    """llguidance's message (several lines, a caret under the error) on one line."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Wrapped:
    """What llguidance's TokenizerWrapper reads from a tokenizer: every token's bytes, EOS, BOS, special ids, and
    how text encodes. llguidance needs a vocabulary that can spell any bytes (byte-level BPE, byte fallback, or
    single characters), as every LLM tokenizer can."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0]
        bos = tokenizer.bos_token
        self.bos_token_id = None if bos is None else tokenizer.token_to_id(bos)
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(int(i) for i in tokenizer.backend.get_added_tokens_decoder())

    def __call__(self, text: str | bytes) -> list[int]:
        return self._tok.encode(text.decode("utf-8") if isinstance(text, bytes) else text, add_special_tokens=False)


class GrammarState:
    """One request's matcher, in the state after its emitted tokens."""

    def __init__(
        self,
        matcher,
        vocab_size: int,
        kind: str,
        eos_ids: Sequence[int],
        token_bytes: Callable[[int], bytes] | None = None,
    ) -> None:
        """token_bytes: each token's bytes (the compiler's tokenizer: prompt lookup matches words with them)."""
        self.matcher, self.vocab_size, self.kind, self.token_bytes = matcher, vocab_size, kind, token_bytes
        self.words = (vocab_size + 31) // 32  # int32 words of a bitmask row
        self.eos = np.asarray(list(eos_ids), dtype=np.int64)
        self.eos_set = frozenset(int(i) for i in eos_ids)
        self.seconds = 0.0  # spent computing states and masks (benchmarks/structured.py reports it per token)
        # tokens that end this request (its EOS and stop-token ids; none with ignore_eos): set by the caller
        self.ends: frozenset[int] = frozenset()
        self._paths: PathMasks | None = None  # this state's path masks, kept until the next emitted tokens

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens emitted (in order). Tokens after the grammar's end (the end-of-sequence token) are not fed: the
        request ends there."""
        self._paths = None
        for t in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(int(t)):
                raise CloverError(f"token {int(t)} does not match the grammar: {_one_line(self.matcher.get_error())}")

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (a JSON schema's keys and punctuation), in llguidance's
        canonical tokenization of the forced text: drafts a step verifies as a chain, like prompt lookup's."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        t0 = time.perf_counter()
        out = self.matcher.compute_ff_tokens()[:limit]
        self.seconds += time.perf_counter() - t0
        return out

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar allows from this state (the state itself unchanged)."""
        if not tokens or self.matcher.is_stopped():
            return 0
        t0 = time.perf_counter()
        n = self.matcher.validate_tokens(tokens)
        self.seconds += time.perf_counter() - t0
        return n

    def the_end(self) -> int | None:
        """The token that ends the request when the grammar allows it alone next (a finished JSON value), else
        None: the loop emits it without a forward, as constrained decoding would have to (its mask has one
        token)."""
        if not self.ends or not (self.matcher.is_accepting() or self.matcher.is_stopped()):
            return None
        allowed = np.flatnonzero(self.paths().allowed(()))
        return int(allowed[0]) if len(allowed) == 1 and int(allowed[0]) in self.ends else None

    def paths(self) -> PathMasks:
        """The masks of paths from this state (one object until the next `extend`: a mask asked for twice, by
        `the_end` after a step and by the next step's drafting, is computed once)."""
        if self._paths is None:
            self._paths = PathMasks(self)
        return self._paths


class PathMasks:
    """The masks of one step's drafted paths, from the committed state: a path's matcher is its parent path's,
    copied, with its last token consumed (a few microseconds); states and masks are kept for the step."""

    def __init__(self, grammar: GrammarState) -> None:
        self.g = grammar
        self._states: dict[tuple[int, ...], Any] = {(): grammar.matcher}
        self._bits: dict[tuple[int, ...], np.ndarray | None] = {}  # llguidance's bitmasks (int32 words)
        self._masks: dict[tuple[int, ...], np.ndarray | None] = {}  # unpacked, where a row is masked

    def _state(self, path: tuple[int, ...]):
        if path in self._states:
            return self._states[path]
        parent = self._state(path[:-1])
        state = None
        if parent is not None and parent.is_stopped():  # after the end only the end again (output stops there)
            state = parent if path[-1] in self.g.eos_set else None
        elif parent is not None:
            state = parent.deep_copy()
            if not state.consume_token(path[-1]) or state.is_error():
                state = None
        self._states[path] = state
        return state

    def permits(self, path: tuple[int, ...]) -> bool:
        """Whether the grammar allows `path` (its state only: no mask computed)."""
        t0 = time.perf_counter()
        ok = self._state(path) is not None
        self.g.seconds += time.perf_counter() - t0
        return ok

    def packed(self, path: tuple[int, ...]) -> np.ndarray | None:
        """The bitmask of the tokens allowed after `path` (bit t of word t // 32), None when the path is
        forbidden. A state that allows nothing (the grammar finished without an end token) allows the
        end-of-sequence tokens, so the request ends there."""
        if path in self._bits:
            return self._bits[path]
        t0 = time.perf_counter()
        state = self._state(path)
        bits = None
        if state is not None:
            bits = np.zeros(self.g.words, dtype=np.int32)
            state.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            if not bits.any():
                words = bits.view(np.uint32)
                np.bitwise_or.at(words, self.g.eos // 32, (np.uint32(1) << (self.g.eos % 32).astype(np.uint32)))
        self._bits[path] = bits
        self.g.seconds += time.perf_counter() - t0
        return bits

    def allowed(self, path: tuple[int, ...]) -> np.ndarray | None:
        """[V] bool: the tokens the grammar allows after `path` (`packed`, unpacked); None when it forbids the
        path."""
        if path in self._masks:
            return self._masks[path]
        bits = self.packed(path)
        t0 = time.perf_counter()
        out = None
        if bits is not None:
            out = np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.g.vocab_size].astype(bool)
        self._masks[path] = out
        self.g.seconds += time.perf_counter() - t0
        return out

    def permits_token(self, path: tuple[int, ...], token: int) -> bool:
        """Whether the grammar allows `token` after the allowed `path`: `allowed(path)[token]`, without computing
        the whole mask where it can be helped. A greedy verify asks this of each row's argmax, which is mostly
        allowed: one token checked by the parser instead of a whole mask, which costs more in a step (the
        tokenizer's trie is out of cache after the forward, and the mask must be unpacked; measured:
        docs/experiments.md, 2026-11-28 "structured output, the grammar's check without its mask"). The mask's bit
        decides where it is more than the parser's check: where the grammar forces bytes (the mask then allows only
        their canonical tokenization, the check any spelling) and where the end may come (an accepting or stopped
        state, an end token: the end-of-sequence rule of `packed`)."""
        t0 = time.perf_counter()
        state = self._state(path)
        quick = (
            path not in self._bits
            and state is not None
            and token not in self.g.eos_set
            and not (state.is_accepting() or state.is_stopped())
            and not state.compute_ff_bytes()
        )
        ok = quick and state.validate_tokens([token]) == 1
        self.g.seconds += time.perf_counter() - t0
        if quick or state is None:
            return ok
        bits = self.packed(path)
        return bits is not None and bool((int(bits[token >> 5]) >> (token & 31)) & 1)

    def best(self, path: tuple[int, ...], logits: np.ndarray) -> int:
        """The allowed token of highest logit after the allowed `path` (ties: the lowest id), as the argmax of the
        masked row; a mask with one token gives it without unpacking."""
        bits = self.packed(path).view(np.uint32)
        nonzero = np.flatnonzero(bits)
        if len(nonzero) == 1 and not (word := int(bits[nonzero[0]])) & (word - 1):  # one bit set
            return int(nonzero[0]) * 32 + word.bit_length() - 1
        return int(np.argmax(np.where(self.allowed(path), logits, -np.inf)))

    def forced_after(self, path: tuple[int, ...], limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces after `path` (GrammarState.forced, one drafted path further):
        a lookup chain that ends a JSON value goes on with the next key."""
        state = self._state(path) if limit > 0 else None
        if state is None or state.is_stopped():
            return []
        t0 = time.perf_counter()
        out = [int(t) for t in state.compute_ff_tokens()[:limit]]
        self.g.seconds += time.perf_counter() - t0
        return out

    def rows(self, paths: Sequence[tuple[int, ...]]) -> np.ndarray:
        """[n, V] bool masks of allowed paths (each must be allowed)."""
        return np.stack([self.allowed(p) for p in paths])

    def lazy(self, paths: Sequence[tuple[int, ...]]) -> MaskRows:
        """The masks of allowed paths, each computed when first asked for."""
        return MaskRows(self, list(paths))


class MaskRows:
    """A verify's rows' masks (one allowed path per row), computed on demand: a greedy verify asks only about the
    rows it walks, up to the first rejected draft (`permits`, then `best` where the argmax is forbidden), where
    sampling needs them all (`dense`)."""

    def __init__(self, masks: PathMasks, paths: list[tuple[int, ...]]) -> None:
        self.masks, self.paths = masks, paths

    def permits(self, i: int, token: int) -> bool:
        """Whether the grammar allows `token` after row i's path (`row(i)[token]`, mostly without the mask)."""
        return self.masks.permits_token(self.paths[i], token)

    def best(self, i: int, logits: np.ndarray) -> int:
        """The allowed token of highest logit after row i's path (ties: the lowest id): the argmax of the masked
        row, or at once the one token a mask allows (the grammar forces it: a JSON key's next token)."""
        return self.masks.best(self.paths[i], logits)

    def dense(self) -> np.ndarray:
        """[n, V] bool, every row."""
        return self.masks.rows(self.paths)
