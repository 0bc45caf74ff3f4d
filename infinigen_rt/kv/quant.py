"""Low-bit codes for KV rows: asymmetric, in groups along head_dim, `bits` 4 or 2 packed into bytes, with an fp16
scale and minimum per group. The `int4` policy stores its host rows this way; `infinigen` can keep its
speculation keys this way on the compute device (every column at a few bits instead of a few columns in full)."""

from __future__ import annotations

import torch


def quantize(x: torch.Tensor, group: int, bits: int = 4):
    """x: [..., D] -> (packed uint8 [..., D * bits / 8], scale and min fp16 [..., D / group])."""
    per = 8 // bits  # codes per byte
    g = x.float().unflatten(-1, (-1, group))  # [..., n_groups, group]
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    top = 2**bits - 1
    scale = ((hi - lo) / top).clamp(min=1e-8)
    q = torch.round((g - lo) / scale).clamp(0, top).to(torch.uint8).flatten(-2)
    packed = q[..., 0::per]
    for i in range(1, per):
        packed = packed | (q[..., i::per] << (bits * i))
    return packed, scale.squeeze(-1).half(), lo.squeeze(-1).half()


def dequantize(packed, scale, lo, group: int, dtype, bits: int = 4) -> torch.Tensor:
    """The inverse of `quantize` (up to its rounding): [..., D] in `dtype`. The float32 values are scaled in place:
    one float32 copy of the rows at a time (int4's whole layer for a batch: 0.5 GiB at 4 x 32k, Llama-3.1-8B)."""
    per, mask = 8 // bits, 2**bits - 1
    q = torch.stack([(packed >> (bits * i)) & mask for i in range(per)], dim=-1).flatten(-2)  # [..., D]
    g = q.unflatten(-1, (-1, group)).float()
    del q
    g.mul_(scale.float()[..., None]).add_(lo.float()[..., None])
    return g.flatten(-2).to(dtype)


def code_bytes(head_dim: int, group: int, bits: int) -> int:
    """Bytes of one row of `head_dim` values: the packed codes and an fp16 scale and minimum per group."""
    return head_dim * bits // 8 + 4 * (head_dim // group)
