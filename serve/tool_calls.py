"""Tool calling (OpenAI's `tools` and `tool_choice`, as vLLM serves them): the server's options, the grammar that
constrains a `required` or named call, and the parsers that find calls in a model's free text (`auto`).

A choice's text becomes chat content and tool calls through one `split` function per mode: it cuts a text into
content pieces and calls, and says how much of the text is settled (a streamed answer holds back the rest until
more text, or the end, decides it). So a stream and a whole response come from the same code and agree:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text (Hermes 2 Pro,
  Qwen2.5, and the format the tool system message asks for where the chat template has no tools); the text outside
  them is content. A block that begins `{"name": "...", "arguments": {` is a call from there on: its arguments
  stream as they are written (the JSON object as the model wrote it) and an unclosed block at the end keeps what
  was written. Another block is a call when its whole JSON is one (`parameters`, keys in another order, arguments
  as a JSON string), sent when it closes, and stays content otherwise.
- `llama3_json`: an answer that starts with a JSON object (after an optional `<|python_tag|>`), `{"name": ...,
  "parameters": {...}}` (or `"arguments"`), several separated by `;`; an answer that starts otherwise is content.
- constrained (`tool_choice` `required` or a named function): the grammar makes the whole output JSON: one call
  object for a named function, a list of them for `required`; each call's arguments stream as they are written.
  Output cut short (max_tokens) before a call's arguments began stays content.

No model code and no torch: the serving layer's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from clover.errors import CloverError
from clover.runtime.grammar import Grammar, strict_json_schema

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


@dataclass(frozen=True)
class OpenCall:
    """A call still being written: its name is known, `arguments` is the raw JSON text of its arguments so far."""

    name: str
    arguments: str


Piece = str | ToolCall | OpenCall  # an OpenCall only last: a call still being written
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


UNDECIDED = "undecided"  # the text so far could still go either way


def _literal(text: str, i: int, word: str) -> int | str | None:
    """The index after `word` at text[i:], UNDECIDED where the text ends inside it, None where it differs."""
    if text.startswith(word, i):
        return i + len(word)
    return UNDECIDED if word.startswith(text[i:]) else None


def _space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string(text: str, i: int) -> tuple[str, int] | str | None:
    """The JSON string at text[i] and the index after it; UNDECIDED where it is not finished yet."""
    if i == len(text):
        return UNDECIDED
    if text[i] != '"':
        return None
    try:
        return json.decoder.scanstring(text, i + 1)
    except json.JSONDecodeError as e:
        # the text ends inside the string, or inside a \\uXXXX escape at its end
        return (
            UNDECIDED
            if e.msg.startswith("Unterminated string") or (e.msg.startswith("Invalid \\u") and e.pos + 6 > len(text))
            else None
        )


def _object_end(text: str, i: int) -> int | None:
    """The index after the JSON object (or array) that opens at text[i], None where it is not closed yet."""
    depth, quoted, escaped = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if quoted:
            escaped, quoted = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            quoted = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def scan_call(text: str, i: int = 0) -> tuple[str, int, int | None] | str | None:
    """A call object that opens at text[i] as `{"name": STRING, "arguments": {` (or `"parameters"`), the form calls
    stream in: (name, where its arguments begin, where they end or None while they are still being written);
    UNDECIDED while the text is too short to tell; None for any other text (a call then only counts whole)."""
    steps: list[str | None] = ["{", '"name"', ":", None, ","]
    name = ""
    for word in steps:
        i = _space(text, i)
        got = _string(text, i) if word is None else _literal(text, i, word)
        if got is None or got == UNDECIDED:
            return got
        if word is None:
            name, i = got
        else:
            i = got
    i = _space(text, i)
    keys = [_literal(text, i, key) for key in ('"arguments"', '"parameters"')]
    key_end = next((k for k in keys if isinstance(k, int)), None)
    if key_end is None:
        return UNDECIDED if UNDECIDED in keys else None
    for word in (":", "{"):
        at = _space(text, key_end if word == ":" else i)
        got = _literal(text, at, word)
        if got is None or got == UNDECIDED:
            return got
        i = got
    start = i - 1
    return (name, start, _object_end(text, start)) if name else None


def split_hermes(text: str, at_start: bool, final: bool) -> tuple[list[Piece], int]:
    """Hermes-style calls, `<tool_call>JSON</tool_call>`, and the content around them; the block being written last
    as an OpenCall once its name and arguments have begun (its text stays unsettled until it closes)."""
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
        open_end = start + len(HERMES_OPEN)
        close = text.find(HERMES_CLOSE, open_end)
        end = len(text) if close < 0 else close + len(HERMES_CLOSE)
        # the block's text so far (without what could begin its close tag, while it is still open)
        body = text[
            open_end : close if close >= 0 else len(text) - (0 if final else _partial_marker(text, HERMES_CLOSE))
        ]
        scan = scan_call(body)
        if isinstance(scan, tuple):
            name, args_start, args_end = scan
            arguments = body[args_start : len(body) if args_end is None else args_end]
            if close < 0 and not final:
                return [*pieces, OpenCall(name, arguments)], start  # the call is still being written
            pieces.append(ToolCall(name, arguments))
        elif close < 0 and not final:
            return pieces, start  # the call is still being written
        else:
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


def _whole_calls(text: str, required: bool) -> tuple[list[Piece], int]:
    """A constrained output taken whole at its end: its calls, or content where it is not calls."""
    try:
        value = json.loads(text)
    except ValueError:
        return ([text] if text else []), len(text)
    calls = [_call(v) for v in (value if required and isinstance(value, list) else [value])]
    if not calls or None in calls:
        return ([text] if text else []), len(text)
    return list(calls), len(text)


def constrained_split(required: bool, name: str | None = None) -> Split:
    """The output of a constrained call: one call object (a named function, `name`) or a list of them (`required`),
    a call at a time, its arguments streaming as they are written (the grammar keeps every prefix valid JSON). A
    call cut short (max_tokens) keeps what was written; cut before its arguments began, a named function's call has
    none written, and a `required` output stays content."""

    def cut_short(text: str) -> tuple[list[Piece], int]:
        pieces, used = _whole_calls(text, required)
        if name is not None and not any(isinstance(p, ToolCall) for p in pieces):
            return [ToolCall(name, "")], used  # the function is known before its call is written
        return pieces, used

    def split(text: str, at_start: bool, final: bool) -> tuple[list[Piece], int]:
        i = _space(text, 0)
        if at_start and required:
            opened = _literal(text, i, "[")
            if not isinstance(opened, int):
                return cut_short(text) if final else ([], 0)
            i = opened
        elif not at_start:  # after a call: its object's end, and the comma before the next one
            for word in ("}", ","):
                i = _space(text, i)
                i += text.startswith(word, i)
        i = _space(text, i)
        scan = scan_call(text, i)
        if not isinstance(scan, tuple):
            if at_start:
                return cut_short(text) if final else ([], 0)
            return [], len(text) if final else 0  # the list's end (or an output cut between calls)
        name, args_start, args_end = scan
        if args_end is not None:
            return [ToolCall(name, text[args_start:args_end])], args_end
        if final:
            return [ToolCall(name, text[args_start:])], len(text)
        return [OpenCall(name, text[args_start:])], i

    return split


PARSERS: dict[str, Split] = {"hermes": split_hermes, "llama3_json": split_llama3_json}


@dataclass(frozen=True)
class CallUpdate:
    """A streamed call's news: its first update names it (`name`, with the arguments so far), the later ones carry
    the next piece of its arguments; `index` numbers the calls of a choice from 0, as OpenAI's stream does."""

    index: int
    id: str
    name: str | None
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """A `delta.tool_calls` entry."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


class ToolStream:
    """One choice's text turned into content and calls as it arrives (`feed`), and at its end (`finish`). Content is
    the text outside calls; where the answer has calls, the whitespace it ends with is dropped (whitespace is held
    until text after it shows it is not the end), so a stream's pieces add up to the whole response's content. A
    call is streamed as CallUpdates: its name once known, then its arguments piece by piece as they are written;
    `calls` holds the calls finished so far, with the ids their updates carried."""

    def __init__(self, split: Split, parallel: bool = True) -> None:
        """parallel: False keeps the first call only (parallel_tool_calls false)."""
        self.split, self.parallel, self.text, self.settled, self.held = split, parallel, "", 0, ""
        self.calls: list[ToolCall] = []
        self.open: tuple[str, int, str] | None = None  # the call being written: its id, index, arguments sent

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[CallUpdate]]:
        """The content and call updates that `delta` (and, with `final`, the end) settle."""
        self.text += delta
        content, updates = "", []
        while True:
            pieces, used = self.split(self.text[self.settled :], self.settled == 0, final)
            self.settled += used
            for piece in pieces:
                if isinstance(piece, str):
                    joined = self.held + piece
                    kept = len(joined.rstrip())
                    content, self.held = content + joined[:kept], joined[kept:]
                elif (update := self._call(piece)) is not None:
                    updates.append(update)
            if not used or self.settled == len(self.text):
                break
        if final and not self.calls:
            content, self.held = content + self.held, ""
        return content, updates

    def _call(self, piece: ToolCall | OpenCall) -> CallUpdate | None:
        """The update a call's piece makes (None: nothing new, or a call parallel_tool_calls false leaves out)."""
        if self.open is None:
            if not self.parallel and self.calls:
                return None
            self.open = (f"call_{uuid.uuid4().hex[:24]}", len(self.calls), "")
            name: str | None = piece.name
        else:
            name = None
        call_id, index, sent = self.open
        new = piece.arguments[len(sent) :] if piece.arguments.startswith(sent) else ""
        if isinstance(piece, ToolCall):
            self.calls.append(ToolCall(piece.name, sent + new, id=call_id))
            self.open = None
        else:
            self.open = (call_id, index, sent + new)
        return CallUpdate(index, call_id, name, new) if name is not None or new else None

    def finish(self) -> tuple[str, list[CallUpdate]]:
        return self.feed("", final=True)


