"""Tool calling through clover-serve for real on SmolLM2-135M-Instruct (uvicorn on 127.0.0.1, the official `openai`
client): a named tool_choice and "required" give calls whose arguments follow the function's schema, the same with
plain decoding and under speculation (tree auto over the shipped Clover-2 heads), streamed and not; a conversation
with the call and its result sent back completes; "auto" with the hermes parser turns a hermes answer into
tool_calls; bad tools are 400 naming their field, and the server keeps serving. SmolLM2's chat template has no
tools, so the model sees them in a hermes system message (runtime/tokenizer.py)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from helpers import Server

from clover.runtime import cost
from clover.runtime.backends.torch_runner import TorchRunner
from clover.runtime.engine import Engine
from clover.runtime.params import EngineOptions
from clover.runtime.tokenizer import Tokenizer
from clover.serve.tool_calls import ToolOptions

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
pytestmark = pytest.mark.slow

MODEL = "smollm2"
MAX_TOKENS = 48
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 40}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def servers(smollm2_path):
    """Two servers on the same base: plain decoding without the auto flags, and tree auto over the shipped
    Clover-2 heads with --enable-auto-tool-choice --tool-call-parser hermes."""
    from clover.models.head_io import resolve_heads
    from clover.models.loading import load_base

    base = load_base(smollm2_path)
    tok = Tokenizer.from_dir(smollm2_path)
    options = EngineOptions(max_batch=2, max_waiting=16)
    speculative = TorchRunner(base, resolve_heads("smollm2-clover2", base))
    # Tree auto's verify-cost curve, given rather than measured (minutes on a shared CPU): any curve leaves the output
    # exact, it only sizes the trees.
    cost._MEASURED[speculative] = {1: 10.0, 4: 11.0, 16: 14.0, 64: 25.0, 256: 70.0, 1024: 260.0, 8192: 2000.0}
    engines = [
        Engine(TorchRunner(base), tok, "plain", log=None, options=options),
        Engine(speculative, tok, "auto", log=None, options=options),
    ]
    made = [Server(engines[0], MODEL), Server(engines[1], MODEL, tools=ToolOptions(auto=True, parser="hermes"))]
    yield made
    for s, e in zip(made, engines):
        s.close()
        e.close()


def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def ask(server, messages=ASK, stream: bool = False, **kw):
    """The choice's (content, [(name, arguments)], finish_reason), streamed or not."""
    c = client(server)
    args = dict(model=MODEL, messages=messages, tools=TOOLS, temperature=0, **{"max_tokens": MAX_TOKENS, **kw})
    if not stream:
        choice = c.chat.completions.create(**args).choices[0]
        calls = [(t.function.name, t.function.arguments, t.id) for t in choice.message.tool_calls or ()]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", {}, None
    for chunk in c.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        content += (delta.content or "") if delta else ""
        for t in (delta.tool_calls or ()) if delta else ():
            name, arguments, id_ = calls.get(t.index, ("", "", t.id))
            calls[t.index] = (name + (t.function.name or ""), arguments + (t.function.arguments or ""), id_)
        reason = chunk.choices[0].finish_reason if chunk.choices else reason
    return content or None, [calls[i] for i in sorted(calls)], reason


def without_ids(answer):
    content, calls, reason = answer
    return content, [(name, arguments) for name, arguments, _ in calls], reason


