"""The OpenAI-compatible ASGI app over one `clover.Engine` (FastAPI; no model code, no torch).

    POST /v1/chat/completions, POST /v1/completions   (stream: server-sent events ending with `data: [DONE]`)
    GET  /v1/models, GET /health (200 "ok" once warmed up; 503 "warming up", or "dead" once the engine's loop has
    stopped), GET /metrics (Prometheus text)

Every error is OpenAI's error shape ({"error": {"message", "type", "param", "code"}}) with its status: 400 for a
malformed body, a bad field (text that is not valid Unicode included, named however deep), a token id outside the
vocabulary, a prompt longer than the context or prompt + max_tokens past it (checked before the request reaches the
engine, so it fails alone); 401 for a missing or wrong API key; 404 for an unknown model; 503 with Retry-After when
the engine's queue is full, it is still warming up, or it has stopped. A client that disconnects cancels its
request, which frees its slot at the engine's next step.

A chat request's `tools` (serve/tool_calls.py) are rendered through the chat template; `tool_choice` "required" or
a named function constrains the output to calls by the grammar engine, "auto" parses the model's text with the
server's parser; either way the answer's calls come back as `tool_calls` (streamed: `delta.tool_calls`).

`create_app` only builds the app: its middleware, error handlers and routes. The routes are module functions that
share one `Completions` (on app.state): it submits a request's candidates to the engine and answers them as one
JSON response or, streamed, through an `EventStream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from clover import __version__
from clover.errors import CloverError
from clover.runtime.engine import Engine, EngineStream
from clover.runtime.grammar import Grammar
from clover.runtime.logprobs import TokenLogprob
from clover.runtime.params import GenerationParams
from clover.runtime.requests import encode_prompt
from clover.runtime.results import GenerationResult, StreamDelta
from clover.runtime.sampling import SamplingParams
from clover.runtime.scheduler import Cancelled, EngineUnavailable, QueueFull
from clover.runtime.tokenizer import Tokenizer
from clover.serve.limits import TENANT, Cors, RequestGuard, RequestLimits
from clover.serve.metrics import Metrics
from clover.serve.responses import Store, create_response, get_response
from clover.serve.schemas import (
    INVALID_UNICODE,
    REFUSED,
    RESPONSE_FORMATS,
    UNKNOWN_FIELD,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DraftCounts,
    PromptTokensDetails,
    Speculation,
    TokenizeRequest,
    Usage,
    error_body,
    new_id,
    now,
    unicode_fault,
)
from clover.serve.tool_calls import CallUpdate, ToolOptions, ToolPlan, ToolStream, parse, plan_tools

RETRY_AFTER_S = 1
# fields holding token ids: an error in one entry names the field, with what it must hold
TOKEN_MAPS = {
    "logit_bias": "logit_bias maps token ids (decimal strings) to biases from -100 to 100",
    "stop_token_ids": "stop_token_ids is a list of token ids (ints >= 0)",
}
WARMUP_PROMPT = "Hello"
CompletionBody = ChatCompletionRequest | CompletionRequest  # the bodies of the two POST routes


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


def request_param(engine_param: str | None, body: Any) -> str | None:
    """The request field behind an engine argument that a CloverError names (its `param`)."""
    if engine_param == "prompt":
        return "messages" if hasattr(body, "messages") else "prompt"
    if engine_param == "max_new_tokens":
        return "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
    if engine_param == "logprobs" and hasattr(body, "top_logprobs"):
        return "top_logprobs"
    if engine_param == "prompt_logprobs":  # asked for by echo with logprobs
        return "logprobs"
    if engine_param == "template_kwargs":
        return "chat_template_kwargs"
    return engine_param  # temperature, top_p, stop, the penalties, logit_bias, min_tokens, ...: the same names


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if loc[:1] == ["response_format"] and len(loc) > 1 and loc[1] in RESPONSE_FORMATS:
        del loc[1]  # the union's tag (the format's type), not a field
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({err.get('msg', '')}): send a JSON object", None
    if err.get("type") == INVALID_UNICODE:  # the field however deep, found by walking the body (schemas.py)
        return f"{err['ctx']['field']}: {err['msg']}", err["ctx"]["field"]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = UNKNOWN_FIELD
    elif loc and loc[0] in REFUSED:  # a field whose type admits only its no-op value
        param, msg = loc[0], REFUSED[loc[0]]
    elif loc and loc[0] in TOKEN_MAPS:  # an entry of a map or list of token ids: the field is the param
        param, msg = loc[0], f"{TOKEN_MAPS[loc[0]]} ({'.'.join(loc[1:])}: {msg})"
    return (f"{param}: {msg}" if param else f"the request body is invalid: {msg}"), param


@dataclass(frozen=True)
class AppOptions:
    """How create_app serves its engine. api_key: /v1 routes and /tokenize, /detokenize, /tokenizer_info (and /metrics with
    `metrics_need_key`) need `Authorization: Bearer KEY`. warmup: /health turns 200 after one short request has run
    (False: at once). limits: what one request may ask. docs: serve /docs, /redoc and /openapi.json. tools: how tool
    calls are served (`tool_choice` "auto" needs a parser). cors: cross-origin requests (None: no CORS headers, a
    browser on another origin is refused)."""

    api_key: str | tuple[str, ...] | None = field(default=None, repr=False)
    warmup: bool = True
    limits: RequestLimits = RequestLimits()
    docs: bool = True
    metrics_need_key: bool = False
    tools: ToolOptions = ToolOptions()
    cors: Cors | None = Cors()


def create_app(
    engine: Engine, model: str, options: AppOptions = AppOptions(), metrics: Metrics | None = None
) -> FastAPI:
    """The app serving `engine` as model `model`, as `options` say. metrics: the engine's Metrics (default: new ones;
    a Ray Serve replica passes its own, labelled)."""
    o = options
    served = Completions(engine, model, o.limits, metrics or Metrics(engine, model=model), o.warmup, o.tools)
    hidden = {} if o.docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="clover-serve", lifespan=_lifespan, **hidden)
    app.state.completions = served  # what the routes share
    # the API key, the body's size and the requests in flight are checked before the body is read
    app.add_middleware(
        RequestGuard,
        api_key=o.api_key,
        max_body_bytes=o.limits.max_body_bytes,
        max_concurrent=o.limits.max_concurrent_requests,
        metrics_need_key=o.metrics_need_key,
        retry_after_s=RETRY_AFTER_S,
    )
    if o.cors is not None:  # added last, so outermost: a preflight is answered before the key is asked for
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(o.cors.origins),
            allow_methods=list(o.cors.methods),
            allow_headers=list(o.cors.headers),
            allow_credentials=o.cors.credentials,
            expose_headers=["X-Request-Id"],
        )
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.get("/health")(health)
    app.head("/health", include_in_schema=False)(health)  # what some load balancers probe with
    app.get("/ping", operation_id="ping")(health)  # vLLM's (SageMaker's) name for the same probe
    app.get("/version")(version)
    app.get("/metrics")(metrics_text)
    app.get("/v1/models")(models)
    app.get("/v1/models/{model_id:path}")(model_card)
    app.post("/tokenize")(tokenize)
    app.post("/detokenize")(detokenize)
    app.get("/tokenizer_info")(tokenizer_info)
    app.post("/v1/chat/completions")(chat_completions)
    app.post("/v1/completions")(completions)
    app.state.responses = Store()
    app.post("/v1/responses")(create_response)
    app.get("/v1/responses/{response_id}")(get_response)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    served: Completions = app.state.completions
    app.state.ready = not served.warmup
    task = asyncio.create_task(_warm(app, served.engine)) if served.warmup else None
    yield
    if task is not None:
        task.cancel()


async def _warm(app: FastAPI, engine: Engine) -> None:
    """One short request, then /health says ok."""
    while True:  # a warm-up that failed (in a step with a failing request) is tried again
        try:
            await engine.agenerate(WARMUP_PROMPT, GenerationParams(max_new_tokens=2))
        except EngineUnavailable:
            return
        except CloverError:
            await asyncio.sleep(RETRY_AFTER_S)
            continue
        app.state.ready = True
        return


# -- exception handlers: every error in OpenAI's shape --------------------------------------------------------------
async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    return _error_response(e)


async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(e)
    return _error_response(ApiError(400, message, param=param))


async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
    if isinstance(e.__cause__, UnicodeDecodeError):  # FastAPI could not read the body
        return _error_response(await _not_utf8(request, e.__cause__))
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return _error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind))


async def _not_utf8(request: Request, e: UnicodeDecodeError) -> ApiError:
    """400 for a body that is not UTF-8, naming the field that holds the bad bytes where the rest is JSON."""
    try:  # each bad byte read as a lone surrogate, which unicode_fault finds
        body = json.loads((await request.body()).decode("utf-8", "surrogateescape"))
    except (ValueError, RuntimeError):  # not JSON either; or the body is gone
        body = None
    fault = unicode_fault(body) if isinstance(body, dict) else None
    field = fault[0] if fault else None
    what = f"the request body is not valid UTF-8 (byte 0x{e.object[e.start]:02X} at offset {e.start}): send UTF-8"
    return ApiError(400, f"{field}: {what}" if field else what, param=field)


# -- routes ---------------------------------------------------------------------------------------------------------
def _served(request: Request) -> Completions:
    return request.app.state.completions


async def health(request: Request) -> Response:
    # the engine's real state: a request that failed its step says nothing about the next ones
    status = "dead" if not _served(request).engine.alive else "ok" if request.app.state.ready else "warming up"
    return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)


async def metrics_text(request: Request) -> Response:
    return Response(generate_latest(_served(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def version(request: Request) -> dict[str, str]:
    return {"version": __version__}


def _model_object(served: Completions) -> dict[str, Any]:
    return {
        "id": served.model,
        "object": "model",
        "created": 0,
        "owned_by": "clover-deploy",
        "max_model_len": served.context,
    }


async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_object(_served(request))]}


async def model_card(model_id: str, request: Request) -> dict[str, Any]:
    served = _served(request)
    served.check_model(model_id)
    return _model_object(served)


async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    served = _served(request)
    if body.model is not None:
        served.check_model(body.model)
    tokenizer = served.engine.tokenizer
    try:
        if body.messages is not None:
            for i, m in enumerate(body.messages):
                if (fault := m.fault()) is not None:
                    raise ApiError(400, f"messages.{i}: {fault}", param=f"messages.{i}")
            messages = [m.for_template() for m in body.messages]
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            ids = await run_in_threadpool(tokenizer.encode_chat, messages, body.add_generation_prompt, tools)
        else:
            ids = await run_in_threadpool(tokenizer.encode, body.prompt, body.add_special_tokens)
    except CloverError as e:
        raise ApiError(400, str(e), param="messages" if body.messages is not None else "prompt") from None
    out: dict[str, Any] = {"count": len(ids), "max_model_len": served.context, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [tokenizer.id_to_token(t) for t in ids]
    return out


async def tokenizer_info(request: Request) -> dict[str, Any]:
    """GET /tokenizer_info, as vLLM's: the special tokens, the chat template and the context (what lm-eval's remote
    tokenizer reads, beside /tokenize and /detokenize)."""
    served = _served(request)
    tokenizer = served.engine.tokenizer
    special = tokenizer.special_tokens
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{k: special.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")},
        "chat_template": tokenizer.chat_template,
        "model_max_length": served.context,
        "vocab_size": tokenizer.vocab_size,
    }


async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    served = _served(request)
    if body.model is not None:
        served.check_model(body.model)
    vocab = served.engine.tokenizer.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if t >= vocab), None)
    if bad is not None:
        raise ApiError(
            400, f"tokens.{bad}: token id {body.tokens[bad]} is not in the vocabulary (0-{vocab - 1})", param="tokens"
        )
    return {"prompt": await run_in_threadpool(served.engine.tokenizer.decode, body.tokens, False)}


async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    served = _served(request)
    served.check_chat(body)
    served.check_prompt(body, len(body.messages), 0)  # before the messages are even copied
    try:
        body.check_messages()
    except CloverError as e:
        raise ApiError(400, str(e), param=e.param) from None
    messages = [m.for_template() for m in body.messages]
    tools = sum(len(json.dumps(t.model_dump(exclude_none=True))) for t in body.tools or ())
    served.check_prompt(body, len(messages), sum(m.chars() for m in body.messages) + tools)
    return await served.complete(request, body, [messages], chat=True)


async def completions(body: CompletionRequest, request: Request) -> Response:
    served = _served(request)
    prompts = body.prompt_inputs()
    served.check_prompt(body, None, max(len(p) if isinstance(p, str) else 0 for p in prompts))
    return await served.complete(request, body, prompts, chat=False)


# -- the work -------------------------------------------------------------------------------------------------------
def _busy(message: str) -> ApiError:
    """503 with Retry-After: the request was fine, the server could not take it now."""
    return ApiError(503, message, "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


class Completions:
    """What the routes share (app.state.completions): the engine serving `model`, the request limits, the metrics;
    and a completion request's work: its candidates submitted to the engine, then answered whole or streamed."""

    def __init__(
        self,
        engine: Engine,
        model: str,
        limits: RequestLimits,
        metrics: Metrics,
        warmup: bool,
        tools: ToolOptions = ToolOptions(),
    ) -> None:
        self.engine, self.model, self.limits, self.metrics, self.warmup = engine, model, limits, metrics, warmup
        self.tools = tools
        self.context = engine.runner.info.max_context

    def check_chat(self, body: ChatCompletionRequest) -> None:
        """400 for a chat request to a model without a chat template (a base model): it has no way to render
        messages, and the message says what does."""
        if not self.engine.tokenizer.has_chat_template and body.model == self.model:
            raise ApiError(
                400,
                f"model {self.model!r} has no chat template (a base model continues text; an instruct model ships a "
                "template), so it cannot render messages: send the text as a prompt to /v1/completions, or start "
                "clover-serve with --chat-template FILE_OR_TEMPLATE (or export the artifact with clover-export "
                "--chat-template)",
                param="messages",
                code="no_chat_template",
            )

    def check_prompt(self, body: CompletionBody, messages: int | None, chars: int) -> None:
        """400 for a prompt over the server's limits, before it is templated or tokenized."""
        try:
            self.limits.check_prompt(messages, chars)
        except CloverError as e:
            raise ApiError(400, str(e), param=request_param(e.param, body)) from None

    async def complete(self, request: Request, body: CompletionBody, prompts: list[Any], chat: bool) -> Response:
        """The answer to a completion request (`prompts`: a chat's messages, or a completion's prompts): a JSON
        response, or its server-sent events with `stream`."""
        # templating and tokenizing run in a worker thread: a huge prompt must not stall /health and every stream
        rid = new_id("chatcmpl" if chat else "cmpl")  # also names the request in the engine's log
        outs, plan = await run_in_threadpool(self.submit, request, body, prompts, rid)
        if body.stream:
            echo = [self.echo_text(body, p) for p in prompts for _ in range(body.choices()[1])]
            return StreamingResponse(
                EventStream(self, outs, rid, body, chat, plan, echo=echo).events(),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": rid},
            )
        results = await self.wait(request, outs, rid)
        if results is None:
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        return self._answer(body, prompts, rid, chat, results, plan)

    def echo_text(self, body: CompletionBody, prompt: Any) -> str | None:
        """What `echo` puts before the answer: a completion's prompt text (as sent, or its ids decoded); a chat's
        final message's content where the assistant sent it (vLLM's), else nothing."""
        if isinstance(body, ChatCompletionRequest):
            final = body.messages[-1]
            return final.content if body.echo and final.role == "assistant" and isinstance(final.content, str) else None
        if not body.echoes_prompt():
            return None
        return prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)

    def submit(
        self, request: Request, body: CompletionBody, prompts: list[Any], rid: str
    ) -> tuple[list[EngineStream], ToolPlan | None]:
        """The request's candidates, submitted prompt after prompt (one for one prompt and n = 1): each a sequence
        of the engine's batch, a seeded request's candidate i of each prompt seeded seed + i; and a chat request's
        tool plan."""
        self._check_served(request, body)
        grammar_field = None
        outs: list[EngineStream] = []
        try:
            self.limits.check(body.stop_strings(), body.ignore_eos)
            grammar, grammar_field = body.grammar() or (None, None)
            plan = self._tool_plan(body) if isinstance(body, ChatCompletionRequest) else None
            if plan is not None and plan.grammar is not None:  # a constrained call
                if grammar is not None:
                    raise CloverError(
                        f"{grammar_field} cannot be combined with tool_choice {plan.mode!r} (the call's grammar "
                        "constrains the output): leave one of them out",
                        param=grammar_field,
                    )
                grammar, grammar_field = plan.grammar, plan.field
            n, candidates = body.choices()
            self._check_sequences(len(prompts) * candidates)
            sampling = _sampling(body, bad_word_ids(self.engine.tokenizer, body.bad_words or ()))
            tenant = request.scope.get(TENANT)  # whose served answers and cached prefixes it shares (several keys)
            for prompt in prompts:
                ids = self.prompt_ids(body, prompt, plan)
                # no max_tokens: up to the end of the context (or the server's cap); more than the context leaves:
                # 400. max_tokens 0 (the prompt alone): its prefill's token is generated and left out of the answer.
                asked = body.token_limit()
                new = self.limits.new_tokens(len(ids), 1 if asked == 0 else asked, self.context)
                first = len(outs)
                for i in range(candidates):
                    outs.append(
                        self.engine.stream(
                            ids,
                            _candidate(body, i, candidates > n, new, sampling, grammar, tenant),
                            request_id=rid if len(prompts) * candidates == 1 else f"{rid}-{first + i}",
                            share_prefill=outs[first] if i else None,  # one prefill for a prompt's candidates
                        )
                    )
            for option in body.options_used():
                self.metrics.options.labels(option).inc()
            self.metrics.params_n.observe(n)
            self.metrics.params_max_tokens.observe(new if new is not None else self.context)
            return outs, plan
        except BaseException as e:
            for out in outs:  # a request is all of its candidates or none of them
                out.cancel()
            if isinstance(e, CloverError):
                raise _refusal(e, body, grammar_field) from None
            raise

    def prompt_ids(self, body: CompletionBody, prompt: Any, plan: ToolPlan | None) -> list[int]:
        """A prompt's token ids: a chat's messages through the template (its tools, vLLM's template controls); a
        completion's text or ids; the last truncate_prompt_tokens of them where the request asks."""
        if isinstance(body, ChatCompletionRequest):
            ids = self.engine.tokenizer.encode_chat(
                prompt,
                body.add_generation_prompt,
                tools=plan.prompt_tools if plan is not None and plan.prompt_tools else None,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
            )
        else:
            ids = encode_prompt(self.engine.tokenizer, prompt)
        keep = body.truncate_prompt_tokens
        return ids[-keep:] if keep is not None else ids

    def _tool_plan(self, body: ChatCompletionRequest) -> ToolPlan:
        """What the request's tools make of it; each function a constrained call may call compiled first, so that
        a schema that cannot compile is named (CloverError, a 400)."""
        mode, name = body.tool_mode()
        tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
        plan = plan_tools(tools, mode, name, body.parallel_tool_calls, self.tools)
        for where, grammar in plan.checks:
            try:
                self.engine.grammars.state(grammar)
            except CloverError as e:
                raise CloverError(f"{where}: {e}", param=where) from None
        return plan

    def check_model(self, model: str) -> None:
        """404 for a model this server does not serve."""
        if model != self.model:
            raise ApiError(
                404,
                f"model {model!r} does not exist: this server serves {self.model!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def _check_sequences(self, sequences: int) -> None:
        """400 for a request of more sequences (prompts times candidates) than the engine ever queues at once."""
        room = self.engine.scheduler.max_waiting
        if sequences > room:
            raise CloverError(
                f"this request makes {sequences} sequences (prompts times best_of or n): this server queues at most "
                f"{room} at once; send fewer prompts per request",
                param="prompt",
            )

    def _check_served(self, request: Request, body: CompletionBody) -> None:
        self.check_model(body.model)
        if not request.app.state.ready:
            raise _busy("the server is warming up: retry in a moment")

    async def wait(self, request: Request, outs: list[EngineStream], rid: str) -> list[GenerationResult] | None:
        """The candidates' results once they have all ended; None when the client went away first."""
        try:
            for out in outs:  # they decode together in the engine's batch; their ends are awaited in turn
                async for _ in out:
                    if await request.is_disconnected():
                        for o in outs:
                            o.cancel()
                        self.metrics.requests.labels("abort").inc()
                        return None
        except Cancelled:
            return None
        except EngineUnavailable as e:  # the engine's loop stopped under this request
            raise _busy(str(e)) from None
        except CloverError as e:  # the engine failed this request's step (the server log has it, by this id)
            for o in outs:
                o.cancel()
            raise ApiError(500, str(e), "server_error", headers={"X-Request-Id": rid}) from None
        results = [out.result for out in outs]
        for result in results:
            self.metrics.finished(result, finish_reason(result))
        return results

    def _answer(
        self,
        body: CompletionBody,
        prompts: list[Any],
        rid: str,
        chat: bool,
        results: list[GenerationResult],
        plan: ToolPlan | None = None,
    ) -> JSONResponse:
        """The JSON response: each prompt's n best candidates (all of them without best_of), numbered prompt after
        prompt; usage and speculation stats."""
        n, candidates = body.choices()
        alone = not chat and body.token_limit() == 0  # max_tokens 0: the prompt alone
        choices, prompt_ids = [], None
        for p, prompt in enumerate(prompts):
            group = results[p * candidates : (p + 1) * candidates]
            if chat:
                text = self.echo_text(body, prompt)
                echo = None if not text else (text, {})
            else:
                as_ids = body.return_tokens_as_token_ids
                k = body.logprobs_wanted()
                echo = echoed(self.engine.tokenizer, prompt, group[0], k, as_ids) if body.echoes_prompt() else None
            if body.return_token_ids:  # vLLM's: the prompt's ids per choice (a chat's once, beside the choices)
                prompt_ids = self.prompt_ids(body, prompt, plan)
            scored = None
            if body.prompt_logprobs is not None:  # vLLM's: per choice (a chat's once, beside the choices)
                scored = vllm_prompt_logprobs(self.engine.tokenizer, group[0], body.prompt_logprobs)
            for result in best(group, n):
                choice = self._choice(len(choices), result, body, echo, plan, alone)
                if body.return_token_ids:
                    choice["token_ids"] = [] if alone else list(result.token_ids)
                    if not chat:
                        choice["prompt_token_ids"] = prompt_ids
                if scored is not None and not chat:
                    choice["prompt_logprobs"] = scored
                choices.append(choice)
        answer = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": self.model,
            "choices": choices,
            "usage": usage(results, candidates, generated=not alone).model_dump(),
            "clover": speculation(results).model_dump(),
        }
        if chat and body.return_token_ids:
            answer["prompt_token_ids"] = prompt_ids
        if chat and scored is not None:
            answer["prompt_logprobs"] = scored
        return JSONResponse(answer, headers={"X-Request-Id": rid})

    def _choice(
        self,
        index: int,
        result: GenerationResult,
        body: CompletionBody,
        echo: tuple[str, dict] | None,
        plan: ToolPlan | None = None,
        alone: bool = False,
    ) -> dict[str, Any]:
        """Choice `index` of `result`; alone (max_tokens 0): its echo alone, the generated token left out."""
        chat, wanted = isinstance(body, ChatCompletionRequest), body.logprobs_wanted()
        reason = finish_reason(result)
        if alone:
            result = dataclasses.replace(result, text="", logprobs=[])
            reason = "length"
        tokenizer, as_ids = self.engine.tokenizer, body.return_tokens_as_token_ids
        logprobs = None if wanted is None else render_logprobs(tokenizer, result.logprobs, chat, as_ids)
        if echo is not None:  # the prompt's text (and a completion's its tokens) before the answer's
            text, before = echo
            result = dataclasses.replace(result, text=text + result.text)
            if logprobs is not None and before:
                logprobs = {k: before[k] + logprobs[k] for k in before}
                logprobs["text_offset"][len(before["tokens"]) :] = [
                    o + len(text) for o in logprobs["text_offset"][len(before["tokens"]) :]
                ]
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": result.text}
            if plan is not None and plan.split is not None:  # the text outside calls, and the calls
                message["content"], calls = parse(plan.split, result.text, plan.parallel)
                if calls:
                    message["tool_calls"] = [c.to_openai() for c in calls]
                    reason = tool_reason(reason, plan)
            return {"index": index, "message": message, "finish_reason": reason, "logprobs": logprobs}
        return {"index": index, "text": result.text, "finish_reason": reason, "logprobs": logprobs}


