"""The one KV store for the running batch: every running request's KV, and one decode step for all of them.

Every request's KV lives in the same buffers, in blocks of BLOCK token slots of the runner's paged pool
(paged.PagedStore: its allocator and its host buffers). A layer whose KV stays on the compute device keeps keys and
values [Hkv, slots, D] there (each head's rows contiguous: a request whose blocks are one run is a view, as
attention reads it); a pooled layer keeps them in the paged pool's host buffers (page-locked when a GPU computes),
from which one gather brings the rows a step reads, for the whole batch.
A request's table lists its blocks; a step's `Batch` is the tables and lengths of the requests it runs, on the
device, so that a layer writes the step's new rows, chooses, gathers and attends for the whole batch in a few
launches, whatever the batch size.

What a policy decides is its selector (policies/base.py's `Selector`): which layers stay on the device, which rows of
a pooled layer a step reads (and what it keeps beside them: InfiniGen's speculation keys), and how a pooled layer's
host rows hold them (its `layout`: as they are, `Plain`, or int4's codes). The store is the mechanism: slots, tables,
copies (rows.py), attention, and the counts of what moved (ledger.py, per request).

Under a capacity (KVOptions.capacity: offload's, int4's, infinigen's) a request keeps at most that many tokens per
(pooled layer, KV head), and its new tokens reuse the slots it freed (evict.Evicting): its pool slots (`length`) are
then fewer than its tokens (`seen`), and the device layers (infinigen's dense ones, which keep every token) have blocks
and tables of their own (`dense`).

A sliding-window layer (Gemma 3's local layers, Mistral's) keeps, whatever the policy, a ring of its last W tokens
per request on the device (window.Rings): the store attends it itself, and no selector ever sees those layers.

Invariants (`check`): the allocator's (and the dense one's); every request's length fits its reservation, the
tokens it holds under a capacity its slots, its tokens its dense table; a released request holds nothing; every
request holds one ring row, and no ring row is lost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from infinigen_rt.kv import cpu
from infinigen_rt.kv.attention import decode_sdpa, paged_decode
from infinigen_rt.kv.cache import KVCache, KVReport, causal_mask
from infinigen_rt.kv.kernels import scatter_rows
from infinigen_rt.kv.ledger import Ledger
from infinigen_rt.kv.paged import BlockAllocator, PagedStore
from infinigen_rt.kv.rows import copy_rows
from infinigen_rt.kv.window import Rings
from infinigen_rt.system import Staging, to_device

BLOCK = 16
STEP_BUCKET = 1024  # tokens: the widest bucket a GPU decode step is sized for (bucket_end)


def bucket_end(t: int) -> int:
    """The end of the bucket of t tokens a GPU decode step is sized for (its table, attention split and selection):
    t rounded up to a sixteenth of the power of two at or below it, at least BLOCK and at most STEP_BUCKET tokens:
    at most ~6 % more than t, one bucket of 1,024 tokens from 16k on, and every t of a bucket has the same end."""
    if t <= 0:
        return 0
    q = min(STEP_BUCKET, max(BLOCK, (1 << (t.bit_length() - 1)) // 16))
    return -(-t // q) * q


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
    rows: torch.Tensor | None = None  # a CPU's device layers' held rows (KVStore.held_rows), made once a step

    def held(self) -> tuple[int, torch.Tensor | None]:
        """(T, held): the longest row's rows before the step, and [B, T] bool of the rows each holds (None: all hold
        T, known on the host)."""
        t = int(self.old.max())
        if (self.old == t).all():
            return t, None
        old = to_device(torch.from_numpy(self.old), self.table.device)
        return t, torch.arange(t, device=self.table.device) < old[:, None]


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

    def __init__(self, host: PagedStore, selector, cfg, device, dtype, rows: int = 1,
                 context: int | None = None):  # fmt: skip
        """`rows`: the most requests it holds at once (the runner's max_batch): the sliding layers' rings, and with
        `context` (the most tokens a request reaches) the device layers' own blocks (see device_slots)."""
        assert host.alloc.block_size == BLOCK
        self.host, self.alloc, self.selector = host, host.alloc, selector  # (its buffers live as long as it)
        self.device = torch.device(device)
        self.staging = Staging(self.device)  # the step's slots and tables: the same buffers every step
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
        # Hkv -> arange(Hkv) [1, Hkv, 1] (each row's KV head, for gather and write): made once, before any step
        self.heads = {self.n_kv: torch.arange(self.n_kv, device=self.device).view(1, self.n_kv, 1)}
        self.rings = Rings(cfg, rows, device, dtype) if cfg.sliding_layers else None  # the sliding layers' KV
        self.sliding = set(cfg.sliding_layers)
        selector.attach(self)

    @property
    def graphs(self) -> bool:
        """Whether a CUDA graph may replay its decode steps (graphs.py): on a GPU, no sliding layer's ring, and a
        selector whose step reads only what the step's begin stages (Selector.graphs)."""
        return self.kernel and self.rings is None and self.selector.graphs()

    @staticmethod
    def apart(selector) -> bool:
        """Whether the device layers have blocks of their own: under a capacity, whose requests reserve the slots
        their pooled layers reach (eviction frees slots they reuse: Offload.pool_slots), while a device layer
        (InfiniGen's dense ones) keeps every token."""
        return selector.evicting is not None and bool(selector.device_layers)

    @classmethod
    def device_slots(cls, host: PagedStore, selector, rows: int, context: int | None) -> int:
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

    def append(self, rids: list[int], n: int, reused: np.ndarray | None = None, staged: bool = False) -> torch.Tensor:
        """Each request of `rids` takes token slots for `n` new tokens: its next ones, but for the first reused[b]
        (host; None: none), which go into slots eviction freed (a selector with a capacity places those: Evicting).
        Their flat slot numbers [B * n] on the device (one copy up, not waited for), in row order, 0 for the reused
        ones. The lengths (slots taken) advance on the host. `staged`: a decode step's, into the same device buffer
        every step (see up)."""
        slots = np.zeros((len(rids), n), dtype=np.int64)
        reused = np.zeros(len(rids), dtype=np.int64) if reused is None else reused
        for i, (r, u) in enumerate(zip(rids, reused.tolist(), strict=True)):
            slots[i, u:] = self.alloc.slots(r, self.length[r], n - u)
            self.length[r] += n - u
            self.seen[r] += n
        return self.up("slots", slots.reshape(-1), staged)

    def dense_pass(self, p: StoreStep | RequestPass, rids: list[int], n: int,
                   staged: bool = False) -> tuple[torch.Tensor, Batch]:  # fmt: skip
        """The device layers' (slots, batch) of pass p, whose requests `rids` brought n tokens each (appended
        already): the pass's own, but where the device layers have tables of their own (see device_slots)."""
        if self.dense is self.alloc:
            return p.slots, p.batch
        slots = []
        for r in rids:
            self.dense.grow(r, self.seen[r])
            slots.append(self.dense.slots(r, self.seen[r] - n, n))
        return self.up("dense slots", np.concatenate(slots), staged), self.tables(self.dense, self.seen, rids, n,
                                                                                  staged)  # fmt: skip

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              rows: torch.Tensor | None = None, last=None) -> tuple | None:  # fmt: skip
        """k, v [B, Hkv, n, D] into `slots` [B * n] (from `append`), or for a pooled layer each head's own flat
        slots [B, Hkv, n] (a capacity's reused ones: Evicting.place): one copy per tensor (a pooled layer: per part)
        for the whole batch. A pooled layer's rows go to host memory as its layout encodes them: on a GPU the scatter
        kernel writes them into the pinned pages, on a CPU index_copy; it returns them, (keys' parts, values' parts)
        [B, Hkv, n, X] each on the device, for attention to read the new tokens as stored. `rows`: a pooled layer's
        rows for `slots` [B * n] where the caller has them (StoreStep.new_rows). `last` (the kernel, a decode step's
        one token): the (keys' parts, values' parts) [B, Hkv, m, X] rows gathered for attention, whose last row each
        new token's parts also go to, in the same launch."""
        if layer in self.pooled:
            h = self.n_kv
            head = self.heads[h].view(h)
            if rows is None and slots.dim() == 1:  # every head's the same
                rows = (slots[:, None] * h + head).reshape(-1)  # [B * n * Hkv], token-major
            elif rows is None:
                rows = (slots * h + head[:, None]).transpose(1, 2).reshape(-1)
            stored = self.layout.encode(k), self.layout.encode(v)
            rowed = lambda x: x.transpose(1, 2).reshape(-1, x.shape[-1])  # noqa: E731  [B * n * Hkv, X] in order
            if self.kernel:  # each part's keys and values in one launch (and into `last`'s last rows)
                near = zip(*last, strict=True) if last is not None else [(None, None)] * len(stored[0])
                assert last is None or k.shape[2] == 1, "a decode step's one token a row"
                for kb, vb, kx, vx, (kl, vl) in zip(self.k[layer], self.v[layer], *stored, near, strict=True):
                    flat = (None, None) if kl is None else (kl.view(-1, *kl.shape[2:]), vl.view(-1, *vl.shape[2:]))
                    scatter_rows(kb.view(-1, kb.shape[-1]), rows, rowed(kx), vb.view(-1, vb.shape[-1]), rowed(vx),
                                 *flat)  # fmt: skip
                return stored
            for bufs, parts in zip((self.k[layer], self.v[layer]), stored, strict=True):
                for buf, x in zip(bufs, parts, strict=True):
                    flat = buf.view(-1, buf.shape[-1])
                    flat.index_copy_(0, rows.to(flat.device), rowed(x).to(flat.device, flat.dtype))
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
               out=None, rows: torch.Tensor | None = None, into=None, first: int = 0, table=None):  # fmt: skip
        """The K and V rows of every row's `slots` [B, Hkv, n] from pooled layer `layer` as stored, in one copy per
        part for the batch: (keys' parts, values' parts), each [B, Hkv, n + extra, X] on the device (the `extra` last
        rows: room for the new tokens), to decode (the layout's). On a GPU the row kernel reads them from pinned
        memory, skipping those where `ok` is False; on a CPU, index_select. `out`: flat device buffers, a (keys,
        values) pair per part, to fill instead of new tensors (the kernel only). `rows`: the slots' pool rows [B, Hkv,
        n] where the caller has them (StoreStep.pool_rows: flat slot x Hkv + KV head), or `table`, the step's
        pool row of every slot [B, Hkv, T] (StoreStep.row_table: the kernel looks them up). `into` (a CPU): the
        (keys, values) tensors [B, Hkv, n + extra, X] of each part to write, windows of larger ones (the room a
        speculated gather left for the correction), returned as they are; with the kernel, whole (keys, values)
        tensors [B, Hkv, m, X] whose rows `first`.. the rows fill (the room left in them)."""
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
        head = self.heads.get(h)  # each row's KV head [1, Hkv, 1]
        if head is None:  # (another count of heads: made here, on a GPU each call, so no stream reads it unordered)
            head = torch.arange(h, device=slots.device).view(1, h, 1)
            if slots.device.type == "cpu":
                self.heads[h] = head
        if ok is not None and not self.kernel and bool(ok.all()):  # a CPU reads ok for free: every row counts
            ok = None
        if table is not None and not self.kernel:
            rows, table = torch.gather(table, 2, slots), None
        if ok is None or self.kernel:  # the kernel writes zeros where ok is False
            if table is not None:  # (the kernel finds each slot's row in the table)
                rows = slots
            elif rows is None:
                rows = self.physical(batch, slots) * h + head
            for src_k, src_v, (out_k, out_v) in zip(keys, values, out, strict=True):
                copy_rows(src_k, src_v, rows, ok, out_k, out_v, self.kernel, first, table)
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

    def batch(self, rids: list[int], new: int | np.ndarray = 1, staged: bool = False) -> Batch:
        """The step's tables and lengths on the device (two copies up, not waited for); `new`: the slots each row
        took (appended already; per row where a capacity reuses freed ones)."""
        return self.tables(self.alloc, self.length, rids, new, staged)

    def tables(self, alloc: BlockAllocator, length: dict[int, int], rids: list[int], new,
               staged: bool = False) -> Batch:  # fmt: skip
        """A Batch of `alloc`'s tables and `length`'s lengths (see batch). A GPU's decode step (`staged`) sizes its
        table and its attention's split for the end of its bucket (bucket_end), the same for every step within
        it (the kernel reads each row's length from the device and stops there)."""
        tables = [alloc.tables[r] for r in rids]
        lengths = np.array([length[r] for r in rids], dtype=np.int32)
        longest = int(lengths.max())
        if staged and self.device.type == "cuda":
            longest = bucket_end(longest)
        width = max(max(len(t) for t in tables), -(-longest // BLOCK))
        table = np.zeros((len(rids), width), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        name = "dense" if alloc is not self.alloc else ""
        return Batch(rids, self.up(f"{name} table", table, staged), self.up(f"{name} lengths", lengths, staged),
                     longest, lengths.astype(np.int64) - new)  # fmt: skip

    def up(self, name: str, a: np.ndarray, staged: bool) -> torch.Tensor:
        """A host array on the device, the copy not waited for: `staged` (a decode step's, once a step) through
        `name`'s buffers of self.staging, the same addresses every step; else through fresh page-locked memory."""
        return self.staging.put(name, a) if staged else to_device(torch.from_numpy(a), self.device)

    def attend(self, layer: int, q: torch.Tensor, batch: Batch, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One query token per row, q [B, H, 1, D], over each row's keys of a device layer, its new k, v [B, Hkv, 1, D]
        written already: [B, H, 1, D]. A GPU attends for the whole batch in one kernel; a CPU in the streaming kernel
        the pooled layers' rows go through (cpu.attend_rows: the rows read where they are, the (sequence, KV head)
        pairs shared with the worker where a speculative policy lends it). Without the kernels, row by row over views
        of each request's blocks where they are one run, gathered where they are not."""
        buf_k, buf_v = self.k[layer], self.v[layer]
        if self.device.type != "cpu":
            return paged_decode(q, buf_k, buf_v, batch.table, batch.lengths, BLOCK, batch.longest)
        d = buf_k.shape[-1]
        out = cpu.attend_rows(q, buf_k.view(-1, d), buf_v.view(-1, d), [self.held_rows(batch, buf_k.shape[1])], k, v,
                              cpu.lent())  # fmt: skip
        if out is not None:
            return out
        rows = [None] * len(batch.rids)

        def row(i: int) -> None:
            rid = batch.rids[i]
            n = self.seen[rid]
            keys, values = self.rows_of(buf_k, rid, n), self.rows_of(buf_v, rid, n)  # [1, Hkv, n, D]
            rows[i] = decode_sdpa(q[i : i + 1], keys, values)

        cpu.each(len(batch.rids), row)
        return torch.cat(rows)

    def held_rows(self, batch: Batch, slots: int) -> torch.Tensor:
        """[B, Hkv, T]: the rows each request held before the step in a device layer's keys [Hkv x slots, D] (head h's
        slot s is row h x slots + s), -1 past its own count; made once a step (batch.rows)."""
        if batch.rows is None:
            b, t = len(batch.rids), int(batch.old.max())
            at = torch.arange(t)
            rows = self.physical(batch, at.expand(b, t))[:, None] + torch.arange(self.n_kv).view(1, -1, 1) * slots
            if not (batch.old == t).all():
                rows.masked_fill_((at >= torch.from_numpy(batch.old)[:, None])[:, None], -1)
            batch.rows = rows
        return batch.rows

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


class StoreStep(KVCache):
    """One decode step of several requests through the store: each row's new token written, every device layer
    attended in one kernel, every pooled layer's rows chosen and gathered once for the batch."""

    def __init__(self, store: KVStore, rids: list[int]):
        self.store, self.rids = store, rids

    def begin(self, positions) -> None:
        self.prepare(positions)
        self.begin_device()

    def prepare(self, positions) -> None:
        """The step's host part: each request's new slot taken, the slots, tables and lengths put on the device (on a
        GPU into the same buffers every step: what a replayed graph reads, graphs.py, which runs this before each
        replay and begin_device inside the graph). A selector that sizes a GPU step for its bucket (Selector.bucketed)
        gets a step whose held count `t` is its bucket's end (bucket_end), each row's own count on the device."""
        store = self.store
        self.positions = positions
        self.reused = store.selector.reuse(self, self.rids, 1)
        self.slots = store.append(self.rids, 1, self.reused, staged=True)
        self.batch = store.batch(self.rids, 1 - self.reused, staged=True)
        self.dense = store.dense_pass(self, self.rids, 1, staged=True)  # the device layers' (slots, batch)
        t, b = int(self.batch.old.max()), len(self.rids)
        self.bucketed = store.kernel and store.device.type == "cuda" and store.selector.bucketed  # (as `tables`)
        self.old = None
        if self.bucketed:  # the rows each held before the step, [B] on the device
            t = bucket_end(t)
            self.old = store.up("old", self.batch.old, True)
        self.t = t
        self.span = None  # one row whose first T slots are one run: their slice (read in place, no gather)
        if (store.pooled or store.selector.indexed) and not self.bucketed:
            table = store.alloc.tables[self.rids[0]][: -(-t // BLOCK)]
            if b == 1 and t and table == list(range(table[0], table[0] + len(table))):
                self.span = slice(table[0] * BLOCK, table[0] * BLOCK + t)
        if store.rings is not None:
            store.rings.begin(self.rids, [store.seen[r] - 1 for r in self.rids])

    def begin_device(self) -> None:
        """The step's device part, from what `prepare` put there: which rows each request holds (`held`: T and [B, T]
        bool, None where every row holds T), their flat slots (`idx` [B, T]: for the pooled layers, on the compute
        stream before a side stream reads them), and the selector's own."""
        store, t, b = self.store, self.t, len(self.rids)
        if self.bucketed:
            self.held = t, torch.arange(t, device=store.device) < self.old[:, None]
        else:
            self.held = self.batch.held()
        if store.pooled or store.selector.indexed:
            self.idx = store.physical(self.batch, torch.arange(t, device=store.device).expand(b, t))
        if store.pooled:  # each held slot's pool row (flat slot x Hkv + KV head) [B, Hkv, T] (pool_rows), the new
            h, head = store.n_kv, store.heads[store.n_kv]  # tokens' [B x Hkv] (write): once, not a layer's ops each
            self.row_table = self.idx[:, None] * h + head
            self.new_rows = (self.slots[:, None] * h + head.view(h)).reshape(-1)
        store.selector.begin(self)

    def graph_inputs(self) -> list[torch.Tensor]:
        """What the step's device work reads that `prepare` put on the device (graphs.py: a replay reads them where the
        capture did): the new tokens' slots, the tables and lengths, the rows each request held."""
        slots, batch = self.dense
        got = [self.slots, self.batch.table, self.batch.lengths, slots, batch.table, batch.lengths]
        return list({id(t): t for t in got + ([] if self.old is None else [self.old])}.values())

    def physical(self, slots: torch.Tensor) -> torch.Tensor:
        """Token slots [B, ..., n] of each row's own sequence, below the step's held count (what a selection over the
        held tokens picks) -> their flat slot numbers: one gather from `idx`, not the tables' arithmetic again."""
        b = slots.shape[0]
        return torch.gather(self.idx, 1, slots.reshape(b, -1)).view(slots.shape)

    def pool_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Token slots [B, Hkv, n] as `physical` takes them -> their rows in a pooled layer's pool (flat slot x Hkv +
        KV head) [B, Hkv, n]: one gather from the step's table (three ops a call without it)."""
        return torch.gather(self.row_table, 2, slots)

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
