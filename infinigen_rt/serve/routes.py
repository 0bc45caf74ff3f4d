"""The OpenAI routes over the scheduler: models, completions and chat completions (streamed as server-sent
events), /health and /metrics; an optional bearer key on /v1/*."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from infinigen_rt.engine import Engine
from infinigen_rt.policies import POLICIES, Policy
from infinigen_rt.sampling import SamplingParams
from infinigen_rt.serve.metrics import Metrics
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
)
from infinigen_rt.serve.scheduler import Done, Failed, Job, QueueFull, Scheduler, ShuttingDown

DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks that its client is still there


class Routes:
    """What the handlers share (the engine, the server's policy and name, its scheduler and metrics, the key), a
    method per route; `router()` puts them on their paths."""

    def __init__(
        self, engine: Engine, policy: Policy, model_name: str, scheduler: Scheduler, metrics: Metrics,
        api_key: str | None,
    ):  # fmt: skip
        self.engine, self.policy, self.model_name = engine, policy, model_name
        self.scheduler, self.metrics, self.api_key = scheduler, metrics, api_key
        self.tok, self.context = engine.tokenizer, engine.cfg.max_position_embeddings
        self.card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "infinigen"}

    def router(self) -> APIRouter:
        """/health and /metrics open to all; /v1/* behind the key."""
        router = APIRouter()
        router.get("/health")(self.health)
        router.get("/metrics")(self.prometheus)
        v1 = APIRouter(prefix="/v1", dependencies=[Depends(self.check_key)])
        v1.get("/models")(self.models)
        v1.get("/models/{model:path}")(self.model)
        v1.post("/completions")(self.completions)
        v1.post("/chat/completions")(self.chat_completions)
        router.include_router(v1)
        return router

    async def check_key(self, authorization: Annotated[str | None, Header()] = None) -> None:
        if self.api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(
                401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key"
            )

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.model_name!r} (GET /v1/models)",
                "model",
                "model_not_found",
            )

    async def health(self):
        if not self.scheduler.alive:
            return JSONResponse(error_body("the scheduler is not running", "server_error"), 503)
        return {
            "status": "ok",
            "model": self.model_name,
            "queue_depth": self.scheduler.queue_depth,
            "batch_size": self.scheduler.batch_size,
        }

    async def prometheus(self):
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(self):
        return {"object": "list", "data": [self.card]}

    async def model(self, model: str):
        self.check_model(model)
        return self.card

    async def completions(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        body.check()
        ids = self.tok.encode(body.prompt_text())
        max_tokens = fit_context(len(ids), body.max_tokens, COMPLETION_MAX_TOKENS, self.context, "prompt")
        return await self.run(request, body, ids, max_tokens, chat=False)

    async def chat_completions(self, body: ChatRequest, request: Request):
        self.check_model(body.model)
        body.check()
        if not self.tok.chat_template:
            raise APIError(400, "this bundle has no chat template: use /v1/completions with a raw prompt", "messages")
        ids = self.tok.encode_chat(body.plain_messages())
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = fit_context(len(ids), requested, CHAT_MAX_TOKENS, self.context, "messages")
        return await self.run(request, body, ids, max_tokens, chat=True)

    async def run(self, request: Request, body: BaseRequest, ids: list[int], max_tokens: int, chat: bool):
        """Queue the request; stream its pieces as SSE, or wait for the whole text."""
        temperature = 1.0 if body.temperature is None else body.temperature  # OpenAI's defaults
        sampling = SamplingParams(temperature=temperature, top_p=body.top_p or 1.0, seed=body.seed)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        job = Job(
            ids,
            max_tokens,
            sampling,
            body.stops(),
            request_policy(self.engine, self.policy, body.infinigen),
            emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
            stream=body.stream,
        )
        self.submit(job)
        rid, created = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time())
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            chunks = Chunks(chat, rid, created, self.model_name, len(ids) if include_usage else None)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(
                sse(self.scheduler, job, events, chunks), media_type="text/event-stream", headers=headers
            )
        done = await wait_done(request, self.scheduler, job, events)
        if done is None:  # the client left; nobody reads this
            return Response(status_code=499)
        make = chat_body if chat else completion_body
        return make(
            rid, created, self.model_name, done.text, done.finish_reason, usage(len(ids), done.completion_tokens)
        )

    def submit(self, job: Job) -> None:
        """Hand `job` to the scheduler, or say as an API error why it cannot take it."""
        if not self.scheduler.alive:
            raise APIError(503, "the scheduler is not running; see the server log", type="server_error")
        try:
            self.scheduler.submit(job)
        except QueueFull:
            raise APIError(
                429,
                f"the server is busy ({self.scheduler.max_queue} requests waiting already); retry shortly",
                code="rate_limit_exceeded",
                type="rate_limit_error",
            ) from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down", type="server_error") from None


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
    changes = {} if o is None else o.changes()
    if not changes:
        return base
    knobs = base.cls.knobs
    for name in changes:
        if name not in knobs:
            users = [n for n, cls in POLICIES.items() if cls.runtime and name in cls.knobs]
            which = " and ".join(users) + (" policy" if len(users) == 1 else " policies")
            raise APIError(
                400, f"infinigen.{name} applies to the {which}; this server runs {base.name}", "infinigen"
            )
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
