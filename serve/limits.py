"""What one request may ask of clover-serve, checked before it reaches the engine (so a request over a limit fails
alone, with 400 and the field in OpenAI's `param`). The engine itself checks token ids and lengths against the model
(clover.Engine.stream); these are the server's own policy, set by clover-serve's flags."""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from clover.errors import CloverError
from clover.serve.schemas import MAX_MESSAGES, error_body


@dataclass(frozen=True)
class RequestLimits:
    """max_stop_strings / max_stop_chars: stop strings per request and characters per string (each is searched for
    in the output at every step, on the engine's thread, for every request: OpenAI allows 4, vLLM any number, and
    lm-evaluation-harness sends a task's whole `until` list). allow_ignore_eos:
    honour vLLM's `ignore_eos` extension (it makes a request run to max_tokens; for load tests). max_body_bytes: a
    request body's size (RequestGuard: refused before it is read)."""

    max_stop_strings: int = 64
    max_stop_chars: int = 256
    allow_ignore_eos: bool = False
    max_body_bytes: int = 2 * 2**20  # a request body's bytes (RequestGuard), checked before it is read
    max_concurrent_requests: int | None = None  # /v1 requests in flight at once (RequestGuard); more get 503
    max_input_tokens: int | None = None  # a prompt's tokens, after the chat template (None: the context's)
    max_tokens_cap: int | None = None  # the most tokens one request may ask for (None: what the context leaves)
    # checked before templating and tokenizing, the costly part of a request before the engine
    max_messages: int = 1024  # messages in one chat request
    max_prompt_chars: int = 262_144  # a prompt's characters (a chat's: its messages' together); ~32 per token at 8k

    def __post_init__(self) -> None:
        if self.max_stop_strings < 0 or self.max_stop_chars < 1:
            raise CloverError(
                f"stop-string limits must be >= 0 strings and >= 1 character, got {self.max_stop_strings} "
                f"and {self.max_stop_chars}"
            )
        if self.max_body_bytes < 1024:
            raise CloverError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        for flag, value in (
            ("--max-concurrent-requests", self.max_concurrent_requests),
            ("--max-input-tokens", self.max_input_tokens),
            ("--max-tokens-cap", self.max_tokens_cap),
            ("--max-messages", self.max_messages),
            ("--max-prompt-chars", self.max_prompt_chars),
        ):
            if value is not None and value < 1:
                raise CloverError(f"{flag} must be >= 1, got {value}")
        if self.max_messages > MAX_MESSAGES:
            raise CloverError(f"--max-messages must be <= {MAX_MESSAGES} (what a chat request may hold at all)")

    def new_tokens(self, prompt_tokens: int, asked: int | None, context: int) -> int | None:
        """What to ask the engine for: `asked` (max_tokens), refused over the cap or with a prompt over
        max_input_tokens; no max_tokens: None (the rest of the context), or the cap where it is less."""
        if self.max_input_tokens is not None and prompt_tokens > self.max_input_tokens:
            raise CloverError(
                f"the prompt has {prompt_tokens} tokens: this server takes at most {self.max_input_tokens}",
                param="prompt",
            )
        if asked is not None and self.max_tokens_cap is not None and asked > self.max_tokens_cap:
            raise CloverError(
                f"max_tokens is {asked}: this server generates at most {self.max_tokens_cap} tokens per request",
                param="max_new_tokens",
            )
        if asked is None and self.max_tokens_cap is not None:
            return min(self.max_tokens_cap, max(context - prompt_tokens, 1))
        return asked

    def check_prompt(self, messages: int | None, chars: int) -> None:
        """CloverError for a chat of more than max_messages messages (None: a completion) or a prompt of more than
        max_prompt_chars characters."""
        if messages is not None and messages > self.max_messages:
            raise CloverError(
                f"{messages} messages: this server takes at most {self.max_messages} per request", param="messages"
            )
        if chars > self.max_prompt_chars:
            raise CloverError(
                f"the prompt has {chars} characters: this server takes at most {self.max_prompt_chars}", param="prompt"
            )

    def check(self, stop: tuple[str, ...], ignore_eos: bool) -> None:
        """CloverError (with its param) for a request over a limit."""
        if len(stop) > self.max_stop_strings:
            raise CloverError(
                f"{len(stop)} stop strings: this server takes at most {self.max_stop_strings}", param="stop"
            )
        longest = max(map(len, stop), default=0)
        if longest > self.max_stop_chars:
            raise CloverError(
                f"a stop string of {longest} characters: this server takes at most {self.max_stop_chars} per string",
                param="stop",
            )
        if ignore_eos and not self.allow_ignore_eos:
            raise CloverError(
                "ignore_eos is off on this server (clover-serve --allow-ignore-eos turns it on)", param="ignore_eos"
            )


