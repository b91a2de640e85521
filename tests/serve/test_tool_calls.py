"""Tool calling's parts on fixed text, without a model: the hermes and llama3_json parsers (a streamed answer,
cut anywhere, adds up to the whole answer's content and calls), the constrained call's output, what a request's
tools and tool_choice make of it (and their 400s), the server's options and flags, and how the chat template renders
tools, calls and results (a template that takes `tools`, and the hermes system message for one that does not)."""

from __future__ import annotations

import json

import pytest
from helpers import char_tokenizer_dir

from clover.errors import CloverError
from clover.runtime.tokenizer import Tokenizer, tool_prompt
from clover.serve.tool_calls import (
    PARSERS,
    ToolOptions,
    ToolStream,
    constrained_split,
    parse,
    plan_tools,
    split_hermes,
    split_llama3_json,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(split, text: str, step: int, parallel: bool = True):
    """The answer fed `step` characters at a time: (content, calls) as a stream's chunks add them up, each call
    from its updates (its name first, then its arguments' pieces), which must agree with the stream's own calls."""
    stream, content, updates = ToolStream(split, parallel), "", []
    for i in range(0, len(text), step):
        piece, new = stream.feed(text[i : i + step])
        content, updates = content + piece, updates + new
    piece, new = stream.finish()
    calls: dict[int, list] = {}
    for u in updates + new:
        if u.name is not None:
            assert u.index == len(calls) and u.index not in calls  # named once, numbered in order
            calls[u.index] = [u.id, u.name, ""]
        assert calls[u.index][0] == u.id
        calls[u.index][2] += u.arguments
    assert [(c.id, c.name, c.arguments) for c in stream.calls] == [tuple(c) for c in calls.values()]
    return content + piece or None, stream.calls


HERMES = [
    (  # Qwen2.5 / Hermes: text, then a call
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n',
        "Let me look.",
        [("get_weather", {"city": "Paris"})],
    ),
    (  # two calls, whitespace between
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        None,
        [("get_time", {}), ("get_weather", {"city": "Oslo"})],
    ),
    (  # the end comes before </tool_call>: still a call
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}',
        None,
        [("get_weather", {"city": "Rome"})],
    ),
    ("No call here, just < and <tool text.  ", "No call here, just < and <tool text.  ", []),  # all of it
    ("a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),  # not a call: content
    (  # arguments as a JSON string, text after the call
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Lima\\"}"}</tool_call> Done.',
        " Done.",
        [("get_weather", {"city": "Lima"})],
    ),
]


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_hermes_parser_whole_and_streamed_anywhere(text, content, calls):
    got_content, got_calls = parse(split_hermes, text)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    for step in range(1, len(text) + 1):
        got_content, got_calls = streamed(split_hermes, text, step)
        assert (got_content, calls_of(got_calls)) == (content, calls), step


LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    (
        '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "arguments": {"city": "B"}}',
        None,
        [("get_time", {}), ("get_weather", {"city": "B"})],
    ),
    ('  {"name": "get_time", "parameters": {}} then text', "then text", [("get_time", {})]),
    ('The call would be {"name": "get_time"}', 'The call would be {"name": "get_time"}', []),  # not at the start
    ('{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but not a call
]


@pytest.mark.parametrize("text,content,calls", LLAMA3)
def test_llama3_json_parser_whole_and_streamed_anywhere(text, content, calls):
    got_content, got_calls = parse(split_llama3_json, text)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    for step in range(1, len(text) + 1):
        got_content, got_calls = streamed(split_llama3_json, text, step)
        assert (got_content, calls_of(got_calls)) == (content, calls), step


def test_streamed_content_comes_before_the_end_and_a_call_as_it_is_written():
    stream = ToolStream(split_hermes)
    assert stream.feed("Sure, ") == ("Sure,", [])  # the space waits: the answer might end there
    assert stream.feed("checking <tool") == (" checking", [])  # "<tool" might begin a call
    assert stream.feed('_call>{"name": "get_wea') == ("", [])  # the name is not known yet
    content, (first,) = stream.feed('ther", "arguments": {"ci')
    assert content == "" and (first.index, first.name, first.arguments) == (0, "get_weather", '{"ci')
    assert first.to_openai() == {
        "index": 0,
        "id": first.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"ci'},
    }
    (more,) = stream.feed('ty": "Paris"}}</tool')[1]  # "</tool" might close the block: held
    assert more.to_openai() == {"index": 0, "function": {"arguments": 'ty": "Paris"}'}}
    assert stream.feed("_call>") == ("", []) and calls_of(stream.calls) == [("get_weather", {"city": "Paris"})]
    assert stream.calls[0].id == first.id and stream.finish() == ("", [])