def test_named_and_required_calls_follow_the_schema_equal_plain_and_speculative_streamed_or_not(servers):
    cases = [({"type": "function", "function": {"name": "get_weather"}}, "get_weather"), ("required", None)]
    for choice, named in cases:
        answers = [without_ids(ask(s, tool_choice=choice, stream=stream)) for s in servers for stream in (False, True)]
        assert all(a == answers[0] for a in answers), (choice, answers)
        content, calls, reason = answers[0]
        # a named function's answer ends with stop, as OpenAI's and vLLM's; a required call's with tool_calls
        assert content is None and reason == ("stop" if named else "tool_calls") and calls, answers[0]
        r = client(servers[1]).chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=MAX_TOKENS
        )
        assert r.model_extra["clover"]["accepted_tokens"] > 0  # speculation ran, and kept the output
        for name, arguments in calls:
            assert name == named or named is None and name in SCHEMAS
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_streamed_call_comes_name_first_then_its_arguments_as_they_are_written(servers):
    """As OpenAI and vLLM stream a call: its first delta holds the id, type and name (with the arguments' start),
    the later ones the next pieces of its arguments, which add up to the whole response's arguments."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for server in servers[1:]:  # the speculative server (the plain one streams through the same code)
        args = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=MAX_TOKENS)
        deltas = [
            t
            for chunk in client(server).chat.completions.create(**args, stream=True)
            for t in (chunk.choices[0].delta.tool_calls or () if chunk.choices and chunk.choices[0].delta else ())
        ]
        first, rest = deltas[0], deltas[1:]
        assert first.id.startswith("call_") and first.type == "function" and first.function.name == "get_weather"
        assert len(rest) >= 2 and all(t.id is None and t.function.name is None and t.index == 0 for t in rest)
        whole = client(server).chat.completions.create(**args).choices[0].message.tool_calls[0].function.arguments
        assert "".join(t.function.arguments or "" for t in deltas) == whole


# objects in an array, an enum, integer bounds, a pattern, and no additionalProperties anywhere: the arguments are
# strict all the same (no property the schema does not list), or a small model invents properties until max_tokens
TRIP = {
    "type": "object",
    "properties": {
        "traveler": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
        "nights": {"type": "integer", "minimum": 1, "maximum": 14},
        "cabin": {"type": "string", "enum": ["economy", "business"]},
        "stops": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1}},
                "required": ["city", "days"],
            },
        },
    },
    "required": ["traveler", "nights", "cabin", "stops"],
}


def test_a_nested_schema_call_finishes_strict_and_valid_plain_equal_speculative(servers):
    from clover.runtime.grammar import strict_json_schema

    tools = [{"type": "function", "function": {"name": "plan_trip", "description": "Book a trip", "parameters": TRIP}}]
    ask = [{"role": "user", "content": "Plan a trip for Anna: 5 nights, Rome then Florence."}]
    answers = []
    for server in servers:
        r = client(server).chat.completions.create(
            model=MODEL,
            messages=ask,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "plan_trip"}},
            temperature=0,
            max_tokens=200,
        )
        choice = r.choices[0]
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "stop" and call.function.name == "plan_trip", r
        jsonschema.validate(json.loads(call.function.arguments), strict_json_schema(TRIP))
        answers.append((call.function.arguments, r.usage.completion_tokens))
    assert answers[0] == answers[1], answers  # plain == speculative


def test_a_named_call_cut_short_is_still_the_call_and_says_length(servers):
    """tool_choice naming a function never answers without its call: cut by max_tokens before or inside the
    arguments, the call comes with what was written and finish_reason length, as OpenAI and vLLM answer."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for max_tokens in (3, 12):
        for stream in (False, True):
            content, calls, reason = ask(servers[1], tool_choice=choice, stream=stream, max_tokens=max_tokens)
            assert content is None and reason == "length" and [c[0] for c in calls] == ["get_weather"], calls


def test_a_call_and_its_result_sent_back_complete_the_conversation(servers):
    plain, speculative = servers
    _, calls, _ = ask(plain, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    name, arguments, id_ = calls[0]
    assert id_.startswith("call_")
    conversation = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": id_, "content": json.dumps({"temperature": 18, "sky": "sunny"})},
    ]
    answers = [without_ids(ask(s, conversation, tool_choice="none")) for s in servers]
    assert answers[0] == answers[1]
    content, calls, reason = answers[0]
    assert content and not calls and reason in ("stop", "length"), answers[0]
    # what the model saw: the tools in a hermes system message, the call and its result as hermes text
    tok = plain.engine.tokenizer
    prompt = tok.apply_chat_template(conversation, tools=TOOLS)
    assert "<tools>" in prompt and "<tool_call>" in prompt and "<tool_response>" in prompt
    r = httpx.post(
        plain.url + "/chat/completions",
        json={"model": MODEL, "messages": conversation, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1},
        timeout=60,
    )
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode_chat(conversation, tools=TOOLS))


def test_auto_parses_a_hermes_answer_into_tool_calls(servers):
    """The model's answer is made hermes text by a regex (vLLM's guided_regex): the hermes parser turns it into a
    call, streamed and not; text before the call stays content."""
    _, speculative = servers
    call = r'<tool_call>\n\{"name": "get_time", "arguments": \{"timezone": "(Europe/Paris|UTC)"\}\}\n</tool_call>'
    for regex, content in ((call, None), (r"Let me check\.\n" + call, "Let me check.")):
        for stream in (False, True):
            got, calls, reason = ask(speculative, stream=stream, tool_choice="auto", extra_body={"guided_regex": regex})
            assert (got, reason) == (content, "tool_calls") and len(calls) == 1, (got, calls, reason)
            name, arguments, _ = calls[0]
            assert name == "get_time" and json.loads(arguments)["timezone"] in ("Europe/Paris", "UTC")
    # an answer without a call is all content, as with tool_choice none (the same prompt)
    auto, none = (ask(speculative, tool_choice=c) for c in ("auto", "none"))
    assert auto == none and auto[1] == []


