"""`quest` (eval only): a Quest-style page selector (Tang et al., 2024) in the same engine, the peer InfiniGen is
measured against at equal bytes. The KV lives in the host pool as `offload`'s; for each of the pool's 16-token blocks
(a page) and KV head the device holds the elementwise minimum and maximum of its keys, kept as tokens are written. In
a decode step each layer at or past the dense layers bounds every page's q.k from its own query (sum over the
channels of max(q * max, q * min), the largest over the group's query heads), and fetches the pages with the highest
bounds whole: floor(budget * held / 16) of them (at least one; all at a budget of 1), so no more rows than
`infinigen` fetches at the budget where that is a page or more.
Unlike InfiniGen it needs the layer's own query, so its fetch cannot start a layer early."""

from __future__ import annotations

import torch

from infinigen_rt.kv.cache import KVReport
from infinigen_rt.kv.store import BLOCK
from infinigen_rt.policies.base import KVPolicy, Selector, kv_layers
from infinigen_rt.policies.offload import Offload
from infinigen_rt.policies.speculation import device_counts


class Quest(KVPolicy):
    name = "quest"
    knobs = frozenset({"budget", "max_kv", "dense_layers", "prefill_chunk"})
    runtime = False
    sweep = ("budget",)

    @classmethod
    def selector(cls, engine, opts, prefetch=None):
        return QuestSelector(engine, opts)

    @classmethod
    def kv_bytes(cls, engine, opts, tokens, dtype_bytes):
        held, host, read = Offload.kv_bytes(engine, opts, tokens, dtype_bytes)
        pages = 2 * engine.cfg.head_dim * dtype_bytes * -(-tokens // BLOCK) * len(kv_layers(engine.cfg))
        return held + pages, host, read + pages


class QuestSelector(Selector):
    """Quest in the batch's KV store: the layers before `dense_layers` on the device, the rest pooled; each pooled
    layer's page bounds (`lo`, `hi` [blocks, Hkv, D] on the device, by the pool's physical block) updated from
    `written`, and `rows` fetching the chosen pages' rows from the pool. Counted per request in the ledger: the rows
    fetched and the rows held (its report's fetched share)."""

    def __init__(self, engine, opts):
        layers = kv_layers(engine.cfg)
        super().__init__([j for j in layers if j < opts.dense_layers], [j for j in layers if j >= opts.dense_layers])
        self.opts = opts
        self.layers = engine.cfg.num_hidden_layers
        self.lo: dict[int, torch.Tensor] = {}
        self.hi: dict[int, torch.Tensor] = {}

    def attach(self, store) -> None:
        super().attach(store)
        shape = (store.alloc.n_blocks, store.n_kv, store.head_dim)
        for j in self.pooled_layers:
            self.lo[j] = torch.full(shape, float("inf"), device=store.device)
            self.hi[j] = torch.full(shape, float("-inf"), device=store.device)

    def written(self, batch, layer, k, phys, reusing=None) -> None:
        """A page's bounds take each new key: reset by the first token written into the page, then the elementwise
        minimum and maximum. k [B, Hkv, s, D] into flat slots phys [B * s] (batch-major, as store.write)."""
        keys = k.transpose(1, 2).reshape(-1, k.shape[1], k.shape[-1]).float()  # [B * s, Hkv, D]
        page = phys.reshape(-1) // BLOCK
        first = phys.reshape(-1) % BLOCK == 0
        lo, hi = self.lo[layer], self.hi[layer]
        lo.index_copy_(0, page[first], keys[first])
        hi.index_copy_(0, page[first], keys[first])
        at = page[:, None, None].expand(keys.shape)
        lo.scatter_reduce_(0, at, keys, "amin")
        hi.scatter_reduce_(0, at, keys, "amax")

    def rows(self, step, layer: int, q: torch.Tensor):
        """(keys, values, ok): the rows of each (sequence, KV head)'s chosen pages, as stored, [B, Hkv, n + 1, X] (the
        last row room for the new token), ok [B, Hkv, n] where a row is held (a page past a sequence's end is not)."""
        store, (t, held) = self.store, step.held
        b, hkv, d = len(step.batch.rids), store.n_kv, q.shape[-1]
        pages = -(-t // BLOCK)
        blocks = step.batch.table[:, :pages].long()  # [B, P]: each page's block in the pool
        lo, hi = self.lo[layer][blocks], self.hi[layer][blocks]  # [B, P, Hkv, D]
        qg = q.float().reshape(b, 1, hkv, -1, d)  # [B, 1, Hkv, G, D]
        bound = torch.maximum(qg * hi[:, :, :, None], qg * lo[:, :, :, None]).sum(-1).amax(-1)  # [B, P, Hkv]
        n_held = torch.full((b,), t, device=q.device) if held is None else held.sum(-1)
        bound = bound.transpose(1, 2).masked_fill(  # a page with no held token never chosen
            torch.arange(pages, device=q.device) * BLOCK >= n_held[:, None, None], float("-inf"))  # fmt: skip
        count = device_counts(n_held, self.opts)  # [B]: the rows infinigen would fetch; the pages within them
        want = torch.where(count >= n_held, -(-n_held // BLOCK), (count // BLOCK).clamp(min=1))
        k = min(pages, int(want.max()))  # (one read of the counts a layer: the fetch's size)
        top = bound.topk(k, -1, sorted=True).indices  # [B, Hkv, k]: the first `want` of each row its best
        slots = (top[..., None] * BLOCK + torch.arange(BLOCK, device=q.device)).flatten(2)  # [B, Hkv, k * BLOCK]
        ok = (slots < n_held[:, None, None]) & (torch.arange(k, device=q.device).repeat_interleave(BLOCK)
                                                < want[:, None, None])  # fmt: skip
        slots = slots.clamp(max=t - 1)
        counted = ok.sum((1, 2))
        keys, values = self.gather(step, layer, slots, ok, 1, layer % 2, counted.tolist(), table=step.row_table)
        store.ledger.add("fetched", step.rids, counted)
        store.ledger.add("possible", step.rids, n_held * hkv)
        return keys, values, ok

    def report(self, rid: int, r: KVReport) -> None:
        led = self.store.ledger
        fetched, possible = led.get("fetched", rid), led.get("possible", rid)
        share = round(fetched / possible, 6) if possible else None
        pooled = len(self.pooled_layers) / self.layers  # the other layers attend all they hold
        r.kv_fetched_share = share
        r.kv_attended_share = None if share is None else round(1 - pooled + pooled * share, 6)
