"""The one KV store for the running batch: every running request's KV, and one decode step for all of them.

Every request's KV lives in the same buffers, in blocks of BLOCK token slots of the runner's paged pool
(paged.PagedStore: its allocator and its host buffers). A layer whose KV stays on the compute device keeps keys and
values [Hkv, slots, D] there (each head's rows contiguous: a request whose blocks are one run is a view, as
attention reads it); a pooled layer keeps them in the paged pool's host buffers (page-locked when a GPU computes),
from which one gather brings the rows a step reads, for the whole batch.
A request's table lists its blocks; a step's `Batch` is the tables and lengths of the requests it runs, on the
device, so that a layer writes the step's new rows, chooses, gathers and attends for the whole batch in a few
launches, whatever the batch size.

What a policy decides is its `Selector`: which layers stay on the device, which rows of a pooled layer a step reads
(and what it keeps beside them: InfiniGen's speculation keys), and how a pooled layer's host rows hold them (its
`layout`: as they are, or int4's codes). The store is the mechanism: slots, tables, copies, attention, and the counts
of what moved (`Ledger`, per request).

Under a capacity (KVOptions.capacity: offload's, int4's, infinigen's) a request keeps at most that many tokens per
(pooled layer, KV head), and its new tokens reuse the slots it freed (`Evicting`): its
pool slots (`length`) are then fewer than its tokens (`seen`), and the device layers (infinigen's dense ones, which
keep every token) have blocks and tables of their own (`dense`).

A sliding-window layer (Gemma 3's local layers, Mistral's) keeps, whatever the policy, a ring of its last W tokens
per request on the device (window.Rings): the store attends it itself, and no selector ever sees those layers.

Invariants (`check`): the allocator's (and the dense one's); every request's length fits its reservation, the
tokens it holds under a capacity its slots, its tokens its dense table; a released request holds nothing; every
request holds one ring row, and no ring row is lost.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from infinigen_rt.kv import cpu
from infinigen_rt.kv.attention import decode_sdpa, paged_decode
from infinigen_rt.kv.cache import KVCache, KVReport, causal_mask
from infinigen_rt.kv.kernels import scatter_rows
from infinigen_rt.kv.paged import BlockAllocator, PagedStore
from infinigen_rt.kv.pool import copy_rows, victims
from infinigen_rt.kv.window import Rings
from infinigen_rt.system import to_device

BLOCK = 16


@dataclass
class Batch:
    """The requests a step runs, in its rows' order: their block tables [B, max_blocks] int32 and lengths [B] int32
    on the device (the lengths after the step's new tokens), and on the host the rows each held before the step
    (`old`, int64 [B])."""

    rids: list[int]
    table: torch.Tensor
    lengths: torch.Tensor
    longest: int
    old: np.ndarray

    def held(self) -> tuple[int, torch.Tensor | None]:
        """(T, held): the longest row's rows before the step, and [B, T] bool of the rows each holds (None: all hold
        T, known on the host)."""
        t = int(self.old.max())
        if (self.old == t).all():
            return t, None
        old = to_device(torch.from_numpy(self.old), self.table.device)
        return t, torch.arange(t, device=self.table.device) < old[:, None]


# the batch from which a pooled layer's new rows are written after attention on a CPU (Selector.attend): at a large
# batch the write then runs while the worker scores the next layer in C; at a small one the worker's speculation is
# mostly Python beside it, both threads wait for the GIL, and writing first is no slower
WRITE_AFTER = 5
LEDGER_HELD = 4096  # host counts a ledger keeps before it sums them (see Ledger.add)


class Ledger:
    """What moved, per request: counts added each step (host ints, or device tensors [B] of the step's rows), read
    to the host in one copy when a report asks (never inside a decode step)."""

    def __init__(self):
        self.pending: list[tuple[str, list[int], torch.Tensor, float]] = []
        self.later: list[tuple[str, tuple[int, ...], object, float]] = []  # host counts not yet summed (see add)
        self.total: dict[tuple[str, int], float] = defaultdict(float)
        self.top: dict[tuple[str, int], float] = {}

    def add(self, key: str, rids: list[int], counts, scale: float = 1.0) -> None:
        """counts (times `scale`): a number for every row, or [B] (host or device: a device tensor is kept as it is,
        no launch)."""
        if isinstance(counts, torch.Tensor):
            if counts.device.type != "cpu":
                self.pending.append((key, rids, counts, scale))
                return
            counts = counts.tolist()
        elif isinstance(counts, np.ndarray):
            counts = counts.tolist()
        # plain Python from here: a few calls a layer and request, each step (numpy's per-call overhead is larger
        # than the work); summed when read, not one by one
        if isinstance(counts, list) and len(counts) not in (1, len(rids)):
            raise ValueError(f"{len(counts)} counts for {len(rids)} requests")
        self.later.append((key, tuple(rids), counts, scale))  # (as they are now)
        if len(self.later) >= LEDGER_HELD:
            self._sum()

    def _sum(self) -> None:
        later, self.later = self.later, []
        for key, rids, counts, scale in later:
            if not isinstance(counts, list):
                counts = [counts] * len(rids)
            elif len(counts) == 1:
                counts = counts * len(rids)
            for r, c in zip(rids, counts, strict=True):
                self._put(key, r, float(c) * scale)

    def _put(self, key: str, rid: int, c: float) -> None:
        self.total[key, rid] += c
        self.top[key, rid] = max(self.top.get((key, rid), c), c)

    def settle(self) -> None:
        self._sum()
        if not self.pending:
            return
        got = torch.cat([c.double().reshape(-1) for _, _, c, _ in self.pending]).tolist()
        at = 0
        for key, rids, _, scale in self.pending:
            for r in rids:
                self._put(key, r, got[at] * scale)
                at += 1
        self.pending = []

    def get(self, key: str, rid: int) -> float:
        self._sum()
        return self.total.get((key, rid), 0.0)

    def max(self, key: str, rid: int) -> float | None:
        self._sum()
        return self.top.get((key, rid))

    def forget(self, rid: int) -> None:
        self.settle()
        for d in (self.total, self.top):
            for k in [k for k in d if k[1] == rid]:
                del d[k]


class Plain:
    """How a pooled layer's host rows hold one KV head's keys (or values) of a token: as they are, in the store's
    dtype. A layout's `parts` are the host tensors a row is kept in, (name suffix, width, dtype) each; the store
    writes what `encode` makes of the new rows ([..., D] -> its parts [..., width]) and moves parts, and attention
    reads what `decode` makes of them on the device (after the gather, the new tokens' parts in their last rows: a
    policy that stores rows otherwise, int4's codes, decodes once a layer for the whole batch)."""

    def __init__(self, head_dim: int, dtype: torch.dtype):
        self.dtype = dtype
        self.parts = [("", head_dim, dtype)]

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x.to(self.dtype),)

    def decode(self, parts) -> torch.Tensor:
        return parts[0]


class KVStore:
    """The batch's KV: `device_layers` on the compute device, the rest of `selector.layers` pooled in `host`'s
    buffers (as the selector's layout holds them), under `host`'s block tables; the device layers under tables of
    their own (`dense`) where a capacity holds a request's pooled tokens in fewer slots than it has tokens."""

    def __init__(self, host: PagedStore, selector: Selector, cfg, device, dtype, rows: int = 1,
                 context: int | None = None):  # fmt: skip
        """`rows`: the most requests it holds at once (the runner's max_batch): the sliding layers' rings, and with
        `context` (the most tokens a request reaches) the device layers' own blocks (see device_slots)."""
        assert host.alloc.block_size == BLOCK
        self.host, self.alloc, self.selector = host, host.alloc, selector  # (its buffers live as long as it)
        self.device = torch.device(device)
        self.n_kv, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        slots = host.alloc.n_blocks * BLOCK
        self.device_layers = set(selector.device_layers)
        self.pooled = set(selector.pooled_layers)
        dense = self.device_slots(host, selector, rows, context)
        self.dense = BlockAllocator(dense // BLOCK, BLOCK) if self.apart(selector) else self.alloc
        shape = (self.n_kv, dense, self.head_dim)
        self.k = {i: torch.zeros(shape, device=self.device, dtype=dtype) for i in self.device_layers}
        self.v = {i: torch.zeros(shape, device=self.device, dtype=dtype) for i in self.device_layers}
        self.layout = selector.layout(self.head_dim, dtype)
        for i in self.pooled:  # each part's slot-major host rows [slots, Hkv, X]: a new token's rows one run
            for name, side in (("k", self.k), ("v", self.v)):
                side[i] = tuple(host.buffer(name + part, i, (self.n_kv, w), t).view(slots, self.n_kv, -1)
                                for part, w, t in self.layout.parts)  # fmt: skip
        self.kernel = self.device.type == "cuda"  # pooled rows by the row kernels (tests: the interpreter)
        # one token's K and V for one KV head, as a pooled layer holds them
        self.row_bytes = 2 * sum(w * t.itemsize for _, w, t in self.layout.parts)
        self.length: dict[int, int] = {}  # pool slots taken per request (host): its tokens, but under a capacity
        self.seen: dict[int, int] = {}  # tokens written per request (host)
        self.ledger = Ledger()
        self.heads: dict = {}  # Hkv -> arange(Hkv) [1, Hkv, 1] on a CPU (gather's, made once)
        self.rings = Rings(cfg, rows, device, dtype) if cfg.sliding_layers else None  # the sliding layers' KV
        self.sliding = set(cfg.sliding_layers)
        selector.attach(self)

    @staticmethod
    def apart(selector: Selector) -> bool:
        """Whether the device layers have blocks of their own: under a capacity, whose requests reserve the slots
        their pooled layers reach (eviction frees slots they reuse: Offload.pool_slots), while a device layer
        (InfiniGen's dense ones) keeps every token."""
        return selector.evicting is not None and bool(selector.device_layers)

    @classmethod
    def device_slots(cls, host: PagedStore, selector: Selector, rows: int, context: int | None) -> int:
        """The device layers' token slots: the pool's, under its tables; or apart (see `apart`), `rows` requests of
        `context` tokens in blocks of their own, each request's table growing with its tokens."""
        return rows * -(-context // BLOCK) * BLOCK if cls.apart(selector) else host.alloc.n_blocks * BLOCK

    def admit(self, rid: int) -> None:
        """Request `rid`, whose blocks the paged pool's allocator holds already."""
        self.length[rid] = self.seen[rid] = 0
        if self.rings is not None:
            self.rings.admit(rid)

    def release(self, rid: int) -> None:
        self.length.pop(rid, None)
        self.seen.pop(rid, None)
        if self.dense is not self.alloc:
            self.dense.release(rid)
        if self.selector.evicting is not None:
            self.selector.evicting.release(rid)
        if self.rings is not None:
            self.rings.release(rid)
        self.ledger.forget(rid)

    def append(self, rids: list[int], n: int, reused: np.ndarray | None = None) -> torch.Tensor:
        """Each request of `rids` takes token slots for `n` new tokens: its next ones, but for the first reused[b]
        (host; None: none), which go into slots eviction freed (a selector with a capacity places those: Evicting).
        Their flat slot numbers [B * n] on the device (one copy up, not waited for), in row order, 0 for the reused
        ones. The lengths (slots taken) advance on the host."""
        slots = np.zeros((len(rids), n), dtype=np.int64)
        reused = np.zeros(len(rids), dtype=np.int64) if reused is None else reused
        for i, (r, u) in enumerate(zip(rids, reused.tolist(), strict=True)):
            slots[i, u:] = self.alloc.slots(r, self.length[r], n - u)
            self.length[r] += n - u
            self.seen[r] += n
        return to_device(torch.from_numpy(slots.reshape(-1)), self.device)

    def dense_pass(self, p: StoreStep | RequestPass, rids: list[int], n: int) -> tuple[torch.Tensor, Batch]:
        """The device layers' (slots, batch) of pass p, whose requests `rids` brought n tokens each (appended
        already): the pass's own, but where the device layers have tables of their own (see device_slots)."""
        if self.dense is self.alloc:
            return p.slots, p.batch
        slots = []
        for r in rids:
            self.dense.grow(r, self.seen[r])
            slots.append(self.dense.slots(r, self.seen[r] - n, n))
        return to_device(torch.from_numpy(np.concatenate(slots)), self.device), self.tables(self.dense, self.seen,
                                                                                           rids, n)  # fmt: skip

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """k, v [B, Hkv, n, D] into `slots` [B * n] (from `append`), or for a pooled layer each head's own flat
        slots [B, Hkv, n] (a capacity's reused ones: Evicting.place): one copy per tensor (a pooled layer: per part)
        for the whole batch. A pooled layer's rows go to host memory as its layout encodes them: on a GPU the scatter
        kernel writes them into the pinned pages, on a CPU index_copy; it returns them, (keys' parts, values' parts)
        [B, Hkv, n, X] each on the device, for attention to read the new tokens as stored."""
        if layer in self.pooled:
            h = self.n_kv
            head = torch.arange(h, device=slots.device)
            if slots.dim() == 1:  # every head's the same
                rows = (slots[:, None] * h + head).reshape(-1)  # [B * n * Hkv], token-major
            else:
                rows = (slots * h + head[:, None]).transpose(1, 2).reshape(-1)
            stored = self.layout.encode(k), self.layout.encode(v)
            for bufs, parts in zip((self.k[layer], self.v[layer]), stored, strict=True):
                for buf, x in zip(bufs, parts, strict=True):
                    src = x.transpose(1, 2).reshape(-1, x.shape[-1])  # [B * n * Hkv, X], rows in the same order
                    flat = buf.view(-1, buf.shape[-1])
                    if self.kernel:
                        scatter_rows(flat, rows, src)
                    else:
                        flat.index_copy_(0, rows.to(flat.device), src.to(flat.device, flat.dtype))
            return stored
        heads = lambda x: x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])  # noqa: E731  [Hkv, B * n, D]
        self.k[layer].index_copy_(1, slots, heads(k).to(self.k[layer].dtype))
        self.v[layer].index_copy_(1, slots, heads(v).to(self.v[layer].dtype))

    def physical(self, batch: Batch, slots: torch.Tensor) -> torch.Tensor:
        """Token slots [B, ..., n] of each row's own sequence -> their flat slot numbers in the buffers, through the
        tables, on the device."""
        b = slots.shape[0]
        blocks = torch.gather(batch.table.long(), 1, (slots // BLOCK).reshape(b, -1)).view(slots.shape)
        return blocks * BLOCK + slots % BLOCK

    def gather(self, layer: int, batch: Batch, slots: torch.Tensor, ok: torch.Tensor | None, extra: int = 1,
               out=None, phys: torch.Tensor | None = None, into=None):  # fmt: skip
        """The K and V rows of every row's `slots` [B, Hkv, n] from pooled layer `layer` as stored, in one copy per
        part for the batch: (keys' parts, values' parts), each [B, Hkv, n + extra, X] on the device (the `extra` last
        rows: room for the new tokens), to decode (the layout's). On a GPU the row kernel reads them from pinned
        memory, skipping those where `ok` is False; on a CPU, index_select. `out`: flat device buffers, a (keys,
        values) pair per part, to fill instead of new tensors (the kernel only). `phys`: the slots' flat slot numbers
        where the caller has them (see physical; [B, 1, n] where every head's are the same). `into` (a CPU): the
        (keys, values) tensors [B, Hkv, n + extra, X] of each part to write, windows of larger ones (the room a
        speculated gather left for the correction), returned as they are."""
        b, h, n = slots.shape
        keys, values = self.k[layer], self.v[layer]
        if into is not None:
            out = into
        elif out is None:
            out = [tuple(torch.empty(b, h, n + extra, x.shape[-1], dtype=x.dtype, device=self.device) for _ in "kv")
                   for x in keys]  # fmt: skip
        else:
            out = [tuple(o[: b * h * (n + extra) * x.shape[-1]].view(b, h, n + extra, x.shape[-1]) for o in pair)
                   for pair, x in zip(out, keys, strict=True)]  # fmt: skip
        got = tuple(o for o, _ in out), tuple(o for _, o in out)
        # each row's KV head [1, Hkv, 1]: a CPU's made once (a GPU's each call, a launch the projection counts)
        head = self.heads.get(h) if slots.device.type == "cpu" else None
        if head is None:
            head = torch.arange(h, device=slots.device).view(1, h, 1)
            if slots.device.type == "cpu":
                self.heads[h] = head
        if ok is not None and not self.kernel and bool(ok.all()):  # a CPU reads ok for free: every row counts
            ok = None
        if ok is None or self.kernel:  # the kernel writes zeros where ok is False
            phys = self.physical(batch, slots) if phys is None else phys
            rows = phys * h + head
            for src_k, src_v, (out_k, out_v) in zip(keys, values, out, strict=True):
                copy_rows(src_k, src_v, rows, ok, out_k, out_v, self.kernel)
            return got
        # a CPU, where rows do not all count: only those that do are copied (and, as index_select does, a row for
        # each new token), the others are zeros (never unwritten memory: NaN bits would poison attention's sum)
        slots = torch.cat([torch.where(ok, slots, 0), slots.new_zeros(b, h, extra)], -1)
        keep = torch.cat([ok.expand(b, h, n), ok.new_ones(b, h, extra)], -1).reshape(-1).nonzero().squeeze(1)
        rows = (self.physical(batch, slots) * h + head).reshape(-1)[keep]
        for src, dst in zip(keys + values, got[0] + got[1], strict=True):
            w = src.shape[-1]
            flat = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
            flat.zero_()
            flat.view(-1, w).index_copy_(0, keep, src.view(-1, w).index_select(0, rows).to(dst.dtype))
            if flat is not dst:  # a window of a larger tensor (`into`)
                dst.copy_(flat)
        return got

    def batch(self, rids: list[int], new: int | np.ndarray = 1) -> Batch:
        """The step's tables and lengths on the device (two copies up, not waited for); `new`: the slots each row
        took (appended already; per row where a capacity reuses freed ones)."""
        return self.tables(self.alloc, self.length, rids, new)

    def tables(self, alloc: BlockAllocator, length: dict[int, int], rids: list[int], new) -> Batch:
        """A Batch of `alloc`'s tables and `length`'s lengths (see batch)."""
        tables = [alloc.tables[r] for r in rids]
        width = max(len(t) for t in tables)
        table = np.zeros((len(rids), width), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        lengths = np.array([length[r] for r in rids], dtype=np.int32)
        return Batch(rids, to_device(torch.from_numpy(table), self.device),
                     to_device(torch.from_numpy(lengths), self.device), int(lengths.max()),
                     lengths.astype(np.int64) - new)  # fmt: skip

    def attend(self, layer: int, q: torch.Tensor, batch: Batch) -> torch.Tensor:
        """One query token per row, q [B, H, 1, D] (its own row already written), over each row's keys of a device
        layer: [B, H, 1, D]. A GPU attends for the whole batch in one kernel; a CPU row by row over views of each
        request's blocks where they are one run (the gather the reference makes would double its KV's memory
        traffic), gathered where they are not; the rows shared with the worker
        where a speculative policy lends it (cpu.each: its dense layers, while it has nothing to speculate)."""
        k, v = self.k[layer], self.v[layer]
        if self.device.type != "cpu":
            return paged_decode(q, k, v, batch.table, batch.lengths, BLOCK, batch.longest)
        out = [None] * len(batch.rids)

        def row(i: int) -> None:
            rid = batch.rids[i]
            n = self.seen[rid]
            keys, values = self.rows_of(k, rid, n), self.rows_of(v, rid, n)  # [1, Hkv, n, D]
            out[i] = decode_sdpa(q[i : i + 1], keys, values)

        cpu.each(len(batch.rids), row)
        return torch.cat(out)

    def rows_of(self, buf: torch.Tensor, rid: int, n: int) -> torch.Tensor:
        """Request `rid`'s first n rows of a device buffer [Hkv, slots, D] as [1, Hkv, n, D]: a view where its blocks
        are one run, else a gather."""
        table = self.dense.tables[rid][: -(-n // BLOCK)]
        if table == list(range(table[0], table[0] + len(table))):
            return buf[None, :, table[0] * BLOCK : table[0] * BLOCK + n]
        return buf[None, :, torch.from_numpy(self.dense.slots(rid, 0, n)).to(buf.device)]

    def report(self, rid: int) -> KVReport:
        """What request `rid` moved so far (settles the device counts: not inside a decode step)."""
        self.ledger.settle()
        led = self.ledger
        h2d = [round(led.get(f"h2d{i}", rid)) for i in range(max(self.pooled, default=-1) + 1)]
        r = KVReport(bytes_h2d=sum(h2d), bytes_d2h=round(led.get("d2h", rid)), kv_fetched_share=1.0,
                     kv_attended_share=1.0, evictions=round(led.get("evictions", rid)),
                     per_layer={"bytes_h2d": h2d} if self.pooled else None)  # fmt: skip
        self.selector.report(rid, r)
        return r

    def check(self) -> None:
        """Raise AssertionError when an invariant (module docstring) does not hold."""
        self.alloc.check()
        assert set(self.length) <= set(self.alloc.tables), "a request's length without its table"
        if self.dense is not self.alloc:
            self.dense.check()
            for rid, n in self.seen.items():
                assert n <= self.dense.reserved.get(rid, 0), f"request {rid}'s device rows past its dense table"
        for rid, n in self.length.items():
            assert n <= self.alloc.reserved[rid], f"request {rid} wrote {n} tokens past its reservation"
            held = self.selector.evicting.held.get(rid, 0) if self.selector.evicting is not None else n
            assert held <= n, f"request {rid} holds {held} tokens in {n} slots"
        if self.rings is not None:
            assert set(self.rings.row) == set(self.length), "a request without its ring, or a ring without one"
            rows = sorted([*self.rings.row.values(), *self.rings.free])
            assert rows == list(range(self.rings.rows)), "a ring row lost or held twice"


class Evicting:
    """A capacity in the store (KVOptions' capacity, eviction and window): after every pass each request keeps at most
    that many tokens per (pooled layer, KV head), and its new tokens go into the slots it freed before it takes more,
    so its reservation is what Offload.pool_slots replays. On the device, the position each (pooled layer, KV head,
    flat slot) holds, -1 where free, with a last sink slot that never holds one (where the rows of a pass shorter than
    its longest look), and beside it, for a policy that selects rows and evicts by counter or lru, each slot's times
    selected or last pass selected (`key`); on the host, per request, the tokens it holds per head (the same for every
    head and layer: each evicts as many), and whether it ever freed a slot: no pass reads the device.

    offload and int4 never select rows, so their counters stay zero and every eviction frees the oldest tokens (the
    ranking's tie-break), whichever `eviction`."""

    def __init__(self, opts, selects: bool = False):
        """`selects`: the policy marks the rows it selects (`mark`), which counter and lru evict by."""
        self.opts = opts
        self.key = opts.eviction if selects and opts.eviction != "fifo" else None
        self.held: dict[int, int] = {}
        self.holes: set[int] = set()
        self.passes = 0  # lru's clock: the passes so far (a request's own count orders its slots alike)

    @classmethod
    def of(cls, opts, selects: bool = False) -> Evicting | None:
        """Options' capacity, if they set one."""
        return None if opts.capacity is None else cls(opts, selects)

    def attach(self, store: KVStore, layers: list[int]) -> None:
        self.store = weakref.proxy(store)
        self.at = {layer: i for i, layer in enumerate(layers)}  # a layer's row of the state
        self.sink = store.alloc.n_blocks * BLOCK
        self.pos = torch.full((len(layers), store.n_kv, self.sink + 1), -1, dtype=torch.int32, device=store.device)
        self.score = torch.zeros_like(self.pos) if self.key is not None else None  # hits (counter), last (lru)

    def release(self, rid: int) -> None:
        self.held.pop(rid, None)
        self.holes.discard(rid)

    def reuse(self, p, rids: list[int], n: int) -> np.ndarray:
        """Of its n new tokens a request puts min(freed, n) into freed slots (freed: the slots
        it took less the tokens it holds), and those come first. Returns them per request ([B], host); the counts
        advance, and pass p keeps its new tokens' positions ([B, n] on the device), which of them reuse a slot
        (`reusing` [B, n] on the device, None where none does), the tokens each request held per head before it
        (`kept` [B], host) and whether a request of it freed any (`holes`)."""
        store = self.store
        seen = np.array([store.seen[r] for r in rids], dtype=np.int64)
        held = np.array([self.held.get(r, 0) for r in rids], dtype=np.int64)
        reused = np.minimum(np.array([store.length[r] for r in rids], dtype=np.int64) - held, n)
        for r, b in zip(rids, held.tolist(), strict=True):
            self.held[r] = b + n
        self.passes += 1
        p.kept = held
        cols = np.arange(n)
        p.newpos = to_device(torch.from_numpy((seen[:, None] + cols).astype(np.int32)), store.device)
        p.reusing = to_device(torch.from_numpy(cols < reused[:, None]), store.device) if reused.any() else None
        p.holes = any(r in self.holes for r in rids)
        return reused

    def begin(self, p, idx: torch.Tensor, held: torch.Tensor | None) -> None:
        """Pass p starts: `p.at` [B, T], the flat slots of the rows each request held before it (idx [B, T], where
        `held` [B, T], None: all), the sink beyond them."""
        p.at = idx if held is None else torch.where(held, idx, self.sink)

    def positions(self, p, layer: int) -> torch.Tensor:
        """[B, Hkv, T]: the position each of the rows held before pass p holds in pooled layer `layer`, -1 where it
        was freed or is not the row's (before the pass's new tokens go in)."""
        return self.pos[self.at[layer]][:, p.at].transpose(0, 1)

    def alive(self, p, layer: int) -> torch.Tensor:
        """[B, Hkv, T]: whether each of the rows held before pass p still holds a token in pooled layer `layer`."""
        return self.positions(p, layer) >= 0

    def mark(self, p, layer: int, slots: torch.Tensor, ok: torch.Tensor | None) -> None:
        """Pass p selected rows `slots` [B, Hkv, n] (of those held before it; where `ok`, None: all) of pooled layer
        `layer`: counted for counter's and lru's ranking."""
        if self.key is None:
            return
        h = slots.shape[1]
        flat = torch.gather(p.at[:, None].expand(-1, h, -1), 2, slots).transpose(0, 1).reshape(h, -1)  # [Hkv, B * n]
        ok = None if ok is None else ok.transpose(0, 1).reshape(h, -1)
        state = self.score[self.at[layer]]
        if self.key == "counter":
            state.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.int32) if ok is None else ok.to(torch.int32))
        else:
            state.scatter_(1, flat, self.passes if ok is None else torch.where(ok, self.passes, state.gather(1, flat)))

    def place(self, p, layer: int) -> torch.Tensor:
        """Where pass p's new tokens go in pooled layer `layer` (their positions noted): its slots p.slots [B * n]
        where no request reuses one; else each head's own [B, Hkv, n]: a request's lowest freed slots first, in its
        new tokens' order, then its fresh ones."""
        pos = self.pos[self.at[layer]]  # [Hkv, S + 1]
        if p.reusing is None:
            pos[:, p.slots] = p.newpos.view(1, -1)
            if self.score is not None:  # a new token's count starts afresh (the slot may have been another's)
                self.score[self.at[layer]][:, p.slots] = 0
            return p.slots
        (b, n), h = p.newpos.shape, pos.shape[0]
        got = pos[:, p.at]  # [Hkv, B, T]
        free = (got < 0) & (p.at != self.sink)
        order = free.to(torch.int8).sort(dim=-1, descending=True, stable=True).indices[..., :n]  # lowest freed first
        freed = torch.gather(p.at.expand(h, -1, -1), 2, order).transpose(0, 1)  # [B, Hkv, min(n, T)]
        freed = F.pad(freed, (0, n - freed.shape[-1]))
        slots = torch.where(p.reusing[:, None], freed, p.slots.view(b, 1, n))
        flat = slots.transpose(0, 1).reshape(h, -1)
        pos.scatter_(1, flat, p.newpos.view(1, -1).expand(h, -1).contiguous())
        if self.score is not None:
            self.score[self.at[layer]].scatter_(1, flat, 0)
        return slots

    def evict(self, p) -> None:
        """After pass p, every request of it keeps at most its capacity per (pooled layer, KV head), never fewer than
        the window (whose tokens stay): the others freed, counter's, lru's or fifo's victims (pool.victims), and
        counted per request."""
        store, rids, window = self.store, p.batch.rids, self.opts.window
        seen = np.array([store.seen[r] for r in rids], dtype=np.int64)
        held = np.array([self.held[r] for r in rids], dtype=np.int64)
        over = np.clip(held - np.maximum(self.opts.capacity_tokens(seen), window), 0, None)
        if not over.any():
            return
        fill = np.array([store.length[r] for r in rids], dtype=np.int64)
        t = int(fill.max())
        fill_d, newest, over_d = to_device(torch.from_numpy(np.stack([fill, seen - 1, over])), store.device)
        at = torch.arange(t, device=store.device)
        at = torch.where(at < fill_d[:, None], store.physical(p.batch, at.expand(len(rids), t)), self.sink)
        for i in range(len(self.at)):  # a layer at a time: the ranking's temporaries are a layer's
            pos = self.pos[i][:, at]  # [Hkv, B, T]
            key = None if self.score is None else self.score[i][:, at]
            self.pos[i][:, at] = pos.masked_fill(victims(pos, key, pos > (newest[:, None] - window), over_d), -1)
        for r, o in zip(rids, over.tolist(), strict=True):
            if o:
                self.held[r] -= o
                self.holes.add(r)
        store.ledger.add("evictions", rids, over * store.n_kv * len(self.at))


@dataclass
class PoolRows:
    """What a CPU's decode step attends in a pooled layer, read where the pool holds it (no copy: on a CPU the
    host pool is the memory attention reads): the layer's pool src_k, src_v (one part each: Plain) and `rows`, one or
    two [B, Hkv, n_i] int64 (flat slot x Hkv + KV head, -1 where a row does not count), then each row's new token.
    `prefetch`: the selector's, whose worker thread takes a share of the (sequence, KV head) pairs before the next
    layer's speculation held for it starts (prefetch.beside)."""

    src_k: torch.Tensor
    src_v: torch.Tensor
    rows: list[torch.Tensor]
    prefetch: object = None

    def attend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """q [B, H, 1, D] over the rows and then k_new, v_new [B, Hkv, 1, D]: the kernel's, or where it does not
        apply the rows gathered and SDPA (masked where a row does not count)."""
        lend = self.prefetch
        out = cpu.attend_rows(q, self.src_k, self.src_v, self.rows, k_new, v_new, lend and lend.beside)
        if lend is not None:
            lend.flush()  # (what a share did not start)
        if out is not None:
            return out
        d = self.src_k.shape[-1]
        rows = torch.cat(self.rows, -1)
        ok = rows >= 0
        flat_k, flat_v = self.src_k.view(-1, d), self.src_v.view(-1, d)
        keys = torch.cat([flat_k[rows.clamp(min=0)], k_new.to(flat_k.dtype)], 2)
        values = torch.cat([flat_v[rows.clamp(min=0)], v_new.to(flat_v.dtype)], 2)
        mask = torch.cat([ok, torch.ones_like(ok[..., :1])], -1)[:, :, None]
        return decode_sdpa(q, keys.to(q.dtype), values.to(q.dtype), mask)


class Selector:
    """A policy as the store runs it: which layers keep their KV on the device (`device_layers`), which are pooled in
    host memory (`pooled_layers`), which rows of a pooled layer a decode step reads, and how its host rows hold them
    (`layout`). The default reads every row a request holds, as it is (`offload`); a policy with nothing pooled keeps
    everything on the device (`full`)."""

    layout = Plain

    indexed = False  # a decode step needs every row's flat slots (StoreStep.idx) though nothing is pooled (h2o's)

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
        phys = step.idx[:, None]  # [B, 1, T]: the heads' row numbers are then the one [B, Hkv, T] temporary
        k, v = self.gather(step, layer, slots, ok, 1, layer % 2, step.batch.old * h, phys)
        return k, v, ok

    def gather(self, step: StoreStep, j: int, slots, ok, extra: int, turn: int | None = None, counted=None,
               phys=None, room: int = 0, into=None):  # fmt: skip
        """Rows `slots` [B, Hkv, n] of pooled layer j for every request as stored (store.gather), counted per request:
        on a GPU the rows that count (`counted` per request, a tensor [B] or a CPU's list, where `ok` skips some; else
        all), into device buffers `turn` (two sets, used in turn by consecutive layers: a new tensor per layer, made on
        the side stream and freed on the compute stream while the host runs ahead of the copies, could not be reused
        before they caught up); on a CPU the rows it copies: those that count and one for each new token (the `extra`
        rows). `room`: rows left before the extra ones for the caller to fill (not counted: nothing of the pool's).
        `into`: where to write them (store.gather's, a CPU)."""
        store, (b, h, n) = self.store, slots.shape
        out = None
        if store.kernel and turn is not None:
            need = [b * h * (n + room + extra) * w for _, w, _ in store.layout.parts]
            # an eighth more: rows grow (every part's alike, so the first part's size says when)
            if turn not in self.buffers or self.buffers[turn][0][0].numel() < need[0]:
                self.buffers[turn] = [tuple(torch.empty(m + m // 8, dtype=t, device=store.device) for _ in "kv")
                                      for m, (_, _, t) in zip(need, store.layout.parts, strict=True)]  # fmt: skip
            out = self.buffers[turn]
        k, v = store.gather(j, step.batch, slots, ok, room + extra, out, phys, into)
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
            return store.attend(layer, q, batch)
        keys, values, ok = self.rows(step, layer, q)  # the rows held before (and their reads) first
        slots = step.slots if self.evicting is None else self.evicting.place(step, layer)  # (after the reads)
        store.ledger.add("d2h", step.rids, k.shape[1] * store.row_bytes)

        def put():  # the new rows into the pool, and the policy's record of them
            out = store.write(layer, slots, k, v)
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
        new = put()
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
            mask = torch.cat([ok, torch.ones_like(ok[..., :1])], -1)[:, :, None]
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


class StoreStep(KVCache):
    """One decode step of several requests through the store: each row's new token written, every device layer
    attended in one kernel, every pooled layer's rows chosen and gathered once for the batch."""

    def __init__(self, store: KVStore, rids: list[int]):
        self.store, self.rids = store, rids

    def begin(self, positions) -> None:
        self.positions = positions
        self.reused = self.store.selector.reuse(self, self.rids, 1)
        self.slots = self.store.append(self.rids, 1, self.reused)
        self.batch = self.store.batch(self.rids, 1 - self.reused)
        self.dense = self.store.dense_pass(self, self.rids, 1)  # the device layers' (slots, batch)
        self.held = self.batch.held()
        self.span = None  # one row whose first T slots are one run: their slice (read in place, no gather)
        if self.store.pooled or self.store.selector.indexed:  # [B, T]: the flat slots of every row's tokens held
            t, b = self.held[0], len(self.rids)  # before the step (on the compute stream, before a side stream reads)
            self.idx = self.store.physical(self.batch, torch.arange(t, device=self.store.device).expand(b, t))
            table = self.store.alloc.tables[self.rids[0]][: -(-t // BLOCK)]
            if b == 1 and t and table == list(range(table[0], table[0] + len(table))):
                self.span = slice(table[0] * BLOCK, table[0] * BLOCK + t)
        if self.store.rings is not None:
            self.store.rings.begin(self.rids, [self.store.seen[r] - 1 for r in self.rids])
        self.store.selector.begin(self)

    def physical(self, slots: torch.Tensor) -> torch.Tensor:
        """Token slots [B, ..., n] of each row's own sequence, below the step's held count (what a selection over the
        held tokens picks) -> their flat slot numbers: one gather from `idx`, not the tables' arithmetic again."""
        b = slots.shape[0]
        return torch.gather(self.idx, 1, slots.reshape(b, -1)).view(slots.shape)

    def observe(self, layer, x) -> None:
        self.store.selector.observe(self, layer, x)

    def attend(self, layer, q, k, v) -> torch.Tensor:
        if layer in self.store.sliding:  # whatever the policy: the rings on the device
            return self.store.rings.attend(layer, q, k, v)
        return self.store.selector.attend(self, layer, q, k, v)

    def end(self) -> None:
        self.store.selector.end(self)


class RequestPass(KVCache):
    """One request's prompt chunk through the store (what the model calls): its rows written through its table,
    attention causal over its earlier rows (read from the device, or gathered from host memory for a pooled layer)
    and the chunk's. It is also the request's handle on the store: its report, and its release."""

    def __init__(self, store: KVStore, rid: int):
        self.store, self.rid = store, rid
        store.admit(rid)

    def begin(self, positions) -> None:
        s = positions.shape[1]
        self.start, self.first = self.store.length[self.rid], self.store.seen[self.rid]  # pool slots, tokens before
        self.reused = self.store.selector.reuse(self, [self.rid], s)
        self.slots = self.store.append([self.rid], s, self.reused)
        self.batch = self.store.batch([self.rid], s - self.reused)
        self.dense = self.store.dense_pass(self, [self.rid], s)  # the device layers' (slots, batch)
        self.held = self.first + s if self.first else None  # the device layers' rows it reads: every one so far
        # causal over the rows read before (a pooled layer's: the pool slots taken; a device layer's: every token)
        # and the chunk's own
        causal = lambda t: causal_mask(torch.ones(1, t + s, dtype=torch.bool, device=positions.device), t)  # noqa: E731
        self.mask = causal(self.start) if self.start else None
        self.dense_mask = self.mask if self.first == self.start else causal(self.first)
        self.store.selector.begin_pass(self)

    def attend(self, layer, q, k, v) -> torch.Tensor:
        if layer in self.store.sliding:
            return self.store.rings.attend_pass(self.rid, self.first, layer, q, k, v)
        return self.store.selector.attend_pass(self, layer, q, k, v)

    def end(self) -> None:
        self.store.selector.end(self)

    def report(self) -> KVReport:
        return self.store.report(self.rid)

    def close(self) -> None:
        self.store.release(self.rid)


class Solo(KVCache):
    """One request in a KV store of its own: its prompt goes through `prompt` (the request's pass, RequestPass), and
    each decode step through the Solo itself (a StoreStep of a batch of one), exactly as the runner runs a request of
    its batch's store. What eval, the needle test and a runner's request whose policy (or options) its batch's store
    does not hold run in: every policy's KV goes through the store, one way. `prefetch` (prefetch.Lane): the
    runner's; None: the store's own, closed with it."""

    def __init__(self, engine, policy, max_len: int, prefetch=None):
        from infinigen_rt.kv.prefetch import engine_prefetcher

        self.policy, self.own = policy, None
        if prefetch is None:
            self.own = engine_prefetcher(engine)
            prefetch = self.own.lane()
        self.lane = prefetch
        selector = policy.selector(engine, prefetch)
        self.host = PagedStore(-(-max_len // BLOCK), BLOCK, engine.device)
        self.host.reserve(0, max_len)
        self.store = KVStore(self.host, selector, engine.cfg, engine.device, engine.dtype, 1, max_len)
        self.prompt = RequestPass(self.store, 0)
        self.now: StoreStep | None = None

    def begin(self, positions) -> None:
        assert positions.shape[1] == 1, "a decode step: one token (a prompt goes through `prompt`)"
        self.now = StoreStep(self.store, [0])
        self.now.begin(positions)

    def observe(self, layer, x) -> None:
        self.now.observe(layer, x)

    def attend(self, layer, q, k, v) -> torch.Tensor:
        return self.now.attend(layer, q, k, v)

    def end(self) -> None:
        self.now.end()

    def report(self) -> KVReport:
        return self.store.report(0)

    def close(self) -> None:
        self.store.release(0)
        self.host.release(0)
        self.host.close()
        self.lane.close()  # (whatever its layers left on the side stream or worker)
        if self.own is not None:
            self.own.close()


def dense_request(cfg, tokens: int, device, dtype) -> RequestPass:
    """One request of up to `tokens` tokens in a store of its own with every layer's KV on the device, as `full` keeps
    it (calibration's dense pass: the model runs it as any other)."""
    host = PagedStore(-(-tokens // BLOCK), BLOCK, device)
    host.reserve(0, tokens)
    store = KVStore(host, Selector(cfg.global_layers, []), cfg, device, dtype, 1, tokens)
    return RequestPass(store, 0)
