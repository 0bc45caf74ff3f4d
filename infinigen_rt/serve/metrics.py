"""Server counters in the Prometheus text format (no client library), and the ASGI middleware that counts
requests by endpoint and status."""

from __future__ import annotations

import threading
from collections import Counter

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")


class Metrics:
    """Counts updated from the event loop (requests) and the scheduler thread (batches), under one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.prompt_tokens = self.generated_tokens = self.cancelled = 0
        self.batches = self.batch_rows = 0
        self.bytes_h2d = self.bytes_d2h = 0
        self.kv_fetched_share: float | None = None  # of the last batch, when its policy reports one
        self.decode_tokens_per_s: float | None = None

    def count_request(self, path: str, status: int) -> None:
        endpoint = path if path in ENDPOINTS else "other"  # bounded label values, whatever clients ask for
        with self.lock:
            self.requests[endpoint, status] += 1

    def count_cancelled(self) -> None:
        with self.lock:
            self.cancelled += 1

    def record_batch(self, batch_prompts: list[int], results, stats) -> None:
        s = stats.to_dict()
        with self.lock:
            self.batches += 1
            self.batch_rows += len(batch_prompts)
            self.prompt_tokens += sum(batch_prompts)
            self.generated_tokens += sum(len(r.token_ids) for r in results)
            self.cancelled += sum(r.finish_reason == "cancelled" for r in results)
            self.bytes_h2d += s.get("bytes_h2d") or 0
            self.bytes_d2h += s.get("bytes_d2h") or 0
            if s.get("kv_fetched_share") is not None:
                self.kv_fetched_share = s["kv_fetched_share"]
            self.decode_tokens_per_s = s.get("decode_tokens_per_s")

    def render(self, queue_depth: int, batch_size: int) -> str:
        """The Prometheus text exposition format, version 0.0.4."""
        out: list[str] = []

        def metric(name: str, kind: str, help: str, samples) -> None:
            out.append(f"# HELP infinigen_{name} {help}")
            out.append(f"# TYPE infinigen_{name} {kind}")
            for labels, value in samples:
                out.append(f"infinigen_{name}{labels} {value}")

        with self.lock:
            reqs = sorted(self.requests.items())
            metric(
                "requests_total",
                "counter",
                "HTTP requests by endpoint and status.",
                [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in reqs],
            )
            metric("prompt_tokens_total", "counter", "Prompt tokens of the requests run.", [("", self.prompt_tokens)])
            metric("generated_tokens_total", "counter", "Tokens generated.", [("", self.generated_tokens)])
            metric(
                "requests_cancelled_total",
                "counter",
                "Requests whose client left before the end.",
                [("", self.cancelled)],
            )
            metric("queue_depth", "gauge", "Requests waiting for a batch.", [("", queue_depth)])
            metric("batch_size", "gauge", "Rows in the batch on the engine now (0 = idle).", [("", batch_size)])
            metric("batches_total", "counter", "Batches run.", [("", self.batches)])
            metric(
                "batch_rows_total",
                "counter",
                "Rows of all batches run (over batches_total: mean batch size).",
                [("", self.batch_rows)],
            )
            metric("bytes_h2d_total", "counter", "KV bytes copied host to device.", [("", self.bytes_h2d)])
            metric("bytes_d2h_total", "counter", "KV bytes copied device to host.", [("", self.bytes_d2h)])
            if self.kv_fetched_share is not None:
                metric(
                    "kv_fetched_share",
                    "gauge",
                    "Share of the held KV fetched per step, last batch.",
                    [("", self.kv_fetched_share)],
                )
            if self.decode_tokens_per_s is not None:
                metric(
                    "decode_tokens_per_second",
                    "gauge",
                    "Decode throughput of the last batch (all rows).",
                    [("", self.decode_tokens_per_s)],
                )
        return "\n".join(out) + "\n"


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
