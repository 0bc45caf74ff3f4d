"""The one KV store for the running batch (work in progress: the runner does not use it yet).

Every running request's KV lives in the same buffers, in blocks of BLOCK token slots taken from one allocator
(paged.BlockAllocator): for a layer whose KV stays on the compute device, keys and values [Hkv, slots, D] there
(each head's rows contiguous: a request whose blocks are one run is a view, as attention reads it);
for a pooled layer, in host memory (page-locked when a GPU computes), whose chosen rows one kernel gathers for the
whole batch (`gather`).
A request's table lists its blocks; a step's `Batch` is the tables and lengths of the requests it runs, on the
device, so that a layer writes the step's new rows and attends for the whole batch in a few launches
(attention.paged_decode), whatever the batch size.

Invariants (`check`): the allocator's; every request's length fits its table; a released request holds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from infinigen_rt.kv.attention import paged_decode
from infinigen_rt.kv.cache import KVCache, KVReport, causal_mask
from infinigen_rt.kv.paged import BlockAllocator
from infinigen_rt.kv.pool import copy_rows
from infinigen_rt.system import host_buffer, to_device

BLOCK = 16


@dataclass
class Batch:
    """The requests a step runs, in its rows' order: their block tables [B, max_blocks] int32 and lengths [B] int32
    on the device (the lengths after the step's new tokens), the longest length on the host."""

    rids: list[int]
    table: torch.Tensor
    lengths: torch.Tensor
    longest: int


class DeviceKV:
    """Keys and values of `layers` on the compute device, paged: [n_blocks * BLOCK, Hkv, D] per layer and tensor."""

    def __init__(self, n_blocks: int, layers, n_kv: int, head_dim: int, device, dtype, pooled=()):
        """`layers`: those whose KV stays on the device; `pooled`: those whose KV lives in host memory."""
        self.alloc = BlockAllocator(n_blocks, BLOCK)
        self.device = torch.device(device)
        shape = (n_kv, n_blocks * BLOCK, head_dim)
        self.k = {i: torch.zeros(shape, device=self.device, dtype=dtype) for i in layers}
        self.v = {i: torch.zeros(shape, device=self.device, dtype=dtype) for i in layers}
        self.pinned: list | None = [] if self.device.type == "cuda" else None  # (released with the store: WIP)
        self.pooled = set(pooled)
        for i in pooled:  # slot-major, as the host pools are: a new token's rows one run, the row kernel's rows
            self.k[i] = host_buffer((n_blocks * BLOCK, n_kv, head_dim), dtype, self.pinned)
            self.v[i] = host_buffer((n_blocks * BLOCK, n_kv, head_dim), dtype, self.pinned)
        self.kernel = self.device.type == "cuda"  # gather pooled rows with the kernel (tests: the interpreter)
        self.n_kv = n_kv
        self.length: dict[int, int] = {}  # tokens written per request (host)

    def admit(self, rid: int, tokens: int) -> None:
        """Blocks for `tokens` tokens of request `rid` (paged.PoolFull when there is no room: nothing changes)."""
        self.alloc.grow(rid, tokens)
        self.length[rid] = 0

    def release(self, rid: int) -> None:
        self.alloc.release(rid)
        self.length.pop(rid, None)

    def slots(self, rid: int, start: int, n: int) -> np.ndarray:
        return self.alloc.slots(rid, start, n)

    def append(self, rids: list[int], n: int) -> torch.Tensor:
        """Each request of `rids` takes its next `n` token slots: their flat slot numbers [B * n] on the device (one
        copy up, not waited for), in row order. The lengths advance on the host."""
        slots = np.concatenate([self.slots(r, self.length[r], n) for r in rids])
        for r in rids:
            self.length[r] += n
        return to_device(torch.from_numpy(slots), self.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, Hkv, n, D] into `slots` [B * n] (from `append`): one copy per tensor for the whole batch (a
        pooled layer's on the host: index_copy there, on a CPU; the scatter kernel is the GPU's, next)."""
        if layer in self.pooled:  # [B * n, Hkv, D] into slot-major host rows
            rows = lambda x: x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1])  # noqa: E731
            dst = self.k[layer].device
            self.k[layer].index_copy_(0, slots.to(dst), rows(k).to(dst, self.k[layer].dtype))
            self.v[layer].index_copy_(0, slots.to(dst), rows(v).to(dst, self.v[layer].dtype))
            return
        heads = lambda x: x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])  # noqa: E731  [Hkv, B * n, D]
        self.k[layer].index_copy_(1, slots, heads(k).to(self.k[layer].dtype))
        self.v[layer].index_copy_(1, slots, heads(v).to(self.v[layer].dtype))

    def rows(self, batch: Batch, slots: torch.Tensor) -> torch.Tensor:
        """Token slots [B, Hkv, n] of each row's own sequence -> row numbers [B * Hkv, n] of a pooled layer's buffers
        viewed as [slots * Hkv, D], through the tables, on the device."""
        b, h, n = slots.shape
        blocks = torch.gather(batch.table.long(), 1, (slots // BLOCK).reshape(b, -1)).view(b, h, n)
        phys = blocks * BLOCK + slots % BLOCK
        head = torch.arange(h, device=slots.device).view(1, h, 1)
        return (phys * h + head).reshape(b * h, n)

    def gather(self, layer: int, batch: Batch, slots: torch.Tensor, ok: torch.Tensor | None, extra: int = 1):
        """The K and V rows of every row's `slots` [B, Hkv, n] from pooled layer `layer`, in one copy for the batch:
        [B, Hkv, n + extra, D] each on the device (the `extra` last rows: room for the new tokens). On a GPU the
        row kernel reads them from pinned memory, skipping those where `ok` is False; on a CPU, index_select."""
        b, h, n = slots.shape
        out_k = torch.empty(b, h, n + extra, self.k[layer].shape[-1], dtype=self.k[layer].dtype, device=self.device)
        out_v = torch.empty_like(out_k)
        copy_rows(self.k[layer], self.v[layer], self.rows(batch, slots).view(b, h, n), ok, out_k, out_v, self.kernel)
        return out_k, out_v

    def batch(self, rids: list[int]) -> Batch:
        """The step's tables and lengths on the device (two copies up, not waited for)."""
        tables = [self.alloc.tables[r] for r in rids]
        width = max(len(t) for t in tables)
        table = np.zeros((len(rids), width), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        lengths = np.array([self.length[r] for r in rids], dtype=np.int32)
        return Batch(rids, to_device(torch.from_numpy(table), self.device),
                     to_device(torch.from_numpy(lengths), self.device), int(lengths.max()))  # fmt: skip

    def attend(self, layer: int, q: torch.Tensor, batch: Batch) -> torch.Tensor:
        """One query token per row, q [B, H, 1, D] (its own row already written), over each row's keys: [B, H, 1, D].
        A GPU attends for the whole batch in one kernel; a CPU row by row over views of each request's blocks where
        they are one run (the gather the reference makes would double its KV's memory traffic: `full` 1.7x slower
        at SmolLM2 4k), gathered where they are not."""
        k, v = self.k[layer], self.v[layer]
        if self.device.type != "cpu":
            return paged_decode(q, k, v, batch.table, batch.lengths, BLOCK, batch.longest)
        out = []
        for i, rid in enumerate(batch.rids):
            n = self.length[rid]
            keys, values = self.rows_of(k, rid, n), self.rows_of(v, rid, n)  # [1, Hkv, n, D]
            out.append(F.scaled_dot_product_attention(q[i : i + 1], keys, values, enable_gqa=k.shape[0] != q.shape[1]))
        return torch.cat(out)

    def rows_of(self, buf: torch.Tensor, rid: int, n: int) -> torch.Tensor:
        """Request `rid`'s first n rows of a device buffer [Hkv, slots, D] as [1, Hkv, n, D]: a view where its blocks
        are one run, else a gather."""
        table = self.alloc.tables[rid][: -(-n // BLOCK)]
        if table == list(range(table[0], table[0] + len(table))):
            return buf[None, :, table[0] * BLOCK : table[0] * BLOCK + n]
        return buf[None, :, torch.from_numpy(self.slots(rid, 0, n)).to(buf.device)]

    def check(self) -> None:
        """Raise AssertionError when an invariant (module docstring) does not hold."""
        self.alloc.check()
        assert set(self.length) == set(self.alloc.tables), "a request's length without its table, or the reverse"
        for rid, n in self.length.items():
            assert n <= self.alloc.reserved[rid], f"request {rid} wrote {n} tokens past its reservation"


class RequestPass(KVCache):
    """One request's prompt chunk through the store (what the model calls, `layers` on the device): its rows written
    through its table, attention causal over its earlier rows and the chunk's."""

    def __init__(self, store: DeviceKV, rid: int):
        self.store, self.rid = store, rid

    def begin(self, valid, positions) -> None:
        assert valid is None or bool(valid.all()), "a request's pass through the store has no padding"
        s = positions.shape[1]
        self.start = self.store.length[self.rid]
        self.slots = self.store.append([self.rid], s)
        self.held = self.start + s if self.start else None  # the rows it reads: every one so far
        self.mask = causal_mask(torch.ones(1, self.start + s, dtype=torch.bool, device=positions.device),
                                self.start) if self.start else None  # fmt: skip

    def attend(self, layer, q, k, v) -> torch.Tensor:
        self.store.write(layer, self.slots, k, v)
        gqa = k.shape[1] != q.shape[1]
        if self.held is None:  # a first chunk: nothing earlier to read
            return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=gqa)
        keys = self.store.rows_of(self.store.k[layer], self.rid, self.held)  # [1, Hkv, T, D]
        values = self.store.rows_of(self.store.v[layer], self.rid, self.held)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, enable_gqa=gqa)

    def report(self) -> KVReport:
        return KVReport(kv_fetched_share=1.0, kv_attended_share=1.0)

    def close(self) -> None:
        self.store.release(self.rid)


class DecodeStep(KVCache):
    """One decode step of several requests through the store: each row's new token written, every row attended in
    one kernel, whatever the batch (the runner's decode forward when every running request's KV is in the store)."""

    def __init__(self, store: DeviceKV, rids: list[int]):
        self.store, self.rids = store, rids

    def begin(self, valid, positions) -> None:
        self.slots = self.store.append(self.rids, 1)
        self.batch = self.store.batch(self.rids)

    def attend(self, layer, q, k, v) -> torch.Tensor:
        self.store.write(layer, self.slots, k, v)
        return self.store.attend(layer, q, self.batch)
