"""The OpenAI-compatible web app of `semkv serve` (FastAPI): /v1/completions, /v1/chat/completions (streamed over
server-sent events or not), /v1/models, /health and /metrics.

A handler checks the request (400 with an OpenAI error object naming the bad value), tokenizes it, and hands it to the
engine thread (`Worker`); it then waits for the tokens, or streams them as they come. A request past
`max_concurrent` in flight gets 429. A client that goes away cancels its request, which frees its pages.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from semkv.cli.args import parse_budget
from semkv.engine.sequence import TokenLogprob
from semkv.errors import SemkvError
from semkv.llm import LLM, GenerationOutput, cut_at_stop
from semkv.methods import get_method
from semkv.serve.protocol import ChatRequest, CompletionRequest, Sampling, error_body
from semkv.serve.worker import Job, MethodChoice, Worker

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # semkv's finish reasons as the API names them
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}


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


def create_app(llm: LLM, worker: Worker, config: ServerConfig) -> FastAPI:
    state = {"in_flight": 0}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)  # the requests still running finish first

    app = FastAPI(title="semkv", lifespan=lifespan)

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
        if not worker.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        worker.metrics.in_flight.set(state["in_flight"])
        return Response(worker.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "semkv", "max_model_len": llm.max_context}]}

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
            ids, _ = llm.encode(prompt, chat=False)
        else:
            try:
                ids = llm.token_ids(prompt, "prompt")
            except SemkvError as exc:
                raise ApiError(400, str(exc), "prompt") from None
        job = start(body, ids, body.max_tokens, body.logprobs)
        render = Completion(llm, config.model_name, body.logprobs is not None)
        return await answer(job, body, render, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if not any(m.text().strip() for m in body.messages):
            raise ApiError(400, "every message is empty; give some text", "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        try:
            ids = llm.encode_chat([{"role": m.role, "content": m.text()} for m in body.messages])
        except SemkvError as exc:
            raise ApiError(400, str(exc), "messages") from None
        except Exception as exc:  # noqa: BLE001 - a chat template may reject a conversation (e.g. role order)
            raise ApiError(400, f"the chat template rejects these messages: {exc}", "messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        job = start(body, ids, limit, (body.top_logprobs or 0) if body.logprobs else None)
        render = Chat(llm, config.model_name, body.logprobs)
        return await answer(job, body, render, request)

    def start(body: Sampling, ids: list[int], max_tokens: int | None, logprobs: int | None) -> Job:
        """Check what is left of the request, then hand it to the engine thread."""
        if body.model != config.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{config.model_name!r}", "model", code="model_not_found")
        problem = body.unsupported()
        if problem:
            raise ApiError(400, problem)
        if body.stream and logprobs is not None:
            raise ApiError(400, "logprobs are given with whole answers; ask without stream", "logprobs")
        if max_tokens is None:
            max_tokens = max(llm.max_context - len(ids), 1)
        name, budget, params = choose(body)
        try:
            method = get_method(name, budget, **params)
        except SemkvError as exc:
            raise ApiError(400, str(exc), "kv_params" if body.kv_params else "kv_method") from None
        try:
            seed = body.seed if body.seed is not None else uuid.uuid4().int % 2**63
            sampling = llm.sampling_params(max_tokens, body.temperature, body.top_k, body.top_p, seed, body.stops(),
                                           body.ignore_eos, logprobs, lambda n: OPENAI_NAMES.get(n, n))
            llm.check_length("the prompt", len(ids), max_tokens, method=method,
                             hint="shorten it or ask for fewer max_tokens")
        except SemkvError as exc:
            raise ApiError(400, str(exc)) from None
        if state["in_flight"] >= config.max_concurrent:
            worker.metrics.ended(name, "rejected")
            raise ApiError(429, f"{state['in_flight']} requests are in flight, the most this server takes "
                           "(--max-concurrent-requests); retry later", kind="rate_limit_exceeded")
        state["in_flight"] += 1

        def ended():
            state["in_flight"] -= 1

        choice = MethodChoice(name, budget, tuple(sorted(params.items())))
        job = Job(ids, sampling, choice, method, asyncio.get_running_loop(), on_end=ended)
        worker.submit(job)
        return job

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

    async def answer(job: Job, body: Sampling, render: Render, request: Request):
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(job, render, include_usage), media_type="text/event-stream")
        output = await collect(job, request)
        if output is None:  # the client went away
            return Response(status_code=499)
        return render.whole(output)

    async def collect(job: Job, request: Request) -> GenerationOutput | None:
        while True:
            try:
                kind, data = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    worker.cancel(job)
                    return None
                continue
            if kind == "done":
                return data
            if kind == "error":
                raise failure(data)

    async def stream(job: Job, render: Render, include_usage: bool) -> AsyncIterator[str]:
        ended = False
        ids: list[int] = []
        sent = 0  # characters of the text sent
        holdback = max((len(s) for s in job.params.stop), default=1) - 1  # a stop string may be forming
        try:
            if render.opening is not None:
                yield sse(render.opening())
            while True:
                kind, data = await job.events.get()
                if kind == "tokens":
                    ids += data
                    text = llm.tokenizer.decode(ids, skip_special_tokens=True)
                    text = cut_at_stop(text, job.params.stop)
                    safe = len(text) - holdback
                    while safe > sent and text[safe - 1] == "\ufffd":  # a character still split across tokens
                        safe -= 1
                    if safe > sent:
                        yield sse(render.chunk(text[sent:safe], None, None))
                        sent = safe
                    continue
                ended = True
                if kind == "error":
                    error = failure(data)
                    yield sse(error_body(error.message, error.kind))
                else:
                    output: GenerationOutput = data
                    yield sse(render.chunk(output.text[sent:], FINISH.get(output.finish_reason, "stop"),
                                           usage(output)))
                    if include_usage:
                        yield sse(render.usage_chunk(usage(output)))
                yield "data: [DONE]\n\n"
                return
        finally:
            if not ended:  # the client went away: free the request now
                worker.cancel(job)

    return app


def failure(error: BaseException) -> ApiError:
    """What the client is told about a request that failed in the engine."""
    if isinstance(error, SemkvError):
        return ApiError(400, str(error))
    if isinstance(error, MemoryError):
        return ApiError(400, f"the request does not fit in this server's memory: {error}")
    return ApiError(500, f"internal error: {type(error).__name__}: {error}", kind="server_error")


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def usage(output: GenerationOutput) -> dict[str, int]:
    prompt, new = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}


class Render:
    """An answer in one endpoint's format: `whole` (not streamed) and `chunk` (one server-sent event)."""

    kind: str  # the object name of a chunk

    def __init__(self, llm: LLM, model: str, logprobs: bool):
        self.llm, self.model, self.logprobs = llm, model, logprobs
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    prefix = "cmpl"

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def token(self, token_id: int) -> str:
        return self.llm.tokenizer.decode([token_id])

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self.head(self.kind), "choices": [], "usage": counts}

    def whole(self, output: GenerationOutput) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, text: str, finish: str | None, counts: dict[str, int] | None) -> dict[str, Any]:
        raise NotImplementedError

    opening: Callable[[], dict[str, Any]] | None = None  # the first event of a stream, if the format has one


