"""`int4`: KV stored in the host pool quantized to 4 bits (asymmetric, groups of 64 along head_dim),
fetched in full and dequantized on the device (FlexGen's compression baseline).

Quantization happens on the device before the copy down, dequantization after the copy up, so the bytes
counted are the packed bytes that really move (half a byte per value plus fp16 scale and minimum per group).
"""

from __future__ import annotations

import torch

from infinigen_rt.kv.cache import KVReport
from infinigen_rt.kv.pool import KVPool, copy_rows
from infinigen_rt.kv.quant import dequantize, quantize
from infinigen_rt.policies.offload import OffloadCache

GROUP = 64


def group_size(head_dim: int) -> int:
    return GROUP if head_dim % GROUP == 0 else head_dim


class Int4Pool(KVPool):
    """A KVPool whose rows are packed 4-bit codes, with per-group scale and minimum in slot-major tensors of their
    own ([S, B, Hkv, groups], fp16), moved with the rows."""

    def __init__(self, batch, n_kv, head_dim, slots, dtype, device, eviction="counter", window=0, pages=None, layer=0):
        super().__init__(batch, n_kv, head_dim // 2, slots, torch.uint8, device, eviction, window, pages, layer)
        self.group, self.out_dtype = group_size(head_dim), dtype
        n_groups = head_dim // self.group
        names = ("k_scale", "k_min", "v_scale", "v_min")
        self.meta = {name: self.buffer(name, (n_kv, n_groups), torch.float16) for name in names}

    @property
    def row_bytes(self) -> int:
        return 2 * (self.k.shape[-1] + 2 * 2 * self.meta["k_scale"].shape[-1])

    def store(self, f, k, v):
        kq, ks, kl = quantize(k, self.group)
        vq, vs, vl = quantize(v, self.group)
        super().store(f, kq, vq)
        for name, x in (("k_scale", ks), ("k_min", kl), ("v_scale", vs), ("v_min", vl)):
            self.write(self.meta[name], f, x)

    def gather(self, slots, ok=None, extra: int = 0, out=None):
        assert out is None, "int4 rows are dequantized into new tensors"
        kq, vq = super().gather(slots, ok, extra)
        b, h, n = slots.shape
        flat = self.flat_rows(slots)
        m = {}
        for a, c in (("k_scale", "k_min"), ("v_scale", "v_min")):
            shape = (b, h, n + extra, self.meta[a].shape[-1])
            m[a] = torch.empty(shape, dtype=torch.float16, device=self.device)
            m[c] = torch.empty_like(m[a])
            copy_rows(self.meta[a], self.meta[c], flat, ok, m[a], m[c], self.kernel)
        k = dequantize(kq, m["k_scale"], m["k_min"], self.group, self.out_dtype)
        v = dequantize(vq, m["v_scale"], m["v_min"], self.group, self.out_dtype)
        return k, v

class Int4Cache(OffloadCache):
    name = "int4"
    pool_class = Int4Pool
    dense_prefill = False  # the prompt attends over its own quantized KV

    @classmethod
    def kv_bytes(cls, engine, opts, tokens, dtype_bytes):
        d = engine.cfg.head_dim
        return cls.pool_bytes(engine, tokens, 2 * (d // 2 + 4 * (d // group_size(d))), resident=0)

    def report(self) -> KVReport:
        # every token is fetched, at 4 bits: its share of the bytes fp16 KV would move
        r = super().report()
        pool = next(p for p in self.pools if p is not None)
        r.kv_fetched_share = round(pool.row_bytes / (2 * self.cfg.head_dim * 2), 6)
        return r

    def update(self, layer, q, k, v):
        # the current tokens attend to themselves exactly as stored: quantized, like every earlier token
        keys, values, mask = super().update(layer, q, k, v)
        s = k.shape[2]
        g = self.pools[layer].group
        keys[:, :, -s:] = dequantize(*quantize(k, g), g, k.dtype)
        values[:, :, -s:] = dequantize(*quantize(v, g), g, v.dtype)
        return keys, values, mask
