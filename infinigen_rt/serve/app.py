"""The FastAPI app: OpenAI routes over the scheduler, streaming as server-sent events, errors as OpenAI error
objects, an optional bearer key on /v1/*. The engine is loaded once by the caller and handed in."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from infinigen_rt import __version__
from infinigen_rt.engine import Engine
from infinigen_rt.errors import InfinigenError
from infinigen_rt.policies import POLICIES, Policy
from infinigen_rt.sampling import SamplingParams
from infinigen_rt.serve.metrics import CountRequests, Metrics
from infinigen_rt.serve.protocol import (
    CHAT_MAX_TOKENS,
    COMPLETION_MAX_TOKENS,
    APIError,
    BaseRequest,
    ChatRequest,
    CompletionRequest,
    KVOverrides,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    error_body,
    usage,
    validation_message,
)
from infinigen_rt.serve.scheduler import Done, Failed, Job, QueueFull, Scheduler, ShuttingDown

DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks that its client is still there
MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 32  # a context's worth of text as JSON: long tokens, \uXXXX escapes, message wrappers


def body_limit(context: int) -> int:
    """The largest request body worth parsing: a prompt that fills the context stays well under it."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * context)


def create_app(
    engine: Engine, policy: Policy, model_name: str, *, max_batch: int = 8, max_queue: int = 64,
    api_key: str | None = None, prefill_chunk: int | None = 512, kv_tokens: int | None = None,
    kv_memory: int | None = None, max_body: int | None = None,
) -> FastAPI:  # fmt: skip
    """An app serving `engine` with `policy` (a request may override some of its options) as `model_name`; its
    scheduler thread runs while the app does (lifespan).

    `max_body`: larger request bodies get a 413 before they are parsed (default: `body_limit(context)`)."""
    metrics = Metrics()
    scheduler = Scheduler(
        engine, policy, max_batch=max_batch, max_queue=max_queue, metrics=metrics, prefill_chunk=prefill_chunk,
        kv_tokens=kv_tokens, kv_memory=kv_memory,
    )  # fmt: skip
    tok, context, started = engine.tokenizer, engine.cfg.max_position_embeddings, int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)  # joins the thread: not on the event loop

    app = FastAPI(title="infinigen-rt", version=__version__, lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.add_middleware(BodyLimit, limit=max_body or body_limit(context))
    app.add_middleware(CountRequests, metrics=metrics)  # the outer one: it counts the 413s too
    _add_error_handlers(app)

    async def check_key(authorization: Annotated[str | None, Header()] = None) -> None:
        if api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key"
            )

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {model_name!r} (GET /v1/models)",
                "model",
                "model_not_found",
            )

    async def run(request: Request, body: BaseRequest, ids: list[int], max_tokens: int, chat: bool):
        """Queue the request; stream its pieces as SSE, or wait for the whole text."""
        temperature = 1.0 if body.temperature is None else body.temperature  # OpenAI's defaults
        sampling = SamplingParams(temperature=temperature, top_p=body.top_p or 1.0, seed=body.seed)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        job = Job(
            ids,
            max_tokens,
            sampling,
            body.stops(),
            request_policy(engine, policy, body.infinigen),
            emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
            stream=body.stream,
        )
        if not scheduler.alive:
            raise APIError(503, "the scheduler is not running; see the server log", type="server_error")
        try:
            scheduler.submit(job)
        except QueueFull:
            raise APIError(
                429,
                f"the server is busy ({max_queue} requests waiting already); retry shortly",
                code="rate_limit_exceeded",
                type="rate_limit_error",
            ) from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down", type="server_error") from None
        rid, created = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time())
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            chunks = Chunks(chat, rid, created, model_name, len(ids) if include_usage else None)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(
                sse(scheduler, job, events, chunks), media_type="text/event-stream", headers=headers
            )
        done = await wait_done(request, scheduler, job, events)
        if done is None:  # the client left; nobody reads this
            return Response(status_code=499)
        make = chat_body if chat else completion_body
        return make(rid, created, model_name, done.text, done.finish_reason, usage(len(ids), done.completion_tokens))

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            return JSONResponse(error_body("the scheduler is not running", "server_error"), 503)
        return {
            "status": "ok",
            "model": model_name,
            "queue_depth": scheduler.queue_depth,
            "batch_size": scheduler.batch_size,
        }

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    card = {"id": model_name, "object": "model", "created": started, "owned_by": "infinigen"}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [card]}

    @v1.get("/models/{model:path}")
    async def model(model: str):
        check_model(model)
        return card

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        body.check()
        ids = tok.encode(body.prompt_text())
        max_tokens = fit_context(len(ids), body.max_tokens, COMPLETION_MAX_TOKENS, context, "prompt")
        return await run(request, body, ids, max_tokens, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body.model)
        body.check()
        if not tok.chat_template:
            raise APIError(400, "this bundle has no chat template: use /v1/completions with a raw prompt", "messages")
        ids = tok.encode_chat(body.plain_messages())
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = fit_context(len(ids), requested, CHAT_MAX_TOKENS, context, "messages")
        return await run(request, body, ids, max_tokens, chat=True)

    app.include_router(v1)

    return app


