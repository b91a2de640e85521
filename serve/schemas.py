"""OpenAI API request and response bodies (the fields clover-serve supports), validated with pydantic.

Every request field is declared: supported ones, harmless ones accepted and ignored (`user`, `metadata`, ...), and
ones that would change the output but are not supported (`functions`, `audio`, ...), which are refused with a 400
naming them unless they carry their no-op value. An undeclared field is refused too
(`extra="forbid"`): nothing that could change the output is silently ignored. docs/serving.md lists every field.
Text that is not valid Unicode (a lone surrogate), in any field at any depth, is refused with the field's path.
"""

from __future__ import annotations

import functools
import json
import time
import typing
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from clover.errors import CloverError
from clover.runtime.grammar import Grammar, strict_json_schema
from clover.runtime.logprobs import MAX_LOGPROBS

# Fields refused unless they carry their no-op value (their types admit only that value), and why.
REFUSED = {
    "suffix": "suffix (insertion) is not supported: leave it out",
    "spaces_between_special_tokens": "special tokens are joined as the tokenizer's decoder joins them: leave "
    "spaces_between_special_tokens out (or true)",
    "functions": "functions (the deprecated form of tools) are not supported: send tools instead",
    "function_call": "function_call (the deprecated form of tool_choice) is not supported: send tool_choice instead",
    "audio": "audio output is not supported: leave it out",
    "modalities": 'only the "text" modality is supported',
    "prediction": "prediction (predicted outputs) is not supported: leave it out",
    "reasoning_effort": "reasoning_effort is not supported (not a reasoning model): leave it out",
    "verbosity": "verbosity is not supported: leave it out",
    "web_search_options": "web search is not supported: leave it out",
}
UNKNOWN_FIELD = (
    "unknown field: this server refuses fields it does not know rather than ignore them (docs/serving.md lists "
    "every field and its status)"
)

INVALID_UNICODE = "invalid_unicode"  # the validation error of text holding a lone surrogate; ctx["field"] names it
_TEXT_HOLDERS = (str, dict, list)  # what unicode_fault walks: a prompt of token ids (a long list of ints) is skipped
MAX_CHOICES = 16  # n and best_of: each choice is a sequence of the batch
MAX_BAD_WORDS = 256  # bad_words per request: each is checked against every row of every step
MAX_PROMPTS = 64  # prompts of one completions request: each is best_of sequences of the batch
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]{0,17})$")]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any]  # JSON text, as OpenAI sends it (an object is taken too)


class ToolCallIn(BaseModel):
    """A call in an assistant message sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call answered

    def fault(self) -> str | None:
        """What is wrong with this message's fields together, or None. Checked by the request once its message count is
        within the server's limit (ChatCompletionRequest.check_messages), not by pydantic per message: a Python
        validator per message would hold the event loop for a refused body of thousands of messages."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            return f"a {self.role} message needs content (only an assistant's tool_calls stand without)"
        if self.tool_calls and self.role != "assistant":
            return f"tool_calls belong to assistant messages, not {self.role} ones"
        if self.role == "tool" and not self.tool_call_id:
            return "a tool message needs tool_call_id: the id of the call it answers"
        return None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (developer as system; keys without a value left out)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        out["content"] = None if self.content is None else self.text()
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def chars(self) -> int:
        """Characters of text the message brings to the prompt (its calls' names and arguments included)."""
        calls = self.tool_calls or ()
        return len(self.text()) + sum(len(c.function.name) + len(str(c.function.arguments)) for c in calls)


MAX_TOOLS = 128  # tools per request (OpenAI's limit)
# Messages a chat request may hold at all, refused while parsing, before its text is walked or validated (a refused
# body of tens of thousands of messages would otherwise hold the event loop, and every stream, for tens of ms);
# --max-messages sets the server's own limit at or below it.
MAX_MESSAGES = 4096
FUNCTION_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"  # OpenAI's (letters, digits, _ and -, at most 64), and dots


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object (none: no arguments)
    strict: bool | None = (
        None  # a call's arguments always follow the schema strictly (runtime/grammar.strict_json_schema)
    )


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


TOOL_CHOICES = ("none", "auto", "required")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far
    include_obfuscation: bool | None = None  # accepted and ignored (no obfuscation padding is sent)


class ResponseFormatText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]


