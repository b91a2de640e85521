"""Tool calling (OpenAI's `tools` and `tool_choice`, as vLLM serves them): the server's options, the grammar that
constrains a `required` or named call, and the parsers that find calls in a model's free text (`auto`).

A choice's text becomes chat content and tool calls through one `split` function per mode: it cuts a text into
content pieces and calls, and says how much of the text is settled (a streamed answer holds back the rest until
more text, or the end, decides it). So a stream and a whole response come from the same code and agree:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text (Hermes 2 Pro,
  Qwen2.5, and the format the tool system message asks for where the chat template has no tools); the text outside
  them is content. A block that is not a JSON call stays content; an unclosed block at the end is a call if its
  JSON is one.
- `llama3_json`: an answer that starts with a JSON object (after an optional `<|python_tag|>`), `{"name": ...,
  "parameters": {...}}` (or `"arguments"`), several separated by `;`; an answer that starts otherwise is content.
- constrained (`tool_choice` `required` or a named function): the grammar makes the whole output JSON: one call
  object for a named function, a list of them for `required`.

No model code and no torch: the serving layer's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from clover.errors import CloverError
from clover.runtime.grammar import Grammar

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's start of a call (special: usually gone from the decoded text)


@dataclass(frozen=True)
class ToolOptions:
    """How the server serves tools. auto: `tool_choice` "auto" is served, parsing the model's text with `parser`
    (vLLM's --enable-auto-tool-choice, --tool-call-parser); without it "auto" answers 400 naming those flags.
    exclude_when_none: `tool_choice` "none" leaves the tools out of the prompt (vLLM's
    --exclude-tools-when-tool-choice-none; default: rendered, as vLLM does)."""

    auto: bool = False
    parser: str | None = None
    exclude_when_none: bool = False

    def __post_init__(self) -> None:
        if self.parser is not None and self.parser not in PARSERS:
            raise CloverError(f"--tool-call-parser {self.parser!r} is not known: use one of {', '.join(PARSERS)}")
        if self.auto and self.parser is None:
            raise CloverError(
                "--enable-auto-tool-choice needs --tool-call-parser NAME (the format the model writes calls in: "
                f"{', '.join(PARSERS)})"
            )


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's `arguments` is a string)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry; with `index`, a streamed `delta.tool_calls` entry."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


Piece = str | ToolCall
# (the text not yet settled, whether it starts the output, whether the output has ended) ->
# (its settled pieces in order, how many of its characters they cover)
Split = Callable[[str, bool, bool], tuple[list[Piece], int]]


def _call(value: Any) -> ToolCall | None:
    """A parsed JSON value as a call: an object with a string `name` and an object `arguments` (or `parameters`,
    Llama 3's name for them; a JSON string of an object is taken too)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))


def _json_call(text: str) -> ToolCall | None:
    try:
        return _call(json.loads(text))
    except ValueError:
        return None


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (they wait for the next text)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_hermes(text: str, at_start: bool, final: bool) -> tuple[list[Piece], int]:
    """Hermes-style calls, `<tool_call>JSON</tool_call>`, and the content around them."""
    pieces: list[Piece] = []
    pos = 0
    while True:
        start = text.find(HERMES_OPEN, pos)
        if start < 0:
            end = len(text) if final else len(text) - _partial_marker(text[pos:], HERMES_OPEN)
            if end > pos:
                pieces.append(text[pos:end])
            return pieces, max(end, pos)
        if start > pos:
            pieces.append(text[pos:start])
        close = text.find(HERMES_CLOSE, start + len(HERMES_OPEN))
        if close < 0 and not final:
            return pieces, start  # the call is still being written
        end = len(text) if close < 0 else close + len(HERMES_CLOSE)
        body = text[start + len(HERMES_OPEN) : len(text) if close < 0 else close]
        pieces.append(_json_call(body.strip()) or text[start:end])  # not a call: the block stays content
        pos = end


def split_llama3_json(text: str, at_start: bool, final: bool) -> tuple[list[Piece], int]:
    """Llama 3's JSON calls: the whole answer is `{"name": ..., "parameters": ...}` objects separated by `;`, or
    it is content."""
    if not at_start:  # the answer was content from its start
        return ([text] if text else []), len(text)
    body = text.lstrip()
    body = body.removeprefix(PYTHON_TAG).lstrip() if body.startswith(PYTHON_TAG) else body
    undecided = not body or PYTHON_TAG.startswith(body)
    if not (body.startswith("{") or undecided):
        return ([text] if text else []), len(text)
    if not final:
        return [], 0  # a call being written (or nothing yet): decided at the end
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while pos < len(body):
        try:
            value, end = decoder.raw_decode(body, pos)
        except ValueError:
            break
        call = _call(value)
        if call is None:
            break
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    if not calls:
        return ([text] if text else []), len(text)
    rest = body[pos:]
    return [*calls, *([rest] if rest else [])], len(text)


def constrained_split(required: bool) -> Split:
    """The output of a constrained call: one call object (a named function) or a list of them (`required`),
    decided at the end; output that is not that (cut short by max_tokens) stays content."""

    def split(text: str, at_start: bool, final: bool) -> tuple[list[Piece], int]:
        if not final:
            return [], 0
        try:
            value = json.loads(text)
        except ValueError:
            return ([text] if text else []), len(text)
        calls = [_call(v) for v in (value if required and isinstance(value, list) else [value])]
        if not calls or None in calls:
            return ([text] if text else []), len(text)
        return list(calls), len(text)

    return split


PARSERS: dict[str, Split] = {"hermes": split_hermes, "llama3_json": split_llama3_json}


class ToolStream:
    """One choice's text turned into content and calls as it arrives (`feed`), and at its end (`finish`). Content is
    the text outside calls; where the answer has calls, the whitespace it ends with is dropped (whitespace is held
    until text after it shows it is not the end), so a stream's pieces add up to the whole response's content."""

    def __init__(self, split: Split, parallel: bool = True) -> None:
        """parallel: False keeps the first call only (parallel_tool_calls false)."""
        self.split, self.parallel, self.text, self.settled, self.held = split, parallel, "", 0, ""
        self.calls: list[ToolCall] = []

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """The content and calls that `delta` (and, with `final`, the end) settle."""
        self.text += delta
        pieces, used = self.split(self.text[self.settled :], self.settled == 0, final)
        self.settled += used
        content, calls = "", []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                if self.parallel or not (self.calls or calls):
                    calls.append(piece)
                continue
            joined = self.held + piece
            kept = len(joined.rstrip())
            content, self.held = content + joined[:kept], joined[kept:]
        self.calls.extend(calls)
        if final and not self.calls:
            content, self.held = content + self.held, ""
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self.feed("", final=True)


def parse(split: Split, text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when there is none) and calls."""
    content, calls = ToolStream(split, parallel).feed(text, final=True)
    return content or None, calls


# -- the constrained call's grammar -------------------------------------------------------------------------------
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON schema of one call of function `name`: `{"name": name, "arguments": ...}`, its arguments following
    the function's parameters (none given: an empty object, as OpenAI reads a function without parameters)."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters or EMPTY_PARAMETERS},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def calls_grammar(functions: Sequence[tuple[str, dict[str, Any] | None]], required: bool, parallel: bool) -> Grammar:
    """The grammar of a constrained answer: one call of the single function given (a named `tool_choice`), or for
    `required` a JSON list of one call or more (one at most unless `parallel`) of any of the functions."""
    if not required:
        ((name, parameters),) = functions
        return Grammar.json_schema(call_schema(name, parameters))
    items = {"anyOf": [call_schema(name, parameters) for name, parameters in functions]}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return Grammar.json_schema(schema)


# -- what a request's tools make of it ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools: mode ("none", "auto", "required", "named"); prompt_tools, the definitions the chat
    template renders (None: none); grammar, the constrained call's, with `field` the request field its errors name
    and `checks` each function's own call grammar with its field (compiled first, so that a schema that cannot
    compile is named); split, how the answer's text becomes content and calls (None: content only); parallel:
    several calls allowed."""

    mode: str
    prompt_tools: list[dict[str, Any]] | None = None
    grammar: Grammar | None = None
    field: str | None = None
    checks: tuple[tuple[str, Grammar], ...] = ()
    split: Split | None = None
    parallel: bool = True

    def stream(self) -> ToolStream | None:
        return None if self.split is None else ToolStream(self.split, self.parallel)


def plan_tools(
    tools: list[dict[str, Any]], mode: str, name: str | None, parallel: bool | None, options: ToolOptions
) -> ToolPlan:
    """The plan of a request with OpenAI tool definitions `tools` and tool choice `mode` (`name`: the named
    function), on a server with `options`. CloverError naming the request's field (a 400) for a choice without
    tools, "auto" on a server without a parser, or a named function not in `tools`."""
    parallel = parallel is not False
    if mode != "none" and not tools:
        raise CloverError(f"tool_choice {mode!r} needs tools: send the functions in tools", param="tool_choice")
    shown = None if not tools or (mode == "none" and options.exclude_when_none) else tools
    if mode == "none":
        return ToolPlan("none", shown)
    if mode == "auto":
        if not options.auto:
            raise CloverError(
                'tool_choice "auto" (also what tools without a tool_choice ask for) needs the server started with '
                '--enable-auto-tool-choice and --tool-call-parser NAME: send tool_choice "required" or a named '
                'function (constrained calls), or "none"',
                param="tool_choice",
            )
        return ToolPlan("auto", shown, split=PARSERS[options.parser], parallel=parallel)
    functions = [(t["function"]["name"], t["function"].get("parameters")) for t in tools]
    if mode == "named":
        names = [n for n, _ in functions]
        if name not in names:
            raise CloverError(
                f"tool_choice names function {name!r}, which is not in tools ({', '.join(names)})",
                param="tool_choice",
            )
        i = names.index(name)
        field_ = f"tools.{i}.function.parameters"
        grammar = calls_grammar([functions[i]], required=False, parallel=False)
        return ToolPlan("named", shown, grammar, field_, ((field_, grammar),), constrained_split(False), False)
    checks = tuple(
        (f"tools.{i}.function.parameters", calls_grammar([f], required=False, parallel=False))
        for i, f in enumerate(functions)
    )
    grammar = calls_grammar(functions, required=True, parallel=parallel)
    return ToolPlan("required", shown, grammar, "tools", checks, constrained_split(True), parallel)
