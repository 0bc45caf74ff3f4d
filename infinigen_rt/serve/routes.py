"""The OpenAI routes over the scheduler: models, completions and chat completions (streamed as server-sent
events), /health and /metrics; an optional bearer key on /v1/*."""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from infinigen_rt.engine import Engine
from infinigen_rt.policies import Policy, read_by
from infinigen_rt.sampling import SEED_RANGE, SamplingParams
from infinigen_rt.serve.metrics import Metrics
from infinigen_rt.serve.protocol import (
    CHAT_MAX_TOKENS,
    COMPLETION_MAX_TOKENS,
    MAX_CHOICES,
    SCORE_TAIL,
    APIError,
    BaseRequest,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    KVOverrides,
    TokenizeRequest,
    chat_body,
    chat_choice,
    chat_chunk,
    chat_logprobs,
    completion_body,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    error_body,
    usage,
)
from infinigen_rt.serve.scheduler import Done, Failed, Job, Piece, QueueFull, Scheduler, ShuttingDown

DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks that its client is still there


@dataclass
class Spec:
    """What one prompt of a request asks for."""

    ids: list[int]
    max_tokens: int
    logprobs: int | None = None  # for each new token
    prompt_logprobs: int | None = None  # for each prompt token (echo with logprobs)
    echo: str | None = None  # the prompt's text, returned before the completion


@dataclass
class Choice:
    spec: Spec
    index: int


