"""Decode attention for a batch whose KV lives in paged device memory: one query token per sequence, each sequence
of its own length, its keys and values in the blocks of its table (the one KV store for the batch: every running
request's rows in the same buffers, so a layer attends once for the whole batch, not once per request).

`paged_decode` runs the Triton kernels on a GPU (_attention_kernel.py: the context split across programs, then the
splits merged, one program per query head; `merge` is the merge's definition); `paged_decode_reference` is its
definition in torch ops (the rows gathered by table, then one masked SDPA), which the kernels are tested against
and which a CPU runs."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from infinigen_rt.kv.kernels import check, gpu_op

TOKENS = 64  # keys a program scores at a time (a tile of keys and one of values per loop turn)
WIDE_TOKENS = 32  # at head_dim 256 (Gemma 3): the same bytes a tile
MIN_SPLIT = 256  # the fewest tokens a program reads (fewer: merging costs more than the parallelism gains)
TARGET_PROGRAMS = 264  # two waves of an H100's 132 SMs


def splits(batch: int, hkv: int, longest: int) -> tuple[int, int]:
    """(tokens per split, a power of two; splits) so that batch x hkv x splits programs about fill the device."""
    want = max(1, math.ceil(TARGET_PROGRAMS / (batch * hkv)))
    need = max(MIN_SPLIT, math.ceil(longest / want))
    split = 1 << (need - 1).bit_length()  # the next power of two
    return split, max(1, math.ceil(longest / split))


def kernel_meta(g: int, d: int, dtype: torch.dtype, block: int, split: int) -> dict:
    """The kernel's compile-time arguments for a group of g query heads of head_dim d over rows of `dtype`."""
    import triton

    return dict(G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, D_PAD=triton.next_power_of_2(d), BLOCK=block,
                TOKENS=TOKENS if d <= 128 else WIDE_TOKENS, SPLIT=split,
                PRECISION="ieee" if dtype == torch.float32 else "tf32")  # fmt: skip


@gpu_op("paged_decode(Tensor q, Tensor k, Tensor v, Tensor table, Tensor lengths, int block, int longest, "
        "float? scale=None) -> Tensor")
def paged_decode(q, k, v, table, lengths, block: int, longest: int, scale: float | None = None) -> torch.Tensor:
    """q [B, H, 1, D] over the keys and values of each sequence: k, v [Hkv, slots, D] (slot = block number x
    `block` + offset; each head's rows contiguous), table [B, max_blocks] int32 (sequence b's token t is in block
    table[b, t // block]), lengths [B] int32 on the device; `longest`: the largest length, known on the host.
    Returns [B, H, 1, D] in q's dtype."""
    check(q.dim() == 4 and q.shape[2] == 1 and k.dim() == 3 and k.shape == v.shape and k.shape[2] == q.shape[3]
          and q.shape[1] % k.shape[0] == 0, "paged_decode: q [B, H, 1, D], k and v [Hkv, slots, D], Hkv dividing H")
    check(table.dim() == 2 and table.shape[0] == q.shape[0] and lengths.shape == (q.shape[0],),
          "paged_decode: table [B, blocks], lengths [B]")  # fmt: skip
    b, h, _, d = q.shape
    hkv = k.shape[0]
    g = h // hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    if q.device.type != "cuda":
        return paged_decode_reference(q, k, v, table, lengths, block, longest, scale)
    import triton

    from infinigen_rt.kv._attention_kernel import merge_splits_kernel, paged_decode_kernel

    split, n = splits(b, hkv, longest)
    qg = q.reshape(b, hkv, g, d).contiguous()
    out_m = torch.empty(b, hkv, n, g, dtype=torch.float32, device=q.device)
    out_l = torch.empty_like(out_m)
    out_acc = torch.empty(b, hkv, n, g, d, dtype=torch.float32, device=q.device)
    with torch.cuda.device(q.device):
        paged_decode_kernel[(b, hkv, n)](
            qg, k, v, table, lengths, out_m, out_l, out_acc, scale, n, table.shape[1], k.shape[1], HKV=hkv,
            **kernel_meta(g, d, k.dtype, block, split),
        )  # fmt: skip
        out = torch.empty(b, hkv, g, d, dtype=q.dtype, device=q.device)
        merge_splits_kernel[(b * hkv, g)](out_m, out_l, out_acc, out, n, G=g, D=d, D_PAD=triton.next_power_of_2(d),
                                          S_PAD=max(2, triton.next_power_of_2(n)))  # fmt: skip
    return out.reshape(b, h, 1, d)


