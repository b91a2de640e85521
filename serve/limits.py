"""What one request may ask of clover-serve, checked before it reaches the engine (so a request over a limit fails
alone, with 400 and the field in OpenAI's `param`). The engine itself checks token ids and lengths against the model
(clover.Engine.stream); these are the server's own policy, set by clover-serve's flags."""

from __future__ import annotations

from dataclasses import dataclass

from clover.errors import CloverError


@dataclass(frozen=True)
class RequestLimits:
    """max_stop_strings / max_stop_chars: stop strings per request and characters per string (each is searched for
    in the output at every step, on the engine's thread, for every request: OpenAI allows 4). allow_ignore_eos:
    honour vLLM's `ignore_eos` extension (it makes a request run to max_tokens; for load tests)."""

    max_stop_strings: int = 4
    max_stop_chars: int = 256
    allow_ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_stop_strings < 0 or self.max_stop_chars < 1:
            raise CloverError(f"stop-string limits must be >= 0 strings and >= 1 character, got {self.max_stop_strings} "
                              f"and {self.max_stop_chars}")

    def check(self, stop: tuple[str, ...], ignore_eos: bool) -> None:
        """CloverError (with its param) for a request over a limit."""
        if len(stop) > self.max_stop_strings:
            raise CloverError(f"{len(stop)} stop strings: this server takes at most {self.max_stop_strings}",
                              param="stop")
        longest = max(map(len, stop), default=0)
        if longest > self.max_stop_chars:
            raise CloverError(f"a stop string of {longest} characters: this server takes at most {self.max_stop_chars} "
                              "per string", param="stop")
        if ignore_eos and not self.allow_ignore_eos:
            raise CloverError("ignore_eos is off on this server (clover-serve --allow-ignore-eos turns it on)",
                              param="ignore_eos")