class Routes:
    """What the handlers share (the engine, the server's policy and name, its scheduler and metrics, the key), a
    method per route; `router()` puts them on their paths."""

    def __init__(
        self, engine: Engine, policy: Policy, model_name: str, scheduler: Scheduler, metrics: Metrics,
        api_key: str | None, score: str = "decode", score_tail: int = SCORE_TAIL,
    ):  # fmt: skip
        """`score`, `score_tail`: how a prompt's logprobs are computed unless a request says (`scoring_tail`)."""
        self.engine, self.policy, self.model_name = engine, policy, model_name
        self.scheduler, self.metrics, self.api_key = scheduler, metrics, api_key
        self.score, self.score_tail = score, score_tail
        self.tok, self.context = engine.tokenizer, engine.cfg.max_position_embeddings
        self.card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "infinigen"}
        self.piece = functools.lru_cache(maxsize=1 << 16)(lambda t: self.tok.decode([t], skip_special_tokens=False))

    def router(self) -> APIRouter:
        """/health, /metrics and the tokenizer's routes open to all (as vLLM's); /v1/* behind the key."""
        router = APIRouter()
        router.get("/health")(self.health)
        router.get("/metrics")(self.prometheus)
        router.get("/tokenizer_info")(self.tokenizer_info)
        router.post("/tokenize")(self.tokenize)
        router.post("/detokenize")(self.detokenize)
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

    async def tokenizer_info(self):
        """What lm-evaluation-harness's remote tokenizer reads (vLLM's /tokenizer_info): the special tokens and the
        chat template."""
        tok = self.tok
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.tok.id_to_token(tok.pad_id),
            "chat_template": tok.chat_template,
            "model_max_length": self.context,
            "vocab_size": self.engine.cfg.vocab_size,
        }

    async def tokenize(self, body: TokenizeRequest):
        """vLLM's /tokenize: a prompt (or chat messages, rendered with the template) -> token ids."""
        self.check_model(body.model)
        if body.messages is not None:
            if not self.tok.chat_template:
                raise APIError(400, "this bundle has no chat template: tokenize a prompt instead", "messages")
            ids = await asyncio.to_thread(self.tok.encode_chat, body.plain_messages(), body.add_generation_prompt)
        else:
            ids = self.tok.encode(body.prompt_text(), add_special_tokens=body.add_special_tokens)
        strs = [self.piece(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.context, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest):
        self.check_model(body.model)
        vocab = self.engine.cfg.vocab_size
        if (bad := next((t for t in body.tokens if not 0 <= t < vocab), None)) is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
        return {"prompt": self.tok.decode(body.tokens, skip_special_tokens=False)}

    async def completions(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        body.check()
        prompts = body.prompts(self.tok, self.engine.cfg.vocab_size)
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n={body.n} make more than {MAX_CHOICES} choices; split "
                           "the request", "n")  # fmt: skip
        specs = []
        for ids, text in prompts:
            max_tokens = fit_context(len(ids), body.max_tokens, COMPLETION_MAX_TOKENS, self.context, "prompt")
            echo = None
            if body.echo:
                echo = text if text is not None else self.tok.decode(ids, skip_special_tokens=False)
            specs.append(Spec(ids, max_tokens, body.logprobs, body.logprobs if body.echo else None, echo))
        return await self.run(request, body, specs, chat=False)

    async def chat_completions(self, body: ChatRequest, request: Request):
        self.check_model(body.model)
        body.check()
        if not self.tok.chat_template:
            raise APIError(400, "this bundle has no chat template: use /v1/completions with a raw prompt", "messages")
        # in a thread: the bundle's template may take until its deadline (chat_template.RENDER_TIMEOUT_S) to render
        # or fail, and meanwhile the event loop serves the other requests
        ids = await asyncio.to_thread(self.tok.encode_chat, body.plain_messages())
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = fit_context(len(ids), requested, CHAT_MAX_TOKENS, self.context, "messages")
        return await self.run(request, body, [Spec(ids, max_tokens, body.n_logprobs())], chat=True)

    def scoring_tail(self, o: KVOverrides | None) -> int:
        """Prompt tokens scored by decode steps (0: by the prefill): the request's `infinigen.score` and
        `score_tail`, else the server's --score and --score-tail."""
        score = (o.score if o is not None else None) or self.score
        tail = (o.score_tail if o is not None else None) or self.score_tail
        return tail if score == "decode" else 0

    async def run(self, request: Request, body: BaseRequest, specs: list[Spec], chat: bool):
        """Queue a job per prompt and choice (`n`); stream their pieces as SSE, or wait for every one."""
        temperature = 1.0 if body.temperature is None else body.temperature  # OpenAI's defaults
        policy = request_policy(self.engine, self.policy, body.infinigen)
        tail = self.scoring_tail(body.infinigen)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        jobs: list[Job] = []
        for spec in specs:
            for j in range(body.n):  # choice i * n + j of prompt i; a seeded request's choices differ by seed + j
                seed = None if body.seed is None else (body.seed + j - SEED_RANGE[0]) % 2**64 + SEED_RANGE[0]
                sampling = SamplingParams(temperature=temperature, top_p=body.top_p or 1.0, seed=seed)
                jobs.append(Job(
                    spec.ids, spec.max_tokens, sampling, body.stops(), policy,
                    emit=lambda ev, k=len(jobs): loop.call_soon_threadsafe(events.put_nowait, (k, ev)),
                    stream=body.stream, logprobs=spec.logprobs, prompt_logprobs=spec.prompt_logprobs,
                    score_tail=tail,
                ))  # fmt: skip
        self.submit(jobs)
        rid, created = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time())
        choices = [Choice(specs[k // body.n], k) for k in range(len(jobs))]
        prompt_tokens = sum(len(s.ids) for s in specs)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            chunks = Chunks(chat, rid, created, self.model_name, prompt_tokens if include_usage else None, self.piece,
                            self.tok.token_bytes)  # fmt: skip
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(
                sse(self.scheduler, jobs, choices, events, chunks), media_type="text/event-stream", headers=headers
            )
        done = await wait_done(request, self.scheduler, jobs, events)
        if done is None:  # the client left; nobody reads this
            return Response(status_code=499)
        use = usage(prompt_tokens, sum(d.completion_tokens for d in done))
        if chat:
            made = [
                chat_choice(c.index, d.text, d.finish_reason,
                            None if d.logprobs is None else chat_logprobs(d.logprobs, self.piece,
                                                                          self.tok.token_bytes))
                for c, d in zip(choices, done, strict=True)
            ]  # fmt: skip
            return chat_body(rid, created, self.model_name, made, use)
        made = [self.completion_choice(c, d) for c, d in zip(choices, done, strict=True)]
        return completion_body(rid, created, self.model_name, made, use)

    def completion_choice(self, c: Choice, d: Done) -> dict:
        """A finished completion: the echoed prompt first (with its logprobs), then the new text."""
        echo = c.spec.echo or ""
        logprobs = None
        if d.logprobs is not None:  # offsets into the text returned, the echoed prompt's included
            entries = (d.prompt_logprobs or []) + d.logprobs if c.spec.echo is not None else d.logprobs
            logprobs = completion_logprobs(entries, self.piece, 0, c.spec.ids[0])
        return completion_choice(c.index, echo + d.text, d.finish_reason, logprobs)

    def submit(self, jobs: list[Job]) -> None:
        """Hand the request's jobs to the scheduler, all or none, or say as an API error why it cannot take them."""
        if not self.scheduler.alive:
            raise APIError(503, "the scheduler is not running; see the server log", type="server_error")
        try:
            self.scheduler.submit(*jobs)
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
            message = f"infinigen.{name} applies to {read_by(name)}; this server runs {base.name}"
            raise APIError(400, message, "infinigen")
    return base.with_options(engine, **changes)


async def wait_done(request: Request, scheduler: Scheduler, jobs: list[Job], events: asyncio.Queue):
    """The final event of every job, in order; None when the client left (the jobs are cancelled). A failed job
    fails the request (the others are cancelled)."""
    done: dict[int, Done] = {}
    try:
        while len(done) < len(jobs):
            try:
                k, event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    _cancel(scheduler, jobs)
                    return None
                continue
            if isinstance(event, Failed):
                _cancel(scheduler, jobs)
                raise _failed(event)
            if isinstance(event, Done):
                done[k] = event
        return [done[k] for k in range(len(jobs))]
    except asyncio.CancelledError:
        _cancel(scheduler, jobs)
        raise


def _cancel(scheduler: Scheduler, jobs: list[Job]) -> None:
    for job in jobs:
        scheduler.cancel(job)


class Chunks:
    """The streamed objects of one request: completion chunks, or chat chunks with the role first, per choice."""

    def __init__(self, chat: bool, rid: str, created: int, model: str, usage_prompt_tokens: int | None, piece,
                 token_bytes):  # fmt: skip
        self.chat, self.head, self.piece, self.token_bytes = chat, (rid, created, model), piece, token_bytes
        self.usage_prompt_tokens = usage_prompt_tokens  # None: no usage chunk (stream_options.include_usage)
        self.offsets: dict[int, int] = {}  # a completion choice's text sent so far (its logprobs' text_offset)

    def first(self, c: Choice) -> dict | None:
        """The role (chat), or the echoed prompt when no logprobs come with it (they come once it is scored)."""
        if self.chat:
            return chat_chunk(*self.head, {"role": "assistant", "content": ""}, index=c.index)
        if c.spec.echo is not None and c.spec.prompt_logprobs is None:
            return self.text(c, c.spec.echo, None)
        return None

    def event(self, c: Choice, ev: Piece) -> dict | None:
        if ev.prompt is not None:  # completions with echo and logprobs: the prompt and its logprobs
            return self.text(c, c.spec.echo or "", ev.prompt)
        if self.chat:
            lp = None if c.spec.logprobs is None else chat_logprobs(ev.logprobs, self.piece, self.token_bytes)
            return chat_chunk(*self.head, {"content": ev.text}, index=c.index, logprobs=lp)
        return self.text(c, ev.text, ev.logprobs if c.spec.logprobs is not None else None)

    def text(self, c: Choice, text: str, entries) -> dict:
        at = self.offsets.get(c.index, 0)
        lp = None if entries is None else completion_logprobs(entries, self.piece, at, c.spec.ids[0])
        self.offsets[c.index] = at + len(text)
        return completion_chunk(*self.head, text, index=c.index, logprobs=lp)

    def final(self, c: Choice, reason: str) -> dict:
        if self.chat:
            return chat_chunk(*self.head, {}, reason, index=c.index)
        return completion_chunk(*self.head, "", reason, index=c.index)

    def usage(self, completion_tokens: int) -> dict | None:
        if self.usage_prompt_tokens is None:
            return None
        rid, created, model = self.head
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        use = usage(self.usage_prompt_tokens, completion_tokens)
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


async def sse(scheduler: Scheduler, jobs: list[Job], choices: list[Choice], events: asyncio.Queue, chunks: Chunks):
    """Server-sent events: a chunk per new piece of any choice, a chunk with each choice's finish reason, the usage
    if asked, [DONE]. A client that leaves cancels this generator (starlette) and so the jobs."""
    finished, left, completion_tokens = False, len(jobs), 0
    try:
        for c in choices:
            if (first := chunks.first(c)) is not None:
                yield _data(first)
        while left:
            k, event = await events.get()
            c = choices[k]
            if isinstance(event, Piece):
                if (chunk := chunks.event(c, event)) is not None:
                    yield _data(chunk)
                continue
            if isinstance(event, Failed):
                yield _data(_failed(event).body())
                break
            if event.text:
                yield _data(chunks.event(c, Piece(event.text)))
            yield _data(chunks.final(c, event.finish_reason))
            completion_tokens += event.completion_tokens
            left -= 1
        if not left and (use := chunks.usage(completion_tokens)) is not None:
            yield _data(use)
        finished = True
        yield "data: [DONE]\n\n"
    finally:
        if not finished or left:
            _cancel(scheduler, jobs)


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _failed(event: Failed) -> APIError:
    return APIError(event.status, event.message, type="invalid_request_error" if event.status < 500 else "server_error")
