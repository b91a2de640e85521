"""POST /v1/responses, OpenAI's Responses API (what the openai-agents SDK and `client.responses.create` call), over
the chat path: the input items become chat messages (instructions first, a previous response's conversation before
them), the function tools chat tools, and the answer's text and calls output items, whole or as the API's stream of
events. GET /v1/responses/{id} answers a stored response.

Stored responses (`store`, true by default, as OpenAI's) are kept in this process, the most recent MAX_STORED of
them, with the conversation that led to them, so that `previous_response_id` continues it; `store: false` keeps
nothing. Every token comes from the chat path, so what speculation guarantees there holds here.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from clover.errors import CloverError
from clover.runtime.engine import EngineStream
from clover.runtime.results import GenerationResult
from clover.serve.schemas import ApiError, ChatCompletionRequest, FunctionDefinition, NamedFunction, new_id, now
from clover.serve.tool_calls import ToolCall, ToolPlan, parse

MAX_STORED = 1000  # stored responses kept (the oldest go first)


class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # an output_text sent back


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(union_mode="left_to_right")]


class FunctionTool(FunctionDefinition):
    """A function tool as the Responses API sends it: the chat API's function definition, flat, with its type."""

    type: Literal["function"]


class NamedTool(NamedFunction):
    """tool_choice naming a function, the Responses API's flat form of the chat API's."""

    type: Literal["function"]


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None  # text only: structured output goes through /v1/chat/completions
    verbosity: None = None


