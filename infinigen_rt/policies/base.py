"""What every KV policy is: a class of facts and rules (`KVPolicy`: its name, the options it reads, what eval sweeps,
its memory needs, how many slots a request reserves) and the selector the batch's KV store runs it as
(kv/store.py's `Selector`: which layers stay on the device, which rows a step reads). A request runs a `Policy`
value: the class with its options, checked against the engine once (`KVPolicy.configure`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from infinigen_rt.kv.attention import decode_sdpa
from infinigen_rt.kv.cache import KVReport
from infinigen_rt.kv.evict import Evicting
from infinigen_rt.kv.rows import PoolRows
from infinigen_rt.kv.store import Batch, KVStore, Plain, RequestPass, StoreStep


class KVPolicy:
    """One policy. Nothing here holds KV: the store does, as the policy's selector says."""

    name = ""
    knobs: frozenset[str] = frozenset()  # the KVOptions fields it reads (a server request may override these)
    runtime = True  # False: an evaluation device only (not for generate, serve or bench)
    speculative = False  # needs the bundle's InfiniGen tensors
    sweep: tuple[str, ...] = ()  # what `eval` sweeps: ("budget",) or ("budget", "alpha")
    scores = False  # its attention builds the score matrix itself (else SDPA's fused kernels never do)
    dense_prefill = True  # a prompt attends over its exact KV (so one prefill may serve several policies)

    @classmethod
    def configure(cls, opts, engine) -> Policy:
        """This policy with `opts` (KVOptions), checked against `engine` once: the value a request runs with. A
        policy that reads the dense layers gets the option, else the bundle's default."""
        opts.check()
        if "dense_layers" in cls.knobs:
            opts = replace(opts, dense_layers=opts.dense_layers or engine.dense_layers)
        return Policy(cls, opts)

    @classmethod
    def selector(cls, engine, opts, prefetch=None):
        """The policy as the KV store runs it (store.Selector). `prefetch` (prefetch.Lane): the runner's side stream
        or worker thread, shared by its requests."""
        raise NotImplementedError

    @classmethod
    def pool_slots(cls, opts, prompt: int, new: int, chunk: int) -> int:
        """The most token slots a request of `prompt` + `new` tokens, prefilled in chunks of at most `chunk`, ever
        holds per (sequence, KV head) in a paged pool: its reservation. Every token, unless eviction frees slots
        for reuse (the host-pool policies with a capacity)."""
        return prompt + new

    @classmethod
    def kv_bytes(cls, engine, opts, tokens: int, dtype_bytes: int) -> tuple[int, int, int]:
        """For `tokens` (sequence, KV head, slot) triples per layer: (device bytes held, host bytes held, device
        bytes read by a decode step) of KV and its bookkeeping (bench's memory model and floor)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Policy:
    """A KV policy as a request runs it: the policy class and its options, checked and resolved against the engine
    once (`KVPolicy.configure`)."""

    cls: type[KVPolicy]
    opts: object  # KVOptions, with the engine's defaults resolved

    @property
    def name(self) -> str:
        return self.cls.name

    def selector(self, engine, prefetch=None):
        return self.cls.selector(engine, self.opts, prefetch)

    def pool_slots(self, prompt: int, new: int, chunk: int) -> int:
        return self.cls.pool_slots(self.opts, prompt, new, chunk)

    def kv_bytes(self, engine, tokens: int, dtype_bytes: int) -> tuple[int, int, int]:
        return self.cls.kv_bytes(engine, self.opts, tokens, dtype_bytes)

    def with_options(self, engine, **changes) -> Policy:
        """The same policy with some options changed (a server request's overrides), configured again."""
        return self.cls.configure(replace(self.opts, **changes), engine)


def kv_layers(cfg) -> list[int]:
    """The layers whose KV a policy holds: every layer but the sliding-window ones, whose rings the store keeps on the
    device whatever the policy (window.Rings). No policy needs to know about them."""
    return cfg.global_layers


# the batch from which a pooled layer's new rows are written after attention on a CPU (Selector.attend): at a large
# batch the write then runs while the worker scores the next layer in C; at a small one the worker's speculation is
# mostly Python beside it, both threads wait for the GIL, and writing first is no slower
WRITE_AFTER = 5


class Selector:
    """A policy as the store runs it: which layers keep their KV on the device (`device_layers`), which are pooled in
    host memory (`pooled_layers`), which rows of a pooled layer a decode step reads, and how its host rows hold them
    (`layout`). The default reads every row a request holds, as it is (`offload`); a policy with nothing pooled keeps
    everything on the device (`full`)."""

    layout = Plain

    indexed = False  # a decode step needs every row's flat slots (StoreStep.idx) though nothing is pooled (h2o's)
    bucketed = False  # a GPU step sized for its bucket of STEP_BUCKET tokens (StoreStep.prepare; infinigen's)

    def __init__(self, device_layers, pooled_layers, prefetch=None, evicting: Evicting | None = None):
        """`evicting`: the pooled layers' capacity (None: every token stays)."""
        self.device_layers, self.pooled_layers = list(device_layers), list(pooled_layers)
        self.prefetch = prefetch  # the runner's lane (prefetch.Lane): rows ahead on its side stream or worker
        self.buffers: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # a GPU's fetched parts, used in turn
        self.evicting = evicting

    def attach(self, store: KVStore) -> None:
        self.store = weakref.proxy(store)  # (no cycle: the store's device memory goes with its last reference)
        if self.evicting is not None:
            self.evicting.attach(store, self.pooled_layers)

    def graphs(self) -> bool:
        """Whether a CUDA graph may replay a decode step's device work within its bucket (graphs.py): every layer on the
        device, read whole, nothing chosen per step (`full`). The others' steps are sized by their context
        (measure/capture.py lists where)."""
        return type(self) is Selector and not self.pooled_layers and self.evicting is None and not self.indexed

    def reuse(self, p: StoreStep | RequestPass, rids: list[int], n: int) -> np.ndarray:
        """How many of the n new tokens of each request of pass `p` go into slots eviction freed ([B], host)."""
        if self.evicting is None:
            return np.zeros(len(rids), dtype=np.int64)
        return self.evicting.reuse(p, rids, n)

    def written(self, batch: Batch, layer: int, k: torch.Tensor, phys: torch.Tensor, reusing=None) -> None:
        """The new keys k [B, Hkv, s, D] went into flat slots phys [B * s] of a pooled layer (a prefill or a step);
        `reusing` [B, s] (device): which of them went into slots their request freed (None: none did)."""

    def begin(self, step: StoreStep) -> None:
        """A decode step starts (step.batch is on the device)."""
        if self.evicting is not None:
            self.evicting.begin(step, step.idx, step.held[1])

    def begin_pass(self, p: RequestPass) -> None:
        """A request's prompt chunk starts (its slots and p.batch are on the device)."""
        if self.evicting is not None:
            at = torch.arange(p.start, device=self.store.device)
            self.evicting.begin(p, self.store.physical(p.batch, at[None]), None)

    def observe(self, step: StoreStep, layer: int, x: torch.Tensor) -> None:
        """Layer `layer`'s normalised input in a decode step: every row's layer-after rows can start moving."""
        j = layer + 1
        if self.prefetch is not None and self.prefetch.side_stream and j in self.store.pooled:
            self.prefetch.start(j, self.every_row, step, j)

    def every_row(self, step: StoreStep, layer: int):
        """(keys, values, ok): every row each request held before the step, as stored (their parts, [B, Hkv, T + 1,
        X] each: the last row is room for the new token); ok [B, Hkv, T] where rows are shorter than the longest,
        else None."""
        t, held = step.held
        b, h = len(step.batch.rids), self.store.n_kv
        slots = torch.arange(t, device=self.store.device).expand(b, h, t)
        ok = None if held is None else held[:, None].expand(b, h, t)
        k, v = self.gather(step, layer, slots, ok, 1, layer % 2, step.batch.old * h, step.row_table)
        return k, v, ok

    def gather(self, step: StoreStep, j: int, slots, ok, extra: int, turn: int | None = None, counted=None,
               rows=None, room: int = 0, into=None, first: int = 0, table=None):  # fmt: skip
        """Rows `slots` [B, Hkv, n] of pooled layer j for every request as stored (store.gather), counted per request:
        on a GPU the rows that count (`counted` per request, a tensor [B] or a CPU's list, where `ok` skips some; else
        all), into device buffers `turn` (two sets, used in turn by consecutive layers: a new tensor per layer, made on
        the side stream and freed on the compute stream while the host runs ahead of the copies, could not be reused
        before they caught up); on a CPU the rows it copies: those that count and one for each new token (the `extra`
        rows). `room`: rows left before the extra ones for the caller to fill (not counted: nothing of the pool's).
        `into`, `first`: where to write them; `table`: where the rows are (store.gather's)."""
        store, (b, h, n) = self.store, slots.shape
        out = None
        if store.kernel and turn is not None:
            need = [b * h * (n + room + extra) * w for _, w, _ in store.layout.parts]
            # an eighth more: rows grow (every part's alike, so the first part's size says when)
            if turn not in self.buffers or self.buffers[turn][0][0].numel() < need[0]:
                self.buffers[turn] = [tuple(torch.empty(m + m // 8, dtype=t, device=store.device) for _ in "kv")
                                      for m, (_, _, t) in zip(need, store.layout.parts, strict=True)]  # fmt: skip
            out = self.buffers[turn]
        k, v = store.gather(j, step.batch, slots, ok, room + extra, out, rows, into, first, table)
        if ok is None:
            copied = n * h + (0 if store.kernel else extra * h)
        else:  # what counts (the kernel and a CPU copy only that), and on a CPU the new tokens' rows
            counted = ok.sum((1, 2)) if counted is None else counted  # (a tensor, or a CPU's list)
            if store.kernel or not extra:
                copied = counted
            else:
                copied = [c + extra * h for c in counted] if isinstance(counted, list) else counted + extra * h
        store.ledger.add(f"h2d{j}", step.batch.rids, copied, store.row_bytes)
        return k, v

    def rows(self, step: StoreStep, layer: int, q: torch.Tensor):
        """(keys, values, ok) that a pooled layer attends in a decode step (see every_row; under a capacity, where a
        request of the step freed slots, ok: the rows still held); q: the layer's query."""
        if self.prefetch is not None and layer in self.prefetch:
            k, v, ok = self.prefetch.result(layer)
        else:
            k, v, ok = self.every_row(step, layer)
        if self.evicting is not None and step.holes:
            ok = self.evicting.alive(step, layer)
        return k, v, ok

    def attend(self, step: StoreStep, layer: int, q, k, v) -> torch.Tensor:
        """A decode step's layer for the whole batch: each row's new k, v [B, Hkv, 1, D] written, q [B, H, 1, D]
        attended over its rows (a device layer: every one; a pooled layer: those `rows` chooses, and its own as
        stored, decoded with them)."""
        store = self.store
        if layer in store.device_layers:
            slots, batch = step.dense
            store.write(layer, slots, k, v)
            return store.attend(layer, q, batch, k, v)
        keys, values, ok = self.rows(step, layer, q)  # the rows held before (and their reads) first
        slots = step.slots if self.evicting is None else self.evicting.place(step, layer)  # (after the reads)
        store.ledger.add("d2h", step.rids, k.shape[1] * store.row_bytes)

        def put(last=None):  # the new rows into the pool (and into `last`: store.write), the policy's record of them
            out = store.write(layer, slots, k, v, step.new_rows if self.evicting is None else None, last)
            self.written(step.batch, layer, k, slots, None if self.evicting is None else step.reusing)
            return out

        if isinstance(keys, PoolRows):  # read where the pool holds them
            # attention takes the new rows as they are and nothing else in the step reads them in the pool: from
            # WRITE_AFTER on they are written after attention, while the worker scores the next layer's keys in C,
            # not in the gap between the correction's share and attention's where the worker waits for its share
            after = self.evicting is None and len(step.rids) >= WRITE_AFTER
            new = (store.layout.encode(k), store.layout.encode(v)) if after else put()
            out = keys.attend(q, *(store.layout.decode(x) for x in new))
            if after:
                put()
            return out
        new = put((keys, values) if store.kernel else None)  # the kernel writes the new rows after the held ones
        if not store.kernel:
            for held, parts in zip((keys, values), new, strict=True):
                for x, y in zip(held, parts, strict=True):
                    x[:, :, -1:] = y
        keys, values = store.layout.decode(keys), store.layout.decode(values)
        mask = None
        if q.device.type == "cpu":  # a KV head's query heads as query positions (decode_sdpa)
            if ok is not None:  # [B, Hkv, 1, n + 1]: the rows that count, and the new token's
                mask = torch.cat([ok, torch.ones_like(ok[..., :1])], -1)[:, :, None]
            return decode_sdpa(q, keys.to(q.dtype), values.to(q.dtype), mask)
        if ok is not None:  # [B, H, 1, n + 1]
            group = q.shape[1] // ok.shape[1]
            ok = ok.repeat_interleave(group, 1) if group > 1 else ok
            mask = F.pad(ok, (0, 1), value=True)[:, :, None]  # (one op where ones and a cat were two)
        return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                              enable_gqa=keys.shape[1] != q.shape[1])  # fmt: skip

    def attend_pass(self, p: RequestPass, layer: int, q, k, v) -> torch.Tensor:
        """A request's prompt chunk: its k, v [1, Hkv, s, D] written, q [1, H, s, D] attended causally over its
        earlier rows (read from the device, or gathered from host memory for a pooled layer) and the chunk's (a
        pooled layer's as stored, decoded with the earlier ones)."""
        store = self.store
        gqa = k.shape[1] != q.shape[1]
        pooled = layer in store.pooled
        slots, mask = (p.slots, p.mask) if pooled else (p.dense[0], p.dense_mask)
        if pooled and self.evicting is not None:  # as in a decode step
            if p.holes:  # [1, H, s, T + s]: the rows still held, and the chunk's own causally
                alive = self.evicting.alive(p, layer).repeat_interleave(q.shape[1] // k.shape[1], 1)[:, :, None]
                mask = mask & torch.cat([alive, alive.new_ones(*alive.shape[:3], k.shape[2])], -1)
            slots = self.evicting.place(p, layer)
        new = store.write(layer, slots, k, v)
        if pooled:
            store.ledger.add("d2h", [p.rid], k.shape[1] * k.shape[2] * store.row_bytes)
            self.written(p.batch, layer, k, slots, None if self.evicting is None else p.reusing)
        if p.held is None:  # a first chunk: nothing earlier to read
            if pooled:
                k, v = store.layout.decode(new[0]), store.layout.decode(new[1])
            return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=gqa)
        if pooled:  # the earlier rows from host memory, then the chunk's own
            t, h = p.start, store.n_kv
            slots = torch.arange(t, device=store.device).expand(1, h, t)
            held = store.gather(layer, p.batch, slots, None, extra=0)
            store.ledger.add(f"h2d{layer}", [p.rid], t * h * store.row_bytes)
            keys, values = (store.layout.decode(tuple(torch.cat(x, 2) for x in zip(old, parts, strict=True)))
                            for old, parts in zip(held, new, strict=True))  # fmt: skip
        else:
            keys = store.rows_of(store.k[layer], p.rid, p.held)  # [1, Hkv, T, D]
            values = store.rows_of(store.v[layer], p.rid, p.held)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)

    def end(self, p: StoreStep | RequestPass) -> None:
        """A pass through the store is over (a decode step's, or a request's prompt chunk): a capacity evicts."""
        if self.evicting is not None:
            self.evicting.evict(p)

    def report(self, rid: int, r: KVReport) -> None:
        """Fill in the policy's fields of request `rid`'s report."""
