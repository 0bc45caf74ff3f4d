"""`full`: all KV resident on the compute device: the baseline every other policy is measured against
(policies.BASELINE), and the exact prefill that several policies' passes can share."""

from __future__ import annotations

from infinigen_rt.kv.store import Selector
from infinigen_rt.policies.base import KVPolicy, kv_layers


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