def parse(split: Split, text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when there is none) and calls."""
    stream = ToolStream(split, parallel)
    content, _ = stream.feed(text, final=True)
    return content or None, stream.calls


# -- the constrained call's grammar -------------------------------------------------------------------------------
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON schema of one call of function `name`: `{"name": name, "arguments": ...}`, its arguments following
    the function's parameters strictly (no property they do not list, unless they allow more explicitly; none
    given: an empty object, as OpenAI reads a function without parameters)."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": strict_json_schema(parameters or EMPTY_PARAMETERS)},
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
    tools, "auto" on a server without a parser, a named function not in `tools`, or a function whose parameters
    are not an object schema."""
    parallel = parallel is not False
    if mode != "none" and not tools:
        raise CloverError(f"tool_choice {mode!r} needs tools: send the functions in tools", param="tool_choice")
    shown = None if not tools or (mode == "none" and options.exclude_when_none) else tools
    for i, tool in enumerate(tools):  # OpenAI's functions take an object of arguments
        parameters = tool["function"].get("parameters")
        kind = parameters.get("type", "object") if isinstance(parameters, dict) else None
        if parameters is not None and kind != "object":
            raise CloverError(
                f"tool {tool['function']['name']!r}: parameters must be a JSON schema of an object (the arguments "
                f"are one), got type {kind!r}",
                param=f"tools.{i}.function.parameters",
            )
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
        return ToolPlan("named", shown, grammar, field_, ((field_, grammar),), constrained_split(False, name), False)
    checks = tuple(
        (f"tools.{i}.function.parameters", calls_grammar([f], required=False, parallel=False))
        for i, f in enumerate(functions)
    )
    grammar = calls_grammar(functions, required=True, parallel=parallel)
    return ToolPlan("required", shown, grammar, "tools", checks, constrained_split(True), parallel)
