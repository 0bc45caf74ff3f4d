"""Eviction from the host pool under a capacity: which slots each (sequence, KV head) frees (`victims`) and the
store's state that decides it (`Evicting`). An evicted slot is freed, so its token can never be selected again; the
most recent `window` positions are never evicted.

  counter  fewest times selected first (the paper's choice), then oldest
  lru      least recently selected first, then oldest
  fifo     oldest first
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.nn.functional as F

from infinigen_rt.system import to_device

EVICTIONS = ("counter", "lru", "fifo")
_BIG = 1 << 32  # ranks: primary key * _BIG + position (positions < 2**32)


def victims(pos: torch.Tensor, primary: torch.Tensor | None, recent: torch.Tensor, over: torch.Tensor) -> torch.Tensor:
    """The slots an eviction frees, per row of the last dimension: of the held ones (pos >= 0) outside the recent
    window, the `over` ranked lowest: by `primary` (times selected: counter; last step selected: lru; None: fifo),
    then oldest. pos, primary, recent [..., S]; over (device) broadcast to pos.shape[:-1], never more than the
    candidates. The store's eviction (store.Evicting) ranks with it."""
    rank = pos.long() if primary is None else primary.long() * _BIG + pos
    rank = rank.masked_fill((pos < 0) | recent, torch.iinfo(torch.long).max)
    order = rank.argsort(dim=-1, stable=True)
    ranks = torch.arange(order.shape[-1], device=pos.device).expand_as(order)
    nth = torch.empty_like(order).scatter_(-1, order, ranks)
    return (nth < over[..., None]) & (pos >= 0) & ~recent


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

    def attach(self, store, layers: list[int]) -> None:
        self.store = weakref.proxy(store)
        self.at = {layer: i for i, layer in enumerate(layers)}  # a layer's row of the state
        self.sink = store.alloc.n_blocks * store.alloc.block_size
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
