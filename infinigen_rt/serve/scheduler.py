"""One thread owns the engine and runs waiting requests through it in batches.

Requests wait in a bounded FIFO. The thread takes the oldest one plus up to max_batch - 1 more with the same
KV options (the engine holds one set per batch) that fit the context together, and runs them as one
`Engine.generate` batch with limits, sampling and stop strings per row. From `on_step` it times each row's
new tokens (the metrics' first-token and inter-token latencies), hands each streaming row its new text and
returns the rows whose clients left, so those rows stop. Requests that arrive meanwhile wait for the next
batch: the engine's decode loop is closed, so a running batch takes no new rows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from infinigen_rt.engine import Engine
from infinigen_rt.errors import InfinigenError
from infinigen_rt.policies import KVOptions
from infinigen_rt.sampling import SamplingParams
from infinigen_rt.serve.metrics import Metrics

log = logging.getLogger("infinigen_rt.serve")


class QueueFull(Exception):
    """The wait queue holds --max-queue requests already."""


class ShuttingDown(Exception):
    """The scheduler is stopping and takes no more requests."""


@dataclass
class Done:
    text: str  # streaming: the text not sent yet; otherwise the whole completion
    finish_reason: str  # "stop" | "length"
    completion_tokens: int


@dataclass
class Failed:
    status: int
    message: str


class TextStream:
    """A row's growing text -> pieces safe to send: holds back an incomplete UTF-8 ending ("\\ufffd") and an
    ending that may still grow into a stop string, and ends at a stop string as the engine does."""

    def __init__(self, stops: list[str]):
        self.stops, self.sent, self.done = stops, "", False

    def update(self, text: str) -> str:
        if self.done:
            return ""
        hits = [text.index(s) for s in self.stops if s in text]
        if hits:
            text, self.done = text[: min(hits)], True
        else:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self._partial_stop(text)]
        if not text.startswith(self.sent):  # earlier text decoded differently: wait for the final text
            return ""
        piece, self.sent = text[len(self.sent) :], text
        return piece

    def finish(self, final: str) -> str:
        return final[len(self.sent) :] if final.startswith(self.sent) else ""

    def _partial_stop(self, text: str) -> int:
        """Length of the longest ending of `text` that starts some stop string."""
        return max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@dataclass(eq=False)
class Job:
    """One request on its way through the scheduler. `emit` is called from the scheduler thread."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    kv: KVOptions  # requests share a batch only when these are equal
    emit: Callable[[str | Done | Failed], None]
    stream: bool = False
    cancelled: bool = False  # set from the HTTP side when the client leaves
    seen: int = 0  # tokens of this row already looked at by on_step
    arrived: float = 0.0  # time.perf_counter() at submit
    last_token: float = 0.0  # time.perf_counter() when on_step last saw new tokens of this row
    text: TextStream = field(init=False)

    def __post_init__(self):
        self.text = TextStream(self.stop)


class Scheduler:
    """Owns the engine from its own thread; `submit` and `cancel` are safe from any thread."""

    def __init__(
        self,
        engine: Engine,
        max_batch: int = 8,
        max_queue: int = 64,
        metrics: Metrics | None = None,
        batch_wait_s: float = 0.02,
    ):
        self.engine, self.base_kv = engine, engine.kv
        self.max_batch, self.max_queue, self.batch_wait_s = max_batch, max_queue, batch_wait_s
        self.metrics = metrics or Metrics()
        self.context = engine.cfg.max_position_embeddings
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="infinigen-scheduler", daemon=True)
        self.metrics.watch(waiting=lambda: len(self.waiting), running=lambda: len(self.running))

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, fail the waiting ones, cut the running batch short, wait for the thread."""
        with self.cond:
            self.stopping = True
            for job in self.waiting:
                _emit(job, Failed(503, "the server is shutting down"))
            self.waiting.clear()
            for job in self.running:
                job.cancelled = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopping

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def batch_size(self) -> int:
        return len(self.running)

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.stopping:
                raise ShuttingDown()
            if len(self.waiting) >= self.max_queue:
                raise QueueFull()
            job.arrived = time.perf_counter()
            self.waiting.append(job)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """The client left: a waiting job leaves the queue, a running row stops at the next step."""
        with self.cond:
            job.cancelled = True
            if job in self.waiting:
                self.waiting.remove(job)
                self.metrics.count_cancelled()

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            self._run(batch)

    def _next_batch(self) -> list[Job] | None:
        with self.cond:
            while True:
                while not self.waiting and not self.stopping:
                    self.cond.wait()
                # requests that come together share a batch: wait a moment for the rest of them (a batch takes
                # no new rows, so starting with the first alone would keep the others waiting a whole generation)
                deadline = time.monotonic() + self.batch_wait_s
                while not self.stopping and len(self.waiting) < self.max_batch and time.monotonic() < deadline:
                    self.cond.wait(deadline - time.monotonic())
                if self.stopping:
                    return None
                if self.waiting:  # else: the waiting ones were cancelled meanwhile
                    break
            first = self.waiting[0]
            batch, longest, steps = [], 0, 0
            for job in self.waiting:
                if len(batch) == self.max_batch:
                    break
                # one KV option set per batch; the cache holds the longest prompt + the most new tokens
                fits = max(longest, len(job.prompt_ids)) + max(steps, job.max_tokens) <= self.context
                if job.kv == first.kv and (fits or not batch):
                    batch.append(job)
                    longest, steps = max(longest, len(job.prompt_ids)), max(steps, job.max_tokens)
            for job in batch:
                self.waiting.remove(job)
            self.running = batch
            return batch

    def _run(self, batch: list[Job]) -> None:
        engine, tok = self.engine, self.engine.tokenizer

        def on_step(generated: list[list[int]]) -> set[int]:
            gone, now = set(), time.perf_counter()
            for i, job in enumerate(batch):
                if job.cancelled:
                    gone.add(i)
                elif len(generated[i]) != job.seen:
                    first = job.seen == 0
                    self.metrics.record_tokens(
                        len(generated[i]) - job.seen, now - (job.arrived if first else job.last_token), first
                    )
                    job.seen, job.last_token = len(generated[i]), now
                    if job.stream and (piece := job.text.update(tok.decode(generated[i]))):
                        _emit(job, piece)
            return gone

        engine.kv = batch[0].kv  # this thread owns the engine: the batch's KV options for this run only
        try:
            results, stats = engine.generate(
                [j.prompt_ids for j in batch],
                [j.max_tokens for j in batch],
                [j.sampling for j in batch],
                stop=[j.stop for j in batch],
                on_step=on_step,
            )
        except InfinigenError as e:
            for job in batch:
                _emit(job, Failed(400, str(e)))
            return
        except Exception as e:  # a bug: fail this batch, keep serving
            log.exception("batch of %d failed", len(batch))
            for job in batch:
                _emit(job, Failed(500, f"internal error: {type(e).__name__}: {e}"))
            return
        finally:
            engine.kv = self.base_kv
            with self.cond:
                self.running = []
        # counted before any client sees its end: a scrape after a response includes that response's batch
        self.metrics.record_batch(batch_prompts=[len(j.prompt_ids) for j in batch], results=results, stats=stats)
        for job, res in zip(batch, results, strict=True):
            if res.finish_reason == "cancelled":
                continue
            text = job.text.finish(res.text) if job.stream else res.text
            self.metrics.e2e.observe(time.perf_counter() - job.arrived)
            _emit(job, Done(text, res.finish_reason, len(res.token_ids)))


def _emit(job: Job, event) -> None:
    try:
        job.emit(event)
    except RuntimeError:  # the event loop is gone (shutdown): nobody to tell
        pass
