"""One thread owns a runner over the engine and drives it step by step (continuous batching).

Requests wait in a bounded FIFO. At every step the thread hands the new ones to the runner (runner.py), which
admits them into the running batch while it has a row (--max-batch) and KV room (--kv-tokens), prefills their
prompts in chunks (--prefill-chunk) and decodes one token for every running request. Each step's tokens are
timed (the metrics' first-token and inter-token latencies) and streamed at once; a request that ends gets its
answer in that step, and one whose client left is aborted there, its KV freed. Each request carries its own
KV options, so requests with different options share steps.
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
from infinigen_rt.policies import Policy
from infinigen_rt.runner import Logprob, Request, Runner, pool_tokens
from infinigen_rt.sampling import SamplingParams
from infinigen_rt.serve.metrics import Metrics
from infinigen_rt.stream import TextStream

log = logging.getLogger("infinigen_rt.serve")


class QueueFull(Exception):
    """The wait queue holds --max-queue requests already."""


class ShuttingDown(Exception):
    """The scheduler is stopping and takes no more requests."""


@dataclass
class Piece:
    """Streaming: new text, and the logprobs of the step's tokens when asked (the text may lag behind them: an
    incomplete character or a possible stop string is held back); `prompt`: the prompt's, once scored."""

    text: str
    logprobs: list[Logprob] = field(default_factory=list)
    prompt: list[Logprob | None] | None = None


@dataclass
class Done:
    text: str  # streaming: the text not sent yet; otherwise the whole completion
    finish_reason: str  # "stop" | "length"
    completion_tokens: int
    logprobs: list[Logprob] | None = None  # not streaming, when asked: the new tokens'
    prompt_logprobs: list[Logprob | None] | None = None  # and the prompt's


@dataclass
class Failed:
    status: int
    message: str


