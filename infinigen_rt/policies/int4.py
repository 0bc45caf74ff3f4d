"""`int4`: KV stored in the host pool quantized to 4 bits (asymmetric, groups of 64 along head_dim),
fetched in full and dequantized on the device (FlexGen's compression baseline).

Quantization happens on the device before the copy down, dequantization after the copy up, so the bytes
counted are the packed bytes that really move (half a byte per value plus fp16 scale and minimum per group).
The batch's KV store (kv/store.py) keeps them in its host buffers as `Codes` say (Int4Selector).
"""

from __future__ import annotations

import torch

from infinigen_rt.kv.cache import KVReport
from infinigen_rt.kv.evict import Evicting
from infinigen_rt.kv.quant import code_bytes, dequantize, quantize
from infinigen_rt.policies.base import Selector, kv_layers
from infinigen_rt.policies.offload import Offload

GROUP = 64


def group_size(head_dim: int) -> int:
    return GROUP if head_dim % GROUP == 0 else head_dim


def fetched_share(head_dim: int) -> float:
    """kv_fetched_share: every row is fetched, at 4 bits: its packed bytes' share of those 16-bit KV would move."""
    return round(code_bytes(head_dim, group_size(head_dim), 4) / (2 * head_dim), 6)


class Codes:
    """How int4 keeps one KV head's keys (or values) of a token in host memory (a layout of the store's, as store.Plain
    is): the packed codes [D / 2] (uint8) in the tensor of the side's name, an fp16 scale and minimum per group in
    `_scale` and `_min` ones. The store keeps each part in host buffers of its own, moved with the rows."""

    def __init__(self, head_dim: int, dtype: torch.dtype):
        self.group, self.dtype = group_size(head_dim), dtype  # dtype: what decode gives
        groups = head_dim // self.group
        self.parts = [("", head_dim // 2, torch.uint8), ("_scale", groups, torch.float16),
                      ("_min", groups, torch.float16)]  # fmt: skip

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return quantize(x, self.group)

    def decode(self, parts) -> torch.Tensor:
        return dequantize(*parts, self.group, self.dtype)


class Int4Selector(Selector):
    """int4 in the batch's KV store: every layer pooled and every row read, as offload's, its host rows `Codes`. A
    step's new rows are quantized on the device once, for the whole batch, before they go down; a layer's gathered
    codes come up (on the side stream, a layer ahead, on a GPU), the new tokens' codes go into their last rows, and
    they are dequantized once: the new tokens attend to themselves as stored, as they are stored."""

    layout = Codes

    def report(self, rid: int, r: KVReport) -> None:
        r.kv_fetched_share = fetched_share(self.store.head_dim)


class Int4(Offload):
    name = "int4"
    dense_prefill = False  # the prompt attends over its own quantized KV

    @classmethod
    def selector(cls, engine, opts, prefetch=None):
        """Every layer pooled as codes, every row read, under the capacity if any."""
        return Int4Selector([], kv_layers(engine.cfg), prefetch, Evicting.of(opts))

    @classmethod
    def kv_bytes(cls, engine, opts, tokens, dtype_bytes):
        d = engine.cfg.head_dim
        return cls.pool_bytes(engine, tokens, 2 * (d // 2 + 4 * (d // group_size(d))), resident=0)