def test_a_call_cut_short_keeps_what_was_written():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Ber'
    for step in (1, 7, len(text)):
        content, calls = streamed(split_hermes, text, step)
        assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Ber')]


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = HERMES[1][0]
    assert calls_of(parse(split_hermes, text, parallel=False)[1]) == [("get_time", {})]
    assert calls_of(streamed(split_hermes, text, 5, parallel=False)[1]) == [("get_time", {})]


def test_constrained_output_is_calls_or_content_when_cut_short():
    one = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert calls_of(parse(constrained_split(False), one)[1]) == [("get_weather", {"city": "Paris"})]
    assert calls_of(parse(constrained_split(True), f"[{one}, {one}]")[1]) == [("get_weather", {"city": "Paris"})] * 2
    assert parse(constrained_split(True), one[:20]) == (one[:20], [])  # cut before the arguments: no call
    (named,) = parse(constrained_split(False, "get_weather"), one[:20])[1]  # a named function's call all the same
    assert parse(constrained_split(False, "get_weather"), one[:20])[0] is None
    assert (named.name, named.arguments) == ("get_weather", "")
    cut = one[: one.index("Paris") + 2]
    got = [(c.name, c.arguments) for c in parse(constrained_split(False), cut)[1]]
    assert got == [("get_weather", '{"city": "Pa')]  # cut inside them: the call as written
    for text, required in ((one, False), (f"[{one}, {one}]", True), (f"[ {one} ,\n{one} ]", True)):
        for step in range(1, len(text) + 1):
            content, calls = streamed(constrained_split(required), text, step)
            assert content is None and calls_of(calls) == [("get_weather", {"city": "Paris"})] * (1 + required)


def test_tool_plans_and_their_refusals():
    auto = ToolOptions(auto=True, parser="hermes")
    plan = plan_tools(TOOLS, "named", "get_weather", None, ToolOptions())
    strict_weather = {**WEATHER, "additionalProperties": False}  # tool arguments are strict
    assert plan.grammar.value["properties"]["arguments"] == strict_weather
    assert plan.field == "tools.0.function.parameters"
    assert plan.grammar.value["properties"]["name"] == {"const": "get_weather"} and plan.prompt_tools == TOOLS
    plan = plan_tools(TOOLS, "required", None, False, ToolOptions())
    assert plan.grammar.value["maxItems"] == 1 and plan.field == "tools" and len(plan.checks) == 2
    assert plan_tools(TOOLS, "required", None, None, ToolOptions()).grammar.value.get("maxItems") is None
    # a function without parameters takes an empty object
    assert plan.checks[1][1].value["properties"]["arguments"]["properties"] == {}
    assert plan_tools(TOOLS, "auto", None, None, auto).split is PARSERS["hermes"]
    assert plan_tools(TOOLS, "none", None, None, auto).prompt_tools == TOOLS  # rendered, as vLLM
    assert plan_tools(TOOLS, "none", None, None, ToolOptions(exclude_when_none=True)).prompt_tools is None
    for args, says in (
        ((TOOLS, "named", "nope", None, auto), "not in tools"),
        (([], "required", None, None, auto), "needs tools"),
        ((TOOLS, "auto", None, None, ToolOptions()), "--enable-auto-tool-choice"),
    ):
        with pytest.raises(CloverError, match=says) as e:
            plan_tools(*args)
        assert e.value.param == "tool_choice"
    # arguments are an object: a tool whose parameters are another schema is refused in every mode
    bad = [TOOLS[0], {"type": "function", "function": {"name": "say", "parameters": {"type": "string"}}}]
    for mode, name in (("required", None), ("named", "get_weather"), ("auto", None), ("none", None)):
        with pytest.raises(CloverError, match="'say': parameters must be a JSON schema of an object") as e:
            plan_tools(bad, mode, name, None, auto)
        assert e.value.param == "tools.1.function.parameters"


