"""The FastAPI app: the routes (routes.py) behind a request body limit and the request counter, errors as OpenAI
error objects. The engine is loaded once by the caller and handed in."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from infinigen_rt import __version__
from infinigen_rt.engine import Engine
from infinigen_rt.errors import InfinigenError
from infinigen_rt.policies import Policy
from infinigen_rt.serve.metrics import CountRequests, Metrics
from infinigen_rt.serve.protocol import SCORE_TAIL, APIError, error_body, validation_message
from infinigen_rt.serve.routes import Routes
from infinigen_rt.serve.scheduler import Scheduler

log = logging.getLogger("infinigen_rt.serve")

MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 32  # a context's worth of text as JSON: long tokens, \uXXXX escapes, message wrappers
BODY_TIMEOUT_S = 30.0  # a whole body after its headers (a 4 MiB one needs 140 KB/s)


def body_limit(context: int) -> int:
    """The largest request body worth parsing: a prompt that fills the context stays well under it."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * context)


def create_app(
    engine: Engine, policy: Policy, model_name: str, *, max_batch: int = 8, max_queue: int = 64,
    api_key: str | None = None, prefill_chunk: int | None = 512, kv_tokens: int | None = None,
    kv_memory: int | None = None, max_body: int | None = None, score: str = "decode", score_tail: int = SCORE_TAIL,
    body_timeout: float = BODY_TIMEOUT_S, graphs: bool = False,
) -> FastAPI:  # fmt: skip
    """An app serving `engine` with `policy` (a request may override some of its options) as `model_name`; its
    scheduler thread runs while the app does (lifespan).

    `max_body`: larger request bodies get a 413 before they are parsed (default: `body_limit(context)`); one not
    all sent within `body_timeout` seconds of its headers gets a 408.
    `score`, `score_tail`: how prompt logprobs are computed ("decode": the last `score_tail` prompt tokens by
    decode steps through the request's policy; "prefill": by the dense prefill). `graphs`: decode steps replayed from
    CUDA graphs where the policy allows (graphs.py)."""
    metrics = Metrics()
    scheduler = Scheduler(
        engine, policy, max_batch=max_batch, max_queue=max_queue, metrics=metrics, prefill_chunk=prefill_chunk,
        kv_tokens=kv_tokens, kv_memory=kv_memory, graphs=graphs,
    )  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)  # joins the thread: not on the event loop

    app = FastAPI(title="infinigen-rt", version=__version__, lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    limit = max_body or body_limit(engine.cfg.max_position_embeddings)
    app.add_middleware(BodyLimit, limit=limit, timeout=body_timeout)
    app.add_middleware(CountRequests, metrics=metrics)  # the outer one: it counts the 413s too
    _add_error_handlers(app)
    app.include_router(Routes(engine, policy, model_name, scheduler, metrics, api_key, score, score_tail).router())
    return app


class ErrorResponse(JSONResponse):
    """An error object as ASCII JSON: a message that quotes the client's text cannot fail to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class BodyLimit:
    """Pure ASGI middleware: a request body over `limit` bytes is answered 413 before anything parses it,
    whether it declares its length or comes in chunks (then it is read, up to the limit, and replayed); one that
    has not all arrived `timeout` seconds after its headers is answered 408, and its connection closed (a client
    trickling a body held its connection, and a slot of the server's, for as long as it liked)."""

    def __init__(self, app, limit: int, timeout: float = BODY_TIMEOUT_S):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self.refuse(scope, receive, send)
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                return await self.too_slow(scope, receive, send, size)
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

    async def too_slow(self, scope, receive, send, size: int):
        message = f"the request body did not arrive within {self.timeout:g} s ({size:,} bytes came); send it at once"
        log_refusal(scope["method"], scope["path"], 408, message)
        response = ErrorResponse(error_body(message, code="request_timeout"), 408, headers={"Connection": "close"})
        await response(scope, receive, send)

    async def refuse(self, scope, receive, send):
        message = f"the request body is larger than this server's limit of {self.limit:,} bytes"
        log_refusal(scope["method"], scope["path"], 413, message)
        await ErrorResponse(error_body(message, code="request_too_large"), 413)(scope, receive, send)


def log_refusal(method: str, path: str, status: int, message: str) -> None:
    """A refused request in the server's log, one line with its reason (the access log says only the status)."""
    log.warning("%s %s -> %d: %s", method, path, status, message.replace("\n", " "))


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI error object, and one log line with its reason; the server keeps serving."""

    def refuse(request: Request, status: int, body: dict, headers=None) -> ErrorResponse:
        log_refusal(request.method, request.url.path, status, body["error"]["message"])
        return ErrorResponse(body, status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return refuse(request, e.status, e.body(), headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        message, param = validation_message(list(e.errors()))
        return refuse(request, 400, error_body(message, param=param))

    @app.exception_handler(InfinigenError)
    async def engine_error(request: Request, e: InfinigenError):
        return refuse(request, 400, error_body(str(e)))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return refuse(request, e.status_code, error_body(str(e.detail), kind), e.headers)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        """Anything else: the OpenAI error body (a 500, its traceback in the log), never Starlette's plain text."""
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return ErrorResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500)
