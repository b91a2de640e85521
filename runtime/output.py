"""Exact stopping and streaming text for generation that emits several tokens per step.

A speculative step emits a run of tokens at once; `OutputTracker.add` consumes them one at a time so
that EOS, stop strings and `max_new_tokens` end generation at exactly the token where they apply, as
plain one-token-per-step decoding would.

Streaming: `add` returns only text that can no longer change. Two things are held back:
- an incomplete UTF-8 character (the decoded text ends in U+FFFD) until a later token completes it;
- a suffix of the text that is a prefix of some stop string, until it is resolved either way.
Text is decoded incrementally over a short window of tokens (prefix offset / read offset, as in TGI
and vLLM): the delta of a token is `decode(window + token) - decode(window)`, which is right for
byte-level BPE and for SentencePiece's leading-space tokens, and costs O(window) per token.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from clover.errors import CloverError
from clover.runtime.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class StopConditions:
    """When generation ends.

    Attributes:
        max_new_tokens: at most this many generated tokens (EOS included); finish reason "length".
        eos_token_ids: ids that end generation; the EOS token is kept but adds no text; reason "stop".
        stop_strings: texts that end generation; the text ends right before the first one; reason "stop".
        min_tokens: stop strings are matched only from this many generated tokens on (a stop string completed by
            an earlier token does not end generation); the engine masks the EOS ids until then (processors.py).
        include_stop_str: the text ends right after the stop string instead (vLLM's include_stop_str_in_output).
    """

    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    min_tokens: int = 0
    include_stop_str: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise CloverError(
                f"max_new_tokens should be an int >= 1, got {self.max_new_tokens!r}", param="max_new_tokens"
            )
        if self.max_new_tokens < 1:
            raise CloverError(f"max_new_tokens should be >= 1, got {self.max_new_tokens}", param="max_new_tokens")
        if isinstance(self.stop_strings, str):
            raise CloverError(
                f"stop_strings should be a sequence of strings, got the string {self.stop_strings!r}; "
                f"write ({self.stop_strings!r},)",
                param="stop",
            )
        stop_strings = tuple(self.stop_strings)
        for s in stop_strings:
            if not isinstance(s, str) or not s:
                raise CloverError(
                    f"stop strings should be non-empty strings, got {s!r} in {stop_strings!r}", param="stop"
                )
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise CloverError(f"min_tokens should be an int >= 0, got {self.min_tokens!r}", param="min_tokens")
        eos_token_ids = tuple(self.eos_token_ids)
        for i in eos_token_ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise CloverError(f"eos_token_ids should be non-negative ints, got {i!r} in {eos_token_ids!r}")
        object.__setattr__(self, "stop_strings", stop_strings)
        object.__setattr__(self, "eos_token_ids", eos_token_ids)


class OutputTracker:
    """Accumulates generated tokens, decides when generation is finished, and streams its text.

    Usage: `delta = tracker.add(step_tokens)` after every step until `tracker.finished`, then
    `tracker.flush()` once. The deltas of all `add` calls plus `flush()` concatenate to `tracker.text`.
    """

    def __init__(self, tokenizer: Tokenizer, stop: StopConditions, skip_special_tokens: bool = True) -> None:
        """skip_special_tokens: special tokens add no text (False: their text is written, <|im_end|> say)."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = stop
        self._eos = frozenset(stop.eos_token_ids)
        self._max_stop_len = max((len(s) for s in stop.stop_strings), default=0)
        self._ids: list[int] = []
        self._detok_ids: list[int] = []  # the tokens that carry text: all but EOS
        self._prefix_offset = 0  # window start in _detok_ids; its text is already in _stable
        self._read_offset = 0  # end of the tokens whose text is in _stable
        self._stable = ""  # text of _detok_ids[:_read_offset]; only ever appended to
        self._pending = ""  # tentative text of _detok_ids[_read_offset:] (ends in an incomplete character)
        self._cut: int | None = None  # where the text ends when a stop string was found
        self._emitted = 0  # characters of text returned so far
        self._finish_reason: str | None = None
        self._flushed = False
        # per token: where its text starts, and the text length it needs out before it counts as released (its
        # text complete; a token ending in an incomplete character needs that character out)
        self._starts: list[int] = []
        self._ends: list[int] = []

    # ---------------------------------------------------------------------------------- public

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens kept: up to and including the one that finished generation."""
        return list(self._ids)

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    def text_offsets(self, start: int = 0) -> list[int]:
        """Where the text of each kept token from `start` on begins in the generated text (characters, counted
        before any stop-string cut; a token that completes a character begins where that character does)."""
        return self._starts[start:]

    @property
    def released(self) -> int:
        """How many tokens have their text out: every token once finished; before, those whose text (and any
        incomplete character they end in) lies within the text returned so far. A stream sends a token's
        log-probability with the text that shows it."""
        return len(self._ids) if self.finished else bisect.bisect_right(self._ends, self._emitted)

    @property
    def text(self) -> str:
        """The generated text so far (final once `finished`), held-back parts included."""
        full = self._stable + self._pending
        return full if self._cut is None else full[: self._cut]

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None

    @property
    def finish_reason(self) -> str | None:
        """Why generation ended: "stop" (EOS or stop string), "length", a caller's reason; None while running."""
        return self._finish_reason

    def add(self, token_ids: Sequence[int]) -> str:
        """Consume newly emitted tokens, in order, until generation finishes.

        Args:
            token_ids: the tokens of one step; those after the one that finishes generation are ignored.

        Returns:
            The new text that is safe to show now (may be empty).
        """
        if self._flushed and not self.finished:
            raise CloverError("OutputTracker.add() called after flush(); flush() ends the stream")
        for token_id in token_ids:
            if self.finished:
                break
            self._add_one(int(token_id))
        if self.finished:
            text = self.text
            return self._take(text, len(text))
        return self._take(self._stable, self._safe_end())

    def finish(self, reason: str) -> None:
        """End generation for a reason of the caller's (e.g. "length" when the context is full).

        No-op if generation is already finished.
        """
        if not isinstance(reason, str) or not reason:
            raise CloverError(f"finish reason should be a non-empty string, got {reason!r}")
        if self._finish_reason is None:
            self._finish_reason = reason

    def flush(self) -> str:
        """The rest of the text not yet returned by `add`; call once, at the end of generation."""
        self._flushed = True
        text = self.text
        return self._take(text, len(text))

    def __repr__(self) -> str:
        return (
            f"OutputTracker(num_tokens={self.num_tokens}, finished={self.finished}, "
            f"finish_reason={self._finish_reason!r}, text={self.text!r})"
        )

    # -------------------------------------------------------------------------------- internals

    def _add_one(self, token_id: int) -> None:
        self._ids.append(token_id)
        scan_from = len(self._stable)  # everything before this was searched already
        self._starts.append(self._complete_end())
        if token_id in self._eos:
            self._ends.append(self._complete_end() + bool(self._pending))
            self._finish_reason = "stop"
            return
        self._detokenize(token_id)
        self._ends.append(self._complete_end() + bool(self._pending))  # an incomplete character: it must be out
        if self._max_stop_len and len(self._ids) >= self._stop.min_tokens and self._find_stop(scan_from):
            self._finish_reason = "stop"
            return
        if len(self._ids) >= self._stop.max_new_tokens:
            self._finish_reason = "length"

    def _complete_end(self) -> int:
        """Where the complete characters end: the stable text and the whole ones of the pending text."""
        return len(self._stable) + len(self._pending.rstrip(_REPLACEMENT_CHAR))

    def _detokenize(self, token_id: int) -> None:
        """Extend `_stable` / `_pending` with the text of one more token (prefix/read offset window)."""
        self._detok_ids.append(token_id)
        decode = self._tokenizer.decode
        skip = self._skip_special
        prefix_text = decode(self._detok_ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        new_text = decode(self._detok_ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            self._stable += new_text[len(prefix_text) :]
            self._pending = ""
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._detok_ids)
        else:  # no text yet, or an incomplete character: keep the window growing
            self._pending = new_text[len(prefix_text) :]

    def _find_stop(self, scan_from: int) -> bool:
        """Look for a stop string in the text this token could have changed; cut the text there."""
        # The characters before a trailing incomplete one are final, so a stop string ending there is
        # found at the token that completed it.
        # Only a stop string ending past scan_from counts: one ending before was searched for already, or (before
        # min_tokens) was not to be matched.
        start = max(0, scan_from - self._max_stop_len + 1)
        region = self._stable[start:] + self._pending.rstrip(_REPLACEMENT_CHAR)
        hits = [
            (i, len(s))
            for s in self._stop.stop_strings
            if (i := region.find(s, max(0, scan_from - start - len(s) + 1))) >= 0
        ]
        if not hits:
            return False
        at, length = min(hits, key=lambda h: h[0])  # the first to start (the first listed, at a tie)
        self._cut = start + at + (length if self._stop.include_stop_str else 0)
        return True

    def _safe_end(self) -> int:
        """End of the stable text that no future token can move past a stop string."""
        held = 0
        for s in self._stop.stop_strings:
            for k in range(min(len(s) - 1, len(self._stable)), held, -1):
                if self._stable.endswith(s[:k]):
                    held = k
                    break
        return max(self._emitted, len(self._stable) - held)

    def _take(self, text: str, end: int) -> str:
        """`text[:end]` past what was already returned (`text` extends the text returned so far)."""
        delta = text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta
