"""KV policies by name: how one engine treats KV. A policy is one KVCache subclass; everything a caller needs
(its options, what it reports, its memory needs, whether it speculates) is on the class, so adding a policy
adds an entry here and touches no model code and no caller."""

from __future__ import annotations

from infinigen_rt.cache import DenseCache, KVCache, KVReport
from infinigen_rt.policies.h2o import H2OCache
from infinigen_rt.policies.infinigen import InfinigenCache
from infinigen_rt.policies.int4 import Int4Cache
from infinigen_rt.policies.offload import OffloadCache
from infinigen_rt.policies.options import KVOptions
from infinigen_rt.policies.oracle import OracleCache

POLICIES: dict[str, type[KVCache]] = {
    cls.name: cls for cls in (DenseCache, OffloadCache, InfinigenCache, H2OCache, Int4Cache, OracleCache)
}
# oracle: eval only, the true top-k per query head (an upper bound, a mask over dense attention)
RUNTIME_POLICIES = tuple(name for name, cls in POLICIES.items() if cls.runtime)

__all__ = ["POLICIES", "RUNTIME_POLICIES", "KVOptions", "KVReport"]
