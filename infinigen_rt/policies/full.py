"""`full`: all KV resident on the compute device in preallocated buffers: the baseline every other policy is
measured against (policies.BASELINE), and the exact prefill that several policies' caches can share."""

from __future__ import annotations

import torch

from infinigen_rt.config import ModelConfig
from infinigen_rt.kv.cache import KVCache, KVReport, causal_mask, kv_layers
from infinigen_rt.kv.store import Selector


class DenseCache(KVCache):
    """All KV resident on the compute device in preallocated buffers (the `full` policy)."""

    name = "full"

    @classmethod
    def build(cls, engine, opts, batch, max_len, pages=None, prefetch=None):
        return cls(engine.cfg, batch, max_len, engine.device, engine.dtype)

    @classmethod
    def selector(cls, engine, opts, prefetch=None):
        """Every layer's KV on the device (not a subclass's, which attends otherwise: h2o has a selector of its own,
        oracle none)."""
        return Selector(kv_layers(engine.cfg), []) if cls is DenseCache else None

    @classmethod
    def kv_bytes(cls, engine, opts, tokens, dtype_bytes):
        kv = tokens * 2 * engine.cfg.head_dim * dtype_bytes * len(kv_layers(engine.cfg))
        return kv, 0, kv

    def report(self) -> KVReport:
        return KVReport(kv_fetched_share=1.0, kv_attended_share=1.0)

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype, layers: list[int] | None = None):
        """`layers`: the layers it holds buffers for (None: every layer a policy holds, `kv_layers`); the others'
        KV lives elsewhere."""
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        held = set(kv_layers(cfg) if layers is None else layers)
        n = cfg.num_hidden_layers
        self.k = [torch.zeros(shape, device=device, dtype=dtype) if i in held else None for i in range(n)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) if i in held else None for i in range(n)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # real (non-pad) slots
        self.max_len = max_len
        self.length = 0  # slots filled, the same for every sequence (left padding aligns the ends)
        self.start = 0
        self.padded = False  # some slot holds padding (then attention needs a mask)
        self._mask = None

    def begin(self, valid: torch.Tensor | None, positions: torch.Tensor) -> None:
        s = positions.shape[1]
        if self.length + s > self.max_len:
            raise ValueError(f"cache holds {self.max_len} tokens, asked for {self.length + s}")
        self.start, self.length = self.length, self.length + s
        self.valid[:, self.start : self.length] = True if valid is None else valid
        self._mask = None
        if s > 1 and valid is not None:  # a decode step brings no padding (see KVCache.begin): no host sync then
            self.padded = self.padded or not bool(valid.all())
        # no mask at all: a first prefill without padding (causal) or a decode step over padding-free slots
        self.unmasked = not self.padded and (s == 1 or self.start == 0)

    @property
    def mask(self) -> torch.Tensor:
        """[B, 1, S, T] bool: causal over the real slots (built when a policy or a padded batch asks)."""
        if self._mask is None:
            self._mask = causal_mask(self.valid[:, : self.length], self.start)
        return self._mask

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.k[layer][:, :, self.start : self.length] = k
        self.v[layer][:, :, self.start : self.length] = v
        mask = None if self.unmasked else self.mask
        return self.k[layer][:, :, : self.length], self.v[layer][:, :, : self.length], mask