@dataclass(eq=False)
class Job:
    """One request on its way through the scheduler. `emit` is called from the scheduler thread."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    policy: Policy  # this request's (the server's, with its overrides)
    emit: Callable[[Piece | Done | Failed], None]
    stream: bool = False
    logprobs: int | None = None  # Request.logprobs, prompt_logprobs and score_tail
    prompt_logprobs: int | None = None
    score_tail: int = 0
    cancelled: bool = False  # set from the HTTP side when the client leaves
    seen: int = 0  # tokens of this request already handed on
    arrived: float = 0.0  # time.perf_counter() at submit
    last_token: float = 0.0  # time.perf_counter() of its previous tokens
    text: TextStream = field(init=False)

    def __post_init__(self):
        self.text = TextStream(self.stop)


class Scheduler:
    """Owns the engine's runner from its own thread; `submit` and `cancel` are safe from any thread."""

    def __init__(
        self,
        engine: Engine,
        policy: Policy,
        max_batch: int = 8,
        max_queue: int = 64,
        metrics: Metrics | None = None,
        prefill_chunk: int | None = 512,
        kv_tokens: int | None = None,
        kv_memory: int | None = None,
        runner_class=Runner,
        graphs: bool = False,
    ):
        """`policy`: the server's (a request may bring its own); `runner_class`: what runs the steps (a test's fake)."""
        self.engine, self.policy = engine, policy
        kv_tokens = pool_tokens(engine, policy, max_batch, kv_tokens, kv_memory)
        params = {"policy": policy, "max_batch": max_batch, "prefill_chunk": prefill_chunk, "kv_tokens": kv_tokens}
        if graphs:  # decode steps from CUDA graphs where the policy allows (graphs.py)
            params["graphs"] = True
        self.runner = runner_class(engine, **params)
        if getattr(engine, "tp", None) is not None:  # rank 0 of a tensor-parallel group: the others replay it
            from infinigen_rt.serve.ranks import Leader, control_group

            self.runner = Leader(self.runner, engine.tp, control_group(), params)
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self.inbox: deque[Job] = deque()  # submitted, not yet handed to the runner
        self.jobs: dict[int, Job] = {}  # the runner's requests (waiting in it or running) by id
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="infinigen-scheduler", daemon=True)
        self.metrics.watch(
            waiting=lambda: self.queue_depth, running=lambda: self.batch_size, kv_blocks=self.runner.block_usage
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 30.0, wait: bool = True) -> None:
        """Refuse new requests, fail the waiting and running ones at the end of the step in progress (their streams
        end), and with `wait` wait for the thread."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if not wait:
            return
        if self.thread.is_alive():
            self.thread.join(timeout)
        else:
            self._fail_all()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopping

    @property
    def queue_depth(self) -> int:
        return len(self.inbox) + len(self.runner.waiting)

    @property
    def batch_size(self) -> int:
        return len(self.runner.running)

    def submit(self, *jobs: Job) -> None:
        """Queue one request's jobs (its choices) together, or none of them: refused only while the queue holds
        --max-queue jobs already, so a request of more choices than that runs once the queue is free."""
        with self.cond:
            if self.stopping:
                raise ShuttingDown()
            if self.queue_depth >= self.max_queue:
                raise QueueFull()
            now = time.perf_counter()
            for job in jobs:
                job.arrived = now
                self.inbox.append(job)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """The client left: the job ends at the next step (its KV freed there)."""
        with self.cond:
            job.cancelled = True
            self.cond.notify()

    def _loop(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.inbox and not self.runner.has_work and not self.stopping:
                        self.cond.wait()
                    if self.stopping:
                        break
                    new = list(self.inbox)
                    self.inbox.clear()
                self._admit(new)
                self._drop_cancelled()
                if self.runner.has_work:
                    self._step()
        finally:
            self._fail_all()
            if hasattr(self.runner, "close"):  # tensor parallelism: the followers stop too
                self.runner.close()

    def _admit(self, new: list[Job]) -> None:
        for job in new:
            if job.cancelled:
                self.metrics.count_cancelled()
                continue
            req = Request(
                job.prompt_ids, job.max_tokens, job.sampling, job.stop, policy=job.policy, logprobs=job.logprobs,
                prompt_logprobs=job.prompt_logprobs, score_tail=job.score_tail,
            )  # fmt: skip
            try:
                self.jobs[self.runner.add(req)] = job
            except InfinigenError as e:
                _emit(job, Failed(400, str(e)))

    def _drop_cancelled(self) -> None:
        for rid, job in list(self.jobs.items()):
            if job.cancelled:
                self.runner.abort(rid)
                del self.jobs[rid]
                self.metrics.count_cancelled()

    def _step(self) -> None:
        st = self.runner.stats
        steps, rows = st.decode_steps, st.decode_tokens
        try:
            outs = self.runner.step()
        except Exception as e:  # the requests of the failed forward end (the runner freed them); others run on
            if not isinstance(e, InfinigenError):
                log.exception("a step of %d requests failed", len(self.runner.running))
            known = {s.id for s in self.runner.running} | {s.id for s in self.runner.waiting}
            status = 400 if isinstance(e, InfinigenError) else 500
            message = str(e) if status == 400 else f"internal error: {type(e).__name__}: {e}"
            for rid in [r for r in self.jobs if r not in known]:
                _emit(self.jobs.pop(rid), Failed(status, message))
            return
        now, tok = time.perf_counter(), self.engine.tokenizer
        rate = st.decode_tokens / st.decode_s if st.decode_s else None
        self.metrics.record_step(st.decode_steps - steps, st.decode_tokens - rows, rate)
        for out in outs:  # every token of the step counted first: a scrape after an answer includes its step
            job = self.jobs[out.id]
            if job.stream and out.prompt_logprobs is not None:
                _emit(job, Piece("", prompt=out.prompt_logprobs))
            if n := len(out.new_token_ids):
                first = job.seen == 0
                self.metrics.record_tokens(n, now - (job.arrived if first else job.last_token), first)
                job.seen, job.last_token = job.seen + n, now
                if job.stream:
                    piece = job.text.update(tok.decode(out.token_ids))
                    if piece or out.new_logprobs:
                        _emit(job, Piece(piece, out.new_logprobs))
        for out in outs:
            if out.finished:  # counted before its client sees its end
                job, gen = self.jobs.pop(out.id), out.generation
                self.metrics.record_request(len(gen.prompt_token_ids), out.report)
                self.metrics.e2e.observe(now - job.arrived)
                if gen.error is not None:  # the model's fault, not the request's
                    _emit(job, Failed(500, gen.error))
                elif job.stream:
                    _emit(job, Done(job.text.finish(gen.text), gen.finish_reason, len(gen.token_ids)))
                else:
                    _emit(job, Done(gen.text, gen.finish_reason, len(gen.token_ids), gen.logprobs,
                                    gen.prompt_logprobs))  # fmt: skip

    def _fail_all(self) -> None:
        """Shutting down: every request not finished gets its end now (no stream is left hanging)."""
        with self.cond:
            self.stopping = True
            left = list(self.inbox) + list(self.jobs.values())
            self.inbox.clear()
        for rid in list(self.jobs):
            self.runner.abort(rid)
        self.jobs.clear()
        for job in left:
            _emit(job, Failed(503, "the server is shutting down"))


def _emit(job: Job, event) -> None:
    try:
        job.emit(event)
    except RuntimeError:  # the event loop is gone (shutdown): nobody to tell
        pass
