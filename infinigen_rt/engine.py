"""The generation engine: a bundle, a model, a KV policy; batched prefill and decode with sampling."""

from __future__ import annotations

import copy
import ctypes
import os
import sys
from collections.abc import Callable

import torch

from infinigen_rt.bundle import DTYPES, Bundle, load_infinigen
from infinigen_rt.errors import InfinigenError
from infinigen_rt.models import load_model
from infinigen_rt.policies import POLICIES, KVOptions
from infinigen_rt.runner import (
    BLOCK_TOKENS,
    Generation,
    Request,
    Runner,
    RunStats,
    blocks,
    per_row,
    pool_tokens,
    reserved,
)
from infinigen_rt.sampling import SamplingParams
from infinigen_rt.system import memory_stats, resolve_device
from infinigen_rt.tokenizer import Tokenizer
from infinigen_rt.tp import TP, shard_config, shard_speculation, tp_time


def resolve_dtype(dtype: str, bundle_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if dtype == "auto":  # CPUs compute half precision slowly: use fp32 there
        return bundle_dtype if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise InfinigenError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def pad_batch(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad prompts. Returns input_ids, positions and valid, each [B, S]."""
    s = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), s), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), s, dtype=torch.bool)
    for i, p in enumerate(prompts):
        if p:
            ids[i, s - len(p) :] = torch.tensor(p)
            valid[i, s - len(p) :] = True
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), positions.to(device), valid.to(device)


def keep_host_heap() -> None:
    """Keep freed mid-sized host blocks in the heap (glibc only; an explicit MALLOC_* setting wins).

    By default glibc hands blocks above 128 KiB back to the OS on free and takes fresh zeroed pages on the
    next allocation. A CPU decode step allocates dozens of such temporaries per layer (scores over the
    context, fetched rows), so it pays page faults on every one: measured on SmolLM2 at 8k context on the
    2-core VM, infinigen 160 -> 118 ms per step, full 131 -> 129. Blocks up to 32 MiB now come from the heap,
    and the heap is not trimmed; the process keeps its peak footprint instead."""
    if not sys.platform.startswith("linux") or any(k.startswith("MALLOC_") for k in os.environ):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


class Engine:
    """Loads a bundle once; `generate` runs batches of prompts through one KV policy."""

    def __init__(
        self, bundle: Bundle, device: str = "auto", dtype: str = "auto", policy: str = "full",
        kv: KVOptions | None = None, tp: TP | None = None,
    ):  # fmt: skip
        """`tp`: this process is one rank of a tensor-parallel group (tp.py): its model, caches and speculation
        hold its share of the heads (`cfg` is that share), and every rank runs the same steps."""
        self.bundle, self.tp = bundle, tp
        self.cfg = shard_config(bundle.config, tp)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, bundle.dtype, self.device)
        self._speculation = {}  # "v": (tensors on the device, defaults), loaded once, shared by with_policy's views
        self._set_policy(policy, kv)
        if self.device.type == "cpu":
            keep_host_heap()
        self.tokenizer = Tokenizer(bundle)
        self.model = load_model(bundle, self.device, self.dtype, tp)

    @classmethod
    def from_model(
        cls, cfg, model, device: torch.device, dtype: torch.dtype, speculation: tuple[dict, dict] | None = None,
        policy: str = "full", kv: KVOptions | None = None,
    ) -> Engine:  # fmt: skip
        """An engine around a model built in memory (synthetic benchmarks): no bundle and no tokenizer.
        `speculation` is (InfiniGen tensors by bundle name, {"alpha", "dense_layers"})."""
        self = cls.__new__(cls)
        if torch.device(device).type == "cpu":
            keep_host_heap()
        self.bundle, self.cfg, self.device, self.dtype, self.tp = None, cfg, torch.device(device), dtype, None
        self.model, self.tokenizer = model, None
        if speculation is not None:  # on the device once, as a bundle's are
            speculation = {k: t.to(self.device) for k, t in speculation[0].items()}, speculation[1]
        self._speculation = {} if speculation is None else {"v": speculation}
        self._set_policy(policy, kv)
        return self

    def speculation(self) -> tuple[dict, dict]:
        """The InfiniGen tensors, on the compute device, and defaults (a one-line error for a bundle converted
        without them). Read and copied to the device once: every request's cache uses the same tensors."""
        if "v" not in self._speculation:
            tensors = shard_speculation(load_infinigen(self.bundle, self.device), self.tp)
            self._speculation["v"] = tensors, (self.bundle.meta.get("infinigen") or {}).get("defaults")
        return self._speculation["v"]

    def _set_policy(self, policy: str, kv: KVOptions | None = None) -> None:
        """The run's KV policy and its options, checked once (a request may bring its own: `with_policy`)."""
        if policy not in POLICIES:
            raise InfinigenError(f"unknown policy {policy!r}; available: {', '.join(POLICIES)}")
        kv = kv or KVOptions()
        kv.check()
        if POLICIES[policy].speculative:  # a bundle without the tensors is a one-line error
            dense = kv.dense_layers or self.speculation()[1]["dense_layers"]
            if dense >= self.cfg.num_hidden_layers:
                raise InfinigenError(
                    f"--dense-layers {dense} leaves no layer to speculate (the model has {self.cfg.num_hidden_layers})"
                )
        self.policy, self.kv = policy, kv

    def with_policy(self, policy: str, kv: KVOptions | None = None) -> Engine:
        """A view of this engine (same model and tokenizer) with another policy."""
        other = copy.copy(self)
        other._set_policy(policy, kv)
        return other

    def dense_layers(self) -> int:
        """Layers attending to everything before selection starts: the option, else the bundle's default."""
        if self.kv.dense_layers is not None:
            return self.kv.dense_layers
        if self.bundle is None:
            return self._speculation["v"][1]["dense_layers"] if self._speculation else 2
        return (self.bundle.meta.get("infinigen") or {}).get("defaults", {}).get("dense_layers", 2)

    def make_cache(self, batch: int, max_len: int, pages=None):
        return POLICIES[self.policy].build(self, batch, max_len, pages)

    def prefill(self, cache, ids, positions, valid):
        """The prompt through the model, in chunks of --prefill-chunk tokens; logits of the last position. `valid`
        None: no padding."""
        chunk = self.kv.prefill_chunk or ids.shape[1]
        for start in range(0, ids.shape[1], chunk):
            sl = slice(start, start + chunk)
            logits = self.model(ids[:, sl], positions[:, sl], cache, None if valid is None else valid[:, sl],
                                last_only=True)  # fmt: skip
        return logits[:, -1]

    def runner(self, *, max_batch: int = 8, prefill_chunk: int | None = 512, kv_tokens: int | None = None) -> Runner:
        """A step-level runner over this engine (continuous batching): see runner.py."""
        return Runner(self, max_batch=max_batch, prefill_chunk=prefill_chunk, kv_tokens=kv_tokens)

    def pool_tokens(self, max_batch: int, kv_tokens: int | None = None, kv_memory: int | None = None) -> int:
        """A paged KV pool's size in tokens for a server of `max_batch` requests: see runner.pool_tokens."""
        return pool_tokens(self, max_batch, kv_tokens, kv_memory)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int] = 64,
        sampling: SamplingParams | list[SamplingParams] | None = None,
        stop: list[str] | list[list[str]] | None = None,
        on_step: Callable[[list[list[int]]], set[int] | None] | None = None,
    ) -> tuple[list[Generation], RunStats]:
        """Generate for token-id prompts, all running together: a loop over a Runner's steps. Limits, sampling
        and stop strings are one for all rows or one per row. `on_step(generated)` sees every step's ids so far
        and may return rows to cancel."""
        b = len(prompts)
        if not prompts:
            raise InfinigenError("every prompt needs at least one token")
        limits = per_row(max_new_tokens, b, "max_new_tokens")
        params = per_row(sampling or SamplingParams(), b, "sampling")
        stops = per_row(stop or [], b, "stop", nested=True)
        # a paged pool of exactly the blocks these requests take
        need = [reserved(self, len(p), n, self.kv.prefill_chunk) for p, n in zip(prompts, limits, strict=True)]
        pool = sum(blocks(x) for x in need) * BLOCK_TOKENS
        run = self.runner(max_batch=b, prefill_chunk=self.kv.prefill_chunk, kv_tokens=pool)
        reduces = (self.tp.reduces, self.tp.reduce_s) if self.tp else None
        rids = [run.add(Request(p, n, s, x)) for p, n, s, x in zip(prompts, limits, params, stops, strict=True)]
        row = {rid: i for i, rid in enumerate(rids)}
        results: list[Generation | None] = [None] * b
        out: list[list[int]] = [[] for _ in range(b)]
        try:
            while run.has_work:
                for o in run.step():
                    out[row[o.id]] = o.token_ids
                    if o.finished:
                        results[row[o.id]] = o.generation
                if on_step is not None:
                    for i in on_step(out) or ():
                        if results[i] is None:
                            results[i] = run.abort(rids[i])
        finally:  # a failed step: the others' KV goes back too
            for rid in rids:
                run.abort(rid)
        stats = run.stats
        stats.extra = {
            "policy": self.policy,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "batch": b,
            "tensor_parallel": self.tp.size if self.tp else 1,
            **(tp_time(self.tp, reduces) if self.tp else {}),
            "generated_tokens": sum(len(r.token_ids) for r in results),
            **run.report().to_dict(),
            **memory_stats(self.device),
        }
        return results, stats
