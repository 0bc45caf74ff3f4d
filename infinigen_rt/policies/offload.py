"""`offload`: all KV in the host pool, every layer fetches every held token (the FlexGen-style baseline): the
store's default selector, one layer's rows ahead on the side stream (a GPU) or the worker thread (a CPU). Also the
rules the pool policies share: the options a capacity reads, a request's reservation under it, the bytes held."""

from __future__ import annotations

import numpy as np

from infinigen_rt.kv.evict import Evicting
from infinigen_rt.policies.base import KVPolicy, Selector, kv_layers

POOL_KNOBS = frozenset({"capacity", "eviction", "window", "prefill_chunk"})


class Offload(KVPolicy):
    name = "offload"
    knobs = POOL_KNOBS

    @classmethod
    def selector(cls, engine, opts, prefetch=None):
        """Every layer pooled, every row read (the store's default selector), under the capacity if any."""
        return Selector([], kv_layers(engine.cfg), prefetch, Evicting.of(opts))

    @classmethod
    def kv_bytes(cls, engine, opts, tokens, dtype_bytes):
        return cls.pool_bytes(engine, tokens, 2 * engine.cfg.head_dim * dtype_bytes, resident=0)

    @classmethod
    def pool_slots(cls, opts, prompt, new, chunk):
        """With a capacity, what the store's eviction (store.Evicting) does to one request, replayed on counts: a
        pass of s tokens takes min(free, s) freed slots and grows the pool by the rest, then eviction keeps at most
        the capacity. The largest chunk gives the largest peak (a smaller pass fits inside a larger one's span, and
        the kept count grows at most one per token), so chunks split by a step's prefill budget never need more."""
        if opts.capacity is None:
            return prompt + new
        fill = held = length = peak = 0
        passes = [min(chunk, prompt - i) for i in range(0, prompt, chunk)] + [1] * (new - 1)
        for s in passes:
            fill += s - min(fill - held, s)
            held, length = held + s, length + s
            peak = max(peak, fill)
            held = min(held, max(int(opts.capacity_tokens(np.array([length]))[0]), opts.window))
        return max(peak, 1)

    @staticmethod
    def pool_bytes(engine, tokens: int, row: int, resident: int) -> tuple[int, int, int]:
        """Pooled layers: rows in host memory, 12 bytes of slot state each on the device, and on the device one
        layer's fetched rows twice over (the layer computing and the next one arriving); resident layers' KV on
        the device, read every step."""
        cfg = engine.cfg
        pooled = len([i for i in kv_layers(cfg) if i >= resident])
        kv_row = 2 * cfg.head_dim * engine.dtype.itemsize
        dense = tokens * kv_row * len([i for i in kv_layers(cfg) if i < resident])
        return 2 * tokens * kv_row + tokens * 12 * pooled + dense, tokens * row * pooled, dense