@dataclass(frozen=True)
class Cors:
    """Cross-origin requests from browser front-ends (Starlette's CORSMiddleware, answering preflights before the
    API key is checked, as vLLM's): the origins, methods and headers allowed ("*": any), and whether credentials
    (cookies, an Authorization header a browser adds) may be sent."""

    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


def read_api_key_file(path: Path, flag: str = "--api-key-file") -> tuple[str, ...]:
    """The API keys of `path`, one per non-empty line (a one-line CloverError naming `flag` if unreadable or empty):
    each key is a tenant of its own (its requests draft from its own served answers, runtime/served_store.py)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise CloverError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    keys = tuple(line.strip() for line in lines if line.strip())
    if not keys:
        raise CloverError(f"{flag} {path} is empty: put the key on its first line (one key per line)")
    return keys


def tenant_of(key: str) -> str:
    """A key's tenant name in the engine (GenerationParams.scope): a digest, so the key itself goes no further."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


TENANT = "clover.tenant"  # the ASGI scope's entry naming the request's tenant (None: one key, or none)


class RequestGuard:
    """Pure-ASGI middleware that refuses before any body is read: a request without the API key to a /v1 route,
    /tokenize, /detokenize or /tokenizer_info (and /metrics with `metrics_need_key`) gets 401, a body over `max_body_bytes` 413 (by its Content-Length or, for a
    chunked body, as the bytes arrive), a /v1 request beyond `max_concurrent` in flight 503 with Retry-After. FastAPI
    would otherwise read and parse a whole body (an unauthenticated multi-GB POST included) before its dependencies
    run."""

    def __init__(
        self,
        app,
        api_key: str | tuple[str, ...] | None,
        max_body_bytes: int,
        max_concurrent: int | None = None,
        metrics_need_key: bool = False,
        retry_after_s: int = 1,
    ) -> None:
        self.app, self.max_body_bytes, self.max_concurrent = app, max_body_bytes, max_concurrent
        keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
        # header value -> tenant; several keys are several tenants, one key (or none) none: every request one scope
        self.keys = {f"Bearer {k}".encode(): tenant_of(k) if len(keys) > 1 else None for k in keys}
        self.key = bool(self.keys) or None
        self.keyed = (
            "/v1",
            "/tokenize",
            "/detokenize",
            "/tokenizer_info",
            *(("/metrics",) if metrics_need_key else ()),
        )
        self.retry_after = str(retry_after_s).encode()
        self.in_flight = 0  # /v1 requests being answered (one event loop: no lock needed)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        path = _route(scope)
        # a browser's CORS preflight (OPTIONS) carries no credentials: the CORS middleware answers it, else a 405
        if self.key is not None and path.startswith(self.keyed) and scope.get("method") != "OPTIONS":
            sent = headers.get(b"authorization", b"")
            match = [k for k in self.keys if secrets.compare_digest(sent, k)]  # every key compared: no timing leak
            if match:
                scope[TENANT] = self.keys[match[0]]
            else:
                return await _refuse(
                    send,
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer "
                    "<key>' with the key clover-serve was started with",
                    "authentication_error",
                    "invalid_api_key",
                )
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await _refuse(send, 413, self._too_large(), "invalid_request_error", "request_too_large")
        if not path.startswith("/v1"):
            return await self._pass(scope, receive, send)
        if self.max_concurrent is not None and self.in_flight >= self.max_concurrent:
            return await _refuse(
                send,
                503,
                f"the server is answering {self.in_flight} requests, its limit "
                "(clover-serve --max-concurrent-requests): retry later",
                "service_unavailable",
                "too_many_requests",
                [(b"retry-after", self.retry_after)],
            )
        self.in_flight += 1
        try:
            await self._pass(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _pass(self, scope, receive, send) -> None:
        """The app, with the body counted as it arrives (a chunked body past the limit: 413)."""
        seen, refused = 0, False

        async def counted():  # a chunked body: counted as it arrives; past the limit the app sees a disconnect
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    refused = True
                    await _refuse(send, 413, self._too_large(), "invalid_request_error", "request_too_large")
                    return {"type": "http.disconnect"}
            return message

        async def quiet_after_refusal(message) -> None:
            if not refused:
                await send(message)

        try:
            await self.app(scope, counted, quiet_after_refusal)
        except Exception:
            if not refused:  # the app's own failure; after a refusal, only the disconnect it was shown
                raise

    def _too_large(self) -> str:
        return f"the request body is over {self.max_body_bytes} bytes (clover-serve --max-body-bytes)"


def _route(scope) -> str:
    """The request's path inside the app: without the prefix the app is mounted at (`root_path`, which ASGI servers
    and Ray Serve's route prefixes put in front of `path`)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


async def _refuse(
    send, status: int, message: str, type_: str, code: str, headers: list[tuple[bytes, bytes]] = ()
) -> None:
    body = json.dumps(error_body(message, type_, None, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})