def fit_context(prompt_tokens: int, requested: int | None, default: int, context: int, param: str) -> int:
    """max_tokens for a prompt: the request's (checked against the context) or a default that fits."""
    if prompt_tokens == 0:
        raise APIError(400, "the prompt is empty: it encodes to no tokens", param)
    room = context - prompt_tokens
    if room < 1:
        raise APIError(
            400,
            f"the prompt is {prompt_tokens} tokens but the model's context is {context} tokens; shorten it",
            param,
            "context_length_exceeded",
        )
    if requested is None:
        return min(default, room)
    if requested > room:
        raise APIError(
            400,
            f"max_tokens {requested} + the prompt's {prompt_tokens} tokens exceed the model's "
            f"context of {context} tokens; ask for at most {room}",
            "max_tokens",
            "context_length_exceeded",
        )
    return requested


def request_policy(engine: Engine, base: Policy, o: KVOverrides | None) -> Policy:
    """The server's policy with this request's `infinigen` overrides (only options the policy reads)."""
    if o is None or (o.alpha is None and o.budget is None):
        return base
    knobs = base.cls.knobs
    for name in ("alpha", "budget"):
        if getattr(o, name) is not None and name not in knobs:
            users = [n for n, cls in POLICIES.items() if cls.runtime and name in cls.knobs]
            which = " and ".join(users) + (" policy" if len(users) == 1 else " policies")
            raise APIError(
                400, f"infinigen.{name} applies to the {which}; this server runs {base.name}", "infinigen"
            )
    changes = {name: getattr(o, name) for name in ("alpha", "budget") if getattr(o, name) is not None}
    return base.with_options(engine, **changes)


async def wait_done(request: Request, scheduler: Scheduler, job: Job, events: asyncio.Queue) -> Done | None:
    """The final event of a non-streaming job; None when the client left (the job is cancelled)."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    scheduler.cancel(job)
                    return None
                continue
            if isinstance(event, Failed):
                raise _failed(event)
            return event
    except asyncio.CancelledError:
        scheduler.cancel(job)
        raise


class Chunks:
    """The streamed objects of one request: completion chunks, or chat chunks with the role first."""

    def __init__(self, chat: bool, rid: str, created: int, model: str, usage_prompt_tokens: int | None):
        self.chat, self.head = chat, (rid, created, model)
        self.usage_prompt_tokens = usage_prompt_tokens  # None: no usage chunk (stream_options.include_usage)

    def first(self) -> dict | None:
        return chat_chunk(*self.head, {"role": "assistant", "content": ""}) if self.chat else None

    def piece(self, text: str) -> dict:
        return chat_chunk(*self.head, {"content": text}) if self.chat else completion_chunk(*self.head, text)

    def final(self, reason: str) -> dict:
        return chat_chunk(*self.head, {}, reason) if self.chat else completion_chunk(*self.head, "", reason)

    def usage(self, completion_tokens: int) -> dict | None:
        if self.usage_prompt_tokens is None:
            return None
        rid, created, model = self.head
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        use = usage(self.usage_prompt_tokens, completion_tokens)
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


async def sse(scheduler: Scheduler, job: Job, events: asyncio.Queue, chunks: Chunks):
    """Server-sent events: a chunk per new piece, a chunk with the finish reason, the usage if asked, [DONE].
    A client that leaves cancels this generator (starlette) and so the job."""
    finished = False
    try:
        if (first := chunks.first()) is not None:
            yield _data(first)
        while True:
            event = await events.get()
            if isinstance(event, str):
                yield _data(chunks.piece(event))
                continue
            if isinstance(event, Failed):
                yield _data(_failed(event).body())
                break
            if event.text:
                yield _data(chunks.piece(event.text))
            yield _data(chunks.final(event.finish_reason))
            if (use := chunks.usage(event.completion_tokens)) is not None:
                yield _data(use)
            break
        finished = True
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            scheduler.cancel(job)


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _failed(event: Failed) -> APIError:
    return APIError(event.status, event.message, type="invalid_request_error" if event.status < 500 else "server_error")


class ErrorResponse(JSONResponse):
    """An error object as ASCII JSON: a message that quotes the client's text cannot fail to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class BodyLimit:
    """Pure ASGI middleware: a request body over `limit` bytes is answered 413 before anything parses it,
    whether it declares its length or comes in chunks (then it is read, up to the limit, and replayed)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self.refuse(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self.refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the client to disconnect

        await self.app(scope, replay, send)

    async def refuse(self, scope, receive, send):
        message = f"the request body is larger than this server's limit of {self.limit:,} bytes"
        await ErrorResponse(error_body(message, code="request_too_large"), 413)(scope, receive, send)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI error object; the server keeps serving."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return ErrorResponse(e.body(), e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        message, param = validation_message(list(e.errors()))
        return ErrorResponse(error_body(message, param=param), 400)

    @app.exception_handler(InfinigenError)
    async def engine_error(request: Request, e: InfinigenError):
        return ErrorResponse(error_body(str(e)), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return ErrorResponse(error_body(str(e.detail), kind), e.status_code, headers=e.headers)
