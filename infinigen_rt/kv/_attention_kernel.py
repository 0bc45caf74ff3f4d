"""Decode attention over paged KV (see attention.py, which imports this module only when a GPU attends).

One program per (sequence, KV head, split of the context): it reads its split's keys and values through the
sequence's block table, once, for every query head of the KV head's group, and leaves the split's running max, sum
and weighted values; attention.py merges the splits. Splitting the context keeps a GPU busy at batch 1 (Llama-3.1-8B
has 8 KV heads: 8 programs would leave 124 of an H100's 132 SMs idle). The split is a power of two (a compile-time
loop: a kernel per size, about ten over a 128k context); the lengths and the split count change every step and are
not specialised (see _gather_kernel.py).

A tile of TOKENS keys and values at a time, the group's query heads padded to 16 rows (the least a tensor-core
product takes): the scores and the weighted values are matrix products (`tl.dot`), which Triton pipelines across the
loop (the next tiles' rows in flight while this one computes: cp.async on sm_80 and sm_90); the scores, the softmax
and the sums in float32, the weights rounded to the rows' dtype for their product with the values. Products summed in
registers ([G, 16, D], 16 keys a turn, as the kernel the H100 profiled did) held a few KiB in flight a program and
each turn's loads waited for the last turn's sums: 19 % of HBM's rate."""

import triton
import triton.language as tl

from infinigen_rt.kv._triton import interpreter_loop_bounds

interpreter_loop_bounds()  # a split's loop runs to its own tokens, in Triton's interpreter too


@triton.jit(do_not_specialize=["n_splits", "max_blocks"])
def paged_decode_kernel(
    q, k, v, table, lengths, out_m, out_l, out_acc, scale, n_splits, max_blocks, n_slots,
    HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK: tl.constexpr, TOKENS: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # q [B, HKV, G, D]; k, v [HKV, n_slots, D] (slot = block * BLOCK + offset); table [B, max_blocks]; lengths [B].
    # PRECISION: the products' ("ieee" for float32 rows: no TF32 rounding; 16-bit rows multiply exactly either way)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(lengths + b)
    lo = s * SPLIT
    hi = tl.minimum(lo + SPLIT, n)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gd = (g[:, None] < G) & (d[None, :] < D)
    qv = tl.load(q + ((b * HKV + h) * G + g[:, None]).to(tl.int64) * D + d[None, :], mask=gd, other=0)
    qv = qv.to(k.dtype.element_ty)
    k_head = k + h.to(tl.int64) * n_slots * D  # this head's rows
    v_head = v + h.to(tl.int64) * n_slots * D
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    acc_l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for t0 in range(0, hi - lo, TOKENS):  # the split's own tokens (the last split's may be fewer)
        t = lo + t0 + tl.arange(0, TOKENS)
        live = t < hi
        blk = tl.load(table + b.to(tl.int64) * max_blocks + t // BLOCK, mask=live, other=0).to(tl.int64)
        row = (blk * BLOCK + t % BLOCK) * D
        kv_mask = live[:, None] & (d[None, :] < D)
        kt = tl.load(k_head + row[:, None] + d[None, :], mask=kv_mask, other=0)  # [TOKENS, D_PAD]
        vt = tl.load(v_head + row[:, None] + d[None, :], mask=kv_mask, other=0)
        sc = tl.dot(qv, tl.trans(kt), input_precision=PRECISION) * scale  # [G_PAD, TOKENS], float32
        sc = tl.where(live[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split with nothing yet: no NaN from inf - inf
        p = tl.exp(sc - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        acc_l = acc_l * alpha + tl.sum(p, 1)
        m = m_new
    at = ((b * HKV + h) * n_splits + s).to(tl.int64) * G + g
    tl.store(out_m + at, m, mask=g < G)
    tl.store(out_l + at, acc_l, mask=g < G)
    tl.store(out_acc + at[:, None] * D + d[None, :], acc, mask=gd)


@triton.jit(do_not_specialize=["n_splits"])
def merge_splits_kernel(m, sums, acc, out, n_splits, G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                        S_PAD: tl.constexpr):  # fmt: skip
    # program (sequence, KV head, query head of the group): its splits' (max, sum, weighted values) as one softmax
    bh = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    live = s < n_splits
    at = (bh * n_splits + s).to(tl.int64) * G + g
    ms = tl.load(m + at, mask=live, other=float("-inf"))
    ls = tl.load(sums + at, mask=live, other=0.0)
    top = tl.max(ms, 0)
    w = tl.where(live, tl.exp(ms - top), 0.0)  # a split past the sequence's length (m = -inf): weight 0
    acc_s = tl.load(acc + at[:, None] * D + d[None, :], mask=live[:, None] & (d[None, :] < D), other=0.0)
    y = tl.sum(acc_s * w[:, None], 0) / tl.sum(ls * w, 0)
    tl.store(out + (bh * G + g).to(tl.int64) * D + d, y.to(out.dtype.element_ty), mask=d < D)
