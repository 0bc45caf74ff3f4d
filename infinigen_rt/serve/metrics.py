"""Server metrics on prometheus_client, and the ASGI middleware that counts requests by endpoint and status.

Each app has its own registry: several apps live in one test process, and the global one would mix them. Names
are vLLM's with our prefix (`vllm:time_to_first_token_seconds` -> `infinigen_time_to_first_token_seconds`)
where the meaning is the same."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
# 1 ms to 60 s: a GPU's inter-token gap to a first token behind a long queue on a CPU
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0)
# whole requests: hundreds of tokens on a loaded CPU take minutes
REQUEST_BUCKETS = (*LATENCY_BUCKETS[3:], 120.0, 300.0, 600.0)


class Metrics:
    """One app's metrics, updated from the event loop (requests) and the scheduler thread (batches, tokens);
    prometheus_client locks each metric. The gauges of the scheduler's state are read at each scrape from the
    callables given to `watch`."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "infinigen_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("infinigen_prompt_tokens", "Prompt tokens of the requests run.", registry=r)
        self.generated_tokens = Counter("infinigen_generated_tokens", "Tokens generated.", registry=r)
        self.cancelled = Counter(
            "infinigen_requests_cancelled", "Requests whose client left before the end.", registry=r
        )
        self.steps = Counter(
            "infinigen_decode_steps", "Decode steps run (each over every running request).", registry=r
        )
        self.step_rows = Counter(
            "infinigen_decode_rows", "Requests of all decode steps (over decode_steps_total: mean batch size).",
            registry=r,
        )  # fmt: skip
        self.bytes_h2d = Counter("infinigen_bytes_h2d", "KV bytes copied host to device.", registry=r)
        self.bytes_d2h = Counter("infinigen_bytes_d2h", "KV bytes copied device to host.", registry=r)
        self.ttft = Histogram(
            "infinigen_time_to_first_token_seconds",
            "From a request's arrival at the scheduler to its first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "infinigen_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "infinigen_e2e_request_latency_seconds",
            "From a request's arrival at the scheduler to its end, for requests that ended with stop or length.",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.last: dict[str, float] = {}  # kv_fetched_share of the last request, decode_tokens_per_second
        self.waiting: Callable[[], int] | None = None
        self.running: Callable[[], int] | None = None
        self.kv_blocks: Callable[[], tuple[int, int]] | None = None
        r.register(_Live(self))

    def watch(
        self,
        waiting: Callable[[], int],
        running: Callable[[], int],
        kv_blocks: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        """Where the gauges read the scheduler's state; `kv_blocks` returns the KV pool's (used, free) blocks."""
        self.waiting, self.running, self.kv_blocks = waiting, running, kv_blocks

    def count_request(self, path: str, status: int) -> None:
        endpoint = path if path in ENDPOINTS else "other"  # bounded label values, whatever clients ask for
        self.requests.labels(endpoint, str(status)).inc()

    def count_cancelled(self) -> None:
        self.cancelled.inc()

    def record_tokens(self, n: int, wait: float, first: bool) -> None:
        """`n` new tokens of one request, the first `wait` s after the request's previous token (`first`: after
        its arrival). Tokens that come in one step reach the client together: the others wait 0."""
        self.generated_tokens.inc(n)
        (self.ttft if first else self.itl).observe(wait)
        for _ in range(n - 1):
            self.itl.observe(0.0)

    def record_step(self, steps: int, rows: int, tokens_per_s: float | None) -> None:
        """After a runner step: its decode steps (0 or 1) and their rows, the engine's decode rate so far."""
        self.steps.inc(steps)
        self.step_rows.inc(rows)
        if tokens_per_s is not None:
            self.last = {**self.last, "decode_tokens_per_second": tokens_per_s}

    def record_request(self, prompt_tokens: int, report) -> None:
        """A request that ended, with its cache's KVReport."""
        self.prompt_tokens.inc(prompt_tokens)
        self.bytes_h2d.inc(report.bytes_h2d)
        self.bytes_d2h.inc(report.bytes_d2h)
        if report.kv_fetched_share is not None:  # kept from an earlier request when this policy reports none
            self.last = {**self.last, "kv_fetched_share": report.kv_fetched_share}  # one assignment: atomic

    def render(self) -> bytes:
        """The text exposition, of type `prometheus_client.CONTENT_TYPE_LATEST`."""
        return generate_latest(self.registry)


class _Live:
    """The gauges read at scrape time: the scheduler's queue and batch, the KV pool, the last request's figures."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        m = self.m
        if m.waiting is not None and m.running is not None:
            waiting, running = m.waiting(), m.running()
            yield _gauge("queue_depth", "Requests waiting for a batch.", waiting)
            yield _gauge("batch_size", "Rows in the batch on the engine now (0 = idle).", running)
            yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", waiting)
            yield _gauge("num_requests_running", "Requests on the engine now.", running)
        if m.kv_blocks is not None:
            used, free = m.kv_blocks()
            yield _gauge("kv_pool_blocks_used", "KV pool blocks holding a request's cache.", used)
            yield _gauge("kv_pool_blocks_free", "KV pool blocks free.", free)
        last = m.last
        if last.get("kv_fetched_share") is not None:
            yield _gauge(
                "kv_fetched_share", "Share of the held KV fetched per step, last request.", last["kv_fetched_share"]
            )
        if last.get("decode_tokens_per_second") is not None:
            yield _gauge(
                "decode_tokens_per_second",
                "Decode tokens per second of the engine so far (all requests).",
                last["decode_tokens_per_second"],
            )


def _gauge(name: str, help: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"infinigen_{name}", help, value=value)


class CountRequests:
    """Pure ASGI middleware (streaming passes through untouched): counts each response's status."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # an exception before the response started ends as a 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.count_request(scope["path"], status)