class ResponsesRequest(BaseModel):
    """The Responses API's request. Fields that would change the answer and are not served are refused (400):
    background runs, conversations, stored prompts, reasoning settings, non-text formats, built-in tools."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    text: TextOptions | None = None
    truncation: Literal["disabled"] | None = None
    # accepted and ignored: they do not change the output
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = Field(default=None, max_length=0)
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning: None = None
    background: Literal[False] | None = None

    def messages(self, before: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages: the instructions as the system message, then `before` (a previous response's
        conversation), then this input."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        out += before
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                if out and out[-1]["role"] == "assistant" and not out[-1].get("content"):
                    out[-1].setdefault("tool_calls", []).append(call)  # parallel calls: one assistant message
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out

    def chat(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The same request on the chat path."""
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {k: v for k, v in t.model_dump(exclude={"type"}).items() if v is not None},
                }
                for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedTool):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        for field, value in (
            ("parallel_tool_calls", self.parallel_tool_calls),
            ("max_completion_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
        ):
            if value is not None:
                body[field] = value
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValueError as e:  # a field the chat path checks more narrowly (a tool's name)
            raise ApiError(400, str(e).splitlines()[-1], param="tools") from None


class Store:
    """The stored responses of this process: id -> (the response, the conversation it ends)."""

    def __init__(self, size: int = MAX_STORED) -> None:
        self.size = size
        self.items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self.items[response["id"]] = (response, conversation)
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def get(self, rid: str, param: str = "previous_response_id") -> tuple[dict[str, Any], list[dict[str, Any]]]:
        if rid not in self.items:
            raise ApiError(404, f"response {rid!r} is not stored here (store: false, or long gone)", param=param)
        return self.items[rid]


def output_items(text: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
    """The answer as output items: a message with its text (where there is text), then each function call."""
    items = []
    if text:
        part = {"type": "output_text", "text": text, "annotations": []}
        items.append(
            {"type": "message", "id": new_id("msg"), "status": "completed", "role": "assistant", "content": [part]}
        )
    for c in calls:
        items.append(
            {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": c.id,
                "name": c.name,
                "arguments": c.arguments,
                "status": "completed",
            }
        )
    return items


def response_object(body: ResponsesRequest, rid: str, status: str, output: list, result: GenerationResult | None):
    """The Response object: status in_progress (no result yet), completed or incomplete (cut by max_output_tokens)."""
    cut = result is not None and result.finish_reason == "length"
    usage = None
    if result is not None:
        usage = {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": result.new_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.new_tokens,
        }
    tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedTool) else body.tool_choice
    return {
        "id": rid,
        "object": "response",
        "created_at": now(),
        "status": "incomplete" if cut and status == "completed" else status,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": body.model,
        "instructions": body.instructions,
        "output": output,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "tool_choice": tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": body.metadata or {},
        "usage": usage,
    }


def conversation_after(messages: list[dict[str, Any]], text: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
    """The chat messages a next response continues from: these (without the system message) and the answer."""
    answer: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        answer["tool_calls"] = [c.to_openai() for c in calls]
    return [m for m in messages if m["role"] != "system"] + [answer]


async def create_response(body: ResponsesRequest, request: Request) -> Response:
    served = request.app.state.completions
    store: Store = request.app.state.responses
    before = store.get(body.previous_response_id)[1] if body.previous_response_id else []
    messages = body.messages(before)
    chat = body.chat(messages)
    served.check_chat(chat)
    served.check_prompt(chat, len(messages), sum(len(m.get("content") or "") for m in messages))
    rid = new_id("resp")
    outs, plan = await run_in_threadpool(served.submit, request, chat, [messages], rid)
    if body.stream:
        events = ResponseEvents(served, store, outs[0], Turn(body, rid, messages, plan))
        return StreamingResponse(events.events(), media_type="text/event-stream", headers={"X-Request-Id": rid})
    results = await served.wait(request, outs, rid)
    if results is None:
        return Response(status_code=499)
    result = results[0]
    text, calls = parse(plan.split, result.text, plan.parallel) if plan.split else (result.text, [])
    doc = response_object(body, rid, "completed", output_items(text or "", calls), result)
    if body.store:
        store.put(doc, conversation_after(messages, text or "", calls))
    return JSONResponse(doc, headers={"X-Request-Id": rid})


async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    return request.app.state.responses.get(response_id, param="response_id")[0]


@dataclass(frozen=True)
class Turn:
    """One response's request: its body and id, the chat messages it runs on, and their tool plan."""

    body: ResponsesRequest
    rid: str
    messages: list[dict[str, Any]]
    plan: ToolPlan


class ResponseEvents:
    """A response as the Responses API streams it: response.created, then the message item's text deltas as they
    settle (text that could begin a call waits), each function call item whole, response.completed last
    (response.incomplete where max_output_tokens cut it)."""

    def __init__(self, served: Any, store: Store, out: EngineStream, turn: Turn) -> None:
        self.served, self.store, self.out = served, store, out
        self.body, self.rid, self.messages, self.plan = turn.body, turn.rid, turn.messages, turn.plan
        self.sequence = 0
        self.text, self.calls = "", []  # what has settled so far
        self.message: dict[str, Any] | None = None  # the message item, once it has text

    def event(self, kind: str, **fields: Any) -> str:
        doc = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(doc)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        body, out = self.body, self.out
        started = response_object(body, self.rid, "in_progress", [], None)
        yield self.event("response.created", response=started)
        yield self.event("response.in_progress", response=started)
        tools = self.plan.stream() if self.plan.split is not None else None
        try:
            async for delta in out:
                for event in self.settled(tools.feed(delta.text)[0] if tools is not None else delta.text):
                    yield event
            if tools is not None:
                for event in self.settled(tools.finish()[0]):
                    yield event
                self.calls = tools.calls
        except CloverError as e:
            failed = response_object(body, self.rid, "failed", [], None)
            failed["error"] = {"code": "server_error", "message": str(e)}
            yield self.event("response.failed", response=failed)
            return
        finally:
            if out.result is None:
                out.cancel()
        result, text, message = out.result, self.text, self.message
        self.served.metrics.finished(result, "length" if result.finish_reason == "length" else "stop")
        items = output_items(text, self.calls)
        if message is not None:  # the streamed message keeps its id
            items[0]["id"] = message["id"]
            part = items[0]["content"][0]
            yield self.event("response.output_text.done", **self.place(), text=text)
            yield self.event("response.content_part.done", **self.place(), part=part)
            yield self.event("response.output_item.done", output_index=0, item=items[0])
        first = 1 if message is not None else 0
        for i, item in enumerate(items[first:], first):
            yield self.event("response.output_item.added", output_index=i, item={**item, "status": "in_progress"})
            yield self.event(
                "response.function_call_arguments.done", item_id=item["id"], output_index=i, arguments=item["arguments"]
            )
            yield self.event("response.output_item.done", output_index=i, item=item)
        doc = response_object(body, self.rid, "completed", items, result)
        if body.store:
            self.store.put(doc, conversation_after(self.messages, text, self.calls))
        yield self.event("response.incomplete" if doc["status"] == "incomplete" else "response.completed", response=doc)

    def place(self) -> dict[str, Any]:
        """Where the message's text is: its item, the first output, the first content part."""
        return {"item_id": self.message["id"], "output_index": 0, "content_index": 0}

    def settled(self, piece: str) -> list[str]:
        """The events of text that settled (calls are sent whole at the end): the message item and its text part
        opened before its first text, then the delta."""
        self.text += piece
        if not piece:
            return []
        events = []
        if self.message is None:
            self.message = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant"}
            self.message["content"] = []
            events.append(self.event("response.output_item.added", output_index=0, item=self.message))
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(self.event("response.content_part.added", **self.place(), part=part))
        events.append(self.event("response.output_text.delta", **self.place(), delta=piece))
        return events