def merge(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:  # noqa: E741
    """The splits' running max m and sum l [B, Hkv, S, G] and weighted values acc [B, Hkv, S, G, D] as one softmax
    over all of them: [B, Hkv, G, D]. A split past a sequence's length holds nothing (m = -inf): weight 0."""
    top = m.amax(2, keepdim=True)
    w = torch.exp(m - top)  # [B, Hkv, S, G]
    return (acc * w[..., None]).sum(2) / (l * w).sum(2)[..., None]


def decode_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """One query token per sequence, q [B, H, 1, D], over keys and values [B, Hkv, n, D] (mask: None, or [B, Hkv or
    1, 1, n] bool, True where a row counts, the same for a KV head's query heads): [B, H, 1, D]. On a CPU a KV
    head's G query heads go to SDPA as G query positions over its own keys ([B, Hkv, G, D], no causal mask), not
    as heads over keys repeated G times (enable_gqa): the same sums, 10-20 % faster at SmolLM2's shapes (9 heads
    on 3, 1k-8k rows, batch 1 and 8, one thread). A GPU's SDPA takes the heads as they are."""
    b, h, _, d = q.shape
    hkv = keys.shape[1]
    if q.device.type != "cpu" or h == hkv or q.shape[2] != 1:
        if mask is not None and mask.shape[1] not in (1, h):
            mask = mask.repeat_interleave(h // hkv, 1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=h != hkv)
    if mask is not None and mask.dim() == 4 and mask.shape[1] not in (1, hkv):
        raise ValueError(f"a decode mask over {mask.shape[1]} heads for {hkv} KV heads")
    out = F.scaled_dot_product_attention(q.view(b, hkv, h // hkv, d), keys, values, attn_mask=mask)
    return out.view(b, h, 1, d)


def paged_decode_reference(q, k, v, table, lengths, block: int, longest: int, scale: float) -> torch.Tensor:
    """`paged_decode` in torch ops: each sequence's first `longest` token slots looked up in its table, their rows
    gathered ([B, Hkv, longest, D]), and one SDPA with the positions past each length masked out."""
    b, h, _, d = q.shape
    t = torch.arange(longest, device=table.device)
    slots = (table[:, t // block].long() * block + t % block).reshape(-1)  # [B x longest]
    # [B, Hkv, longest, D]: index_select on the flat slots (several times faster on a CPU than indexing by [B, T])
    keys, values = (x.index_select(1, slots).unflatten(1, (b, longest)).transpose(0, 1) for x in (k, v))
    mask = (t[None, :] < lengths[:, None].long())[:, None, None, :]  # [B, 1, 1, longest]
    return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale,
                                          enable_gqa=keys.shape[1] != h)  # fmt: skip


def run_kernel_on_cpu(q, k, v, table, lengths, block: int, longest: int, scale: float | None = None) -> torch.Tensor:
    """The Triton kernel on CPU tensors (TRITON_INTERPRET=1): what tests compare with the reference."""

    from infinigen_rt.kv._attention_kernel import paged_decode_kernel

    check(q.dim() == 4 and q.shape[2] == 1 and k.dim() == 3 and k.shape == v.shape and k.shape[2] == q.shape[3]
          and q.shape[1] % k.shape[0] == 0, "paged_decode: q [B, H, 1, D], k and v [Hkv, slots, D], Hkv dividing H")
    check(table.dim() == 2 and table.shape[0] == q.shape[0] and lengths.shape == (q.shape[0],),
          "paged_decode: table [B, blocks], lengths [B]")  # fmt: skip
    b, h, _, d = q.shape
    hkv = k.shape[0]
    g = h // hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    split, n = splits(b, hkv, longest)
    out_m = torch.empty(b, hkv, n, g, dtype=torch.float32)
    out_l = torch.empty_like(out_m)
    out_acc = torch.empty(b, hkv, n, g, d, dtype=torch.float32)
    paged_decode_kernel[(b, hkv, n)](
        q.reshape(b, hkv, g, d).contiguous(), k, v, table, lengths, out_m, out_l, out_acc, scale, n,
        table.shape[1], k.shape[1], HKV=hkv, **kernel_meta(g, d, k.dtype, block, split),
    )  # fmt: skip
    return merge(out_m, out_l, out_acc).reshape(b, h, 1, d).to(q.dtype)
