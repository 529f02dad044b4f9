"""The OpenAI-compatible web app of `semkv serve` (FastAPI): /v1/completions, /v1/chat/completions (streamed over
server-sent events or not), /v1/models, /health, /metrics and /version.

It runs in the web process, which holds the model's text side only (`TextModel`: tokenizer, chat template, limits). A
handler checks the request (400 with an OpenAI error object naming the bad value), tokenizes it, and hands it to the
engine process (`EngineClient.submit`); it then waits for the tokens, or streams them as they come. A request past
`max_concurrent` in flight gets 429. A client that goes away cancels its request, which frees its pages. When the
engine process dies, open requests get an error and new ones 503, and /health says why.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

import semkv
from semkv.cli.args import parse_budget
from semkv.engine.sequence import TokenLogprob
from semkv.errors import SemkvError
from semkv.methods import get_method
from semkv.serve.client import EngineClient, EngineDead, Pending, RequestOutput
from semkv.serve.messages import Ended, MethodChoice
from semkv.serve.protocol import ChatRequest, CompletionRequest, Sampling, error_body
from semkv.serve.render import FINISH, Chat, Completion, Render, sse, usage
from semkv.text import Detokenizer, GenerationOutput, TextModel, cut_at_stop

OPENAI_NAMES = {"max_new_tokens": "max_tokens"}
LOG = logging.getLogger("uvicorn.error")  # uvicorn's own log: its format and its --log-level


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.kind, self.param, self.code), status_code=self.status)


@dataclass
class ServerConfig:
    model_name: str  # what /v1/models lists and requests name
    method: str = "full"  # the KV method of requests that name none, with its budget and parameters
    budget: int | float | None = None
    params: dict[str, Any] = field(default_factory=dict)
    max_concurrent: int = 64  # requests in flight (queued or running) before 429
    api_key: str | None = None  # when set, /v1 requests must send `Authorization: Bearer <api_key>`
    log_stats_s: float = 10.0  # log a line of throughput and queue this often (0: never)


def create_app(text: TextModel, client: EngineClient, config: ServerConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        receiving = asyncio.create_task(client.receive())
        logger = asyncio.create_task(log_stats()) if config.log_stats_s else None
        yield
        if logger is not None:
            logger.cancel()
        await client.drain()  # uvicorn has waited for the requests in flight; the engine then ends
        with suppress(asyncio.CancelledError):
            await receiving
        client.close()

    async def log_stats():
        while True:
            await asyncio.sleep(config.log_stats_s)
            line = client.metrics.summary(config.log_stats_s)
            if line is not None:
                LOG.info(line)

    app = FastAPI(title="semkv", version=semkv.__version__, lifespan=lifespan)

    app.add_middleware(RequestIdAndKey, api_key=config.api_key)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(SemkvError)
    async def bad_input(request: Request, exc: SemkvError):  # a check the handler left to the LLM (prompt text...)
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # unknown route or method, a body that is no JSON
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        if first["type"] == "extra_forbidden":
            message = f"unknown parameter {where!r}"
        elif first["type"] == "json_invalid" or not where:
            message = f"the body is not a valid request: {first['msg']}"
        else:
            message = f"{where}={first.get('input')!r}: {first['msg']}"
        return JSONResponse(error_body(message, param=where or None), status_code=400)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        if client.dead is not None:
            return JSONResponse({"status": "error", "reason": client.dead}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": semkv.__version__}

    @app.get("/metrics")
    async def metrics():
        client.metrics.in_flight.set(len(client.requests))
        return Response(client.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "semkv", "root": client.ready.source,
                                            "max_model_len": text.max_context}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) > 1:
                raise ApiError(400, f"{len(prompt)} prompts in one request; send one prompt per request", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ApiError(400, "the prompt is empty; give some text", "prompt")
            ids, _ = await asyncio.to_thread(text.encode, prompt, chat=False)  # a long prompt: not on the loop
        else:
            try:
                ids = text.token_ids(prompt, "prompt")
            except SemkvError as exc:
                raise ApiError(400, str(exc), "prompt") from None
        pending = start(body, ids, body.max_tokens, body.logprobs)
        render = Completion(text, config.model_name, body.logprobs is not None, request.state.id)
        return await answer(pending, body, render, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if not any(m.text().strip() for m in body.messages):
            raise ApiError(400, "every message is empty; give some text", "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        try:
            ids = await asyncio.to_thread(text.encode_chat, [{"role": m.role, "content": m.text()}
                                                             for m in body.messages])
        except SemkvError as exc:
            raise ApiError(400, str(exc), "messages") from None
        except Exception as exc:  # noqa: BLE001 - a chat template may reject a conversation (e.g. role order)
            raise ApiError(400, f"the chat template rejects these messages: {exc}", "messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        pending = start(body, ids, limit, (body.top_logprobs or 0) if body.logprobs else None)
        render = Chat(text, config.model_name, body.logprobs, request.state.id)
        return await answer(pending, body, render, request)

    def start(body: Sampling, ids: list[int], max_tokens: int | None, logprobs: int | None) -> Pending:
        """Check what is left of the request, then hand it to the engine process."""
        if body.model != config.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{config.model_name!r}", "model", code="model_not_found")
        problem = body.unsupported()
        if problem:
            raise ApiError(400, problem)
        if body.stream and logprobs is not None:
            raise ApiError(400, "logprobs are given with whole answers; ask without stream", "logprobs")
        if max_tokens is None:
            max_tokens = max(text.max_context - len(ids), 1)
        name, budget, params = choose(body)
        try:
            method = get_method(name, budget, **params)
        except SemkvError as exc:
            raise ApiError(400, str(exc), "kv_params" if body.kv_params else "kv_method") from None
        try:
            seed = body.seed if body.seed is not None else uuid.uuid4().int % 2**63
            sampling = text.sampling_params(max_tokens, body.temperature, body.top_k, body.top_p, seed, body.stops(),
                                            body.ignore_eos, logprobs, lambda n: OPENAI_NAMES.get(n, n))
            text.check_length("the prompt", len(ids), max_tokens, method=method,
                              hint="shorten it or ask for fewer max_tokens")
        except SemkvError as exc:
            raise ApiError(400, str(exc)) from None
        if len(client.requests) >= config.max_concurrent:
            client.metrics.ended(name, "rejected")
            raise ApiError(429, f"{len(client.requests)} requests are in flight, the most this server takes "
                           "(--max-concurrent-requests); retry later", kind="rate_limit_exceeded")
        try:
            return client.submit(ids, sampling, MethodChoice.of(name, budget, params))
        except EngineDead as exc:
            raise unavailable(str(exc)) from None

    def choose(body: Sampling) -> tuple[str, int | float | None, dict[str, Any]]:
        """The request's method, budget and parameters; the server's defaults fill what it leaves out of its
        method."""
        name = body.kv_method or config.method
        try:
            budget = parse_budget(body.kv_budget) if isinstance(body.kv_budget, str) else body.kv_budget
        except SemkvError as exc:
            raise ApiError(400, str(exc).replace("budget", "kv_budget", 1), "kv_budget") from None
        if name == config.method:
            return name, config.budget if budget is None else budget, {**config.params, **(body.kv_params or {})}
        return name, budget, dict(body.kv_params or {})

    async def answer(pending: Pending, body: Sampling, render: Render, request: Request):
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(pending, render, include_usage), media_type="text/event-stream")
        output = await collect(pending, request)
        if output is None:  # the client went away
            return Response(status_code=499)
        return render.whole(output)

    async def collect(pending: Pending, request: Request) -> GenerationOutput | None:
        answer = Answer(pending)
        while True:
            try:
                out = await asyncio.wait_for(pending.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    client.cancel(pending)
                    return None
                continue
            if answer.add(out):
                return answer.output(text)

    async def stream(pending: Pending, render: Render, include_usage: bool) -> AsyncIterator[str]:
        ended = False
        answer = Answer(pending)
        detokenizer = Detokenizer(text.tokenizer)
        sent = 0  # characters of the text sent
        stops = pending.params.stop
        holdback = max((len(s) for s in stops), default=1) - 1  # a stop string may be forming
        opening = render.opening  # sent with the first tokens, as vLLM does: clients time the first token by it
        try:
            while True:
                items = [await pending.queue.get()]
                while not pending.queue.empty():  # a client that reads slowly gets what piled up in one event
                    items.append(pending.queue.get_nowait())
                if opening is not None:
                    yield sse(opening())
                    opening = None
                try:
                    done = [answer.add(item) for item in items][-1]
                except ApiError as error:
                    ended = True
                    yield sse(error_body(error.message, error.kind, error.param, error.code))
                    yield "data: [DONE]\n\n"
                    return
                if not done:  # a chunk for each arrival of tokens, as vLLM streams (a client times tokens by their
                    # chunks), with the text they complete: none for a special token, half a character, or text that
                    # may begin a stop string
                    decoded = cut_at_stop(detokenizer.text_of(answer.ids), stops)
                    safe = max(len(decoded) - holdback, sent)
                    yield sse(render.chunk(decoded[sent:safe], None, None))
                    sent = safe
                    continue
                ended = True
                output = answer.output(text)
                yield sse(render.chunk(output.text[sent:], FINISH.get(output.finish_reason, "stop"), usage(output)))
                if include_usage:
                    yield sse(render.usage_chunk(usage(output)))
                yield "data: [DONE]\n\n"
                return
        finally:
            if not ended:  # the client went away: free the request now
                client.cancel(pending)

    return app


class RequestIdAndKey:
    """ASGI middleware (plain ASGI: a streamed answer passes through untouched): the request id, the client's
    X-Request-Id or a new one, goes to `request.state.id` and back in the X-Request-Id header; with an API key, /v1
    routes need `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
        scope.setdefault("state", {})["id"] = request_id
        if self.api_key is not None and scope["path"].startswith("/v1"):
            if not secrets.compare_digest(headers.get(b"authorization", b""), f"Bearer {self.api_key}".encode()):
                refused = JSONResponse(error_body("a valid API key is needed: send 'Authorization: Bearer <key>'",
                                                  "authentication_error", code="invalid_api_key"), status_code=401)
                return await refused(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_id)


class Answer:
    """A request's outputs as they come from the engine process."""

    def __init__(self, pending: Pending):
        self.pending = pending
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.ended: Ended | None = None

    def add(self, item: RequestOutput | Ended) -> bool:
        """Take one item of the request's queue; True when the request has ended. ApiError when it failed."""
        if isinstance(item, RequestOutput):
            self.ids += item.token_ids
            self.logprobs += item.logprobs
            return False
        if item.finish_reason == "error":
            if item.status == 503:
                raise unavailable(item.error)
            raise ApiError(item.status, item.error, kind="invalid_request_error" if item.status < 500 else
                           "server_error")
        self.ended = item
        return True

    def output(self, text: TextModel) -> GenerationOutput:
        params = self.pending.params
        return text.answer(self.pending.prompt_ids, self.ids, self.ended.finish_reason, self.ended.stats, params.stop,
                           self.logprobs if params.logprobs is not None else None)


def unavailable(reason: str) -> ApiError:
    return ApiError(503, reason, kind="server_error", code="engine_unavailable")
