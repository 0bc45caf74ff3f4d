"""Step-level generation: requests join and leave the running batch at every step (continuous batching).

    runner = Runner(engine, policy, max_batch=8, prefill_chunk=512, kv_tokens=65536)
    rid = runner.add(Request(prompt_ids, max_new_tokens=64))   # checked at once: a bad request raises here
    while runner.has_work:
        for out in runner.step():                              # each running request's new tokens
            ...                                                # out.finished: out.generation is its result
    runner.abort(rid)                                          # its KV is freed at once

A step admits waiting requests while the batch has a row (`max_batch`) and the KV pool has room for the
request's prompt and new tokens (`kv_tokens`, in blocks of `BLOCK_TOKENS`; a request waits, never fails, while
the pool is taken), prefills up to `prefill_chunk` prompt tokens (a long prompt takes several steps, so the
running streams keep getting a token every step), then runs one decode forward over every running request.

The KV pool (kv/paged.py: a PagedStore, with `kv_tokens`) is one set of preallocated host buffers per layer, in blocks,
that every request shares: an admitted request takes the blocks for its prompt and new tokens, or under a
capacity for what its pools reach (its policy's `pool_slots`: eviction frees slots it reuses), its block table.

Over that pool the runner keeps the batch's KV store (kv/store.py), made for the first policy (with its options)
that a request brings: every policy runs in a store (its `selector`: which layers stay on the device, which rows a
step reads; under a capacity store.Evicting; a sliding-window layer keeps its rings in the store whatever the
policy). Its requests' prompts go through the store request by request (`RequestPass`), and every decode step is
one pass for all of them (`StoreStep`): speculation, selection, the gather and attention once a layer for the
whole batch. A request whose policy or options differ from the store's (a server request's own `budget`, say), or
whose store would not fit the device, runs in a store of its own (`store.Solo`, its rows in buffers of its own); a
step then attends the batch's store as one part and each such request as another (cache.Rows). Without `kv_tokens`
every request has a store of its own and nothing limits admission but `max_batch`.

A request's KV is released, its blocks returned, the moment it finishes or is aborted. A request's tokens are the
same whichever requests share its steps (the runner's tests hold this for every policy, in the store or not). The
model runs in step.py's two functions.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from infinigen_rt.errors import InfinigenError
from infinigen_rt.graphs import StepGraphs
from infinigen_rt.kv.cache import KVReport, Rows, merge_reports
from infinigen_rt.kv.paged import PagedStore
from infinigen_rt.kv.prefetch import engine_prefetcher
from infinigen_rt.kv.store import KVStore, RequestPass, Solo, StoreStep
from infinigen_rt.kv.window import Rings
from infinigen_rt.policies import Policy
from infinigen_rt.sampling import NOT_FINITE, SamplingParams, sample, sample_rows, seeded
from infinigen_rt.step import decode_step, prefill
from infinigen_rt.system import Clock, host_available, to_device
from infinigen_rt.tp import total_report

if TYPE_CHECKING:
    from infinigen_rt.engine import Engine

MAX_LOGPROBS = 20  # top alternatives a token's logprob may come with (vLLM's default limit)
# stop strings are searched for in every step's text: bounded so that one request cannot slow everyone's steps
MAX_STOPS, MAX_STOP_CHARS = 16, 4096
BLOCK_TOKENS = 16  # the unit in which the KV budget is taken and reported (the metrics' pool blocks)


@dataclass
class Logprob:
    """A token's log-probability under the model (the raw distribution, before temperature or top-p) and the
    `top` most likely tokens at its position, best first, as (token id, logprob)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (eos or a stop string), "length", "cancelled" or "error"
    logprobs: list[Logprob] | None = None  # one per token of token_ids (Request.logprobs)
    prompt_logprobs: list[Logprob | None] | None = None  # one per prompt token, None for the first one
    error: str | None = None  # why it ended with finish_reason "error" (the model gave no usable logits)