def bad_word_ids(tokenizer: Tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word's tokens, and its tokens after a space where they differ (a
    word inside a sentence is usually the second)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def _sampling(body: CompletionBody, bad_words: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
    return SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        top_k=body.top_k,
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=body.logit_bias_ids(),
        min_tokens=body.min_tokens,
        allowed_token_ids=tuple(body.allowed_token_ids or ()),
        bad_words=bad_words,
    )


def _candidate(
    body: CompletionBody,
    i: int,
    ranked: bool,
    new: int | None,
    sampling: SamplingParams,
    grammar: Grammar | None,
    tenant: str | None = None,
) -> GenerationParams:
    """Candidate i's options (ranked: best_of returns the best of more candidates than n), seeded seed + i. A
    CloverError names the engine's field (request_param maps it to the request's)."""
    wanted = body.logprobs_wanted()
    seed = None if body.seed is None else (body.seed + i) % 2**63
    return GenerationParams(
        max_new_tokens=new,
        sampling=dataclasses.replace(sampling, seed=seed),
        stop=body.stop_strings(),
        ignore_eos=body.ignore_eos,
        include_stop_str=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        stop_token_ids=body.stop_token_ids or (),
        # best_of ranks candidates by their tokens' log-probabilities
        logprobs=wanted if wanted is not None or not ranked else 0,
        grammar=grammar,
        # echo and prompt_logprobs: the prompt's log-probabilities, once (the candidates share the prompt)
        prompt_logprobs=prompt_alternatives(body) if i == 0 else None,
        cache_salt=body.cache_salt,
        scope=tenant,
    )


