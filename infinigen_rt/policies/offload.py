"""`offload`: all KV in the host pool, every layer fetches every held token (the FlexGen-style baseline).

Also the base of the pool policies: subclasses change `select` (which slots a layer fetches) and add
per-token state; the byte counters count the copies actually made."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infinigen_rt.cache import DenseCache, KVCache, causal_mask
from infinigen_rt.config import ModelConfig
from infinigen_rt.policies.options import KVOptions
from infinigen_rt.pool import KVPool


@dataclass
class KVStats:
    bytes_h2d: int = 0  # host -> device: rows fetched
    bytes_d2h: int = 0  # device -> host: new tokens written to the pool
    fetched: int = 0  # rows fetched by speculated layers in decode
    held: int = 0  # rows those layers could have fetched
    tokens_per_head: list = field(default_factory=list)
    recall: list = field(default_factory=list)
    layer_h2d: dict = field(default_factory=dict)  # layer -> bytes fetched
    layer_fetched: dict = field(default_factory=dict)  # layer -> [rows fetched, rows held] when speculated

    def to_dict(self, evictions: int) -> dict:
        t = self.tokens_per_head
        layers = sorted(self.layer_h2d)
        return {
            "per_layer": {
                "bytes_h2d": [self.layer_h2d[i] for i in layers],
                "kv_fetched_share": [
                    round(self.layer_fetched[i][0] / self.layer_fetched[i][1], 6) if i in self.layer_fetched else None
                    for i in layers
                ],
            },
            "bytes_h2d": self.bytes_h2d,
            "bytes_d2h": self.bytes_d2h,
            "kv_fetched_share": round(self.fetched / self.held, 6) if self.held else None,
            "tokens_per_head_mean": round(sum(t) / len(t), 3) if t else None,
            "tokens_per_head_max": max(t) if t else None,
            "evictions": evictions,
            "attention_recall": round(sum(self.recall) / len(self.recall), 6) if self.recall else None,
        }


class OffloadCache(KVCache):
    pool_class = KVPool  # how the host stores rows (Int4Pool for the int4 policy)

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype, opts: KVOptions, resident: int = 0):
        """`resident`: the first layers keep their KV on the device (a DenseCache), outside the pool."""
        self.cfg, self.device, self.opts = cfg, torch.device(device), opts
        pin = self.device.type == "cuda"
        self.resident = DenseCache(cfg, batch, max_len, self.device, dtype, layers=resident) if resident else None
        self.n_resident = resident
        self.pools = [
            None if i < resident else self.pool_class(
                batch, cfg.num_key_value_heads, cfg.head_dim, max_len, dtype, pin, opts.eviction, opts.window
            )
            for i in range(cfg.num_hidden_layers)
        ]  # fmt: skip
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        self.lengths = torch.zeros(batch, dtype=torch.long)  # real tokens seen per sequence
        self.stats = KVStats(layer_h2d=dict.fromkeys(range(cfg.num_hidden_layers), 0))
        self.step = 0
        self.padded = False  # some slot holds padding (decode steps bring none: see KVCache.begin)

    def begin(self, valid, positions) -> None:
        if self.resident is not None:
            self.resident.begin(valid, positions)
        self.valid, self.positions = valid, positions
        self.new_mask = causal_mask(valid, 0)  # [B, 1, s, s] among the new tokens
        s = valid.shape[1]
        if s > 1:
            self.padded = self.padded or not bool(valid.all())
        self.plain = s > 1 and int(self.lengths.max()) == 0 and not self.padded  # a first prefill, no padding
        self.lengths += valid.sum(-1).cpu()
        self.step += 1

    def select(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots layer `layer` fetches from the pool: (slots, ok), each [B, Hkv, n] on the host."""
        return self.pools[layer].held_slots()

    def update(self, layer, q, k, v):
        if layer < self.n_resident:
            return self.resident.update(layer, q, k, v)
        pool, s = self.pools[layer], k.shape[2]
        decode = s == 1  # one new token: the fetch leaves a row for it (no concatenation)
        slots, ok, keys, values = self.fetch(layer, extra=1 if decode else 0)
        self.after_fetch(layer, q, slots, ok)
        new_slots = pool.insert(k, v, self.positions, self.valid)
        self.stats.bytes_d2h += k.shape[0] * k.shape[1] * k.shape[2] * pool.row_bytes
        self.after_insert(layer, k, new_slots)
        if decode:
            keys[:, :, -1:], values[:, :, -1:] = k, v
        else:
            keys, values = torch.cat([keys.to(k.dtype), k], 2), torch.cat([values.to(v.dtype), v], 2)
        if self.plain:  # nothing held yet: plain causal attention among the new tokens
            return keys, values, None
        if decode and bool(ok.all()):  # every fetched row is a real token (ok lives on the host): no mask
            return keys, values, None
        old = ok.to(self.device).repeat_interleave(self.group, dim=1)[:, :, None, :]  # [B, H, 1, n]
        mask = torch.cat([old.expand(-1, -1, s, -1), self.new_mask.expand(-1, old.shape[1], -1, -1)], -1)
        return keys, values, mask

    def fetch(self, layer: int, extra: int = 0):
        """(slots, ok, keys, values) for `layer`: its selected rows copied to the device now, plus `extra`
        rows per (sequence, KV head) at the end for the new tokens (see KVPool.gather)."""
        slots, ok = self.select(layer)
        k, v = self.pools[layer].gather(slots, self.device, extra)
        self.count_h2d(layer, k.shape[0] * k.shape[1] * k.shape[2] * self.pools[layer].row_bytes)
        return slots, ok, k, v

    def count_h2d(self, layer: int, n_bytes: int) -> None:
        self.stats.bytes_h2d += n_bytes
        self.stats.layer_h2d[layer] = self.stats.layer_h2d.get(layer, 0) + n_bytes

    def after_fetch(self, layer, q, slots, ok) -> None:
        """Hook for subclasses: the rows of `slots` were just fetched for `layer`."""

    def after_insert(self, layer, k, slots) -> None:
        """Hook for subclasses: the new tokens' keys went into `slots`."""

    def end(self) -> None:
        if self.opts.capacity is None:  # the pool holds everything: nothing to evict
            return
        cap = self.opts.capacity_tokens(self.lengths)
        for pool in self.pools[self.n_resident :]:
            pool.evict(cap)

    def report(self) -> dict:
        return self.stats.to_dict(sum(p.evicted for p in self.pools[self.n_resident :]))
