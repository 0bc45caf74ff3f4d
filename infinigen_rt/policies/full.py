"""`full`: all KV resident on the compute device: the baseline every other policy is measured against
(policies.BASELINE), and the exact prefill that several policies' passes can share."""

from __future__ import annotations

from infinigen_rt.kv.paged import PagedStore
from infinigen_rt.kv.store import BLOCK, KVStore, RequestPass
from infinigen_rt.policies.base import KVPolicy, Selector, kv_layers


class Full(KVPolicy):
    name = "full"

    @classmethod
    def selector(cls, engine, opts, prefetch=None):
        """Every layer's KV on the device."""
        return Selector(kv_layers(engine.cfg), [])

    @classmethod
    def kv_bytes(cls, engine, opts, tokens, dtype_bytes):
        kv = tokens * 2 * engine.cfg.head_dim * dtype_bytes * len(kv_layers(engine.cfg))
        return kv, 0, kv


def dense_request(cfg, tokens: int, device, dtype) -> RequestPass:
    """One request of up to `tokens` tokens in a store of its own with every layer's KV on the device, as `full` keeps
    it (calibration's dense pass: the model runs it as any other)."""
    host = PagedStore(-(-tokens // BLOCK), BLOCK, device)
    host.reserve(0, tokens)
    return RequestPass(KVStore(host, Selector(kv_layers(cfg), []), cfg, device, dtype, 1, tokens), 0)