def prompt_alternatives(body: CompletionBody) -> int | None:
    """Alternatives per prompt token the request needs: echo's (with logprobs) and prompt_logprobs', the more."""
    asked = [
        k for k in (body.logprobs_wanted() if body.echoes_prompt() else None, body.prompt_logprobs) if k is not None
    ]
    return max(asked) if asked else None


def vllm_prompt_logprobs(tokenizer: Tokenizer, result: GenerationResult, k: int) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: None for the first token, then per prompt token its own entry and the k most likely,
    each `{"logprob", "rank", "decoded_token"}` by token id."""
    out: list[dict[str, Any] | None] = [None]
    for e in result.prompt_logprobs or ():
        entry = {
            str(t): {"logprob": max(v, -9999.0), "rank": r, "decoded_token": tokenizer.token_text(t)}
            for r, (t, v) in enumerate(e.top[:k], 1)
        }
        entry[str(e.token_id)] = {
            "logprob": max(e.logprob, -9999.0),
            "rank": e.rank,
            "decoded_token": tokenizer.token_text(e.token_id),
        }
        out.append(entry)
    return out


def _refusal(e: CloverError, body: CompletionBody, grammar_field: str | None) -> ApiError:
    """A request the engine did not take: 503 when it is full or stopped, else 400 naming the request's field."""
    if isinstance(e, QueueFull):
        return _busy(f"the server is busy ({e}): retry later")
    if isinstance(e, EngineUnavailable):
        return _busy(f"the server cannot take requests: {e}")
    if e.param == "grammar":
        return ApiError(400, f"{grammar_field}: {e}", param=grammar_field)
    return ApiError(400, str(e), param=request_param(e.param, body))


