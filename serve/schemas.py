"""OpenAI API request and response bodies (the fields clover-serve supports), validated with pydantic.

Unknown request fields are accepted and ignored, as OpenAI-compatible servers do (clients send
`frequency_penalty: 0`, `user`, ...); a field we support with a bad value is a 400 naming it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Generation(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens past end-of-sequence (load tests)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop is not None and any(not s for s in ([stop] if isinstance(stop, str) else stop)):
            raise ValueError("stop strings must not be empty")
        return stop

    def stop_strings(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) and len(prompt) != 1:
            raise ValueError(f"one prompt per request is supported, got {len(prompt)}")
        if not prompt or (isinstance(prompt, list) and isinstance(prompt[0], str) and not prompt[0]):
            raise ValueError("the prompt is empty")
        return prompt

    def token_limit(self) -> int | None:
        return self.max_tokens

    def prompt_input(self) -> str | list[int]:
        return self.prompt[0] if isinstance(self.prompt, list) and isinstance(self.prompt[0], str) else self.prompt


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Speculation(BaseModel):
    """clover-deploy's extension field (`clover` in every response): what speculation did for this request."""

    acceptance_length: float  # tokens emitted per verify step, the bonus token included
    steps: int  # verify steps
    drafted_tokens: int
    accepted_tokens: int
    tree: str


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