def test_strict_schemas_admit_no_property_they_do_not_list():
    from clover.runtime.grammar import strict_json_schema

    nested = {
        "type": "object",
        "properties": {
            "stops": {"type": "array", "items": {"type": "object", "properties": {"city": {"type": "string"}}}},
            "meta": {"type": "object", "additionalProperties": {"type": "object", "properties": {}}},
            "any": {"type": "object", "additionalProperties": True},
            "either": {"anyOf": [{"type": "object", "properties": {}}, {"type": "integer"}]},
            "tagged": {"$ref": "#/$defs/tag"},
        },
        "$defs": {"tag": {"properties": {"k": {"type": "string"}}}},
    }
    got = strict_json_schema(nested)
    assert got["additionalProperties"] is False
    props = got["properties"]
    assert props["stops"]["items"]["additionalProperties"] is False
    assert props["meta"]["additionalProperties"] == {"type": "object", "properties": {}, "additionalProperties": False}
    assert props["any"]["additionalProperties"] is True  # said explicitly: kept
    assert props["either"]["anyOf"][0]["additionalProperties"] is False and props["either"]["anyOf"][1] == {
        "type": "integer"
    }
    assert got["$defs"]["tag"]["additionalProperties"] is False and "additionalProperties" not in nested  # a copy


def test_tool_options_and_flags(capsys):
    from clover.tools.serve import PARSER_NAMES, build_parser, main

    assert PARSER_NAMES == tuple(PARSERS)
    with pytest.raises(CloverError, match="--tool-call-parser"):
        ToolOptions(auto=True)
    with pytest.raises(CloverError, match="not known"):
        ToolOptions(parser="mistral")
    args = build_parser().parse_args(
        [
            "--demo",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "llama3_json",
            "--exclude-tools-when-tool-choice-none",
        ]
    )
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.exclude_tools_when_tool_choice_none) == (
        True,
        "llama3_json",
        True,
    )
    assert main(["--artifact", "missing", "--enable-auto-tool-choice"]) == 2  # refused before anything loads
    assert "--tool-call-parser" in capsys.readouterr().err


def test_ray_options_carry_the_tool_options():
    from clover.serve.ray import RayServeOptions

    o = RayServeOptions(artifact="a", tools=ToolOptions(auto=True, parser="hermes"))
    assert RayServeOptions.from_args(o.to_args()) == o


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "9 C"},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_dir(char_tokenizer_dir(tmp_path_factory.mktemp("chars")))


def test_a_template_without_tools_sees_them_in_a_hermes_system_message(tok):
    assert not tok.template_takes_tools
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS)
    want = (
        f"system: {tool_prompt(TOOLS)}\n"
        "user: Weather in Paris and Oslo?\n"
        'assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        "user: <tool_response>\n18 C\n</tool_response>\n<tool_response>\n9 C\n</tool_response>\n"
        "assistant: "
    )
    assert text == want
    assert json.dumps(TOOLS[0]) in tool_prompt(TOOLS) and "<tool_call>" in tool_prompt(TOOLS)
    # an existing system message keeps its text, the tools after it
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, CONVERSATION[0]], tools=TOOLS)
    assert text.startswith(f"system: Be brief.\n\n{tool_prompt(TOOLS)}\nuser: ")
    # no tools: the conversation's calls and results still read as hermes text
    assert tok.apply_chat_template(CONVERSATION) == want.replace(f"system: {tool_prompt(TOOLS)}\n", "")


def test_a_template_that_takes_tools_renders_them_itself(tok):
    template = (
        "{% if tools %}TOOLS {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
        "{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %};{% endfor %}"
    )
    native = tok.with_chat_template(template)
    assert native.template_takes_tools
    text = native.apply_chat_template(CONVERSATION[:3], add_generation_prompt=False, tools=TOOLS)
    # the arguments reach the template as an object (templates write them with tojson), as vLLM hands them over
    assert text == (
        "TOOLS get_weather,get_time\nuser: Weather in Paris and Oslo?;"
        'assistant: CALL get_weather {"city": "Paris"}CALL get_weather {"city": "Paris"};'
        "tool: 18 C (call_1);"
    )


def test_a_template_that_handles_tool_messages_gets_them_as_they_are(tok):
    template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% if m.role == 'tool' %} ({{ m.tool_call_id }}){% endif %};{% endfor %}"
    )
    own = tok.with_chat_template(template)
    text = own.apply_chat_template([CONVERSATION[0], CONVERSATION[2]], add_generation_prompt=False, tools=TOOLS)
    assert text == f"system: {tool_prompt(TOOLS)};user: Weather in Paris and Oslo?;tool: 18 C (call_1);"