class EventStream:
    """A request's candidates as server-sent events: a chunk for each delta of each choice as it comes, one for each
    choice's end (its finish reason and speculation stats), the usage when asked, then `data: [DONE]`."""

    def __init__(
        self,
        served: Completions,
        outs: list[EngineStream],
        rid: str,
        body: CompletionBody,
        chat: bool,
        plan: ToolPlan | None = None,
        echo: list[str | None] | None = None,
    ) -> None:
        self.served, self.outs, self.rid, self.body, self.chat = served, outs, rid, body, chat
        self.echo = echo or [None] * len(outs)  # each choice's prompt text, streamed first (a completion's echo)
        # each choice's text parsed into content and tool calls as it comes (None: the text is the content)
        self.plan = plan
        self.tools: list[ToolStream | None] = [plan.stream() if plan else None for _ in outs]
        self.created, self.kind = now(), "chat.completion.chunk" if chat else "text_completion"
        self.wants_logprobs = body.logprobs_wanted() is not None
        # each choice's deltas as they come, through one queue (None: that choice ended)
        self.queue: asyncio.Queue[tuple[int, StreamDelta | BaseException | None]] = asyncio.Queue()
        options = body.stream_options
        self.continuous = bool(options and options.continuous_usage_stats)  # vLLM's: usage in every chunk
        self.generated = [0] * len(outs)  # each choice's tokens so far

    async def events(self) -> AsyncIterator[str]:
        outs = self.outs
        pumps = [asyncio.ensure_future(self.pump(i, out)) for i, out in enumerate(outs)]
        try:
            if self.chat:
                for i in range(len(outs)):
                    yield self.chunk(i, {"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            for i, text in enumerate(self.echo):  # what echo puts first
                if text:
                    yield self.chunk(i, self.piece(text))
            running = len(outs)
            while running:
                index, item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, StreamDelta):
                    self.generated[index] += len(item.token_ids)
                if item is None:
                    running -= 1
                    result = outs[index].result
                    reason = finish_reason(result)
                    self.served.metrics.finished(result, reason)
                    if (tools := self.tools[index]) is not None:  # what the end settles: content, calls
                        for event in self.tool_events(index, *tools.finish()):
                            yield event
                        reason = tool_reason(reason, self.plan) if tools.calls else reason
                    yield self.chunk(index, self.piece("", reason), clover=speculation([result]).model_dump())
                elif (tools := self.tools[index]) is not None:
                    content, updates = tools.feed(item.text)
                    if content or item.logprobs:
                        yield self.chunk(index, self.piece(content), item.logprobs)
                    for event in self.tool_events(index, "", updates):
                        yield event
                # a token's log-probability comes with the text that shows it (held-back text holds it back too)
                elif item.text or item.logprobs or (self.body.return_token_ids and item.token_ids):
                    piece = self.piece(item.text)
                    if self.body.return_token_ids:  # vLLM's: each delta's token ids
                        piece["token_ids"] = list(item.token_ids)
                    yield self.chunk(index, piece, item.logprobs)
            if self.body.include_usage:
                results = [out.result for out in outs]
                yield self.chunk(None, None, usage=usage(results, self.body.choices()[1]).model_dump())
        except Cancelled:
            return
        except CloverError as e:  # the engine failed this request's step: say so in the stream
            yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
        finally:
            for out, p in zip(outs, pumps):
                p.cancel()
                if out.result is None:  # a client that went away (the response task is cancelled): free its slot
                    out.cancel()
                    self.served.metrics.requests.labels("abort").inc()
        yield "data: [DONE]\n\n"

    def tool_events(self, index: int, content: str, updates: list[CallUpdate]) -> list[str]:
        """Choice `index`'s settled content, then each call update (`delta.tool_calls`, as OpenAI's: a call's id,
        type and name with the start of its arguments first, then their next pieces), one chunk each."""
        events = [self.chunk(index, self.piece(content))] if content else []
        for update in updates:
            delta = {"tool_calls": [update.to_openai()]}
            events.append(self.chunk(index, {"delta": delta, "finish_reason": None}))
        return events

    async def pump(self, index: int, out: EngineStream) -> None:
        """Choice `index`'s deltas into the queue, then None (its end) or the exception that ended it."""
        try:
            async for delta in out:
                self.queue.put_nowait((index, delta))
            self.queue.put_nowait((index, None))
        except Exception as e:  # handed to the response, which says it in the stream
            self.queue.put_nowait((index, e))

    def chunk(
        self, index: int | None, choice: dict[str, Any] | None, logprobs: tuple[TokenLogprob, ...] = (), **extra: Any
    ) -> str:
        """One event: `choice` (None: no choice, e.g. the usage chunk) with its tokens' log-probabilities if asked."""
        wanted = self.wants_logprobs and logprobs
        tokenizer, as_ids = self.served.engine.tokenizer, self.body.return_tokens_as_token_ids
        rendered = render_logprobs(tokenizer, logprobs, self.chat, as_ids) if wanted else None
        doc = {
            "id": self.rid,
            "object": self.kind,
            "created": self.created,
            "model": self.served.model,
            "choices": [] if choice is None else [{"index": index, "logprobs": rendered, **choice}],
            **extra,
        }
        if self.continuous and choice is not None:  # the usage so far: each prompt once, every choice's tokens
            per = self.body.choices()[1]
            prompt = sum(out.prompt_tokens for out in self.outs[::per])
            done = sum(self.generated)
            doc["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
            cached = sum(out.cached_tokens for out in self.outs[::per])
            doc["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        return f"data: {json.dumps(doc)}\n\n"

    def piece(self, text: str, reason: str | None = None) -> dict[str, Any]:
        """A choice's delta: chat's `delta` (no content in the end chunk), or the completions API's `text`."""
        if self.chat:
            return {"delta": {"content": text} if text or reason is None else {}, "finish_reason": reason}
        return {"text": text, "finish_reason": reason}


def render_logprobs(tokenizer: Tokenizer, entries, chat: bool, as_ids: bool = False) -> dict[str, Any]:
    """Log-probabilities in OpenAI's shape: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`, or the
    completions API's legacy `{tokens, token_logprobs, top_logprobs, text_offset}` (its top_logprobs maps token text
    to log-probability and holds the chosen token too, as OpenAI's does). as_ids: tokens named `token_id:ID`
    (vLLM's return_tokens_as_token_ids) instead of by their text."""

    def lp(x: float) -> float:
        return max(x, -9999.0)  # no -inf in JSON (vLLM's floor)

    def name(t: int) -> str:
        return f"token_id:{t}" if as_ids else tokenizer.token_text(t)

    if chat:
        return {
            "content": [
                {
                    "token": name(e.token_id),
                    "logprob": lp(e.logprob),
                    "bytes": list(tokenizer.token_bytes(e.token_id)),
                    "top_logprobs": [
                        {"token": name(t), "logprob": lp(v), "bytes": list(tokenizer.token_bytes(t))} for t, v in e.top
                    ],
                }
                for e in entries
            ],
            "refusal": None,
        }
    return {
        "tokens": [name(e.token_id) for e in entries],
        "token_logprobs": [lp(e.logprob) for e in entries],
        "top_logprobs": [{name(t): lp(v) for t, v in (*e.top, (e.token_id, e.logprob))} for e in entries],
        "text_offset": [e.text_offset for e in entries],
    }


def echoed(
    tokenizer: Tokenizer, prompt: str | list[int], first: GenerationResult, k: int | None, as_ids: bool = False
) -> tuple[str, dict[str, list]]:
    """A completions prompt echoed: its text (as sent, or its ids decoded) and its legacy log-probabilities with k
    alternatives (the first token has none, as OpenAI's), from the candidate that computed them (none where k is
    None)."""
    text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
    if first.prompt_logprobs is None or k is None:
        return text, {}
    entries = [dataclasses.replace(e, top=e.top[:k]) for e in first.prompt_logprobs]  # prompt_logprobs may ask more
    rendered = render_logprobs(tokenizer, entries, False, as_ids)
    ids = encode_prompt(tokenizer, prompt)  # as the request was submitted
    return text, {
        "tokens": [f"token_id:{ids[0]}" if as_ids else tokenizer.token_text(ids[0])] + rendered["tokens"],
        "token_logprobs": [None] + rendered["token_logprobs"],
        "top_logprobs": [None] + rendered["top_logprobs"],
        "text_offset": [0] + rendered["text_offset"],
    }


def finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def tool_reason(reason: str, plan: ToolPlan) -> str:
    """The finish reason of an answer with tool calls: tool_calls where it ended by itself (cut short: length), but
    stop for a named tool_choice, as OpenAI and vLLM answer it."""
    return "tool_calls" if reason == "stop" and plan.mode != "named" else reason


def best(results: list[GenerationResult], n: int) -> list[GenerationResult]:
    """The n results of highest mean log-probability per token (best_of), in their order; all when there are n."""
    if len(results) == n:
        return results
    score = [sum(e.logprob for e in r.logprobs) / max(len(r.logprobs), 1) for r in results]
    keep = sorted(sorted(range(len(results)), key=lambda i: -score[i])[:n])
    return [results[i] for i in keep]


def usage(results: list[GenerationResult], candidates: int, generated: bool = True) -> Usage:
    """Tokens of a request: each prompt once (its `candidates` results in a row), and every candidate's generated
    tokens (best_of's too; none when not `generated`, max_tokens 0)."""
    completion = sum(r.new_tokens for r in results) if generated else 0
    prompt = sum(r.prompt_tokens for r in results[::candidates])
    cached = PromptTokensDetails(cached_tokens=sum(r.cached_tokens for r in results[::candidates]))
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=cached,
    )


def speculation(results: list[GenerationResult]) -> Speculation:
    """What speculation did for a request's candidates together."""
    steps = sum(r.steps for r in results)
    emitted = sum(sum(r.accepted_per_step) for r in results)
    sources: dict[str, list[int]] = {}
    for r in results:
        for name, (drafted, accepted) in r.drafts_by_source.items():
            counts = sources.setdefault(name, [0, 0])
            counts[0] += drafted
            counts[1] += accepted
    return Speculation(
        acceptance_length=round(emitted / steps, 4) if steps else 0.0,
        steps=steps,
        drafted_tokens=sum(r.drafted_tokens for r in results),
        accepted_tokens=sum(r.accepted_tokens for r in results),
        tree=results[0].tree,
        sources={k: DraftCounts(drafted=d, accepted=a) for k, (d, a) in sources.items()},
    )