def test_bad_tools_are_400_naming_their_field_and_the_server_keeps_serving(servers):
    plain, _ = servers

    def post(**extra):
        body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "tools": TOOLS, **extra}
        return httpx.post(plain.url + "/chat/completions", json={k: v for k, v in body.items() if v is not None})

    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    cases = [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": bad_schema, "tool_choice": {"type": "function", "function": {"name": "f"}}}, None),
        ({"tools": [TOOLS[0], *bad_schema], "tool_choice": "required"}, "tools.1.function.parameters"),
        (
            {
                "tools": [
                    TOOLS[0],
                    {"type": "function", "function": {"name": "say", "parameters": {"type": "string"}}},
                ],
                "tool_choice": "required",
            },
            "tools.1.function.parameters",
        ),  # arguments are an object
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "tool", "content": "18"}]}, "messages.0"),
        ({"messages": [{"role": "user"}]}, "messages.0"),
    ]
    bad_schema_param = "tools.0.function.parameters"
    for extra, param in cases:
        r = post(**extra)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == (param or bad_schema_param), (extra, r.text)
    # tool_choice auto (or tools alone) on a server without the flags: 400 naming them, as vLLM
    for extra in ({"tool_choice": "auto"}, {}):
        r = post(**extra)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "tool_choice", r.text
        assert "--enable-auto-tool-choice" in err["message"] and "--tool-call-parser" in err["message"]
    assert post(tool_choice="none").status_code == 200


def test_the_responses_api_answers_as_the_chat_path_streamed_or_not(servers):
    """POST /v1/responses (the openai client's responses.create): text input with instructions answers the chat
    path's text for the same messages, plain and speculative alike, streamed as output_text deltas or whole; a
    stored response is fetched back; store false keeps nothing to continue from."""
    ask = dict(model=MODEL, instructions="Answer in one sentence.", input="Name a colour.", max_output_tokens=16)
    chat = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "Name a colour."}]
    want = client(servers[0]).chat.completions.create(model=MODEL, messages=chat, temperature=0, max_tokens=16)
    want = want.choices[0].message.content
    for s in servers:
        r = client(s).responses.create(**ask, temperature=0)
        assert r.output_text == want and r.status in ("completed", "incomplete") and r.usage.output_tokens > 0
        assert client(s).responses.retrieve(r.id).output_text == want
        deltas, kinds = [], []
        for event in client(s).responses.create(**ask, temperature=0, stream=True):
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        assert "".join(deltas) == want and kinds[0] == "response.created"
        assert kinds[-1] == ("response.completed" if r.status == "completed" else "response.incomplete")
    unstored = client(servers[1]).responses.create(**ask, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client(servers[1]).responses.create(model=MODEL, input="And another?", previous_response_id=unstored.id)


def test_the_responses_api_calls_a_function_and_continues_from_its_output(servers):
    """A function tool named by tool_choice gives a function_call item whose arguments follow its schema; its output
    sent back with previous_response_id continues the conversation as the chat path does with the same messages."""
    tool = {"type": "function", "name": "get_weather", "description": "The weather now", "parameters": WEATHER}
    for s in servers:
        c = client(s)
        r = c.responses.create(
            model=MODEL,
            input=ASK[0]["content"],
            tools=[tool],
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            max_output_tokens=MAX_TOKENS,
        )
        (call,) = [item for item in r.output if item.type == "function_call"]
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 18}'}
        after = c.responses.create(
            model=MODEL,
            input=[result],
            previous_response_id=r.id,
            tools=[tool],
            tool_choice="none",
            temperature=0,
            max_output_tokens=24,
        )
        messages = [
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"celsius": 18}'},
        ]
        want = c.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS[:1], tool_choice="none", temperature=0, max_tokens=24
        )
        assert after.output_text == (want.choices[0].message.content or "")


def test_an_openai_agents_sdk_agent_runs_its_tool(servers):
    """The openai-agents SDK's default model (the Responses API) against the server with auto tool choice: the agent
    calls its function tool (required on its first turn), gets the result, and answers with text."""
    agents = pytest.importorskip("agents")
    import asyncio

    agents.set_tracing_disabled(True)
    called = []

    @agents.function_tool
    def get_weather(city: str, unit: str) -> str:
        """The weather now in a city."""
        called.append((city, unit))
        return f"18 degrees {unit} and sunny in {city}"

    model = agents.OpenAIResponsesModel(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=servers[1].url, api_key="x")
    )
    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather in one short sentence.",
        tools=[get_weather],
        model=model,
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=160),
    )
    result = asyncio.run(agents.Runner.run(agent, ASK[0]["content"], max_turns=4))
    assert len(called) >= 1 and all(isinstance(city, str) for city, _ in called), called
    assert isinstance(result.final_output, str) and result.final_output.strip()
