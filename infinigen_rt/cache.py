"""KV caches: what the attention layer asks for keys and values.

Per forward pass the model calls `cache.begin(valid, positions)`; every attention layer calls
`cache.observe(layer, x)` with its normalised input, then `k, v, mask = cache.update(layer, q, k, v)`
and attends over what it gets back; the model ends with `cache.end()`. Where keys and values live,
which of them a layer sees, and what moves where is the cache's business: every policy (full, offload,
infinigen, h2o, int4) implements these calls and no model code knows which one it talks to.
"""

from __future__ import annotations

import torch

from infinigen_rt.config import ModelConfig


class KVCache:
    """The interface. Keys and values are per KV head, never expanded to query heads."""

    def begin(self, valid: torch.Tensor, positions: torch.Tensor) -> None:
        """Start a forward pass over S new tokens; valid: [B, S] bool (False = left padding); positions: [B, S].
        A decode step (S == 1) passes valid all True: padding only ever comes with a prompt."""
        raise NotImplementedError

    def observe(self, layer: int, x: torch.Tensor) -> None:
        """Layer `layer`'s normalised attention input x: [B, S, hidden] (InfiniGen speculates from it)."""

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k, v: [B, Hkv, S, D] (q: [B, H, S, D], post-RoPE); return (keys, values, mask) to attend over.

        keys/values: [B, Hkv, T, D]; mask: [B, 1, S, T] bool, True where a query may attend, or None for
        plain causal attention among the new tokens only (T == S, no padding: the fused kernels' fast path)."""
        raise NotImplementedError

    def end(self) -> None:
        """The forward pass is over (policies enforce capacity, advance counters)."""

    def close(self) -> None:
        """The cache's work is over: release what it holds besides memory (a worker thread, pinned pages)."""


class DenseCache(KVCache):
    """All KV resident on the compute device in preallocated buffers (the `full` policy)."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype, layers: int | None = None):
        """`layers`: buffers for the first `layers` layers only (the others live elsewhere)."""
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        n = cfg.num_hidden_layers if layers is None else layers
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # real (non-pad) slots
        self.max_len = max_len
        self.length = 0  # slots filled, the same for every sequence (left padding aligns the ends)
        self.start = 0
        self.padded = False  # some slot holds padding (then attention needs a mask)
        self._mask = None

    def begin(self, valid: torch.Tensor, positions: torch.Tensor) -> None:
        s = valid.shape[1]
        if self.length + s > self.max_len:
            raise ValueError(f"cache holds {self.max_len} tokens, asked for {self.length + s}")
        self.start, self.length = self.length, self.length + s
        self.valid[:, self.start : self.length] = valid
        self._mask = None
        if s > 1:  # a decode step brings no padding (see KVCache.begin): no host sync then
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


def causal_mask(valid: torch.Tensor, start: int) -> torch.Tensor:
    """valid: [B, T] bool over all slots; queries are slots start..T-1. Returns [B, 1, S, T] bool.

    A padding query attends to itself only, so its row is never empty (an empty row gives NaN
    outputs, and NaN keys/values would poison later rows even where masked out)."""
    t = valid.shape[1]
    q_pos = torch.arange(start, t, device=valid.device)[:, None]  # [S, 1]
    k_pos = torch.arange(t, device=valid.device)[None, :]  # [1, T]
    causal = k_pos <= q_pos  # [S, T]
    mask = causal[None] & valid[:, None, :]  # [B, S, T]
    mask = mask | (k_pos == q_pos)[None]
    return mask[:, None]