def stats(output: GenerationOutput) -> dict[str, Any]:
    """semkv's own numbers of a request, beside the OpenAI fields."""
    s = output.stats
    return {"prefill_s": s.prefill_s, "decode_s": s.decode_s, "kv_resident_tokens": s.kv_resident_tokens,
            "kv_attended_tokens": s.kv_attended_tokens}


class Completion(Render):
    kind = "text_completion"

    def _logprobs(self, ids: list[int], items: list[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tokens = [self.token(t) for t in ids]
        offsets, at = [], offset
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": [i.logprob for i in items],
                "top_logprobs": [{self.token(t): lp for t, lp in i.top} for i in items], "text_offset": offsets}

    def whole(self, output: GenerationOutput) -> dict[str, Any]:
        items = [TokenLogprob(lp, top) for lp, top in zip(output.logprobs or [], output.top_logprobs or [])]
        choice = {"index": 0, "text": output.text, "logprobs": self._logprobs(output.token_ids, items),
                  "finish_reason": FINISH.get(output.finish_reason, "stop")}
        return {**self.head(self.kind), "choices": [choice], "usage": usage(output), "semkv": stats(output)}

    def chunk(self, text, finish, counts):
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self.head(self.kind), "choices": [choice], **({"usage": counts} if counts else {})}


class Chat(Render):
    kind = "chat.completion.chunk"
    prefix = "chatcmpl"

    def _content(self, items: list[TokenLogprob], ids: list[int]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [dict(entry(t, i.logprob), top_logprobs=[entry(a, lp) for a, lp in i.top])
                            for t, i in zip(ids, items)]}

    def whole(self, output: GenerationOutput) -> dict[str, Any]:
        items = [TokenLogprob(lp, top) for lp, top in zip(output.logprobs or [], output.top_logprobs or [])]
        choice = {"index": 0, "message": {"role": "assistant", "content": output.text},
                  "logprobs": self._content(items, output.token_ids),
                  "finish_reason": FINISH.get(output.finish_reason, "stop")}
        return {**self.head("chat.completion"), "choices": [choice], "usage": usage(output), "semkv": stats(output)}

    def chunk(self, text, finish, counts):
        choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}
        return {**self.head(self.kind), "choices": [choice], **({"usage": counts} if counts else {})}

    def opening(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return {**self.head(self.kind), "choices": [choice]}