# a request's error when its logits were not finite (sampling.NOT_FINITE)
NOT_FINITE_ERROR = ("the model's logits are not finite (NaN or infinity): a NaN or infinite weight in the bundle "
                    "(`infinigen-prep inspect --verify` checks every weight), or values past the range of the "
                    "dtype (try --dtype float32)")  # fmt: skip


@dataclass
class RunStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "prefill_tokens": self.prefill_tokens,
            "prefill_s": round(self.prefill_s, 6),
            "prefill_tokens_per_s": round(self.prefill_tokens / self.prefill_s, 3) if self.prefill_s else None,
            "decode_tokens": self.decode_tokens,
            "decode_steps": self.decode_steps,
            "decode_s": round(self.decode_s, 6),
            "decode_tokens_per_s": round(self.decode_tokens / self.decode_s, 3) if self.decode_s else None,
            "ms_per_step": round(1000 * self.decode_s / self.decode_steps, 3) if self.decode_steps else None,
            **self.extra,
        }


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    policy: Policy | None = None  # None: the runner's
    ignore_eos: bool = False  # run to max_new_tokens whatever is sampled (bench's fixed-length steps)
    logprobs: int | None = None  # each new token's logprob and this many top alternatives (None: none)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first; max_new_tokens may be 0
    score_tail: int = 0  # with prompt_logprobs: the last this many prompt tokens are scored by decode steps

    def split(self) -> int:
        """The prompt tokens prefilled; the rest are fed one decode step each through the request's policy (teacher
        forcing), so that their logprobs are what the policy computes when it generates, as `eval` measures."""
        n = len(self.prompt_ids)
        if self.prompt_logprobs is None or self.score_tail <= 0:
            return n
        return max(1, n - 1 - self.score_tail)  # the token after the split is scored by the prefill's last logits


@dataclass
class Output:
    """One request's part of a step: the tokens it gained, and when it finished, its result."""

    id: int
    new_token_ids: list[int]
    token_ids: list[int]  # every token so far (the list keeps growing: copy it to keep a snapshot)
    new_logprobs: list[Logprob] = field(default_factory=list)  # for new_token_ids, when the request asked
    prompt_logprobs: list[Logprob | None] | None = None  # in the step its prompt is scored, when it asked
    generation: Generation | None = None  # set when the request finished in this step
    report: KVReport | None = None  # and what its cache did

    @property
    def finished(self) -> bool:
        return self.generation is not None


@dataclass(eq=False)
class _Seq:
    id: int
    req: Request
    policy: Policy
    need: int  # KV slots it reserves in the pool: prompt + new tokens, fewer where eviction frees slots for reuse
    gen: object  # sampling.seeded's draws, or None
    cache: object = None
    done: int = 0  # prompt tokens prefilled
    split: int = 0  # prompt tokens to prefill (Request.split); the others are forced through decode steps
    forced: int = 0  # the prompt token the next decode step's logits score (teacher forcing while < len(prompt))
    out: list[int] = field(default_factory=list)
    out_lp: list[Logprob] = field(default_factory=list)
    prompt_lp: list[Logprob | None] = field(default_factory=lambda: [None])
    prompt_told: bool = False  # its prompt logprobs were in an Output
    pending: torch.Tensor | None = None  # the sampled token not yet fed to the model: [1] on the device
    pos: torch.Tensor | None = None  # its position: [1, 1] on the device (advanced there, never read)
    reason: str | None = None
    error: str | None = None  # with reason "error": why (Generation.error)
    text: str | None = None
    report: KVReport | None = None


