"""KV policies by name: how one engine treats KV. Each builder takes (engine, batch, max_len); adding a
policy adds an entry here and touches no model code."""

from __future__ import annotations

from infinigen_rt.cache import DenseCache
from infinigen_rt.policies.h2o import H2OCache
from infinigen_rt.policies.infinigen import InfinigenCache
from infinigen_rt.policies.int4 import Int4Cache
from infinigen_rt.policies.offload import OffloadCache
from infinigen_rt.policies.options import KVOptions
from infinigen_rt.policies.oracle import OracleCache

POLICIES = {
    "full": lambda e, b, n: DenseCache(e.cfg, b, n, e.device, e.dtype),
    "offload": lambda e, b, n: OffloadCache(e.cfg, b, n, e.device, e.dtype, e.kv),
    "infinigen": lambda e, b, n: InfinigenCache(
        e.cfg, b, n, e.device, e.dtype, e.kv, e.model, e.infinigen_tensors, e.infinigen_defaults
    ),
    "h2o": lambda e, b, n: H2OCache(e.cfg, b, n, e.device, e.dtype, e.kv),
    "int4": lambda e, b, n: Int4Cache(e.cfg, b, n, e.device, e.dtype, e.kv),
    # eval only: the true top-k per query head (an upper bound, a mask over dense attention)
    "oracle": lambda e, b, n: OracleCache(e.cfg, b, n, e.device, e.dtype, e.kv, e.dense_layers()),
}
RUNTIME_POLICIES = ("full", "offload", "infinigen", "h2o", "int4")

__all__ = ["POLICIES", "RUNTIME_POLICIES", "KVOptions"]
