"""`int4`: KV stored in the host pool quantized to 4 bits (asymmetric, groups of 64 along head_dim),
fetched in full and dequantized on the device (FlexGen's compression baseline).

Quantization happens on the device before the copy down, dequantization after the copy up, so the bytes
counted are the packed bytes that really move (half a byte per value plus fp16 scale and minimum per group).
A request's own cache keeps them in an Int4Pool; the batch's KV store (kv/store.py) in the same host tensors,
through Int4Selector.
"""

from __future__ import annotations

import torch

from infinigen_rt.kv.cache import KVReport, kv_layers
from infinigen_rt.kv.pool import KVPool, copy_rows
from infinigen_rt.kv.quant import code_bytes, dequantize, quantize
from infinigen_rt.kv.store import Evicting, Selector
from infinigen_rt.policies.offload import OffloadCache

GROUP = 64


def group_size(head_dim: int) -> int:
    return GROUP if head_dim % GROUP == 0 else head_dim


def fetched_share(head_dim: int) -> float:
    """kv_fetched_share: every row is fetched, at 4 bits: its packed bytes' share of those 16-bit KV would move."""
    return round(code_bytes(head_dim, group_size(head_dim), 4) / (2 * head_dim), 6)


class Codes:
    """How int4 keeps one KV head's keys (or values) of a token in host memory (a layout of the store's, as store.Plain
    is): the packed codes [D / 2] (uint8) in the tensor of the side's name, an fp16 scale and minimum per group in
    `_scale` and `_min` ones. A request's Int4Pool and the store's Int4Selector keep the same tensors, so in a paged
    pool they share its buffers."""

    def __init__(self, head_dim: int, dtype: torch.dtype):
        self.group, self.dtype = group_size(head_dim), dtype  # dtype: what decode gives
        groups = head_dim // self.group
        self.parts = [("", head_dim // 2, torch.uint8), ("_scale", groups, torch.float16),
                      ("_min", groups, torch.float16)]  # fmt: skip

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return quantize(x, self.group)

    def decode(self, parts) -> torch.Tensor:
        return dequantize(*parts, self.group, self.dtype)


class Int4Pool(KVPool):
    """A KVPool whose rows are `Codes`: the packed 4-bit codes in its k and v, the per-group scale and minimum in
    slot-major tensors of their own ([S, B, Hkv, groups], fp16), moved with the rows."""

    def __init__(self, batch, n_kv, head_dim, slots, dtype, device, eviction="counter", window=0, pages=None, layer=0):
        self.codes = Codes(head_dim, dtype)
        (_, width, code), *beside = self.codes.parts
        super().__init__(batch, n_kv, width, slots, code, device, eviction, window, pages, layer)
        self.group, self.out_dtype = self.codes.group, dtype
        # each side's host tensors in the order of the parts: codes, scale, minimum
        self.parts = {side: [x] + [self.buffer(side + name, (n_kv, w), t) for name, w, t in beside]
                      for side, x in (("k", self.k), ("v", self.v))}  # fmt: skip

    @property
    def row_bytes(self) -> int:
        return 2 * sum(w * t.itemsize for _, w, t in self.codes.parts)

    def store(self, f, k, v):
        for side, x in (("k", k), ("v", v)):
            for buf, part in zip(self.parts[side], self.codes.encode(x), strict=True):
                self.write(buf, f, part)

    def gather(self, slots, ok=None, extra: int = 0, out=None):
        assert out is None, "int4 rows are dequantized into new tensors"
        b, h, n = slots.shape
        flat = self.flat_rows(slots)
        got = {"k": [], "v": []}
        for (_, w, t), src_k, src_v in zip(self.codes.parts, self.parts["k"], self.parts["v"], strict=True):
            out_k, out_v = (torch.empty(b, h, n + extra, w, dtype=t, device=self.device) for _ in "kv")
            copy_rows(src_k, src_v, flat, ok, out_k, out_v, self.kernel)
            got["k"].append(out_k)
            got["v"].append(out_v)
        return self.codes.decode(got["k"]), self.codes.decode(got["v"])


class Int4Selector(Selector):
    """int4 in the batch's KV store: every layer pooled and every row read, as offload's, its host rows `Codes`. A
    step's new rows are quantized on the device once, for the whole batch, before they go down; a layer's gathered
    codes come up (on the side stream, a layer ahead, on a GPU), the new tokens' codes go into their last rows, and
    they are dequantized once: the new tokens attend to themselves as stored, as a request's own cache has them."""

    layout = Codes

    def report(self, rid: int, r: KVReport) -> None:
        r.kv_fetched_share = fetched_share(self.store.head_dim)


class Int4Cache(OffloadCache):
    name = "int4"
    pool_class = Int4Pool
    dense_prefill = False  # the prompt attends over its own quantized KV

    @classmethod
    def selector(cls, engine, opts, prefetch=None):
        """Every layer pooled as codes, every row read (not a subclass's), under the capacity if any."""
        if cls is not Int4Cache:
            return None
        return Int4Selector([], kv_layers(engine.cfg), prefetch, Evicting.of(opts))

    @classmethod
    def kv_bytes(cls, engine, opts, tokens, dtype_bytes):
        d = engine.cfg.head_dim
        return cls.pool_bytes(engine, tokens, 2 * (d // 2 + 4 * (d // group_size(d))), resident=0)

    def report(self) -> KVReport:
        r = super().report()
        r.kv_fetched_share = fetched_share(self.cfg.head_dim)
        return r

    def update(self, layer, q, k, v):
        # the current tokens attend to themselves exactly as stored: quantized, like every earlier token
        keys, values, mask = super().update(layer, q, k, v)
        s = k.shape[2]
        g = self.pools[layer].group
        keys[:, :, -s:] = dequantize(*quantize(k, g), g, k.dtype)
        values[:, :, -s:] = dequantize(*quantize(v, g), g, v.dtype)
        return keys, values, mask