class ResponseFormatJsonObject(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_object"]


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # true: no property the schema does not list (default: the schema as written)


class ResponseFormatJsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    json_schema: JsonSchema


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one of json (a schema), json_object, regex, choice or grammar (Lark)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = Field(default=None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "json_object", "regex", "choice", "grammar") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes one of json, json_object, regex, choice or grammar")
        return self

    def compiled(self) -> Grammar:
        if self.json_ is not None:
            return Grammar.json_schema(self.json_)
        if self.json_object:
            return Grammar.json_object()
        if self.regex is not None:
            return Grammar.regex(self.regex)
        if self.choice is not None:
            return Grammar.choice(self.choice)
        return Grammar.lark(self.grammar)


RESPONSE_FORMATS = ("text", "json_object", "json_schema")
ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


class _Generation(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[TokenIdKey, Bias] | None = None
    # vLLM's extensions
    top_k: int = Field(default=-1, ge=-1, lt=2**31)  # the k most likely tokens (-1 or 0: off)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # tokens at least min_p times as likely as the most likely
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    ignore_eos: bool = False  # run to max_tokens past end-of-sequence (load tests)
    include_stop_str_in_output: bool = False  # the text ends after the stop string that ended it, not before
    skip_special_tokens: bool = True  # special tokens add no text (False: written out)
    spaces_between_special_tokens: Literal[True] = True  # the tokenizer's decoder joins them: no other way here
    # structured output: OpenAI's response_format, and vLLM's guided decoding fields (Lark for guided_grammar)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = Field(default=None, min_length=1)
    structured_outputs: StructuredOutputs | None = None  # vLLM's current form of the guided_* fields
    # more of vLLM's: the generated (and prompt) token ids in the answer; the prompt's last k tokens only
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # log-probabilities name tokens `token_id:ID`, not by their text
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # each prompt token's, vLLM's shape
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    priority: int = 0  # vLLM's priority scheduling: this server schedules first come, first served
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: reuses cached prefixes of this salt only
    # accepted and ignored: they do not change the output
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)  # choices: separate sequences in the batch

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, body: Any) -> Any:
        # OpenAI, vLLM and llama.cpp read an explicit null as "not given", and client libraries send it: a field whose
        # type has no null (temperature, top_p, stream, the penalties, ...) takes its default, as if left out
        if isinstance(body, dict) and any(v is None for v in body.values()):
            defaulted = _non_nullable(cls)
            return {k: v for k, v in body.items() if v is not None or k not in defaulted}
        return body

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        # JSON's \u escapes (and Python's parser) admit a lone surrogate, which no UTF-8 text holds: the tokenizer
        # and every response would fail on it. Refused before any field is read, in any field, named however deep.
        fault = unicode_fault(body) if isinstance(body, dict) else None
        if fault is not None:
            field, what = fault
            raise PydanticCustomError(INVALID_UNICODE, "{what}", {"field": field, "what": what})
        return body

    @field_validator("priority")
    @classmethod
    def _first_come(cls, priority: int) -> int:
        if priority != 0:
            raise ValueError("this server schedules first come, first served (no priority scheduling): send priority 0")
        return priority

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

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def options_used(self) -> list[str]:
        """The output-shaping options this request sets (for /metrics)."""
        return [
            name
            for name, on in (
                ("logprobs", self.logprobs_wanted() is not None),
                ("presence_penalty", self.presence_penalty != 0),
                ("frequency_penalty", self.frequency_penalty != 0),
                ("repetition_penalty", self.repetition_penalty != 1),
                ("logit_bias", bool(self.logit_bias)),
                ("min_tokens", self.min_tokens > 0),
                ("stop_token_ids", bool(self.stop_token_ids)),
                ("allowed_token_ids", bool(self.allowed_token_ids)),
                ("bad_words", bool(self.bad_words)),
                ("structured_output", self.grammar() is not None),
            )
            if on
        ]

    def grammar(self) -> tuple[Grammar, str] | None:
        """The grammar the output must match and the field that set it, or None. CloverError (a 400) when several
        fields set one, or with min_tokens."""
        found = []
        rf = self.response_format
        if isinstance(rf, ResponseFormatJsonObject):
            found.append((Grammar.json_object(), "response_format"))
        elif isinstance(rf, ResponseFormatJsonSchema):
            schema = rf.json_schema.schema_
            if schema is not None and rf.json_schema.strict:  # strict: no property the schema does not list
                schema = strict_json_schema(schema)
            found.append(
                (Grammar.json_schema(schema) if schema is not None else Grammar.json_object(), "response_format")
            )
        if self.guided_json is not None:
            found.append((Grammar.json_schema(self.guided_json), "guided_json"))
        if self.guided_regex is not None:
            found.append((Grammar.regex(self.guided_regex), "guided_regex"))
        if self.guided_choice is not None:
            found.append((Grammar.choice(self.guided_choice), "guided_choice"))
        if self.guided_grammar is not None:
            found.append((Grammar.lark(self.guided_grammar), "guided_grammar"))
        if self.structured_outputs is not None:
            found.append((self.structured_outputs.compiled(), "structured_outputs"))
        if len(found) > 1:
            fields = " and ".join(f for _, f in found)
            raise CloverError(f"{fields} each set the output's grammar: send one of them", param=found[1][1])
        if found and self.min_tokens:
            raise CloverError(f"min_tokens cannot be combined with {found[0][1]}: leave one of them out", "min_tokens")
        return found[0] if found else None

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token to report (None: no log-probabilities)."""
        raise NotImplementedError

    def echoes_prompt(self) -> bool:
        """A completion's echo: the prompt's text (and log-probabilities) before the answer's."""
        return False

    def choices(self) -> tuple[int, int]:
        """(choices returned, candidates generated): n, and best_of where the endpoint has it. CloverError (a 400)
        when best_of is below n, or above n while streaming."""
        n = self.n or 1
        best = getattr(self, "best_of", None) or n
        if best < n:
            raise CloverError(f"best_of ({best}) must be at least n ({n})", param="best_of")
        if best > n and self.stream:
            raise CloverError("best_of above n cannot be streamed (the best are known at the end)", param="best_of")
        if self.echoes_prompt() and self.stream and self.logprobs_wanted() is not None:
            raise CloverError(
                "echo with logprobs is not streamed (the prompt's log-probabilities come with the whole answer): send "
                "stream false, or echo without logprobs",
                param="echo",
            )
        return n, best


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # function calling (serve/tool_calls.py)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: one call at most
    # vLLM's: the final message's content before the answer's where it is the assistant's (the answer continues it)
    echo: bool = False
    # vLLM's chat template controls
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the answer continues the final (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (Qwen3's enable_thinking)
    # refused unless no-op (REFUSED)
    functions: list[Any] | None = Field(default=None, max_length=0)
    function_call: Literal["none"] | None = None
    audio: None = None
    modalities: list[Literal["text"]] | None = None
    prediction: None = None
    reasoning_effort: None = None
    verbosity: None = None
    web_search_options: None = None

    @model_validator(mode="before")
    @classmethod
    def _few_enough_messages(cls, body: Any) -> Any:
        messages = body.get("messages") if isinstance(body, dict) else None
        if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
            raise PydanticCustomError(
                "too_many_messages",
                "{n} messages: a chat request holds at most {most}",
                {"n": len(messages), "most": MAX_MESSAGES},
            )
        return body

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        # one message for every wrong value, rather than one per member of the union
        if isinstance(value, str) and value in TOOL_CHOICES or value is None:
            return value
        try:
            return NamedToolChoice.model_validate(value)
        except ValueError:
            raise ValueError(
                f"tool_choice is 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
                f'{{"name": NAME}}}}, got {json.dumps(value)[:200]}'
            ) from None

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in tools or ()]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"tools name each function once: {', '.join(twice)} appear more than once")
        return tools

    def check_messages(self) -> None:
        """CloverError naming the first message whose fields do not go together (ChatMessage.fault)."""
        for i, m in enumerate(self.messages):
            fault = m.fault()
            if fault is not None:
                raise CloverError(fault, param=f"messages.{i}")

    def tool_mode(self) -> tuple[str, str | None]:
        """(mode, function): mode "none" (no tools, or tool_choice none), "auto" (also tools without a tool_choice,
        OpenAI's default), "required", or "named" with the function's name."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named", choice.function.name
        if choice is None:
            return ("auto" if self.tools else "none"), None
        return choice, None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_flag(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, bool):
            raise ValueError(
                f"chat completions take logprobs true or false, got {value!r}: ask for alternatives with "
                f"top_logprobs (0-{MAX_LOGPROBS})"
            )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Generation):
    # one prompt (text or token ids), or a list of them: the choices of prompt p are indexes p * n to p * n + n - 1
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's default for completions; 0 with echo: the prompt alone, with its log-probabilities (a loglikelihood)
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # the prompt before the completion, and its tokens' log-probabilities with logprobs
    echo: bool = Field(default=False, validate_default=True)
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)  # candidates, the n most likely returned
    # refused unless no-op (REFUSED)
    suffix: Literal[""] | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_count(cls, value: Any) -> Any:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(
                f"completions take logprobs as the number of alternatives per token, an int from 0 to "
                f"{MAX_LOGPROBS}, got {value!r}"
            )
        return value

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: str | list[int] | list[str] | list[list[int]]) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"{len(prompt)} prompts: a request holds at most {MAX_PROMPTS}")
            empty = [i for i, p in enumerate(prompt) if not p]
            if empty:
                raise ValueError(f"prompt {empty[0]} of the list is empty")
        elif not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @field_validator("echo")
    @classmethod
    def _nothing_to_answer(cls, echo: bool, info) -> bool:
        if info.data.get("max_tokens") == 0 and not echo:
            raise ValueError("max_tokens 0 answers with the prompt alone: send echo true with it, or max_tokens >= 1")
        if info.data.get("max_tokens") == 0 and info.data.get("stream"):
            raise ValueError("max_tokens 0 (the prompt alone) is not streamed: send stream false")
        return echo

    def token_limit(self) -> int | None:
        return self.max_tokens

    def echoes_prompt(self) -> bool:
        return self.echo

    def prompt_inputs(self) -> list[str | list[int]]:
        """The prompts, each text or token ids."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str | list):
            return list(self.prompt)
        return [self.prompt]

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    """POST /tokenize, as vLLM's: a prompt's token ids, or a chat's after the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True  # a prompt's (a chat's come from its template)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send a prompt or messages (one of them)")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize, as vLLM's: the text of token ids."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose caches an earlier request computed (the prefix cache)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class DraftCounts(BaseModel):
    drafted: int
    accepted: int


class Speculation(BaseModel):
    """clover-deploy's extension field (`clover` in every response): what speculation did for this request."""

    acceptance_length: float  # tokens emitted per verify step, the bonus token included
    steps: int  # verify steps
    drafted_tokens: int
    accepted_tokens: int
    tree: str
    # drafted and accepted tokens by where the drafts came from: heads, sequence (prompt lookup in the request
    # itself), store (the artifact's n-gram store), served (this server's past answers); sources that drafted only
    sources: dict[str, DraftCounts] = {}