class Runner:
    """See the module docstring. One thread drives a runner (the server's scheduler thread, or `generate`)."""

    def __init__(
        self, engine: Engine, policy: Policy, *, max_batch: int = 8, prefill_chunk: int | None = 512,
        kv_tokens: int | None = None, max_positions: int | None = None, graphs: bool = False,
    ):  # fmt: skip
        """`policy`: what a request that brings none runs; `max_positions`: the most tokens a request may reach
        (default: the model's context); `graphs`: on a GPU, decode steps the store's policy allows replayed from CUDA
        graphs (graphs.py)."""
        if max_batch < 1:
            raise InfinigenError(f"--max-batch must be >= 1, got {max_batch}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise InfinigenError(f"--prefill-chunk must be >= 1, got {prefill_chunk}")
        check_pool_options(kv_tokens)
        self.engine, self.policy, self.max_batch, self.prefill_chunk = engine, policy, max_batch, prefill_chunk
        self.max_positions = max_positions or engine.cfg.max_position_embeddings
        self.store = None if kv_tokens is None else PagedStore(kv_tokens // BLOCK_TOKENS, BLOCK_TOKENS, engine.device)
        # one side stream (a GPU) or worker thread (a CPU with a core to spare) for every request's row copies: the
        # caches take lanes of it (on a CPU under tensor parallelism speculation runs inline: collectives in order)
        self.prefetch = engine_prefetcher(engine)
        self.kv: KVStore | None = None  # the batch's KV store (kv/store.py), made for the first policy it can run
        self.graphs = graphs and engine.device.type == "cuda"
        self.step_graphs: StepGraphs | None = None  # the store's decode steps as CUDA graphs (with `graphs`)
        self._inputs: torch.Tensor | None = None  # [2, max_batch, 1]: a decode step's token ids and positions
        self.kv_policy: Policy | None = None  # the policy (with its options) whose requests it holds
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []  # admitted: prefilling (done < prompt) or decoding, in arrival order
        self.ids = itertools.count()
        self._stats = RunStats()
        self.prefill_clock = Clock(engine.device)  # prefill time without waiting for the device
        self.reports: list[KVReport] = []  # of the requests that finished or were aborted
        self.eos = engine.tokenizer.eos_ids if engine.tokenizer is not None else set()

    @property
    def stats(self) -> RunStats:
        """The run's counters. Prefill time is the device's (events, read once done); it is complete once the runner
        has no work left (reading it then may wait for the device), else it counts the prefills finished so far."""
        self._stats.prefill_s = self.prefill_clock.seconds(wait=not self.has_work)
        return self._stats

    # ---- requests in and out

    def add(self, req: Request) -> int:
        """Queue a request; its checks (context, limits, room in the pool) fail here, not at a later step."""
        eng = self.engine
        if not req.prompt_ids:
            raise InfinigenError("every prompt needs at least one token")
        check_stops(req.stop)
        if req.max_new_tokens < (0 if req.prompt_logprobs is not None else 1):
            raise InfinigenError(f"max-new-tokens must be >= 1 (0 only to score the prompt), got {req.max_new_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if (k := getattr(req, name)) is not None and not 0 <= k <= MAX_LOGPROBS:
                raise InfinigenError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        check_context(len(req.prompt_ids), req.max_new_tokens, self.max_positions)
        policy = req.policy or self.policy
        split = req.split()  # the forced prompt tokens are decode passes, as new tokens are
        need = reserved(policy, split, len(req.prompt_ids) - split + req.max_new_tokens, self.prefill_chunk)
        if self.store is not None and blocks_for(need) > self.store.alloc.n_blocks:
            raise InfinigenError(
                f"the request needs {need} tokens of KV (prompt + max-new-tokens) but the KV pool holds "
                f"{self.store.alloc.n_blocks * BLOCK_TOKENS}; raise --kv-tokens (or --kv-memory) or ask for fewer "
                "tokens"
            )
        seed = req.sampling.seed
        gen = seeded(seed, eng.device) if seed is not None else None
        seq = _Seq(next(self.ids), req, policy, need, gen, split=split, forced=split + 1)
        self.waiting.append(seq)
        return seq.id

    def abort(self, rid: int) -> Generation | None:
        """Stop a request now (waiting or running) and free its KV; returns what it generated, or None if the
        runner does not know it (finished already)."""
        for seq in self.waiting:
            if seq.id == rid:
                self.waiting.remove(seq)
                seq.reason = "cancelled"
                return self._result(seq)
        for seq in self.running:
            if seq.id == rid:
                seq.reason = "cancelled"
                self._free(seq)
                return self._result(seq)
        return None

    def close(self) -> None:
        """Abort every request (waiting or running): their KV is freed, and the batch's store with it (the next
        request makes a new one)."""
        for seq in [*self.waiting, *self.running]:
            self.abort(seq.id)
        self.kv = self.kv_policy = self.step_graphs = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def block_usage(self) -> tuple[int, int]:
        """KV blocks (used, free); without a pool: the blocks the running requests would take, and -1."""
        if self.store is None:
            return sum(blocks_for(s.need) for s in self.running), -1
        return self.store.alloc.used, len(self.store.alloc.free)

    def report(self) -> KVReport:
        """The KV report over the requests that have ended (see cache.merge_reports)."""
        return merge_reports(self.reports)

    def live_report(self) -> KVReport:
        """The KV report over the running requests, so far (bench reads it before and after its timed steps)."""
        return merge_reports([s.cache.report() for s in self.running if s.cache is not None])

    # ---- a step

    @torch.inference_mode()
    def step(self) -> list[Output]:
        """Admit, prefill up to one chunk, decode one token for every running request. Returns an Output for every
        request that gained a token or finished in this step."""
        self._admit()
        outs: dict[int, Output] = {}
        self._prefill(outs)
        self._decode(outs)
        return list(outs.values())

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if self.store is not None and not self.store.alloc.room(seq.id, seq.need):
                break  # first come, first served: the next one waits for room too
            self.waiting.popleft()
            if self.store is not None:
                self.store.reserve(seq.id, seq.need)
            try:
                if self._stored(seq.policy):
                    seq.cache = RequestPass(self.kv, seq.id)
                else:  # a store of its own
                    seq.cache = Solo(self.engine, seq.policy, len(seq.req.prompt_ids) + seq.req.max_new_tokens,
                                     self.prefetch.lane())  # fmt: skip
            except Exception:
                seq.reason = "error"
                self._free(seq)
                raise
            self.running.append(seq)

    def _stored(self, policy: Policy) -> bool:
        """Whether a request of `policy` keeps its KV in the batch's store: over a paged pool, for the policy (with its
        options) the store was made for; it is made for the first request's policy, if its device layers' KV and the
        sliding layers' rings fit the device (else that policy's requests each run in a store of their own, exactly
        their size: store.Solo)."""
        cfg, dev = self.engine.cfg, self.engine.device
        if self.store is None:
            return False
        if self.kv_policy is not None:
            return self.kv is not None and policy == self.kv_policy
        selector = policy.selector(self.engine, self.prefetch.lane())
        self.kv_policy = policy
        size = self.engine.dtype.itemsize
        slots = KVStore.device_slots(self.store, selector, self.max_batch, self.max_positions)
        need = slots * 2 * cfg.num_key_value_heads * cfg.head_dim * len(selector.device_layers) * size + Rings.bytes(
            cfg, self.max_batch, size)  # fmt: skip
        free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else host_available() // 2
        if need > 0.9 * free:  # a pool sized for admission only (the default: max_batch x the context)
            return False
        self.kv = KVStore(self.store, selector, cfg, dev, self.engine.dtype, self.max_batch, self.max_positions)
        self.step_graphs = StepGraphs(self.engine) if self.graphs and self.kv.graphs else None
        return True

    def _prefill(self, outs: dict[int, Output]) -> None:
        budget = self.prefill_chunk
        dev = self.engine.device
        for seq in [s for s in self.running if s.done < s.split]:
            if budget is not None and budget <= 0:
                break
            prompt, scored = seq.req.prompt_ids, seq.req.prompt_logprobs is not None
            chunk = seq.policy.opts.prefill_chunk or budget or seq.split
            n = min(seq.split - seq.done, chunk, budget or chunk)
            ids = to_device(torch.tensor([prompt[seq.done : seq.done + n]]), dev)
            pos = torch.arange(seq.done, seq.done + n, device=dev)[None]
            try:
                with self.prefill_clock.span():
                    prompt_pass = seq.cache.prompt if isinstance(seq.cache, Solo) else seq.cache
                    logits = prefill(self.engine, prompt_pass, ids, pos, every=scored)
                    if scored:  # position j scores the prompt token after it
                        m = min(n, len(prompt) - 1 - seq.done)
                        targets = to_device(torch.tensor(prompt[seq.done + 1 : seq.done + 1 + m]), dev)
                        seq.prompt_lp += logprobs(logits[0, :m], targets, [seq.req.prompt_logprobs] * m)
                        logits = logits[:, -1]
                    if seq.done + n == len(prompt):
                        seq.pending = sample(logits, seq.req.sampling, seq.gen)
                    seq.pos = torch.full((1, 1), seq.done + n, device=dev)  # the pending token's position
            except Exception:
                self._fail([seq])
                raise
            seq.done += n
            self._stats.prefill_tokens += n
            if budget is not None:
                budget -= n
            if seq.done == len(prompt):
                if seq.req.max_new_tokens == 0:
                    self._finish(seq, "length", outs)
                else:  # the request's first token (a read, as any token)
                    self._accept(seq, int(seq.pending), outs, self._sampled_logprob(seq, logits))
            elif seq.done == seq.split:  # the rest of the prompt goes through decode steps
                self._force(seq, seq.split, outs)

    def _decode(self, outs: dict[int, Output]) -> None:
        """One token for every request with a pending one. The step's one host sync is the read of the sampled
        tokens: positions live on the device and advance there, and the wall time of the step ends at that read
        (a step that also prefilled counts the prefill work still running on the device as decode time). A row
        still being fed its prompt (teacher forcing) takes its next prompt token instead of a sampled one."""
        rows = [s for s in self.running if s.pending is not None]
        if not rows:
            return
        t0 = time.perf_counter()
        stored = [s for s in rows if isinstance(s.cache, RequestPass)]
        rows = stored + [s for s in rows if not isinstance(s.cache, RequestPass)]  # the store's rows first
        if self._inputs is None:  # the step's token ids and positions: the same device buffers every step (what a
            # CUDA graph replays: measure/capture.py)
            self._inputs = torch.zeros(2, self.max_batch, 1, dtype=torch.int64, device=self.engine.device)
        ids, pos = self._inputs[0, : len(rows)], self._inputs[1, : len(rows)]
        torch.cat([s.pending.view(1, 1) for s in rows], out=ids)
        torch.cat([s.pos for s in rows], out=pos)  # [B, 1]
        if stored:  # one step through the store for all of its rows
            cache = StoreStep(self.kv, [s.id for s in stored])
            if len(stored) < len(rows):
                rest = [s.cache for s in rows[len(stored) :]]
                cache = Rows([cache, *rest], [len(stored)] + [1] * len(rest))
        else:
            cache = rows[0].cache if len(rows) == 1 else Rows([s.cache for s in rows])
        free = [i for i, s in enumerate(rows) if s.forced >= len(s.req.prompt_ids)]
        try:
            with self.prefetch.sharing():
                if self.step_graphs is not None and len(stored) == len(rows):
                    logits = self.step_graphs.step(cache, ids, pos)
                else:
                    logits = decode_step(self.engine, cache, ids, pos)
            if len(free) == len(rows):
                toks = sample_rows(logits, [s.req.sampling for s in rows], [s.gen for s in rows])
            else:
                forced = [s.req.prompt_ids[s.forced] if i not in free else 0 for i, s in enumerate(rows)]
                toks = to_device(torch.tensor(forced), self.engine.device)
                if free:
                    picked, at = [rows[i] for i in free], self._index(free)
                    sampled = sample_rows(logits.index_select(0, at), [s.req.sampling for s in picked],
                                          [s.gen for s in picked])  # fmt: skip
                    toks.index_copy_(0, at, sampled)
            nxt = pos + 1
            got = toks.tolist()  # the one host sync a step: the sampled tokens
            lps = self._step_logprobs(rows, free, logits, toks)
        except Exception:
            self._fail(rows)
            raise
        for i, (seq, t) in enumerate(zip(rows, got, strict=True)):
            seq.pending, seq.pos = toks[i : i + 1], nxt[i : i + 1]
            if i in free:
                self._accept(seq, t, outs, lps.get(i))
            else:
                if i in lps:
                    seq.prompt_lp.append(lps[i])
                self._force(seq, seq.forced, outs, pending=seq.pending)
        self._stats.decode_steps += 1
        self._stats.decode_tokens += len(rows)
        self._stats.decode_s += time.perf_counter() - t0

    def _step_logprobs(self, rows: list[_Seq], free: list[int], logits, toks) -> dict[int, Logprob]:
        """The logprobs of the step's tokens for the rows that asked (sampled ones: Request.logprobs; forced
        prompt tokens: Request.prompt_logprobs), read after the step's sync."""
        want = {}
        for i, s in enumerate(rows):
            k = s.req.logprobs if i in free else s.req.prompt_logprobs
            if k is not None:
                want[i] = k
        if not want:
            return {}
        at = self._index(list(want))
        entries = logprobs(logits.index_select(0, at), toks.index_select(0, at), list(want.values()))
        return dict(zip(want, entries, strict=True))

    def _index(self, rows: list[int]) -> torch.Tensor:
        """Row numbers as an index on the device, copied without waiting (a list index would copy from pageable
        memory)."""
        return to_device(torch.tensor(rows), self.engine.device)

    def _sampled_logprob(self, seq: _Seq, logits) -> Logprob | None:
        """The first new token's logprob (from the prefill's last logits [1, V]) when the request asked."""
        if seq.req.logprobs is None:
            return None
        return logprobs(logits, seq.pending, [seq.req.logprobs])[0]

    def _force(self, seq: _Seq, t: int, outs: dict[int, Output], pending=None) -> None:
        """The last logits scored prompt token t: it is the row's next input (`pending`: already on the device),
        unless the prompt is scored and no new token is asked for, when the request ends there."""
        prompt = seq.req.prompt_ids
        if t == len(prompt) - 1 and seq.req.max_new_tokens == 0:
            self._finish(seq, "length", outs)
            return
        seq.pending = pending if pending is not None else to_device(torch.tensor([prompt[t]]), self.engine.device)
        seq.forced = t + 1  # the next logits score the token after it (past the prompt: a new token is sampled)

    def _accept(self, seq: _Seq, t: int, outs: dict[int, Output], lp: Logprob | None = None) -> None:
        """A sampled token: the end (eos), or one more token, then maybe a stop string or the limit; NOT_FINITE ends
        the request with an error (no token of it is kept)."""
        out = self._output(seq, outs)
        if t == NOT_FINITE:
            seq.error = NOT_FINITE_ERROR
            self._finish(seq, "error", outs)
            return
        if t in self.eos and not seq.req.ignore_eos:
            seq.reason = "stop"
        else:
            seq.out.append(t)
            out.new_token_ids.append(t)
            if lp is not None:
                seq.out_lp.append(lp)
                out.new_logprobs.append(lp)
            if seq.req.stop:
                text = self.engine.tokenizer.decode(seq.out)
                hit = [text.index(x) for x in seq.req.stop if x in text]
                if hit:
                    seq.text, seq.reason = text[: min(hit)], "stop"
            if seq.reason is None and len(seq.out) >= seq.req.max_new_tokens:
                seq.reason = "length"
        if seq.reason is not None:
            self._finish(seq, seq.reason, outs)

    def _output(self, seq: _Seq, outs: dict[int, Output]) -> Output:
        """The request's Output of this step; the first one carries the prompt's logprobs (when it asked)."""
        out = outs.setdefault(seq.id, Output(seq.id, [], seq.out))
        if not seq.prompt_told and seq.req.prompt_logprobs is not None:
            out.prompt_logprobs, seq.prompt_told = seq.prompt_lp, True
        return out

    def _finish(self, seq: _Seq, reason: str, outs: dict[int, Output]) -> None:
        out = self._output(seq, outs)
        seq.reason = reason
        self._free(seq)
        out.generation, out.report = self._result(seq), seq.report

    def _free(self, seq: _Seq) -> None:
        """Its KV goes back at once (the cache closed, its blocks returned)."""
        if seq.cache is not None:
            try:  # under tensor parallelism: the totals over every rank (each ends the request in the same step)
                seq.report = total_report(seq.cache.report(), self.engine.tp)
                self.reports.append(seq.report)
            finally:
                seq.cache.close()
                seq.cache, seq.pending, seq.pos = None, None, None
        if self.store is not None:
            self.store.release(seq.id)
        if seq in self.running:
            self.running.remove(seq)

    def _fail(self, seqs: list[_Seq]) -> None:
        """A forward failed: the requests in it end (their KV freed); the others run on."""
        for seq in seqs:
            seq.reason = seq.reason or "error"
            self._free(seq)

    def _result(self, seq: _Seq) -> Generation:
        tok = self.engine.tokenizer
        text = seq.text if seq.text is not None else (tok.decode(seq.out) if tok is not None else "")
        req = seq.req
        return Generation(
            text, seq.out, list(req.prompt_ids), seq.reason or "length",
            logprobs=seq.out_lp if req.logprobs is not None else None,
            prompt_logprobs=seq.prompt_lp if req.prompt_logprobs is not None else None, error=seq.error,
        )  # fmt: skip


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, tops: list[int]) -> list[Logprob]:
    """Row i of `logits` [k, V] scores tokens[i], with its tops[i] most likely tokens (a host read); k may be 0 (a
    one-token prompt has no token to score)."""
    if not tops:
        return []
    lp = torch.log_softmax(logits.float(), -1)
    chosen = lp.gather(-1, tokens.view(-1, 1).clamp(min=0)).squeeze(-1).tolist()  # NOT_FINITE's row ends anyway
    best_v, best_i = lp.topk(max(tops), -1) if max(tops) else (lp[:, :0], lp[:, :0].long())
    best_v, best_i = best_v.tolist(), best_i.tolist()
    return [
        Logprob(t, c, list(zip(best_i[i][:k], best_v[i][:k], strict=True)))
        for i, (t, c, k) in enumerate(zip(tokens.tolist(), chosen, tops, strict=True))
    ]


def check_stops(stops: list[str]) -> None:
    """Stop strings a request may bring: none empty (it would end before the first token), at most MAX_STOPS of
    at most MAX_STOP_CHARS characters in all."""
    if any(s == "" for s in stops):
        raise InfinigenError("an empty stop string would end the text before its first token: give a non-empty one")
    if len(stops) > MAX_STOPS:
        raise InfinigenError(f"{len(stops)} stop strings: at most {MAX_STOPS}")
    if (n := sum(map(len, stops))) > MAX_STOP_CHARS:
        raise InfinigenError(f"stop strings of {n:,} characters in all: at most {MAX_STOP_CHARS:,}")


def check_pool_options(kv_tokens: int | None, kv_memory: int | None = None) -> None:
    if kv_tokens is not None and kv_tokens < BLOCK_TOKENS:
        raise InfinigenError(f"--kv-tokens must be >= {BLOCK_TOKENS} (one block), got {kv_tokens}")
    if kv_tokens is not None and kv_memory is not None:
        raise InfinigenError("--kv-tokens and --kv-memory both size the KV pool: give one of them")


def reserved(policy: Policy, prompt: int, new: int, step_chunk: int | None) -> int:
    """The KV slots a request of `prompt` + `new` tokens reserves under `policy`, prefilled in chunks of at most
    its own prefill chunk, else the step's (`step_chunk`), else the whole prompt."""
    chunk = policy.opts.prefill_chunk or step_chunk or max(prompt, 1)
    return policy.pool_slots(prompt, new, chunk)


def pool_tokens(engine: Engine, policy: Policy, max_batch: int, kv_tokens: int | None = None,
                kv_memory: int | None = None) -> int:  # fmt: skip
    """The paged pool's size in tokens: `kv_tokens`; or `kv_memory` bytes at the policy's bytes per token
    (host memory for a host-pool policy, device memory for the others); or by default room for `max_batch`
    requests of the model's whole context, at most half the memory free now where the pool lives (pool_room). A size
    asked for that does not fit in what is free is an error before anything is allocated."""
    check_pool_options(kv_tokens, kv_memory)
    device, host, _ = policy.kv_bytes(engine, engine.cfg.num_key_value_heads, engine.dtype.itemsize)
    per_token = host or device
    room, where = pool_room(engine, host > 0)
    if kv_tokens is None and kv_memory is not None:
        kv_tokens = kv_memory // per_token
        if kv_tokens < BLOCK_TOKENS:
            raise InfinigenError(
                f"--kv-memory {kv_memory} bytes holds {kv_tokens} tokens of KV ({per_token} bytes each under "
                f"{policy.name}); give at least {BLOCK_TOKENS * per_token} bytes (one block)"
            )
    if kv_tokens is not None:  # asked for: refused, not allocated, when it cannot fit
        if room is not None and kv_tokens * per_token > room:
            raise InfinigenError(
                f"a KV pool of {kv_tokens:,} tokens needs {kv_tokens * per_token / 1e9:,.1f} GB of {where} memory "
                f"({per_token:,} bytes a token under {policy.name}) and {room / 1e9:,.1f} GB are free; ask for at most "
                f"{room // per_token:,} tokens (--kv-tokens) or less --kv-memory"
            )
        return kv_tokens
    kv_tokens = max_batch * engine.cfg.max_position_embeddings
    if room is not None:  # the default never takes more than half of what is free
        kv_tokens = max(BLOCK_TOKENS, min(kv_tokens, room // 2 // per_token))
    return kv_tokens


def pool_room(engine: Engine, host: bool) -> tuple[int | None, str]:
    """(free bytes, and a name) of the memory the pool lives in: the host's for a host pool or a CPU engine, the
    GPU's otherwise (None where it cannot be read)."""
    if host or engine.device.type == "cpu":
        return host_available(), "host"
    try:
        return torch.cuda.mem_get_info(engine.device)[0], "device"
    except (RuntimeError, AssertionError, AttributeError):
        return None, "device"


def blocks_for(tokens: int) -> int:
    return math.ceil(tokens / BLOCK_TOKENS)


def check_context(prompt_tokens: int, new_tokens: int, context: int) -> None:
    """A prompt and its new tokens must fit the model's positions (the KV cache is sized by their sum)."""
    if prompt_tokens >= context:
        raise InfinigenError(f"the prompt is {prompt_tokens} tokens but the model's context is {context}; shorten it")
    if prompt_tokens + new_tokens > context:
        raise InfinigenError(
            f"the prompt's {prompt_tokens} tokens + max-new-tokens {new_tokens} exceed the model's context of "
            f"{context} tokens; ask for at most {context - prompt_tokens}"
        )