@functools.cache
def _non_nullable(model: type[BaseModel]) -> frozenset[str]:
    """The request fields (by their JSON names) whose types do not admit null, and that have a default."""
    return frozenset(
        f.alias or name
        for name, f in model.model_fields.items()
        if not f.is_required() and type(None) not in typing.get_args(f.annotation) and f.annotation is not type(None)
    )


def unicode_fault(body: dict[str, Any]) -> tuple[str, str] | None:
    """Text of a parsed JSON body (a value or a key, at any depth) that UTF-8 cannot encode, as (its field's dotted
    path, e.g. "messages.0.content"; what is wrong with it); None when all of it is valid Unicode. Iterative: a body
    nests as deep as the JSON parser allows."""
    if _all_unicode(body):  # the common case, in C: a refused body of thousands of messages walked in Python
        return None  # would hold the event loop (and every stream) for tens of milliseconds
    todo: list[tuple[tuple[str, ...], Any]] = [((), body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str) and (where := _lone_surrogate(value)) is not None:
            return ".".join(path), _not_unicode(value, where)
        if isinstance(value, dict):
            for key in value:
                if isinstance(key, str) and (where := _lone_surrogate(key)) is not None:
                    named = key.encode("utf-8", "backslashreplace").decode()  # the key, its surrogate \u-escaped
                    return ".".join((*path, named)), "the field's name is " + _not_unicode(key, where)
            todo.extend(((*path, str(k)), v) for k, v in reversed(value.items()) if isinstance(v, _TEXT_HOLDERS))
        elif isinstance(value, list):
            todo.extend(
                ((*path, str(i)), v) for i, v in reversed(list(enumerate(value))) if isinstance(v, _TEXT_HOLDERS)
            )
    return None


def _all_unicode(body: dict[str, Any]) -> bool:
    """Whether every text of a parsed JSON body encodes as UTF-8 (serialized and encoded whole, in C); False also
    when it cannot be serialized so (then the walk decides)."""
    try:
        json.dumps(body, ensure_ascii=False, check_circular=False).encode("utf-8")
    except (UnicodeEncodeError, ValueError, TypeError, RecursionError):
        return False
    return True


def _lone_surrogate(text: str) -> int | None:
    """The index of text's first lone surrogate (the one thing a str holds that UTF-8 cannot encode), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _not_unicode(text: str, where: int) -> str:
    return (
        f"not valid Unicode: a lone surrogate (U+{ord(text[where]):04X}) at character {where}; JSON's "
        "\\u escapes of surrogates come in high-low pairs"
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = (
            status,
            message,
            type_,
            param,
            code,
            headers,
        )


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
